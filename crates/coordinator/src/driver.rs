//! The phase driver: runs one checkpoint epoch of a job as a sequence of barriers over every
//! node hosting it, and restarts jobs from committed epochs.
//!
//! Each phase calls every node in parallel with the phase's deadline and waits for all answers.
//! The first failure (an error, an unreachable agent, a missed deadline) aborts the epoch: every
//! node thaws what it froze and deletes the epoch's partial images, the epoch is recorded failed
//! with the phase and the reason, and the job keeps running from where it was. Nothing is
//! restorable until the commit is written to the registry, after every node sealed its images.
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use ckpt_proto::v1 as pb;
use futures_util::future::join_all;
use tokio::sync::{mpsc, Mutex};
use tracing::{info, instrument, warn};

use crate::agents::{call, Agents, FailureKind, NodeFailure};
use crate::config::CoordinatorConfig;
use crate::model::{Epoch, FlushState, Job, JobState, Phase, TransitionError};
use crate::registry::{Registry, RegistryError};

/// Why a request to the coordinator failed.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    /// No such job.
    #[error("job {job} not found (see `ckptctl list`)")]
    UnknownJob {
        /// Job id.
        job: u64,
    },
    /// The caller does not own the job.
    #[error("job {job} belongs to uid {owner}; only its owner or root may act on it")]
    NotOwner {
        /// Job id.
        job: u64,
        /// Owner.
        owner: u32,
    },
    /// Wrong state for the request.
    #[error(transparent)]
    State(#[from] TransitionError),
    /// The job has no committed epoch.
    #[error("job {job} has no committed checkpoint to restart from (see `ckptctl epochs {job}`)")]
    NoCommittedEpoch {
        /// Job id.
        job: u64,
    },
    /// The requested epoch cannot be restored.
    #[error(
        "job {job} epoch {epoch} is {state} and cannot be restored (see `ckptctl epochs {job}`)"
    )]
    EpochNotRestorable {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// Its state.
        state: String,
    },
    /// Bad request.
    #[error("{0}")]
    Invalid(String),
    /// The caller may not do this (wrong job secret).
    #[error("{0}")]
    Denied(String),
    /// Not now: try again shortly (a checkpoint or restart of the job is in progress).
    #[error("{0}")]
    Busy(String),
    /// No agent to run the job.
    #[error("no agent is registered; start ckpt-agent on a node (or run ckptd --standalone)")]
    NoAgents,
    /// An epoch failed and was aborted.
    #[error("job {job} epoch {epoch} failed in phase {phase}: {failure}; the epoch was aborted, the job keeps running, earlier checkpoints are still restorable")]
    EpochFailed {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// Phase name.
        phase: &'static str,
        /// What failed.
        failure: NodeFailure,
    },
    /// A restart failed.
    #[error("restart of job {job} from epoch {epoch} failed: {failure}")]
    RestartFailed {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// What failed.
        failure: NodeFailure,
    },
    /// A call to an agent failed outside an epoch.
    #[error(transparent)]
    Node(#[from] NodeFailure),
    /// The registry failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// One progress message of a long operation.
#[derive(Debug, Clone)]
pub struct Step {
    /// Job.
    pub job: u64,
    /// Epoch (0 before one is chosen).
    pub epoch: u32,
    /// Phase name.
    pub phase: &'static str,
    /// What happened.
    pub message: String,
}

/// Who is asking: the peer credentials of the ckptctl connection.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Process id, for logs (groups are not taken from it: the agent derives a job's groups
    /// from its uid).
    pub pid: Option<i32>,
}

impl Caller {
    fn may_act_on(&self, job: &Job) -> Result<(), DriveError> {
        if self.uid == 0 || self.uid == job.owner_uid {
            Ok(())
        } else {
            Err(DriveError::NotOwner {
                job: job.id,
                owner: job.owner_uid,
            })
        }
    }
}

/// What a run needs.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// Job name.
    pub name: String,
    /// Command.
    pub argv: Vec<String>,
    /// Working directory.
    pub cwd: String,
    /// Environment.
    pub env: std::collections::HashMap<String, String>,
    /// Node for the launcher (empty: the first registered).
    pub node: String,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The coordinator: registry, agents, configuration.
#[derive(Debug)]
pub struct Coordinator {
    /// Persistent jobs and epochs.
    pub registry: Registry,
    /// Registered agents.
    pub agents: Agents,
    pub(crate) cfg: CoordinatorConfig,
    /// Serializes read-modify-write of job records (short critical sections only).
    pub(crate) state: Mutex<()>,
    /// Flushes to shared storage: progress, ordering, and those waiting for their nodes.
    pub(crate) flushes: crate::flush::Flushes,
    /// Epochs to abort on a node when its agent registers: found in progress at start-up, or
    /// whose abort could not reach the node.
    orphaned: std::sync::Mutex<Vec<(String, u64, u32)>>,
    /// The coordinator's cluster credential: agents are called over TLS with it. None for a
    /// standalone ckptd without one, which reaches only its embedded agent (local socket).
    credential: Option<ckpt_auth::tls::Credential>,
}

impl Coordinator {
    /// A coordinator over an opened registry. Epochs left in progress by an earlier ckptd are
    /// marked failed, and their nodes are told to abort them when they register.
    pub fn new(
        registry: Registry,
        cfg: CoordinatorConfig,
        credential: Option<ckpt_auth::tls::Credential>,
    ) -> Result<Arc<Self>, DriveError> {
        let mut orphaned = Vec::new();
        let flushes = crate::flush::Flushes::default();
        for mut job in registry.jobs()? {
            let mut changed = false;
            for mut e in registry.epochs(job.id)? {
                if e.is_restorable() && e.flush == FlushState::Flushing {
                    // Interrupted: copied again from the start once every node is back.
                    flushes.wait_for_nodes(job.id, e.number);
                }
                if e.phase().is_some() {
                    warn!(
                        job = job.id,
                        epoch = e.number,
                        "epoch interrupted by a coordinator restart"
                    );
                    e.fail("the coordinator restarted during the epoch", now_ms())?;
                    registry.put_epoch(&e)?;
                    for n in &e.nodes {
                        orphaned.push((n.clone(), job.id, e.number));
                    }
                }
            }
            match job.state {
                JobState::Checkpointing => {
                    job.state = JobState::Running;
                    changed = true;
                }
                // Interrupted by this coordinator's restart: what became of the processes is
                // unknown until an agent reports.
                JobState::Restarting | JobState::Starting => {
                    job.state = JobState::Lost;
                    changed = true;
                }
                _ => {}
            }
            if changed {
                registry.put_job(&job)?;
            }
        }
        Ok(Arc::new(Coordinator {
            registry,
            agents: Agents::default(),
            cfg,
            state: Mutex::new(()),
            orphaned: std::sync::Mutex::new(orphaned),
            credential,
            flushes,
        }))
    }

    /// Registers an agent, and aborts on it any epoch a coordinator restart interrupted.
    pub async fn register_agent(
        self: &Arc<Self>,
        node: &str,
        address: &str,
        host_addresses: Vec<String>,
        shared_dir: String,
    ) -> Result<(), String> {
        let dial = match (&self.credential, address.starts_with("unix:")) {
            (_, true) | (None, false) => ckpt_auth::transport::Dial::LocalOnly,
            (Some(c), false) => ckpt_auth::transport::Dial::Tls(
                c.client_config(ckpt_auth::Identity::Node(node.to_string()))
                    .map_err(|e| e.to_string())?,
            ),
        };
        self.agents
            .register(node, address, host_addresses, shared_dir, dial)?;
        info!(node, address, "agent registered");
        self.resume_waiting_flushes();
        let pending: Vec<(String, u64, u32)> = {
            let mut o = self.orphaned.lock().expect("orphaned lock");
            let (mine, rest) = o.drain(..).partition(|(n, _, _)| n == node);
            *o = rest;
            mine
        };
        for (_, job, epoch) in pending {
            if let Ok(mut c) = self.agents.client(node) {
                let req = pb::AbortRequest {
                    job_id: job,
                    epoch,
                    reason: "coordinator restarted during the epoch".into(),
                };
                let _ = call(node, "abort", self.cfg.deadlines.abort, c.abort(req)).await;
            }
        }
        Ok(())
    }

    /// Applies an agent's report about its jobs.
    pub async fn heartbeat(&self, node: &str, reports: Vec<pb::JobReport>) -> bool {
        if !self.agents.seen(node) {
            return false;
        }
        for r in reports {
            let observed = match r.state.as_str() {
                "exited" => JobState::Exited {
                    code: r.exit_code,
                    signal: r.exit_signal,
                },
                "absent" => JobState::Lost,
                _ => continue,
            };
            let _g = self.state.lock().await;
            if let Ok(Some(mut job)) = self.registry.job(r.job_id) {
                if job.node == node && job.observe(r.incarnation, observed) {
                    info!(job = job.id, state = %job.state.name(), "job ended");
                    let _ = self.registry.put_job(&job);
                }
            }
        }
        true
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
    /// has not reported yet. Errors reaching the agent leave the record as it is.
    pub async fn refresh(&self, id: u64) -> Result<Job, DriveError> {
        let job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        if job.state != JobState::Running && job.state != JobState::Lost {
            return Ok(job);
        }
        let Ok(mut c) = self.agents.client(&job.node) else {
            return Ok(job);
        };
        let info = match call(
            &job.node,
            "inspect",
            self.cfg.deadlines.sync,
            c.inspect(pb::InspectRequest { job_id: id }),
        )
        .await
        {
            Ok(i) => i,
            Err(_) => return Ok(job),
        };
        let observed = if let Some(rest) = info.state.strip_prefix("exited with code ") {
            JobState::Exited {
                code: rest.parse().ok(),
                signal: None,
            }
        } else if let Some(rest) = info.state.strip_prefix("killed by signal ") {
            JobState::Exited {
                code: None,
                signal: rest.parse().ok(),
            }
        } else if info.state == "absent" {
            JobState::Lost
        } else {
            return Ok(job);
        };
        let _g = self.state.lock().await;
        let mut job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        let inc = job.incarnation;
        if job.observe(inc, observed) {
            self.registry.put_job(&job)?;
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
        let node = if spec.node.is_empty() {
            self.agents
                .list()
                .into_iter()
                .next()
                .map(|(n, _, _)| n)
                .ok_or(DriveError::NoAgents)?
        } else {
            spec.node.clone()
        };
        let mut client = self.agents.client(&node)?;
        let (id, name, token) = {
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
            let job = Job {
                id,
                name: name.clone(),
                owner_uid: caller.uid,
                owner_gid: caller.gid,
                argv: spec.argv.clone(),
                cwd: spec.cwd.clone(),
                node: node.clone(),
                state: JobState::Starting,
                incarnation: 0,
                last_epoch: 0,
                latest_committed: 0,
                created_unix_ms: now_ms(),
                job_dir: String::new(),
                parts: vec![],
                token: new_token(),
            };
            self.registry.put_job(&job)?;
            (id, name, job.token)
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
        };
        let reply = match call(&node, "launch", self.cfg.deadlines.sync, client.launch(req)).await {
            Ok(r) => r,
            Err(failure) => {
                // Keep the record, so the id is never reused and `ckptctl list` says why.
                let reason = failure.message.clone();
                self.update_job(id, |j| {
                    j.state = JobState::FailedToStart { reason };
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
        job.state = JobState::Running;
        job.incarnation = reply.incarnation;
        job.job_dir = reply.job_dir;
        self.registry.put_job(&job)?;
        info!(job = id, name, node, pid = reply.pid, "job started");
        Ok(job)
    }

    async fn update_job(
        &self,
        id: u64,
        f: impl FnOnce(&mut Job) -> Result<(), TransitionError>,
    ) -> Result<Job, DriveError> {
        let _g = self.state.lock().await;
        let mut job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        f(&mut job)?;
        self.registry.put_job(&job)?;
        Ok(job)
    }

    /// Validates a checkpoint request and starts the epoch; returns the job and the epoch.
    pub async fn begin_checkpoint(
        &self,
        caller: &Caller,
        id: u64,
        kill: bool,
    ) -> Result<(Job, Epoch), DriveError> {
        self.job_for(caller, id)?;
        self.refresh(id).await?;
        let _g = self.state.lock().await;
        let mut job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        let number = match job.begin_checkpoint() {
            Ok(n) => n,
            Err(e) if matches!(job.state, JobState::Exited { .. } | JobState::Stopped | JobState::Cancelled | JobState::Lost) => {
                return Err(DriveError::State(TransitionError {
                    action: format!("checkpoint it: it has no running processes (restart it with `ckptctl restart {id}`)"),
                    ..e
                }))
            }
            Err(e) => return Err(e.into()),
        };
        let epoch = Epoch::begin(id, number, kill, job.nodes(), now_ms());
        self.registry.put_job_and_epoch(&job, &epoch)?;
        Ok((job, epoch))
    }

    /// Runs every phase of an epoch begun by [`Coordinator::begin_checkpoint`].
    #[instrument(skip_all, fields(job = job.id, epoch = epoch.number))]
    pub async fn drive_checkpoint(
        self: &Arc<Self>,
        job: Job,
        mut epoch: Epoch,
        progress: mpsc::UnboundedSender<Step>,
    ) -> Result<Epoch, DriveError> {
        let begin = Instant::now();
        let (id, number) = (job.id, epoch.number);
        let say = |phase: Phase, message: String| {
            let _ = progress.send(Step {
                job: id,
                epoch: number,
                phase: phase.name(),
                message,
            });
        };
        let nodes = epoch.nodes.clone();
        let d = self.cfg.deadlines.clone();
        let phase_req = || pb::PhaseRequest {
            job_id: id,
            epoch: number,
        };
        // ib-quiesce channels in the job: once any may be down, they must be rebuilt, also
        // when the epoch fails.
        let channels = std::sync::atomic::AtomicU32::new(0);
        let result: Result<BTreeMap<String, String>, (Phase, NodeFailure)> = async {
            say(Phase::Sync, format!("checking {} node(s)", nodes.len()));
            let prepared = self
                .on_all(&nodes, "initial synchronization", d.sync, |mut c| {
                    let r = phase_req();
                    async move { c.prepare(r).await }
                })
                .await
                .map_err(|f| (Phase::Sync, f))?;
            let est: u64 = prepared.iter().map(|(_, p)| p.estimated_bytes).sum();
            channels.store(
                prepared.iter().map(|(_, p)| p.channels).sum(),
                std::sync::atomic::Ordering::Relaxed,
            );
            self.advance(&mut epoch, Phase::Quiesce).await;
            say(
                Phase::Quiesce,
                format!(
                    "freezing {} processes (~{} MB resident)",
                    prepared.iter().map(|(_, p)| p.processes).sum::<u32>(),
                    est >> 20
                ),
            );
            self.on_all(&nodes, "quiesce", d.quiesce, |mut c| {
                let r = phase_req();
                async move { c.quiesce(r).await }
            })
            .await
            .map_err(|f| (Phase::Quiesce, f))?;
            self.advance(&mut epoch, Phase::Dump).await;
            say(Phase::Dump, "all nodes frozen; dumping".into());
            self.on_all(&nodes, "local checkpoint", d.dump, |mut c| {
                let r = phase_req();
                async move { c.dump(r).await }
            })
            .await
            .map_err(|f| (Phase::Dump, f))?;
            self.advance(&mut epoch, Phase::Resume).await;
            say(
                Phase::Resume,
                if epoch.kill {
                    "stopping the job".into()
                } else {
                    "resuming the job".into()
                },
            );
            let kill = epoch.kill;
            let resumed = self
                .on_all(&nodes, "resume", d.resume, |mut c| async move {
                    c.resume(pb::ResumeRequest {
                        job_id: id,
                        epoch: number,
                        kill,
                    })
                    .await
                })
                .await
                .map_err(|f| (Phase::Resume, f))?;
            if !kill && channels.load(std::sync::atomic::Ordering::Relaxed) > 0 {
                let r = self
                    .rebuild_channels(&nodes, id, number)
                    .await
                    .map_err(|f| (Phase::Resume, f))?;
                say(
                    Phase::Resume,
                    r.say(channels.load(std::sync::atomic::Ordering::Relaxed)),
                );
            }
            // The job's frozen time: from the first freeze to the last thaw, per node; the
            // longest node is what the job felt.
            epoch.frozen_ms = resumed
                .iter()
                .map(|(_, r)| r.frozen_us / 1000)
                .max()
                .unwrap_or(0);
            self.advance(&mut epoch, Phase::Finalize).await;
            say(
                Phase::Finalize,
                format!(
                    "job {} after {} ms frozen; sealing images",
                    if kill { "stopped" } else { "resumed" },
                    epoch.frozen_ms
                ),
            );
            let sealed = self
                .on_all(&nodes, "finalize", d.finalize, |mut c| {
                    let r = phase_req();
                    async move { c.finalize(r).await }
                })
                .await
                .map_err(|f| (Phase::Finalize, f))?;
            epoch.image_bytes = sealed.iter().map(|(_, f)| f.image_bytes).sum();
            epoch.image_files = sealed.iter().map(|(_, f)| f.image_files).sum();
            self.advance(&mut epoch, Phase::Commit).await;
            Ok(sealed
                .into_iter()
                .map(|(n, f)| (n, f.manifest_digest))
                .collect())
        }
        .await;
        match result {
            Ok(manifests) => {
                epoch.commit(manifests, now_ms())?;
                let flush = self.plans_flush(&epoch);
                if flush {
                    epoch.flush = FlushState::Flushing;
                }
                let _g = self.state.lock().await;
                let mut job = self
                    .registry
                    .job(id)?
                    .ok_or(DriveError::UnknownJob { job: id })?;
                job.end_checkpoint(Some(number), epoch.kill)?;
                self.registry.put_job_and_epoch(&job, &epoch)?;
                let pruned = self.apply_retention(id)?;
                self.prune_in_background(id, pruned);
                if flush || self.plans_partners(&epoch) {
                    self.flush_in_background(id, number);
                }
                say(
                    Phase::Commit,
                    format!(
                        "committed: frozen {} ms, total {} ms, {} bytes in {} files",
                        epoch.frozen_ms,
                        begin.elapsed().as_millis(),
                        epoch.image_bytes,
                        epoch.image_files
                    ),
                );
                info!(
                    frozen_ms = epoch.frozen_ms,
                    bytes = epoch.image_bytes,
                    "epoch committed"
                );
                Ok(epoch)
            }
            Err((phase, failure)) => {
                warn!(phase = phase.name(), error = %failure, "epoch failed; aborting");
                say(phase, format!("failed: {failure}; aborting"));
                let reason = failure.to_string();
                // A node that did not answer in time is not waited for again: it is told to
                // abort in the background (and again when its agent re-registers), so the
                // caller learns of the failure within the phase deadline.
                let slow = matches!(
                    failure.kind,
                    FailureKind::Unreachable | FailureKind::Deadline
                );
                let (later, now): (Vec<String>, Vec<String>) = nodes
                    .iter()
                    .cloned()
                    .partition(|n| slow && *n == failure.node);
                if !later.is_empty() {
                    let me = self.clone();
                    let why = reason.clone();
                    tokio::spawn(async move {
                        me.abort_all(&later, id, number, &why).await;
                    });
                }
                let abort_errors = self.abort_all(&now, id, number, &reason).await;
                let mut reason = reason;
                for e in abort_errors {
                    reason.push_str(&format!("; abort on {e}"));
                }
                // Channels quiesced before the failure wait for new endpoints; the job cannot
                // talk until they have them.
                let killed = epoch.kill && phase > Phase::Resume;
                if channels.load(std::sync::atomic::Ordering::Relaxed) > 0
                    && phase >= Phase::Quiesce
                    && !killed
                {
                    match self.rebuild_channels(&now, id, number).await {
                        Ok(r) => info!(
                            qps = r.qps,
                            relayed = r.relayed,
                            ms = r.took.as_millis() as u64,
                            "ib-quiesce channels rebuilt after the abort; the job runs on"
                        ),
                        Err(e) => {
                            warn!(error = %e, "ib-quiesce channels not rebuilt after the abort");
                            reason.push_str(&format!("; channel rebuild on {e}"));
                        }
                    }
                }
                epoch.fail(reason, now_ms())?;
                let _g = self.state.lock().await;
                let mut job = self
                    .registry
                    .job(id)?
                    .ok_or(DriveError::UnknownJob { job: id })?;
                // A kill that happened before the failure leaves the job stopped.
                job.end_checkpoint(None, killed)?;
                self.registry.put_job_and_epoch(&job, &epoch)?;
                Err(DriveError::EpochFailed {
                    job: id,
                    epoch: number,
                    phase: phase.name(),
                    failure,
                })
            }
        }
    }

    /// Post-checkpoint coordination for InfiniBand: every node's down channels recreate their
    /// objects and report new endpoints and the peer QPs they need; each node then gets the
    /// endpoints it asked for and reconnects. Returns the number of QPs and the time taken.
    async fn rebuild_channels(
        &self,
        nodes: &[String],
        id: u64,
        number: u32,
    ) -> Result<ChannelsRebuilt, NodeFailure> {
        let begin = Instant::now();
        let d = self.cfg.deadlines.resume;
        let rebuilt = self
            .on_all(nodes, "rebuild", d, |mut c| async move {
                c.rebuild(pb::PhaseRequest {
                    job_id: id,
                    epoch: number,
                })
                .await
            })
            .await?;
        let for_node = route_endpoints(&rebuilt)?;
        let qps = rebuilt.iter().map(|(_, r)| r.endpoints.len()).sum();
        let relayed = for_node.values().map(Vec::len).sum();
        let for_node = &for_node;
        self.on_each(nodes, "reconnect", d, |node, mut c| async move {
            let endpoints = for_node.get(node).cloned().unwrap_or_default();
            c.reconnect(pb::ReconnectRequest {
                job_id: id,
                epoch: number,
                endpoints,
            })
            .await
        })
        .await?;
        Ok(ChannelsRebuilt {
            qps,
            relayed,
            took: begin.elapsed(),
        })
    }

    async fn advance(&self, epoch: &mut Epoch, next: Phase) {
        if let Err(e) = epoch.enter(next) {
            // Phases are entered in code order; a refusal here is a bug, not a user error.
            panic!("phase driver out of order: {e}");
        }
        if let Err(e) = self.registry.put_epoch(epoch) {
            warn!(error = %e, "cannot persist epoch progress");
        }
    }

    /// Calls every node in parallel; all must succeed. Returns (node, reply) pairs.
    async fn on_all<T, F, Fut>(
        &self,
        nodes: &[String],
        what: &str,
        deadline: std::time::Duration,
        f: F,
    ) -> Result<Vec<(String, T)>, NodeFailure>
    where
        F: Fn(ckpt_proto::v1::agent_client::AgentClient<tonic::transport::Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.on_each(nodes, what, deadline, |_, c| f(c)).await
    }

    /// [`Self::on_all`] with a request that depends on the node.
    async fn on_each<'n, T, F, Fut>(
        &self,
        nodes: &'n [String],
        what: &str,
        deadline: std::time::Duration,
        f: F,
    ) -> Result<Vec<(String, T)>, NodeFailure>
    where
        F: Fn(&'n str, ckpt_proto::v1::agent_client::AgentClient<tonic::transport::Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut calls = Vec::new();
        for n in nodes {
            let client = self.agents.client(n)?;
            let fut = f(n, client);
            calls.push(async move { (n.clone(), call(n, what, deadline, fut).await) });
        }
        let mut out = Vec::new();
        let mut first_err = None;
        for (n, r) in join_all(calls).await {
            match r {
                Ok(v) => out.push((n, v)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    async fn abort_all(
        &self,
        nodes: &[String],
        job: u64,
        epoch: u32,
        reason: &str,
    ) -> Vec<NodeFailure> {
        let d = self.cfg.deadlines.abort;
        let r = self
            .on_all_collect(nodes, "abort", d, |mut c| {
                let req = pb::AbortRequest {
                    job_id: job,
                    epoch,
                    reason: reason.to_string(),
                };
                async move { c.abort(req).await }
            })
            .await;
        let failed: Vec<NodeFailure> = r.into_iter().filter_map(|(_, r)| r.err()).collect();
        // A node that could not be told now is told when its agent registers again.
        let mut o = self.orphaned.lock().expect("orphaned lock");
        for f in &failed {
            o.push((f.node.clone(), job, epoch));
        }
        failed
    }

    async fn on_all_collect<T, F, Fut>(
        &self,
        nodes: &[String],
        what: &str,
        deadline: std::time::Duration,
        f: F,
    ) -> Vec<(String, Result<T, NodeFailure>)>
    where
        F: Fn(ckpt_proto::v1::agent_client::AgentClient<tonic::transport::Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let f = &f;
        let calls = nodes
            .iter()
            .map(|n| async move { (n.clone(), self.agents.call(n, what, deadline, f).await) });
        join_all(calls).await
    }

    /// A committed epoch of the job: `epoch`, or the latest committed one for 0.
    fn restorable_epoch(&self, job: &Job, epoch: u32) -> Result<Epoch, DriveError> {
        let id = job.id;
        let number = if epoch == 0 {
            job.latest_committed
        } else {
            epoch
        };
        if number == 0 {
            return Err(DriveError::NoCommittedEpoch { job: id });
        }
        let e = self.registry.epoch(id, number)?.ok_or_else(|| {
            DriveError::Invalid(format!(
                "job {id} has no epoch {number} (see `ckptctl epochs {id}`)"
            ))
        })?;
        if !e.is_restorable() {
            return Err(DriveError::EpochNotRestorable {
                job: id,
                epoch: number,
                state: e.state_name(),
            });
        }
        Ok(e)
    }

    /// Checks a committed epoch's images on every node against their digests, in parallel.
    /// Reads only; a node that cannot be reached is reported as not verified.
    pub async fn verify(
        &self,
        caller: &Caller,
        id: u64,
        epoch: u32,
    ) -> Result<pb::VerifyReply, DriveError> {
        let job = self.job_for(caller, id)?;
        let e = self.restorable_epoch(&job, epoch)?;
        let d = self.cfg.deadlines.restore;
        let calls = e.nodes.iter().map(|n| {
            let req = pb::RestoreRequest {
                job_id: id,
                epoch: e.number,
                manifest_digest: e.manifests.get(n).cloned().unwrap_or_default(),
                shared_durable: e.is_durable(),
                local_pruned: !e.local_copy,
                ..Default::default()
            };
            async move {
                let r = self
                    .agents
                    .call(n, "verify", d, |mut c| async move { c.verify(req).await })
                    .await;
                r.unwrap_or_else(|f| pb::NodeVerify {
                    node: n.clone(),
                    ok: false,
                    error: f.message,
                    ..Default::default()
                })
            }
        });
        Ok(pb::VerifyReply {
            job_id: id,
            epoch: e.number,
            nodes: join_all(calls).await,
        })
    }

    /// Validates a restart request; returns the job, the epoch to restore and the state to go
    /// back to if the restart fails.
    pub async fn begin_restart(
        &self,
        caller: &Caller,
        id: u64,
        epoch: u32,
    ) -> Result<(Job, Epoch, JobState), DriveError> {
        self.job_for(caller, id)?;
        let job = self.refresh(id).await?;
        let e = self.restorable_epoch(&job, epoch)?;
        let mut previous = job.state.clone();
        let job = self
            .update_job(id, |j| {
                previous = j.state.clone();
                j.begin_restart()
            })
            .await?;
        Ok((job, e, previous))
    }

    /// Restores every node of an epoch begun by [`Coordinator::begin_restart`]. With
    /// `fallback` (the caller asked for the latest checkpoint), an epoch whose images are
    /// unusable on some node is skipped for the next older restorable one, each step reported.
    /// Returns the job and the epoch it runs from.
    #[instrument(skip_all, fields(job = job.id, epoch = epoch.number))]
    pub async fn drive_restart(
        &self,
        job: Job,
        epoch: Epoch,
        previous: JobState,
        fallback: bool,
        progress: mpsc::UnboundedSender<Step>,
    ) -> Result<(Job, Epoch), DriveError> {
        let id = job.id;
        let mut epoch = epoch;
        let mut skipped: Vec<String> = Vec::new();
        loop {
            let number = epoch.number;
            match self.restore_epoch(&job, &epoch, &progress).await {
                Ok(incarnation) => {
                    let job = self
                        .update_job(id, |j| j.end_restart(Ok(incarnation)))
                        .await?;
                    if !epoch.local_copy {
                        // Every node fetched its images back into local staging: record it,
                        // so that retention deletes them again in time.
                        let _g = self.state.lock().await;
                        if let Some(mut e) = self.registry.epoch(id, number)? {
                            e.local_copy = true;
                            self.registry.put_epoch(&e)?;
                        }
                    }
                    let _ = progress.send(Step {
                        job: id,
                        epoch: number,
                        phase: "restore",
                        message: "running again".into(),
                    });
                    return Ok((job, epoch));
                }
                Err(f) => {
                    let older = if fallback && f.kind == FailureKind::DataLoss {
                        self.registry
                            .epochs(id)?
                            .into_iter()
                            .filter(|e| e.is_restorable() && e.number < number)
                            .max_by_key(|e| e.number)
                    } else {
                        None
                    };
                    let Some(older) = older else {
                        self.update_job(id, |j| j.end_restart(Err(previous)))
                            .await?;
                        let mut failure = f;
                        for s in skipped.iter().rev() {
                            failure.message = format!("{}; before that, {s}", failure.message);
                        }
                        return Err(DriveError::RestartFailed {
                            job: id,
                            epoch: number,
                            failure,
                        });
                    };
                    warn!(job = id, epoch = number, error = %f, older = older.number, "epoch unusable; falling back");
                    let _ = progress.send(Step {
                        job: id,
                        epoch: number,
                        phase: "restore",
                        message: format!(
                            "epoch {number} cannot be restored ({f}); trying epoch {}",
                            older.number
                        ),
                    });
                    skipped.push(format!("epoch {number}: {f}"));
                    epoch = older;
                }
            }
        }
    }

    /// Restores every node of one epoch, held, then releases them together; on any failure
    /// the parts already restored are killed. Returns the launcher node's incarnation.
    async fn restore_epoch(
        &self,
        job: &Job,
        epoch: &Epoch,
        progress: &mpsc::UnboundedSender<Step>,
    ) -> Result<u32, NodeFailure> {
        let (id, number) = (job.id, epoch.number);
        let _ = progress.send(Step {
            job: id,
            epoch: number,
            phase: "restore",
            message: format!(
                "verifying and restoring {} node(s) from epoch {number}",
                epoch.nodes.len()
            ),
        });
        // Every node restores its part frozen, with the part's TCP ports blocked; only when all
        // are restored are they released together. A node released early would exchange
        // packets with peers that do not exist yet and get its connections reset.
        let d = self.cfg.deadlines.restore;
        let calls = epoch.nodes.iter().map(|n| {
            let partner = epoch
                .local_copy
                .then(|| epoch.partners.get(n).cloned())
                .flatten()
                .unwrap_or_default();
            let req = pb::RestoreRequest {
                job_id: id,
                epoch: number,
                manifest_digest: epoch.manifests.get(n).cloned().unwrap_or_default(),
                hold: true,
                token: job.token.clone(),
                shared_durable: epoch.is_durable(),
                partner_address: self.agents.address(&partner).unwrap_or_default(),
                partner,
                local_pruned: !epoch.local_copy,
            };
            async move {
                let r = self
                    .agents
                    .call(n, "restore", d, |mut c| async move { c.restore(req).await })
                    .await;
                if let Ok(reply) = &r {
                    let message = if reply.source == "local" || reply.source.is_empty() {
                        format!("node {n} restored (held)")
                    } else {
                        format!(
                            "node {n} restored (held) from its {} copy; {}",
                            reply.source, reply.note
                        )
                    };
                    let _ = progress.send(Step {
                        job: id,
                        epoch: number,
                        phase: "restore",
                        message,
                    });
                }
                (n.clone(), r)
            }
        });
        let results = join_all(calls).await;
        let mut incarnation = 0;
        let mut failure = None;
        let mut restored = Vec::new();
        let mut channels = 0;
        for (n, r) in results {
            match r {
                Ok(reply) => {
                    if n == job.node {
                        incarnation = reply.incarnation;
                    }
                    channels += reply.channels;
                    restored.push(n);
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        let kill = failure.is_some();
        let released = self
            .on_all_collect(&restored, "release", self.cfg.deadlines.resume, |mut c| {
                let req = pb::ReleaseRequest { job_id: id, kill };
                async move { c.release(req).await }
            })
            .await;
        for (_, r) in released {
            if let Err(e) = r {
                failure.get_or_insert(e);
            }
        }
        if failure.is_some() && !kill {
            // Released elsewhere but not everywhere: the job cannot run incomplete.
            let _ = self
                .on_all_collect(&restored, "release", self.cfg.deadlines.resume, |mut c| {
                    let req = pb::ReleaseRequest {
                        job_id: id,
                        kill: true,
                    };
                    async move { c.release(req).await }
                })
                .await;
        }
        if let Some(f) = failure {
            return Err(f);
        }
        if channels > 0 {
            let r = self.rebuild_channels(&restored, id, number).await?;
            let _ = progress.send(Step {
                job: id,
                epoch: number,
                phase: "restore",
                message: r.say(channels),
            });
        }
        Ok(incarnation)
    }

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

    fn check_token(job: &Job, token: &str) -> Result<(), DriveError> {
        if !ckpt_auth::token_eq(&job.token, token) {
            return Err(DriveError::Denied(format!(
                "wrong secret for job {}: ckpt-rsh must run inside the job (CKPT_JOB_TOKEN)",
                job.id
            )));
        }
        Ok(())
    }

    /// Starts a part of a running job on another node, for `ckpt-rsh`: the command runs there
    /// through `/bin/sh -c` as the job's owner, in the job's cgroup, with the environment sshd
    /// would give it. Returns the node and its agent's address.
    #[instrument(skip_all, fields(job = req.job_id, host = %req.host))]
    pub async fn attach(&self, req: pb::AttachRequest) -> Result<pb::AttachReply, DriveError> {
        let id = req.job_id;
        // The token first: a caller without it learns nothing of the cluster's nodes.
        let job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        Self::check_token(&job, &req.token)?;
        let node = self.resolve_host(&req.host).await?;
        let (job, part) = {
            let _g = self.state.lock().await;
            let mut job = self
                .registry
                .job(id)?
                .ok_or(DriveError::UnknownJob { job: id })?;
            Self::check_token(&job, &req.token)?;
            // The launcher may call here before the launch reply is in (`Starting`).
            match job.state {
                JobState::Running | JobState::Starting => {}
                JobState::Checkpointing | JobState::Restarting => {
                    return Err(DriveError::Busy(format!(
                        "job {id} is {}; try again when it is done",
                        job.state.name()
                    )))
                }
                _ => {
                    return Err(DriveError::Invalid(format!(
                        "job {id} is {}: no new processes can join it",
                        job.state.name()
                    )))
                }
            }
            if node == job.node {
                return Err(DriveError::Invalid(format!(
                    "node {node} runs job {id}'s launcher, which starts its processes there itself; name each host once in mpiexec's host list"
                )));
            }
            if job.parts.contains(&node) {
                return Err(DriveError::Invalid(format!(
                    "job {id} already has processes on node {node}; name each host once in mpiexec's host list"
                )));
            }
            job.parts.push(node.clone());
            self.registry.put_job(&job)?;
            let part = job.parts.len() as u32;
            (job, part)
        };
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
        };
        let r = self
            .agents
            .call(
                &node,
                "launch",
                self.cfg.deadlines.sync,
                |mut c| async move { c.launch(launch).await },
            )
            .await;
        match r {
            Ok(reply) => {
                info!(node, pid = reply.pid, part, "job part started");
                Ok(pb::AttachReply {
                    agent: self.agents.address(&node).unwrap_or_default(),
                    node,
                    pid: reply.pid,
                    incarnation: reply.incarnation,
                })
            }
            Err(failure) => {
                let _ = self
                    .update_job(id, |j| {
                        j.parts.retain(|p| *p != node);
                        Ok(())
                    })
                    .await;
                Err(failure.into())
            }
        }
    }

    /// The current address of a node's agent, for `ckpt-rsh` of a job with a part there.
    pub async fn locate(&self, req: pb::LocateRequest) -> Result<pb::LocateReply, DriveError> {
        let job = self
            .registry
            .job(req.job_id)?
            .ok_or(DriveError::UnknownJob { job: req.job_id })?;
        Self::check_token(&job, &req.token)?;
        let agent = self.agents.address(&req.node).ok_or_else(|| {
            DriveError::Invalid(format!("node {} has no registered agent", req.node))
        })?;
        Ok(pb::LocateReply { agent })
    }

    /// Kills a running job (SIGTERM, then SIGKILL). Its epochs stay restorable.
    pub async fn cancel(&self, caller: &Caller, id: u64) -> Result<Job, DriveError> {
        self.job_for(caller, id)?;
        let job = self.refresh(id).await?;
        if job.state != JobState::Running {
            // Refused by the guard, with the job's state in the message.
            job.clone().cancel()?;
        }
        let node = job.node.clone();
        let client = self.agents.client(&node)?;
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
        let _ = self
            .on_all_collect(&job.parts, "cancel", d.resume, |mut c| {
                let req = pb::SignalRequest {
                    job_id: id,
                    signal: libc::SIGKILL,
                    ..Default::default()
                };
                async move { c.signal(req).await }
            })
            .await;
        // The job was running when the cancel began; an end seen since (its exit on SIGTERM,
        // reported by a heartbeat) is the cancel's doing.
        self.update_job(id, |j| {
            if j.state == JobState::Running || matches!(j.state, JobState::Exited { .. }) {
                j.state = JobState::Cancelled;
            }
            Ok(())
        })
        .await
    }

    /// The job's processes per node, as the agents see them now (asked in parallel).
    pub async fn inspect(&self, job: &Job) -> Vec<pb::NodeJobInfo> {
        let id = job.id;
        self.on_all_collect(
            &job.nodes(),
            "inspect",
            self.cfg.deadlines.sync,
            |mut c| async move { c.inspect(pb::InspectRequest { job_id: id }).await },
        )
        .await
        .into_iter()
        .map(|(n, r)| {
            r.unwrap_or_else(|e| pb::NodeJobInfo {
                role: if n == job.node {
                    "launcher"
                } else {
                    "attached"
                }
                .into(),
                node: n,
                state: format!("unknown ({})", e.message),
                processes: vec![],
            })
        })
        .collect()
    }

    /// The kind of a failure, for mapping to status codes.
    pub fn failure_kind(e: &DriveError) -> Option<FailureKind> {
        match e {
            DriveError::EpochFailed { failure, .. }
            | DriveError::RestartFailed { failure, .. }
            | DriveError::Node(failure) => Some(failure.kind),
            _ => None,
        }
    }
}

/// PATH of commands started on other nodes, as sshd sets it.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

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

/// What the post-checkpoint InfiniBand coordination did.
struct ChannelsRebuilt {
    /// QPs rebuilt on all nodes.
    qps: usize,
    /// Endpoints sent to the nodes (each node gets those of its channels' peers).
    relayed: usize,
    took: std::time::Duration,
}

impl ChannelsRebuilt {
    /// The progress line of `channels` channels.
    fn say(&self, channels: u32) -> String {
        format!(
            "{channels} ib-quiesce channel(s) rebuilt and reconnected: {} QP(s), {} endpoint(s) \
             relayed, in {} ms",
            self.qps,
            self.relayed,
            self.took.as_millis()
        )
    }
}

/// After a rebuild: for each node, the endpoints its channels asked for (`wants`), from all
/// nodes' replies; every endpoint of the job to a node that could not say (`wants_all`). A QP
/// asked for that no node reported is a failure of the node that asked, named here rather
/// than by the channel that would not connect.
fn route_endpoints(
    rebuilt: &[(String, pb::RebuildReply)],
) -> Result<HashMap<String, Vec<Vec<u8>>>, NodeFailure> {
    let mut by_id: HashMap<(u64, u32), &Vec<u8>> = HashMap::new();
    for (node, r) in rebuilt {
        if r.ids.len() != r.endpoints.len() {
            return Err(NodeFailure {
                node: node.clone(),
                kind: FailureKind::Internal,
                message: format!(
                    "rebuild: {} endpoints but {} QP ids (is the agent older than ckptd?)",
                    r.endpoints.len(),
                    r.ids.len()
                ),
            });
        }
        for (id, e) in r.ids.iter().zip(&r.endpoints) {
            by_id.insert((id.channel, id.qpn), e);
        }
    }
    let mut out = HashMap::new();
    for (node, r) in rebuilt {
        let eps: Vec<Vec<u8>> = if r.wants_all {
            rebuilt
                .iter()
                .flat_map(|(_, r)| r.endpoints.iter().cloned())
                .collect()
        } else {
            r.wants
                .iter()
                .map(|w| {
                    by_id
                        .get(&(w.channel, w.qpn))
                        .map(|e| (*e).clone())
                        .ok_or_else(|| NodeFailure {
                            node: node.clone(),
                            kind: FailureKind::Refused,
                            message: format!(
                                "a channel there is connected to QP {:#x} of channel {:#x}, \
                                 which no node of the job rebuilt (did that process exit?)",
                                w.qpn, w.channel
                            ),
                        })
                })
                .collect::<Result<_, _>>()?
        };
        out.insert(node.clone(), eps);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(eps: &[(u64, u32)], wants: Option<&[(u64, u32)]>) -> pb::RebuildReply {
        let qp = |&(channel, qpn): &(u64, u32)| pb::QpRef { channel, qpn };
        pb::RebuildReply {
            endpoints: eps
                .iter()
                .map(|(c, q)| format!("{c}/{q}").into_bytes())
                .collect(),
            ids: eps.iter().map(qp).collect(),
            wants: wants.unwrap_or_default().iter().map(qp).collect(),
            wants_all: wants.is_none(),
            elapsed_us: 0,
        }
    }

    fn names(v: &[Vec<u8>]) -> Vec<String> {
        v.iter()
            .map(|b| String::from_utf8(b.clone()).unwrap())
            .collect()
    }

    #[test]
    fn each_node_gets_the_endpoints_its_channels_asked_for() {
        let rebuilt = vec![
            (
                "n1".to_string(),
                reply(&[(1, 10), (1, 11)], Some(&[(2, 10)])),
            ),
            (
                "n2".to_string(),
                reply(&[(2, 10)], Some(&[(1, 10), (1, 11)])),
            ),
            ("n3".to_string(), reply(&[], Some(&[]))),
            ("n4".to_string(), reply(&[], None)),
        ];
        let r = route_endpoints(&rebuilt).unwrap();
        assert_eq!(names(&r["n1"]), ["2/10"]);
        assert_eq!(names(&r["n2"]), ["1/10", "1/11"]);
        assert!(r["n3"].is_empty(), "no channels, nothing to send");
        assert_eq!(
            names(&r["n4"]),
            ["1/10", "1/11", "2/10"],
            "could not say: all"
        );
    }

    #[test]
    fn a_peer_nobody_rebuilt_or_an_endpoint_without_an_id_is_a_named_failure() {
        let rebuilt = vec![
            ("n1".to_string(), reply(&[(1, 10)], Some(&[(9, 0x710003)]))),
            ("n2".to_string(), reply(&[(2, 10)], Some(&[(1, 10)]))),
        ];
        let e = route_endpoints(&rebuilt).unwrap_err();
        assert_eq!(e.node, "n1");
        assert!(
            e.message.contains("QP 0x710003 of channel 0x9"),
            "{}",
            e.message
        );
        let mut bad = reply(&[(1, 10)], Some(&[]));
        bad.ids.clear();
        let e = route_endpoints(&[("n5".to_string(), bad)]).unwrap_err();
        assert_eq!((e.node.as_str(), e.kind), ("n5", FailureKind::Internal));
        assert!(
            e.message.contains("1 endpoints but 0 QP ids"),
            "{}",
            e.message
        );
    }
}
