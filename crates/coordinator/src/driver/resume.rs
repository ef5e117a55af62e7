//! `ckptctl run --resume`: what a requeued batch script calls. The caller's own latest job of
//! a name restarts from its latest committed epoch when it has one and its processes are gone
//! without it having finished (stopped after a checkpoint, lost, killed by a signal,
//! cancelled); otherwise the job starts fresh.
use super::{Caller, Coordinator, DriveError};
use crate::model::{Job, JobState, PolicyChange};

/// What `run --resume` does.
#[derive(Debug)]
pub enum Resume {
    /// Restart this job from this epoch.
    Restart(Box<Job>, u32),
    /// No checkpoint to resume from: start fresh.
    Fresh,
}

impl Coordinator {
    /// Finds the job `run --resume --name NAME` resumes: the caller's latest job of that name.
    /// Names are per owner: another user's job of the same name is never considered (nor
    /// named), so no one can take the name a batch script resumes by. A live job is refused
    /// (two copies of a job would write the same files), one without a committed epoch starts
    /// over. A policy `change` given with the run applies to the job.
    pub async fn resolve_resume(
        &self,
        caller: &Caller,
        name: &str,
        change: PolicyChange,
    ) -> Result<Resume, DriveError> {
        if name.is_empty() {
            return Err(DriveError::Invalid(
                "--resume needs --name NAME: the name finds the job's checkpoints again".into(),
            ));
        }
        let Some(latest) = self
            .registry
            .jobs()?
            .into_iter()
            .filter(|j| j.name == name && j.owner_uid == caller.uid)
            .max_by_key(|j| j.id)
        else {
            return Ok(Resume::Fresh);
        };
        let latest = self.refresh(latest.id).await?;
        if latest.is_live() {
            return Err(DriveError::State(crate::model::TransitionError {
                what: format!("job {} ({name})", latest.id),
                from: latest.state().name(),
                action: "resume it: it still runs (wait for it, or `ckptctl cancel` it)".into(),
            }));
        }
        // A job that ended by itself (with an exit code) is done: run it again from the start.
        let finished = matches!(latest.state(), JobState::Exited { code: Some(_), .. });
        if latest.latest_committed == 0 || finished {
            return Ok(Resume::Fresh);
        }
        let epoch = latest.latest_committed;
        if let Some(Some(d)) = change.deadline_unix_ms {
            self.check_deadline(Some(&latest), d).await?;
        }
        let job = if change.is_empty() {
            latest
        } else {
            self.update_job(latest.id, |j| {
                change.apply(&mut j.policy);
                Ok(())
            })
            .await?
        };
        Ok(Resume::Restart(Box::new(job), epoch))
    }
}
