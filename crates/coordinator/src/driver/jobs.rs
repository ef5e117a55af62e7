//! A job's life outside its checkpoints: agents registering and reporting, `run`, `cancel`,
//! and what ckptctl shows of a job on its nodes.
//!
//! One file: a job record's life between checkpoints (registration, reports, run, cancel, the view
//! of its nodes), each a transition of the same record under the same lock.
use std::sync::Arc;

use ckpt_proto::v1 as pb;
use ckpt_proto::Engine;
use tracing::{info, instrument, warn};

use super::{now_ms, Caller, Coordinator, DriveError, RunSpec};
use crate::agents::call;
use crate::model::{Job, JobState};

impl Coordinator {
    /// Registers an agent, and aborts on it any epoch a coordinator restart interrupted.
    pub async fn register_agent(
        self: &Arc<Self>,
        node: &str,
        info: crate::agents::Registration,
    ) -> Result<(), String> {
        let address = info.address.clone();
        let dial = match (&self.credential, address.starts_with("unix:")) {
            (_, true) | (None, false) => ckpt_auth::transport::Dial::LocalOnly,
            (Some(c), false) => ckpt_auth::transport::Dial::Tls(
                c.client_config(ckpt_auth::Identity::Node(node.to_string()))
                    .map_err(|e| e.to_string())?,
            ),
        };
        self.agents.register(node, info, dial)?;
        info!(node, address, "agent registered");
        self.resume_waiting_flushes();
        let pending: Vec<(String, u64, u32)> = {
            let mut o = self.orphaned.lock().expect("orphaned lock");
            let (mine, rest) = o.drain(..).partition(|(n, _, _)| n == node);
            *o = rest;
            mine
        };
        // Not waited for: the agent's lease comes with this registration's answer, and an
        // abort may wait for the node's part to leave a phase first.
        let interrupted: Vec<u64> = self
            .interrupted
            .lock()
            .expect("interrupted lock")
            .iter()
            .copied()
            .collect();
        let me = self.clone();
        let node = node.to_string();
        tokio::spawn(async move {
            for job in interrupted {
                // Whatever this node restored of it is held frozen; not if it was restarted
                // since (begin_restart takes it off the set).
                if !me
                    .interrupted
                    .lock()
                    .expect("interrupted lock")
                    .contains(&job)
                {
                    continue;
                }
                if let Ok(mut c) = me.agents.client(&node) {
                    let req = pb::ReleaseRequest {
                        job_id: job,
                        kill: true,
                    };
                    let _ = call(&node, "release", me.cfg.deadlines.resume, c.release(req)).await;
                }
            }
            for (_, job, epoch) in pending {
                if let Ok(mut c) = me.agents.client(&node) {
                    let req = pb::AbortRequest {
                        job_id: job,
                        epoch,
                        reason: "coordinator restarted during the epoch".into(),
                    };
                    let _ = call(&node, "abort", me.cfg.deadlines.abort, c.abort(req)).await;
                }
            }
        });
        Ok(())
    }

    /// Applies an agent's report about its jobs (and its staging space: free, total bytes).
    pub async fn heartbeat(
        &self,
        node: &str,
        reports: Vec<pb::JobReport>,
        staging: Option<(u64, u64)>,
    ) -> bool {
        if !self.agents.seen(node, staging) {
            return false;
        }
        let fenced: Vec<(u64, u64)> = reports
            .iter()
            .filter(|r| r.fenced_after_ms > 0)
            .map(|r| (r.job_id, r.fenced_after_ms))
            .collect();
        if !fenced.is_empty() {
            // Before the launcher's exit, which the fence caused, is taken for the job's end.
            self.fenced(node, fenced).await;
        }
        for r in reports.iter().filter(|r| !r.killed.is_empty()) {
            // Before the launcher's end too, which this death may have caused.
            let _g = self.state.lock().await;
            if let Ok(Some(mut job)) = self.registry.job(r.job_id) {
                let part = job.node == node || job.parts.iter().any(|p| p == node);
                if part
                    && *job.state() == JobState::Running
                    && job.killed.is_empty()
                    && !self.is_cancelling(job.id)
                {
                    job.killed = format!("{} on {node}", r.killed);
                    warn!(job = job.id, killed = %job.killed, "a process of a job was killed");
                    let _ = self.registry.put_job(&job);
                }
            }
        }
        for r in reports {
            let Some(observed) = ended(r.state(), r.end.as_ref()) else {
                continue;
            };
            let _g = self.state.lock().await;
            if let Ok(Some(mut job)) = self.registry.job(r.job_id) {
                if job.node != node || self.hold_end(&job, r.incarnation, &observed) {
                    continue;
                }
                if job.observe(r.incarnation, observed) {
                    info!(job = job.id, state = %job.state().name(), "job ended");
                    let _ = self.registry.put_job(&job);
                    self.agents.forget_job(job.id);
                }
            }
        }
        true
    }

    /// Whether to hold back the failed end a job's launcher reported: an MPI launcher ends
    /// with an error when a node of its job dies, and then the job was lost with that node, not
    /// ended, which only `node_timeout` tells (`lost.rs`). So a failed end (a signal, an exit
    /// code other than 0) of a job with parts on other nodes counts once each of them has sent
    /// a heartbeat after it was first reported: they live, and the end is the job's own. Until
    /// then the job stays running, and becomes lost if one of them goes down.
    pub(super) fn hold_end(&self, job: &Job, incarnation: u32, observed: &JobState) -> bool {
        let failed = matches!(
            observed,
            JobState::Exited {
                signal: Some(_),
                ..
            } | JobState::Exited {
                code: Some(1..),
                ..
            }
        ) || matches!(observed, JobState::Exited { code: Some(c), .. } if *c < 0);
        if job.parts.is_empty()
            || !failed
            || *job.state() != JobState::Running
            || incarnation != job.incarnation
        {
            return false;
        }
        let mut held = self.held_ends.lock().expect("held ends");
        let since = *held
            .entry((job.id, incarnation))
            .or_insert_with(std::time::Instant::now);
        let views = self.agents.views();
        let alive_since = |n: &String| {
            views
                .iter()
                .any(|v| &v.node == n && v.since_seen < since.elapsed())
        };
        if job.parts.iter().all(alive_since) {
            held.remove(&(job.id, incarnation));
            return false;
        }
        true
    }

    /// Whether the current incarnation's launcher reported a failed end that is held back
    /// ([`Coordinator::hold_end`]): the job is over, unless it is lost with a node.
    pub(super) fn end_held(&self, job: &Job) -> bool {
        self.held_ends
            .lock()
            .expect("held ends")
            .contains_key(&(job.id, job.incarnation))
    }

    /// SIGKILLs what is left of a job on `nodes`, each within `deadlines.resume`; `what`
    /// names the step in errors, which are not returned (a node that cannot be reached is
    /// down, or kills its parts itself when its lease runs out).
    pub(super) async fn kill_parts(&self, job: u64, nodes: &[String], what: &str) {
        let _ = self
            .on_all_collect(nodes, what, self.cfg.deadlines.resume, |mut c| {
                let req = pb::SignalRequest {
                    job_id: job,
                    signal: libc::SIGKILL,
                    ..Default::default()
                };
                async move { c.signal(req).await }
            })
            .await;
    }

    /// A job the caller may act on.
    pub fn job_for(&self, caller: &Caller, id: u64) -> Result<Job, DriveError> {
        let job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        caller.may_act_on(&job)?;
        Ok(job)
    }

    /// Asks the job's agent whether its processes still run, and records an exit the heartbeat
    /// has not reported yet. Errors reaching the agent leave the record as it is. A node that is
    /// down is not asked (a dead node answers nothing: the call would only wait out its
    /// deadline, and a restart of a job whose launcher's node was lost would wait with it); one
    /// that is up has `node_timeout` to answer, as in [`Coordinator::inspect`].
    pub async fn refresh(&self, id: u64) -> Result<Job, DriveError> {
        let job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        if *job.state() != JobState::Running && *job.state() != JobState::Lost {
            return Ok(job);
        }
        let timeout = self.cfg.node_timeout;
        if !self.agents.up(&job.node, timeout) {
            return Ok(job);
        }
        let Ok(mut c) = self.agents.client(&job.node) else {
            return Ok(job);
        };
        let info = match call(
            &job.node,
            "inspect",
            timeout.min(self.cfg.deadlines.sync),
            c.inspect(pb::InspectRequest { job_id: id }),
        )
        .await
        {
            Ok(i) => i,
            Err(_) => return Ok(job),
        };
        let Some(observed) = ended(info.state(), info.end.as_ref()) else {
            return Ok(job);
        };
        let _g = self.state.lock().await;
        let mut job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        let inc = job.incarnation;
        if self.hold_end(&job, inc, &observed) {
            return Ok(job);
        }
        if job.observe(inc, observed) {
            self.registry.put_job(&job)?;
            self.agents.forget_job(id);
        }
        Ok(job)
    }

    /// Starts a job.
    #[instrument(skip_all, fields(job))]
    pub async fn run(&self, caller: Caller, spec: RunSpec) -> Result<Job, DriveError> {
        if spec.argv.is_empty() {
            return Err(DriveError::Invalid(
                "no command given: ckptctl run -- COMMAND [ARGS...]".into(),
            ));
        }
        check_part_env(&spec.part_env)?;
        // The engine asked for, if any ("" names none), and the one the job runs under.
        let asked = match spec.engine.as_str() {
            "" => None,
            e => Some(
                e.parse::<Engine>()
                    .map_err(|e| DriveError::Invalid(e.to_string()))?,
            ),
        };
        let engine = asked.unwrap_or_default();
        let on_failure = self.on_failure(&spec.on_failure, engine)?;
        if !spec.redundancy.is_empty() && spec.redundancy != "none" {
            spec.redundancy
                .parse::<ckpt_store::erasure::Scheme>()
                .map_err(|e| DriveError::Invalid(format!("--redundancy {e}, or `none`")))?;
        }
        let (node, mut client) = self.launch_node(&spec.node, engine).await?;
        let (id, name, token, job_address) = {
            let _g = self.state.lock().await;
            let id = self.registry.next_job_id()?;
            let name = if spec.name.is_empty() {
                std::path::Path::new(&spec.argv[0])
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "job".into())
            } else {
                spec.name.clone()
            };
            let mut job = fresh_job(id, name.clone(), &caller, &spec, &node, asked, on_failure);
            self.check_live_jobs(&job)?;
            self.take_address(&mut job, &node)?;
            self.registry.put_job(&job)?;
            let address = job.addresses.get(&node).cloned().unwrap_or_default();
            (id, name, job.token, address)
        };
        tracing::Span::current().record("job", id);
        let req = pb::LaunchRequest {
            job_id: id,
            argv: spec.argv,
            cwd: spec.cwd,
            env: spec.env,
            uid: caller.uid,
            gid: caller.gid,
            // The agent takes the groups (and the primary group) from its node's user database.
            groups: Vec::new(),
            token,
            part: 0,
            engine: asked.map(Engine::as_str).unwrap_or_default().into(),
            may_move: matches!(on_failure, crate::model::OnFailure::Restart { .. }),
            job_gateway: if job_address.is_empty() {
                String::new()
            } else {
                self.job_gateway()
            },
            job_address,
        };
        let reply = match call(&node, "launch", self.cfg.deadlines.sync, client.launch(req)).await {
            Ok(r) => r,
            Err(failure) => {
                // Keep the record, so the id is never reused and `ckptctl list` says why.
                let reason = failure.message.clone();
                self.update_job(id, |j| {
                    j.failed_to_start(reason);
                    Ok(())
                })
                .await?;
                return Err(failure.into());
            }
        };
        let _g = self.state.lock().await;
        let mut job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        job.started(reply.incarnation, reply.job_dir, now_ms());
        self.registry.put_job(&job)?;
        info!(job = id, name, node, pid = reply.pid, "job started");
        Ok(job)
    }

    /// The node a new job's launcher runs on, with its agent's client: the one `asked` (`""`:
    /// the first node whose agent has the job's `engine`), which must have that engine. Right
    /// after ckptd started, a node named that has not registered again yet is waited for
    /// ([`Coordinator::registered_client`]).
    async fn launch_node(
        &self,
        asked: &str,
        engine: Engine,
    ) -> Result<(String, ckpt_proto::FencedAgentClient), DriveError> {
        let node = if asked.is_empty() {
            // The first node that has the engine.
            let nodes = self.agents.list();
            nodes
                .iter()
                .map(|(n, _, _)| n.clone())
                .find(|n| self.agents.has_engine(n, engine))
                .or_else(|| nodes.first().map(|(n, _, _)| n.clone()))
                .ok_or(DriveError::NoAgents)?
        } else {
            asked.to_string()
        };
        let client = self.registered_client(&node).await?;
        if !self.agents.has_engine(&node, engine) {
            let has = self.agents.engines(&node);
            return Err(DriveError::Invalid(format!(
                "node {node} has no {engine} engine (its agent reported {}): install {} there and restart its ckpt-agent (see docs/dmtcp.md), run on a node that has it with --node, or choose another engine with --engine",
                if has.is_empty() { "none".to_string() } else { has.iter().map(|(n, v)| format!("{n} {v}")).collect::<Vec<_>>().join(", ") },
                engine.as_str().to_uppercase(),
            )));
        }
        Ok((node, client))
    }

    /// The client of `node`'s agent. In ckptd's first `node_timeout` a node not registered
    /// may only not have re-registered yet (its agent does on its next heartbeat after ckptd
    /// restarts or a standby takes over): it is waited for until then, so that a request right
    /// after a restart is not refused for it. After that, an unregistered node is refused at
    /// once.
    pub(super) async fn registered_client(
        &self,
        node: &str,
    ) -> Result<ckpt_proto::FencedAgentClient, DriveError> {
        loop {
            match self.agents.client(node) {
                Ok(c) => return Ok(c),
                Err(_) if self.started.elapsed() < self.cfg.node_timeout => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Kills a running job (SIGTERM, then SIGKILL); gives up one that ended in a way a restart
    /// follows, which gives back its job addresses ([`Job::cancel`]). Its epochs stay
    /// restorable.
    pub async fn cancel(&self, caller: &Caller, id: u64) -> Result<Job, DriveError> {
        self.job_for(caller, id)?;
        let job = self.refresh(id).await?;
        if *job.state() != JobState::Running {
            // Nothing runs: only its state changes (refused by the guard, with the job's
            // state in the message, when it is not one a restart follows).
            let was = job.state().name();
            let job = self
                .update_job(id, |j| j.cancel().map_err(DriveError::from))
                .await?;
            info!(job = id, was, "job cancelled: its job addresses are free again, and it is not restarted by itself; its checkpoints stay restorable");
            return Ok(job);
        }
        let node = job.node.clone();
        let client = self.agents.client(&node)?;
        self.cancelling.lock().expect("cancelling").insert(id);
        let r = self.cancel_now(id, &job, client).await;
        self.cancelling.lock().expect("cancelling").remove(&id);
        r
    }

    /// Whether a cancel is killing the job now.
    pub(super) fn is_cancelling(&self, id: u64) -> bool {
        self.cancelling.lock().expect("cancelling").contains(&id)
    }

    /// [`Coordinator::cancel`]'s signals, and the job's end as cancelled.
    async fn cancel_now(
        &self,
        id: u64,
        job: &Job,
        client: ckpt_proto::FencedAgentClient,
    ) -> Result<Job, DriveError> {
        let node = job.node.clone();
        let d = &self.cfg.deadlines;
        let signal = |signal| {
            let req = pb::SignalRequest {
                job_id: id,
                signal,
                ..Default::default()
            };
            let mut c = client.clone();
            let node = node.clone();
            async move { call(&node, "cancel", d.resume, c.signal(req)).await }
        };
        let _ = signal(libc::SIGTERM).await;
        // Give the job a grace period to exit on SIGTERM, then kill what is left.
        for _ in 0..CANCEL_GRACE_STEPS {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            let mut c = client.clone();
            let inspect = c.inspect(pb::InspectRequest { job_id: id });
            if let Ok(i) = call(&node, "inspect", d.sync, inspect).await {
                if i.processes.is_empty() {
                    break;
                }
            }
        }
        let _ = signal(libc::SIGKILL).await;
        // Parts on other nodes normally end with the launcher; kill what is left of them.
        self.kill_parts(id, &job.parts, "cancel").await;
        self.agents.forget_job(id);
        // The job was running when the cancel began; an end seen since (its exit on SIGTERM,
        // reported by a heartbeat) is the cancel's doing.
        self.update_job(id, |j| {
            j.killed_by_cancel();
            Ok(())
        })
        .await
    }

    /// The job's processes per node, as the agents see them now (asked in parallel).
    /// A node that is down is not asked: its part says so. The others have `node_timeout` to
    /// answer (an agent answers from memory; one that does not is about to be down).
    pub async fn inspect(&self, job: &Job) -> Vec<pb::NodeJobInfo> {
        let id = job.id;
        let timeout = self.cfg.node_timeout;
        let deadline = timeout.min(self.cfg.deadlines.sync);
        let (up, down): (Vec<String>, Vec<String>) = job
            .nodes()
            .into_iter()
            .partition(|n| self.agents.up(n, timeout));
        let mut answers = self
            .on_all_collect(&up, "inspect", deadline, |mut c| async move {
                c.inspect(pb::InspectRequest { job_id: id }).await
            })
            .await;
        answers.extend(down.into_iter().map(|n| {
            let why = format!(
                "node down: its agent has sent no heartbeat for {} (ckptd.toml node_timeout)",
                humantime::format_duration(timeout)
            );
            let failure = crate::agents::NodeFailure {
                node: n.clone(),
                kind: crate::agents::FailureKind::Unreachable,
                message: why,
            };
            (n, Err(failure))
        }));
        answers
            .into_iter()
            .map(|(n, r)| {
                let address = job.addresses.get(&n).cloned().unwrap_or_default();
                let mut info = r.unwrap_or_else(|e| pb::NodeJobInfo {
                    role: if n == job.node {
                        "launcher"
                    } else {
                        "attached"
                    }
                    .into(),
                    node: n,
                    state: pb::PartState::Unspecified.into(),
                    end: None,
                    detail: e.message,
                    processes: vec![],
                    ..Default::default()
                });
                info.address = address;
                // The agent of a part restored elsewhere cannot tell which part it is.
                info.role = if info.node == job.node {
                    "launcher"
                } else {
                    "attached"
                }
                .into();
                info.moved_from = job
                    .moved
                    .iter()
                    .find(|(_, now)| **now == info.node)
                    .map(|(old, _)| old.clone())
                    .unwrap_or_default();
                info
            })
            .collect()
    }
}

/// The end of a job's part that an agent reports (in a heartbeat or an Inspect reply): how it
/// exited, or that its processes are gone without an exit status. `None` while it runs (or
/// for a state this coordinator does not know).
fn ended(state: pb::PartState, end: Option<&pb::JobEnd>) -> Option<JobState> {
    match state {
        pb::PartState::Exited => Some(JobState::Exited {
            code: end.and_then(pb::JobEnd::code),
            signal: end.and_then(pb::JobEnd::signal),
        }),
        pb::PartState::Absent => Some(JobState::Lost),
        pb::PartState::Running | pb::PartState::Frozen | pb::PartState::Unspecified => None,
    }
}

/// Most variables a job may give its parts on other nodes, and the longest value.
const PART_ENV_MAX: usize = 64;
const PART_ENV_VALUE_MAX: usize = 4096;

/// Checks the variables a job's parts on other nodes get: environment variable names (not
/// ckpt's own `CKPT_*`, which the agents set), bounded in number and size, no NUL.
fn check_part_env(env: &std::collections::HashMap<String, String>) -> Result<(), DriveError> {
    let bad = |m: String| Err(DriveError::Invalid(format!("part_env: {m}")));
    if env.len() > PART_ENV_MAX {
        return bad(format!("{} variables, at most {PART_ENV_MAX}", env.len()));
    }
    for (k, v) in env {
        let name_ok = k
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && k.len() <= 128;
        if !name_ok {
            return bad(format!("{k:?} is not an environment variable name"));
        }
        if k.starts_with("CKPT_") {
            return bad(format!("{k} is set by ckpt itself"));
        }
        if v.len() > PART_ENV_VALUE_MAX || v.contains('\0') {
            return bad(format!(
                "the value of {k} is longer than {PART_ENV_VALUE_MAX} bytes or has a NUL"
            ));
        }
    }
    Ok(())
}

/// A fresh job secret: 128 random bits, hex.
fn new_token() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        // Never reached on Linux; still unguessable enough to tell jobs apart.
        b[..8].copy_from_slice(&now_ms().to_le_bytes());
        b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// SIGTERM grace period of `cancel`, in 100 ms steps: MPI launchers forward SIGTERM to ranks
/// and need a moment to tear down.
const CANCEL_GRACE_STEPS: u32 = 50;

/// The record of a new job `id` called `name`, started by `caller` as `spec` says on `node`,
/// before its launch.
fn fresh_job(
    id: u64,
    name: String,
    caller: &Caller,
    spec: &RunSpec,
    node: &str,
    engine: Option<Engine>,
    on_failure: crate::model::OnFailure,
) -> Job {
    let mut job = Job::new(id, JobState::Starting);
    job.name = name;
    job.owner_uid = caller.uid;
    job.owner_gid = caller.gid;
    job.argv = spec.argv.clone();
    job.cwd = spec.cwd.clone();
    job.node = node.to_string();
    job.created_unix_ms = now_ms();
    job.token = new_token();
    job.part_env = spec.part_env.clone().into_iter().collect();
    job.policy = spec.policy.clone();
    job.engine = engine;
    job.on_failure = on_failure;
    job.redundancy = spec.redundancy.clone();
    job
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_env_takes_only_plain_variables_and_never_ckpts_own() {
        let env = |pairs: &[(&str, &str)]| -> std::collections::HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(check_part_env(&env(&[("UCX_TLS", "rc_verbs,ud_verbs,self")])).is_ok());
        for (k, v) in [
            ("CKPT_JOB_TOKEN", "x"),
            ("A=B", "x"),
            ("1X", "x"),
            ("", "x"),
            ("UCX_TLS", "a\0b"),
        ] {
            let e = check_part_env(&env(&[(k, v)])).unwrap_err().to_string();
            assert!(e.contains("part_env"), "{k}: {e}");
        }
        let long = "x".repeat(PART_ENV_VALUE_MAX + 1);
        assert!(check_part_env(&env(&[("UCX_TLS", &long)])).is_err());
        let many: std::collections::HashMap<String, String> = (0..=PART_ENV_MAX)
            .map(|i| (format!("V{i}"), String::new()))
            .collect();
        assert!(check_part_env(&many).is_err());
    }

    #[test]
    fn an_agents_part_state_is_the_jobs_end_or_nothing() {
        let exited = |end: Option<pb::JobEnd>| ended(pb::PartState::Exited, end.as_ref());
        assert_eq!(
            exited(Some(pb::JobEnd::exited(3))),
            Some(JobState::Exited {
                code: Some(3),
                signal: None
            })
        );
        assert_eq!(
            exited(Some(pb::JobEnd::killed(9))),
            Some(JobState::Exited {
                code: None,
                signal: Some(9)
            })
        );
        assert_eq!(
            exited(None),
            Some(JobState::Exited {
                code: None,
                signal: None
            }),
            "an exit whose status is not known"
        );
        assert_eq!(ended(pb::PartState::Absent, None), Some(JobState::Lost));
        for alive in [
            pb::PartState::Running,
            pb::PartState::Frozen,
            pb::PartState::Unspecified,
        ] {
            assert_eq!(
                ended(alive, Some(&pb::JobEnd::exited(0))),
                None,
                "{alive:?}"
            );
        }
        // A report from a newer agent with a state this coordinator does not know.
        let report = pb::JobReport {
            state: 42,
            end: Some(pb::JobEnd::exited(0)),
            ..Default::default()
        };
        assert_eq!(ended(report.state(), report.end.as_ref()), None);
    }
}
