//! The phase driver: runs one checkpoint epoch of a job as a sequence of barriers over every
//! node hosting it, and restarts jobs from committed epochs.
//!
//! Each phase calls every node in parallel with the phase's deadline and waits for all answers.
//! The first failure (an error, an unreachable agent, a missed deadline) aborts the epoch: every
//! node thaws what it froze and deletes the epoch's partial images, the epoch is recorded failed
//! with the phase and the reason, and the job keeps running from where it was. Nothing is
//! restorable until the commit is written to the registry, after every node sealed its images.
//!
//! This file is the core: the coordinator, its errors, and the barrier that calls every node
//! with a deadline. The protocol steps live beside it: `checkpoint.rs` (one epoch, phase by
//! phase), `endpoints.rs` (the InfiniBand rebuild after a resume or a restore), `restart.rs`,
//! `attach.rs` (parts of a job started on other nodes through ckpt-rsh), `jobs.rs` (run, cancel,
//! agents' reports), `nodes.rs` (what `ckptctl nodes` shows), `gauges.rs` (the metrics computed
//! at each scrape), `schedule.rs` (periodic checkpoints), `deadline.rs` (estimates and
//! deadlines), `resume.rs` (`run --resume`) and [`flush`] (partner copies, the flush to shared
//! storage, retention).
mod addresses;
mod attach;
mod checkpoint;
mod deadline;
mod drain;
mod encode;
mod endpoints;
pub mod flush;
mod gauges;
mod jobs;
mod lost;
mod nodes;
mod placement;
mod quota;
mod recover;
mod restart;
mod resume;
mod schedule;

pub use drain::Drained;
pub use nodes::NodeState;
pub use placement::{Allocation, Moves, Placement};
pub use restart::Begun;
pub use resume::Resume;

pub use ckpt_proto::now_ms;

use std::sync::Arc;

use ckpt_proto::v1 as pb;
use futures_util::future::join_all;
use tokio::sync::Mutex;
use tracing::warn;

use crate::agents::{call, Agents, FailureKind, NodeFailure};
use crate::config::CoordinatorConfig;
use crate::model::{Epoch, FlushState, Job, JobState, Phase, TransitionError};
use crate::registry::{Registry, RegistryError};

/// Why a request to the coordinator failed.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    /// No such job.
    #[error("job {job} not found (see `ckptctl list`)")]
    UnknownJob {
        /// Job id.
        job: u64,
    },
    /// The caller does not own the job.
    #[error("job {job} belongs to uid {owner}; only its owner or root may act on it")]
    NotOwner {
        /// Job id.
        job: u64,
        /// Owner.
        owner: u32,
    },
    /// Wrong state for the request.
    #[error(transparent)]
    State(#[from] TransitionError),
    /// The job has no committed epoch.
    #[error("job {job} has no committed checkpoint to restart from (see `ckptctl epochs {job}`)")]
    NoCommittedEpoch {
        /// Job id.
        job: u64,
    },
    /// The requested epoch cannot be restored.
    #[error(
        "job {job} epoch {epoch} is {state} and cannot be restored (see `ckptctl epochs {job}`)"
    )]
    EpochNotRestorable {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// Its state.
        state: String,
    },
    /// Bad request.
    #[error("{0}")]
    Invalid(String),
    /// A deadline too close for a final checkpoint (the message says the estimate).
    #[error("{0}")]
    DeadlineTooClose(String),
    /// The caller may not do this (wrong job secret).
    #[error("{0}")]
    Denied(String),
    /// The caller's `[limits]` in ckptd.toml would be exceeded.
    #[error("{0}")]
    Quota(String),
    /// Not now: try again shortly (a checkpoint or restart of the job is in progress).
    #[error("{0}")]
    Busy(String),
    /// A restart names a node that has no registered agent.
    #[error("{hint}")]
    UnknownNode {
        /// The node.
        node: String,
        /// What to do.
        hint: String,
    },
    /// A restart would put a part on a node that cannot take it.
    #[error("node {node} cannot take a part of this restart: {reason}")]
    NodeNotFree {
        /// The node.
        node: String,
        /// Why.
        reason: String,
    },
    /// A restart would move a part of a job without a restart policy off a node ckptd cannot
    /// reach: the part there is not fenced and may still run.
    #[error("job {job}'s part on {node} may still run: ckptd has not heard from {node} {since}, and the job has no restart policy, so {node} does not fence (kill) its part when cut off from ckptd; a copy restored elsewhere would run beside it. Restart once {node} is back (its part is then stopped first), or, if {node} is down for good (powered off, or its ckpt-agent and processes stopped), say so: `ckptctl restart {job} --down {node} ...`")]
    PartMayRun {
        /// The job.
        job: u64,
        /// The node.
        node: String,
        /// "for 40s", "since ckptd started".
        since: String,
    },
    /// Fewer free spares than nodes to replace.
    #[error("{down} must be replaced but {free}: {hint}")]
    NoSpare {
        /// The nodes that need a spare.
        down: String,
        /// Which spares are free, if any.
        free: String,
        /// What to do.
        hint: String,
    },
    /// No agent to run the job.
    #[error("no agent is registered; start ckpt-agent on a node (or run ckptd --standalone)")]
    NoAgents,
    /// An epoch failed and was aborted.
    #[error("job {job} epoch {epoch} failed in phase {phase}: {failure}; the epoch was aborted, the job keeps running, earlier checkpoints are still restorable")]
    EpochFailed {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// Phase name.
        phase: &'static str,
        /// What failed.
        failure: NodeFailure,
    },
    /// A restart failed.
    #[error("restart of job {job} from epoch {epoch} failed: {failure}")]
    RestartFailed {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// What failed.
        failure: NodeFailure,
    },
    /// A call to an agent failed outside an epoch.
    #[error(transparent)]
    Node(#[from] NodeFailure),
    /// The registry failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// One progress message of a long operation.
#[derive(Debug, Clone)]
pub struct Step {
    /// Job.
    pub job: u64,
    /// Epoch (0 before one is chosen).
    pub epoch: u32,
    /// What the operation is doing.
    pub phase: OperationPhase,
    /// What happened.
    pub message: String,
}

/// What a long operation is doing when it reports a [`Step`]: a phase of a checkpoint epoch, a
/// restore, or a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperationPhase {
    /// A phase of a checkpoint epoch.
    Epoch(Phase),
    /// A restart restoring the job on its nodes.
    Restore,
    /// A drain checkpointing and stopping (or moving) the jobs of a node.
    Drain,
}

impl OperationPhase {
    /// Name shown to users: the epoch phase's, "restore" or "drain".
    pub fn name(self) -> &'static str {
        match self {
            OperationPhase::Epoch(p) => p.name(),
            OperationPhase::Restore => "restore",
            OperationPhase::Drain => "drain",
        }
    }

    /// Its value in the Control API (`Progress.phase_kind`).
    pub fn kind(self) -> pb::OperationPhase {
        match self {
            OperationPhase::Epoch(p) => crate::wire::phase(p),
            OperationPhase::Restore => pb::OperationPhase::Restore,
            OperationPhase::Drain => pb::OperationPhase::Drain,
        }
    }
}

/// Who is asking: the peer credentials of the ckptctl connection.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Process id, for logs (groups are not taken from it: the agent derives a job's groups
    /// from its uid).
    pub pid: Option<i32>,
}

impl Caller {
    fn may_act_on(&self, job: &Job) -> Result<(), DriveError> {
        if self.uid == 0 || self.uid == job.owner_uid {
            Ok(())
        } else {
            Err(DriveError::NotOwner {
                job: job.id,
                owner: job.owner_uid,
            })
        }
    }
}

/// What a run needs.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// Job name.
    pub name: String,
    /// Command.
    pub argv: Vec<String>,
    /// Working directory.
    pub cwd: String,
    /// Environment.
    pub env: std::collections::HashMap<String, String>,
    /// Node for the launcher (empty: the first registered).
    pub node: String,
    /// Variables the job's parts on other nodes get too.
    pub part_env: std::collections::HashMap<String, String>,
    /// When ckptd checkpoints it by itself.
    pub policy: crate::model::Policy,
    /// Snapshot engine ("" or "criu", "dmtcp").
    pub engine: String,
    /// `--on-failure`: "stop", "restart", "restart:N"; empty: ckptd.toml `[recovery]`.
    pub on_failure: String,
    /// `ckptctl run --redundancy` ("" for ckptd.toml's).
    pub redundancy: String,
}

/// The coordinator: registry, agents, configuration.
#[derive(Debug)]
pub struct Coordinator {
    /// Persistent jobs and epochs.
    pub registry: Registry,
    /// Registered agents.
    pub agents: Agents,
    pub(crate) cfg: CoordinatorConfig,
    /// Serializes read-modify-write of job records (short critical sections only).
    pub(crate) state: Mutex<()>,
    /// Flushes to shared storage: progress, ordering, and those waiting for their nodes.
    pub(crate) flushes: flush::Flushes,
    /// Epochs to abort on a node when its agent registers: found in progress at start-up, or
    /// whose abort could not reach the node.
    orphaned: std::sync::Mutex<Vec<(String, u64, u32)>>,
    /// Jobs whose restart a coordinator restart interrupted: the parts a node may hold
    /// restored, frozen until a release that never comes, are killed when it registers.
    interrupted: std::sync::Mutex<std::collections::HashSet<u64>>,
    /// Failed ends of multi-node jobs' launchers, by job and incarnation, held since when
    /// (see `Coordinator::hold_end`).
    held_ends: std::sync::Mutex<std::collections::HashMap<(u64, u32), std::time::Instant>>,
    /// Jobs a cancel is killing: their end is the cancel's, never a failure to recover from.
    cancelling: std::sync::Mutex<std::collections::HashSet<u64>>,
    /// Parts `ckpt-rsh` asked to start, by job and node, for its retries.
    attaches: attach::Attaches,
    /// What `[limits]` counts in memory.
    usage: quota::Usage,
    /// When this coordinator started: a node that has not registered `node_timeout` after it
    /// is down.
    started: std::time::Instant,
    started_unix_ms: u64,
    /// The end of ckptd's last stall (its start at first): a node's silence counts from no
    /// earlier (`lost.rs`).
    awake: std::sync::Mutex<std::time::Instant>,
    /// The coordinator's cluster credential: agents are called over TLS with it. None for a
    /// standalone ckptd without one, which reaches only its embedded agent (local socket).
    credential: Option<ckpt_auth::tls::Credential>,
}

impl Coordinator {
    /// A coordinator over an opened registry. Epochs left in progress by an earlier ckptd are
    /// marked failed, and their nodes are told to abort them when they register.
    pub fn new(
        registry: Registry,
        cfg: CoordinatorConfig,
        credential: Option<ckpt_auth::tls::Credential>,
    ) -> Result<Arc<Self>, DriveError> {
        // Registered now, so that a scrape sees them before the first epoch.
        crate::metrics::metrics();
        let mut orphaned = Vec::new();
        let mut interrupted = std::collections::HashSet::new();
        let flushes = flush::Flushes::default();
        for mut job in registry.jobs()? {
            let mut changed = false;
            for mut e in registry.epochs(job.id)? {
                // An encoding is recorded only once complete: one interrupted is done again.
                let encode_pending = e.is_restorable()
                    && e.local_copy
                    && e.encodings.is_empty()
                    && cfg
                        .redundancy
                        .scheme_for(&job.redundancy)
                        .is_some_and(|s| s.code().is_some() && e.nodes.len() > s.parity());
                if e.is_restorable() && (e.flush == FlushState::Flushing || encode_pending) {
                    // Interrupted: copied again from the start once every node is back.
                    flushes.wait_for_nodes(job.id, e.number);
                }
                if e.phase().is_some() {
                    warn!(
                        job = job.id,
                        epoch = e.number,
                        "epoch interrupted by a coordinator restart"
                    );
                    e.fail("the coordinator restarted during the epoch", now_ms())?;
                    registry.put_epoch(&e)?;
                    for n in &e.nodes {
                        orphaned.push((n.clone(), job.id, e.number));
                    }
                }
            }
            // Interrupted by this coordinator's restart: what became of the processes is
            // unknown until an agent reports. A restart's parts held on nodes are killed as
            // they register.
            if *job.state() == JobState::Restarting {
                interrupted.insert(job.id);
            }
            changed |= job.interrupted();
            if changed {
                registry.put_job(&job)?;
            }
        }
        let fence = registry.fence();
        Ok(Arc::new(Coordinator {
            registry,
            agents: Agents::fenced(fence),
            cfg,
            state: Mutex::new(()),
            orphaned: std::sync::Mutex::new(orphaned),
            interrupted: std::sync::Mutex::new(interrupted),
            held_ends: Default::default(),
            cancelling: Default::default(),
            attaches: Default::default(),
            credential,
            flushes,
            usage: Default::default(),
            started: std::time::Instant::now(),
            started_unix_ms: now_ms(),
            awake: std::sync::Mutex::new(std::time::Instant::now()),
        }))
    }

    async fn update_job(
        &self,
        id: u64,
        f: impl FnOnce(&mut Job) -> Result<(), DriveError>,
    ) -> Result<Job, DriveError> {
        let _g = self.state.lock().await;
        let mut job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        f(&mut job)?;
        self.registry.put_job(&job)?;
        Ok(job)
    }

    /// Moves an epoch to its next phase, noted in the registry for readers (not synced: see
    /// [`Registry::note_epoch`]).
    fn advance(&self, epoch: &mut Epoch, next: Phase) {
        if let Err(e) = epoch.enter(next) {
            // Phases are entered in code order; a refusal here is a bug, not a user error.
            panic!("phase driver out of order: {e}");
        }
        if let Err(e) = self.registry.note_epoch(epoch) {
            warn!(error = %e, "cannot persist epoch progress");
        }
    }

    /// Calls every node in parallel; all must succeed. Returns (node, reply) pairs.
    async fn on_all<T, F, Fut>(
        &self,
        nodes: &[String],
        what: &str,
        deadline: std::time::Duration,
        f: F,
    ) -> Result<Vec<(String, T)>, NodeFailure>
    where
        F: Fn(ckpt_proto::FencedAgentClient) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.on_each(nodes, what, deadline, |_, c| f(c)).await
    }

    /// [`Self::on_all`] with a request that depends on the node.
    async fn on_each<'n, T, F, Fut>(
        &self,
        nodes: &'n [String],
        what: &str,
        deadline: std::time::Duration,
        f: F,
    ) -> Result<Vec<(String, T)>, NodeFailure>
    where
        F: Fn(&'n str, ckpt_proto::FencedAgentClient) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut calls = Vec::new();
        for n in nodes {
            let client = self.agents.client(n)?;
            let fut = f(n, client);
            calls.push(async move { (n.clone(), call(n, what, deadline, fut).await) });
        }
        let mut out = Vec::new();
        let mut first_err = None;
        for (n, r) in join_all(calls).await {
            match r {
                Ok(v) => out.push((n, v)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    async fn abort_all(
        &self,
        nodes: &[String],
        job: u64,
        epoch: u32,
        reason: &str,
    ) -> Vec<NodeFailure> {
        let d = self.cfg.deadlines.abort;
        let r = self
            .on_all_collect(nodes, "abort", d, |mut c| {
                let req = pb::AbortRequest {
                    job_id: job,
                    epoch,
                    reason: reason.to_string(),
                };
                async move { c.abort(req).await }
            })
            .await;
        let failed: Vec<NodeFailure> = r.into_iter().filter_map(|(_, r)| r.err()).collect();
        // A node that could not be told now is told when its agent registers again.
        let mut o = self.orphaned.lock().expect("orphaned lock");
        for f in &failed {
            o.push((f.node.clone(), job, epoch));
        }
        failed
    }

    async fn on_all_collect<T, F, Fut>(
        &self,
        nodes: &[String],
        what: &str,
        deadline: std::time::Duration,
        f: F,
    ) -> Vec<(String, Result<T, NodeFailure>)>
    where
        F: Fn(ckpt_proto::FencedAgentClient) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let f = &f;
        let calls = nodes
            .iter()
            .map(|n| async move { (n.clone(), self.agents.call(n, what, deadline, f).await) });
        join_all(calls).await
    }

    /// The kind of a failure, for mapping to status codes.
    pub fn failure_kind(e: &DriveError) -> Option<FailureKind> {
        match e {
            DriveError::EpochFailed { failure, .. }
            | DriveError::RestartFailed { failure, .. }
            | DriveError::Node(failure) => Some(failure.kind),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_phase_has_the_value_of_its_name() {
        let all = crate::model::fixtures::PHASES
            .into_iter()
            .map(OperationPhase::Epoch)
            .chain([OperationPhase::Restore, OperationPhase::Drain]);
        for op in all {
            // A new operation does not compile here until it is listed above.
            match op {
                OperationPhase::Epoch(_) | OperationPhase::Restore | OperationPhase::Drain => {}
            }
            // OPERATION_PHASE_LOCAL_CHECKPOINT for "local-checkpoint".
            let want = format!(
                "OPERATION_PHASE_{}",
                op.name().to_uppercase().replace('-', "_")
            );
            assert_eq!(op.kind().as_str_name(), want);
        }
    }
}
