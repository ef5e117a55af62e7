//! Jobs and epochs as the coordinator records them, with guarded state transitions.
//!
//! Every transition is: check the guard, act, persist. A call in the wrong state is refused with
//! [`TransitionError`], which names the job or epoch, the state it is in and the state asked for.
//!
//! A job's record and its transitions are here; an epoch's are in `epoch.rs`.

use ckpt_proto::v1 as pb;
use ckpt_proto::Engine;
use serde::{Deserialize, Serialize};

mod epoch;
pub mod estimate;
pub mod policy;
pub mod recovery;
pub mod trigger;
pub use epoch::{Epoch, EpochState, FlushState, Storage, MAX_RESTARTS_KEPT};
pub use policy::{Every, Policy, PolicyChange};
pub use recovery::{OnFailure, Recovery};
pub use trigger::Trigger;

/// The protocol phases of one checkpoint epoch, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    /// Initial synchronization: all agents confirm the job can be checkpointed.
    #[serde(alias = "Sync")]
    InitialSync,
    /// Pre-checkpoint coordination: quiesce channels and freeze every node.
    Quiesce,
    /// Local checkpointing: every node dumps its frozen processes.
    #[serde(alias = "Dump")]
    LocalCheckpoint,
    /// Post-checkpoint coordination: thaw and rebuild (or kill) everywhere.
    Resume,
    /// Every node seals its images (digests, fsync, manifest).
    Finalize,
    /// The coordinator records the epoch as restorable.
    Commit,
}

impl Phase {
    /// Name shown to users.
    pub fn name(self) -> &'static str {
        match self {
            Phase::InitialSync => pb::Phase::InitialSync.name(),
            Phase::Quiesce => pb::Phase::Quiesce.name(),
            Phase::LocalCheckpoint => pb::Phase::LocalCheckpoint.name(),
            Phase::Resume => pb::Phase::Resume.name(),
            Phase::Finalize => pb::Phase::Finalize.name(),
            // ckptd's own, after the nodes' phases.
            Phase::Commit => "commit",
        }
    }
}

/// A refused state transition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} is {from}; cannot {action}")]
pub struct TransitionError {
    /// "job 3" or "job 3 epoch 2".
    pub what: String,
    /// Current state.
    pub from: String,
    /// Refused action.
    pub action: String,
}

/// State of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    /// Recorded; its command is being started (its launcher may already attach parts).
    Starting,
    /// Processes running.
    Running,
    /// A checkpoint epoch is in progress.
    Checkpointing,
    /// A restart is in progress.
    Restarting,
    /// The job's root process ended by itself (or was killed from outside).
    Exited {
        /// Exit code.
        code: Option<i32>,
        /// Signal.
        signal: Option<i32>,
    },
    /// Stopped by ckpt after a checkpoint (`--kill`).
    Stopped,
    /// Killed by `ckptctl cancel`.
    Cancelled,
    /// Its processes vanished without a recorded exit (node or agent lost).
    Lost,
    /// Its command could not be started.
    FailedToStart {
        /// What the agent reported.
        reason: String,
    },
}

impl JobState {
    /// Name shown to users.
    pub fn name(&self) -> String {
        match self {
            JobState::Starting => "starting".into(),
            JobState::Running => "running".into(),
            JobState::Checkpointing => "checkpointing".into(),
            JobState::Restarting => "restarting".into(),
            JobState::Exited { code: Some(c), .. } => format!("exited ({c})"),
            JobState::Exited {
                signal: Some(s), ..
            } => format!("killed (signal {s})"),
            JobState::Exited { .. } => "exited".into(),
            JobState::Stopped => "stopped".into(),
            JobState::Cancelled => "cancelled".into(),
            JobState::Lost => "lost".into(),
            JobState::FailedToStart { .. } => "failed to start".into(),
        }
    }

    /// Whether processes are (supposed to be) alive.
    pub fn is_active(&self) -> bool {
        matches!(
            self,
            JobState::Starting | JobState::Running | JobState::Checkpointing | JobState::Restarting
        )
    }
}

/// A job as the coordinator records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    /// Id (1, 2, ...).
    pub id: u64,
    /// Name given by the user (or the command's basename).
    pub name: String,
    /// Owner.
    pub owner_uid: u32,
    /// Owner's group.
    pub owner_gid: u32,
    /// Command.
    pub argv: Vec<String>,
    /// Working directory.
    pub cwd: String,
    /// Node the job's launcher runs on.
    pub node: String,
    /// State: read through [`Job::state`], changed only by the transitions below.
    state: JobState,
    /// The agent-side incarnation that `state` describes (launches and restores bump it).
    pub incarnation: u32,
    /// Highest epoch number used.
    pub last_epoch: u32,
    /// Latest committed epoch, 0 if none.
    pub latest_committed: u32,
    /// Creation time (ms since the Unix epoch).
    pub created_unix_ms: u64,
    /// Job directory on the launcher node (stdout, stderr, logs).
    pub job_dir: String,
    /// Further nodes where the job's MPI launcher started a part through `ckpt-rsh`, in order.
    #[serde(default)]
    pub parts: Vec<String>,
    /// The job's secret: `ckpt-rsh` presents it to attach parts on other nodes.
    #[serde(default)]
    pub token: String,
    /// Variables the job's parts on other nodes get besides their login environment.
    #[serde(default)]
    pub part_env: std::collections::BTreeMap<String, String>,
    /// The job address (`ADDRESS/PREFIX`) of the part on each node, when the job runs in
    /// sandboxes.
    #[serde(default)]
    pub addresses: std::collections::BTreeMap<String, String>,
    /// Nodes a restart moved the job's parts away from, and where each part runs now: a
    /// restored `ckpt-rsh` still names the node it started its part on.
    #[serde(default)]
    pub moved: std::collections::BTreeMap<String, String>,
    /// When ckptd checkpoints the job by itself.
    #[serde(default)]
    pub policy: Policy,
    /// When the current incarnation began running (ms since the Unix epoch): the launch or the
    /// last restart. Periodic checkpoints count from the later of this and the last epoch.
    #[serde(default)]
    pub running_since_unix_ms: u64,
    /// The snapshot engine the job asked for; None: it named none, and gets the default (CRIU).
    /// Stored as its name, "" for none.
    #[serde(default, with = "engine_or_empty")]
    pub engine: Option<Engine>,
    /// Why the job is `lost`, when a node of it went down (see `driver/lost.rs`).
    #[serde(default)]
    pub lost: Option<LostNode>,
    /// What ckptd does when the job fails.
    #[serde(default)]
    pub on_failure: OnFailure,
    /// How the job's checkpoints survive lost nodes, when it chose (`ckptctl run
    /// --redundancy`): a scheme, or `none`; empty: ckptd.toml's `[redundancy] scheme`.
    #[serde(default)]
    pub redundancy: String,
    /// The automatic restarts ckptd did, oldest first.
    #[serde(default)]
    pub recoveries: Vec<Recovery>,
    /// While the job is failed: why ckptd has not restarted it (yet), or why it will not.
    #[serde(default)]
    pub recovery_note: String,
    /// The incarnation whose failure ckptd gave up on: it is not restarted by itself again.
    #[serde(default)]
    pub gave_up: Option<u32>,
    /// A process of the running incarnation killed by a signal that means a failure, as a node
    /// reported it ("heat (pid 4711) killed by signal 9 on n2"); cleared by a restart.
    #[serde(default)]
    pub killed: String,
    /// While restarting: the state before, which a coordinator restart that interrupts the
    /// restart goes back to (the old incarnation had ended; its late reports are stale).
    #[serde(default)]
    pub before_restart: Option<JobState>,
    /// Epochs retention expired whose local images the job's nodes were not told yet to
    /// delete: its next epoch tells them with its initial synchronization (one message, not a
    /// call per node); a job that stops or ends has them deleted at once.
    #[serde(default)]
    pub unpruned: Vec<u32>,
}

/// The node whose loss made a job `lost`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LostNode {
    /// The node.
    pub node: String,
    /// When it was last heard from (ms since the Unix epoch).
    pub since_unix_ms: u64,
    /// When ckptd declared it lost.
    pub noticed_unix_ms: u64,
}

/// [`Job::engine`] as records store it: the engine's name, "" for none.
mod engine_or_empty {
    use ckpt_proto::Engine;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// Writes the engine's name, or "" for none.
    pub fn serialize<S: Serializer>(e: &Option<Engine>, s: S) -> Result<S::Ok, S::Error> {
        match e {
            Some(e) => e.serialize(s),
            None => s.serialize_str(""),
        }
    }

    /// Reads "" as none and an engine's name as that engine; refuses any other name.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Engine>, D::Error> {
        let name = String::deserialize(d)?;
        if name.is_empty() {
            return Ok(None);
        }
        name.parse().map(Some).map_err(serde::de::Error::custom)
    }
}

impl Job {
    /// A record of job `id` in `state` with nothing else set yet: no name, command, owner,
    /// node, token, epochs, parts or history, the default policies. Its maker fills in the
    /// rest (`Job { name, .., ..Job::new(id, state) }`).
    pub fn new(id: u64, state: JobState) -> Job {
        Job {
            id,
            name: String::new(),
            owner_uid: 0,
            owner_gid: 0,
            argv: Vec::new(),
            cwd: String::new(),
            node: String::new(),
            state,
            incarnation: 0,
            last_epoch: 0,
            latest_committed: 0,
            created_unix_ms: 0,
            job_dir: String::new(),
            parts: Vec::new(),
            part_env: Default::default(),
            addresses: Default::default(),
            moved: Default::default(),
            token: String::new(),
            policy: Default::default(),
            running_since_unix_ms: 0,
            engine: None,
            lost: None,
            on_failure: Default::default(),
            redundancy: String::new(),
            recoveries: Vec::new(),
            recovery_note: String::new(),
            gave_up: None,
            killed: String::new(),
            before_restart: None,
            unpruned: Vec::new(),
        }
    }

    /// The job's snapshot engine (CRIU where none was named).
    pub fn snapshot_engine(&self) -> Engine {
        self.engine.unwrap_or_default()
    }

    /// Whether the job's engine virtualizes PIDs and reconnects sockets itself (DMTCP): such
    /// a job runs in the node's namespaces, without a job network address, and moves to other
    /// nodes without one.
    pub fn engine_virtualizes(&self) -> bool {
        self.snapshot_engine().virtualizes()
    }

    /// Whether the job's processes run (or are being started, checkpointed or restored): its
    /// nodes are not free for another job's parts.
    pub fn is_live(&self) -> bool {
        matches!(
            self.state,
            JobState::Starting | JobState::Running | JobState::Checkpointing | JobState::Restarting
        )
    }

    /// Whether the job keeps its job addresses: while it runs, and after it ended in a way a
    /// restart follows (stopped by ckpt, killed, lost). A job that finished or was cancelled
    /// gives them back; restarting it later takes them again if they are still free.
    pub fn holds_addresses(&self) -> bool {
        !matches!(
            self.state,
            JobState::Exited { code: Some(_), .. }
                | JobState::Cancelled
                | JobState::FailedToStart { .. }
        )
    }

    /// Every node the job runs on: the launcher node first, then its parts.
    pub fn nodes(&self) -> Vec<String> {
        std::iter::once(self.node.clone())
            .chain(self.parts.iter().cloned())
            .collect()
    }

    fn refuse(&self, action: &str) -> TransitionError {
        TransitionError {
            what: format!("job {}", self.id),
            from: self.state.name(),
            action: action.into(),
        }
    }

    /// Starts a checkpoint epoch: only a running job; returns the new epoch number.
    pub fn begin_checkpoint(&mut self) -> Result<u32, TransitionError> {
        if self.state != JobState::Running {
            return Err(self.refuse("checkpoint it"));
        }
        self.state = JobState::Checkpointing;
        self.last_epoch += 1;
        Ok(self.last_epoch)
    }

    /// Ends a checkpoint epoch; `committed` if it was committed, `killed` if the job was stopped.
    pub fn end_checkpoint(
        &mut self,
        committed: Option<u32>,
        killed: bool,
    ) -> Result<(), TransitionError> {
        if self.state != JobState::Checkpointing {
            return Err(self.refuse("end a checkpoint"));
        }
        if let Some(e) = committed {
            self.latest_committed = self.latest_committed.max(e);
        }
        self.state = if killed {
            JobState::Stopped
        } else {
            JobState::Running
        };
        Ok(())
    }

    /// Starts a restart: only a job whose processes are gone.
    pub fn begin_restart(&mut self) -> Result<(), TransitionError> {
        if self.state.is_active() {
            return Err(self.refuse("restart it (cancel it first, or checkpoint it with --kill)"));
        }
        self.before_restart = Some(self.state.clone());
        self.state = JobState::Restarting;
        Ok(())
    }

    /// Ends a restart: running again with a new incarnation, or back to `previous` on failure.
    pub fn end_restart(&mut self, result: Result<u32, JobState>) -> Result<(), TransitionError> {
        if self.state != JobState::Restarting {
            return Err(self.refuse("end a restart"));
        }
        self.before_restart = None;
        match result {
            Ok(incarnation) => {
                self.state = JobState::Running;
                self.incarnation = incarnation;
                self.killed.clear();
            }
            Err(previous) => self.state = previous,
        }
        Ok(())
    }

    /// Where the job's parts run after a restart from an epoch taken on `epoch_nodes` (its
    /// `nodes()` then, launcher first), each moved as `moves` says (keyed by the epoch's
    /// nodes). The epoch's nodes are the job's at that time, in the same order (parts are only
    /// appended, and moves keep their place), so the part at each position keeps its address,
    /// and `moved` keeps mapping the node each part first ran on (which a restored `ckpt-rsh`
    /// still names) to where it runs now.
    pub fn place_from(
        &mut self,
        epoch_nodes: &[String],
        moves: &std::collections::BTreeMap<String, String>,
    ) {
        let current = self.nodes();
        let first_ran_on = |n: &String| {
            self.moved
                .iter()
                .find(|(_, now)| *now == n)
                .map(|(old, _)| old.clone())
                .unwrap_or_else(|| n.clone())
        };
        let mut addresses = std::collections::BTreeMap::new();
        let mut moved = std::collections::BTreeMap::new();
        let mut placed = Vec::with_capacity(epoch_nodes.len());
        for (i, e) in epoch_nodes.iter().enumerate() {
            let new = moves.get(e).cloned().unwrap_or_else(|| e.clone());
            // The part at this position: its node now (before the restart), else the epoch's.
            let before = current.get(i).unwrap_or(e);
            if let Some(a) = self.addresses.get(before) {
                addresses.insert(new.clone(), a.clone());
            }
            let origin = first_ran_on(before);
            if origin != new {
                moved.insert(origin, new.clone());
            }
            placed.push(new);
        }
        if let Some((launcher, parts)) = placed.split_first() {
            self.node = launcher.clone();
            self.parts = parts.to_vec();
        }
        self.addresses = addresses;
        self.moved = moved;
    }

    /// Records what the agent reports about the current incarnation: an end of a running job,
    /// or the definitive exit of a job whose end was unknown (`Lost` without a lost node). Reports about another
    /// incarnation, or while a checkpoint or restart is in progress, are ignored.
    pub fn observe(&mut self, incarnation: u32, report: JobState) -> bool {
        if incarnation != self.incarnation || report == JobState::Running {
            return false;
        }
        let exited = matches!(report, JobState::Exited { .. });
        // A job lost with a node keeps saying so: the exits of its other parts, killed then,
        // are not its end.
        let applies = self.state == JobState::Running
            || (self.state == JobState::Lost && self.lost.is_none() && exited);
        if !applies {
            return false;
        }
        self.state = report;
        true
    }

    /// Cancels a running job (its processes are then killed), or one that ended in a way a
    /// restart follows (stopped by ckpt, killed, lost, or failed and about to restart by
    /// itself): it gives back its job addresses and is not restarted by itself. Its epochs
    /// stay restorable by hand.
    pub fn cancel(&mut self) -> Result<(), TransitionError> {
        let may = match self.state {
            JobState::Running | JobState::Stopped | JobState::Lost => true,
            JobState::Exited { .. } => self.holds_addresses() || self.failure().is_some(),
            _ => false,
        };
        if !may {
            return Err(self.refuse("cancel it"));
        }
        self.state = JobState::Cancelled;
        Ok(())
    }

    /// The job's state.
    pub fn state(&self) -> &JobState {
        &self.state
    }

    /// The launch failed: the record stays (its id is never reused) and says why.
    pub fn failed_to_start(&mut self, reason: String) {
        self.state = JobState::FailedToStart { reason };
    }

    /// The launcher runs, as `incarnation`, with its job directory; since `now_ms`.
    pub fn started(&mut self, incarnation: u32, job_dir: String, now_ms: u64) {
        self.state = JobState::Running;
        self.running_since_unix_ms = now_ms;
        self.incarnation = incarnation;
        self.job_dir = job_dir;
    }

    /// A cancel killed the job's processes: a job still running, or whose end was seen since
    /// the cancel began (its exit on SIGTERM), is cancelled; any other end stands.
    pub fn killed_by_cancel(&mut self) {
        if self.state == JobState::Running || matches!(self.state, JobState::Exited { .. }) {
            self.state = JobState::Cancelled;
        }
    }

    /// Incarnation `incarnation`, running, is lost with a node (`lost`); false if the job is
    /// no longer that one running.
    pub fn lose(&mut self, incarnation: u32, lost: LostNode) -> bool {
        if self.state != JobState::Running || self.incarnation != incarnation {
            return false;
        }
        self.state = JobState::Lost;
        self.lost = Some(lost);
        true
    }

    /// What a checkpoint or restart in progress, or a start, interrupted by ckptd's own restart
    /// leaves: a checkpoint's job runs on; a restart goes back to where it began (lost if
    /// that is not known); a start's processes are unknown (lost). False if nothing was in
    /// progress.
    pub fn interrupted(&mut self) -> bool {
        self.state = match self.state {
            JobState::Checkpointing => JobState::Running,
            JobState::Restarting => self.before_restart.take().unwrap_or(JobState::Lost),
            JobState::Starting => JobState::Lost,
            _ => return false,
        };
        true
    }
}

/// Jobs and epochs for the unit tests of the modules that keep them.
#[cfg(test)]
pub(crate) mod fixtures;

#[cfg(test)]
mod tests;
