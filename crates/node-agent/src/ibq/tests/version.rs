//! The hello's protocol version: this tree's and an older layer's (without one) are admitted,
//! another is refused with its connection closed, and the refusal names both versions.
use super::*;

/// Sends `line` (a hello, without its newline) on a new connection to `ch`.
async fn hello_line(ch: &Channels, line: String) -> UnixStream {
    let mut s = UnixStream::connect(ch.socket()).await.unwrap();
    s.write_all(format!("{line}\n").as_bytes()).await.unwrap();
    s
}

/// A hello of `version` (none: the field left out, as a layer built before it says).
fn hello_of(version: Option<u32>) -> String {
    let version = version
        .map(|v| format!(r#""version":{v},"#))
        .unwrap_or_default();
    format!(
        r#"{{"msg":"hello",{version}"pid":{},"channel":7,"down":false,"qps":1,"mrs":1}}"#,
        me().pid
    )
}

#[test]
fn a_hello_of_this_version_or_without_one_is_admitted() {
    runtime().block_on(async {
        for version in [Some(PROTOCOL_VERSION), None] {
            let dir = tempfile::tempdir().unwrap();
            let ch = serving(dir.path(), my_uid(), JOB_CGROUP, Limits::default());
            let mut s = hello_line(&ch, hello_of(version)).await;
            assert!(comes_up(&ch).await, "version {version:?} is admitted");
            assert!(!closed_by_agent(&mut s, Duration::from_millis(100)).await);
        }
    });
}

/// A hello of a version the agent does not speak (older, newer, or a newer hello whose other
/// fields changed) is refused: the connection is closed, no channel comes up and its job's
/// place is given back.
#[test]
fn a_hello_of_another_version_is_refused_and_its_connection_closed() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ch = serving(dir.path(), my_uid(), JOB_CGROUP, Limits::default());
        let reshaped = format!(
            r#"{{"msg":"hello","version":9,"pid":{},"channels":[7]}}"#,
            me().pid
        );
        for line in [
            hello_of(Some(0)),
            hello_of(Some(PROTOCOL_VERSION + 1)),
            reshaped,
        ] {
            let mut s = hello_line(&ch, line.clone()).await;
            assert!(
                closed_by_agent(&mut s, Duration::from_secs(5)).await,
                "{line} is refused"
            );
            assert!(ch.up(&[me().pid]).await.is_empty(), "{line}");
            assert_eq!(job7_holds(&ch, 0).await, 0, "its place is given back");
        }
        // The process may come back with a layer that matches.
        let _s = hello_line(&ch, hello_of(Some(PROTOCOL_VERSION))).await;
        assert!(comes_up(&ch).await);
    });
}

#[test]
fn a_version_refusal_names_both_versions_and_what_to_do() {
    let e = HelloError::version(42, 2);
    assert!(matches!(
        e,
        HelloError::Version {
            pid: 42,
            layer: 2,
            agent: PROTOCOL_VERSION
        }
    ));
    let m = e.to_string();
    for part in [
        "pid 42",
        "version 2",
        &format!("speaks version {PROTOCOL_VERSION}"),
        "rebuild or reinstall libckpt_verbs.so",
        "on this node",
    ] {
        assert!(m.contains(part), "{part:?} in {m}");
    }
}

/// A process refused for its version is warned about once (its control thread tries again
/// every second), and again if it says another version.
#[test]
fn a_version_refusal_is_warned_about_once_per_process_and_version() {
    let warned = VersionWarned::default();
    assert!(warned.first(5, 2));
    assert!(!warned.first(5, 2));
    assert!(warned.first(6, 2));
    assert!(warned.first(5, 3));
    assert!(!warned.first(5, 3));
}
