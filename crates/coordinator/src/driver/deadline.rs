//! `ckptctl estimate` and deadlines. The estimate relates the job's resident memory per node
//! now (asked of its agents) to the times of earlier checkpoints ([`crate::model::estimate`]).
//! A deadline's final checkpoint (with `--kill`) starts one and a half times the estimated
//! time to durable, plus `policy.deadline_margin`, before the deadline.
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::schedule::{Schedule, LEAD_REFRESH};
use super::{now_ms, Caller, Coordinator, DriveError};
use crate::model::estimate::{self, Estimate};
use crate::model::{Epoch, Job, Trigger};

/// How many of the latest jobs lend their epochs to the estimate of a job without its own.
const SITE_JOBS: usize = 50;

/// How long after a failed final checkpoint the next try starts.
const RETRY: Duration = Duration::from_secs(5);

impl Coordinator {
    /// Resident bytes per node of a job's processes now; 0 when none run.
    async fn resident_per_node(&self, job: &Job) -> u64 {
        if !job.is_live() {
            return 0;
        }
        let total: u64 = self
            .inspect(job)
            .await
            .iter()
            .flat_map(|n| &n.processes)
            .map(|p| p.rss_bytes)
            .sum();
        total / job.nodes().len().max(1) as u64
    }

    /// Committed epochs of the latest jobs, for a job with too few of its own.
    fn site_epochs(&self) -> Result<Vec<Epoch>, DriveError> {
        let mut jobs = self.registry.jobs()?;
        jobs.sort_by_key(|j| std::cmp::Reverse(j.id));
        let mut out = Vec::new();
        for j in jobs.iter().take(SITE_JOBS) {
            out.extend(
                self.registry
                    .epochs(j.id)?
                    .into_iter()
                    .filter(Epoch::is_restorable),
            );
        }
        Ok(out)
    }

    /// The estimate of a job's next checkpoint at its resident memory now (for a job that
    /// does not run: at that of its last checkpoint); None before any checkpoint anywhere was
    /// measured.
    pub async fn estimate_job(&self, job: &Job) -> Result<Option<Estimate>, DriveError> {
        let own = self.registry.epochs(job.id)?;
        let mut x = self.resident_per_node(job).await;
        if x == 0 {
            x = own
                .iter()
                .filter(|e| e.resident_bytes > 0)
                .max_by_key(|e| e.number)
                .map_or(0, |e| e.resident_bytes / e.nodes.len().max(1) as u64);
        }
        let site = self.site_epochs()?;
        Ok(estimate::estimate(&own, &site, x))
    }

    /// `ckptctl estimate`: the caller's job (or any, for root) and its estimate.
    pub async fn estimate(
        &self,
        caller: &Caller,
        id: u64,
    ) -> Result<(Job, Option<Estimate>), DriveError> {
        self.job_for(caller, id)?;
        let job = self.refresh(id).await?;
        let est = self.estimate_job(&job).await?;
        Ok((job, est))
    }

    /// How long before a deadline the final checkpoint must start, with why.
    pub fn deadline_lead(&self, est: Option<&Estimate>) -> (Duration, String) {
        let margin = self.cfg.policy.deadline_margin;
        let Some(e) = est else {
            return (
                margin,
                format!(
                    "no checkpoint measured yet: only the margin of {} s",
                    margin.as_secs()
                ),
            );
        };
        let (ms, to) = match e.predicted.durable_ms {
            Some(d) => (d, "durable"),
            None => (e.predicted.commit_ms, "committed"),
        };
        let lead = margin + Duration::from_millis(ms * 3 / 2);
        (
            lead,
            format!(
                "a checkpoint takes ~{:.1} s to be {to} ({}); 1.5 times that plus the margin of {} s",
                ms as f64 / 1000.0,
                e.basis,
                margin.as_secs()
            ),
        )
    }

    /// Checks a new deadline: refused when it has passed, or when it is too close for the
    /// final checkpoint (the message says the estimate).
    pub async fn check_deadline(&self, job: Option<&Job>, deadline: u64) -> Result<(), DriveError> {
        let now = now_ms();
        if deadline <= now {
            return Err(DriveError::Invalid(format!(
                "the deadline passed {} s ago: give a time in the future",
                (now - deadline) / 1000
            )));
        }
        let est = match job {
            Some(j) => self.estimate_job(j).await?,
            None => None,
        };
        let (lead, why) = self.deadline_lead(est.as_ref());
        let left = Duration::from_millis(deadline - now);
        if lead > left {
            return Err(DriveError::DeadlineTooClose(format!(
                "the deadline is in {} s, too close for a final checkpoint: it must start {} s before ({why})",
                left.as_secs(),
                lead.as_secs()
            )));
        }
        Ok(())
    }

    /// Whether a running job's deadline checkpoint is due; starts it if so. Refreshes the
    /// estimate behind it in the background every [`LEAD_REFRESH`].
    pub(super) fn deadline_due(
        self: &Arc<Self>,
        st: &Arc<Schedule>,
        job: &Job,
        deadline: u64,
        now: u64,
    ) -> bool {
        let lead = st.leads.lock().expect("leads").get(&job.id).cloned();
        let stale = lead
            .as_ref()
            .is_none_or(|(at, _, _)| at.elapsed() > LEAD_REFRESH);
        if stale && st.estimating.lock().expect("estimating").insert(job.id) {
            let (coord, st, job) = (self.clone(), st.clone(), job.clone());
            tokio::spawn(async move {
                let est = coord.estimate_job(&job).await.ok().flatten();
                let (lead, why) = coord.deadline_lead(est.as_ref());
                st.leads
                    .lock()
                    .expect("leads")
                    .insert(job.id, (Instant::now(), lead, why));
                st.estimating.lock().expect("estimating").remove(&job.id);
            });
        }
        // Until the first estimate is in, the margin alone.
        let lead = lead.map_or(self.cfg.policy.deadline_margin, |(_, l, _)| l);
        if now + lead.as_millis() as u64 <= deadline {
            return false;
        }
        let waiting = st
            .retry_after
            .lock()
            .expect("retry")
            .get(&job.id)
            .is_some_and(|t| Instant::now() < *t);
        if waiting || !st.begin(job.id) {
            return true;
        }
        let (coord, st, job) = (self.clone(), st.clone(), job.clone());
        tokio::spawn(async move {
            info!(job = job.id, deadline, "deadline near: final checkpoint");
            if coord.scheduled_checkpoint(&job, Trigger::Deadline).await {
                let r = coord
                    .update_job(job.id, |j| {
                        j.policy.deadline_unix_ms = None;
                        Ok(())
                    })
                    .await;
                if let Err(e) = r {
                    warn!(job = job.id, error = %e, "cannot clear the job's deadline");
                }
                st.leads.lock().expect("leads").remove(&job.id);
            } else {
                st.retry_after
                    .lock()
                    .expect("retry")
                    .insert(job.id, Instant::now() + RETRY);
            }
            st.end(job.id);
        });
        true
    }
}
