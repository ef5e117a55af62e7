//! The jobs of this node and the checkpoint phases the agent runs on them. This file is the
//! table ([`Jobs`]: the map of jobs, each job's record and epoch state, their loading, saving and
//! locking); the services every step uses are the [`Node`] it holds (`node.rs`). The phases are
//! `impl Jobs` blocks in `launch/`, `checkpoint/`, `restore/`, `copies/` and `part/`.
//!
//! Each job has a directory `<state_dir>/jobs/<id>/` with its persisted record (`job.json`), its
//! stdout/stderr, engine logs, and one run directory per incarnation (`run/<n>/`) owned by that
//! incarnation's shim. Each checkpoint epoch walks a node-side phase machine
//! ([`NodePhase`]); a call in the wrong phase is refused with [`AgentError::WrongPhase`].
//!
//! Who may run jobs here is the [`LaunchPolicy`] (`allow_root_jobs`, `min_uid`); a job runs as
//! its owner's uid with the groups this node's user databases give it ([`crate::os::owner::Identity`]), whatever
//! the request says. Files: the directories on the way to a job's stdout and stderr
//! (`<state_dir>`, `jobs/`, `jobs/<id>/`) are 0711 (users pass through, nobody lists them);
//! stdout and stderr are 0600 and the job owner's; everything else the agent keeps (job
//! records, launch specs, engine logs, staging) is root's alone. Root does nothing by path in a
//! directory a job's owner controls: dump-time reads refuse symbolic links and other users'
//! files, and the put-back before a restore runs as the owner ([`crate::os::owner::PutBack`]).
//!
//! One file: the table with the record and epoch state of a job, which every step reads and the
//! table alone loads, saves and locks.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_proto::v1::Phase;
use ckpt_store::copy::CopyOptions;
use ckpt_store::layout::Staging;
use ckpt_store::manifest::{OpenFile, PreservedFile};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use tracing::warn;

use crate::engine::{EngineStop, Engines, SnapshotEngine};
use crate::error::{io_err, AgentError};
use crate::failpoint::Failpoints;
use crate::ibq::Channels;
use crate::node::{LaunchEnv, Node};
use crate::os::cgroup::{CgroupParent, Freezer, JobCgroup};
use crate::os::host::{Host, RealHost};
use crate::os::modes::{ensure_dir, protect_staging, write_private, PRIVATE_DIR, TRAVERSE_ONLY};
use crate::os::owner::{fix_job_dir_modes, LaunchPolicy};
use crate::os::procfs;
use crate::shim::{self, launched_as, Exit};

/// Name of the session directory under `<job dir>/session` ([`NodeJob::session_dir`]).
pub(crate) const SESSION: &str = "current";

/// The persisted record of a job on this node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRecord {
    /// Job id.
    pub id: u64,
    /// Bumped by every launch and restore.
    pub incarnation: u32,
    /// Root of the job's process tree in the current incarnation.
    pub root_pid: Option<i32>,
    /// The current incarnation's shim: PID and start time (to tell a reused PID apart).
    #[serde(default)]
    pub shim: Option<(i32, u64)>,
    /// The job's secret; `ckpt-rsh` presents it when it polls a part.
    #[serde(default)]
    pub token: String,
    /// 0: this node runs the job's command; >0: a part started through `ckpt-rsh`.
    #[serde(default)]
    pub part: u32,
    /// The job's owner (uid); unknown for records of an older agent.
    #[serde(default)]
    pub owner: Option<u32>,
    /// The part's job address, when it runs in a sandbox.
    #[serde(default)]
    pub sandbox: Option<crate::os::sandbox::JobAddress>,
    /// The snapshot engine the job runs under; empty: the default (CRIU).
    #[serde(default)]
    pub engine: String,
    /// The mount namespace (device, inode) the agent's last guarded restore made for the part
    /// (`shim/guard.rs`): its dumps run CRIU there. None: the node's.
    #[serde(default)]
    pub guarded_ns: Option<(u64, u64)>,
    /// The fenced port of the part's DMTCP coordinator ([`crate::os::fence`]), if it has one.
    #[serde(default)]
    pub coordinator_port: Option<u16>,
    /// The cgroup Slurm lent the current incarnation (`[slurm] adopt`): its Slurm job's
    /// extern step. None: the agent's own.
    #[serde(default)]
    pub slurm: Option<crate::os::cgroup::Lent>,
    /// ckptd may restart the part elsewhere by itself (the job has a restart policy): its shim
    /// kills it once the node's lease runs out ([`crate::rpc::lease`]). False: never fenced.
    #[serde(default)]
    pub may_move: bool,
    /// The part's TCP connections are locked on this node (`ckpt_lock_<node>_<job>`) since ckpt
    /// killed it after a checkpoint: lifted when the part runs here again.
    #[serde(default)]
    pub tcp_locked: bool,
}

impl JobRecord {
    /// Whether the current incarnation's shim still runs (the same process: PID and start
    /// time).
    pub(crate) fn shim_alive(&self) -> bool {
        self.shim.is_some_and(|(pid, start)| {
            procfs::stat(pid).is_some_and(|s| s.start_ticks == start && s.state != 'Z')
        })
    }
}

/// Where one epoch is on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodePhase {
    /// Initial synchronization passed; nothing changed yet.
    Synced,
    /// Quiesce, first round, where verbs layers only drained: they hold their objects and the
    /// processes run (their verbs calls held) until the second round releases and freezes.
    Drained,
    /// Quiesced: channels released; processes frozen.
    Quiesced,
    /// Local checkpoint taken: images written; processes still frozen.
    Checkpointed,
    /// Resumed: processes thawed (or killed).
    Resumed,
}

impl NodePhase {
    /// The protocol's name of the last phase this node finished.
    pub fn done(self) -> &'static str {
        match self {
            NodePhase::Synced => Phase::InitialSync.name(),
            NodePhase::Drained => "quiesce (first round: verbs layers drained)",
            NodePhase::Quiesced => Phase::Quiesce.name(),
            NodePhase::Checkpointed => Phase::LocalCheckpoint.name(),
            NodePhase::Resumed => Phase::Resume.name(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct EpochWork {
    pub(crate) epoch: u32,
    pub(crate) phase: NodePhase,
    pub(crate) node_dir: PathBuf,
    pub(crate) frozen_at: Option<Instant>,
    pub(crate) pids: Vec<i32>,
    pub(crate) root_pid: i32,
    pub(crate) open_files: Vec<OpenFile>,
    pub(crate) preserved: Vec<PreservedFile>,
    pub(crate) tcp_ports: Vec<u16>,
    pub(crate) tcp_addrs: Vec<String>,
    pub(crate) tids: Vec<i32>,
    pub(crate) notes: BTreeMap<String, String>,
    /// How long the engine kept the job suspended, where the engine (not a freeze) does.
    pub(crate) suspended: Option<Duration>,
    /// Held from just before the freeze to the end of the thaw: background copies wait.
    pub(crate) pause: Option<PauseGuard>,
    /// The job's pre-copy chain, held from initial synchronization to the end of the epoch
    /// (none where pre-copy is off).
    pub(crate) chain: Option<tokio::sync::OwnedMutexGuard<crate::copies::precopy::chain::Chain>>,
    /// The pre-dumps below this epoch's dump, as its manifest lists them.
    pub(crate) links: Vec<String>,
    /// The part's TCP connections are locked for the kill that ends this epoch (`--kill`),
    /// from before its dump: an abort lifts the lock.
    pub(crate) kill_lock: bool,
}

impl EpochWork {
    /// How long the job has been kept from running in this epoch: since the freeze, or what
    /// the engine that suspends jobs itself took.
    pub(crate) fn frozen_so_far(&self) -> Duration {
        match (self.suspended, self.frozen_at) {
            (Some(d), _) => d,
            (None, Some(t)) => t.elapsed(),
            (None, None) => Duration::ZERO,
        }
    }
}

/// One frozen job's hold on the node's background copies; released on drop.
#[derive(Debug)]
pub(crate) struct PauseGuard(Arc<std::sync::atomic::AtomicUsize>);

impl PauseGuard {
    pub(crate) fn new(counter: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        PauseGuard(counter.clone())
    }
}

impl Drop for PauseGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// What the agent sees of a job right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// Processes alive.
    Running,
    /// The root exited.
    Exited(Exit),
    /// No processes and no recorded exit (e.g. its shim was killed).
    Lost,
}

/// One job on this node.
#[derive(Debug)]
pub struct NodeJob {
    pub(crate) record: JobRecord,
    pub(crate) dir: PathBuf,
    pub(crate) cgroup: JobCgroup,
    pub(crate) work: Option<EpochWork>,
    /// Processes whose ib-quiesce channels are down (quiesced, or restored), to rebuild.
    pub(crate) ibq_down: Vec<i32>,
    /// How many channels a tree restored with new PIDs (DMTCP) holds: their processes are
    /// found among the job's at the rebuild, by the hellos they send once flagged.
    pub(crate) ibq_restored: usize,
    /// Processes whose verbs layers drained in this epoch's quiesce and still hold their
    /// objects (and map the device): released in local-checkpoint, before the job freezes,
    /// or resumed by an abort.
    pub(crate) layer_drained: Vec<i32>,
    /// Its pre-dumps on this node (see `copies/precopy.rs`).
    pub(crate) precopy: Arc<Mutex<crate::copies::precopy::chain::Chain>>,
}

impl NodeJob {
    pub(crate) fn run_dir(&self) -> PathBuf {
        self.dir
            .join("run")
            .join(self.record.incarnation.to_string())
    }

    /// The session directory, for engines that keep files of their own beside the job
    /// (DMTCP's coordinator port, images and saved files): the owner's, in a directory of
    /// root's (see [`crate::launch::make_session`]). The same path for every incarnation, and
    /// on every node with the same state directory: the engine records absolute paths in it
    /// at checkpoint time that a restart reads again.
    pub(crate) fn session_dir(&self) -> PathBuf {
        self.dir.join("session").join(SESSION)
    }

    pub(crate) fn save(&self) -> Result<(), AgentError> {
        let path = self.dir.join("job.json");
        write_private(
            &path,
            &serde_json::to_vec_pretty(&self.record).expect("serializable"),
        )
        .map_err(io_err(self.record.id, "write", &path))
    }

    /// Current state of the job's processes, its cgroup's members as `host` lists them.
    pub(crate) fn observe(&self, host: &dyn Host) -> Observed {
        if self.record.incarnation == 0 {
            return Observed::Lost;
        }
        if let Some(exit) = shim::read_json::<Exit>(&self.run_dir().join(shim::EXIT)) {
            return Observed::Exited(exit);
        }
        if host
            .pids(&self.cgroup)
            .map(|p| !p.is_empty())
            .unwrap_or(false)
        {
            return Observed::Running;
        }
        // The processes are gone but the shim has not written the exit status yet: it is
        // about to, so the job is not lost.
        if self.record.shim_alive() {
            return Observed::Running;
        }
        Observed::Lost
    }

    /// Puts the job's next incarnation in the cgroup Slurm lends it (`place`), or in the
    /// agent's own.
    pub(crate) fn settle_cgroup(
        &mut self,
        cgroups: &crate::os::cgroup::CgroupParent,
        place: Option<&crate::os::slurm::SlurmPlace>,
    ) {
        self.record.slurm = place.map(|p| crate::os::cgroup::Lent {
            slurm_job: p.step.job,
            socket: p.step.socket().to_path_buf(),
            freezer: p.cgroups.freezer.clone(),
            others: p.cgroups.others.clone(),
        });
        self.cgroup = match &self.record.slurm {
            Some(lent) => {
                // The agent's own cgroup of an earlier incarnation, if empty, goes.
                let own = cgroups.job(self.record.id);
                if own.exists() && own.pids().is_ok_and(|p| p.is_empty()) {
                    let _ = own.remove();
                }
                JobCgroup::lent(lent.clone())
            }
            None => cgroups.job(self.record.id),
        };
    }

    /// Removes the job's cgroup if it exists and holds no process.
    pub fn remove_empty_cgroup(&self) {
        if self.cgroup.exists() && self.cgroup.pids().map(|p| p.is_empty()).unwrap_or(false) {
            let _ = self.cgroup.remove();
        }
    }

    /// Job id.
    pub fn id(&self) -> u64 {
        self.record.id
    }

    /// Incarnation.
    pub fn incarnation(&self) -> u32 {
        self.record.incarnation
    }

    pub(crate) fn wrong_phase(&self, epoch: u32, call: &'static str) -> AgentError {
        let state = match &self.work {
            None => "no checkpoint in progress".to_string(),
            Some(w) if w.epoch != epoch => format!("epoch {} is in progress", w.epoch),
            Some(w) => format!("epoch {} has finished {}", w.epoch, w.phase.done()),
        };
        AgentError::WrongPhase {
            job: self.record.id,
            epoch,
            call,
            state,
        }
    }

    pub(crate) fn expect_phase(
        &mut self,
        epoch: u32,
        phase: NodePhase,
        call: &'static str,
    ) -> Result<&mut EpochWork, AgentError> {
        match &self.work {
            Some(w) if w.epoch == epoch && w.phase == phase => {
                Ok(self.work.as_mut().expect("checked"))
            }
            _ => Err(self.wrong_phase(epoch, call)),
        }
    }
}

/// The jobs of this node: the table of their records, each behind its own lock. The services
/// every step uses (engines, staging, cgroups, channels, the host, ...) are the [`Node`].
#[derive(Debug)]
pub struct Jobs {
    /// What this node has and runs its jobs with.
    pub(crate) node: Node,
    jobs: std::sync::Mutex<HashMap<u64, Arc<Mutex<NodeJob>>>>,
    /// Each job's dump in progress, reached without the job's lock (which the dump holds):
    /// an abort or a cancel ends it ([`EngineStop`]).
    stops: std::sync::Mutex<HashMap<u64, Arc<EngineStop>>>,
}

pub(crate) use ckpt_proto::now_ms;

/// One job of the table as its steps see it (`CheckpointRun`, `PartRun`): the node, the job's
/// id, its entry (none: the job is unknown here) and the stop of its dump.
pub struct JobRef<'a> {
    pub(crate) node: &'a Node,
    pub(crate) job_id: u64,
    pub(crate) job: Option<Arc<Mutex<NodeJob>>>,
    pub(crate) stop: Arc<EngineStop>,
}

impl JobRef<'_> {
    /// The job's entry, or the error that it is unknown here.
    pub(crate) fn entry(&self) -> Result<Arc<Mutex<NodeJob>>, AgentError> {
        self.job
            .clone()
            .ok_or(AgentError::UnknownJob { job: self.job_id })
    }
}

/// For the ib-quiesce control socket: the job whose cgroup is `cgroup`, and its owner (from the
/// job's record, set at launch and at restore).
fn ibq_job_owner(
    state_dir: PathBuf,
    cgroups: CgroupParent,
) -> impl Fn(&Path) -> Option<crate::ibq::JobOwner> + Send + Sync {
    move |cgroup: &Path| {
        // A job's cgroup is `<parent>/<prefix><id>`: try each tail of trailing digits as the id.
        let name = cgroup.file_name()?.to_str()?;
        let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        let own = (1..=digits.min(20))
            .filter_map(|k| name[name.len() - k..].parse::<u64>().ok())
            .find(|&id| cgroups.job(id).path() == cgroup);
        let jobs = state_dir.join("jobs");
        let record =
            |job: u64| shim::read_json::<JobRecord>(&jobs.join(job.to_string()).join("job.json"));
        let (job, record) = match own {
            Some(job) => (job, record(job)?),
            // Else a cgroup Slurm lent (`.../step_extern`): the job whose live part holds it
            // (one at a time, `Node::step_free`).
            None => {
                let job = live_holder(&state_dir, cgroup, 0)?;
                (job, record(job)?)
            }
        };
        Some(crate::ibq::JobOwner {
            job,
            uid: record.owner?,
        })
    }
}

impl Jobs {
    /// Opens the node's job table, reloading jobs persisted by an earlier agent run and
    /// thawing any left frozen by a checkpoint that the earlier run did not finish.
    pub fn open(
        node: String,
        state_dir: PathBuf,
        staging: Staging,
        cgroups: CgroupParent,
        engine: Arc<dyn SnapshotEngine>,
        shim_exe: PathBuf,
    ) -> std::io::Result<Self> {
        let jobs_dir = state_dir.join("jobs");
        ensure_dir(&state_dir, TRAVERSE_ONLY)?;
        ensure_dir(&jobs_dir, TRAVERSE_ONLY)?;
        protect_staging(staging.root());
        let mut map = HashMap::new();
        for ent in fs::read_dir(&jobs_dir)?.flatten() {
            let Some(mut record) = shim::read_json::<JobRecord>(&ent.path().join("job.json"))
            else {
                continue;
            };
            let mut cgroup = match &record.slurm {
                Some(lent) => JobCgroup::lent(lent.clone()),
                None => cgroups.job(record.id),
            };
            cgroup.set_tree(record.shim);
            // An older agent's record has no owner: that of the job's live root process, else
            // the user its newest launch here ran as.
            let owner = record.owner.or_else(|| {
                let root = record.root_pid?;
                cgroup
                    .pids()
                    .ok()?
                    .contains(&root)
                    .then(|| procfs::uid_of(root))?
            });
            record.owner = owner.or_else(|| launched_as(&ent.path(), record.incarnation));
            fix_job_dir_modes(&ent.path(), record.owner);
            if cgroup.exists() && cgroup.state().is_ok_and(|s| s != Freezer::Thawed) {
                warn!(
                    job = record.id,
                    "thawing a job left frozen by an interrupted checkpoint"
                );
                if let Err(e) = cgroup.thaw() {
                    warn!(job = record.id, error = %e, "cannot thaw");
                }
            }
            let job = NodeJob {
                dir: ent.path(),
                cgroup,
                record,
                work: None,
                ibq_down: Vec::new(),
                ibq_restored: 0,
                layer_drained: Vec::new(),
                precopy: Arc::default(),
            };
            map.insert(job.record.id, Arc::new(Mutex::new(job)));
        }
        let channels = Channels::new(
            state_dir.join("ibq").join("control.sock"),
            ibq_job_owner(state_dir.clone(), cgroups.clone()),
        );
        let lease = crate::rpc::lease::Keeper::open(&state_dir);
        Ok(Jobs {
            node: Node {
                name: node,
                state_dir,
                staging,
                cgroups,
                engines: Engines::new(engine.clone(), Vec::new()),
                engine,
                shim_exe,
                job_link: None,
                failpoints: Failpoints::from_env(),
                launch_env: LaunchEnv::default(),
                credential: None,
                shared: None,
                copy_opts: CopyOptions::default(),
                frozen: Arc::default(),
                channels,
                policy: LaunchPolicy::default(),
                slurm: Default::default(),
                precopy: crate::copies::precopy::chain::Mode::Off("pre-copy is not set up".into()),
                fence: crate::os::fence::Fence::off(),
                lease,
                leader_fence: Arc::default(),
                exits: Arc::default(),
                host: Arc::new(RealHost),
            },
            jobs: std::sync::Mutex::new(map),
            stops: std::sync::Mutex::default(),
        })
    }

    /// Sets what the checkpoint and restore steps ask of the machine (the machine itself,
    /// [`RealHost`], unless set; tests pass a recording fake).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn with_host(mut self, host: Arc<dyn Host>) -> Self {
        self.node.host = host;
        self
    }

    /// Fences the DMTCP coordinators of jobs here ([`crate::os::fence`]), those of the running
    /// jobs found at start again; `prefix` names the table (the cgroup prefix).
    pub fn with_fence(mut self, prefix: &str) -> Self {
        let keep: Vec<(u16, u32)> = self
            .snapshot()
            .iter()
            .filter_map(|j| {
                let j = j.try_lock().ok()?;
                let port = j.record.coordinator_port?;
                (j.observe(self.node.host.as_ref()) == Observed::Running)
                    .then_some((port, j.record.owner?))
            })
            .collect();
        self.node.fence = crate::os::fence::Fence::start(prefix, &keep);
        self
    }

    /// Sets whether jobs here are pre-copied.
    pub fn with_precopy(mut self, mode: crate::copies::precopy::chain::Mode) -> Self {
        self.node.precopy = mode;
        self
    }

    /// Adds the engines besides the default one.
    pub fn with_engines(mut self, others: Vec<Arc<dyn SnapshotEngine>>) -> Self {
        self.node.engines = Engines::new(self.node.engine.clone(), others);
        self
    }

    /// Sets the failpoints the checkpoint phases run (instead of those [`crate::failpoint::ENV`]
    /// names).
    pub fn with_failpoints(mut self, failpoints: Failpoints) -> Self {
        self.node.failpoints = failpoints;
        self
    }

    /// Sets the interface that sandboxes' job addresses go on.
    pub fn with_job_link(mut self, link: Option<String>) -> Self {
        self.node.job_link = link;
        self
    }

    /// Sets who may run jobs here.
    pub fn with_launch_policy(mut self, policy: LaunchPolicy) -> Self {
        self.node.policy = policy;
        self
    }

    /// Sets whether Slurm must have given a job's owner this node (`[slurm] enforce`).
    pub fn with_slurm_gate(mut self, gate: crate::os::slurm::SlurmGate) -> Self {
        self.node.slurm = gate;
        self
    }

    /// Sets what launches add to jobs' environments.
    pub fn with_launch_env(mut self, env: LaunchEnv) -> Self {
        self.node.launch_env = env;
        self
    }

    /// Sets the credential partner copies are made with.
    pub fn with_credential(mut self, credential: Option<ckpt_auth::tls::Credential>) -> Self {
        self.node.credential = credential;
        self
    }

    /// Sets the shared storage epochs are flushed to and how copies to and from it run.
    pub fn with_shared(mut self, dir: Option<PathBuf>, opts: CopyOptions) -> Self {
        self.node.shared = dir.map(Staging::at);
        self.node.copy_opts = opts;
        self
    }

    /// The ib-quiesce channel registry (the daemon serves its socket).
    pub fn channels(&self) -> &Arc<Channels> {
        &self.node.channels
    }

    /// Node name.
    pub fn node(&self) -> &str {
        &self.node.name
    }

    /// This node's cluster credential (none in the standalone daemon).
    pub fn credential(&self) -> Option<&ckpt_auth::tls::Credential> {
        self.node.credential.as_ref()
    }

    /// The default snapshot engine.
    pub fn engine(&self) -> &Arc<dyn SnapshotEngine> {
        &self.node.engine
    }

    /// Every snapshot engine of this node.
    pub fn engines(&self) -> &Engines {
        &self.node.engines
    }

    pub(crate) fn get(&self, job: u64) -> Result<Arc<Mutex<NodeJob>>, AgentError> {
        self.jobs
            .lock()
            .expect("jobs lock")
            .get(&job)
            .cloned()
            .ok_or(AgentError::UnknownJob { job })
    }

    /// What a step of job `job` uses of the table: the node, the job's entry if this node
    /// knows it, and the stop of its dump (for an unknown job, one nobody else holds).
    pub(crate) fn job_ref(&self, job: u64) -> JobRef<'_> {
        let (entry, stop) = match self.get(job) {
            Ok(j) => (Some(j), self.engine_stop(job)),
            Err(_) => (None, Arc::default()),
        };
        JobRef {
            node: &self.node,
            job_id: job,
            job: entry,
            stop,
        }
    }

    /// Job `job`'s dump in progress, to begin, run or stop one: reached without the job's
    /// lock, which a dump holds.
    pub(crate) fn engine_stop(&self, job: u64) -> Arc<EngineStop> {
        self.stops
            .lock()
            .expect("stops lock")
            .entry(job)
            .or_default()
            .clone()
    }

    pub(crate) fn get_or_create(&self, job: u64) -> Result<Arc<Mutex<NodeJob>>, AgentError> {
        let mut map = self.jobs.lock().expect("jobs lock");
        if let Some(j) = map.get(&job) {
            return Ok(j.clone());
        }
        let dir = self.node.state_dir.join("jobs").join(job.to_string());
        let logs = dir.join("logs");
        ensure_dir(&dir, TRAVERSE_ONLY)
            .and_then(|()| ensure_dir(&logs, PRIVATE_DIR))
            .map_err(|source| AgentError::Io {
                job,
                what: "create",
                path: dir.clone(),
                source,
            })?;
        let j = Arc::new(Mutex::new(NodeJob {
            record: JobRecord {
                id: job,
                incarnation: 0,
                root_pid: None,
                shim: None,
                token: String::new(),
                part: 0,
                owner: None,
                sandbox: None,
                engine: String::new(),
                guarded_ns: None,
                coordinator_port: None,
                slurm: None,
                may_move: false,
                tcp_locked: false,
            },
            dir,
            cgroup: self.node.cgroups.job(job),
            work: None,
            ibq_down: Vec::new(),
            ibq_restored: 0,
            layer_drained: Vec::new(),
            precopy: Arc::default(),
        }));
        map.insert(job, j.clone());
        Ok(j)
    }

    /// All jobs (for heartbeats), skipping any whose lock is held by a running phase.
    pub fn snapshot(&self) -> Vec<Arc<Mutex<NodeJob>>> {
        self.jobs
            .lock()
            .expect("jobs lock")
            .values()
            .cloned()
            .collect()
    }

    /// Directory of a job on this node.
    pub fn job_dir(&self, job: u64) -> PathBuf {
        self.node.state_dir.join("jobs").join(job.to_string())
    }
}

impl Node {
    /// Refuses to put job `job`'s part into a Slurm job's step (`place`) that another live
    /// part of this node already holds: the step is frozen as one, so a checkpoint of either
    /// would freeze and thaw the other.
    pub(crate) fn step_free(
        &self,
        job: u64,
        uid: u32,
        place: Option<&crate::os::slurm::SlurmPlace>,
    ) -> Result<(), AgentError> {
        let Some(p) = place else { return Ok(()) };
        if let Some(other) = live_holder(&self.state_dir, &p.cgroups.freezer, job) {
            return Err(AgentError::SlurmAdoption {
                job,
                node: self.name.clone(),
                uid,
                why: format!(
                    "ckpt job {other} already runs in Slurm job {}'s extern step here, and a step holds one (a checkpoint freezes the whole step): cancel job {other}, run this one from another Slurm job, or set [slurm] adopt = false",
                    p.step.job
                ),
            });
        }
        Ok(())
    }
}

/// A job other than `except` whose record puts its live part (its shim still running) in the
/// cgroup Slurm lent at `freezer`.
fn live_holder(state_dir: &Path, freezer: &Path, except: u64) -> Option<u64> {
    fs::read_dir(state_dir.join("jobs"))
        .ok()?
        .flatten()
        .filter_map(|e| shim::read_json::<JobRecord>(&e.path().join("job.json")))
        .find(|r| {
            r.id != except
                && r.slurm.as_ref().is_some_and(|l| l.freezer == freezer)
                && r.shim_alive()
        })
        .map(|r| r.id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn agent_directories_and_records_get_explicit_modes() {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("new/state");
        ensure_dir(&state, TRAVERSE_ONLY).unwrap();
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&state), 0o711);
        assert_eq!(
            mode(&d.path().join("new")),
            0o755,
            "missing parents like /var/lib"
        );
        let rec = state.join("job.json");
        write_private(&rec, b"{}").unwrap();
        assert_eq!(mode(&rec), 0o600);
        // An older agent's job directory, made with umask 022.
        let job = state.join("7");
        for sub in ["logs", "run/1"] {
            fs::create_dir_all(job.join(sub)).unwrap();
        }
        for f in ["job.json", "stdout", "run/1/spec.json"] {
            fs::write(job.join(f), b"x").unwrap();
        }
        for p in [&job, &job.join("logs"), &job.join("run")] {
            fs::set_permissions(p, fs::Permissions::from_mode(0o755)).unwrap();
        }
        fs::set_permissions(job.join("job.json"), fs::Permissions::from_mode(0o644)).unwrap();
        fs::set_permissions(job.join("stdout"), fs::Permissions::from_mode(0o644)).unwrap();
        fix_job_dir_modes(&job, None);
        assert_eq!(mode(&job), 0o711);
        assert_eq!(mode(&job.join("logs")), 0o700);
        assert_eq!(mode(&job.join("run")), 0o700);
        assert_eq!(mode(&job.join("job.json")), 0o600);
        assert_eq!(mode(&job.join("stdout")), 0o600);
    }

    #[test]
    fn staging_is_made_private() {
        let d = tempfile::tempdir().unwrap();
        let own = d.path().join("local");
        fs::create_dir(&own).unwrap();
        fs::set_permissions(&own, fs::Permissions::from_mode(0o755)).unwrap();
        protect_staging(&own);
        assert_eq!(fs::metadata(&own).unwrap().mode() & 0o7777, 0o700);
    }
}
