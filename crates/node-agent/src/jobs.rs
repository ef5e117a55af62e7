//! The jobs of this node and the checkpoint phases the agent runs on them.
//!
//! Each job has a directory `<state_dir>/jobs/<id>/` with its persisted record (`job.json`), its
//! stdout/stderr, engine logs, and one run directory per incarnation (`run/<n>/`) owned by that
//! incarnation's shim. Each checkpoint epoch walks a node-side phase machine
//! ([`NodePhase`]); a call in the wrong phase is refused with [`AgentError::WrongPhase`].
//!
//! Who may run jobs here is the [`LaunchPolicy`] (`allow_root_jobs`, `min_uid`); a job runs as
//! its owner's uid with the groups this node's user databases give it ([`Identity`]), whatever
//! the request says. Files: the directories on the way to a job's stdout and stderr
//! (`<state_dir>`, `jobs/`, `jobs/<id>/`) are 0711 (users pass through, nobody lists them);
//! stdout and stderr are 0600 and the job owner's; everything else the agent keeps (job
//! records, launch specs, engine logs, staging) is root's alone. Root does nothing by path in a
//! directory a job's owner controls: dump-time reads refuse symbolic links and other users'
//! files, and the put-back before a restore runs as the owner ([`crate::owner::PutBack`]).
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ckpt_store::copy::{CopyOptions, CopyProgress};
use ckpt_store::layout::Staging;
use ckpt_store::manifest::{self, NodeManifest, OpenFile, PreservedFile};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use tracing::{info, instrument, warn};

use crate::cgroup::{CgroupParent, JobCgroup};
use crate::engine::{DumpSpec, RestoreSpec, SnapshotEngine};
use crate::error::AgentError;
use crate::failpoint::{Action, Failpoints};
use crate::ibq::{ChannelFailure, Channels, Rebuilt};
use crate::modes::{
    ensure_dir, fix_job_dir_modes, protect_staging, set_mode, write_private, PRIVATE_DIR,
    PRIVATE_FILE, TRAVERSE_ONLY,
};
pub use crate::owner::LaunchPolicy;
use crate::owner::{
    put_back_own_output, run_put_back, verify_restored, Identity, PutBack, PutBackTask,
};
use crate::procfs;
use crate::shim::{self, Exit, ShimMode, ShimSpec, Started};

/// How long a newly started shim may take to report the job's root running. Exec of a
/// launcher is milliseconds; 30 s covers a loaded node.
pub const LAUNCH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a restore may take: the engine reads every image page back; at a pessimistic
/// 100 MB/s this covers 60 GB per node.
pub const RESTORE_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a restore waits for the PIDs of a just-killed incarnation to be released. Zombies
/// of killed processes linger until reaped, which init can take over a second to do.
pub const PID_FREE_TIMEOUT: Duration = Duration::from_secs(10);
/// Headroom over the resident size when checking staging room: images add metadata, and a
/// checkpoint that fills the disk fails late.
const ROOM_FACTOR: f64 = 1.10;
/// Manifest note naming the uid of the job's owner: a restore puts files back as that user,
/// and checks that the node still lets it run jobs.
const OWNER_NOTE: &str = "owner_uid";

/// The uid the newest launch of a job (in `dir`, incarnations up to `incarnation`) ran as.
fn launched_as(dir: &Path, incarnation: u32) -> Option<u32> {
    (1..=incarnation).rev().find_map(|n| {
        let spec = dir.join("run").join(n.to_string()).join(shim::SPEC);
        match shim::read_json::<ShimSpec>(&spec)?.mode {
            ShimMode::Launch { uid, .. } => Some(uid),
            ShimMode::Restore { .. } => None,
        }
    })
}

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
}

/// Where one epoch is on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodePhase {
    /// Initial synchronization passed; nothing changed yet.
    Prepared,
    /// Processes frozen.
    Frozen,
    /// Images written; processes still frozen.
    Dumped,
    /// Processes thawed (or killed).
    Resumed,
}

#[derive(Debug)]
struct EpochWork {
    epoch: u32,
    phase: NodePhase,
    node_dir: PathBuf,
    frozen_at: Option<Instant>,
    pids: Vec<i32>,
    root_pid: i32,
    open_files: Vec<OpenFile>,
    preserved: Vec<PreservedFile>,
    tcp_ports: Vec<u16>,
    tcp_addrs: Vec<String>,
    tids: Vec<i32>,
    notes: BTreeMap<String, String>,
    /// Held from just before the freeze to the end of the thaw: background copies wait.
    pause: Option<PauseGuard>,
}

/// One frozen job's hold on the node's background copies; released on drop.
#[derive(Debug)]
struct PauseGuard(Arc<std::sync::atomic::AtomicUsize>);

impl PauseGuard {
    fn new(counter: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
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
    record: JobRecord,
    dir: PathBuf,
    cgroup: JobCgroup,
    work: Option<EpochWork>,
    /// Processes whose ib-quiesce channels are down (quiesced, or restored), to rebuild.
    ibq_down: Vec<i32>,
}

impl NodeJob {
    fn run_dir(&self) -> PathBuf {
        self.dir
            .join("run")
            .join(self.record.incarnation.to_string())
    }

    fn save(&self) -> Result<(), AgentError> {
        let path = self.dir.join("job.json");
        write_private(
            &path,
            &serde_json::to_vec_pretty(&self.record).expect("serializable"),
        )
        .map_err(io_err(self.record.id, "write", &path))
    }

    /// Current state of the job's processes.
    pub fn observe(&self) -> Observed {
        if self.record.incarnation == 0 {
            return Observed::Lost;
        }
        if let Some(exit) = shim::read_json::<Exit>(&self.run_dir().join(shim::EXIT)) {
            return Observed::Exited(exit);
        }
        if self.cgroup.pids().map(|p| !p.is_empty()).unwrap_or(false) {
            return Observed::Running;
        }
        // The processes are gone but the shim has not written the exit status yet: it is
        // about to, so the job is not lost.
        let shim_alive = self.record.shim.is_some_and(|(pid, start)| {
            procfs::stat(pid).is_some_and(|s| s.start_ticks == start && s.state != 'Z')
        });
        if shim_alive {
            return Observed::Running;
        }
        Observed::Lost
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

    fn wrong_phase(&self, epoch: u32, call: &'static str) -> AgentError {
        let state = match &self.work {
            None => "no checkpoint in progress".to_string(),
            Some(w) if w.epoch != epoch => format!("epoch {} is in progress", w.epoch),
            Some(w) => format!("epoch {} is {:?}", w.epoch, w.phase),
        };
        AgentError::WrongPhase {
            job: self.record.id,
            epoch,
            call,
            state,
        }
    }

    fn expect_phase(
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

/// Result of a finished local checkpoint.
#[derive(Debug, Clone)]
pub struct Finalized {
    /// Total image bytes.
    pub image_bytes: u64,
    /// Number of image files.
    pub image_files: u32,
    /// Digest of the node manifest.
    pub manifest_digest: String,
}

/// Result of initial synchronization.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Processes in the job on this node.
    pub processes: u32,
    /// Estimated image size.
    pub estimated_bytes: u64,
    /// Free bytes in staging.
    pub staging_free_bytes: u64,
    /// ib-quiesce channels among the processes.
    pub channels: u32,
}

/// What a launch needs.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Job id.
    pub job: u64,
    /// Command.
    pub argv: Vec<String>,
    /// Working directory.
    pub cwd: PathBuf,
    /// Environment.
    pub env: BTreeMap<String, String>,
    /// User.
    pub uid: u32,
    /// Group: not used, the agent takes the uid's primary group from this node's passwd.
    pub gid: u32,
    /// Supplementary groups: not used, the agent asks this node's group database.
    pub groups: Vec<u32>,
    /// The job's secret.
    pub token: String,
    /// 0: the job's command; >0: a part started through `ckpt-rsh`.
    pub part: u32,
}

/// What the agent adds to every job's environment so that its MPI launcher reaches other
/// nodes through ckpt.
#[derive(Debug, Clone, Default)]
pub struct LaunchEnv {
    /// The coordinator's agent-facing address (`CKPT_COORDINATOR`).
    pub coordinator: String,
    /// `ckpt-rsh`, if installed.
    pub launcher: Option<PathBuf>,
    /// The cluster CA certificate `ckpt-rsh` checks the daemons against (`CKPT_TLS_CA`); none
    /// when the coordinator is reached over a local socket.
    pub ca: Option<PathBuf>,
    /// Point Hydra and Open MPI at `launcher` unless the job chose a launcher itself.
    pub set_mpi_env: bool,
}

impl LaunchEnv {
    /// Adds the job's identity and the launcher settings to `env`.
    pub fn apply(&self, env: &mut BTreeMap<String, String>, job: u64, token: &str, node: &str) {
        env.insert("CKPT_JOB_ID".into(), job.to_string());
        env.insert("CKPT_JOB_TOKEN".into(), token.into());
        env.insert("CKPT_NODE".into(), node.into());
        if !self.coordinator.is_empty() {
            env.insert("CKPT_COORDINATOR".into(), self.coordinator.clone());
        }
        if let Some(ca) = &self.ca {
            env.insert("CKPT_TLS_CA".into(), ca.display().to_string());
        }
        let Some(l) = &self.launcher else { return };
        let l = l.display().to_string();
        env.insert("CKPT_RSH".into(), l.clone());
        if self.set_mpi_env {
            for (k, v) in [
                ("HYDRA_LAUNCHER", "ssh"),
                ("HYDRA_LAUNCHER_EXEC", l.as_str()),
                ("OMPI_MCA_plm", "rsh"),
                ("OMPI_MCA_plm_rsh_agent", l.as_str()),
            ] {
                env.entry(k.into()).or_insert_with(|| v.into());
            }
        }
    }
}

/// A part's new output and state, for `ckpt-rsh`.
#[derive(Debug, Clone)]
pub struct PollResult {
    /// Output after the stdout offset.
    pub stdout: Vec<u8>,
    /// Output after the stderr offset.
    pub stderr: Vec<u8>,
    /// The part's state; an exit is only reported with the last of its output.
    pub observed: Observed,
}

/// Largest chunk of each stream one poll returns.
const POLL_CHUNK: u64 = 1 << 20;

/// The jobs of this node and everything needed to act on them.
#[derive(Debug)]
pub struct Jobs {
    node: String,
    state_dir: PathBuf,
    staging: Staging,
    cgroups: CgroupParent,
    engine: Arc<dyn SnapshotEngine>,
    shim_exe: PathBuf,
    jobs: std::sync::Mutex<HashMap<u64, Arc<Mutex<NodeJob>>>>,
    failpoints: Failpoints,
    launch_env: LaunchEnv,
    /// This node's cluster credential, for partner copies to and from other agents; none when
    /// embedded in a standalone ckptd.
    credential: Option<ckpt_auth::tls::Credential>,
    shared: Option<Staging>,
    copy_opts: CopyOptions,
    /// Jobs frozen on this node right now: flushes and partner copies wait while above zero.
    frozen: Arc<std::sync::atomic::AtomicUsize>,
    /// The ib-quiesce channels of job processes.
    channels: Arc<Channels>,
    /// Who may run jobs here.
    policy: LaunchPolicy,
}

/// Where a restore may find this node's images besides its own staging.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// The node keeping a partner copy, and its agent's host:port.
    pub partner: Option<(String, String)>,
    /// The epoch is complete in shared storage.
    pub shared_durable: bool,
    /// Retention deleted the local copies: do not look for them.
    pub local_pruned: bool,
}

/// A flush running in a blocking thread.
pub type FlushTask = tokio::task::JoinHandle<Result<ckpt_store::dedup::FlushStats, AgentError>>;

/// A restored part of a job.
#[derive(Debug)]
pub struct Restored {
    /// PID of the restored root process.
    pub pid: i32,
    /// The job's incarnation on this node.
    pub incarnation: u32,
    /// Where the images came from.
    pub source: Location,
    /// Why the local copy was not used (empty if it was).
    pub note: String,
    /// ib-quiesce channels in the restored processes (rebuilt after the release).
    pub channels: u32,
}

/// Where a copy of a node's images is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// Node-local staging.
    Local,
    /// Another node's staging.
    Partner,
    /// Shared storage.
    Shared,
}

impl Location {
    /// Name shown to users.
    pub fn name(self) -> &'static str {
        match self {
            Location::Local => "local",
            Location::Partner => "partner",
            Location::Shared => "shared",
        }
    }
}

/// The outcome of checking one copy.
#[derive(Debug)]
pub struct CopyCheck {
    /// Which copy.
    pub location: Location,
    /// Its manifest if every file is intact.
    pub result: Result<NodeManifest, AgentError>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
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
        let job = (1..=digits.min(20))
            .filter_map(|k| name[name.len() - k..].parse::<u64>().ok())
            .find(|&id| cgroups.job(id).path() == cgroup)?;
        let dir = state_dir.join("jobs").join(job.to_string());
        let uid = shim::read_json::<JobRecord>(&dir.join("job.json"))?.owner?;
        Some(crate::ibq::JobOwner { job, uid })
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
            let cgroup = cgroups.job(record.id);
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
            if cgroup.exists() && cgroup.state().map(|s| s != "THAWED").unwrap_or(false) {
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
            };
            map.insert(job.record.id, Arc::new(Mutex::new(job)));
        }
        let channels = Channels::new(
            state_dir.join("ibq").join("control.sock"),
            ibq_job_owner(state_dir.clone(), cgroups.clone()),
        );
        Ok(Jobs {
            node,
            state_dir,
            staging,
            cgroups,
            engine,
            shim_exe,
            jobs: std::sync::Mutex::new(map),
            failpoints: Failpoints::from_env(),
            launch_env: LaunchEnv::default(),
            credential: None,
            shared: None,
            copy_opts: CopyOptions::default(),
            frozen: Arc::default(),
            channels,
            policy: LaunchPolicy::default(),
        })
    }

    /// Sets who may run jobs here.
    pub fn with_launch_policy(mut self, policy: LaunchPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets what launches add to jobs' environments.
    pub fn with_launch_env(mut self, env: LaunchEnv) -> Self {
        self.launch_env = env;
        self
    }

    /// Sets the credential partner copies are made with.
    pub fn with_credential(mut self, credential: Option<ckpt_auth::tls::Credential>) -> Self {
        self.credential = credential;
        self
    }

    /// Sets the shared storage epochs are flushed to and how copies to and from it run.
    pub fn with_shared(mut self, dir: Option<PathBuf>, opts: CopyOptions) -> Self {
        self.shared = dir.map(Staging::at);
        self.copy_opts = opts;
        self
    }

    /// The shared storage mount, if configured.
    pub fn shared_dir(&self) -> Option<&Path> {
        self.shared.as_ref().map(|s| s.root())
    }

    /// The shared store, if configured and mounted.
    fn shared(&self, job: u64) -> Result<Staging, AgentError> {
        let s = self.shared.clone().ok_or_else(|| AgentError::NoShared {
            job,
            problem: format!("node {} has no shared storage", self.node),
        })?;
        if !s.root().is_dir() {
            return Err(AgentError::NoShared {
                job,
                problem: format!(
                    "shared_dir {} does not exist on node {} (is the file system mounted?)",
                    s.root().display(),
                    self.node
                ),
            });
        }
        Ok(s)
    }

    /// Starts copying this node's images of a committed epoch to shared storage, in a blocking
    /// thread; returns its progress and the task. Does not touch the job: it may have moved
    /// on, or ended.
    pub fn flush(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
    ) -> Result<(Arc<CopyProgress>, FlushTask), AgentError> {
        let shared = self.shared(job_id)?;
        let src = self.staging.node_dir(job_id, epoch, &self.node);
        let progress = Arc::new(CopyProgress::pausing_on(self.frozen.clone()));
        let (p, opts, digest, node) = (
            progress.clone(),
            self.copy_opts.clone(),
            committed_digest.to_string(),
            self.node.clone(),
        );
        let task = tokio::task::spawn_blocking(move || {
            let r = ckpt_store::dedup::flush(
                &src,
                &shared,
                target(job_id, epoch, &node),
                &digest,
                &opts,
                &p,
            );
            if r.is_err() {
                // An incomplete copy has no manifest and is never used; do not keep its bytes.
                let _ = fs::remove_dir_all(shared.node_dir(job_id, epoch, &node));
                let _ = ckpt_store::dedup::sweep(&shared, job_id, &node);
            }
            r.map_err(|source| AgentError::Store {
                job: job_id,
                source,
            })
        });
        Ok((progress, task))
    }

    /// Writes an epoch's commit record into shared storage after checking that every node's
    /// flushed manifest there is the committed one.
    pub async fn publish(
        &self,
        record: ckpt_store::commit::CommitRecord,
    ) -> Result<(), AgentError> {
        let job = record.job_id;
        let shared = self.shared(job)?;
        tokio::task::spawn_blocking(move || -> Result<(), ckpt_store::StoreError> {
            for (node, want) in &record.manifests {
                let dir = shared.node_dir(job, record.epoch, node);
                let (_, found) = manifest::read(&dir)?;
                if &found != want {
                    return Err(ckpt_store::StoreError::NotCommitted {
                        path: dir.join(manifest::FILE_NAME),
                        found,
                        expected: want.clone(),
                    });
                }
            }
            ckpt_store::commit::write(&shared.epoch_dir(job, record.epoch), &record)
        })
        .await
        .expect("publish task")
        .map_err(|source| AgentError::Store { job, source })
    }

    /// Runs the failpoint of `phase`, if one is set (tests only; see [`crate::failpoint`]).
    async fn failpoint(&self, job: u64, phase: &'static str) -> Result<(), AgentError> {
        match self.failpoints.action(phase) {
            None => Ok(()),
            Some(Action::Error) => Err(AgentError::Injected { job, phase }),
            Some(Action::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
        }
    }

    /// Node name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The snapshot engine.
    pub fn engine(&self) -> &Arc<dyn SnapshotEngine> {
        &self.engine
    }

    fn get(&self, job: u64) -> Result<Arc<Mutex<NodeJob>>, AgentError> {
        self.jobs
            .lock()
            .expect("jobs lock")
            .get(&job)
            .cloned()
            .ok_or(AgentError::UnknownJob { job })
    }

    fn get_or_create(&self, job: u64) -> Result<Arc<Mutex<NodeJob>>, AgentError> {
        let mut map = self.jobs.lock().expect("jobs lock");
        if let Some(j) = map.get(&job) {
            return Ok(j.clone());
        }
        let dir = self.state_dir.join("jobs").join(job.to_string());
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
            },
            dir,
            cgroup: self.cgroups.job(job),
            work: None,
            ibq_down: Vec::new(),
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
        self.state_dir.join("jobs").join(job.to_string())
    }

    async fn start_shim(
        &self,
        job: &mut NodeJob,
        mode: ShimMode,
        owner: &Identity,
        timeout: Duration,
    ) -> Result<i32, AgentError> {
        let id = job.record.id;
        job.record.incarnation += 1;
        job.record.root_pid = None;
        let run_dir = job.run_dir();
        let io = |what, path: &Path| io_err(id, what, path);
        ensure_dir(&job.dir.join("run"), PRIVATE_DIR)
            .and_then(|()| ensure_dir(&run_dir, PRIVATE_DIR))
            .map_err(io("create", &run_dir))?;
        job.cgroup
            .create()
            .map_err(|source| AgentError::Cgroup { job: id, source })?;
        let spec = ShimSpec {
            mode,
            cgroup_procs: job.cgroup.procs_file(),
            stdout: job.dir.join("stdout"),
            stderr: job.dir.join("stderr"),
            run_dir: run_dir.clone(),
            output_owner: Some((owner.uid, owner.gid)),
        };
        let spec_path = run_dir.join(shim::SPEC);
        // It holds the job's secret and whole environment.
        write_private(
            &spec_path,
            &serde_json::to_vec_pretty(&spec).expect("serializable"),
        )
        .map_err(io("write", &spec_path))?;
        job.save()?;
        let log = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(PRIVATE_FILE)
            .open(run_dir.join("shim.log"))
            .map_err(io("create", &run_dir))?;
        let log2 = log.try_clone().map_err(io("create", &run_dir))?;
        let mut cmd = tokio::process::Command::new(&self.shim_exe);
        cmd.arg("shim")
            .arg(&spec_path)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2);
        // SAFETY: setsid is async-signal-safe; the shim leaves the agent's session so that
        // stopping the agent does not stop jobs.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| AgentError::Start {
            job: id,
            message: format!("cannot start shim {}: {e}", self.shim_exe.display()),
        })?;
        job.record.shim = child
            .id()
            .and_then(|pid| procfs::stat(pid as i32))
            .map(|s| (s.pid, s.start_ticks));
        // Reap the shim whenever it ends; the job's exit status is in its run directory.
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        let started_file = run_dir.join(shim::STARTED);
        let begin = Instant::now();
        let started = loop {
            if let Some(s) = shim::read_json::<Started>(&started_file) {
                break s;
            }
            if begin.elapsed() > timeout {
                return Err(AgentError::Timeout {
                    job: id,
                    what: "job start",
                    waited: timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        match started {
            Started::Running { root_pid } => {
                job.record.root_pid = Some(root_pid);
                job.save()?;
                Ok(root_pid)
            }
            Started::Failed { error } => Err(AgentError::Start {
                job: id,
                message: error,
            }),
        }
    }

    /// Starts a job's command on this node.
    #[instrument(skip_all, fields(job = spec.job))]
    pub async fn launch(&self, spec: LaunchSpec) -> Result<(i32, u32), AgentError> {
        // Checked before anything is created: a refused launch leaves nothing behind. The
        // request's gid and groups are not used.
        let owner = self.policy.authorize(spec.job, &self.node, spec.uid)?;
        let j = self.get_or_create(spec.job)?;
        let mut job = j.lock().await;
        if job.observe() == Observed::Running {
            return Err(AgentError::StillRunning {
                job: spec.job,
                pids: job.cgroup.pids().unwrap_or_default(),
            });
        }
        let mut env = spec.env;
        self.launch_env
            .apply(&mut env, spec.job, &spec.token, &self.node);
        env.insert(
            ib_quiesce::control::SOCKET_ENV.into(),
            self.channels.socket().display().to_string(),
        );
        job.record.token = spec.token;
        job.record.part = spec.part;
        job.record.owner = Some(owner.uid);
        let mode = ShimMode::Launch {
            argv: spec.argv,
            cwd: spec.cwd,
            env,
            uid: owner.uid,
            gid: owner.gid,
            groups: owner.groups.clone(),
        };
        let pid = self
            .start_shim(&mut job, mode, &owner, LAUNCH_TIMEOUT)
            .await?;
        info!(pid, "job started");
        Ok((pid, job.record.incarnation))
    }

    /// Phase 1, initial synchronization: the job runs, no process holds verbs resources without
    /// a channel, the engine works, and staging has room.
    #[instrument(skip_all, fields(job, epoch))]
    pub async fn prepare(&self, job_id: u64, epoch: u32) -> Result<Prepared, AgentError> {
        let j = self.get(job_id)?;
        let mut job = j.lock().await;
        if let Some(w) = &job.work {
            return Err(AgentError::WrongPhase {
                job: job_id,
                epoch,
                call: "prepare",
                state: format!("epoch {} is {:?}", w.epoch, w.phase),
            });
        }
        self.failpoint(job_id, "sync").await?;
        let root = job.record.root_pid.unwrap_or(0);
        let live = job.cgroup.pids().unwrap_or_default();
        if let Some(p) = procfs::outside_tree(root, &live)
            .into_iter()
            .min_by_key(|p| p.pid)
        {
            return Err(AgentError::OutsideTree {
                job: job_id,
                pid: p.pid,
                comm: p.comm,
                root,
            });
        }
        match job.observe() {
            Observed::Running => {}
            Observed::Exited(e) => {
                return Err(AgentError::NotRunning {
                    job: job_id,
                    state: exit_text(&e),
                })
            }
            Observed::Lost => {
                return Err(AgentError::NotRunning {
                    job: job_id,
                    state: "no processes".into(),
                })
            }
        }
        let pids = job.cgroup.pids().map_err(|source| AgentError::Cgroup {
            job: job_id,
            source,
        })?;
        let mut estimated = 0u64;
        // A process with a channel releases the device before the freeze; checked again then.
        let channeled = self.channels.up(&pids).await;
        refuse_verbs_without_channel(job_id, pids.iter().filter(|p| !channeled.contains(p)))?;
        for &pid in &pids {
            estimated += procfs::rss_bytes(pid);
        }
        let free = self
            .staging
            .free_bytes()
            .map_err(|source| AgentError::Store {
                job: job_id,
                source,
            })?;
        let need = (estimated as f64 * ROOM_FACTOR) as u64;
        if free < need {
            return Err(AgentError::NoRoom {
                job: job_id,
                dir: self.staging.root().to_path_buf(),
                need,
                free,
            });
        }
        let node_dir = self
            .staging
            .create_node_dir(job_id, epoch, &self.node)
            .map_err(|source| AgentError::Store {
                job: job_id,
                source,
            })?;
        // Root's alone even where staging is a shared directory (see `protect_staging`).
        let job_stage = self.staging.job_dir(job_id);
        set_mode(&job_stage, PRIVATE_DIR).map_err(io_err(job_id, "chmod", &job_stage))?;
        let root_pid = job.record.root_pid.unwrap_or(0);
        job.work = Some(EpochWork {
            epoch,
            phase: NodePhase::Prepared,
            node_dir,
            frozen_at: None,
            pids,
            root_pid,
            open_files: Vec::new(),
            preserved: Vec::new(),
            tcp_ports: Vec::new(),
            tcp_addrs: Vec::new(),
            tids: Vec::new(),
            notes: BTreeMap::new(),
            pause: None,
        });
        Ok(Prepared {
            processes: job.work.as_ref().map(|w| w.pids.len() as u32).unwrap_or(0),
            estimated_bytes: estimated,
            staging_free_bytes: free,
            channels: channeled.len() as u32,
        })
    }

    /// Phase 2, pre-checkpoint coordination: freeze every process of the job on this node.
    #[instrument(skip_all, fields(job, epoch))]
    pub async fn quiesce(&self, job_id: u64, epoch: u32) -> Result<Duration, AgentError> {
        let j = self.get(job_id)?;
        let mut job = j.lock_owned().await;
        job.expect_phase(epoch, NodePhase::Prepared, "quiesce")?;
        self.failpoint(job_id, "quiesce").await?;
        self.quiesce_channels(&mut job).await?;
        // Background copies stop taking CPU and disk before the freeze, until the thaw.
        job.work.as_mut().expect("checked").pause = Some(PauseGuard::new(&self.frozen));
        let begin = Instant::now();
        let job = tokio::task::spawn_blocking(move || {
            let r = job.cgroup.freeze_for_snapshot();
            (job, r)
        })
        .await
        .expect("freeze task");
        let (mut job, r) = job;
        let retries = r.map_err(|source| AgentError::Cgroup {
            job: job_id,
            source,
        })?;
        if retries > 0 {
            tracing::info!(
                job = job_id,
                retries,
                "froze again: a process was waiting for a vfork child"
            );
        }
        let pids = job.cgroup.pids().unwrap_or_default();
        let w = job.work.as_mut().expect("checked");
        w.frozen_at = Some(begin);
        w.pids = pids;
        w.phase = NodePhase::Frozen;
        Ok(begin.elapsed())
    }

    /// Pre-checkpoint, before the freeze: quiesce the ib-quiesce channels of the job's
    /// processes (all at once: their flush handshakes need each other), then check that no
    /// process still maps a verbs device.
    async fn quiesce_channels(&self, job: &mut NodeJob) -> Result<(), AgentError> {
        let job_id = job.record.id;
        let pids = job
            .work
            .as_ref()
            .map(|w| w.pids.clone())
            .unwrap_or_default();
        let up = self.channels.up(&pids).await;
        if !up.is_empty() {
            let (done, failed) = self.channels.quiesce(&up, CHANNEL_QUIESCE_TIMEOUT).await;
            job.ibq_down.extend(&done.pids);
            if let Some(f) = failed.into_iter().next() {
                // Channels still up run on; those that quiesced wait for the rebuild that
                // follows the abort.
                self.channels.resume(&up).await;
                return Err(channel_error(job_id, "quiesce")(f));
            }
            info!(
                channels = done.pids.len(),
                qps = done.report.flushed_qps,
                kept_receives = done.report.kept_receives,
                slowest_us = done.slowest.as_micros() as u64,
                "ib-quiesce channels quiesced"
            );
            let w = job.work.as_mut().expect("checked");
            w.notes
                .insert(CHANNEL_NOTE.into(), join_pids(&job.ibq_down));
            w.notes.insert(
                "ibq_quiesce_us".into(),
                done.slowest.as_micros().to_string(),
            );
        }
        refuse_verbs_without_channel(job_id, &pids)
    }

    /// Post-checkpoint (or after a restart's release): the job's channels that are down
    /// recreate their objects; returns their new endpoints (none without channels) and the
    /// peer QPs whose endpoints they need back.
    pub async fn rebuild_channels(&self, job_id: u64) -> Result<Rebuilt, AgentError> {
        let j = self.get(job_id)?;
        let job = j.lock().await;
        if job.ibq_down.is_empty() {
            return Ok((Vec::new(), Some(Vec::new())));
        }
        self.channels
            .rebuild(&job.ibq_down, CHANNEL_REBUILD_TIMEOUT)
            .await
            .map_err(channel_error(job_id, "rebuild"))
    }

    /// Connects the rebuilt channels to the job's endpoints (all nodes) and lets them run.
    pub async fn reconnect_channels(
        &self,
        job_id: u64,
        endpoints: &[ib_quiesce::Endpoint],
    ) -> Result<(), AgentError> {
        let j = self.get(job_id)?;
        let mut job = j.lock().await;
        if job.ibq_down.is_empty() {
            return Ok(());
        }
        self.channels
            .reconnect(&job.ibq_down, endpoints, CHANNEL_REBUILD_TIMEOUT)
            .await
            .map_err(channel_error(job_id, "reconnect"))?;
        job.ibq_down.clear();
        Ok(())
    }

    /// The ib-quiesce channel registry (the daemon serves its socket).
    pub fn channels(&self) -> &Arc<Channels> {
        &self.channels
    }

    /// Phase 3, local checkpoint: record open-file sizes, save what the engine does not, and
    /// have the engine dump the frozen tree into staging. Returns (elapsed, frozen so far).
    #[instrument(skip_all, fields(job, epoch))]
    pub async fn dump(&self, job_id: u64, epoch: u32) -> Result<(Duration, Duration), AgentError> {
        let j = self.get(job_id)?;
        let mut job = j.lock_owned().await;
        job.expect_phase(epoch, NodePhase::Frozen, "dump")?;
        self.failpoint(job_id, "dump").await?;
        let engine = self.engine.clone();
        let begin = Instant::now();
        let (mut job, r) = tokio::task::spawn_blocking(move || {
            let r = dump_frozen(&mut job, engine.as_ref());
            (job, r)
        })
        .await
        .expect("dump task");
        r?;
        let w = job.work.as_mut().expect("checked");
        w.phase = NodePhase::Dumped;
        let frozen = w.frozen_at.map(|t| t.elapsed()).unwrap_or_default();
        Ok((begin.elapsed(), frozen))
    }

    /// Phase 4, post-checkpoint coordination: thaw the job (or kill it for `--kill`). Returns
    /// (elapsed, time frozen from the freeze to the end of the thaw).
    #[instrument(skip_all, fields(job, epoch, kill))]
    pub async fn resume(
        &self,
        job_id: u64,
        epoch: u32,
        kill: bool,
    ) -> Result<(Duration, Duration), AgentError> {
        let j = self.get(job_id)?;
        let mut job = j.lock_owned().await;
        job.expect_phase(epoch, NodePhase::Dumped, "resume")?;
        self.failpoint(job_id, "resume").await?;
        let begin = Instant::now();
        let (mut job, r) = tokio::task::spawn_blocking(move || {
            let r = if kill {
                job.cgroup.kill_all()
            } else {
                job.cgroup.thaw()
            };
            (job, r)
        })
        .await
        .expect("resume task");
        r.map_err(|source| AgentError::Cgroup {
            job: job_id,
            source,
        })?;
        if kill {
            job.ibq_down.clear();
        }
        let w = job.work.as_mut().expect("checked");
        w.phase = NodePhase::Resumed;
        w.pause = None;
        let frozen = w.frozen_at.map(|t| t.elapsed()).unwrap_or_default();
        Ok((begin.elapsed(), frozen))
    }

    /// Seals the epoch on this node: digest and fsync every image, write the node manifest.
    /// Runs after the job has resumed, so it costs the job no frozen time.
    #[instrument(skip_all, fields(job, epoch))]
    pub async fn finalize(&self, job_id: u64, epoch: u32) -> Result<Finalized, AgentError> {
        let j = self.get(job_id)?;
        let mut job = j.lock_owned().await;
        job.expect_phase(epoch, NodePhase::Resumed, "finalize")?;
        self.failpoint(job_id, "finalize").await?;
        let w = job.work.take().expect("checked");
        let node = self.node.clone();
        let engine = (
            self.engine.name().to_string(),
            self.engine.version().to_string(),
        );
        let r =
            tokio::task::spawn_blocking(move || -> Result<Finalized, ckpt_store::StoreError> {
                let files = ckpt_store::digest::seal_tree(&w.node_dir, &[manifest::FILE_NAME])?;
                let m = NodeManifest {
                    job_id,
                    epoch,
                    node,
                    engine: engine.0,
                    engine_version: engine.1,
                    created_unix_ms: now_ms(),
                    root_pid: w.root_pid,
                    pids: w.pids,
                    tids: w.tids,
                    files,
                    open_files: w.open_files,
                    preserved: w.preserved,
                    tcp_ports: w.tcp_ports,
                    tcp_addrs: w.tcp_addrs,
                    notes: w.notes,
                };
                let digest = manifest::write(&w.node_dir, &m)?;
                Ok(Finalized {
                    image_bytes: m.image_bytes(),
                    image_files: m.files.len() as u32,
                    manifest_digest: digest,
                })
            })
            .await
            .expect("finalize task");
        r.map_err(|source| AgentError::Store {
            job: job_id,
            source,
        })
    }

    /// Abandons an epoch: thaw the job if it is frozen, delete the epoch's images on this node.
    /// Safe to call in any phase and more than once.
    #[instrument(skip_all, fields(job, epoch))]
    pub async fn abort(&self, job_id: u64, epoch: u32, reason: &str) -> Result<(), AgentError> {
        let j = self.get(job_id)?;
        let mut job = j.lock_owned().await;
        if job.work.as_ref().is_some_and(|w| w.epoch == epoch) {
            job.work = None;
        }
        warn!(reason, "aborting epoch");
        let staging = self.staging.clone();
        let node = self.node.clone();
        let (_job, r) = tokio::task::spawn_blocking(move || {
            let mut r = Ok(());
            if job.cgroup.exists() && job.cgroup.state().map(|s| s != "THAWED").unwrap_or(false) {
                r = job.cgroup.thaw().map_err(|source| AgentError::Cgroup {
                    job: job_id,
                    source,
                });
            }
            if let Err(source) = staging.remove_node_dir(job_id, epoch, &node) {
                r = r.and(Err(AgentError::Store {
                    job: job_id,
                    source,
                }));
            }
            (job, r)
        })
        .await
        .expect("abort task");
        r
    }

    /// Restores this node's part of a job from a committed epoch: verify the manifest and every
    /// image against the committed digest before anything else, then put the job's files back
    /// as they were, then have the shim run the engine's restore.
    #[instrument(skip_all, fields(job, epoch))]
    pub async fn restore(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        hold: bool,
        token: &str,
        sources: &Sources,
    ) -> Result<Restored, AgentError> {
        let j = self.get_or_create(job_id)?;
        let mut job = j.lock().await;
        // Processes of a just-killed incarnation may still be exiting: give them a moment.
        let begin = Instant::now();
        loop {
            let live = job.cgroup.pids().unwrap_or_default();
            if live.is_empty() {
                break;
            }
            if begin.elapsed() > PID_FREE_TIMEOUT {
                return Err(AgentError::StillRunning {
                    job: job_id,
                    pids: live,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let node_dir = self.staging.node_dir(job_id, epoch, &self.node);
        let (m, source, note) = self
            .usable_images(job_id, epoch, committed_digest, sources)
            .await?;
        for a in &m.tcp_addrs {
            if !address_is_local(a) {
                return Err(AgentError::AddressMissing {
                    job: job_id,
                    node: self.node.clone(),
                    addr: a.clone(),
                });
            }
        }
        // The owner recorded at checkpoint time (committed with the manifest) must still be
        // allowed to run jobs here; files are put back as that user.
        let owner_uid = m
            .notes
            .get(OWNER_NOTE)
            .and_then(|v| v.parse().ok())
            .or(job.record.owner)
            .ok_or_else(|| AgentError::OwnerUnknown {
                job: job_id,
                epoch,
                node: self.node.clone(),
            })?;
        let owner = self.policy.authorize(job_id, &self.node, owner_uid)?;
        job.record.owner = Some(owner.uid);
        let ids: Vec<i32> = m.pids.iter().chain(&m.tids).copied().collect();
        wait_pids_free(job_id, &ids).await?;
        let channels = channel_pids(&m.notes);
        self.put_back_files(&job, &owner, &m, &node_dir).await?;
        clear_stale_sockets(&m.tcp_ports).await;
        if !token.is_empty() {
            job.record.token = token.to_string();
        }
        // A cgroup the engine creates gets the freezer state of dump time (frozen); an existing
        // one would let the restored processes run at once.
        job.remove_empty_cgroup();
        if hold {
            self.hold_tcp(job_id, &m.tcp_ports).await?;
        }
        let inc = job.record.incarnation + 1;
        let run_dir = job.dir.join("run").join(inc.to_string());
        let log = job
            .dir
            .join("logs")
            .join(format!("restore-{epoch}-{inc}.log"));
        let pid_file = run_dir.join("restored.pid");
        let argv = self.engine.restore_argv(&RestoreSpec {
            images_dir: &node_dir.join("images"),
            log_file: &log,
            pid_file: &pid_file,
        });
        let lock = machine_restore_lock().await;
        let started = self
            .start_shim(
                &mut job,
                ShimMode::Restore { argv, pid_file },
                &owner,
                RESTORE_TIMEOUT,
            )
            .await;
        drop(lock);
        match started {
            Ok(pid) if hold => {
                // Released together with the other nodes (`release`). A part that cannot be
                // held is not left running on its own: the coordinator only releases (or
                // kills) the parts that reported restored.
                if job.cgroup.state().map(|s| s == "THAWED").unwrap_or(false) {
                    if let Err(source) = job.cgroup.freeze() {
                        let _ = job.cgroup.kill_all();
                        self.release_tcp(job_id).await;
                        return Err(AgentError::Cgroup {
                            job: job_id,
                            source,
                        });
                    }
                }
                if let Err(e) = verify_restored(job_id, &job.cgroup, &owner) {
                    let _ = job.cgroup.kill_all();
                    self.release_tcp(job_id).await;
                    return Err(e);
                }
                info!(
                    pid,
                    source = source.name(),
                    "job restored, held frozen until released"
                );
                job.ibq_down = channels.clone();
                Ok(Restored {
                    pid,
                    incarnation: job.record.incarnation,
                    source,
                    note,
                    channels: channels.len() as u32,
                })
            }
            Ok(pid) => {
                if let Err(e) = verify_restored(job_id, &job.cgroup, &owner) {
                    let _ = job.cgroup.kill_all();
                    return Err(e);
                }
                // The engine recreates a missing cgroup with the freezer state it had at dump
                // time (frozen); the job must run.
                if job.cgroup.state().map(|s| s != "THAWED").unwrap_or(false) {
                    job.cgroup.thaw().map_err(|source| AgentError::Cgroup {
                        job: job_id,
                        source,
                    })?;
                }
                info!(pid, source = source.name(), "job restored");
                job.ibq_down = channels.clone();
                Ok(Restored {
                    pid,
                    incarnation: job.record.incarnation,
                    source,
                    note,
                    channels: channels.len() as u32,
                })
            }
            Err(e) => {
                if hold {
                    self.release_tcp(job_id).await;
                }
                match e {
                    AgentError::Start { message, .. } => Err(AgentError::Engine {
                        job: job_id,
                        source: self.engine.restore_failed(message, &log),
                    }),
                    e => Err(e),
                }
            }
        }
    }

    /// Checks this node's images of an epoch: the manifest against the committed digest (if
    /// given), then every file against the manifest. Reads only.
    pub async fn verify(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
    ) -> Result<NodeManifest, AgentError> {
        let nd = self.staging.node_dir(job_id, epoch, &self.node);
        let committed = committed_digest.to_string();
        tokio::task::spawn_blocking(move || -> Result<NodeManifest, AgentError> {
            let store_err = |source| AgentError::Store {
                job: job_id,
                source,
            };
            if committed.is_empty() {
                return Err(store_err(ckpt_store::StoreError::DigestRequired {
                    path: nd.join(ckpt_store::manifest::FILE_NAME),
                }));
            }
            let (m, digest) = manifest::read(&nd).map_err(store_err)?;
            if digest != committed {
                return Err(AgentError::ManifestMismatch {
                    job: job_id,
                    epoch,
                    found: digest,
                    committed,
                });
            }
            ckpt_store::digest::verify_tree(&nd, &m.files).map_err(store_err)?;
            Ok(m)
        })
        .await
        .expect("verify task")
    }

    /// Rebuilds this node's images of an epoch from shared storage into `dest` (removed again
    /// on failure), or with `None` only checks that they can be rebuilt intact.
    async fn rebuild_shared(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        dest: Option<PathBuf>,
    ) -> Result<NodeManifest, AgentError> {
        let shared = self.shared(job_id)?;
        let (opts, digest, node) = (
            self.copy_opts.clone(),
            committed_digest.to_string(),
            self.node.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let t = target(job_id, epoch, &node);
            let r = ckpt_store::dedup::rebuild(&shared, t, &digest, dest.as_deref(), &opts);
            if let (Err(_), Some(d)) = (&r, &dest) {
                let _ = fs::remove_dir_all(d);
            }
            r
        })
        .await
        .expect("rebuild task")
        .map_err(|source| AgentError::Store {
            job: job_id,
            source,
        })
    }

    /// Checks every copy of this node's images of an epoch: the local one (unless retention
    /// deleted it), and the shared one when the coordinator says it is complete. Reads only.
    pub async fn verify_copies(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        local: bool,
        shared_durable: bool,
    ) -> Vec<CopyCheck> {
        let mut out = Vec::new();
        if local {
            out.push(CopyCheck {
                location: Location::Local,
                result: self.verify(job_id, epoch, committed_digest).await,
            });
        }
        if shared_durable {
            out.push(CopyCheck {
                location: Location::Shared,
                result: self
                    .rebuild_shared(job_id, epoch, committed_digest, None)
                    .await,
            });
        }
        out
    }

    /// Images to restore from, in order: the local copy if intact, else a fresh local copy
    /// fetched from the partner node, else from shared storage (for a durable epoch), each
    /// verified as it is read. Returns the manifest, where the images came from and why the
    /// sources before it were not used.
    async fn usable_images(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        sources: &Sources,
    ) -> Result<(NodeManifest, Location, String), AgentError> {
        let local_err = if sources.local_pruned {
            AgentError::Store {
                job: job_id,
                source: ckpt_store::StoreError::FileMissing {
                    path: self.staging.node_dir(job_id, epoch, &self.node),
                },
            }
        } else {
            match self.verify(job_id, epoch, committed_digest).await {
                Ok(m) => return Ok((m, Location::Local, String::new())),
                Err(e) => e,
            }
        };
        let mut tried = vec![if sources.local_pruned {
            "local copy deleted by retention".to_string()
        } else {
            format!("local copy unusable: {local_err}")
        }];
        let dest = self.staging.node_dir(job_id, epoch, &self.node);
        let tmp = self
            .staging
            .epoch_dir(job_id, epoch)
            .join(format!(".{}.fetch", self.node));
        if let Some((pn, pa)) = &sources.partner {
            warn!(job = job_id, epoch, partner = %pn, error = %local_err, "local images unusable; fetching the partner copy");
            match self
                .fetch_from_partner(job_id, epoch, committed_digest, pn, pa, &tmp)
                .await
            {
                Ok(m) => {
                    install(job_id, &tmp, &dest).await?;
                    return Ok((m, Location::Partner, tried.join("; ")));
                }
                Err(e) => tried.push(format!("partner copy on {pn}: {e}")),
            }
        }
        if sources.shared_durable {
            warn!(job = job_id, epoch, "fetching the shared copy");
            let fetched = self
                .rebuild_shared(job_id, epoch, committed_digest, Some(tmp.clone()))
                .await;
            match fetched {
                Ok(m) => {
                    install(job_id, &tmp, &dest).await?;
                    return Ok((m, Location::Shared, tried.join("; ")));
                }
                Err(e) => tried.push(format!("shared copy: {e}")),
            }
        }
        if tried.len() == 1 {
            return Err(local_err);
        }
        Err(AgentError::NoUsableCopy {
            job: job_id,
            epoch,
            node: self.node.clone(),
            tried: tried.join("; "),
        })
    }

    /// Has the partner node send back the copy of this node's images it keeps, into `tmp`.
    async fn fetch_from_partner(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        partner: &str,
        address: &str,
        tmp: &Path,
    ) -> Result<NodeManifest, AgentError> {
        let failed = |s: tonic::Status| AgentError::Partner {
            job: job_id,
            node: partner.to_string(),
            message: s.message().to_string(),
        };
        let mut c =
            crate::partner::connect(job_id, partner, address, self.credential.as_ref()).await?;
        let s = c
            .send(ckpt_proto::v1::SendRequest {
                job_id,
                epoch,
                node: self.node.clone(),
                manifest_digest: committed_digest.to_string(),
            })
            .await
            .map_err(failed)?
            .into_inner();
        let (header, rest) = crate::partner::split_header(s).await.map_err(failed)?;
        crate::partner::receive(
            job_id,
            partner,
            tmp.to_path_buf(),
            header,
            committed_digest,
            rest,
        )
        .await
    }

    /// Sends this node's images of a committed epoch to the partner node's agent.
    pub async fn replicate(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        partner: &str,
        address: &str,
    ) -> Result<(), AgentError> {
        use tokio_stream::StreamExt;
        let mut c =
            crate::partner::connect(job_id, partner, address, self.credential.as_ref()).await?;
        let header = ckpt_proto::v1::ChunkHeader {
            job_id,
            epoch,
            node: self.node.clone(),
            ..Default::default()
        };
        let rx = crate::partner::chunks(
            self.staging.node_dir(job_id, epoch, &self.node),
            header,
            committed_digest.to_string(),
            self.frozen.clone(),
        );
        // A damaged local file ends the stream early; the partner then refuses the incomplete
        // copy, and the local error is the one worth reporting.
        let failed = Arc::new(std::sync::Mutex::new(None));
        let f = failed.clone();
        let s = tokio_stream::wrappers::ReceiverStream::new(rx).map_while(move |r| match r {
            Ok(c) => Some(c),
            Err(e) => {
                *f.lock().expect("lock") = Some(e);
                None
            }
        });
        let r = c.receive(s).await;
        if let Some(e) = failed.lock().expect("lock").take() {
            return Err(e);
        }
        r.map(|_| ()).map_err(|s| AgentError::Partner {
            job: job_id,
            node: partner.to_string(),
            message: s.message().to_string(),
        })
    }

    /// Where this node keeps its own or a partner's images of an epoch.
    pub fn node_dir(&self, job_id: u64, epoch: u32, node: &str) -> PathBuf {
        self.staging.node_dir(job_id, epoch, node)
    }

    /// Deletes this node's images of the given epochs (retention): the local copies unless
    /// `keep_local`, and with `shared` the shared copies (the epoch's commit record first, so a
    /// partly deleted epoch never looks complete). Missing ones are fine.
    pub async fn prune(
        &self,
        job_id: u64,
        epochs: &[u32],
        shared: bool,
        keep_local: bool,
    ) -> Result<(), AgentError> {
        let staging = self.staging.clone();
        let shared = if shared {
            Some(self.shared(job_id)?)
        } else {
            None
        };
        let node = self.node.clone();
        let epochs = epochs.to_vec();
        tokio::task::spawn_blocking(move || {
            let store_err = |source| AgentError::Store {
                job: job_id,
                source,
            };
            for e in epochs {
                if let Some(sh) = &shared {
                    let commit = sh.epoch_dir(job_id, e).join(ckpt_store::commit::FILE_NAME);
                    match fs::remove_file(&commit) {
                        Ok(()) => {}
                        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                        Err(err) => return Err(io_err(job_id, "remove", &commit)(err)),
                    }
                    sh.remove_node_dir(job_id, e, &node).map_err(store_err)?;
                    ckpt_store::dedup::sweep(sh, job_id, &node).map_err(store_err)?;
                }
                if !keep_local {
                    staging
                        .remove_node_dir(job_id, e, &node)
                        .map_err(store_err)?;
                }
            }
            Ok(())
        })
        .await
        .expect("prune task")
    }

    /// Name of the nftables table that holds a job's TCP traffic during a restart.
    fn hold_table(&self, job: u64) -> String {
        let node: String = self
            .node
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        format!("ckpt_hold_{node}_{job}")
    }

    /// Drops TCP traffic on the job's ports in this node's network namespace, so that restored
    /// connections exchange nothing (and reset nothing) before every node is restored. Packets
    /// are dropped, not rejected: TCP retransmits them after the release.
    async fn hold_tcp(&self, job: u64, ports: &[u16]) -> Result<(), AgentError> {
        if ports.is_empty() {
            return Ok(());
        }
        let set = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let table = self.hold_table(job);
        let script = format!(
            "table inet {table} {{\n\
             chain input {{ type filter hook input priority -10; policy accept; tcp dport {{ {set} }} drop; }}\n\
             chain output {{ type filter hook output priority -10; policy accept; tcp sport {{ {set} }} drop; }}\n\
             }}\n"
        );
        self.release_tcp(job).await;
        run_nft(&["-f", "-"], Some(&script))
            .await
            .map_err(|message| AgentError::Start {
                job,
                message: format!("cannot block the job's TCP ports during restore: {message}"),
            })
    }

    /// Removes the hold of [`Jobs::hold_tcp`], if any.
    async fn release_tcp(&self, job: u64) {
        let table = self.hold_table(job);
        let _ = run_nft(&["delete", "table", "inet", &table], None).await;
    }

    /// Restart, second step: lets a part restored with `hold` run (TCP first, then thaw), or
    /// kills it when the restart failed elsewhere.
    #[instrument(skip_all, fields(job = job_id, kill))]
    pub async fn release(&self, job_id: u64, kill: bool) -> Result<(), AgentError> {
        let j = self.get(job_id)?;
        let job = j.lock_owned().await;
        // Running processes get their network back before they thaw; killed ones after they
        // are gone, so that nothing of theirs leaks out.
        if !kill {
            self.release_tcp(job_id).await;
        }
        let (_job, r) = tokio::task::spawn_blocking(move || {
            let r = if kill {
                job.cgroup.kill_all()
            } else if job.cgroup.exists() {
                job.cgroup.thaw()
            } else {
                Ok(())
            };
            (job, r)
        })
        .await
        .expect("release task");
        if kill {
            self.release_tcp(job_id).await;
        }
        r.map_err(|source| AgentError::Cgroup {
            job: job_id,
            source,
        })
    }

    /// Puts the job's files back as they were at checkpoint time, before the engine restores:
    /// the job's own stdout and stderr (in the job directory, which root controls) here, and
    /// everything else, in directories the owner controls, through the put-back helper running
    /// as the owner ([`PutBack`]).
    async fn put_back_files(
        &self,
        job: &NodeJob,
        owner: &Identity,
        m: &NodeManifest,
        node_dir: &Path,
    ) -> Result<(), AgentError> {
        let job_id = job.record.id;
        let own_dir = fs::canonicalize(&job.dir).unwrap_or_else(|_| job.dir.clone());
        let (ours, theirs): (Vec<OpenFile>, Vec<OpenFile>) =
            m.open_files.iter().cloned().partition(|f| {
                let p = Path::new(&f.path);
                p.parent() == Some(own_dir.as_path())
                    && p.file_name()
                        .is_some_and(|n| n == "stdout" || n == "stderr")
            });
        if let Some(pf) = m.preserved.iter().find(|pf| pf.uid != owner.uid) {
            return Err(AgentError::FileRefused {
                job: job_id,
                action: "put back",
                path: pf.path.clone(),
                uid: owner.uid,
                problem: format!(
                    "it belonged to uid {} at checkpoint time, not to the job's owner",
                    pf.uid
                ),
            });
        }
        for f in &ours {
            put_back_own_output(job_id, f, owner)?;
        }
        if theirs.is_empty() && m.preserved.is_empty() {
            return Ok(());
        }
        let task = PutBackTask {
            put_back: PutBack {
                owner: owner.clone(),
                open_files: theirs,
                preserved: m.preserved.clone(),
                saved_dir: node_dir.to_path_buf(),
            },
        };
        run_put_back(job_id, &self.shim_exe, &task).await
    }

    /// New output of the job's part on this node after the given offsets, and its exit status
    /// once all output has been returned. Never waits for a phase in progress.
    pub async fn poll(
        &self,
        job_id: u64,
        token: &str,
        stdout_offset: u64,
        stderr_offset: u64,
    ) -> Result<PollResult, AgentError> {
        let j = self.get(job_id)?;
        let Ok(job) = j.try_lock() else {
            return Ok(PollResult {
                stdout: Vec::new(),
                stderr: Vec::new(),
                observed: Observed::Running,
            });
        };
        if !ckpt_auth::token_eq(&job.record.token, token) {
            return Err(AgentError::BadToken { job: job_id });
        }
        let observed = job.observe();
        let read = |name: &str, offset: u64| -> Result<(Vec<u8>, bool), AgentError> {
            use std::io::{Read, Seek, SeekFrom};
            let path = job.dir.join(name);
            let mut f = match fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((vec![], true)),
                Err(e) => return Err(io_err(job_id, "read", &path)(e)),
            };
            let mut buf = Vec::new();
            f.seek(SeekFrom::Start(offset))
                .and_then(|_| f.take(POLL_CHUNK).read_to_end(&mut buf))
                .map_err(io_err(job_id, "read", &path))?;
            let done = (buf.len() as u64) < POLL_CHUNK;
            Ok((buf, done))
        };
        let (stdout, out_done) = read("stdout", stdout_offset)?;
        let (stderr, err_done) = read("stderr", stderr_offset)?;
        let observed = if out_done && err_done {
            observed
        } else {
            Observed::Running
        };
        Ok(PollResult {
            stdout,
            stderr,
            observed,
        })
    }

    /// Whether `token` is the job's (constant time; an empty token never is).
    pub async fn check_token(&self, job_id: u64, token: &str) -> Result<(), AgentError> {
        let j = self.get(job_id)?;
        let job = j.lock().await;
        if ckpt_auth::token_eq(&job.record.token, token) {
            Ok(())
        } else {
            Err(AgentError::BadToken { job: job_id })
        }
    }

    /// Sends a signal to every process of the job on this node.
    pub async fn signal(&self, job_id: u64, sig: i32) -> Result<usize, AgentError> {
        let j = self.get(job_id)?;
        let job = j.lock().await;
        job.cgroup
            .signal_all(sig)
            .map_err(|source| AgentError::Cgroup {
                job: job_id,
                source,
            })
    }

    /// The job's processes on this node, each with its MPI rank if it is one; and which part
    /// of the job this node runs (0: the job's command).
    pub async fn processes(
        &self,
        job_id: u64,
    ) -> Result<(Observed, u32, Vec<(procfs::ProcStat, Option<i32>)>), AgentError> {
        let j = self.get(job_id)?;
        let job = j.lock().await;
        let procs = job
            .cgroup
            .pids()
            .unwrap_or_default()
            .into_iter()
            .filter_map(procfs::stat)
            .map(|s| {
                let rank = procfs::mpi_rank(s.pid);
                (s, rank)
            })
            .collect();
        Ok((job.observe(), job.record.part, procs))
    }
}

/// Maps an I/O error of step `what` on `path` to [`AgentError::Io`].
pub(crate) fn io_err(
    job: u64,
    what: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> AgentError {
    let path = path.to_path_buf();
    move |source| AgentError::Io {
        job,
        what,
        path,
        source,
    }
}

/// A node's copy of one epoch in shared storage.
fn target(job: u64, epoch: u32, node: &str) -> ckpt_store::dedup::Target<'_> {
    ckpt_store::dedup::Target { job, epoch, node }
}

/// Puts a fetched copy in place of the node's unusable one.
async fn install(job: u64, tmp: &Path, dest: &Path) -> Result<(), AgentError> {
    let (tmp, dest, path) = (tmp.to_path_buf(), dest.to_path_buf(), dest.to_path_buf());
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        if dest.exists() {
            fs::remove_dir_all(&dest)?;
        }
        fs::rename(&tmp, &dest)
    })
    .await
    .expect("install task")
    .map_err(|source| AgentError::Io {
        job,
        what: "install fetched images",
        path,
        source,
    })
}

/// Human text for an exit status.
pub fn exit_text(e: &Exit) -> String {
    match (e.code, e.signal) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "ended".into(),
    }
}

/// Files under these prefixes are shared memory or session state that the engine does not put in
/// the image and that launchers delete when the job ends (Open MPI's `vader_segment.*` in
/// /dev/shm and its session directory in /tmp/ompi.*): the agent saves the ones the job uses.
const PRESERVE_PREFIXES: [&str; 2] = ["/dev/shm/", "/tmp/ompi."];

fn dump_frozen(job: &mut NodeJob, engine: &dyn SnapshotEngine) -> Result<(), AgentError> {
    let id = job.record.id;
    let root = job.work.as_ref().map(|w| w.root_pid).unwrap_or(0);
    // An older agent's record has no owner: the job's root process says who it is.
    let owner = job
        .record
        .owner
        .or_else(|| procfs::uid_of(root))
        .ok_or_else(|| AgentError::NotRunning {
            job: id,
            state: format!("its root process {root} is gone"),
        })?;
    job.record.owner = Some(owner);
    let w = job.work.as_mut().expect("checked by caller");
    w.notes.insert(OWNER_NOTE.into(), owner.to_string());
    let io = |what, path: &Path| io_err(id, what, path);
    let begin = Instant::now();
    // Sizes of files open for writing: restore truncates them back.
    let mut open: BTreeMap<String, u64> = BTreeMap::new();
    let mut preserve: Vec<PathBuf> = Vec::new();
    for &pid in &w.pids {
        for (path, size) in procfs::files_open_for_write(pid) {
            open.insert(path.display().to_string(), size);
        }
        let mut used: Vec<String> = procfs::mapped_paths(pid);
        used.extend(
            procfs::fd_paths(pid)
                .into_iter()
                .map(|p| p.display().to_string()),
        );
        for p in used {
            if PRESERVE_PREFIXES.iter().any(|pre| p.starts_with(pre)) && !p.ends_with(" (deleted)")
            {
                preserve.push(PathBuf::from(p));
            }
        }
    }
    // Whole Open MPI session directories (`/tmp/ompi.<host>.<uid>/pid.<launcher pid>`), since
    // processes find each other's files through them.
    let mut trees: Vec<PathBuf> = preserve
        .iter()
        .filter_map(|p| {
            let rest = p.strip_prefix("/tmp").ok()?;
            let mut comps = rest.components();
            let top = comps.next()?;
            let session = comps.next()?;
            Some(Path::new("/tmp").join(top).join(session))
        })
        // Never through a link: a user's link to another directory is not the job's session.
        .filter(|t| fs::symlink_metadata(t).is_ok_and(|m| m.is_dir()))
        .collect();
    trees.sort();
    trees.dedup();
    for t in &trees {
        collect_files(t, &mut preserve);
    }
    preserve.sort();
    preserve.dedup();
    w.open_files = open
        .into_iter()
        .map(|(path, size)| OpenFile { path, size })
        .collect();
    w.tids = procfs::thread_ids(&w.pids);
    let tcp = procfs::tcp_endpoints(&w.pids);
    w.tcp_ports = tcp.ports;
    w.tcp_addrs = tcp.addrs.iter().map(|a| a.to_string()).collect();
    let scanned = begin.elapsed();
    let images = w.node_dir.join("images");
    fs::create_dir_all(&images).map_err(io("create", &images))?;
    let log = job.dir.join("logs").join(format!("dump-{}.log", w.epoch));
    // Copying the preserved files and the engine's dump both only read the frozen job and write
    // to different directories: run them side by side, so the job stays frozen for the longer
    // of the two rather than their sum.
    let node_dir = w.node_dir.clone();
    let root_pid = w.root_pid;
    let (dumped, copied) = std::thread::scope(|scope| {
        let copier = scope.spawn(|| copy_preserved(id, owner, &node_dir, &preserve));
        let t = Instant::now();
        let dumped = engine
            .dump(&DumpSpec {
                root_pid,
                images_dir: &images,
                cgroup: job.cgroup.path(),
                log_file: &log,
            })
            .map_err(|source| AgentError::Engine { job: id, source })
            .map(|()| t.elapsed());
        (dumped, copier.join().expect("copy thread panicked"))
    });
    let engine_time = dumped?;
    let (preserved, copied_bytes, copy_time) = copied?;
    let w = job.work.as_mut().expect("checked by caller");
    w.preserved = preserved;
    info!(
        scan_ms = scanned.as_millis() as u64,
        engine_dump_ms = engine_time.as_millis() as u64,
        preserve_copy_ms = copy_time.as_millis() as u64,
        preserved_bytes = copied_bytes,
        "dumped"
    );
    w.notes.extend(
        [
            ("scan_ms", scanned.as_millis()),
            ("engine_dump_ms", engine_time.as_millis()),
            ("preserve_copy_ms", copy_time.as_millis()),
            ("preserved_bytes", copied_bytes as u128),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    Ok(())
}

/// The manifest note listing the processes whose ib-quiesce channels were quiesced.
const CHANNEL_NOTE: &str = "ibq_channels";
/// How long channels have to drain and flush before the freeze.
const CHANNEL_QUIESCE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long channels have to come back, recreate their objects and connect.
const CHANNEL_REBUILD_TIMEOUT: Duration = Duration::from_secs(60);

/// The agent error for a channel that failed `step` in job `job`.
fn channel_error(job: u64, step: &'static str) -> impl Fn(ChannelFailure) -> AgentError {
    move |f| AgentError::Channel {
        job,
        pid: f.pid,
        message: format!("{step} failed: {}", f.message),
    }
}

/// Fails naming the first of `pids` that maps or holds a verbs device.
fn refuse_verbs_without_channel<'a>(
    job: u64,
    pids: impl IntoIterator<Item = &'a i32>,
) -> Result<(), AgentError> {
    for &pid in pids {
        if let Some(device) = procfs::verbs_device(pid) {
            let comm = procfs::stat(pid).map(|s| s.comm).unwrap_or_default();
            return Err(AgentError::VerbsWithoutChannel {
                job,
                pid,
                comm,
                device,
            });
        }
    }
    Ok(())
}

fn join_pids(pids: &[i32]) -> String {
    pids.iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The processes of a manifest whose channels must be rebuilt after a restore.
fn channel_pids(notes: &BTreeMap<String, String>) -> Vec<i32> {
    notes
        .get(CHANNEL_NOTE)
        .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// Copies the files the engine does not save into `extra/` of the node directory (named pipes
/// are only recorded); returns what was saved, the bytes copied and the time taken. These files
/// are in directories users control (`/dev/shm`, `/tmp`): each is opened without following a
/// symbolic link anywhere on its path, and must belong to the job's owner `owner`; what the
/// open file is (type, owner, mode) is read from the open file.
fn copy_preserved(
    job: u64,
    owner: u32,
    node_dir: &Path,
    files: &[PathBuf],
) -> Result<(Vec<PreservedFile>, u64, Duration), AgentError> {
    let begin = Instant::now();
    let io = |what, path: &Path| io_err(job, what, path);
    let refused = |p: &Path, problem: String| AgentError::FileRefused {
        job,
        action: "save",
        path: p.display().to_string(),
        uid: owner,
        problem,
    };
    let extra = node_dir.join("extra");
    let mut out = Vec::new();
    let mut bytes = 0u64;
    for (i, p) in files.iter().enumerate() {
        const LINK: &str = "it is a symbolic link, or a directory on its path is; root does not follow a user's links (remove the link, or keep the job's files under their real path)";
        // O_PATH: no open of the file itself yet (a FIFO's reader would wake its writer). With
        // O_NOFOLLOW a final link is opened as the link itself, and refused below.
        let handle = match crate::owner::open_no_symlinks(p, libc::O_PATH, 0) {
            Ok(h) => h,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(refused(p, LINK.into())),
            // Gone since the scan.
            Err(_) => continue,
        };
        let meta = handle.metadata().map_err(io("stat", p))?;
        if meta.file_type().is_symlink() {
            return Err(refused(p, LINK.into()));
        }
        let fifo = meta.file_type().is_fifo();
        if !fifo && !meta.is_file() {
            continue;
        }
        if meta.uid() != owner {
            return Err(refused(
                p,
                format!(
                    "it belongs to uid {}, not to the job's owner; a checkpoint saves only the owner's files",
                    meta.uid()
                ),
            ));
        }
        let saved_as = if fifo {
            String::new()
        } else {
            ensure_dir(&extra, PRIVATE_DIR).map_err(io("create", &extra))?;
            let saved = format!("extra/{i}");
            // The same file, reopened for reading through the handle (not by its path again).
            let mut src = fs::File::open(format!("/proc/self/fd/{}", handle.as_raw_fd()))
                .map_err(io("read", p))?;
            let dst_path = node_dir.join(&saved);
            let mut dst = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(PRIVATE_FILE)
                .open(&dst_path)
                .map_err(io("create", &dst_path))?;
            bytes += std::io::copy(&mut src, &mut dst).map_err(io("copy", p))?;
            saved
        };
        out.push(PreservedFile {
            path: p.display().to_string(),
            saved_as,
            mode: meta.mode() & 0o7777,
            uid: meta.uid(),
            gid: meta.gid(),
            fifo,
        });
    }
    Ok((out, bytes, begin.elapsed()))
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => collect_files(&p, out),
            Ok(t) if t.is_file() || t.is_fifo() => out.push(p),
            _ => {}
        }
    }
}

/// Lock that serializes restores on one machine. Agents sharing a machine (test hosts, or
/// several agents with their own cgroup prefixes) share `/dev/shm` and `/tmp`, where the engine
/// re-creates deleted files under temporary names derived from the image: two restores at once
/// would collide on them. With one agent per machine the lock is never contended.
const RESTORE_LOCK: &str = "/run/lock/ckpt-restore.lock";

async fn machine_restore_lock() -> Option<fs::File> {
    tokio::task::spawn_blocking(|| {
        let _ = fs::create_dir_all("/run/lock");
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(RESTORE_LOCK)
            .ok()?;
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a file descriptor we own; released when the file is closed.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        (rc == 0).then_some(f)
    })
    .await
    .ok()
    .flatten()
}

/// Whether an address is configured on this node (in the agent's network namespace).
fn address_is_local(addr: &str) -> bool {
    let Ok(ip) = addr.parse::<std::net::IpAddr>() else {
        return true;
    };
    match std::net::TcpListener::bind((ip, 0)) {
        Ok(_) => true,
        Err(e) => e.raw_os_error() != Some(libc::EADDRNOTAVAIL),
    }
}

/// Runs `nft` with `args` (and `stdin`); the error is nft's message.
async fn run_nft(args: &[&str], stdin: Option<&str>) -> Result<(), String> {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new("nft")
        .args(args)
        .stdin(if stdin.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run nft (install nftables): {e}"))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .await
            .map_err(|e| format!("nft: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| format!("nft: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// TCP states of connections their owner has closed.
const STALE_TCP_STATES: [&str; 5] = [
    "time-wait",
    "fin-wait-1",
    "fin-wait-2",
    "closing",
    "last-ack",
];

async fn wait_pids_free(job: u64, pids: &[i32]) -> Result<(), AgentError> {
    let begin = Instant::now();
    loop {
        let taken: Vec<i32> = pids
            .iter()
            .copied()
            .filter(|&p| procfs::pid_taken(p))
            .collect();
        if taken.is_empty() {
            return Ok(());
        }
        if begin.elapsed() > PID_FREE_TIMEOUT {
            return Err(AgentError::PidsTaken { job, pids: taken });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Destroys the closing remains of the job's TCP connections on its ports. When a job is killed
/// its connections linger for up to a minute (TIME_WAIT; FIN_WAIT and LAST_ACK when the peer
/// was killed too, or a failed restart dropped its packets), and the restored sockets, which
/// reuse the same addresses, could not bind or connect. Only sockets in closing states are
/// touched, never an open one, and only after every process of the job is gone.
async fn clear_stale_sockets(ports: &[u16]) {
    if ports.is_empty() {
        return;
    }
    let filter = ports
        .iter()
        .map(|p| format!("sport = :{p}"))
        .collect::<Vec<_>>()
        .join(" or ");
    let r = tokio::process::Command::new("ss")
        .args(["-K", "-t", "-a", "-n"])
        .args(STALE_TCP_STATES.iter().flat_map(|s| ["state", s]))
        .arg(format!("( {filter} )"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output()
        .await;
    match r {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            warn!(stderr = %String::from_utf8_lossy(&o.stderr), "cannot clear stale TCP sockets")
        }
        Err(e) => warn!(error = %e, "cannot run ss (iproute2) to clear stale TCP sockets"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::owner::{has_acl, owner_may};
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn launch_policy_refuses_root_system_accounts_and_unknown_users() {
        let strict = LaunchPolicy::default();
        let e = strict.authorize(7, "n1", 0).unwrap_err();
        assert!(matches!(e, AgentError::RootRefused { .. }), "{e}");
        assert!(e.to_string().contains("allow_root_jobs"), "{e}");
        let e = strict.authorize(7, "n1", 1).unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::UidBelowMinimum {
                    uid: 1,
                    min_uid: 1000,
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("uid 1") && e.to_string().contains("min_uid"),
            "{e}"
        );
        let e = strict.authorize(7, "n1", u32::MAX - 7).unwrap_err();
        assert!(matches!(e, AgentError::UnknownUser { .. }), "{e}");
        assert!(e.to_string().contains("no passwd entry"), "{e}");
        let open = LaunchPolicy {
            allow_root: true,
            min_uid: 1000,
        };
        let root = open.authorize(7, "n1", 0).unwrap();
        assert_eq!((root.uid, root.gid), (0, 0), "gid from passwd");
        assert!(matches!(
            crate::grpc::to_status(strict.authorize(7, "n1", 0).unwrap_err()).code(),
            tonic::Code::PermissionDenied
        ));
    }

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
    fn restored_files_are_judged_by_what_the_owner_may_do() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("f");
        fs::write(&f, b"x").unwrap();
        let me = nix::unistd::getuid().as_raw();
        let owner = Identity {
            uid: me.wrapping_add(1),
            gid: 4242,
            groups: vec![4242, 4343],
        };
        let read = procfs::Access {
            read: true,
            ..Default::default()
        };
        let write = procfs::Access {
            write: true,
            ..Default::default()
        };
        let judge = |mode: u32, gid: u32, access| {
            fs::set_permissions(&f, fs::Permissions::from_mode(mode)).unwrap();
            std::os::unix::fs::chown(&f, None, Some(gid)).unwrap();
            owner_may(&owner, &fs::metadata(&f).unwrap(), access)
        };
        assert!(judge(0o644, 0, read), "others may read");
        assert!(!judge(0o640, 0, read), "another user's group-only file");
        assert!(judge(0o640, 4343, read), "a supplementary group's file");
        assert!(!judge(0o644, 4343, write), "not writable by the group");
        assert!(judge(0o664, 4242, write), "writable by the primary group");
        assert!(!judge(0o600, 0, read), "another user's private file");
        let mine = Identity { uid: me, ..owner };
        assert!(
            owner_may(&mine, &fs::metadata(&f).unwrap(), write),
            "the owner's own file"
        );
        assert!(!has_acl(&f));
    }

    #[test]
    fn staging_is_made_private_unless_it_is_a_shared_directory() {
        let d = tempfile::tempdir().unwrap();
        let own = d.path().join("local");
        fs::create_dir(&own).unwrap();
        fs::set_permissions(&own, fs::Permissions::from_mode(0o755)).unwrap();
        protect_staging(&own);
        assert_eq!(fs::metadata(&own).unwrap().mode() & 0o7777, 0o700);
        let shared = d.path().join("shm");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
        protect_staging(&shared);
        assert_eq!(
            fs::metadata(&shared).unwrap().mode() & 0o7777,
            0o1777,
            "a shared directory keeps its mode"
        );
    }

    #[test]
    fn addresses_not_on_this_node_are_told_apart() {
        assert!(address_is_local("127.0.0.1"));
        // TEST-NET-1 (RFC 5737) is never configured on a host.
        assert!(!address_is_local("192.0.2.1"));
        // What cannot be parsed is not ours to refuse.
        assert!(address_is_local("not-an-address"));
    }

    #[test]
    fn launch_env_names_the_job_and_keeps_the_jobs_own_launcher() {
        let le = LaunchEnv {
            coordinator: "10.0.0.1:7600".into(),
            launcher: Some("/usr/lib/ckpt/ckpt-rsh".into()),
            set_mpi_env: true,
            ca: Some("/etc/ckpt/tls/ca.pem".into()),
        };
        let mut env = BTreeMap::from([("OMPI_MCA_plm_rsh_agent".to_string(), "ssh".to_string())]);
        le.apply(&mut env, 7, "secret", "n1");
        assert_eq!(env["CKPT_TLS_CA"], "/etc/ckpt/tls/ca.pem");
        assert_eq!(env["CKPT_JOB_ID"], "7");
        assert_eq!(env["CKPT_JOB_TOKEN"], "secret");
        assert_eq!(env["CKPT_COORDINATOR"], "10.0.0.1:7600");
        assert_eq!(env["HYDRA_LAUNCHER_EXEC"], "/usr/lib/ckpt/ckpt-rsh");
        assert_eq!(
            env["OMPI_MCA_plm_rsh_agent"], "ssh",
            "the job's choice wins"
        );
        let mut env = BTreeMap::new();
        LaunchEnv {
            set_mpi_env: false,
            ..le
        }
        .apply(&mut env, 7, "secret", "n1");
        assert!(!env.contains_key("HYDRA_LAUNCHER_EXEC"));
        assert_eq!(env["CKPT_RSH"], "/usr/lib/ckpt/ckpt-rsh");
    }
}
