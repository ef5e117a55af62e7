//! Tests of the checkpoint phases on a real job cgroup (needs root and a freezer; skips
//! otherwise), with a fake snapshot engine and a job process whose verbs layer quiesces in two
//! stages. The process is this test binary again, running [`drained_layer_process`].
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ckpt_store::layout::Staging;
use ib_quiesce::control::{ToAgent, ToChannel};

use super::*;
use crate::engine::{DumpSpec, EngineError, RestoreSpec, SnapshotEngine};
use crate::failpoint::Failpoints;
use crate::os::cgroup::{CgroupParent, JobCgroup};

/// The layer process's environment: the agent's control socket.
const LAYER_SOCKET: &str = "CKPT_TEST_LAYER_SOCKET";
/// The layer process's environment: the directory where it waits for `go` (it is in the job's
/// cgroup then) and appends each command it is sent to `commands`.
const LAYER_DIR: &str = "CKPT_TEST_LAYER_DIR";
/// The layer process's environment: a feature it reports in use when checked (absent: none).
const LAYER_UNSUPPORTED: &str = "CKPT_TEST_LAYER_UNSUPPORTED";
/// The job the test checkpoints.
const JOB: u64 = 7;

/// A snapshot engine that writes nothing and counts its dumps.
#[derive(Debug, Default)]
struct CountingEngine {
    dumps: AtomicUsize,
}

impl SnapshotEngine for CountingEngine {
    fn name(&self) -> &str {
        "counting"
    }
    fn version(&self) -> &str {
        "0"
    }
    fn dump(&self, _spec: &DumpSpec<'_>) -> Result<(), EngineError> {
        self.dumps.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn restore_argv(&self, _spec: &RestoreSpec<'_>) -> Vec<String> {
        Vec::new()
    }
    fn restore_failed(&self, status: String, log: &Path) -> EngineError {
        EngineError::Failed {
            engine: "criu",
            op: "restore",
            status,
            summary: "the counting engine does not restore".into(),
            log: log.to_path_buf(),
        }
    }
}

/// The job process: a verbs layer that answers `check` with no descriptors (and the feature in
/// [`LAYER_UNSUPPORTED`], if set), `quiesce` with `drained`, `release` with `quiesced` (then
/// closes its connection, and lives on until killed) and `resume` with `resumed`, noting each
/// command in `commands` before it answers. Does nothing unless
/// started by [`a_drained_layer_is_released_and_frozen_in_the_second_quiesce_round`].
#[test]
#[ignore = "the job process of another test, started by it"]
fn drained_layer_process() {
    let (Some(socket), Some(dir)) = (std::env::var_os(LAYER_SOCKET), std::env::var_os(LAYER_DIR))
    else {
        return;
    };
    let dir = PathBuf::from(dir);
    while !dir.join("go").exists() {
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut stream = UnixStream::connect(socket).unwrap();
    let say = |s: &mut UnixStream, m: &ToAgent| {
        let mut line = serde_json::to_vec(m).unwrap();
        line.push(b'\n');
        s.write_all(&line).unwrap();
    };
    let hello = ToAgent::Hello {
        version: ib_quiesce::control::PROTOCOL_VERSION,
        pid: std::process::id() as i32,
        channel: 1,
        down: false,
        qps: 1,
        mrs: 1,
    };
    say(&mut stream, &hello);
    let mut log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("commands"))
        .unwrap();
    for line in BufReader::new(stream.try_clone().unwrap()).lines() {
        let cmd = ToChannel::decode(line.unwrap().as_bytes()).unwrap();
        let (name, answer) = match cmd {
            ToChannel::Quiesce { .. } => (
                "quiesce",
                ToAgent::Drained {
                    report: Default::default(),
                    micros: 1,
                },
            ),
            ToChannel::Release => (
                "release",
                ToAgent::Quiesced {
                    report: Default::default(),
                    micros: 1,
                },
            ),
            ToChannel::Resume => ("resume", ToAgent::Resumed),
            ToChannel::Check => (
                "check",
                ToAgent::Checked {
                    fds: Some(Vec::new()),
                    unsupported: std::env::var(LAYER_UNSUPPORTED).into_iter().collect(),
                },
            ),
            _ => (
                "other",
                ToAgent::Failed {
                    error: "not expected in this test".into(),
                },
            ),
        };
        writeln!(log, "{name}").unwrap();
        say(&mut stream, &answer);
        if name == "release" {
            break;
        }
    }
    drop(stream);
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The job process in the job's cgroup; killed, and the cgroup removed, on drop.
struct LayerJob {
    child: Child,
    cgroup: JobCgroup,
    dir: PathBuf,
}

impl LayerJob {
    /// Starts the job process, puts it in job [`JOB`]'s cgroup, records it as the job's root
    /// (owned by this user), and waits for its channel to say hello.
    async fn start(jobs: &Jobs, dir: &Path, unsupported: Option<&str>) -> LayerJob {
        let j = jobs.get_or_create(JOB).unwrap();
        let mut job = j.lock().await;
        job.cgroup.create().unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        if let Some(feature) = unsupported {
            cmd.env(LAYER_UNSUPPORTED, feature);
        }
        let child = cmd
            .args([
                "--exact",
                "checkpoint::tests::drained_layer_process",
                "--ignored",
                "--test-threads=1",
            ])
            .env(LAYER_SOCKET, jobs.channels().socket())
            .env(LAYER_DIR, dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let layer = LayerJob {
            child,
            cgroup: job.cgroup.clone(),
            dir: dir.to_path_buf(),
        };
        let pid = layer.pid();
        fs::write(job.cgroup.procs_file(), pid.to_string()).unwrap();
        job.record.incarnation = 1;
        job.record.root_pid = Some(pid);
        job.record.owner = Some(nix::unistd::getuid().as_raw());
        job.save().unwrap();
        drop(job);
        fs::write(dir.join("go"), b"").unwrap();
        for _ in 0..500 {
            if !jobs.channels().up(&[pid]).await.is_empty() {
                return layer;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the job process's channel did not say hello within 5 s");
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The commands the process was sent, in order.
    fn commands(&self) -> Vec<String> {
        fs::read_to_string(self.dir.join("commands"))
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }
}

impl Drop for LayerJob {
    fn drop(&mut self) {
        let _ = self.cgroup.kill_all();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = self.cgroup.remove();
    }
}

/// A node for the layer tests: a job table on real cgroups (named `<prefix>-<pid>-<job>`) with
/// `engine`, in a temporary directory, and a runtime; `None` (the reason printed) without root
/// or a cgroup hierarchy.
fn layer_node(
    prefix: &str,
    engine: Arc<CountingEngine>,
) -> Option<(tempfile::TempDir, Jobs, tokio::runtime::Runtime)> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to make a job cgroup");
        return None;
    }
    let parent = match CgroupParent::resolve("auto", &format!("{prefix}-{}-", std::process::id())) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            return None;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let staging = dir.path().join("staging");
    fs::create_dir(&staging).unwrap();
    let jobs = Jobs::open(
        "n1".into(),
        dir.path().join("state"),
        Staging::at(staging),
        parent,
        engine,
        PathBuf::from("/nonexistent/ckpt-shim"),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    Some((dir, jobs, rt))
}

/// With a verbs layer that drained, the first quiesce round leaves the job thawed; an abort
/// then (another node failed its first round) resumes the layer. In the next epoch the second
/// round releases the layer and freezes, a third round (the coordinator asks every node) does
/// nothing more, and local-checkpoint dumps.
#[test]
fn a_drained_layer_is_released_and_frozen_in_the_second_quiesce_round() {
    let engine = Arc::new(CountingEngine::default());
    let Some((dir, jobs, rt)) = layer_node("ckpt-phasetest", engine.clone()) else {
        return;
    };
    let failpoints = dir.path().join("failpoints");
    let jobs = jobs.with_failpoints(Failpoints::at(failpoints.clone()));
    rt.block_on(async {
        let listener = jobs.channels().bind().unwrap();
        tokio::spawn(jobs.channels().clone().serve(listener));
        let layer = LayerJob::start(&jobs, dir.path(), None).await;
        let pid = layer.pid();
        let j = jobs.get(JOB).unwrap();
        let state = || j.try_lock().unwrap().cgroup.state().unwrap();
        let run = CheckpointRun::of(&jobs, JOB);

        assert_eq!(run.initial_sync(1).await.unwrap().channels, 1);
        assert_eq!(run.quiesce(1).await.unwrap(), (Duration::ZERO, 1));
        assert_eq!(layer.commands(), ["check", "quiesce"]);
        assert_eq!(
            state(),
            crate::os::cgroup::Freezer::Thawed,
            "the freeze waits for the release"
        );
        {
            let job = j.lock().await;
            assert_eq!(job.layer_drained, [pid]);
            assert!(job.work.as_ref().unwrap().frozen_at.is_none());
        }
        let e = run.local_checkpoint(1, false).await.unwrap_err();
        assert!(
            e.to_string().contains("quiesce (first round"),
            "no dump before the second round: {e}"
        );
        run.abort(1, "another node failed").await.unwrap();
        assert_eq!(layer.commands(), ["check", "quiesce", "resume"]);
        assert!(j.lock().await.layer_drained.is_empty());
        assert_eq!(jobs.channels().up(&[pid]).await, [pid]);

        // A failpoint in the first round fires before the layer hears anything.
        fs::write(&failpoints, "quiesce=error\n").unwrap();
        run.initial_sync(2).await.unwrap();
        let e = run.quiesce(2).await.unwrap_err();
        assert!(matches!(e, AgentError::Injected { .. }), "{e}");
        assert_eq!(layer.commands(), ["check", "quiesce", "resume", "check"]);
        run.abort(2, "injected").await.unwrap();

        fs::write(&failpoints, "").unwrap();
        run.initial_sync(3).await.unwrap();
        assert_eq!(run.quiesce(3).await.unwrap().1, 1);
        assert_eq!(state(), crate::os::cgroup::Freezer::Thawed);
        assert_eq!(run.quiesce(3).await.unwrap().1, 0, "second round");
        assert_eq!(
            layer.commands(),
            ["check", "quiesce", "resume", "check", "check", "quiesce", "release"]
        );
        assert_eq!(
            state(),
            crate::os::cgroup::Freezer::Frozen,
            "frozen after the release"
        );
        assert_eq!(run.quiesce(3).await.unwrap(), (Duration::ZERO, 0));
        run.local_checkpoint(3, false).await.unwrap();
        assert_eq!(engine.dumps.load(Ordering::SeqCst), 1);
        {
            let job = j.lock().await;
            assert!(job.layer_drained.is_empty());
            assert_eq!(job.ibq_down, [pid], "down: rebuilt after the resume");
            let w = job.work.as_ref().unwrap();
            assert!(w.frozen_at.is_some());
            assert_eq!(
                crate::part::notes::PartNotes::read(&w.notes).channels,
                [pid]
            );
        }
        run.resume(3, true).await.unwrap();
        assert!(j.lock().await.ibq_down.is_empty());
        drop(layer);
    });
}

/// A job, on a real cgroup, whose verbs layer reports a feature in use that it cannot
/// rebuild: initial sync asks it (`check`), fails naming the process and the feature, and
/// sends it nothing else; the process runs on, and no epoch was begun.
#[test]
fn a_layer_with_a_feature_in_use_it_cannot_rebuild_is_refused_at_initial_sync() {
    let Some((dir, jobs, rt)) = layer_node("ckpt-refusetest", Arc::new(CountingEngine::default()))
    else {
        return;
    };
    rt.block_on(async {
        let listener = jobs.channels().bind().unwrap();
        tokio::spawn(jobs.channels().clone().serve(listener));
        let feature = "multicast (ibv_attach_mcast): 1 group(s) attached";
        let layer = LayerJob::start(&jobs, dir.path(), Some(feature)).await;
        let pid = layer.pid();
        let e = CheckpointRun::of(&jobs, JOB)
            .initial_sync(1)
            .await
            .unwrap_err();
        match &e {
            AgentError::UnsupportedVerbsFeature {
                job,
                pid: p,
                feature: f,
                ..
            } => assert_eq!((*job, *p, f.as_str()), (JOB, pid, feature)),
            other => panic!("{other}"),
        }
        let m = e.to_string();
        assert!(
            m.contains(&format!("process {pid} (")) && m.contains("the job runs on"),
            "{m}"
        );
        assert_eq!(layer.commands(), ["check"]);
        assert_eq!(jobs.channels().up(&[pid]).await, [pid], "still connected");
        let j = jobs.get(JOB).unwrap();
        assert!(j.lock().await.work.is_none(), "no epoch begun");
        assert_eq!(
            j.lock().await.cgroup.state().unwrap(),
            crate::os::cgroup::Freezer::Thawed
        );
        drop(layer);
    });
}

/// The comparison of what a process holds on verbs devices with what its library reports.
#[test]
fn what_a_process_holds_beyond_its_verbs_library_is_found() {
    use super::channels::{beyond_library, Beyond};
    use ib_quiesce::control::Holdings;

    let uverbs0 = "/dev/infiniband/uverbs0".to_string();
    let uverbs1 = "/dev/infiniband/uverbs1".to_string();
    let rdma_cm = "/dev/infiniband/rdma_cm".to_string();
    let knows = |fds: &[i32]| Holdings {
        fds: Some(fds.to_vec()),
        unsupported: Vec::new(),
    };
    // The layer's own context, and its mappings of that device: nothing beyond.
    let fds = vec![(7, uverbs0.clone()), (3, "/dev/null".into())];
    let mapped = vec![uverbs0.clone(), "/usr/lib/libc.so.6".into()];
    assert_eq!(beyond_library(&fds, &mapped, &knows(&[7])), None);
    // A second descriptor on the same device, opened by the program: named, lowest first.
    let more = vec![
        (12, uverbs0.clone()),
        (7, uverbs0.clone()),
        (9, uverbs1.clone()),
    ];
    assert_eq!(
        beyond_library(&more, &mapped, &knows(&[7])),
        Some(Beyond::Fd {
            fd: 9,
            device: uverbs1.clone()
        })
    );
    // The connection manager is refused on its own, not here.
    let cm = vec![(7, uverbs0.clone()), (4, rdma_cm.clone())];
    assert_eq!(beyond_library(&cm, &mapped, &knows(&[7])), None);
    // A mapping of a device the library holds no descriptor on (another libibverbs that
    // closed its descriptor).
    let two = vec![uverbs0.clone(), uverbs1.clone()];
    assert_eq!(
        beyond_library(&fds, &two, &knows(&[7])),
        Some(Beyond::Mapping {
            device: uverbs1.clone()
        })
    );
    // A descriptor the library says is its own but is not on a verbs device counts for no
    // device: the mapping is still beyond.
    assert_eq!(
        beyond_library(
            &[(3, "/dev/null".into())],
            std::slice::from_ref(&uverbs0),
            &knows(&[3])
        ),
        Some(Beyond::Mapping {
            device: uverbs0.clone()
        })
    );
    // A library that cannot tell its descriptors is not compared on them...
    let cannot_tell = Holdings::default();
    assert_eq!(beyond_library(&more, &two, &cannot_tell), None);
    // ...but a feature in use is found either way, after the descriptors.
    let feature = "multicast (ibv_attach_mcast)".to_string();
    let using = |fds: Option<Vec<i32>>| Holdings {
        fds,
        unsupported: vec![feature.clone()],
    };
    assert_eq!(
        beyond_library(&more, &two, &using(None)),
        Some(Beyond::Feature(feature.clone()))
    );
    assert_eq!(
        beyond_library(&fds, &mapped, &using(Some(vec![7]))),
        Some(Beyond::Feature(feature.clone()))
    );
    assert!(matches!(
        beyond_library(&more, &mapped, &using(Some(vec![7]))),
        Some(Beyond::Fd { fd: 9, .. })
    ));
}

#[test]
fn staging_room_on_a_chain_is_what_was_written_unless_the_dump_will_be_full() {
    const MB: u64 = 1_000_000;
    let room = |resident, on_chain| room_needed(resident * MB, on_chain) / MB;
    assert_eq!(
        room(1000, None),
        1100,
        "a full dump: the resident memory and headroom"
    );
    // 10 % written since the newest pre-dump: that alone is dumped.
    assert_eq!(room(1000, Some((100 * MB, 1000 * MB))), 110);
    // 70 % written: a full dump, after the chain (900 MB of staging) was deleted.
    assert_eq!(room(1000, Some((700 * MB, 900 * MB))), 200);
    assert_eq!(room(1000, Some((700 * MB, 5000 * MB))), 0);
}

/// The engine session is made afresh at each launch and restore: what the owner left in the
/// one before (a link to a file of root's included) goes without the link being followed, and
/// the session and its subdirectories are the owner's and private.
#[test]
fn a_session_is_made_afresh_without_following_what_the_owner_left() {
    use std::os::unix::fs::MetadataExt;
    let engine = Arc::new(CountingEngine::default());
    let Some((dir, jobs, rt)) = layer_node("ckpt-sessiontest", engine) else {
        return;
    };
    let secret = dir.path().join("secret");
    fs::write(&secret, "root's").unwrap();
    rt.block_on(async {
        let j = jobs.get_or_create(JOB).unwrap();
        let job = j.lock().await;
        let owner = crate::os::owner::Identity::of_uid(0).unwrap().unwrap();
        let first = crate::launch::make_session(&job, &owner, &["tmp"], |_| Ok(())).unwrap();
        assert_eq!(first, job.session_dir());
        std::os::unix::fs::symlink(&secret, first.join("tmp/link")).unwrap();
        std::os::unix::fs::symlink(dir.path(), first.join("dirlink")).unwrap();
        let again = crate::launch::make_session(&job, &owner, &["tmp"], |d| {
            fs::write(d.join("filled"), "x")
        })
        .unwrap();
        assert_eq!(again, first, "the same path in every incarnation");
        assert_eq!(fs::read_to_string(&secret).unwrap(), "root's");
        assert!(!again.join("tmp/link").exists() && !again.join("dirlink").exists());
        assert!(again.join("filled").exists());
        for d in [again.clone(), again.join("tmp")] {
            let m = fs::metadata(&d).unwrap();
            assert_eq!(
                (m.uid(), m.mode() & 0o777),
                (owner.uid, 0o700),
                "{}",
                d.display()
            );
        }
    });
}
