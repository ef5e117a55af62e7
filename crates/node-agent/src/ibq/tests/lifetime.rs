//! A channel lives as long as the process that registered it, not its PID.
use super::*;

/// The attack on a registry keyed by PID alone: a process connects and says hello (down, as a
/// restored channel would), hands its connection on (here: its parent keeps the same socket)
/// and exits, freeing its PID for a process of another job. The channel must go with its
/// process: the PID finds no channel, a rebuild sends nothing down that connection, the agent
/// closes it and the job's place is freed.
#[test]
fn a_channel_goes_with_the_process_that_registered_it() {
    use std::os::fd::AsRawFd;
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ch = serving(dir.path(), my_uid(), JOB_CGROUP, Limits::default());
        // Made before the fork: the child only makes system calls.
        let sock = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let addr = nix::sys::socket::UnixAddr::new(ch.socket()).unwrap();
        let (go_r, go_w) = nix::unistd::pipe().unwrap();
        let (sfd, rfd) = (sock.as_raw_fd(), go_r.as_raw_fd());
        let (sa, sa_len) = (
            nix::sys::socket::SockaddrLike::as_ptr(&addr),
            nix::sys::socket::SockaddrLike::len(&addr),
        );
        // SAFETY: the child makes only async-signal-safe system calls (connect, read, _exit)
        // on descriptors and memory prepared before the fork.
        let child = match unsafe { nix::unistd::fork() }.unwrap() {
            // SAFETY: as above: system calls only, on what was made before the fork.
            nix::unistd::ForkResult::Child => unsafe {
                if libc::connect(sfd, sa.cast(), sa_len) != 0 {
                    libc::_exit(1);
                }
                let mut b = [0u8; 1];
                // Lives until told to go.
                libc::read(rfd, b.as_mut_ptr().cast(), 1);
                libc::_exit(0);
            },
            nix::unistd::ForkResult::Parent { child } => child,
        };
        let pid = child.as_raw();
        drop(go_r);
        // The parent holds the child's connection (the same socket) and says the child's
        // hello on it, as a sibling handed the socket would.
        let std_stream = std::os::unix::net::UnixStream::from(sock);
        let mut connected = false;
        for _ in 0..200 {
            if std_stream.peer_addr().is_ok() {
                connected = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(connected, "the child connected");
        std_stream.set_nonblocking(true).unwrap();
        let mut held = UnixStream::from_std(std_stream).unwrap();
        let mut hello = serde_json::to_vec(&ToAgent::Hello {
            version: PROTOCOL_VERSION,
            pid,
            channel: 9,
            down: true,
            qps: 1,
            mrs: 1,
        })
        .unwrap();
        hello.push(b'\n');
        held.write_all(&hello).await.unwrap();
        let mut registered = false;
        for _ in 0..200 {
            if ch.down_among(&[pid]).await == [pid] {
                registered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(registered, "the child's channel registered while it lived");
        // The child exits; its PID is free.
        nix::unistd::write(&go_w, b"x").unwrap();
        nix::sys::wait::waitpid(child, None).unwrap();
        assert!(
            closed_by_agent(&mut held, Duration::from_secs(5)).await,
            "the agent closes the connection of a process that exited"
        );
        assert!(ch.down_among(&[pid]).await.is_empty());
        assert_eq!(job7_holds(&ch, 0).await, 0, "its place is freed");
        let r = ch.rebuild(&[pid], Duration::from_millis(300)).await;
        assert!(r.is_err(), "no rebuild through a dead process's channel");
        ch.lower_flags([pid]);
    });
}
