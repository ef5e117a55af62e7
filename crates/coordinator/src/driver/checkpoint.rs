//! One checkpoint epoch: initial synchronization, quiesce, local checkpoint, resume, finalize,
//! commit; the first failure aborts the epoch on every node.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use ckpt_proto::v1 as pb;
use tokio::sync::mpsc;
use tracing::{info, instrument, warn};

use super::{now_ms, Caller, Coordinator, DriveError, Step};
use crate::agents::{FailureKind, NodeFailure};
use crate::config::Deadlines;
use crate::model::{Epoch, FlushState, Job, JobState, Phase, TransitionError};

impl Coordinator {
    /// Validates a checkpoint request and starts the epoch; returns the job and the epoch.
    pub async fn begin_checkpoint(
        &self,
        caller: &Caller,
        id: u64,
        kill: bool,
    ) -> Result<(Job, Epoch), DriveError> {
        self.job_for(caller, id)?;
        self.refresh(id).await?;
        let _g = self.state.lock().await;
        let mut job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        let number = match job.begin_checkpoint() {
            Ok(n) => n,
            Err(e) if matches!(job.state, JobState::Exited { .. } | JobState::Stopped | JobState::Cancelled | JobState::Lost) => {
                return Err(DriveError::State(TransitionError {
                    action: format!("checkpoint it: it has no running processes (restart it with `ckptctl restart {id}`)"),
                    ..e
                }))
            }
            Err(e) => return Err(e.into()),
        };
        let epoch = Epoch::begin(id, number, kill, job.nodes(), now_ms());
        self.registry.put_job_and_epoch(&job, &epoch)?;
        Ok((job, epoch))
    }

    /// Runs every phase of an epoch begun by [`Coordinator::begin_checkpoint`], then commits
    /// it, or aborts it on every node after the first failure.
    #[instrument(skip_all, fields(job = job.id, epoch = epoch.number))]
    pub async fn drive_checkpoint(
        self: &Arc<Self>,
        job: Job,
        epoch: Epoch,
        progress: mpsc::UnboundedSender<Step>,
    ) -> Result<Epoch, DriveError> {
        let mut run = EpochRun {
            coord: self,
            id: job.id,
            nodes: epoch.nodes.clone(),
            deadlines: self.cfg.deadlines.clone(),
            epoch,
            progress,
            begin: Instant::now(),
            channels: 0,
        };
        match run.phases().await {
            Ok(manifests) => run.commit(manifests).await,
            Err((phase, failure)) => run.abort(phase, failure).await,
        }
    }
}

/// A step's failure: the phase it failed in, and which node failed how.
type StepResult<T> = Result<T, (Phase, NodeFailure)>;

/// One epoch in flight: what its steps share.
struct EpochRun<'c> {
    coord: &'c Arc<Coordinator>,
    id: u64,
    epoch: Epoch,
    nodes: Vec<String>,
    deadlines: Deadlines,
    progress: mpsc::UnboundedSender<Step>,
    begin: Instant,
    /// ib-quiesce channels in the job: once any may be down, they must be rebuilt, also when
    /// the epoch fails.
    channels: u32,
}

impl EpochRun<'_> {
    /// The phases up to the commit, in order; the first failure ends them.
    async fn phases(&mut self) -> StepResult<BTreeMap<String, String>> {
        let prepared = self.sync().await?;
        self.quiesce(&prepared).await?;
        self.dump().await?;
        self.resume().await?;
        self.finalize().await
    }

    fn say(&self, phase: Phase, message: String) {
        let _ = self.progress.send(Step {
            job: self.id,
            epoch: self.epoch.number,
            phase: phase.name(),
            message,
        });
    }

    fn request(&self) -> pb::PhaseRequest {
        pb::PhaseRequest {
            job_id: self.id,
            epoch: self.epoch.number,
        }
    }

    /// Initial synchronization: every node checks it can take the checkpoint and says how
    /// much it holds.
    #[instrument(skip_all, fields(phase = "initial-sync"))]
    async fn sync(&mut self) -> StepResult<Vec<(String, pb::PrepareReply)>> {
        self.say(
            Phase::Sync,
            format!("checking {} node(s)", self.nodes.len()),
        );
        let r = self.request();
        let prepared = self
            .coord
            .on_all(
                &self.nodes,
                "initial synchronization",
                self.deadlines.sync,
                |mut c| async move { c.prepare(r).await },
            )
            .await
            .map_err(|f| (Phase::Sync, f))?;
        self.channels = prepared.iter().map(|(_, p)| p.channels).sum();
        Ok(prepared)
    }

    /// Quiesce: every node drains its InfiniBand channels and freezes the job's processes.
    #[instrument(skip_all, fields(phase = "quiesce"))]
    async fn quiesce(&mut self, prepared: &[(String, pb::PrepareReply)]) -> StepResult<()> {
        self.coord.advance(&mut self.epoch, Phase::Quiesce).await;
        let resident: u64 = prepared.iter().map(|(_, p)| p.estimated_bytes).sum();
        self.say(
            Phase::Quiesce,
            format!(
                "freezing {} processes (~{} MB resident)",
                prepared.iter().map(|(_, p)| p.processes).sum::<u32>(),
                resident >> 20
            ),
        );
        let r = self.request();
        self.coord
            .on_all(
                &self.nodes,
                "quiesce",
                self.deadlines.quiesce,
                |mut c| async move { c.quiesce(r).await },
            )
            .await
            .map_err(|f| (Phase::Quiesce, f))?;
        Ok(())
    }

    /// Local checkpoint: every node snapshots its frozen processes into its staging.
    #[instrument(skip_all, fields(phase = "local-checkpoint"))]
    async fn dump(&mut self) -> StepResult<()> {
        self.coord.advance(&mut self.epoch, Phase::Dump).await;
        self.say(Phase::Dump, "all nodes frozen; dumping".into());
        let r = self.request();
        self.coord
            .on_all(
                &self.nodes,
                "local checkpoint",
                self.deadlines.dump,
                |mut c| async move { c.dump(r).await },
            )
            .await
            .map_err(|f| (Phase::Dump, f))?;
        Ok(())
    }

    /// Resume: every node thaws (or, for `--kill`, stops) the job; then its InfiniBand
    /// channels are rebuilt and reconnected across the nodes.
    #[instrument(skip_all, fields(phase = "resume"))]
    async fn resume(&mut self) -> StepResult<()> {
        self.coord.advance(&mut self.epoch, Phase::Resume).await;
        let kill = self.epoch.kill;
        self.say(
            Phase::Resume,
            if kill {
                "stopping the job"
            } else {
                "resuming the job"
            }
            .into(),
        );
        let (id, number) = (self.id, self.epoch.number);
        let resumed = self
            .coord
            .on_all(
                &self.nodes,
                "resume",
                self.deadlines.resume,
                |mut c| async move {
                    c.resume(pb::ResumeRequest {
                        job_id: id,
                        epoch: number,
                        kill,
                    })
                    .await
                },
            )
            .await
            .map_err(|f| (Phase::Resume, f))?;
        if !kill && self.channels > 0 {
            let r = self
                .coord
                .rebuild_channels(&self.nodes, id, number)
                .await
                .map_err(|f| (Phase::Resume, f))?;
            self.say(Phase::Resume, r.say(self.channels));
        }
        // The job's frozen time: from the first freeze to the last thaw, per node; the longest
        // node is what the job felt.
        self.epoch.frozen_ms = resumed
            .iter()
            .map(|(_, r)| r.frozen_us / 1000)
            .max()
            .unwrap_or(0);
        Ok(())
    }

    /// Finalize: every node digests and syncs its images and seals them with a manifest.
    /// Returns each node's manifest digest.
    #[instrument(skip_all, fields(phase = "finalize"))]
    async fn finalize(&mut self) -> StepResult<BTreeMap<String, String>> {
        self.coord.advance(&mut self.epoch, Phase::Finalize).await;
        self.say(
            Phase::Finalize,
            format!(
                "job {} after {} ms frozen; sealing images",
                if self.epoch.kill {
                    "stopped"
                } else {
                    "resumed"
                },
                self.epoch.frozen_ms
            ),
        );
        let r = self.request();
        let sealed = self
            .coord
            .on_all(
                &self.nodes,
                "finalize",
                self.deadlines.finalize,
                |mut c| async move { c.finalize(r).await },
            )
            .await
            .map_err(|f| (Phase::Finalize, f))?;
        self.epoch.image_bytes = sealed.iter().map(|(_, f)| f.image_bytes).sum();
        self.epoch.image_files = sealed.iter().map(|(_, f)| f.image_files).sum();
        self.coord.advance(&mut self.epoch, Phase::Commit).await;
        Ok(sealed
            .into_iter()
            .map(|(n, f)| (n, f.manifest_digest))
            .collect())
    }

    /// Commit: the epoch and the job are written together; from here the epoch is
    /// restorable. Retention, partner copies and the flush follow in the background.
    #[instrument(skip_all, fields(phase = "commit"))]
    async fn commit(mut self, manifests: BTreeMap<String, String>) -> Result<Epoch, DriveError> {
        let (coord, id, number) = (self.coord, self.id, self.epoch.number);
        self.epoch.commit(manifests, now_ms())?;
        let flush = coord.plans_flush(&self.epoch);
        if flush {
            self.epoch.flush = FlushState::Flushing;
        }
        {
            let _g = coord.state.lock().await;
            let mut job = coord
                .registry
                .job(id)?
                .ok_or(DriveError::UnknownJob { job: id })?;
            job.end_checkpoint(Some(number), self.epoch.kill)?;
            coord.registry.put_job_and_epoch(&job, &self.epoch)?;
            let pruned = coord.apply_retention(id)?;
            coord.prune_in_background(id, pruned);
            if flush || coord.plans_partners(&self.epoch) {
                coord.flush_in_background(id, number);
            }
        }
        let e = &self.epoch;
        self.say(
            Phase::Commit,
            format!(
                "committed: frozen {} ms, total {} ms, {} bytes in {} files",
                e.frozen_ms,
                self.begin.elapsed().as_millis(),
                e.image_bytes,
                e.image_files
            ),
        );
        info!(
            frozen_ms = e.frozen_ms,
            bytes = e.image_bytes,
            "epoch committed"
        );
        Ok(self.epoch)
    }

    /// Abort after `failure` in `phase`: every node thaws what it froze and drops the epoch's
    /// partial images, channels taken down are rebuilt, and the epoch is recorded failed. The
    /// job keeps running (or stays stopped if `--kill` had already stopped it).
    #[instrument(skip_all, fields(phase = "abort"))]
    async fn abort(mut self, phase: Phase, failure: NodeFailure) -> Result<Epoch, DriveError> {
        let (coord, id, number) = (self.coord, self.id, self.epoch.number);
        warn!(phase = phase.name(), error = %failure, "epoch failed; aborting");
        self.say(phase, format!("failed: {failure}; aborting"));
        let mut reason = failure.to_string();
        // A node that did not answer in time is not waited for again: it is told to abort in
        // the background (and again when its agent re-registers), so the caller learns of the
        // failure within the phase deadline.
        let slow = matches!(
            failure.kind,
            FailureKind::Unreachable | FailureKind::Deadline
        );
        let (later, now): (Vec<String>, Vec<String>) = self
            .nodes
            .iter()
            .cloned()
            .partition(|n| slow && *n == failure.node);
        if !later.is_empty() {
            let me = coord.clone();
            let why = reason.clone();
            tokio::spawn(async move {
                me.abort_all(&later, id, number, &why).await;
            });
        }
        for e in coord.abort_all(&now, id, number, &reason).await {
            reason.push_str(&format!("; abort on {e}"));
        }
        // Channels quiesced before the failure wait for new endpoints; the job cannot talk
        // until they have them.
        let killed = self.epoch.kill && phase > Phase::Resume;
        if self.channels > 0 && phase >= Phase::Quiesce && !killed {
            match coord.rebuild_channels(&now, id, number).await {
                Ok(r) => info!(
                    qps = r.qps,
                    relayed = r.relayed,
                    ms = r.took.as_millis() as u64,
                    "ib-quiesce channels rebuilt after the abort; the job runs on"
                ),
                Err(e) => {
                    warn!(error = %e, "ib-quiesce channels not rebuilt after the abort");
                    reason.push_str(&format!("; channel rebuild on {e}"));
                }
            }
        }
        self.epoch.fail(reason, now_ms())?;
        let _g = coord.state.lock().await;
        let mut job = coord
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        // A kill that happened before the failure leaves the job stopped.
        job.end_checkpoint(None, killed)?;
        coord.registry.put_job_and_epoch(&job, &self.epoch)?;
        Err(DriveError::EpochFailed {
            job: id,
            epoch: number,
            phase: phase.name(),
            failure,
        })
    }
}
