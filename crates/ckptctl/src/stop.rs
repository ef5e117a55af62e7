//! How a job's end ends `ckptctl run --wait`, and the checkpoint that stops a job on a signal
//! (`--checkpoint-on`, a batch job's `--slurm` requeue): shared by `run` and `slurm`.
use std::time::Duration;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::control_client::ControlClient;
use tonic::transport::Channel;

use crate::{follow_to, Failure};

/// Exit status of `run --wait` when ckpt stopped the job after a checkpoint or lost its node:
/// sysexits' EX_TEMPFAIL, "try again later". A batch script requeues itself on it.
pub const STOPPED: u8 = 75;

/// How a job that is over ends `run --wait`: its own status, or [`STOPPED`].
pub fn end_status(j: &pb::JobInfo) -> Option<(u8, String)> {
    if j.recovering {
        // ckptd restarts it by itself (`--on-failure restart`): not its end.
        return None;
    }
    let name = format!("job {} ({})", j.id, crate::term::field(&j.name));
    if let Some(s) = j.exit_signal {
        return Some((
            (128 + s).clamp(0, 255) as u8,
            format!("{name} was killed by signal {s}"),
        ));
    }
    let resume = format!(
        "resume it with `ckptctl run --name {} --resume ...`",
        crate::term::field(&j.name)
    );
    match j.state_kind() {
        pb::JobStateKind::Exited => {
            let c = j.exit_code.unwrap_or(0);
            Some((
                c.clamp(0, 255) as u8,
                format!("{name} exited with code {c}"),
            ))
        }
        pb::JobStateKind::Stopped => Some((
            STOPPED,
            format!(
                "{name} was stopped after checkpoint {}; {resume}",
                j.latest_committed_epoch
            ),
        )),
        pb::JobStateKind::Lost => Some((
            STOPPED,
            format!(
                "{name} was lost (a node or agent went away); {}",
                if j.latest_committed_epoch > 0 {
                    resume
                } else {
                    "it has no checkpoint to resume from".into()
                }
            ),
        )),
        pb::JobStateKind::Cancelled => Some((143, format!("{name} was cancelled"))),
        pb::JobStateKind::FailedToStart => Some((1, format!("{name} failed to start"))),
        // Not over. UNSPECIFIED: a state this ckptctl has no value for (a newer ckptd's), which
        // is not taken for an end.
        pb::JobStateKind::Unspecified
        | pb::JobStateKind::Starting
        | pb::JobStateKind::Running
        | pb::JobStateKind::Checkpointing
        | pb::JobStateKind::Restarting => None,
    }
}

/// `--checkpoint-on`: one checkpoint with `--kill`, tried again while another checkpoint or a
/// restart of the job is in progress (bounded); exit 75 once the job is stopped.
pub(crate) async fn checkpoint_and_stop(
    c: &mut ControlClient<Channel>,
    id: u64,
    signal: &str,
    json: bool,
) -> Result<(), Failure> {
    say_err!("ckptctl: got {signal}: checkpointing job {id} and stopping it");
    let begin = std::time::Instant::now();
    loop {
        let r = match c
            .checkpoint(pb::CheckpointRequest {
                job_id: id,
                kill: true,
            })
            .await
        {
            Ok(s) => follow_to(s.into_inner(), true, json, "checkpoint", true).await,
            Err(s) => Err(s.into()),
        };
        match r {
            Ok(()) => {
                let j = c
                    .status(pb::StatusRequest { job_id: id })
                    .await?
                    .into_inner()
                    .job
                    .unwrap_or_default();
                let (code, message) = end_status(&j)
                    .unwrap_or((STOPPED, format!("job {id} was checkpointed and stopped")));
                return Err(Failure { code, message });
            }
            // Busy (another checkpoint or a restart in progress): try again shortly.
            Err(f)
                if (f.code == 4 || f.code == 7) && begin.elapsed() < Duration::from_secs(600) =>
            {
                let j = c
                    .status(pb::StatusRequest { job_id: id })
                    .await
                    .ok()
                    .and_then(|r| r.into_inner().job);
                if let Some((code, message)) = j.as_ref().and_then(end_status) {
                    // It ended (or was stopped) meanwhile: nothing to checkpoint.
                    return Err(Failure { code, message });
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(f) => {
                return Err(Failure {
                    code: f.code,
                    message: format!(
                    "{}; job {id} was not stopped: its last committed checkpoint stays restorable",
                    f.message
                ),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiting_run_ends_with_the_jobs_status_or_75_when_ckpt_stopped_it() {
        use pb::JobStateKind as K;
        let job = |kind: K, state: &str, code: Option<i32>, signal: Option<i32>| pb::JobInfo {
            id: 4,
            name: "heat".into(),
            state: state.into(),
            state_kind: kind.into(),
            exit_code: code,
            exit_signal: signal,
            latest_committed_epoch: 2,
            ..Default::default()
        };
        let code = |j: pb::JobInfo| end_status(&j).map(|(c, _)| c);
        assert_eq!(code(job(K::Running, "running", None, None)), None);
        assert_eq!(
            code(job(K::Checkpointing, "checkpointing", None, None)),
            None
        );
        assert_eq!(code(job(K::Exited, "exited (0)", Some(0), None)), Some(0));
        assert_eq!(code(job(K::Exited, "exited (3)", Some(3), None)), Some(3));
        assert_eq!(code(job(K::Exited, "exited", None, None)), Some(0));
        assert_eq!(
            code(job(K::Exited, "killed (signal 9)", None, Some(9))),
            Some(137)
        );
        assert_eq!(code(job(K::Cancelled, "cancelled", None, None)), Some(143));
        assert_eq!(code(job(K::Lost, "lost", None, None)), Some(STOPPED));
        assert_eq!(
            code(job(K::FailedToStart, "failed to start", None, None)),
            Some(1)
        );
        // The kind decides, not the words.
        assert_eq!(code(job(K::Running, "exited (5)", None, None)), None);
        assert_eq!(code(job(K::Unspecified, "stopped", None, None)), None);
        let recovering = pb::JobInfo {
            recovering: true,
            ..job(K::Lost, "lost", None, None)
        };
        assert_eq!(end_status(&recovering), None, "ckptd restarts it by itself");
        let (c, m) = end_status(&job(K::Stopped, "stopped", None, None)).unwrap();
        assert_eq!(c, STOPPED);
        assert!(
            m.contains("after checkpoint 2") && m.contains("--name heat --resume"),
            "{m}"
        );
    }
}
