//! `ckpt-rsh`: the program an MPI launcher runs instead of ssh to start its proxy on another
//! node (MPICH's Hydra: `HYDRA_LAUNCHER_EXEC`; Open MPI: `plm_rsh_agent`).
//!
//! Called as ssh would be, `ckpt-rsh [ssh options] HOST COMMAND...`, from inside a job that
//! `ckptctl run` started. It asks ckptd to start COMMAND on HOST through that node's agent, as
//! part of the same job (its cgroup, its owner, a fresh session with inherited descriptors
//! closed, as sshd would), then follows it the way ssh does: it copies the remote command's
//! stdout and stderr to its own, and exits with its status (128+N for a signal, 255 when the
//! node cannot be reached).
//!
//! It holds no connection open between polls: each poll of the remote agent is a short call.
//! A checkpoint therefore rarely catches one, and a restored `ckpt-rsh` simply polls again.
//! Its only state, the offsets of the output it has copied, is restored with it.
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_client::AgentClient;
use ckpt_proto::v1::registry_client::RegistryClient;
use tonic::transport::Channel;

const USAGE: &str = "usage: ckpt-rsh [ssh options] HOST COMMAND [ARGS...]

Starts COMMAND on HOST as part of the calling ckpt job and follows it like ssh: its stdout and
stderr are copied here and its exit status is returned (128+N if killed by signal N, 255 if the
node cannot be reached). HOST is a node name, or any address of the node (or a name resolving
to one).

MPI launchers call it instead of ssh. Jobs started with `ckptctl run` have it set already:
  MPICH (Hydra):  HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC=/path/to/ckpt-rsh
  Open MPI:       OMPI_MCA_plm=rsh OMPI_MCA_plm_rsh_agent=/path/to/ckpt-rsh
It needs CKPT_JOB_ID, CKPT_JOB_TOKEN and CKPT_COORDINATOR, which ckpt puts in every job's
environment. ssh options (-x, -q, -o KEY=VALUE, -p PORT, -l USER, ...) are accepted and ignored.";

/// Exit status for "could not reach or start", as ssh uses.
const UNREACHABLE: u8 = 255;
/// How long to keep trying a coordinator or agent that does not answer.
const GIVE_UP_AFTER: Duration = Duration::from_secs(300);
/// Connecting (and the TLS handshake) to a daemon on the cluster network.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Limit of one call.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Poll intervals: fast while output flows, slower when idle.
const POLL_MIN: Duration = Duration::from_millis(20);
const POLL_MAX: Duration = Duration::from_millis(500);

/// ssh options that take a value.
const SSH_OPTS_WITH_VALUE: &str = "bcDEeFIiJLlmOopQRSWw";

/// HOST and the command, from ssh-style arguments; `None` if there is no host.
fn parse_args(args: &[String]) -> Option<(String, String)> {
    let mut it = args.iter().filter(|a| !a.is_empty());
    let host = loop {
        let a = it.next()?;
        match a.strip_prefix('-') {
            Some(flags) if !flags.is_empty() => {
                // `-p 22` takes the next argument; `-p22` or `-xq` do not.
                if let Some(last) = flags.chars().last() {
                    if flags.len() == 1 && SSH_OPTS_WITH_VALUE.contains(last) {
                        it.next()?;
                    }
                }
            }
            _ => break a.clone(),
        }
    };
    // sshd hands the command, joined by spaces, to the user's shell.
    let command = it.cloned().collect::<Vec<_>>().join(" ");
    Some((host, command))
}

/// Connects to a daemon of the cluster: over TLS, checking against the cluster CA
/// (`CKPT_TLS_CA`) that the server is `server` (ckptd, or the agent of the node named), or over
/// the standalone daemon's local socket.
async fn connect(addr: &str, server: ckpt_auth::Identity) -> Result<Channel, String> {
    let dial = if addr.starts_with("unix:") {
        ckpt_auth::transport::Dial::LocalOnly
    } else {
        let ca = std::env::var_os("CKPT_TLS_CA")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::Path::new(ckpt_auth::ca::DEFAULT_DIR).join(ckpt_auth::ca::CA_CERT)
            });
        let roots = ckpt_auth::tls::load_roots(&ca).map_err(|e| e.to_string())?;
        let cfg =
            ckpt_auth::tls::anonymous_client_config(&roots, server).map_err(|e| e.to_string())?;
        ckpt_auth::transport::Dial::Tls(cfg)
    };
    ckpt_auth::transport::connect(addr, dial, CONNECT_TIMEOUT).await
}

/// Whether a failed call may succeed if tried again.
fn transient(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
    )
}

struct Job {
    id: u64,
    token: String,
    coordinator: String,
}

/// Asks ckptd to start the command on the host; retries while it is unreachable or busy
/// (a checkpoint of the job in progress), bounded.
async fn attach(job: &Job, host: &str, command: &str) -> Result<pb::AttachReply, String> {
    let cwd = std::env::current_dir()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "/".into());
    let begin = Instant::now();
    // This invocation's, on every try: a retry after a call that timed out while the node was
    // slow to start the part gets that part, not a refusal as a second one.
    let attempt = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let mut wait = Duration::from_millis(100);
    loop {
        let err = match connect(&job.coordinator, ckpt_auth::Identity::Coordinator).await {
            Ok(ch) => {
                let req = pb::AttachRequest {
                    job_id: job.id,
                    token: job.token.clone(),
                    host: host.into(),
                    command: command.into(),
                    cwd: cwd.clone(),
                    attempt: attempt.clone(),
                };
                match with_timeout(RegistryClient::new(ch).attach(req)).await {
                    Ok(r) => return Ok(r.into_inner()),
                    Err(s) if transient(&s) => s.message().to_string(),
                    Err(s) => return Err(s.message().to_string()),
                }
            }
            Err(e) => e,
        };
        if begin.elapsed() > GIVE_UP_AFTER {
            return Err(format!(
                "the coordinator at {} did not accept the command within {GIVE_UP_AFTER:?}: {err}",
                job.coordinator
            ));
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(2));
    }
}

/// Where the part first started on `node` runs now, from the coordinator: its node (another
/// one if a restart moved it) and that node's agent.
async fn locate(job: &Job, node: &str) -> Option<(String, String)> {
    let ch = connect(&job.coordinator, ckpt_auth::Identity::Coordinator)
        .await
        .ok()?;
    let req = pb::LocateRequest {
        job_id: job.id,
        token: job.token.clone(),
        node: node.into(),
    };
    let r = with_timeout(RegistryClient::new(ch).locate(req))
        .await
        .ok()?
        .into_inner();
    // A coordinator that does not name the node has not moved the part.
    let now = if r.node.is_empty() {
        node.into()
    } else {
        r.node
    };
    Some((now, r.agent))
}

/// A call bounded by [`CALL_TIMEOUT`].
async fn with_timeout<T>(
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<tonic::Response<T>, tonic::Status> {
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer in time")))
}

async fn poll_once(
    agent: &str,
    node: &str,
    req: pb::PollRequest,
) -> Result<pb::PollReply, tonic::Status> {
    let ch = connect(agent, ckpt_auth::Identity::Node(node.to_string()))
        .await
        .map_err(tonic::Status::unavailable)?;
    with_timeout(AgentClient::new(ch).poll(req))
        .await
        .map(|r| r.into_inner())
}

/// Forwards a signal this process got to the remote part, as sshd hangs up a session.
async fn forward_signal(agent: &str, node: &str, job: &Job, signal: i32) {
    if let Ok(ch) = connect(agent, ckpt_auth::Identity::Node(node.to_string())).await {
        let _ = with_timeout(AgentClient::new(ch).signal(pb::SignalRequest {
            job_id: job.id,
            signal,
            token: job.token.clone(),
        }))
        .await;
    }
}

fn write_all(fd: &mut impl Write, data: &[u8]) {
    // The reader may be gone (mpiexec closed the pipe); the remote command still runs.
    let _ = fd.write_all(data).and_then(|()| fd.flush());
}

async fn follow(job: &Job, reply: pb::AttachReply) -> u8 {
    use tokio::signal::unix::{signal, SignalKind};
    // The node the part was started on, as the coordinator knows it wherever it runs now.
    let first = reply.node;
    let mut node = first.clone();
    let mut agent = reply.agent;
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    let mut hup = signal(SignalKind::hangup()).ok();
    let (mut out_off, mut err_off) = (0u64, 0u64);
    let mut interval = POLL_MIN;
    let mut failing_since: Option<Instant> = None;
    let mut absent_since: Option<Instant> = None;
    loop {
        let req = pb::PollRequest {
            job_id: job.id,
            token: job.token.clone(),
            stdout_offset: out_off,
            stderr_offset: err_off,
        };
        match poll_once(&agent, &node, req).await {
            Ok(r) => {
                failing_since = None;
                let ended = matches!(r.state(), pb::PartState::Exited | pb::PartState::Absent);
                if ended {
                    // A restart may have moved the part while this node's agent lives on and
                    // still reports the incarnation that ran here (and what it wrote after the checkpoint):
                    // follow it there, without that output.
                    if let Some((now, a)) = locate(job, &first).await {
                        if now != node {
                            (node, agent) = (now, a);
                            absent_since = None;
                            interval = POLL_MIN;
                            continue;
                        }
                    }
                }
                let got = !r.stdout.is_empty() || !r.stderr.is_empty();
                out_off += r.stdout.len() as u64;
                err_off += r.stderr.len() as u64;
                write_all(&mut std::io::stdout(), &r.stdout);
                write_all(&mut std::io::stderr(), &r.stderr);
                match r.state() {
                    pb::PartState::Exited => {
                        let end = r.end.unwrap_or_default();
                        return match (end.code(), end.signal()) {
                            (Some(c), _) => c.clamp(0, 255) as u8,
                            (None, Some(s)) => (128 + s).clamp(0, 255) as u8,
                            _ => UNREACHABLE,
                        };
                    }
                    pb::PartState::Absent => {
                        let since = *absent_since.get_or_insert_with(Instant::now);
                        if since.elapsed() > Duration::from_secs(30) {
                            eprintln!(
                                "ckpt-rsh: job {}'s processes on node {node} are gone without an exit status",
                                job.id
                            );
                            return UNREACHABLE;
                        }
                    }
                    _ => absent_since = None,
                }
                interval = if got {
                    POLL_MIN
                } else {
                    (interval * 2).min(POLL_MAX)
                };
            }
            Err(s)
                if s.code() == tonic::Code::NotFound
                    || s.code() == tonic::Code::PermissionDenied =>
            {
                eprintln!("ckpt-rsh: node {node}: {}", s.message());
                return UNREACHABLE;
            }
            Err(s) => {
                let since = *failing_since.get_or_insert_with(Instant::now);
                if since.elapsed() > GIVE_UP_AFTER {
                    eprintln!(
                        "ckpt-rsh: lost contact with node {node}'s agent at {agent} for {GIVE_UP_AFTER:?}: {}",
                        s.message()
                    );
                    return UNREACHABLE;
                }
                // The agent may have restarted elsewhere: ask the coordinator where it is.
                if since.elapsed() > Duration::from_secs(2) {
                    if let Some((now, a)) = locate(job, &first).await {
                        (node, agent) = (now, a);
                    }
                }
                interval = POLL_MAX;
            }
        }
        let sig = tokio::select! {
            _ = tokio::time::sleep(interval) => None,
            Some(()) = async { term.as_mut()?.recv().await } => Some(libc::SIGTERM),
            Some(()) = async { int.as_mut()?.recv().await } => Some(libc::SIGINT),
            Some(()) = async { hup.as_mut()?.recv().await } => Some(libc::SIGHUP),
        };
        if let Some(s) = sig {
            forward_signal(&agent, &node, job, s).await;
            return (128 + s) as u8;
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let Some((host, command)) = parse_args(&args) else {
        eprintln!("ckpt-rsh: no host given\n\n{USAGE}");
        return ExitCode::from(UNREACHABLE);
    };
    if command.trim().is_empty() {
        eprintln!("ckpt-rsh: {host}: interactive sessions are not supported; give a command");
        return ExitCode::from(UNREACHABLE);
    }
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (Some(id), Some(token), Some(coordinator)) = (
        var("CKPT_JOB_ID").and_then(|v| v.parse().ok()),
        var("CKPT_JOB_TOKEN"),
        var("CKPT_COORDINATOR"),
    ) else {
        eprintln!(
            "ckpt-rsh: not inside a ckpt job (CKPT_JOB_ID, CKPT_JOB_TOKEN or CKPT_COORDINATOR is unset); start the job with `ckptctl run -- mpiexec ...`"
        );
        return ExitCode::from(UNREACHABLE);
    };
    let job = Job {
        id,
        token,
        coordinator,
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ckpt-rsh: {e}");
            return ExitCode::from(UNREACHABLE);
        }
    };
    rt.block_on(async {
        match attach(&job, &host, &command).await {
            Ok(reply) => ExitCode::from(follow(&job, reply).await),
            Err(e) => {
                eprintln!("ckpt-rsh: {host}: {e}");
                ExitCode::from(UNREACHABLE)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::parse_args;

    fn p(args: &[&str]) -> Option<(String, String)> {
        parse_args(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn parses_the_ways_mpi_launchers_call_ssh() {
        // Hydra: `-x HOST "cmd" args...`
        assert_eq!(
            p(&[
                "-x",
                "10.0.0.2",
                "\"/usr/bin/hydra_pmi_proxy\"",
                "--control-port",
                "h:1"
            ]),
            Some((
                "10.0.0.2".into(),
                "\"/usr/bin/hydra_pmi_proxy\" --control-port h:1".into()
            ))
        );
        // Open MPI: `HOST "" orted ...` style with an empty argument.
        assert_eq!(
            p(&["n2", "", "orted", "-mca", "ess", "\"env\""]),
            Some(("n2".into(), "orted -mca ess \"env\"".into()))
        );
        // Options with values, attached or not.
        assert_eq!(
            p(&[
                "-o",
                "StrictHostKeyChecking=no",
                "-p22",
                "-l",
                "me",
                "-q",
                "n3",
                "true"
            ]),
            Some(("n3".into(), "true".into()))
        );
        assert_eq!(p(&["-x"]), None);
        assert_eq!(p(&["n1"]), Some(("n1".into(), String::new())));
    }
}
