//! Checkpoints ckptd takes by itself. A job with a periodic policy is checkpointed once its
//! interval has passed since it began running (launch or restart) and since its last epoch
//! ended: never while a checkpoint or restart of it is in progress, and never two at once. The
//! policy is part of the job's record, so a restarted ckptd goes on where it left off.
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use ckpt_proto::v1 as pb;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::{now_ms, Caller, Coordinator, DriveError};
use crate::model::policy::{self, Interval};
use crate::model::{Job, JobState, Policy};

/// How often the scheduler looks for due checkpoints.
const TICK: Duration = Duration::from_millis(250);

/// Trigger recorded on the epochs the scheduler starts.
pub const PERIODIC: &str = "periodic";

impl Coordinator {
    /// Sets a job's policy (its owner or root). Takes effect at once: a shorter interval may
    /// make a checkpoint due now.
    pub async fn set_policy(
        &self,
        caller: &Caller,
        id: u64,
        policy: Policy,
    ) -> Result<Job, DriveError> {
        self.job_for(caller, id)?;
        let job = self
            .update_job(id, |j| {
                j.policy = policy;
                Ok(())
            })
            .await?;
        info!(job = id, every = ?job.policy.every, "policy set");
        Ok(job)
    }

    /// When the job's next periodic checkpoint is due (ms since the Unix epoch), with the
    /// interval and how it was chosen; None without a periodic policy or while the job does not
    /// run (stopped, exited, or a checkpoint or restart in progress).
    pub fn next_checkpoint(&self, job: &Job) -> Result<Option<(u64, Interval)>, DriveError> {
        let Some(every) = job.policy.every else {
            return Ok(None);
        };
        if job.state != JobState::Running {
            return Ok(None);
        }
        let epochs = self.registry.epochs(job.id)?;
        let iv = policy::interval(
            every,
            job.nodes().len(),
            &epochs,
            &self.cfg.policy.auto_params(),
        );
        let last_end = epochs
            .iter()
            .map(|e| e.finished_unix_ms.max(e.started_unix_ms))
            .max()
            .unwrap_or(0);
        let since = job
            .running_since_unix_ms
            .max(job.created_unix_ms)
            .max(last_end);
        Ok(Some((since + iv.every.as_millis() as u64, iv)))
    }

    /// The policy as `status` shows it.
    pub fn policy_info(&self, job: &Job) -> Option<pb::JobPolicy> {
        let every = job.policy.every?;
        let mut info = pb::JobPolicy {
            every: every.text(),
            ..Default::default()
        };
        match self.next_checkpoint(job) {
            Ok(Some((due, iv))) => {
                info.interval_s = iv.every.as_secs();
                info.why = iv.why;
                info.next_checkpoint_unix_ms = due;
            }
            Ok(None) => {}
            Err(e) => info.why = format!("cannot read the job's epochs: {e}"),
        }
        Some(info)
    }

    /// Starts every periodic checkpoint that is due, each in its own task; `pending` holds the
    /// jobs whose checkpoint is being started.
    async fn start_due(self: &Arc<Self>, pending: &Arc<std::sync::Mutex<HashSet<u64>>>) {
        let jobs = match self.registry.jobs() {
            Ok(j) => j,
            Err(e) => {
                warn!(error = %e, "periodic checkpoints: cannot read the job registry");
                return;
            }
        };
        let now = now_ms();
        for job in jobs {
            let due = match self.next_checkpoint(&job) {
                Ok(Some((due, _))) => due,
                Ok(None) => continue,
                Err(e) => {
                    warn!(job = job.id, error = %e, "periodic checkpoints: cannot read the job");
                    continue;
                }
            };
            if due > now || !pending.lock().expect("pending").insert(job.id) {
                continue;
            }
            let coord = self.clone();
            let pending = pending.clone();
            tokio::spawn(async move {
                coord.periodic_checkpoint(&job).await;
                pending.lock().expect("pending").remove(&job.id);
            });
        }
    }

    /// One periodic checkpoint of `job`, as its owner would take it; its outcome is in the
    /// job's epochs and in the log.
    async fn periodic_checkpoint(self: &Arc<Self>, job: &Job) {
        let owner = Caller {
            uid: job.owner_uid,
            gid: job.owner_gid,
            pid: None,
        };
        let (job, epoch) = match self.begin_checkpoint(&owner, job.id, false, PERIODIC).await {
            Ok(b) => b,
            Err(e) => {
                // The job ended or is busy since the registry was read: the next pass decides.
                debug!(job = job.id, error = %e, "periodic checkpoint not started");
                return;
            }
        };
        let (id, number) = (job.id, epoch.number);
        info!(job = id, epoch = number, "periodic checkpoint");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
        match self.drive_checkpoint(job, epoch, tx).await {
            Ok(e) => info!(
                job = id,
                epoch = e.number,
                frozen_ms = e.frozen_ms,
                "periodic checkpoint committed"
            ),
            Err(e) => warn!(job = id, epoch = number, error = %e, "periodic checkpoint failed"),
        }
        let _ = drain.await;
    }

    /// Takes periodic checkpoints until `stop` turns true.
    pub async fn schedule(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let pending = Arc::new(std::sync::Mutex::new(HashSet::new()));
        loop {
            self.start_due(&pending).await;
            tokio::select! {
                _ = tokio::time::sleep(TICK) => {}
                _ = stop.wait_for(|v| *v) => return,
            }
        }
    }
}
