//! One connection's calls return typed errors: the end of the stream after `quiesced` is
//! [`ChannelError::Closed`] and marks the connection down; other endings name what happened, in
//! the words the coordinator shows.
use super::*;

/// A registered connection of pid 1 (job 7) and the channel's end of it.
fn conn_pair() -> (Conn, UnixStream) {
    let (agent, channel) = UnixStream::pair().unwrap();
    let (r, w) = agent.into_split();
    let slots = Arc::new(JobSlots::default());
    let conn = Conn {
        pid: 1,
        channel: 7,
        down: false,
        drained: true,
        wants: Wants::All,
        io: Some((CappedLines::new(BufReader::new(r)), w)),
        _slot: slots.take(7, 1).unwrap(),
    };
    (conn, channel)
}

async fn say(s: &mut UnixStream, m: &ToAgent) {
    let mut line = serde_json::to_vec(m).unwrap();
    line.push(b'\n');
    s.write_all(&line).await.unwrap();
}

#[test]
fn the_end_of_the_stream_is_closed_and_after_quiesced_marks_the_connection_down() {
    runtime().block_on(async {
        let (mut conn, channel) = conn_pair();
        drop(channel);
        let e = conn
            .reply(Duration::from_secs(1), MAX_LINE)
            .await
            .unwrap_err();
        assert!(matches!(e, ChannelError::Closed), "{e:?}");
        assert_eq!(
            e.to_string(),
            "the process closed its channel (did it exit?)"
        );

        let (mut conn, channel) = conn_pair();
        drop(channel);
        conn.closes_after_quiesced(Duration::from_secs(1))
            .await
            .unwrap();
        assert!(conn.down && !conn.drained);
    });
}

#[test]
fn a_channel_that_stays_or_speaks_after_quiesced_is_not_down() {
    runtime().block_on(async {
        let (mut conn, _channel) = conn_pair();
        let e = conn
            .closes_after_quiesced(Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, ChannelError::NotDisconnected(inner) if matches!(**inner, ChannelError::Timeout(_))),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "quiesced but did not disconnect: no answer within 50ms");
        assert!(!conn.down);

        let (mut conn, mut channel) = conn_pair();
        say(&mut channel, &ToAgent::Resumed).await;
        let e = conn
            .closes_after_quiesced(Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(e, ChannelError::SaidAfterQuiesced(_)), "{e:?}");
        assert_eq!(e.to_string(), "quiesced but then said Resumed");
        assert!(!conn.down && conn.drained);
    });
}

/// A `failed` answer carries the channel's words; one from a library that cannot read the
/// command is told apart from the others.
#[test]
fn a_failed_answer_is_the_channels_own_words() {
    runtime().block_on(async {
        let (mut conn, mut channel) = conn_pair();
        let error = "unreadable command: unreadable line \"{}\"".to_string();
        say(
            &mut channel,
            &ToAgent::Failed {
                error: error.clone(),
            },
        )
        .await;
        let e = conn
            .reply(Duration::from_secs(1), MAX_LINE)
            .await
            .unwrap_err();
        assert!(e.is_unknown_command(), "{e:?}");
        assert_eq!(e.to_string(), error);
        let busy = ChannelError::Failed("ibv_dereg_mr: device busy".into());
        assert!(!busy.is_unknown_command());
    });
}

/// The texts the coordinator shows for a failed call are those it showed before the errors were
/// typed.
#[test]
fn channel_errors_read_as_before() {
    let cases = [
        (
            ChannelError::Timeout(Duration::from_secs(5)),
            "no answer within 5s",
        ),
        (
            ChannelError::TooLong { cap: 65536 },
            "its answer is longer than the 65536-byte cap; the agent closed the connection",
        ),
        (
            ChannelError::ShutByAgent,
            "the agent closed the connection after an over-long line",
        ),
        (
            ChannelError::Send(std::io::Error::from(std::io::ErrorKind::BrokenPipe)),
            "cannot reach the channel: broken pipe",
        ),
        (
            ChannelError::NotDrained,
            "its channel is not drained; only a drained verbs layer is released",
        ),
        (
            ChannelError::Unexpected(Box::new(ToAgent::Resumed)),
            "unexpected answer Resumed",
        ),
        (
            ChannelError::Gone,
            "its channel is gone (did the process exit?)",
        ),
        (ChannelError::Missing, "no channel"),
        (
            ChannelError::NotBack(Duration::from_secs(60)),
            "its channel did not come back within 60s (is the process alive?)",
        ),
    ];
    for (e, text) in cases {
        assert_eq!(e.to_string(), text);
    }
}
