//! Per-user limits (`[limits]` in ckptd.toml): live jobs, job addresses, checkpoints per hour
//! and verifies in progress. Root is never limited. Counts of jobs and addresses come from the
//! registry, so they hold across restarts of ckptd; the checkpoint window and the verifies in
//! progress live in memory (a restart of ckptd forgets at most an hour of checkpoints).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Caller, Coordinator, DriveError};
use crate::config::Limits;
use crate::model::Job;

const HOUR: Duration = Duration::from_secs(3600);

/// What the limits remember between requests.
#[derive(Debug, Default)]
pub(crate) struct Usage {
    /// Start times of each user's counted checkpoints in the last hour, oldest first.
    checkpoints: Mutex<HashMap<u32, VecDeque<Instant>>>,
    /// Verifies in progress per user.
    verifies: Arc<Mutex<HashMap<u32, u32>>>,
}

/// A verify in progress: counted until dropped.
#[derive(Debug)]
pub(crate) struct VerifySlot {
    uid: u32,
    verifies: Arc<Mutex<HashMap<u32, u32>>>,
}

impl Drop for VerifySlot {
    fn drop(&mut self) {
        let mut v = self.verifies.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = v.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                v.remove(&self.uid);
            }
        }
    }
}

fn refused(uid: u32, what: String, key: &str, then: &str) -> DriveError {
    DriveError::Quota(format!(
        "uid {uid} {what}, the most [limits] {key} in ckptd.toml allows; {then}"
    ))
}

impl Usage {
    /// Counts a checkpoint of `uid`'s job started now, or refuses it if `uid` started
    /// `limits.checkpoints_per_hour` in the last hour.
    pub(crate) fn checkpoint(&self, limits: &Limits, uid: u32) -> Result<(), DriveError> {
        self.checkpoint_at(limits, uid, Instant::now())
    }

    fn checkpoint_at(&self, limits: &Limits, uid: u32, now: Instant) -> Result<(), DriveError> {
        let max = limits.checkpoints_per_hour;
        if uid == 0 || max == 0 {
            return Ok(());
        }
        let mut all = self.checkpoints.lock().unwrap_or_else(|p| p.into_inner());
        let times = all.entry(uid).or_default();
        while times
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= HOUR)
        {
            times.pop_front();
        }
        if times.len() >= max as usize {
            let wait = times
                .front()
                .map(|t| HOUR.saturating_sub(now.saturating_duration_since(*t)))
                .unwrap_or_default();
            return Err(refused(
                uid,
                format!("started {max} checkpoints in the last hour"),
                "checkpoints_per_hour",
                &format!(
                    "the next may start in {}s (a checkpoint with --kill is never refused)",
                    wait.as_secs().max(1)
                ),
            ));
        }
        times.push_back(now);
        Ok(())
    }

    /// A slot for a verify of `uid`'s, or a refusal if `limits.verifies` are in progress.
    pub(crate) fn verify(&self, limits: &Limits, uid: u32) -> Result<VerifySlot, DriveError> {
        let max = limits.verifies;
        let mut v = self.verifies.lock().unwrap_or_else(|p| p.into_inner());
        let n = v.entry(uid).or_default();
        if uid != 0 && max != 0 && *n >= max {
            return Err(refused(
                uid,
                format!("has {max} verifies in progress"),
                "verifies",
                "try again when one ends",
            ));
        }
        *n += 1;
        Ok(VerifySlot {
            uid,
            verifies: self.verifies.clone(),
        })
    }
}

impl Coordinator {
    /// Refuses to make `job` live (run, restart) if its owner's other live jobs reach
    /// `[limits] jobs`. Call with the state lock held.
    pub(super) fn check_live_jobs(&self, job: &Job) -> Result<(), DriveError> {
        let max = self.cfg.limits.jobs;
        let Some(others) = self.others_of_owner(job, max)? else {
            return Ok(());
        };
        let live = others.iter().filter(|j| j.is_live()).count();
        if live >= max as usize {
            return Err(refused(
                job.owner_uid,
                format!("has {live} live jobs"),
                "jobs",
                "wait for one to end or cancel one (`ckptctl list`)",
            ));
        }
        Ok(())
    }

    /// Refuses one more job address for `job` if its owner's jobs hold `[limits] addresses`.
    /// Call with the state lock held.
    pub(super) fn check_address_quota(&self, job: &Job) -> Result<(), DriveError> {
        let max = self.cfg.limits.addresses;
        let Some(others) = self.others_of_owner(job, max)? else {
            return Ok(());
        };
        let held: usize = others
            .iter()
            .filter(|j| j.holds_addresses())
            .map(|j| j.addresses.len())
            .sum::<usize>()
            + job.addresses.len();
        if held >= max as usize {
            return Err(refused(
                job.owner_uid,
                format!("holds {held} job addresses"),
                "addresses",
                "cancel jobs that will not restart (`ckptctl list`), or run with fewer nodes",
            ));
        }
        Ok(())
    }

    /// The other jobs of `job`'s owner, or None when a limit of `max` does not apply to them
    /// (root, or no limit).
    fn others_of_owner(&self, job: &Job, max: u32) -> Result<Option<Vec<Job>>, DriveError> {
        if job.owner_uid == 0 || max == 0 {
            return Ok(None);
        }
        let mut all = self.registry.jobs()?;
        all.retain(|j| j.id != job.id && j.owner_uid == job.owner_uid);
        Ok(Some(all))
    }

    /// Counts a checkpoint `caller` starts, unless root starts it or it stops the job.
    pub(super) fn count_checkpoint(&self, caller: &Caller, kill: bool) -> Result<(), DriveError> {
        if kill {
            return Ok(());
        }
        self.usage.checkpoint(&self.cfg.limits, caller.uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(checkpoints: u32, verifies: u32) -> Limits {
        Limits {
            checkpoints_per_hour: checkpoints,
            verifies,
            ..Limits::default()
        }
    }

    #[test]
    fn checkpoints_beyond_the_hourly_limit_are_refused_until_the_oldest_is_an_hour_old() {
        let u = Usage::default();
        let l = limits(3, 0);
        let t0 = Instant::now();
        for i in 0..3 {
            u.checkpoint_at(&l, 1000, t0 + Duration::from_secs(i))
                .unwrap();
        }
        let e = u
            .checkpoint_at(&l, 1000, t0 + Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("checkpoints_per_hour") && e.contains("3590s"),
            "{e}"
        );
        // Another user and root are not held back by uid 1000's.
        u.checkpoint_at(&l, 1001, t0 + Duration::from_secs(10))
            .unwrap();
        for _ in 0..10 {
            u.checkpoint_at(&l, 0, t0).unwrap();
        }
        // An hour after the first, one more may start.
        u.checkpoint_at(&l, 1000, t0 + HOUR).unwrap();
        assert!(u.checkpoint_at(&l, 1000, t0 + HOUR).is_err());
        // 0 is no limit.
        for _ in 0..10 {
            u.checkpoint_at(&limits(0, 0), 1000, t0).unwrap();
        }
    }

    #[test]
    fn verifies_in_progress_are_limited_and_a_finished_one_frees_its_slot() {
        let u = Usage::default();
        let l = limits(0, 2);
        let a = u.verify(&l, 1000).unwrap();
        let _b = u.verify(&l, 1000).unwrap();
        let e = u.verify(&l, 1000).unwrap_err().to_string();
        assert!(e.contains("[limits] verifies"), "{e}");
        let _other = u.verify(&l, 1001).unwrap();
        let _root: Vec<_> = (0..5).map(|_| u.verify(&l, 0).unwrap()).collect();
        drop(a);
        let _c = u.verify(&l, 1000).unwrap();
    }
}
