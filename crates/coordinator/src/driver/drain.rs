//! `ckptctl drain NODE`: a node is being reclaimed. Every live job with a part on it is
//! checkpointed and stopped; with `migrate`, each is restarted at once with that part on a
//! spare (the other parts where they ran).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{info, warn};

use super::placement::Placement;
use super::{Caller, Coordinator, DriveError, OperationPhase, Step};
use crate::agents::{FailureKind, NodeFailure};
use crate::model::{FlushState, Job, Trigger};

/// What became of one job of a drained node.
#[derive(Debug)]
pub struct Drained {
    /// Job id.
    pub job: u64,
    /// The epoch it was checkpointed to, if that succeeded.
    pub epoch: Option<u32>,
    /// Where its part of the node runs now, if it was migrated.
    pub moved_to: Option<String>,
    /// Why it was not checkpointed, or not migrated.
    pub error: Option<DriveError>,
    /// When the checkpoint failed after the job was stopped: the epoch it restarts from.
    pub stopped_at: Option<u32>,
}

impl Coordinator {
    /// The live jobs with a part on `node`. Only root drains a node: it stops other users'
    /// jobs. With `migrate`, refused before anything is stopped when a job cannot move (it runs
    /// without sandboxes) or there are fewer free spares than jobs.
    pub fn begin_drain(
        &self,
        caller: &Caller,
        node: &str,
        migrate: bool,
    ) -> Result<Vec<Job>, DriveError> {
        if caller.uid != 0 {
            return Err(DriveError::Denied(
                "only root may drain a node: it stops every user's jobs there".into(),
            ));
        }
        if self.agents.address(node).is_none() {
            return Err(DriveError::UnknownNode {
                node: node.into(),
                hint: format!("{node} has no registered agent: there is nothing to drain"),
            });
        }
        let all = self.registry.jobs()?;
        let jobs: Vec<Job> = all
            .iter()
            .filter(|j| j.is_live() && j.nodes().iter().any(|n| n == node))
            .cloned()
            .collect();
        if !jobs.is_empty() && !self.agents.up(node, self.cfg.node_timeout) {
            let ids: Vec<String> = jobs.iter().map(|j| j.id.to_string()).collect();
            return Err(DriveError::UnknownNode {
                node: node.into(),
                hint: format!(
                    "{node} is down (no heartbeat for {}): its parts cannot be checkpointed; restart job(s) {} from their last checkpoint with `ckptctl restart JOB --on-spares`",
                    humantime::format_duration(self.cfg.node_timeout),
                    ids.join(", ")
                ),
            });
        }
        if migrate && !jobs.is_empty() {
            let fixed: Vec<String> = jobs
                .iter()
                .filter(|j| j.addresses.is_empty())
                .map(|j| j.id.to_string())
                .collect();
            if !fixed.is_empty() {
                return Err(DriveError::NodeNotFree {
                    node: node.into(),
                    reason: format!(
                        "job(s) {} run without a job network and cannot move; nothing was stopped (drain without --migrate to checkpoint and stop them)",
                        fixed.join(", ")
                    ),
                });
            }
            let free = self
                .cfg
                .spares
                .nodes
                .iter()
                .filter(|s| {
                    *s != node
                        && self.agents.up(s, self.cfg.node_timeout)
                        && !all.iter().any(|j| j.is_live() && j.nodes().contains(s))
                })
                .count();
            if free < jobs.len() {
                return Err(DriveError::NoSpare {
                    down: format!("{} job(s) on {node} (drained)", jobs.len()),
                    free: format!("{free} spare(s) are free"),
                    hint: "nothing was stopped; add spares ([spares] in ckptd.toml), or drain without --migrate".into(),
                });
            }
        }
        Ok(jobs)
    }

    /// Checkpoints (and stops) each job, one after the other; with `migrate`, restarts it with
    /// `node`'s part on a spare. A job that cannot be checkpointed keeps running where it is;
    /// one that cannot be migrated stays stopped, restorable.
    pub async fn drive_drain(
        self: &Arc<Self>,
        node: &str,
        jobs: Vec<Job>,
        migrate: bool,
        progress: mpsc::UnboundedSender<Step>,
    ) -> Vec<Drained> {
        let root = Caller {
            uid: 0,
            gid: 0,
            pid: None,
        };
        let mut out = Vec::new();
        for job in jobs {
            let id = job.id;
            let say = |epoch: u32, message: String| {
                let _ = progress.send(Step {
                    job: id,
                    epoch,
                    phase: OperationPhase::Drain,
                    message,
                });
            };
            say(0, format!("checkpointing job {id} and stopping it"));
            let checkpointed = match self.begin_checkpoint(&root, id, true, Trigger::Drain).await {
                Ok((job, epoch)) => self.drive_checkpoint(job, epoch, progress.clone()).await,
                Err(e) => Err(e),
            };
            let epoch = match checkpointed {
                Ok(e) => e.number,
                Err(e) => {
                    warn!(job = id, node, error = %e, "drain: checkpoint failed");
                    // A failure after the job was stopped (sealing, commit) leaves it stopped:
                    // say so, with the epoch it restarts from.
                    let stopped = self
                        .registry
                        .job(id)
                        .ok()
                        .flatten()
                        .filter(|j| !j.is_live() && j.latest_committed > 0);
                    out.push(Drained {
                        job: id,
                        epoch: None,
                        moved_to: None,
                        stopped_at: stopped.map(|j| j.latest_committed),
                        error: Some(e),
                    });
                    continue;
                }
            };
            info!(job = id, node, epoch, "drain: job checkpointed and stopped");
            let moved = if migrate {
                self.migrate(&root, id, epoch, node, &say, &progress).await
            } else {
                Ok(None)
            };
            if let Err(e) = &moved {
                warn!(job = id, node, error = %e, "drain: migration failed; the job stays stopped");
            }
            let (moved_to, error) = match moved {
                Ok(to) => (to, None),
                Err(e) => (None, Some(e)),
            };
            out.push(Drained {
                job: id,
                epoch: Some(epoch),
                moved_to,
                error,
                stopped_at: None,
            });
        }
        out
    }

    /// Restarts a drained job from `epoch` with `node`'s part on a spare, once another node
    /// holds a copy of that part's images; returns the spare.
    async fn migrate(
        &self,
        root: &Caller,
        id: u64,
        epoch: u32,
        node: &str,
        say: &impl Fn(u32, String),
        progress: &mpsc::UnboundedSender<Step>,
    ) -> Result<Option<String>, DriveError> {
        self.wait_durable(id, epoch, node, say).await?;
        let placement = Placement {
            vacate: vec![node.to_string()],
            ..Placement::default()
        };
        let begun = self.begin_restart(root, id, epoch, &placement).await?;
        let to = begun.moves.get(node).cloned();
        let record = begun.record(Trigger::Drain, format!("drain {node}"));
        self.drive_restart(begun, false, record, progress.clone())
            .await?;
        Ok(to)
    }

    /// Waits until another node than `node` holds a copy of `node`'s images of a
    /// just-committed epoch: its partner copy, or the shared copy (bounded by the copies' own
    /// stall deadlines, and by `deadlines.finalize` overall); an error if neither comes.
    async fn wait_durable(
        &self,
        id: u64,
        number: u32,
        node: &str,
        say: &impl Fn(u32, String),
    ) -> Result<(), DriveError> {
        let begin = Instant::now();
        let mut told = false;
        loop {
            let e = self
                .registry
                .epoch(id, number)?
                .ok_or(DriveError::UnknownJob { job: id })?;
            if e.partners.contains_key(node) || e.encoding_of(node).is_some() || e.is_durable() {
                return Ok(());
            }
            let partners_pending = (self.plans_partners(&e) && e.partners.is_empty())
                || (self.plans_encoding(&e).is_some() && e.encodings.is_empty());
            let flush_pending = e.flush == FlushState::Flushing;
            if (partners_pending || flush_pending) && begin.elapsed() < self.cfg.deadlines.finalize
            {
                if !told {
                    say(
                        number,
                        format!("waiting for a copy of {node}'s images of epoch {number} on another node (partner, parity or shared storage)"),
                    );
                    told = true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let why = match &e.flush {
                FlushState::Flushing => "its copies did not complete in time".to_string(),
                FlushState::Failed { reason } => {
                    format!("it has no partner copy and its flush to shared storage failed ({reason})")
                }
                _ => "it has no partner copy or parity ([redundancy] scheme) and is not flushed to shared storage (a node without shared_dir, or [flush] every)".to_string(),
            };
            return Err(DriveError::Node(NodeFailure {
                node: node.into(),
                kind: FailureKind::Refused,
                message: format!(
                    "epoch {number} of job {id} cannot move: {why}; restart the job where it ran (`ckptctl restart {id}`)"
                ),
            }));
        }
    }
}
