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

    /// Runs every phase of an epoch begun by [`Coordinator::begin_checkpoint`].
    #[instrument(skip_all, fields(job = job.id, epoch = epoch.number))]
    pub async fn drive_checkpoint(
        self: &Arc<Self>,
        job: Job,
        mut epoch: Epoch,
        progress: mpsc::UnboundedSender<Step>,
    ) -> Result<Epoch, DriveError> {
        let begin = Instant::now();
        let (id, number) = (job.id, epoch.number);
        let say = |phase: Phase, message: String| {
            let _ = progress.send(Step {
                job: id,
                epoch: number,
                phase: phase.name(),
                message,
            });
        };
        let nodes = epoch.nodes.clone();
        let d = self.cfg.deadlines.clone();
        let phase_req = || pb::PhaseRequest {
            job_id: id,
            epoch: number,
        };
        // ib-quiesce channels in the job: once any may be down, they must be rebuilt, also
        // when the epoch fails.
        let channels = std::sync::atomic::AtomicU32::new(0);
        let result: Result<BTreeMap<String, String>, (Phase, NodeFailure)> = async {
            say(Phase::Sync, format!("checking {} node(s)", nodes.len()));
            let prepared = self
                .on_all(&nodes, "initial synchronization", d.sync, |mut c| {
                    let r = phase_req();
                    async move { c.prepare(r).await }
                })
                .await
                .map_err(|f| (Phase::Sync, f))?;
            let est: u64 = prepared.iter().map(|(_, p)| p.estimated_bytes).sum();
            channels.store(
                prepared.iter().map(|(_, p)| p.channels).sum(),
                std::sync::atomic::Ordering::Relaxed,
            );
            self.advance(&mut epoch, Phase::Quiesce).await;
            say(
                Phase::Quiesce,
                format!(
                    "freezing {} processes (~{} MB resident)",
                    prepared.iter().map(|(_, p)| p.processes).sum::<u32>(),
                    est >> 20
                ),
            );
            self.on_all(&nodes, "quiesce", d.quiesce, |mut c| {
                let r = phase_req();
                async move { c.quiesce(r).await }
            })
            .await
            .map_err(|f| (Phase::Quiesce, f))?;
            self.advance(&mut epoch, Phase::Dump).await;
            say(Phase::Dump, "all nodes frozen; dumping".into());
            self.on_all(&nodes, "local checkpoint", d.dump, |mut c| {
                let r = phase_req();
                async move { c.dump(r).await }
            })
            .await
            .map_err(|f| (Phase::Dump, f))?;
            self.advance(&mut epoch, Phase::Resume).await;
            say(
                Phase::Resume,
                if epoch.kill {
                    "stopping the job".into()
                } else {
                    "resuming the job".into()
                },
            );
            let kill = epoch.kill;
            let resumed = self
                .on_all(&nodes, "resume", d.resume, |mut c| async move {
                    c.resume(pb::ResumeRequest {
                        job_id: id,
                        epoch: number,
                        kill,
                    })
                    .await
                })
                .await
                .map_err(|f| (Phase::Resume, f))?;
            if !kill && channels.load(std::sync::atomic::Ordering::Relaxed) > 0 {
                let r = self
                    .rebuild_channels(&nodes, id, number)
                    .await
                    .map_err(|f| (Phase::Resume, f))?;
                say(
                    Phase::Resume,
                    r.say(channels.load(std::sync::atomic::Ordering::Relaxed)),
                );
            }
            // The job's frozen time: from the first freeze to the last thaw, per node; the
            // longest node is what the job felt.
            epoch.frozen_ms = resumed
                .iter()
                .map(|(_, r)| r.frozen_us / 1000)
                .max()
                .unwrap_or(0);
            self.advance(&mut epoch, Phase::Finalize).await;
            say(
                Phase::Finalize,
                format!(
                    "job {} after {} ms frozen; sealing images",
                    if kill { "stopped" } else { "resumed" },
                    epoch.frozen_ms
                ),
            );
            let sealed = self
                .on_all(&nodes, "finalize", d.finalize, |mut c| {
                    let r = phase_req();
                    async move { c.finalize(r).await }
                })
                .await
                .map_err(|f| (Phase::Finalize, f))?;
            epoch.image_bytes = sealed.iter().map(|(_, f)| f.image_bytes).sum();
            epoch.image_files = sealed.iter().map(|(_, f)| f.image_files).sum();
            self.advance(&mut epoch, Phase::Commit).await;
            Ok(sealed
                .into_iter()
                .map(|(n, f)| (n, f.manifest_digest))
                .collect())
        }
        .await;
        match result {
            Ok(manifests) => {
                epoch.commit(manifests, now_ms())?;
                let flush = self.plans_flush(&epoch);
                if flush {
                    epoch.flush = FlushState::Flushing;
                }
                let _g = self.state.lock().await;
                let mut job = self
                    .registry
                    .job(id)?
                    .ok_or(DriveError::UnknownJob { job: id })?;
                job.end_checkpoint(Some(number), epoch.kill)?;
                self.registry.put_job_and_epoch(&job, &epoch)?;
                let pruned = self.apply_retention(id)?;
                self.prune_in_background(id, pruned);
                if flush || self.plans_partners(&epoch) {
                    self.flush_in_background(id, number);
                }
                say(
                    Phase::Commit,
                    format!(
                        "committed: frozen {} ms, total {} ms, {} bytes in {} files",
                        epoch.frozen_ms,
                        begin.elapsed().as_millis(),
                        epoch.image_bytes,
                        epoch.image_files
                    ),
                );
                info!(
                    frozen_ms = epoch.frozen_ms,
                    bytes = epoch.image_bytes,
                    "epoch committed"
                );
                Ok(epoch)
            }
            Err((phase, failure)) => {
                warn!(phase = phase.name(), error = %failure, "epoch failed; aborting");
                say(phase, format!("failed: {failure}; aborting"));
                let reason = failure.to_string();
                // A node that did not answer in time is not waited for again: it is told to
                // abort in the background (and again when its agent re-registers), so the
                // caller learns of the failure within the phase deadline.
                let slow = matches!(
                    failure.kind,
                    FailureKind::Unreachable | FailureKind::Deadline
                );
                let (later, now): (Vec<String>, Vec<String>) = nodes
                    .iter()
                    .cloned()
                    .partition(|n| slow && *n == failure.node);
                if !later.is_empty() {
                    let me = self.clone();
                    let why = reason.clone();
                    tokio::spawn(async move {
                        me.abort_all(&later, id, number, &why).await;
                    });
                }
                let abort_errors = self.abort_all(&now, id, number, &reason).await;
                let mut reason = reason;
                for e in abort_errors {
                    reason.push_str(&format!("; abort on {e}"));
                }
                // Channels quiesced before the failure wait for new endpoints; the job cannot
                // talk until they have them.
                let killed = epoch.kill && phase > Phase::Resume;
                if channels.load(std::sync::atomic::Ordering::Relaxed) > 0
                    && phase >= Phase::Quiesce
                    && !killed
                {
                    match self.rebuild_channels(&now, id, number).await {
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
                epoch.fail(reason, now_ms())?;
                let _g = self.state.lock().await;
                let mut job = self
                    .registry
                    .job(id)?
                    .ok_or(DriveError::UnknownJob { job: id })?;
                // A kill that happened before the failure leaves the job stopped.
                job.end_checkpoint(None, killed)?;
                self.registry.put_job_and_epoch(&job, &epoch)?;
                Err(DriveError::EpochFailed {
                    job: id,
                    epoch: number,
                    phase: phase.name(),
                    failure,
                })
            }
        }
    }
}
