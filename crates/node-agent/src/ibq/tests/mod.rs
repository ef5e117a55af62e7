//! Tests of [`super`] (the ib-quiesce control socket).
//!
//! One file: the tests of the control socket, over one fake process side and its scripted answers.
use super::*;
use proptest::prelude::*;
use tokio::io::AsyncReadExt;

/// The cgroup the fake [`PeerCgroups`] puts every connecting process in.
const JOB_CGROUP: &str = "/sys/fs/cgroup/ckpt-test-7";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn my_uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

fn me() -> Peer {
    Peer {
        pid: std::process::id() as i32,
        uid: my_uid(),
        gid: nix::unistd::getgid().as_raw(),
    }
}

/// Job 7, owned by `uid`, whose cgroup is [`JOB_CGROUP`].
fn job7(uid: u32) -> impl Fn(&Path) -> Option<JobOwner> + Send + Sync {
    move |c: &Path| (c == Path::new(JOB_CGROUP)).then_some(JobOwner { job: 7, uid })
}

/// A registry serving in `dir` whose job 7 belongs to `owner`, where every connecting
/// process is in the cgroup `peer_cgroup`.
fn serving(dir: &Path, owner: u32, peer_cgroup: &'static str, limits: Limits) -> Arc<Channels> {
    let ch = Channels::with_parts(
        dir.join("ibq").join("control.sock"),
        job7(owner),
        move |_pid: i32| Ok(vec![PathBuf::from(peer_cgroup)]),
        limits,
    );
    let listener = ch.bind().unwrap();
    tokio::spawn(ch.clone().serve(listener));
    ch
}

/// Says this process's hello (channel 7, up, one QP and one MR) on `s`.
async fn say_hello(s: &mut (impl tokio::io::AsyncWrite + Unpin)) {
    let hello = ToAgent::Hello {
        version: PROTOCOL_VERSION,
        pid: me().pid,
        channel: 7,
        down: false,
        qps: 1,
        mrs: 1,
    };
    let mut line = serde_json::to_vec(&hello).unwrap();
    line.push(b'\n');
    s.write_all(&line).await.unwrap();
}

/// Channels served in a fresh directory for this user's job, and a fake verbs layer of this
/// process connected to them, up (not down).
async fn layer_up() -> (tempfile::TempDir, Arc<Channels>, FakeLayer) {
    let dir = tempfile::tempdir().unwrap();
    let ch = serving(dir.path(), my_uid(), JOB_CGROUP, Limits::default());
    let layer = FakeLayer::connect(&ch, false).await;
    assert!(comes_up(&ch).await);
    (dir, ch, layer)
}

/// Whether the channel of this process comes up within two seconds.
async fn comes_up(ch: &Channels) -> bool {
    for _ in 0..200 {
        if !ch.up(&[me().pid]).await.is_empty() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// Whether the agent closed `s` (within `within`).
async fn closed_by_agent(s: &mut UnixStream, within: Duration) -> bool {
    let mut b = [0u8; 1];
    matches!(
        tokio::time::timeout(within, s.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

/// Until `held` connections of job 7 hold places, or two seconds passed.
async fn job7_holds(ch: &Channels, held: usize) -> usize {
    for _ in 0..200 {
        if ch.slots.held(7) == held {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    ch.slots.held(7)
}

/// With job 7 belonging to `owner` and this process in the cgroup `peer_cgroup`: a
/// connection that says hello is closed by the agent, and its channel never comes up.
fn refused_on_the_socket(owner: u32, peer_cgroup: &'static str) {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ch = serving(dir.path(), owner, peer_cgroup, Limits::default());
        let mut s = UnixStream::connect(ch.socket()).await.unwrap();
        say_hello(&mut s).await;
        assert!(closed_by_agent(&mut s, Duration::from_secs(5)).await);
        assert!(ch.up(&[me().pid]).await.is_empty());
    });
}

#[test]
fn a_process_of_the_jobs_owner_in_the_jobs_cgroup_is_admitted() {
    let peer = me();
    let cgroups = [
        PathBuf::from("/sys/fs/cgroup/memory/user.slice"),
        PathBuf::from(JOB_CGROUP),
    ];
    assert_eq!(
        authorize(peer, &cgroups, &job7(peer.uid)),
        Ok(JobOwner {
            job: 7,
            uid: peer.uid
        })
    );
}

#[test]
fn a_process_in_no_jobs_cgroup_is_refused() {
    let peer = me();
    let e = authorize(
        peer,
        &[PathBuf::from("/sys/fs/cgroup/user.slice")],
        &job7(peer.uid),
    )
    .unwrap_err();
    assert!(matches!(e, Refused::NotInJob { .. }), "{e:?}");
    let m = e.to_string();
    assert!(
        m.contains(&format!("pid {}", peer.pid))
            && m.contains(&format!("uid {}", peer.uid))
            && m.contains("no job's cgroup"),
        "{m}"
    );
    let e = authorize(peer, &[], &job7(peer.uid)).unwrap_err();
    assert!(matches!(e, Refused::NotInJob { .. }), "{e:?}");
    // And on the socket: closed before its hello counts.
    refused_on_the_socket(my_uid(), "/sys/fs/cgroup/user.slice");
}

#[test]
fn a_process_of_another_user_in_a_jobs_cgroup_is_refused() {
    let peer = me();
    let owner = peer.uid.wrapping_add(1);
    let e = authorize(peer, &[PathBuf::from(JOB_CGROUP)], &job7(owner)).unwrap_err();
    assert_eq!(
        e,
        Refused::NotOwner {
            peer,
            job: 7,
            owner
        }
    );
    assert!(
        e.to_string().contains(&format!(
            "runs as uid {}, but job 7 belongs to uid {owner}",
            peer.uid
        )),
        "{e}"
    );
    refused_on_the_socket(owner, JOB_CGROUP);
}

/// An over-long hello closes that connection; a good one is served next; an over-long
/// answer to a command closes that channel's connection and fails the command, naming the
/// cap.
#[test]
fn an_over_long_line_closes_its_connection_and_the_agent_serves_others() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ch = serving(dir.path(), my_uid(), JOB_CGROUP, Limits::default());
        let mut long = UnixStream::connect(ch.socket()).await.unwrap();
        // The agent may close while this is still being written.
        let _ = long.write_all(&vec![b'x'; MAX_LINE + 1]).await;
        assert!(closed_by_agent(&mut long, Duration::from_secs(5)).await);
        assert_eq!(job7_holds(&ch, 0).await, 0, "its place is given back");

        let s = UnixStream::connect(ch.socket()).await.unwrap();
        let (r, mut w) = s.into_split();
        let mut r = BufReader::new(r);
        say_hello(&mut w).await;
        assert!(comes_up(&ch).await, "a good channel is served");

        let quiesce = tokio::spawn({
            let ch = ch.clone();
            async move { ch.quiesce(&[me().pid], Duration::from_secs(5)).await }
        });
        let mut cmd = String::new();
        r.read_line(&mut cmd).await.unwrap();
        assert!(cmd.contains("quiesce"), "{cmd}");
        let mut answer = vec![b' '; MAX_LINE + 1];
        answer.push(b'\n');
        let _ = w.write_all(&answer).await;
        let (done, failed) = quiesce.await.unwrap();
        assert!(done.released.is_empty() && done.drained.is_empty());
        assert_eq!(failed.len(), 1);
        assert!(
            failed[0].message.contains(&format!("{MAX_LINE}-byte cap")),
            "{failed:?}"
        );
        let mut rest = Vec::new();
        let eof = tokio::time::timeout(Duration::from_secs(5), r.read_to_end(&mut rest)).await;
        assert!(
            matches!(eof, Ok(Ok(_)) | Ok(Err(_))),
            "the agent closed the connection"
        );
    });
}

/// A registry serving in `dir` with `limits` that leave two places: two connections
/// (returned with it) take them, and a third is refused.
async fn two_held_and_a_third_refused(
    dir: &Path,
    limits: Limits,
) -> (Arc<Channels>, UnixStream, UnixStream) {
    let ch = serving(dir, my_uid(), JOB_CGROUP, limits);
    let a = UnixStream::connect(ch.socket()).await.unwrap();
    let b = UnixStream::connect(ch.socket()).await.unwrap();
    assert_eq!(job7_holds(&ch, 2).await, 2);
    let mut c = UnixStream::connect(ch.socket()).await.unwrap();
    assert!(
        closed_by_agent(&mut c, Duration::from_secs(5)).await,
        "a third is refused"
    );
    (ch, a, b)
}

#[test]
fn connections_per_job_are_bounded() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let limits = Limits {
            per_job: 2,
            unidentified: 16,
        };
        let (ch, mut a, mut b) = two_held_and_a_third_refused(dir.path(), limits).await;
        assert!(!closed_by_agent(&mut b, Duration::from_millis(100)).await);
        drop(a);
        assert_eq!(
            job7_holds(&ch, 1).await,
            1,
            "a closed one gives its place back"
        );
        a = UnixStream::connect(ch.socket()).await.unwrap();
        say_hello(&mut a).await;
        assert!(comes_up(&ch).await, "a new one takes the place");
        assert_eq!(ch.slots.held(7), 2);
        drop(b);
        drop(a);
    });
}

#[test]
fn connections_not_yet_identified_are_bounded() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let limits = Limits {
            per_job: 16,
            unidentified: 2,
        };
        let (ch, _a, mut b) = two_held_and_a_third_refused(dir.path(), limits).await;
        // Once one says hello, its permit is free for the next.
        say_hello(&mut b).await;
        assert!(comes_up(&ch).await);
        let mut d = UnixStream::connect(ch.socket()).await.unwrap();
        assert!(!closed_by_agent(&mut d, Duration::from_millis(200)).await);
    });
}

#[test]
fn cgroup_entries_are_placed_under_their_hierarchys_mount() {
    let mountinfo = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 31 0:38 /jobs /mnt/jobs rw,relatime shared:9 - cgroup2 cgroup2 rw
";
    let cgroup = "\
9:name=systemd:/user.slice
6:freezer:/ckpt-5
4:memory:/process_api/x
0::/jobs/ckpt-5
";
    let dirs = cgroup_dirs(cgroup, mountinfo);
    let want: Vec<PathBuf> = [
        "/sys/fs/cgroup/systemd/user.slice",
        "/sys/fs/cgroup/freezer/ckpt-5",
        "/sys/fs/cgroup/memory/process_api/x",
        "/sys/fs/cgroup/unified/jobs/ckpt-5",
        "/mnt/jobs/ckpt-5",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    assert_eq!(dirs, want);
    // Outside a mount's root, or climbing out of it: nowhere.
    let only_sub = "42 31 0:38 /jobs /mnt/jobs rw - cgroup2 cgroup2 rw\n";
    assert!(cgroup_dirs("0::/other\n", only_sub).is_empty());
    assert!(cgroup_dirs("0::/jobs/../x\n", only_sub).is_empty());
    assert!(cgroup_dirs("garbage\n::\n", mountinfo).is_empty());
}

/// The real reader places a process put in a job cgroup in that cgroup's directory, as
/// `CgroupParent::job` names it (skipped where no cgroup can be made).
#[test]
fn the_proc_reader_finds_a_process_in_its_job_cgroup() {
    let prefix = format!("ckpt-ibqtest-{}-", std::process::id());
    let cg = match crate::os::cgroup::CgroupParent::resolve("auto", &prefix) {
        Ok(p) => p.job(1),
        Err(e) => return eprintln!("skipped: {e}"),
    };
    if let Err(e) = cg.create() {
        return eprintln!("skipped: cannot make a cgroup: {e}");
    }
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let joined = std::fs::write(cg.procs_file(), pid.to_string());
    let dirs = ProcCgroups.cgroups_of(pid);
    let _ = child.kill();
    let _ = child.wait();
    let _ = cg.remove();
    if let Err(e) = joined {
        return eprintln!("skipped: cannot move a process into a cgroup: {e}");
    }
    let dirs = dirs.unwrap();
    assert!(dirs.iter().any(|d| d == cg.path()), "{dirs:?}");
}

#[test]
fn bind_makes_the_socket_directory_the_agents_and_refuses_what_others_could_replace() {
    // Binding needs a runtime (the listener registers with its reactor).
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ibq").join("control.sock");
        let ibq = dir.path().join("ibq");
        std::fs::create_dir(&ibq).unwrap();
        std::fs::set_permissions(&ibq, std::fs::Permissions::from_mode(0o777)).unwrap();
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&ibq, Some(4321), Some(4321)).unwrap();
        } else {
            eprintln!("not root: the ownership fix is not exercised");
        }
        let ch = Channels::new(socket.clone(), job7(0));
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        drop(ch.bind().unwrap());
        let m = std::fs::metadata(&ibq).unwrap();
        assert_eq!(
            (m.uid(), m.mode() & 0o7777),
            (nix::unistd::geteuid().as_raw(), 0o755)
        );
        assert_eq!(mode(&flag_dir(&socket)), 0o755);
        assert_eq!(mode(&socket), 0o666);

        // A symlink in place of the flag directory is refused.
        let flags = flag_dir(&socket);
        std::fs::remove_dir(&flags).unwrap();
        std::os::unix::fs::symlink(dir.path(), &flags).unwrap();
        let e = ch.bind().unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
        std::fs::remove_file(&flags).unwrap();

        // A parent others can write is refused; with the sticky bit it is not.
        let set = |m| std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(m));
        set(0o777).unwrap();
        let e = ch.bind().unwrap_err();
        assert!(
            e.to_string().contains("can be written by other users"),
            "{e}"
        );
        set(0o1777).unwrap();
        drop(ch.bind().unwrap());
        set(0o700).unwrap();
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The agent's line reader, fed any bytes in any chunks, returns exactly the lines of
    /// at most the cap, stops at the first longer one, and never panics; whatever it
    /// returns decodes (or not) without panicking.
    #[test]
    fn the_agents_line_reader_splits_any_input_within_the_cap(
        input in proptest::collection::vec(
            prop_oneof![Just(b'\n'), Just(b'{'), Just(b'"'), any::<u8>()], 0..4096),
        cap in 0usize..512,
    ) {
        let (want, too_long) = ib_quiesce::control::lines_within_cap(&input, cap);
        let got = runtime().block_on(async {
            let mut lines = CappedLines::new(BufReader::with_capacity(7, &input[..]));
            let mut got = Vec::new();
            loop {
                match lines.next_line(cap).await {
                    Ok(Some(l)) => {
                        let _ = ToAgent::decode(&l);
                        got.push(l);
                    }
                    Ok(None) => return (got, false),
                    Err(LineError::TooLong(e)) => {
                        assert_eq!(e.cap, cap);
                        return (got, true);
                    }
                    Err(LineError::Io(e)) => panic!("{e}"),
                }
            }
        });
        prop_assert_eq!(got, (want, too_long));
    }
}

/// A registry serving on a temporary socket, and a "process" (this test) whose channel says
/// hello and then exits without answering.
#[test]
fn a_channel_whose_process_died_fails_the_quiesce_and_a_missing_one_the_rebuild() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ch = serving(dir.path(), my_uid(), JOB_CGROUP, Limits::default());
        let pid = std::process::id() as i32;
        let mut s = UnixStream::connect(ch.socket()).await.unwrap();
        say_hello(&mut s).await;
        assert!(comes_up(&ch).await);
        assert_eq!(ch.up(&[pid]).await, vec![pid]);
        drop(s);
        let (done, failed) = ch.quiesce(&[pid], Duration::from_secs(2)).await;
        assert!(done.released.is_empty() && done.drained.is_empty());
        assert_eq!(failed.len(), 1);
        assert!(
            failed[0].message.contains("cannot reach the channel"),
            "{failed:?}"
        );
        let e = ch
            .rebuild(&[pid], Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(e.pid, pid);
        assert!(e.message.contains("did not come back"), "{e:?}");
        assert!(
            flag_path(ch.socket(), FlagFor::of_process(pid).unwrap()).exists(),
            "the flag was raised"
        );
    });
}

/// A verbs layer of this process, as the agent sees it: connected, hello said.
struct FakeLayer {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
}

impl FakeLayer {
    /// Connects to `ch` and says hello (`down`: released, back for a rebuild).
    async fn connect(ch: &Channels, down: bool) -> FakeLayer {
        let (r, w) = UnixStream::connect(ch.socket()).await.unwrap().into_split();
        let hello = ToAgent::Hello {
            version: PROTOCOL_VERSION,
            pid: me().pid,
            channel: 7,
            down,
            qps: 1,
            mrs: 1,
        };
        let mut layer = FakeLayer {
            r: BufReader::new(r),
            w,
        };
        layer.say(&hello).await;
        layer
    }

    /// The agent's next command (within five seconds).
    async fn command(&mut self) -> ToChannel {
        let mut line = String::new();
        tokio::time::timeout(Duration::from_secs(5), self.r.read_line(&mut line))
            .await
            .expect("a command within 5 s")
            .unwrap();
        ToChannel::decode(line.trim_end().as_bytes()).unwrap()
    }

    /// Sends one message.
    async fn say(&mut self, msg: &ToAgent) {
        let mut line = serde_json::to_vec(msg).unwrap();
        line.push(b'\n');
        self.w.write_all(&line).await.unwrap();
    }
}

/// What the fake layer reports when it drains or releases.
fn layer_report() -> QuiesceReport {
    QuiesceReport {
        flushed_qps: 0,
        kept_receives: 2,
        held_completions: 1,
    }
}

/// Has the agent quiesce this process's layer, which answers `drained`; returns the result.
async fn drained(ch: &Arc<Channels>, layer: &mut FakeLayer) -> (Quiesced, Vec<ChannelFailure>) {
    let q = tokio::spawn({
        let ch = ch.clone();
        async move { ch.quiesce(&[me().pid], Duration::from_secs(5)).await }
    });
    assert!(matches!(layer.command().await, ToChannel::Quiesce { .. }));
    layer
        .say(&ToAgent::Drained {
            report: layer_report(),
            micros: 1500,
        })
        .await;
    q.await.unwrap()
}

/// The agent's `release` of this process's layer, running.
fn releasing(ch: &Arc<Channels>) -> tokio::task::JoinHandle<(Quiesced, Vec<ChannelFailure>)> {
    let ch = ch.clone();
    tokio::spawn(async move { ch.release(&[me().pid], Duration::from_secs(2)).await })
}

/// Has the agent release this process's drained layer, which answers `quiesced` and closes;
/// returns the result.
async fn released(ch: &Arc<Channels>, mut layer: FakeLayer) -> (Quiesced, Vec<ChannelFailure>) {
    let release = releasing(ch);
    assert_eq!(layer.command().await, ToChannel::Release);
    layer
        .say(&ToAgent::Quiesced {
            report: layer_report(),
            micros: 800,
        })
        .await;
    drop(layer);
    release.await.unwrap()
}

/// The agent's rebuild of this process's released layer, running, and the layer connected
/// again (down) with the `rebuild` command read.
async fn rebuilding(
    ch: &Arc<Channels>,
) -> (
    tokio::task::JoinHandle<Result<Rebuilt, ChannelFailure>>,
    FakeLayer,
) {
    let pid = me().pid;
    let rebuild = tokio::spawn({
        let ch = ch.clone();
        async move { ch.rebuild(&[pid], Duration::from_secs(5)).await }
    });
    while !flag_path(ch.socket(), FlagFor::of_process(pid).unwrap()).exists() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut layer = FakeLayer::connect(ch, true).await;
    assert_eq!(layer.command().await, ToChannel::Rebuild);
    (rebuild, layer)
}

/// A layer that answers `drained` is reported drained and stays up (not down); released, it
/// answers `quiesced` and closes, and is then down, and is rebuilt and reconnected like a
/// channel.
#[test]
fn a_drained_layer_stays_up_until_released_then_is_rebuilt_like_a_channel() {
    runtime().block_on(async {
        let (_dir, ch, mut layer) = layer_up().await;
        let pid = me().pid;
        let (done, failed) = drained(&ch, &mut layer).await;
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!((done.drained, done.released), (vec![pid], vec![]));
        assert_eq!(done.report, layer_report());
        assert_eq!(done.slowest, Duration::from_micros(1500));
        assert_eq!(ch.up(&[pid]).await, vec![pid], "drained is not down");

        let (done, failed) = released(&ch, layer).await;
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!((done.released, done.drained), (vec![pid], vec![]));
        assert!(ch.up(&[pid]).await.is_empty(), "released is down");

        let (rebuild, mut layer) = rebuilding(&ch).await;
        layer
            .say(&ToAgent::Rebuilt {
                endpoints: Vec::new(),
                peers: Some(Vec::new()),
                addresses: None,
                micros: 10,
            })
            .await;
        assert_eq!(
            rebuild.await.unwrap().unwrap(),
            (Vec::new(), Some(Vec::new()))
        );
        let reconnect = tokio::spawn({
            let ch = ch.clone();
            async move { ch.reconnect(&[pid], &[], Duration::from_secs(5)).await }
        });
        assert_eq!(
            layer.command().await,
            ToChannel::Reconnect {
                endpoints: Vec::new()
            }
        );
        layer.say(&ToAgent::Reconnected { micros: 10 }).await;
        reconnect.await.unwrap().unwrap();
        assert_eq!(ch.up(&[pid]).await, vec![pid]);
    });
}

/// A restored channel found by its hello (down) before the rebuild is not flagged again: a flag
/// it never takes down would bring it back right after its next release, and its new
/// connection would be in the snapshot.
#[test]
fn a_channel_back_before_the_rebuild_is_not_flagged_again() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ch = serving(dir.path(), my_uid(), JOB_CGROUP, Limits::default());
        let pid = me().pid;
        let mut layer = FakeLayer::connect(&ch, true).await;
        for _ in 0..200 {
            if !ch.down_among(&[pid]).await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ch.down_among(&[pid]).await, vec![pid]);
        let rebuild = tokio::spawn({
            let ch = ch.clone();
            async move { ch.rebuild(&[pid], Duration::from_secs(5)).await }
        });
        assert_eq!(layer.command().await, ToChannel::Rebuild);
        let flag = flag_path(ch.socket(), FlagFor::of_process(pid).unwrap());
        assert!(!flag.exists(), "no flag for a channel that is back");
        layer
            .say(&ToAgent::Rebuilt {
                endpoints: Vec::new(),
                peers: Some(Vec::new()),
                addresses: None,
                micros: 10,
            })
            .await;
        rebuild.await.unwrap().unwrap();
        assert!(!flag.exists());
    });
}

/// A drained layer is resumed by `resume`, is up, and is no longer drained (nothing to release).
#[test]
fn a_drained_layer_is_resumed_and_no_longer_drained() {
    runtime().block_on(async {
        let (_dir, ch, mut layer) = layer_up().await;
        let pid = me().pid;
        assert_eq!(drained(&ch, &mut layer).await.0.drained, vec![pid]);
        let resume = tokio::spawn({
            let ch = ch.clone();
            async move { ch.resume(&[pid]).await }
        });
        assert_eq!(layer.command().await, ToChannel::Resume);
        layer.say(&ToAgent::Resumed).await;
        resume.await.unwrap();
        assert_eq!(ch.up(&[pid]).await, vec![pid]);
        let (done, failed) = ch.release(&[pid], Duration::from_secs(1)).await;
        assert!(done.released.is_empty());
        assert_eq!(failed.len(), 1);
        assert!(failed[0].message.contains("not drained"), "{failed:?}");
    });
}

/// A release the layer answers with `failed`, or not at all, or with `quiesced` but no close,
/// fails naming the pid within the timeout; the layer stays drained (registered, up) and can
/// be released again.
#[test]
fn a_release_that_fails_or_hangs_names_the_pid_and_returns() {
    runtime().block_on(async {
        let (_dir, ch, mut layer) = layer_up().await;
        let pid = me().pid;
        drained(&ch, &mut layer).await;
        let bounded = |h: tokio::task::JoinHandle<_>| async move {
            tokio::time::timeout(Duration::from_secs(10), h)
                .await
                .expect("release returns within its timeout")
                .unwrap()
        };

        let release = releasing(&ch);
        assert_eq!(layer.command().await, ToChannel::Release);
        let error = "ibv_dereg_mr: device busy".to_string();
        layer.say(&ToAgent::Failed { error }).await;
        let (done, failed): (Quiesced, _) = bounded(release).await;
        assert!(done.released.is_empty());
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].pid, pid);
        assert!(failed[0].message.contains("device busy"), "{failed:?}");
        assert_eq!(ch.up(&[pid]).await, vec![pid], "still registered");

        let release = releasing(&ch);
        assert_eq!(layer.command().await, ToChannel::Release, "still drained");
        let (_, failed) = bounded(release).await;
        assert_eq!(failed[0].pid, pid);
        assert!(failed[0].message.contains("no answer within"), "{failed:?}");

        let release = releasing(&ch);
        assert_eq!(layer.command().await, ToChannel::Release);
        layer
            .say(&ToAgent::Quiesced {
                report: layer_report(),
                micros: 1,
            })
            .await;
        let (done, failed) = bounded(release).await;
        assert!(done.released.is_empty());
        assert!(
            failed[0].message.contains("did not disconnect"),
            "{failed:?}"
        );
    });
}

/// `check` asks the layer what it holds and returns its answer with its pid; a layer built
/// before `check` (it cannot read the command) is taken as one that cannot tell; a layer that
/// does not answer fails the check, naming the pid, within the timeout. None of it changes the
/// layer's registration.
#[test]
fn a_check_returns_what_the_layer_holds_and_an_older_one_cannot_tell() {
    runtime().block_on(async {
        let (_dir, ch, mut layer) = layer_up().await;
        let pid = me().pid;
        let checking = |timeout| {
            let ch = ch.clone();
            tokio::spawn(async move { ch.check(&[pid], timeout).await })
        };

        let check = checking(Duration::from_secs(5));
        assert_eq!(layer.command().await, ToChannel::Check);
        let holds = Holdings {
            fds: Some(vec![5, 6]),
            unsupported: vec!["multicast (ibv_attach_mcast)".into()],
        };
        layer.say(&holds.clone().into()).await;
        assert_eq!(check.await.unwrap().unwrap(), vec![(pid, holds)]);

        let check = checking(Duration::from_secs(5));
        assert_eq!(layer.command().await, ToChannel::Check);
        let error = "unreadable command: unreadable line \"{\\\"cmd\\\":\\\"check\\\"}\"".into();
        layer.say(&ToAgent::Failed { error }).await;
        assert_eq!(
            check.await.unwrap().unwrap(),
            vec![(pid, Holdings::default())],
            "cannot tell"
        );

        let check = checking(Duration::from_millis(300));
        assert_eq!(layer.command().await, ToChannel::Check);
        let e = tokio::time::timeout(Duration::from_secs(5), check)
            .await
            .expect("bounded by its timeout")
            .unwrap()
            .unwrap_err();
        assert_eq!(e.pid, pid);
        assert!(e.message.contains("no answer within"), "{e:?}");
        assert_eq!(ch.up(&[pid]).await, vec![pid], "still registered and up");

        let e = ch
            .check(&[pid + 1], Duration::from_secs(1))
            .await
            .unwrap_err();
        assert_eq!(e.pid, pid + 1);
        assert!(e.message.contains("gone"), "{e:?}");
    });
}

mod conn;
mod lifetime;
mod lookup;
mod version;
