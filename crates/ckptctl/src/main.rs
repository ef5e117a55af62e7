//! `ckptctl`: the command-line client of ckptd. It only maps arguments to requests and replies
//! to text, JSON and exit codes.
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

mod client;
mod rdma;

use ckpt_proto::v1 as pb;
use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use tonic::Code;

const AFTER_HELP: &str = "\
Examples:
  JOB=$(ckptctl run --name heat -- mpiexec -n 4 ./heat 512 4000)
  ckptctl checkpoint $JOB --wait        # consistent snapshot; the job keeps running
  ckptctl checkpoint $JOB --kill        # snapshot, then stop the job (preemption)
  ckptctl restart $JOB                  # from the latest committed epoch
  ckptctl restart $JOB --epoch 1        # from an older one
  ckptctl status $JOB · ckptctl epochs $JOB · ckptctl list

Exit codes:
  0 success            1 internal error          2 bad arguments
  3 job not found      4 not allowed in the job's current state
  5 permission denied  6 checkpoint or restart failed (epoch aborted; job unharmed)
  7 ckptd or an agent unreachable                 8 image corrupt or missing
  9 a deadline passed  10 staging storage full";

/// Checkpoint and restart MPI jobs with ckpt.
///
/// Talks to ckptd over its Unix socket; you may act on your own jobs (root on all).
#[derive(Parser, Debug)]
#[command(version, about, long_about, after_help = AFTER_HELP)]
struct Cli {
    /// ckptd's control socket.
    #[arg(long, global = true, env = "CKPT_SOCKET", default_value = client::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Print machine-readable JSON on stdout instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start a job under ckpt; prints its JOBID on stdout.
    ///
    /// The command runs on a node's agent with your uid, environment and working directory;
    /// its stdout and stderr go to files in the job directory (shown on stderr).
    Run {
        /// Job name (default: the command's file name).
        #[arg(long)]
        name: Option<String>,
        /// Node to start the command on (default: the first registered).
        #[arg(long)]
        node: Option<String>,
        /// Run MPI over InfiniBand/RoCE verbs in a way ckpt can checkpoint: sets, unless your
        /// environment has them, OMPI_MCA_pml=ucx OMPI_MCA_pml_ucx_devices=any
        /// OMPI_MCA_pml_ucx_tls=any OMPI_MCA_btl=^openib,ofi OMPI_MCA_mtl=^ofi OMPI_MCA_osc=^ucx
        /// UCX_TLS=rc_verbs,ud_verbs,self UCX_UD_VERBS_ETH_DGID_CHECK=n UCX_MODULES=^rdmacm,
        /// and gives them to the job's processes on other nodes too. The agents preload the
        /// verbs layer on nodes with RDMA devices either way (docs/infiniband.md).
        #[arg(long)]
        rdma: bool,
        /// The command, usually `mpiexec ...`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Take a coordinated checkpoint of a running job.
    Checkpoint {
        /// Job id.
        job: u64,
        /// Wait until the epoch is committed (or failed) and show progress.
        #[arg(long)]
        wait: bool,
        /// Stop the job once the snapshot is taken (implies --wait).
        #[arg(long)]
        kill: bool,
    },
    /// Restart a job whose processes are gone from a committed epoch.
    Restart {
        /// Job id.
        job: u64,
        /// Epoch to restart from (default: the latest committed).
        #[arg(long)]
        epoch: Option<u32>,
        /// Restart on these nodes: the epoch's nodes, in the order `ckptctl status` lists
        /// them, are replaced one for one (e.g. `--nodes n4,n2,n3`). Only a job that ran in
        /// sandboxes (a job network, docs/operations.md) can move; exit 2 for a wrong count,
        /// 3 for a node without an agent, 4 for a node that cannot take the part.
        #[arg(long, value_delimiter = ',', conflicts_with = "map")]
        nodes: Vec<String>,
        /// Move single parts: `--map n3=n4` restarts n3's part on n4, the others where they
        /// ran (repeat for more).
        #[arg(long, value_name = "OLD=NEW")]
        map: Vec<String>,
        /// Put the part of every node of the epoch that is down (no heartbeat for
        /// ckptd.toml `node_timeout`) on a free spare (ckptd.toml `[spares]`); the others
        /// restart where they ran. With spares configured, a restart without --nodes or --map
        /// does this too. Exit 10 when too few spares are free.
        #[arg(long, conflicts_with_all = ["nodes", "map"])]
        on_spares: bool,
    },
    /// Root only: a node is being reclaimed. Checkpoint and stop every running job with a part
    /// on NODE (as `checkpoint --kill` does); with --migrate, restart each at once with that
    /// part on a free spare (ckptd.toml `[spares]`). A job that cannot be checkpointed keeps
    /// running; one that cannot be migrated stays stopped and restorable. Exit 0 when every
    /// job was handled, else the code of the first failure.
    Drain {
        /// The node to empty.
        node: String,
        /// Restart the jobs on spares at once.
        #[arg(long)]
        migrate: bool,
    },
    /// Show a job, its nodes and processes.
    Status {
        /// Job id.
        job: u64,
    },
    /// List jobs (yours; root sees all).
    List,
    /// Show a job's checkpoint epochs: state, storage (local, flushing with progress,
    /// durable = also in shared storage, shared-only, flush-failed), which copies exist
    /// (local, partner, shared), frozen time, size, failure reason.
    Epochs {
        /// Job id.
        job: u64,
    },
    /// Kill a running job (SIGTERM, then SIGKILL). Its checkpoints stay restorable.
    Cancel {
        /// Job id.
        job: u64,
    },
    /// Check a committed checkpoint's images on every node against their digests (reads only):
    /// the local copy, and the shared one for a durable epoch. Exit 0 if every node has an
    /// intact copy (a damaged one is reported), 8 if a node has none, 7 if a node could not be
    /// reached.
    Verify {
        /// Job id.
        job: u64,
        /// Epoch to check (default: the latest committed).
        #[arg(long)]
        epoch: Option<u32>,
    },
}

struct Failure {
    code: u8,
    message: String,
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
            eprintln!("ckptctl: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

/// A job's part on a node in words: "running", "exited with code 0", "killed by signal 9",
/// "absent", or "unknown (why)" when ckptd could not ask the node.
fn node_state(n: &pb::NodeJobInfo) -> String {
    match n.state() {
        pb::PartState::Exited => n.end.unwrap_or_default().text(),
        pb::PartState::Unspecified => format!("unknown ({})", n.detail),
        s => s.name().to_string(),
    }
}

fn job_json(j: &pb::JobInfo) -> Value {
    json!({
        "id": j.id, "name": j.name, "owner_uid": j.owner_uid, "state": j.state,
        "argv": j.argv, "cwd": j.cwd, "created_unix_ms": j.created_unix_ms,
        "exit_code": j.exit_code, "exit_signal": j.exit_signal,
        "last_epoch": j.last_epoch, "latest_committed_epoch": j.latest_committed_epoch,
        "job_dir": j.job_dir, "flush": j.flush,
        "nodes": j.nodes.iter().map(|n| json!({
            "node": n.node, "state": n.state().name(), "role": n.role, "address": n.address,
            "moved_from": n.moved_from,
            "exit_code": n.end.as_ref().and_then(pb::JobEnd::code),
            "exit_signal": n.end.as_ref().and_then(pb::JobEnd::signal),
            "detail": n.detail,
            "ranks": n.processes.iter().filter_map(|p| p.rank).collect::<Vec<_>>(),
            "processes": n.processes.iter().map(|p| json!({"pid": p.pid, "comm": p.comm, "state": p.state().name(), "rank": p.rank})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// Prints the job a reply carries (an empty one if it carries none): as JSON under `--json`, else
/// as `text` words it.
fn print_job(job: Option<pb::JobInfo>, json: bool, text: impl FnOnce(&pb::JobInfo)) {
    let j = job.unwrap_or_default();
    if json {
        println!("{}", job_json(&j));
    } else {
        text(&j);
    }
}

/// `ckptctl status` in words: the job, then each node and its processes.
fn print_status(j: &pb::JobInfo) {
    println!("job {} ({}): {}", j.id, j.name, j.state);
    println!("  owner uid {}, command: {}", j.owner_uid, j.argv.join(" "));
    println!(
        "  epochs: {} taken, latest committed {}",
        j.last_epoch, j.latest_committed_epoch
    );
    println!("  output: {}/stdout", j.job_dir);
    if !j.flush.is_empty() {
        println!("  flushing: {}", j.flush);
    }
    for n in &j.nodes {
        let mut ranks: Vec<i32> = n.processes.iter().filter_map(|p| p.rank).collect();
        ranks.sort_unstable();
        let ranks = if ranks.is_empty() {
            String::new()
        } else {
            format!(
                ", ranks {}",
                ranks
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )
        };
        let address = if n.address.is_empty() {
            String::new()
        } else {
            format!(", job address {}", n.address)
        };
        let moved = if n.moved_from.is_empty() {
            String::new()
        } else {
            format!(", moved here from {}", n.moved_from)
        };
        println!(
            "  node {} ({}): {}, {} processes{ranks}{address}{moved}",
            n.node,
            n.role,
            node_state(n),
            n.processes.len()
        );
        println!("    {:>8} {:>5} {:<16} STATE", "PID", "RANK", "COMMAND");
        for p in &n.processes {
            let rank = p.rank.map(|r| r.to_string()).unwrap_or_else(|| "-".into());
            println!(
                "    {:>8} {:>5} {:<16} {}",
                p.pid,
                rank,
                p.comm,
                p.state().name()
            );
        }
    }
}

fn epoch_json(e: &pb::EpochInfo) -> Value {
    json!({
        "job_id": e.job_id, "epoch": e.epoch, "state": e.state, "failed_phase": e.failed_phase,
        "reason": e.reason, "started_unix_ms": e.started_unix_ms, "finished_unix_ms": e.finished_unix_ms,
        "frozen_ms": e.frozen_ms, "total_ms": e.total_ms, "image_bytes": e.image_bytes,
        "image_files": e.image_files, "kill": e.kill, "nodes": e.nodes,
        "storage": e.storage, "flush_detail": e.flush_detail, "flushed_bytes": e.flushed_bytes,
        "flush_ms": e.flush_ms, "local_copy": e.local_copy, "shared_copy": e.shared_copy,
        "partner_copy": e.partner_copy, "shared_bytes": e.shared_bytes,
    })
}

/// Prints a list: as one JSON array of `to_json`'s objects under `--json`, else as `table`
/// words it.
fn print_list<T>(items: &[T], json: bool, to_json: fn(&T) -> Value, table: fn(&[T])) {
    if json {
        println!("{}", Value::Array(items.iter().map(to_json).collect()));
    } else {
        table(items);
    }
}

/// `ckptctl list` in words: one line per job.
fn print_jobs(jobs: &[pb::JobInfo]) {
    println!(
        "{:>6}  {:<16} {:<18} {:>6} {:>6} {:>9}  COMMAND",
        "JOBID", "NAME", "STATE", "OWNER", "EPOCHS", "COMMITTED"
    );
    for j in jobs {
        println!(
            "{:>6}  {:<16} {:<18} {:>6} {:>6} {:>9}  {}",
            j.id,
            j.name,
            j.state,
            j.owner_uid,
            j.last_epoch,
            j.latest_committed_epoch,
            j.argv.join(" ")
        );
    }
}

/// `ckptctl epochs` in words: one line per epoch.
fn print_epochs(epochs: &[pb::EpochInfo]) {
    println!(
        "{:>5}  {:<28} {:<16} {:<20} {:>9} {:>9} {:>10} {:>6}  REASON",
        "EPOCH", "STATE", "STORAGE", "COPIES", "FROZEN", "TOTAL", "SIZE", "FILES"
    );
    for e in epochs {
        let reason = if !e.reason.is_empty() {
            format!("[{}] {}", e.failed_phase, e.reason)
        } else if !e.flush_detail.is_empty() {
            format!("[flush] {}", e.flush_detail)
        } else {
            String::new()
        };
        let storage = match e.storage.as_str() {
            "flushing" if e.image_bytes > 0 => {
                format!("flushing {}%", e.flushed_bytes * 100 / e.image_bytes)
            }
            "" => "-".into(),
            s => s.to_string(),
        };
        let copies: Vec<&str> = [
            (e.local_copy, "local"),
            (e.partner_copy, "partner"),
            (e.shared_copy, "shared"),
        ]
        .iter()
        .filter(|c| c.0)
        .map(|c| c.1)
        .collect();
        let copies = if copies.is_empty() {
            "-".to_string()
        } else {
            copies.join(",")
        };
        println!(
            "{:>5}  {:<28} {:<16} {:<20} {:>7}ms {:>7}ms {:>10} {:>6}  {}",
            e.epoch,
            e.state,
            storage,
            copies,
            e.frozen_ms,
            e.total_ms,
            size(e.image_bytes),
            e.image_files,
            reason
        );
    }
}

fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let mut c = client::connect(cli.socket.clone()).await.map_err(|e| Failure {
        code: 7,
        message: format!(
            "cannot connect to ckptd at {}: {e} (is ckptd running? start it with `systemctl start ckptd` or `ckptd --standalone`)",
            cli.socket.display()
        ),
    })?;
    let json = cli.json;
    match cli.cmd {
        Cmd::Run {
            name,
            node,
            rdma,
            command,
        } => {
            let cwd = std::env::current_dir()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "/".into());
            let mut env: std::collections::HashMap<String, String> = std::env::vars().collect();
            let mut part_env = Default::default();
            if rdma {
                let a = rdma::apply(&mut env);
                if !json && !a.set.is_empty() {
                    let set: Vec<String> = a.set.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    eprintln!("--rdma set {}", set.join(" "));
                }
                part_env = a.part_env;
            }
            let req = pb::RunRequest {
                name: name.unwrap_or_default(),
                argv: command,
                cwd,
                env,
                node: node.unwrap_or_default(),
                part_env,
            };
            let reply = c.run(req).await?;
            print_job(reply.into_inner().job, json, |job| {
                println!("{}", job.id);
                let node = job.nodes.first().map(|n| n.node.as_str()).unwrap_or("?");
                eprintln!(
                    "job {} ({}) started on node {node}; output in {}/stdout",
                    job.id, job.name, job.job_dir
                );
            });
        }
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
        } => {
            let stream = c
                .restart(pb::RestartRequest {
                    job_id: job,
                    epoch: epoch.unwrap_or(0),
                    nodes,
                    map,
                    on_spares,
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
        Cmd::Status { job } => {
            let reply = c.status(pb::StatusRequest { job_id: job }).await?;
            print_job(reply.into_inner().job, json, print_status);
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
                println!("job {} {}", j.id, j.state)
            });
        }
        Cmd::Verify { job, epoch } => {
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
                        println!("node {}: NOT VERIFIED: {}", n.node, n.error);
                    }
                    for c in &n.copies {
                        if c.ok {
                            println!(
                                "node {} {} copy: ok, {} files, {:.1} MiB verified",
                                n.node,
                                c.location().name(),
                                c.files,
                                c.bytes as f64 / (1 << 20) as f64,
                            );
                        } else {
                            println!(
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
                let unreachable = bad.iter().all(|n| n.error.contains("unreachable"));
                return Err(Failure {
                    code: if unreachable { 7 } else { 8 },
                    message: format!(
                        "job {job} epoch {}: {} of {} node(s) failed verification; restart from an older epoch (`ckptctl epochs {job}`)",
                        r.epoch,
                        bad.len(),
                        r.nodes.len()
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Shows progress of a streamed operation; returns once it is done (or, without `wait`, once
/// it has started).
async fn follow(
    mut stream: tonic::Streaming<pb::Progress>,
    wait: bool,
    json: bool,
    what: &str,
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
                Some(b) => b.println(line),
                None if !json => eprintln!("{line}"),
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
                    println!(
                        "job {}: epoch {} started (follow it with `ckptctl epochs {}`)",
                        msg.job_id, msg.epoch, msg.job_id
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
        if json {
            let mut v = msg
                .result
                .as_ref()
                .map(epoch_json)
                .unwrap_or_else(|| json!({"message": msg.message}));
            v["elapsed_ms"] = json!(msg.elapsed_ms);
            println!("{v}");
        } else if let Some(e) = &msg.result {
            if what == "checkpoint" {
                println!(
                    "job {}: epoch {} committed: frozen {} ms, total {:.2} s, {} in {} files",
                    e.job_id,
                    e.epoch,
                    e.frozen_ms,
                    msg.elapsed_ms as f64 / 1000.0,
                    size(e.image_bytes),
                    e.image_files
                );
            } else {
                println!(
                    "job {}: restarted from epoch {} in {:.2} s",
                    e.job_id,
                    e.epoch,
                    msg.elapsed_ms as f64 / 1000.0
                );
            }
        } else {
            println!("{}", msg.message);
        }
        return Ok(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
