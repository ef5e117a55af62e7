//! Tests of [`super`] (control.rs).
use super::*;
use crate::fake::{Fabric, FakeVerbs};
use crate::verbs::{QpCaps, RecvWr, SendOp, SendWr, Sge};
use std::io::BufRead;
use std::os::unix::net::UnixListener;
use std::sync::atomic::AtomicBool;

const CAPS: QpCaps = QpCaps {
    max_send_wr: 16,
    max_recv_wr: 16,
    max_sge: 1,
};

struct Rank {
    shared: Arc<Shared<FakeVerbs>>,
    buf: Box<[u8; 64]>,
    key: u32,
    cq: u32,
    qp: u32,
}

fn pair() -> (Fabric, Rank, Rank) {
    let f = Fabric::new();
    let mk = |id| {
        let mut ch = Channel::open(f.end(id), "").unwrap();
        let buf = Box::new([0u8; 64]);
        let key = ch.reg_mr(buf.as_ptr() as u64, 64, 0x7).unwrap();
        let cq = ch.create_cq(32).unwrap();
        let qp = ch.create_qp(cq, cq, CAPS).unwrap();
        (ch, buf, key, cq, qp)
    };
    let (mut a, mut b) = (mk(0), mk(1));
    let (ea, eb) = (a.0.endpoint(a.4).unwrap(), b.0.endpoint(b.4).unwrap());
    a.0.connect(a.4, eb).unwrap();
    b.0.connect(b.4, ea).unwrap();
    let rank = |(ch, buf, key, cq, qp): (Channel<FakeVerbs>, _, _, _, _)| Rank {
        shared: Shared::new(ch),
        buf,
        key,
        cq,
        qp,
    };
    (f, rank(a), rank(b))
}

/// An application thread that keeps sending and polling through the shared channel, and
/// counts its calls, until told to stop.
fn app(r: &Rank, stop: Arc<AtomicBool>, calls: Arc<AtomicU64>) -> std::thread::JoinHandle<()> {
    let (s, qp, cq, key) = (r.shared.clone(), r.qp, r.cq, r.key);
    let addr = r.buf.as_ptr() as u64;
    std::thread::spawn(move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let wr = SendWr {
                wr_id: n,
                op: SendOp::Write {
                    remote_addr: 0,
                    rkey: crate::channel::MR_KEY_BASE,
                },
                sges: vec![Sge {
                    addr,
                    len: 8,
                    lkey: key,
                }],
                signaled: n % 4 == 0,
            };
            s.call(|c| c.post_send(qp, &wr)).unwrap();
            s.call(|c| c.poll_cq(cq, 16)).unwrap();
            calls.fetch_add(1, Ordering::Relaxed);
            n += 1;
            std::thread::sleep(Duration::from_millis(1));
        }
    })
}

fn line<T: serde::de::DeserializeOwned>(r: &mut BufReader<UnixStream>) -> Option<T> {
    let mut l = String::new();
    (r.read_line(&mut l).ok()? > 0).then(|| serde_json::from_str(&l).expect("json"))
}

fn tell(s: &mut UnixStream, c: &ToChannel) {
    let mut v = serde_json::to_vec(c).unwrap();
    v.push(b'\n');
    s.write_all(&v).unwrap();
}

/// The agent's side of the protocol, by hand: hello, quiesce (then the channel hangs up),
/// flag, hello again (down), rebuild, reconnect. Meanwhile the application thread is held
/// at the gate and goes on afterwards.
#[test]
fn the_control_protocol_quiesces_and_rebuilds_while_the_application_waits() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("control.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    std::fs::create_dir_all(flag_dir(&socket)).unwrap();
    let (_f, a, b) = pair();
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let worker = app(&a, stop.clone(), calls.clone());
    start_at(&a.shared, socket.clone()).unwrap();
    start_at(&b.shared, socket.clone()).unwrap();
    let accept = |listener: &UnixListener| {
        let (s, _) = listener.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let hello: ToAgent = line(&mut r).unwrap();
        (s, r, hello)
    };
    let mut conns: Vec<_> = (0..2).map(|_| accept(&listener)).collect();
    for (_, _, h) in &conns {
        assert!(
            matches!(
                h,
                ToAgent::Hello {
                    version: PROTOCOL_VERSION,
                    down: false,
                    qps: 1,
                    mrs: 1,
                    ..
                }
            ),
            "{h:?}"
        );
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(calls.load(Ordering::Relaxed) > 0, "the application runs");
    for (s, _, _) in &mut conns {
        tell(s, &ToChannel::Quiesce { timeout_ms: 5000 });
    }
    for (_, r, _) in &mut conns {
        let q: ToAgent = line(r).unwrap();
        assert!(matches!(q, ToAgent::Quiesced { .. }), "{q:?}");
        assert!(
            line::<ToAgent>(r).is_none(),
            "the channel hangs up after quiescing"
        );
    }
    let held = calls.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        calls.load(Ordering::Relaxed),
        held,
        "application calls wait at the gate"
    );
    assert_eq!(a.shared.peek(|c| c.state()), State::Down);
    // Both processes in one test: the flag is per pid, so both come back.
    std::fs::write(flag_path(&socket, FlagFor::own()), b"").unwrap();
    let mut conns: Vec<_> = (0..2).map(|_| accept(&listener)).collect();
    let mut endpoints = Vec::new();
    let mut wants = Vec::new();
    for (s, r, h) in &mut conns {
        assert!(matches!(h, ToAgent::Hello { down: true, .. }), "{h:?}");
        tell(s, &ToChannel::Rebuild);
        match line::<ToAgent>(r).unwrap() {
            ToAgent::Rebuilt {
                endpoints: e,
                peers,
                ..
            } => {
                endpoints.extend(e);
                wants.push(peers.expect("a channel names its peers"));
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(endpoints.len(), 2);
    // Each channel names the other's QP, and gets only that endpoint.
    assert_eq!(wants.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1]);
    assert_ne!(wants[0], wants[1]);
    for ((s, r, _), want) in conns.iter_mut().zip(&wants) {
        let mine: Vec<Endpoint> = endpoints
            .iter()
            .filter(|e| want.contains(&e.id))
            .cloned()
            .collect();
        assert_eq!(mine.len(), 1);
        tell(s, &ToChannel::Reconnect { endpoints: mine });
        let m: ToAgent = line(r).unwrap();
        assert!(matches!(m, ToAgent::Reconnected { .. }), "{m:?}");
    }
    let t = Instant::now();
    while calls.load(Ordering::Relaxed) <= held + 5 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the application resumes"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    assert_eq!(a.shared.rebuilds(), 1);
}

/// A failed quiesce (the peer never answers the flush marker) leaves the channel up and the
/// application running.
#[test]
fn a_quiesce_that_times_out_lets_the_application_run_on() {
    let (_f, a, _b) = pair();
    let r = a.shared.quiesce(Duration::from_millis(200));
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert_eq!(a.shared.peek(|c| c.state()), State::Up);
    let wr = RecvWr {
        wr_id: 1,
        sges: vec![Sge {
            addr: a.buf.as_ptr() as u64,
            len: 8,
            lkey: a.key,
        }],
    };
    a.shared.call(|c| c.post_recv(a.qp, &wr)).unwrap();
}

/// An agent's control socket in a fresh directory, and a channel pair whose first rank's
/// control thread is started at it (the caller accepts its connection).
fn agent_socket() -> (tempfile::TempDir, UnixListener, (Fabric, Rank, Rank)) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("control.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    std::fs::create_dir_all(flag_dir(&socket)).unwrap();
    let ranks = pair();
    start_at(&ranks.1.shared, socket).unwrap();
    (dir, listener, ranks)
}

/// A command line longer than [`MAX_LINE`] closes the connection; the control thread then
/// says hello to the agent again.
#[test]
fn an_over_long_command_closes_the_connection_and_the_channel_says_hello_again() {
    let (_dir, listener, _ranks) = agent_socket();
    let (mut s, _) = listener.accept().unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    assert!(matches!(
        line::<ToAgent>(&mut r),
        Some(ToAgent::Hello { .. })
    ));
    let mut long = vec![b' '; MAX_LINE + 1];
    long.push(b'\n');
    // The channel may close while this is still being written.
    let _ = s.write_all(&long);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    assert_eq!(
        std::io::Read::read_to_end(&mut r, &mut rest).unwrap(),
        0,
        "closed without an answer"
    );
    let (s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = BufReader::new(s);
    assert!(matches!(
        line::<ToAgent>(&mut r),
        Some(ToAgent::Hello { down: false, .. })
    ));
}

/// `check` on the wire: the channel answers `checked` and stays connected (a quiesce goes on
/// as usual); the fake backend cannot tell its descriptors, so `fds` is absent, which the
/// agent reads as "do not compare".
#[test]
fn a_check_is_answered_with_what_the_channel_holds_and_changes_nothing() {
    let (_dir, listener, (_f, a, _b)) = agent_socket();
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    assert!(matches!(
        line::<ToAgent>(&mut r),
        Some(ToAgent::Hello { .. })
    ));
    tell(&mut s, &ToChannel::Check);
    let mut raw = String::new();
    r.read_line(&mut raw).unwrap();
    assert_eq!(raw, "{\"msg\":\"checked\",\"unsupported\":[]}\n");
    assert_eq!(
        ToAgent::decode(raw.trim_end().as_bytes()).unwrap(),
        ToAgent::Checked {
            fds: None,
            unsupported: Vec::new()
        }
    );
    assert_eq!(a.shared.peek(|c| c.state()), State::Up, "nothing changed");
    tell(&mut s, &ToChannel::Check);
    assert!(matches!(
        line::<ToAgent>(&mut r),
        Some(ToAgent::Checked { fds: None, .. })
    ));
}

/// The `checked` answer's fields: descriptors kept when given, absent means "cannot tell"
/// (not "none"), and a missing `unsupported` list is empty.
#[test]
fn a_checked_answer_tells_no_descriptors_from_cannot_tell() {
    let some = ToAgent::Checked {
        fds: Some(Vec::new()),
        unsupported: Vec::new(),
    };
    let line = serde_json::to_vec(&some).unwrap();
    assert_eq!(line, br#"{"msg":"checked","fds":[],"unsupported":[]}"#);
    assert_eq!(ToAgent::decode(&line).unwrap(), some);
    assert_eq!(
        ToAgent::decode(br#"{"msg":"checked"}"#).unwrap(),
        ToAgent::Checked {
            fds: None,
            unsupported: Vec::new()
        }
    );
    assert_eq!(
        ToChannel::decode(br#"{"cmd":"check"}"#).unwrap(),
        ToChannel::Check
    );
    let h = Holdings {
        fds: Some(vec![4]),
        unsupported: vec!["x".into()],
    };
    assert_eq!(
        ToAgent::from(h),
        ToAgent::Checked {
            fds: Some(vec![4]),
            unsupported: vec!["x".into()]
        }
    );
}

/// A hello carries its protocol version and reads back the same; one without a version (from a
/// layer built before hellos carried it) reads as version 1, the protocol those layers speak.
#[test]
fn a_hello_says_its_version_and_one_without_reads_as_version_1() {
    let hello = ToAgent::Hello {
        version: PROTOCOL_VERSION,
        pid: 12,
        channel: 7,
        down: false,
        qps: 2,
        mrs: 3,
    };
    let line = serde_json::to_vec(&hello).unwrap();
    assert_eq!(
        line,
        br#"{"msg":"hello","version":1,"pid":12,"channel":7,"down":false,"qps":2,"mrs":3}"#
    );
    assert_eq!(ToAgent::decode(&line).unwrap(), hello);
    let older = br#"{"msg":"hello","pid":12,"channel":7,"down":false,"qps":2,"mrs":3}"#;
    assert_eq!(ToAgent::decode(older).unwrap(), hello);
    let newer = br#"{"msg":"hello","version":2,"pid":12,"channel":7,"down":true,"qps":0,"mrs":0}"#;
    assert_eq!(hello_version(&line), Some(PROTOCOL_VERSION));
    assert_eq!(hello_version(older), Some(UNVERSIONED));
    assert_eq!(hello_version(newer), Some(2));
    let reshaped = br#"{"msg":"hello","version":3,"pid":12,"channels":[7]}"#;
    assert_eq!(hello_version(reshaped), Some(3));
    assert_eq!(hello_version(br#"{"msg":"resumed"}"#), None);
    assert_eq!(hello_version(b"not json"), None);
    assert!(matches!(
        ToAgent::decode(newer).unwrap(),
        ToAgent::Hello {
            version: 2,
            down: true,
            ..
        }
    ));
}

#[test]
fn a_line_over_the_cap_is_an_error_and_one_at_the_cap_is_not() {
    let mut input = vec![b'a'; 10];
    input.push(b'\n');
    input.extend_from_slice(&[b'b'; 11]);
    input.push(b'\n');
    let mut r = BufReader::with_capacity(4, &input[..]);
    let mut part = LineBuf::default();
    assert_eq!(
        read_line(&mut r, &mut part, 10).unwrap(),
        Some(vec![b'a'; 10])
    );
    let e = read_line(&mut r, &mut part, 10).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("10-byte cap"), "{e}");
}

/// One valid line of every message each side decodes.
fn samples() -> Vec<Vec<u8>> {
    let endpoint = Endpoint {
        id: (7, 0x710000),
        rkeys: vec![(0x7100_0000, 42), (0x7100_0001, 43)],
        ..Endpoint::default()
    };
    let agent = [
        ToAgent::Hello {
            version: PROTOCOL_VERSION,
            pid: 1,
            channel: 7,
            down: true,
            qps: 2,
            mrs: 3,
        },
        ToAgent::Quiesced {
            report: QuiesceReport::default(),
            micros: 5,
        },
        ToAgent::Rebuilt {
            endpoints: vec![endpoint.clone()],
            peers: Some(vec![(8, 0x710001)]),
            addresses: None,
            micros: 6,
        },
        ToAgent::Rebuilt {
            endpoints: vec![endpoint.clone()],
            peers: None,
            addresses: Some(vec![8, u64::MAX]),
            micros: 6,
        },
        ToAgent::Lookup {
            version: PROTOCOL_VERSION,
            pid: 4,
            addresses: vec![9],
        },
        ToAgent::Reconnected { micros: 7 },
        ToAgent::Resumed,
        ToAgent::Checked {
            fds: Some(vec![5, 9]),
            unsupported: vec!["multicast (ibv_attach_mcast)".into()],
        },
        ToAgent::Failed { error: "x".into() },
    ];
    let channel = [
        ToChannel::Quiesce { timeout_ms: 100 },
        ToChannel::Resume,
        ToChannel::Check,
        ToChannel::Rebuild,
        ToChannel::Reconnect {
            endpoints: vec![endpoint.clone()],
        },
        ToChannel::Endpoints {
            endpoints: vec![endpoint],
        },
    ];
    agent
        .iter()
        .map(|m| serde_json::to_vec(m).unwrap())
        .chain(channel.iter().map(|c| serde_json::to_vec(c).unwrap()))
        .collect()
}

/// A change to a line: overwrite, insert or remove a byte at a position (modulo the length).
#[derive(Debug, Clone)]
enum Mutation {
    Set(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
}

fn mutation() -> impl proptest::strategy::Strategy<Value = Mutation> {
    use proptest::prelude::*;
    let byte = prop_oneof![
        Just(b'{'),
        Just(b'}'),
        Just(b'['),
        Just(b'"'),
        Just(b':'),
        Just(b'-'),
        Just(b'9'),
        Just(0xff),
        any::<u8>()
    ];
    prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), byte).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Remove),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(mut line: Vec<u8>, ms: &[Mutation]) -> Vec<u8> {
    for m in ms {
        let n = line.len().max(1);
        match *m {
            Mutation::Set(i, b) if !line.is_empty() => line[i % n] = b,
            Mutation::Insert(i, b) => line.insert(i % (line.len() + 1), b),
            Mutation::Remove(i) if !line.is_empty() => {
                line.remove(i % n);
            }
            Mutation::Truncate(i) => line.truncate(i % n),
            _ => {}
        }
    }
    line
}

/// Both decoders on any line: an error or a message, never a panic; a message decoded is
/// encoded back to the same message.
fn decode_both(line: &[u8]) {
    if let Ok(m) = ToAgent::decode(line) {
        assert_eq!(
            ToAgent::decode(&serde_json::to_vec(&m).unwrap()).unwrap(),
            m
        );
    }
    if let Ok(c) = ToChannel::decode(line) {
        assert_eq!(
            ToChannel::decode(&serde_json::to_vec(&c).unwrap()).unwrap(),
            c
        );
    }
    if let Err(e) = ToAgent::decode(line) {
        assert!(
            e.to_string().len() < 600,
            "the message quotes a bounded excerpt"
        );
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    #[test]
    fn the_decoders_never_panic_on_random_lines(
        line in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2048),
    ) {
        decode_both(&line);
    }

    #[test]
    fn the_decoders_never_panic_on_mutated_messages(
        which in 0usize..12,
        ms in proptest::collection::vec(mutation(), 1..8),
    ) {
        let line = samples()[which].clone();
        decode_both(&mutate(line, &ms));
    }

    #[test]
    fn the_decoders_never_panic_on_deep_nesting(depth in 0usize..20_000, open in 0u8..3) {
        let c = [b'[', b'{', b'"'][open as usize];
        let mut line = b"{\"msg\":".to_vec();
        line.extend(std::iter::repeat_n(c, depth));
        decode_both(&line);
    }

    /// The channel's line reader, fed any bytes, returns exactly the lines within the cap
    /// and stops at the first longer one.
    #[test]
    fn the_channels_line_reader_splits_any_input_within_the_cap(
        input in proptest::collection::vec(
            proptest::prop_oneof![
                proptest::strategy::Just(b'\n'),
                proptest::prelude::any::<u8>()
            ],
            0..4096,
        ),
        cap in 0usize..512,
        chunk in 1usize..64,
    ) {
        let (want, too_long) = lines_within_cap(&input, cap);
        let mut r = BufReader::with_capacity(chunk, &input[..]);
        let mut part = LineBuf::default();
        let mut got = Vec::new();
        let ended_long = loop {
            match read_line(&mut r, &mut part, cap) {
                Ok(Some(l)) => {
                    decode_both(&l);
                    got.push(l);
                }
                Ok(None) => break false,
                Err(e) => {
                    proptest::prop_assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
                    break true;
                }
            }
        };
        proptest::prop_assert_eq!((got, ended_long), (want, too_long));
    }
}

#[test]
fn the_kernels_pid_is_the_processs_own_without_a_checkpointer() {
    assert_eq!(crate::kernel::pid(), std::process::id() as i32);
}
