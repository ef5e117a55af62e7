//! Automatic recovery (`ckptctl run --on-failure restart[:N]`, ckptd.toml `[recovery]`). A job
//! that failed (its node lost, or a process of it killed by a signal ckpt did not send, see
//! [`Job::failure`]) is restarted from its latest committed epoch, as `ckptctl restart` would:
//! the parts of nodes that are down on free spares, the others in place. At most N times over
//! the job's life, the first at once and each next one after twice the wait of the one before
//! (`[recovery] backoff`). A job that fails again before a checkpoint committed after its
//! last automatic restart is not restarted again: it would fail the same way, in a loop. A
//! restart refused before anything was restored (no spare free, a node of the epoch down with
//! no spare for it) is not a try: the job waits, saying why, and is restarted once it can be.

use std::time::Duration;

use ckpt_proto::Engine;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{now_ms, Caller, Coordinator, DriveError, Placement};
use crate::model::{Job, OnFailure, Recovery, Trigger};

/// ckptd itself, acting on any job.
const ROOT: Caller = Caller {
    uid: 0,
    gid: 0,
    pid: None,
};

impl Coordinator {
    /// The policy a new job gets: `asked` (`--on-failure`), else ckptd.toml's default. An
    /// explicit restart policy is refused for a job whose parts cannot move to other nodes
    /// (it runs without a sandbox); the default applies only to those that can.
    pub(super) fn on_failure(&self, asked: &str, engine: Engine) -> Result<OnFailure, DriveError> {
        let movable = engine.virtualizes() || matches!(self.cfg.job_network.range(), Ok(Some(_)));
        if asked.is_empty() {
            let default = OnFailure::parse(&self.cfg.recovery.on_failure).unwrap_or_default();
            return Ok(if movable { default } else { OnFailure::Stop });
        }
        let policy = OnFailure::parse(asked).map_err(DriveError::Invalid)?;
        if policy != OnFailure::Stop && !movable {
            return Err(DriveError::Invalid(format!(
                "--on-failure {asked}: this job would run without a sandbox (ckptd.toml has no [job_network]), so a lost node's part could not move to a spare, and ckptd does not restart what it cannot place; configure [job_network] (docs/operations.md, \"Job sandboxes\") or run without --on-failure"
            )));
        }
        Ok(policy)
    }

    /// Restarts, or notes why not, every failed job whose policy says so. Called on each tick
    /// of the node watcher; a restart runs on in a task of its own.
    pub async fn recover(self: &std::sync::Arc<Self>) -> Result<(), DriveError> {
        for job in self.registry.jobs()? {
            let OnFailure::Restart { max } = job.on_failure else {
                continue;
            };
            let Some(trigger) = job.failure() else {
                continue;
            };
            if job.gave_up == Some(job.incarnation) || self.is_cancelling(job.id) {
                continue;
            }
            if let Some(why) = give_up(&job, max) {
                warn!(job = job.id, %trigger, "not restarting by itself: {why}");
                crate::metrics::metrics()
                    .recoveries
                    .with_label_values(&["gave_up"])
                    .inc();
                self.note(&job, format!("not restarted by itself: {why}"), true)
                    .await?;
                continue;
            }
            let used = job.recoveries.len() as u32;
            if let Some(last) = job.recoveries.last() {
                let wait = self.cfg.recovery.backoff * 2u32.saturating_pow(used - 1);
                let due = last.at_unix_ms + wait.as_millis() as u64;
                if now_ms() < due {
                    let note = format!(
                        "{trigger}: restarting by itself in {} (try {} of {max})",
                        humantime::format_duration(Duration::from_secs(
                            (due - now_ms()).div_ceil(1000)
                        )),
                        used + 1
                    );
                    self.note(&job, note, false).await?;
                    continue;
                }
            }
            self.restart_by_itself(job, trigger, used + 1, max).await?;
        }
        Ok(())
    }

    /// Begins the restart of a failed job; the restore runs on in a task of its own.
    async fn restart_by_itself(
        self: &std::sync::Arc<Self>,
        job: Job,
        trigger: String,
        attempt: u32,
        max: u32,
    ) -> Result<(), DriveError> {
        let id = job.id;
        let placement = Placement {
            on_spares: true,
            ..Placement::default()
        };
        let lost = job.lost.clone();
        let begun = match self.begin_restart(&ROOT, id, 0, &placement).await {
            Ok(begun) => begun,
            // Nothing was restored: not a try. The job waits and says why.
            Err(e) => {
                let note = format!("{trigger}: waiting to restart by itself: {e}");
                return self.note(&job, note, false).await;
            }
        };
        let mut recovery = begun.record(Trigger::Recovery, trigger.clone());
        if let Some(l) = lost {
            recovery.failed_unix_ms = l.since_unix_ms;
            recovery.noticed_unix_ms = l.noticed_unix_ms;
        }
        info!(
            job = id,
            %trigger,
            epoch = recovery.epoch,
            moves = ?recovery.moves,
            "restarting by itself (try {attempt} of {max})"
        );
        self.update_job(id, |j| {
            j.recoveries.push(recovery.clone());
            j.recovery_note.clear();
            Ok(())
        })
        .await?;
        let me = self.clone();
        tokio::spawn(async move {
            // Nobody follows the steps: the outcome goes to the job's record and the log.
            let (tx, _rx) = mpsc::unbounded_channel();
            let r = me.drive_restart(begun, true, recovery.clone(), tx).await;
            let m = crate::metrics::metrics();
            let done = match r {
                Ok((_, _, done)) => {
                    m.recoveries.with_label_values(&["done"]).inc();
                    if done.failed_unix_ms > 0 {
                        let s = done.running_unix_ms.saturating_sub(done.failed_unix_ms);
                        m.recovery_seconds.observe(s as f64 / 1e3);
                    }
                    done
                }
                Err(e) => {
                    m.recoveries.with_label_values(&["failed"]).inc();
                    warn!(job = id, error = %e, "the automatic restart failed");
                    Recovery {
                        outcome: format!("failed: {e}"),
                        ..recovery
                    }
                }
            };
            let _ = me
                .update_job(id, |j| {
                    if let Some(last) = j.recoveries.last_mut() {
                        *last = done.clone();
                    }
                    Ok(())
                })
                .await;
        });
        Ok(())
    }

    /// Records why a failed job is not restarted now; `final_` marks its failure given up on.
    async fn note(&self, job: &Job, note: String, final_: bool) -> Result<(), DriveError> {
        if job.recovery_note == note && (!final_ || job.gave_up == Some(job.incarnation)) {
            return Ok(());
        }
        let incarnation = job.incarnation;
        let state = job.state().clone();
        self.update_job(job.id, |j| {
            // Only while the job is still in the failure read.
            if j.incarnation == incarnation && *j.state() == state {
                j.recovery_note = note.clone();
                if final_ {
                    j.gave_up = Some(incarnation);
                }
            }
            Ok(())
        })
        .await
        .map(|_| ())
    }
}

/// Why a failed job with `restart:max` must not be restarted by itself again, if so.
fn give_up(job: &Job, max: u32) -> Option<String> {
    let used = job.recoveries.len() as u32;
    if job.latest_committed == 0 {
        return Some(
            "it has no committed checkpoint to restart from; start it again with `ckptctl run`"
                .into(),
        );
    }
    if used >= max {
        return Some(format!(
            "its {used} automatic restarts (--on-failure restart:{max}) are used up; restart it by hand with `ckptctl restart {}`",
            job.id
        ));
    }
    match job.recoveries.last() {
        Some(last)
            if last.outcome.starts_with("running again") && job.latest_committed <= last.epoch =>
        {
            Some(format!(
                "it failed again ({}) before a checkpoint committed after its automatic restart from epoch {}, and would fail the same way in a loop; see its output, then restart it by hand with `ckptctl restart {}`",
                job.failure().unwrap_or_default(),
                last.epoch,
                job.id
            ))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::job;
    use crate::model::JobState;

    fn recovery(epoch: u32, outcome: &str) -> Recovery {
        Recovery {
            outcome: outcome.into(),
            ..Recovery::begun(Trigger::Recovery, "node n3 lost".into(), epoch, vec![], 1)
        }
    }

    #[test]
    fn a_job_is_given_up_on_when_it_cannot_or_should_not_restart_again() {
        let mut j = job(
            4,
            JobState::Exited {
                code: None,
                signal: Some(9),
            },
        );
        assert!(give_up(&j, 3).unwrap().contains("no committed checkpoint"));
        j.latest_committed = 2;
        assert_eq!(give_up(&j, 3), None, "a first failure restarts");
        j.recoveries.push(recovery(2, "running again from epoch 2"));
        let again = give_up(&j, 3).unwrap();
        assert!(
            again.contains("failed again")
                && again.contains("epoch 2")
                && again.contains("ckptctl restart 4"),
            "{again}"
        );
        j.latest_committed = 3;
        assert_eq!(
            give_up(&j, 3),
            None,
            "a checkpoint committed since: it may restart"
        );
        j.recoveries[0].outcome = "failed: no spare".into();
        j.latest_committed = 2;
        assert_eq!(give_up(&j, 3), None, "a restore that failed is tried again");
        j.recoveries.push(recovery(3, "failed: x"));
        j.recoveries.push(recovery(3, "failed: x"));
        assert!(give_up(&j, 3).unwrap().contains("3 automatic restarts"));
    }
}
