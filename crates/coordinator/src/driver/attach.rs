//! A job's processes on other nodes: `ckpt-rsh` resolving a host and attaching a part of the
//! job there (checked by the job token), and locating a job by its token.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckpt_proto::v1 as pb;
use ckpt_proto::Engine;
use tokio::sync::watch;
use tracing::{info, instrument, warn};

use super::{Coordinator, DriveError};
use crate::agents::NodeFailure;
use crate::model::{Job, JobState};

/// What became of an attach: the reply, or how the node failed to start the part.
type Outcome = Option<Result<pb::AttachReply, NodeFailure>>;

/// Parts `ckpt-rsh` asked to start, by (job, node): the attempt that asked and its outcome,
/// once known. A `ckpt-rsh` whose call timed out while the node was slow to start the part asks
/// again with the same attempt and gets the first call's outcome: the part is started once,
/// whatever became of the calls.
#[derive(Debug, Default)]
pub(crate) struct Attaches(Mutex<HashMap<(u64, String), Asked>>);

/// One attach: who asked, when, and what became of it.
#[derive(Debug)]
struct Asked {
    attempt: String,
    since: Instant,
    outcome: watch::Receiver<Outcome>,
}

/// How long an attach's outcome is kept for retries: longer than `ckpt-rsh` retries.
const ATTACH_KEPT: Duration = Duration::from_secs(600);

impl Attaches {
    /// The outcome of `attempt`'s attach of `node`, if it made one.
    fn of(&self, job: u64, node: &str, attempt: &str) -> Option<watch::Receiver<Outcome>> {
        let m = self.0.lock().expect("attaches lock");
        m.get(&(job, node.to_string()))
            .filter(|a| !attempt.is_empty() && a.attempt == attempt)
            .map(|a| a.outcome.clone())
    }

    fn insert(&self, job: u64, node: &str, attempt: &str, rx: watch::Receiver<Outcome>) {
        let mut m = self.0.lock().expect("attaches lock");
        m.retain(|_, a| a.since.elapsed() < ATTACH_KEPT);
        let asked = Asked {
            attempt: attempt.to_string(),
            since: Instant::now(),
            outcome: rx,
        };
        m.insert((job, node.to_string()), asked);
    }
}

/// Waits for an attach's outcome.
async fn outcome(mut rx: watch::Receiver<Outcome>) -> Result<pb::AttachReply, DriveError> {
    match rx.wait_for(Option::is_some).await {
        Ok(o) => o.clone().expect("waited for").map_err(DriveError::from),
        Err(_) => Err(DriveError::Busy(
            "the part's start was interrupted; try again".into(),
        )),
    }
}

impl Coordinator {
    /// The node a host name from an MPI host list means: a node name (also without its domain),
    /// an address of the node (its agent's or one of its interfaces'), or a name resolving to one.
    pub async fn resolve_host(&self, host: &str) -> Result<String, DriveError> {
        let agents = self.agents.list();
        let short = |s: &str| s.split('.').next().unwrap_or(s).to_string();
        if let Some((n, _, _)) = agents
            .iter()
            .find(|(n, _, _)| n == host)
            .or_else(|| agents.iter().find(|(n, _, _)| short(n) == short(host)))
        {
            return Ok(n.clone());
        }
        if let Some(n) = self.agents.node_with_address(host) {
            return Ok(n);
        }
        if let Ok(ips) = tokio::net::lookup_host((host, 0)).await {
            if let Some(n) = ips
                .map(|s| s.ip().to_string())
                .find_map(|ip| self.agents.node_with_address(&ip))
            {
                return Ok(n);
            }
        }
        let known = agents
            .iter()
            .map(|(n, a, _)| format!("{n} ({a})"))
            .collect::<Vec<_>>()
            .join(", ");
        Err(DriveError::Invalid(format!(
            "host {host:?} is not a node with a registered ckpt-agent (known: {known}); start ckpt-agent there, or name the host as its node name or agent address"
        )))
    }

    /// The job `id` if `token` is its secret. An unknown job is answered as a wrong secret,
    /// so that a caller without the secret cannot tell which jobs exist.
    fn job_by_token(&self, id: u64, token: &str) -> Result<Job, DriveError> {
        match self.registry.job(id)? {
            Some(job) if ckpt_auth::token_eq(&job.token, token) => Ok(job),
            _ => Err(DriveError::Denied(format!(
                "wrong secret for job {id}, or no such job: ckpt-rsh must run inside the job (CKPT_JOB_TOKEN)"
            ))),
        }
    }

    /// Starts a part of a running job on another node, for `ckpt-rsh`: the command runs there
    /// through `/bin/sh -c` as the job's owner, in the job's cgroup, with the environment sshd
    /// would give it. Returns the node and its agent's address.
    ///
    /// The part starts in a task of its own: a caller that stops waiting (its call timed out)
    /// neither interrupts it nor leaves the job recording a part that never started, and its
    /// retry (the same `attempt`) gets the outcome.
    #[instrument(skip_all, fields(job = req.job_id, host = %req.host))]
    pub async fn attach(
        self: &Arc<Self>,
        req: pb::AttachRequest,
    ) -> Result<pb::AttachReply, DriveError> {
        let id = req.job_id;
        // The token first: a caller without it learns nothing of the cluster's nodes.
        self.job_by_token(id, &req.token)?;
        let node = self.resolve_host(&req.host).await?;
        let (job, part) = {
            let _g = self.state.lock().await;
            let mut job = self.job_by_token(id, &req.token)?;
            may_join(&job, &node)?;
            if job.parts.contains(&node) {
                if let Some(rx) = self.attaches.of(id, &node, &req.attempt) {
                    drop(_g);
                    info!(node, "ckpt-rsh asked again for the part it asked for");
                    return outcome(rx).await;
                }
                return Err(DriveError::Invalid(format!(
                    "job {id} already has processes on node {node}; name each host once in mpiexec's host list"
                )));
            }
            job.parts.push(node.clone());
            self.take_address(&mut job, &node)?;
            self.registry.put_job(&job)?;
            let part = job.parts.len() as u32;
            (job, part)
        };
        let (home, env) = part_env(&job);
        let launch = pb::LaunchRequest {
            job_id: id,
            argv: vec!["/bin/sh".into(), "-c".into(), req.command.clone()],
            cwd: home,
            env,
            uid: job.owner_uid,
            gid: job.owner_gid,
            groups: vec![],
            token: job.token.clone(),
            part,
            engine: job.engine.map(Engine::as_str).unwrap_or_default().into(),
            may_move: job.may_move(),
            job_address: job.addresses.get(&node).cloned().unwrap_or_default(),
            job_gateway: if job.addresses.contains_key(&node) {
                self.job_gateway()
            } else {
                String::new()
            },
        };
        let (tx, rx) = watch::channel(None);
        self.attaches.insert(id, &node, &req.attempt, rx.clone());
        let me = self.clone();
        tokio::spawn(async move {
            let r = me
                .agents
                .call(&node, "launch", me.cfg.deadlines.sync, |mut c| async move {
                    c.launch(launch).await
                })
                .await;
            let r = match r {
                Ok(reply) => {
                    info!(job = id, node, pid = reply.pid, part, "job part started");
                    Ok(pb::AttachReply {
                        agent: me.agents.address(&node).unwrap_or_default(),
                        node,
                        pid: reply.pid,
                        incarnation: reply.incarnation,
                    })
                }
                Err(failure) => {
                    warn!(job = id, node, error = %failure, "job part not started");
                    let _ = me
                        .update_job(id, |j| {
                            j.parts.retain(|p| *p != node);
                            j.addresses.remove(&node);
                            Ok(())
                        })
                        .await;
                    Err(failure)
                }
            };
            let _ = tx.send(Some(r));
        });
        outcome(rx).await
    }

    /// The current address of a node's agent, for `ckpt-rsh` of a job with a part there.
    pub async fn locate(&self, req: pb::LocateRequest) -> Result<pb::LocateReply, DriveError> {
        let job = self.job_by_token(req.job_id, &req.token)?;
        // A part a restart moved is found where it runs now.
        let node = job.moved.get(&req.node).unwrap_or(&req.node);
        let agent = self
            .agents
            .address(node)
            .ok_or_else(|| DriveError::Invalid(format!("node {node} has no registered agent")))?;
        Ok(pb::LocateReply {
            agent,
            node: node.clone(),
        })
    }
}

/// PATH of commands started on other nodes, as sshd sets it.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Whether a part of `job` may start on `node` now: the job runs (or is starting), under an
/// engine that runs across nodes, and `node` is not its launcher's.
fn may_join(job: &Job, node: &str) -> Result<(), DriveError> {
    let id = job.id;
    // The launcher may call here before the launch reply is in (`Starting`).
    match job.state() {
        JobState::Running | JobState::Starting => {}
        JobState::Checkpointing | JobState::Restarting => {
            return Err(DriveError::Busy(format!(
                "job {id} is {}; try again when it is done",
                job.state().name()
            )))
        }
        _ => {
            return Err(DriveError::Invalid(format!(
                "job {id} is {}: no new processes can join it",
                job.state().name()
            )))
        }
    }
    if job.engine_virtualizes() {
        return Err(DriveError::Invalid(format!(
            "job {id} runs under {}, which ckpt runs on one node: its MPI launcher may not start processes on node {node} (DMTCP 4.2's restart cannot reconnect TCP between nodes, so the job could be checkpointed but not restarted; docs/dmtcp.md); run the job on one node, or with --engine criu",
            job.snapshot_engine()
        )));
    }
    if node == job.node {
        return Err(DriveError::Invalid(format!(
            "node {node} runs job {id}'s launcher, which starts its processes there itself; name each host once in mpiexec's host list"
        )));
    }
    Ok(())
}

/// The home directory and environment of a part started for `job`'s launcher: what sshd would
/// give its owner, and the job's own part environment.
fn part_env(job: &Job) -> (String, HashMap<String, String>) {
    let user = nix::unistd::User::from_uid(job.owner_uid.into())
        .ok()
        .flatten();
    let home = user
        .as_ref()
        .map(|u| u.dir.display().to_string())
        .unwrap_or_else(|| "/".into());
    let mut env = std::collections::HashMap::new();
    env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
    env.insert("HOME".to_string(), home.clone());
    if let Some(u) = &user {
        env.insert("USER".to_string(), u.name.clone());
        env.insert("LOGNAME".to_string(), u.name.clone());
        env.insert("SHELL".to_string(), "/bin/sh".to_string());
    }
    for (k, v) in &job.part_env {
        env.insert(k.clone(), v.clone());
    }
    (home, env)
}
