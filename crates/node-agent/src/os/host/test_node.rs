//! A node of the agent for in-process tests of its steps, run by any user: a job table in a
//! temporary directory on the recording fake host ([`FakeHost`]), with a fake engine
//! ([`RecordingEngine`]) noting into the same log, and a job whose processes are the fake
//! cgroup's members (PIDs no kernel gives, so no scan of `/proc` finds anything of theirs).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ckpt_store::layout::Staging;

use super::fake::{Call, FakeHost, Latch, Log, Step};
use crate::engine::{DumpSpec, EngineError, RestoreSpec, SnapshotEngine};
use crate::jobs::Jobs;
use crate::os::cgroup::CgroupParent;
use crate::os::owner::LaunchPolicy;

/// The node's name: one no deployed node has, since the TCP hold of a restore is an
/// nftables table named after the node and the job, which is the machine's.
pub(crate) const NODE: &str = "fakehost-test-node";
/// The job the tests run.
pub(crate) const JOB: u64 = 7;
/// Its root process: above the kernel's PID limit (4,194,304), so never a real process.
pub(crate) const ROOT: i32 = 5_000_001;
/// Its other process.
pub(crate) const CHILD: i32 = 5_000_002;
/// Its owner: `nobody`, whom every system has and the default policy lets run jobs.
pub(crate) const OWNER: u32 = 65534;

/// Which image files of [`RecordingEngine`]'s hold only memory contents.
fn page_data(path: &str) -> bool {
    path.rsplit('/')
        .next()
        .is_some_and(|name| name.starts_with("pages-"))
}

/// The page data file [`RecordingEngine`] writes, relative to the node directory.
pub(crate) const PAGES: &str = "images/pages-1.img";

/// How a [`RecordingEngine`] restores page data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pages {
    /// Every file verified before the engine starts.
    VerifiedFirst,
    /// Page data may be verified while the engine restores, but there is too little of it:
    /// verified before the engine all the same, in its own step.
    CheckedFirst,
    /// Page data verified while the engine restores, behind the gate.
    BehindGate,
}

/// A snapshot engine that notes its dumps and restores in the host's log, writes a small
/// image set (a core file and a page data file), and dumps as the test scripts.
#[derive(Debug)]
pub(crate) struct RecordingEngine {
    log: Log,
    dump: Mutex<Step>,
    pages: Pages,
}

impl RecordingEngine {
    /// Sets how the next dumps answer ([`Step::Stuck`]: the engine fails).
    pub(crate) fn script_dump(&self, step: Step) {
        *self.dump.lock().expect("engine lock") = step;
    }
}

impl SnapshotEngine for RecordingEngine {
    fn name(&self) -> &str {
        "recording"
    }

    fn version(&self) -> &str {
        "1"
    }

    fn dump(&self, spec: &DumpSpec<'_>) -> Result<(), EngineError> {
        self.log.lock().expect("log lock").push(Call::Dump);
        let step = self.dump.lock().expect("engine lock").clone();
        match step {
            Step::Succeed => {}
            Step::Stuck => {
                return Err(EngineError::Failed {
                    engine: "criu",
                    op: "dump",
                    status: "exit status 1".into(),
                    summary: "the recording engine was told to fail".into(),
                    log: spec.log_file.to_path_buf(),
                })
            }
            // It hangs as an engine does that never ends by itself: until the latch opens,
            // or a stop ends it (then it fails as a stopped engine does).
            Step::Hang(latch) => {
                let begin = std::time::Instant::now();
                while !latch.is_open() && begin.elapsed() < std::time::Duration::from_secs(60) {
                    if spec
                        .stop
                        .is_some_and(|s| s.wait_stopped(std::time::Duration::from_millis(10)))
                    {
                        return Err(EngineError::Stopped {
                            engine: "criu",
                            op: "dump",
                            log: spec.log_file.to_path_buf(),
                        });
                    }
                }
            }
        }
        let io = |source| EngineError::Spawn {
            path: spec.images_dir.display().to_string(),
            source,
        };
        fs::write(spec.images_dir.join("core-1.img"), b"core of the tree").map_err(io)?;
        fs::write(spec.images_dir.join("pages-1.img"), vec![0x5a; 64 << 10]).map_err(io)
    }

    fn memory_only(&self) -> Option<fn(&str) -> bool> {
        match self.pages {
            Pages::VerifiedFirst => None,
            Pages::CheckedFirst | Pages::BehindGate => Some(page_data),
        }
    }

    fn gate_min_bytes(&self) -> u64 {
        match self.pages {
            Pages::BehindGate => 0,
            _ => u64::MAX,
        }
    }

    fn restore_argv(&self, spec: &RestoreSpec<'_>) -> Vec<String> {
        self.log.lock().expect("log lock").push(Call::RestoreArgv);
        vec![
            "recording-restore".into(),
            spec.images_dir.display().to_string(),
        ]
    }

    fn restore_failed(&self, status: String, log: &Path) -> EngineError {
        EngineError::Failed {
            engine: "criu",
            op: "restore",
            status,
            summary: "the recording engine's restore failed".into(),
            log: log.to_path_buf(),
        }
    }
}

/// The node's failpoint file, in its directory ([`crate::failpoint`]).
pub(crate) const FAILPOINTS: &str = "failpoints";

/// The node: its directory (removed on drop), job table, fake host and engine.
pub(crate) struct TestNode {
    /// Everything the node writes is below it.
    pub(crate) dir: tempfile::TempDir,
    /// The job table, on the fake host.
    pub(crate) jobs: Jobs,
    /// The fake host.
    pub(crate) host: Arc<FakeHost>,
    /// The fake engine (the node's default).
    pub(crate) engine: Arc<RecordingEngine>,
}

impl TestNode {
    /// A node [`NODE`] whose engine restores page data as `pages` says.
    pub(crate) fn new(pages: Pages) -> TestNode {
        let dir = tempfile::tempdir().expect("temporary directory");
        let log: Log = Arc::default();
        let host = Arc::new(FakeHost::new(log.clone()));
        let engine = Arc::new(RecordingEngine {
            log,
            dump: Mutex::default(),
            pages,
        });
        // A directory that passes for a cgroup v2 parent: only the fake touches the freezer.
        let cgroups = dir.path().join("cgroup");
        fs::create_dir(&cgroups).expect("cgroup parent");
        fs::write(cgroups.join("cgroup.controllers"), b"").expect("cgroup.controllers");
        let parent =
            CgroupParent::resolve(&cgroups.display().to_string(), "job-").expect("a cgroup parent");
        let staging = dir.path().join("staging");
        fs::create_dir(&staging).expect("staging");
        let jobs = Jobs::open(
            NODE.into(),
            dir.path().join("state"),
            Staging::at(staging),
            parent,
            engine.clone(),
            PathBuf::from("/nonexistent/ckpt-shim"),
        )
        .expect("job table")
        .with_launch_policy(LaunchPolicy::default())
        .with_failpoints(crate::failpoint::Failpoints::at(
            dir.path().join(FAILPOINTS),
        ))
        .with_host(host.clone());
        TestNode {
            dir,
            jobs,
            host,
            engine,
        }
    }

    /// Job [`JOB`] running here as [`OWNER`]: [`ROOT`] and [`CHILD`] in its cgroup, thawed.
    pub(crate) async fn run_job(&self) {
        let j = self.jobs.get_or_create(JOB).expect("job");
        let mut job = j.lock().await;
        job.record.incarnation = 1;
        job.record.root_pid = Some(ROOT);
        job.record.owner = Some(OWNER);
        job.save().expect("job record");
        self.host.run(&[ROOT, CHILD]);
    }

    /// The checkpoint steps of [`JOB`] here.
    pub(crate) fn run(&self) -> crate::checkpoint::CheckpointRun<'_> {
        crate::checkpoint::CheckpointRun::of(&self.jobs, JOB)
    }

    /// A whole checkpoint of [`JOB`] as `epoch`, the job thawed (or killed, with `kill`) after
    /// it; returns the node manifest's digest (what the coordinator commits).
    pub(crate) async fn checkpoint(&self, epoch: u32, kill: bool) -> String {
        let run = self.run();
        run.initial_sync(epoch).await.expect("initial-sync");
        run.quiesce(epoch).await.expect("quiesce");
        run.local_checkpoint(epoch, false)
            .await
            .expect("local-checkpoint");
        run.resume(epoch, kill).await.expect("resume");
        run.finalize(epoch).await.expect("finalize").manifest_digest
    }

    /// The epoch's node directory in staging.
    pub(crate) fn node_dir(&self, epoch: u32) -> PathBuf {
        self.jobs.node.node_dir(JOB, epoch, NODE)
    }

    /// Sets the node's failpoints (lines `PHASE=error` or `PHASE=delay:DURATION`).
    pub(crate) fn failpoints(&self, lines: &str) {
        fs::write(self.dir.path().join(FAILPOINTS), lines).expect("failpoint file");
    }

    /// A latch for a scripted hang.
    pub(crate) fn latch() -> Arc<Latch> {
        Arc::default()
    }
}
