//! `ckptctl run`: start or resume a job, and with `--wait` follow it to its end, checkpointing
//! and stopping it on the signals of `--checkpoint-on` (what a batch script does before its
//! allocation ends).
use std::time::Duration;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::control_client::ControlClient;
use ckpt_proto::Engine;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tonic::transport::Channel;

use crate::cli::RunArgs;
use crate::show::{job_json, policy_text, print_job};
use crate::stop::{checkpoint_and_stop, end_status, STOPPED};
use crate::{follow_to, rdma, Failure};

/// How often `--wait` asks ckptd about the job.
const POLL: Duration = Duration::from_millis(500);

/// The signals `--checkpoint-on` accepts.
const SIGNALS: [(&str, i32); 6] = [
    ("HUP", libc::SIGHUP),
    ("INT", libc::SIGINT),
    ("TERM", libc::SIGTERM),
    ("USR1", libc::SIGUSR1),
    ("USR2", libc::SIGUSR2),
    ("XCPU", libc::SIGXCPU),
];

/// Parses `USR1`, `SIGUSR1` or `usr1`.
pub fn parse_signal(name: &str) -> Result<(String, i32), String> {
    let upper = name.trim().to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    SIGNALS
        .iter()
        .find(|(n, _)| *n == bare)
        .map(|(n, s)| (format!("SIG{n}"), *s))
        .ok_or_else(|| {
            let known: Vec<&str> = SIGNALS.iter().map(|(n, _)| *n).collect();
            format!(
                "--checkpoint-on {name:?}: not a signal ckptctl can wait for; use one of {}",
                known.join(", ")
            )
        })
}

/// Whether ckptd refused a deadline as too close for a final checkpoint.
fn deadline_too_close(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::InvalidArgument
        && s.metadata()
            .get(ckpt_proto::REFUSAL_KEY)
            .is_some_and(|v| v.as_bytes() == ckpt_proto::REFUSAL_DEADLINE_TOO_CLOSE.as_bytes())
}

/// `ckptctl run`; `batch`: what `--slurm` took from the batch job ([`crate::slurm::prepare`],
/// already applied to `a`).
pub async fn run(
    c: &mut ControlClient<Channel>,
    a: RunArgs,
    batch: Option<crate::slurm::Batch>,
    json: bool,
) -> Result<(), Failure> {
    let invalid = |message: String| Failure { code: 2, message };
    // Handlers first: a signal that comes while the job starts must not kill ckptctl.
    let mut handlers: Vec<(String, Signal)> = Vec::new();
    for name in &a.checkpoint_on {
        let (name, num) = parse_signal(name).map_err(invalid)?;
        let s = signal(SignalKind::from_raw(num))
            .map_err(|e| invalid(format!("cannot wait for {name}: {e}")))?;
        handlers.push((name, s));
    }
    let wait = a.wait || !handlers.is_empty();
    let req = request(&a, json)?;
    let reply = match c.run(req.clone()).await {
        // A time limit too short for a final checkpoint: the job runs without one.
        Err(s)
            if deadline_too_close(&s) && batch.as_ref().is_some_and(|b| b.deadline_from_slurm) =>
        {
            say_err!(
                "ckptctl: no final checkpoint before Slurm's time limit: {}",
                s.message()
            );
            c.run(pb::RunRequest {
                deadline_unix_ms: 0,
                ..req
            })
            .await?
        }
        r => r?,
    }
    .into_inner();
    let id = reply.job.as_ref().map(|j| j.id).unwrap_or_default();
    if reply.resume_epoch > 0 {
        if !json {
            let j = reply.job.clone().unwrap_or_default();
            say_err!(
                "job {} ({}): resuming from epoch {}",
                j.id,
                crate::term::field(&j.name),
                reply.resume_epoch
            );
        }
        resume(c, id, json).await?;
    } else {
        if a.resume && !json {
            say_err!(
                "no unfinished job called {:?} with a checkpoint: starting it fresh",
                a.name.as_deref().unwrap_or_default()
            );
        }
        print_job(reply.job, json, |job| {
            say!("{}", job.id);
            let node = job.nodes.first().map(|n| n.node.as_str()).unwrap_or("?");
            say_err!(
                "job {} ({}) started on node {node}; output in {}/stdout",
                job.id,
                job.name,
                job.job_dir
            );
            if let Some(p) = &job.policy {
                say_err!("job {}: {}", job.id, policy_text(p));
            }
        });
    }
    if !wait {
        return Ok(());
    }
    let mut got = None;
    let end = wait_for_end(c, id, &mut handlers, &mut got, json).await;
    if let (Some(b), Err(f)) = (&batch, &end) {
        if f.code == STOPPED {
            crate::slurm::requeue(b, got.as_deref());
        }
    }
    end
}

/// The request of `ckptctl run` for `a`: the command with ckptctl's working directory and
/// environment (with `--rdma`'s settings, said on stderr unless `json`).
fn request(a: &RunArgs, json: bool) -> Result<pb::RunRequest, Failure> {
    let invalid = |message: String| Failure { code: 2, message };
    let deadline_unix_ms = match &a.deadline {
        Some(t) => crate::when::parse_deadline(t).map_err(invalid)?,
        None => 0,
    };
    let cwd = std::env::current_dir()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "/".into());
    let mut env: std::collections::HashMap<String, String> = std::env::vars().collect();
    let mut part_env = Default::default();
    if a.rdma
        && a.engine
            .as_deref()
            .is_some_and(|e| e.parse() != Ok(Engine::Criu))
    {
        return Err(invalid(
            "--rdma needs the criu engine: the verbs layer for unmodified programs is not tested under DMTCP (programs that use ib-quiesce's API are: run them without --rdma)".into(),
        ));
    }
    if a.rdma {
        let r = rdma::apply(&mut env);
        if !json && !r.set.is_empty() {
            let set: Vec<String> = r.set.iter().map(|(k, v)| format!("{k}={v}")).collect();
            say_err!("--rdma set {}", set.join(" "));
        }
        part_env = r.part_env;
    }
    Ok(pb::RunRequest {
        name: a.name.clone().unwrap_or_default(),
        argv: a.command.clone(),
        cwd,
        env,
        node: a.node.clone().unwrap_or_default(),
        part_env,
        every: a.every.clone().unwrap_or_default(),
        on_failure: a.on_failure.clone().unwrap_or_default(),
        redundancy: a.redundancy.clone().unwrap_or_default(),
        resume: a.resume,
        deadline_unix_ms,
        engine: a.engine.clone().unwrap_or_default(),
    })
}

/// The restart of job `id` that `run --resume` found with a checkpoint: inside a Slurm job,
/// onto its allocation; the job's id on stdout, as for a fresh run.
async fn resume(c: &mut ControlClient<Channel>, id: u64, json: bool) -> Result<(), Failure> {
    let invalid = |message: String| Failure { code: 2, message };
    // Inside a Slurm job, onto its allocation: Slurm gives a requeued job whatever
    // nodes are free.
    let allocation = crate::slurm::allocation().map_err(invalid)?;
    if let (Some(a), false) = (&allocation, json) {
        say_err!(
            "job {id}: restarting on the nodes of {} ({})",
            a.name,
            a.nodes.join(", ")
        );
    }
    let stream = c
        .restart(pb::RestartRequest {
            job_id: id,
            epoch: 0,
            allocation,
            ..Default::default()
        })
        .await?
        .into_inner();
    // The restart's result goes to stderr: stdout carries the job id, as for a fresh run.
    follow_to(stream, true, json, "restart", true).await?;
    let st = c
        .status(pb::StatusRequest { job_id: id })
        .await?
        .into_inner();
    print_job(st.job, json, |j| {
        say!("{}", j.id);
        if let Some(p) = &j.policy {
            say_err!("job {}: {}", j.id, policy_text(p));
        }
    });
    Ok(())
}

/// Waits for any of `handlers`' signals; never, without handlers.
async fn any_signal(handlers: &mut [(String, Signal)]) -> String {
    if handlers.is_empty() {
        return std::future::pending().await;
    }
    let futs = handlers.iter_mut().map(|(name, s)| {
        Box::pin(async move {
            s.recv().await;
            name.clone()
        })
    });
    futures_util::future::select_all(futs).await.0
}

/// Follows job `id` to its end; on a signal of `handlers`, checkpoints and stops it (the
/// signal's name in `got`).
async fn wait_for_end(
    c: &mut ControlClient<Channel>,
    id: u64,
    handlers: &mut [(String, Signal)],
    got: &mut Option<String>,
    json: bool,
) -> Result<(), Failure> {
    let mut unreachable_said = false;
    loop {
        tokio::select! {
            name = any_signal(handlers) => {
                let end = checkpoint_and_stop(c, id, &name, json).await;
                *got = Some(name);
                return end;
            }
            _ = tokio::time::sleep(POLL) => {}
        }
        let j = match c.status(pb::StatusRequest { job_id: id }).await {
            Ok(r) => r.into_inner().job.unwrap_or_default(),
            Err(s) if s.code() == tonic::Code::Unavailable => {
                // ckptd restarting: the job runs on without it.
                if !unreachable_said {
                    say_err!(
                        "ckptctl: ckptd unreachable ({}); still waiting for job {id}",
                        s.message()
                    );
                    unreachable_said = true;
                }
                continue;
            }
            Err(s) => return Err(s.into()),
        };
        unreachable_said = false;
        if let Some((code, message)) = end_status(&j) {
            if json {
                println!("{}", job_json(&j));
            }
            return if code == 0 {
                Ok(())
            } else {
                Err(Failure { code, message })
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_too_close_deadline_is_known_by_its_refusal_kind_not_its_words() {
        let mut close = tonic::Status::invalid_argument("any words");
        close.metadata_mut().insert(
            ckpt_proto::REFUSAL_KEY,
            tonic::metadata::MetadataValue::from_static(ckpt_proto::REFUSAL_DEADLINE_TOO_CLOSE),
        );
        assert!(deadline_too_close(&close));
        let words = tonic::Status::invalid_argument("the deadline is in 3 s, too close");
        assert!(
            !deadline_too_close(&words),
            "the message alone is not enough"
        );
        let mut other = tonic::Status::failed_precondition("x");
        *other.metadata_mut() = close.metadata().clone();
        assert!(!deadline_too_close(&other), "only on InvalidArgument");
    }

    #[test]
    fn signals_parse_with_or_without_sig_and_unknown_ones_are_named() {
        assert_eq!(parse_signal("USR1"), Ok(("SIGUSR1".into(), libc::SIGUSR1)));
        assert_eq!(
            parse_signal("sigterm"),
            Ok(("SIGTERM".into(), libc::SIGTERM))
        );
        let e = parse_signal("KILL").unwrap_err();
        assert!(e.contains("\"KILL\"") && e.contains("USR1"), "{e}");
    }
}
