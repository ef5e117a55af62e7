//! `ckptctl`: the command-line client of ckptd. It only maps arguments to requests and replies
//! to text, JSON and exit codes.
use std::io::IsTerminal;
use std::process::ExitCode;

#[macro_use]
mod term;

mod cli;
mod client;
#[cfg(test)]
mod json_tests;
mod manual;
mod nodes;
mod rdma;
mod run;
mod show;
mod slurm;
mod stop;
mod when;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::control_client::ControlClient;
use clap::Parser;
use serde_json::{json, Value};
use tonic::transport::Channel;
use tonic::Code;

use cli::{Cli, Cmd};
use show::*;

pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
}

fn exit_code(code: Code) -> u8 {
    match code {
        Code::NotFound => 3,
        Code::FailedPrecondition => 4,
        Code::PermissionDenied | Code::Unauthenticated => 5,
        Code::Aborted => 6,
        Code::Unavailable => 7,
        Code::DataLoss => 8,
        Code::DeadlineExceeded => 9,
        Code::ResourceExhausted => 10,
        Code::InvalidArgument => 2,
        _ => 1,
    }
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Self {
        let message = if s.code() == Code::Unavailable && s.message().contains("transport") {
            "ckptd is not reachable (is it running? see `systemctl status ckptd`)".to_string()
        } else {
            s.message().to_string()
        };
        Failure {
            code: exit_code(s.code()),
            message,
        }
    }
}

fn main() -> ExitCode {
    // SAFETY: restoring the default SIGPIPE disposition before any thread starts, so that
    // `ckptctl list | head` ends quietly like other Unix tools instead of panicking.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            say_err!("ckptctl: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

async fn run(mut cli: Cli) -> Result<(), Failure> {
    // What needs no ckptd: answered, or (what a batch job gives `run --slurm`) checked first.
    let mut batch = None;
    match &mut cli.cmd {
        Cmd::Completions { shell } => return manual::completions(*shell),
        Cmd::Manual { dir } => return manual::pages(dir),
        Cmd::Run(a) if a.slurm => {
            batch =
                Some(slurm::prepare(a, cli.json).map_err(|message| Failure { code: 2, message })?)
        }
        _ => {}
    }
    let mut c = client::connect(&cli.socket).await.map_err(|e| Failure {
        code: 7,
        message: format!(
            "cannot connect to ckptd at {}: {e} (is ckptd running? start it with `systemctl start ckptd` or `ckptd --standalone`)",
            cli.socket.display()
        ),
    })?;
    let json = cli.json;
    match cli.cmd {
        Cmd::Run(args) => run::run(&mut c, args, batch, json).await?,
        Cmd::Checkpoint { job, wait, kill } => {
            let stream = c
                .checkpoint(pb::CheckpointRequest { job_id: job, kill })
                .await?
                .into_inner();
            follow(stream, wait || kill, json, "checkpoint").await?;
        }
        Cmd::Restart {
            job,
            epoch,
            nodes,
            map,
            on_spares,
            down,
        } => {
            let stream = c
                .restart(pb::RestartRequest {
                    job_id: job,
                    epoch: epoch.unwrap_or(0),
                    nodes,
                    map,
                    on_spares,
                    allocation: None,
                    down,
                })
                .await?
                .into_inner();
            follow(stream, true, json, "restart").await?;
        }
        Cmd::Drain { node, migrate } => {
            let stream = c
                .drain(pb::DrainRequest { node, migrate })
                .await?
                .into_inner();
            follow(stream, true, json, "drain").await?;
        }
        Cmd::Policy {
            job,
            every,
            deadline,
        } => policy(&mut c, job, every, deadline, json).await?,
        Cmd::Estimate { job } => estimate(&mut c, job, json).await?,
        Cmd::Status { job } => status(&mut c, job, json).await?,
        Cmd::Nodes => {
            let r = c.nodes(pb::NodesRequest {}).await?.into_inner();
            if json {
                println!("{}", nodes::nodes_json(&r));
            } else {
                nodes::print_nodes(&r);
            }
        }
        Cmd::List => {
            let reply = c.list(pb::ListRequest { all_users: true }).await?;
            print_list(&reply.into_inner().jobs, json, job_json, print_jobs);
        }
        Cmd::Epochs { job } => {
            let reply = c.epochs(pb::EpochsRequest { job_id: job }).await?;
            print_list(&reply.into_inner().epochs, json, epoch_json, print_epochs);
        }
        Cmd::Cancel { job } => {
            let reply = c.cancel(pb::CancelRequest { job_id: job }).await?;
            print_job(reply.into_inner().job, json, |j| {
                say!("job {} {}", j.id, j.state)
            });
        }
        Cmd::Verify { job, epoch } => verify(&mut c, job, epoch, json).await?,
        Cmd::SlurmEpilog => slurm::epilog(&mut c, json).await?,
        Cmd::Completions { .. } | Cmd::Manual { .. } => {} // answered above
    }
    Ok(())
}

/// `ckptctl estimate`.
async fn estimate(c: &mut ControlClient<Channel>, job: u64, json: bool) -> Result<(), Failure> {
    let r = c
        .estimate(pb::EstimateRequest { job_id: job })
        .await?
        .into_inner();
    if json {
        println!("{}", estimate_json(&r));
    } else {
        print_estimate(&r);
    }
    Ok(())
}

/// `ckptctl status`: of a job, or without one of the cluster (its nodes and jobs).
async fn status(
    c: &mut ControlClient<Channel>,
    job: Option<u64>,
    json: bool,
) -> Result<(), Failure> {
    let Some(job) = job else {
        let r = c.nodes(pb::NodesRequest {}).await?.into_inner();
        let jobs = c
            .list(pb::ListRequest { all_users: true })
            .await?
            .into_inner()
            .jobs;
        if json {
            println!("{}", nodes::cluster_json(&r, &jobs));
        } else {
            // SAFETY: getuid cannot fail.
            let root = unsafe { libc::getuid() } == 0;
            nodes::print_cluster(&r, &jobs, root);
        }
        return Ok(());
    };
    let reply = c.status(pb::StatusRequest { job_id: job }).await?;
    print_job(reply.into_inner().job, json, print_status);
    Ok(())
}

/// `ckptctl policy`: sets the job's periodic and deadline checkpoints if asked, and shows the
/// policy it has.
async fn policy(
    c: &mut ControlClient<Channel>,
    job: u64,
    every: Option<String>,
    deadline: Option<String>,
    json: bool,
) -> Result<(), Failure> {
    let deadline_unix_ms = match deadline.as_deref() {
        None => None,
        Some("off" | "none") => Some(0),
        Some(t) => Some(when::parse_deadline(t).map_err(|message| Failure { code: 2, message })?),
    };
    let reply = match (every, deadline_unix_ms) {
        (None, None) => None,
        (every, deadline_unix_ms) => Some(
            c.set_policy(pb::PolicyRequest {
                job_id: job,
                every: every.unwrap_or_default(),
                deadline_unix_ms,
            })
            .await?
            .into_inner()
            .job,
        ),
    };
    let reply = match reply {
        Some(j) => j,
        None => {
            c.status(pb::StatusRequest { job_id: job })
                .await?
                .into_inner()
                .job
        }
    };
    print_job(reply, json, |j| match &j.policy {
        Some(p) => say!("job {}: {}", j.id, policy_text(p)),
        None => say!("job {}: checkpoints only when asked (no policy)", j.id),
    });
    Ok(())
}

/// `ckptctl verify`: every node's copies of an epoch checked against the committed digests;
/// exit 8 if one is damaged, 7 if every failed node could not be reached.
async fn verify(
    c: &mut ControlClient<Channel>,
    job: u64,
    epoch: Option<u32>,
    json: bool,
) -> Result<(), Failure> {
    let r = c
        .verify(pb::VerifyRequest {
            job_id: job,
            epoch: epoch.unwrap_or(0),
        })
        .await?
        .into_inner();
    if json {
        let nodes: Vec<Value> = r
            .nodes
            .iter()
            .map(|n| {
                json!({"node": n.node, "ok": n.ok, "files": n.files, "bytes": n.bytes,
                       "error": n.error, "elapsed_ms": n.elapsed_ms,
                       "copies": n.copies.iter().map(|c| json!({"location": c.location().name(),
                           "ok": c.ok, "files": c.files, "bytes": c.bytes, "error": c.error}))
                           .collect::<Vec<_>>()})
            })
            .collect();
        println!(
            "{}",
            json!({"job_id": r.job_id, "epoch": r.epoch, "nodes": nodes})
        );
    } else {
        for n in &r.nodes {
            if n.copies.is_empty() {
                // The node could not be asked.
                say!("node {}: NOT VERIFIED: {}", n.node, n.error);
            }
            for c in &n.copies {
                if c.ok {
                    say!(
                        "node {} {} copy: ok, {} files, {:.1} MiB verified",
                        n.node,
                        c.location().name(),
                        c.files,
                        c.bytes as f64 / (1 << 20) as f64,
                    );
                } else {
                    say!(
                        "node {} {} copy: DAMAGED: {}",
                        n.node,
                        c.location().name(),
                        c.error
                    );
                }
            }
        }
    }
    let bad: Vec<&pb::NodeVerify> = r.nodes.iter().filter(|n| !n.ok).collect();
    if !bad.is_empty() {
        return Err(Failure {
            code: verify_exit_code(&bad),
            message: format!(
                "job {job} epoch {}: {} of {} node(s) failed verification; restart from an older epoch (`ckptctl epochs {job}`)",
                r.epoch,
                bad.len(),
                r.nodes.len()
            ),
        });
    }
    Ok(())
}

/// The exit code of a verification some nodes failed: 7 when none of them could be asked (their
/// images were not judged), 8 when images were found damaged or missing.
fn verify_exit_code(bad: &[&pb::NodeVerify]) -> u8 {
    match bad.iter().all(|n| n.unreachable) {
        true => 7,
        false => 8,
    }
}

/// Shows progress of a streamed operation; returns once it is done (or, without `wait`, once
/// it has started).
pub(crate) async fn follow(
    stream: tonic::Streaming<pb::Progress>,
    wait: bool,
    json: bool,
    what: &str,
) -> Result<(), Failure> {
    follow_to(stream, wait, json, what, false).await
}

/// [`follow`], with the result in words on stderr when `result_to_stderr` (stdout carries
/// something else, e.g. `run --resume`'s job id).
pub(crate) async fn follow_to(
    mut stream: tonic::Streaming<pb::Progress>,
    wait: bool,
    json: bool,
    what: &str,
    result_to_stderr: bool,
) -> Result<(), Failure> {
    let tty = std::io::stderr().is_terminal();
    let bar = if tty && !json {
        let b = indicatif::ProgressBar::new_spinner();
        b.enable_steady_tick(std::time::Duration::from_millis(100));
        Some(b)
    } else {
        None
    };
    loop {
        let msg = match stream.message().await {
            Ok(Some(m)) => m,
            Ok(None) => {
                return Err(Failure {
                    code: 1,
                    message: format!("ckptd closed the {what} stream without a result"),
                })
            }
            Err(s) => return Err(s.into()),
        };
        if !msg.done {
            let line = format!(
                "[{:>6.1}s] job {} epoch {} {}: {}",
                msg.elapsed_ms as f64 / 1000.0,
                msg.job_id,
                msg.epoch,
                msg.phase,
                msg.message
            );
            match &bar {
                // Each step stays on screen: a fallback or a fetch from shared storage is
                // worth reading after the fact.
                Some(b) => b.println(term::clean(&line)),
                None if !json => say_err!("{line}"),
                None => {}
            }
            if !wait {
                if let Some(b) = &bar {
                    b.finish_and_clear();
                }
                if json {
                    println!(
                        "{}",
                        json!({"job_id": msg.job_id, "epoch": msg.epoch, "state": "in-progress"})
                    );
                } else {
                    say!(
                        "job {}: epoch {} started (follow it with `ckptctl epochs {}`)",
                        msg.job_id,
                        msg.epoch,
                        msg.job_id
                    );
                }
                return Ok(());
            }
            continue;
        }
        if let Some(b) = &bar {
            b.finish_and_clear();
        }
        if !msg.ok {
            return Err(Failure {
                code: exit_code(Code::from_i32(msg.code)),
                message: msg.message,
            });
        }
        if json && !result_to_stderr {
            let mut v = msg
                .result
                .as_ref()
                .map(epoch_json)
                .unwrap_or_else(|| json!({"message": msg.message}));
            v["elapsed_ms"] = json!(msg.elapsed_ms);
            println!("{v}");
        } else if let Some(e) = &msg.result {
            let line = if what == "checkpoint" {
                format!(
                    "job {}: epoch {} committed: frozen {} ms, total {:.2} s, {} in {} files",
                    e.job_id,
                    e.epoch,
                    e.frozen_ms,
                    msg.elapsed_ms as f64 / 1000.0,
                    size(e.image_bytes),
                    e.image_files
                )
            } else {
                format!(
                    "job {}: restarted from epoch {} in {:.2} s",
                    e.job_id,
                    e.epoch,
                    msg.elapsed_ms as f64 / 1000.0
                )
            };
            if result_to_stderr {
                say_err!("{line}");
            } else {
                say!("{line}");
            }
        } else {
            say!("{}", msg.message);
        }
        return Ok(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Verification's exit code comes from the node's `unreachable` flag, never from the
    /// words of its error: a damaged image whose message says "unreachable" is still 8.
    #[test]
    fn verify_exits_7_only_when_no_failed_node_could_be_asked() {
        let node = |unreachable: bool, error: &str| pb::NodeVerify {
            node: "n2".into(),
            unreachable,
            error: error.into(),
            ..Default::default()
        };
        let away = node(true, "agent unreachable during verify");
        let damaged = node(false, "pages-1.img: digest mismatch (unreachable block)");
        assert_eq!(verify_exit_code(&[&away]), 7);
        assert_eq!(verify_exit_code(&[&away, &away]), 7);
        assert_eq!(verify_exit_code(&[&damaged]), 8);
        assert_eq!(verify_exit_code(&[&away, &damaged]), 8);
    }

    /// `ckptctl --help` lists each command in one short line; the rest is the command's own
    /// help.
    #[test]
    fn every_command_is_summed_up_in_one_short_line() {
        use clap::CommandFactory;
        let cli = Cli::command();
        for c in cli.get_subcommands() {
            let about = c.get_about().map(|a| a.to_string()).unwrap_or_default();
            assert!(
                !about.is_empty() && about.len() <= 90 && !about.contains('\n'),
                "{}: {about:?}",
                c.get_name()
            );
        }
    }

    #[test]
    fn run_help_names_every_rdma_setting_with_its_value() {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        let run = cli.find_subcommand_mut("run").unwrap();
        let help = run.render_long_help().to_string();
        let help: String = help.split_whitespace().collect::<Vec<_>>().join(" ");
        for (k, v) in rdma::SETTINGS {
            assert!(
                help.contains(&format!("{k}={v}")),
                "{k}={v} missing from: {help}"
            );
        }
    }

    #[test]
    fn a_nodes_state_reads_as_before_the_protocol_was_typed() {
        let node = |state: pb::PartState, end: Option<pb::JobEnd>, detail: &str| pb::NodeJobInfo {
            state: state.into(),
            end,
            detail: detail.into(),
            ..Default::default()
        };
        let cases = [
            (node(pb::PartState::Running, None, ""), "running"),
            (node(pb::PartState::Absent, None, ""), "absent"),
            (
                node(pb::PartState::Exited, Some(pb::JobEnd::exited(0)), ""),
                "exited with code 0",
            ),
            (
                node(pb::PartState::Exited, Some(pb::JobEnd::killed(9)), ""),
                "killed by signal 9",
            ),
            (node(pb::PartState::Exited, None, ""), "ended"),
            (
                node(pb::PartState::Unspecified, None, "node n2 unreachable"),
                "unknown (node n2 unreachable)",
            ),
        ];
        for (n, want) in cases {
            assert_eq!(node_state(&n), want);
        }
        let j = pb::JobInfo {
            nodes: vec![pb::NodeJobInfo {
                processes: vec![pb::ProcessInfo {
                    state: pb::ProcessState::DiskSleep.into(),
                    ..Default::default()
                }],
                ..node(pb::PartState::Exited, Some(pb::JobEnd::killed(15)), "")
            }],
            ..Default::default()
        };
        let v = job_json(&j);
        let n = &v["nodes"][0];
        assert_eq!(
            (&n["state"], &n["exit_code"], &n["exit_signal"]),
            (&json!("exited"), &Value::Null, &json!(15)),
            "{v}"
        );
        assert_eq!(n["processes"][0]["state"], "disk-wait", "{v}");
    }
}
