//! Checkpoints ckptd takes by itself. A job with a periodic policy is checkpointed once its
//! interval has passed since it began running (launch or restart) and since its last epoch
//! ended: never while a checkpoint or restart of it is in progress, and never two at once. The
//! policy is part of the job's record, so a restarted ckptd goes on where it left off.
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckpt_proto::v1 as pb;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::{now_ms, Caller, Coordinator, DriveError};
use crate::model::policy::{self, Interval};
use crate::model::{Job, JobState, PolicyChange, Trigger};

/// How often the scheduler looks for due checkpoints (it reads every job's record).
const TICK: Duration = Duration::from_millis(500);

/// What the scheduler remembers between passes.
#[derive(Debug, Default)]
pub(super) struct Schedule {
    /// Jobs with a scheduled checkpoint being started or run.
    pending: Mutex<HashSet<u64>>,
    /// Per job with a deadline: how long before it the final checkpoint starts, why, and when
    /// that was estimated (refreshed every [`LEAD_REFRESH`]).
    pub(super) leads: Mutex<HashMap<u64, (Instant, Duration, String)>>,
    /// Jobs whose estimate is being refreshed.
    pub(super) estimating: Mutex<HashSet<u64>>,
    /// Jobs whose final checkpoint failed: not tried again before then.
    pub(super) retry_after: Mutex<HashMap<u64, Instant>>,
}

impl Schedule {
    /// Marks a job busy; false if it already was.
    pub(super) fn begin(&self, job: u64) -> bool {
        self.pending.lock().expect("pending").insert(job)
    }

    pub(super) fn end(&self, job: u64) {
        self.pending.lock().expect("pending").remove(&job);
    }
}

/// How often the estimate behind a deadline is refreshed.
pub(super) const LEAD_REFRESH: Duration = Duration::from_secs(10);

impl Coordinator {
    /// Changes a job's policy (its owner or root). Takes effect at once: a shorter interval
    /// may make a checkpoint due now. A deadline that has passed or is too close for a final
    /// checkpoint is refused.
    pub async fn set_policy(
        &self,
        caller: &Caller,
        id: u64,
        change: PolicyChange,
    ) -> Result<Job, DriveError> {
        let job = self.job_for(caller, id)?;
        if let Some(Some(d)) = change.deadline_unix_ms {
            self.check_deadline(Some(&job), d).await?;
        }
        let job = self
            .update_job(id, |j| {
                change.apply(&mut j.policy);
                Ok(())
            })
            .await?;
        info!(job = id, policy = ?job.policy, "policy set");
        Ok(job)
    }

    /// When the job's next periodic checkpoint is due (ms since the Unix epoch), with the
    /// interval and how it was chosen; None without a periodic policy or while the job does not
    /// run (stopped, exited, or a checkpoint or restart in progress).
    pub fn next_checkpoint(&self, job: &Job) -> Result<Option<(u64, Interval)>, DriveError> {
        let Some(every) = job.policy.every else {
            return Ok(None);
        };
        if *job.state() != JobState::Running {
            return Ok(None);
        }
        let epochs = self.registry.epoch_heads(job.id)?;
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
        if job.policy.every.is_none() && job.policy.deadline_unix_ms.is_none() {
            return None;
        }
        let mut info = pb::JobPolicy {
            every: job.policy.every.map(|e| e.text()).unwrap_or_default(),
            auto: job.policy.every == Some(policy::Every::Auto),
            deadline_unix_ms: job.policy.deadline_unix_ms.unwrap_or(0),
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

    /// Starts every checkpoint that is due (a deadline's final one first), each in its own
    /// task.
    async fn start_due(self: &Arc<Self>, st: &Arc<Schedule>) {
        let jobs = match self.registry.jobs() {
            Ok(j) => j,
            Err(e) => {
                warn!(error = %e, "scheduled checkpoints: cannot read the job registry");
                return;
            }
        };
        let now = now_ms();
        for job in jobs {
            if !job.state().is_active() && !job.unpruned.is_empty() {
                // No next epoch will carry its deletions.
                self.prune_unpruned(job.id).await;
            }
            if *job.state() != JobState::Running {
                continue;
            }
            if let Some(deadline) = job.policy.deadline_unix_ms {
                if self.deadline_due(st, &job, deadline, now) {
                    continue;
                }
            }
            let due = match self.next_checkpoint(&job) {
                Ok(Some((due, _))) => due,
                Ok(None) => continue,
                Err(e) => {
                    warn!(job = job.id, error = %e, "periodic checkpoints: cannot read the job");
                    continue;
                }
            };
            if due > now || !st.begin(job.id) {
                continue;
            }
            let coord = self.clone();
            let st = st.clone();
            tokio::spawn(async move {
                coord.scheduled_checkpoint(&job, Trigger::Periodic).await;
                st.end(job.id);
            });
        }
    }

    /// One checkpoint of `job` that ckptd takes by itself (`trigger`: periodic, or the final
    /// one of a deadline, which stops the job), as its owner would take it; its outcome is in
    /// the job's epochs and in the log. Returns whether it committed.
    pub(super) async fn scheduled_checkpoint(
        self: &Arc<Self>,
        job: &Job,
        trigger: Trigger,
    ) -> bool {
        let kill = trigger == Trigger::Deadline;
        let owner = Caller {
            uid: job.owner_uid,
            gid: job.owner_gid,
            pid: None,
        };
        let (job, epoch) = match self.begin_checkpoint(&owner, job.id, kill, trigger).await {
            Ok(b) => b,
            Err(e) => {
                // The job ended or is busy since the registry was read: the next pass decides.
                debug!(job = job.id, error = %e, trigger = trigger.name(), "scheduled checkpoint not started");
                return false;
            }
        };
        let (id, number) = (job.id, epoch.number);
        info!(
            job = id,
            epoch = number,
            trigger = trigger.name(),
            "scheduled checkpoint"
        );
        let (tx, mut rx) = mpsc::unbounded_channel();
        let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let r = self.drive_checkpoint(job, epoch, tx).await;
        let _ = drain.await;
        match r {
            Ok(e) => {
                info!(
                    job = id,
                    epoch = e.number,
                    frozen_ms = e.frozen_ms,
                    trigger = trigger.name(),
                    "scheduled checkpoint committed"
                );
                true
            }
            Err(e) => {
                warn!(job = id, epoch = number, error = %e, trigger = trigger.name(), "scheduled checkpoint failed");
                false
            }
        }
    }

    /// Takes periodic and deadline checkpoints until `stop` turns true.
    pub async fn schedule(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let st = Arc::new(Schedule::default());
        loop {
            self.start_due(&st).await;
            tokio::select! {
                _ = tokio::time::sleep(TICK) => {}
                _ = stop.wait_for(|v| *v) => return,
            }
        }
    }
}
