//! gRPC handlers of ckptd: the Control service (ckptctl, Unix socket) and the Registry service
//! (agents, TCP). Errors become statuses here and only here, one arm per error variant.
use std::pin::Pin;
use std::sync::Arc;

use ckpt_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::transport::server::UdsConnectInfo;
use tonic::{Code, Request, Response, Status};

use crate::agents::FailureKind;
use crate::driver::{Caller, Coordinator, DriveError, OperationPhase, RunSpec, Step};
use crate::model::{Every, Phase, Policy, PolicyChange, Trigger};
use crate::wire::{epoch_info, job_info, with_unreachable};

/// Maps a coordinator error to a status.
pub fn to_status(e: &DriveError) -> Status {
    let msg = e.to_string();
    let code = match e {
        DriveError::UnknownJob { .. } => Code::NotFound,
        DriveError::NotOwner { .. } => Code::PermissionDenied,
        DriveError::State(_)
        | DriveError::NoCommittedEpoch { .. }
        | DriveError::EpochNotRestorable { .. } => Code::FailedPrecondition,
        DriveError::Invalid(_) | DriveError::DeadlineTooClose(_) => Code::InvalidArgument,
        DriveError::Denied(_) => Code::PermissionDenied,
        DriveError::Busy(_) => Code::Unavailable,
        DriveError::Quota(_) => Code::ResourceExhausted,
        DriveError::NoAgents => Code::Unavailable,
        DriveError::UnknownNode { .. } => Code::NotFound,
        DriveError::NodeNotFree { .. } | DriveError::PartMayRun { .. } => Code::FailedPrecondition,
        DriveError::NoSpare { .. } => Code::ResourceExhausted,
        DriveError::EpochFailed { failure, .. } => match failure.kind {
            FailureKind::Deadline => Code::DeadlineExceeded,
            FailureKind::NoRoom => Code::ResourceExhausted,
            _ => Code::Aborted,
        },
        DriveError::RestartFailed { failure, .. } | DriveError::Node(failure) => {
            failure.kind.code()
        }
        DriveError::Registry(_) => Code::Internal,
    };
    let mut status = Status::new(code, msg);
    if let DriveError::DeadlineTooClose(_) = e {
        status.metadata_mut().insert(
            ckpt_proto::REFUSAL_KEY,
            tonic::metadata::MetadataValue::from_static(ckpt_proto::REFUSAL_DEADLINE_TOO_CLOSE),
        );
    }
    status
}

fn caller<T>(req: &Request<T>) -> Result<Caller, Status> {
    let cred = req
        .extensions()
        .get::<UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
        .ok_or_else(|| {
            Status::unauthenticated("ckptd accepts control requests only on its Unix socket")
        })?;
    Ok(Caller {
        uid: cred.uid(),
        gid: cred.gid(),
        pid: cred.pid(),
    })
}

/// The lease an agent gets with each answer (see `driver/lost.rs`): none for the agent on
/// ckptd's own machine (a standalone ckptd's), which loses ckptd only with ckptd itself and
/// whose parts nobody restarts elsewhere.
fn lease_for(peer: &ckpt_auth::Peer, cfg: &crate::config::CoordinatorConfig) -> u64 {
    match peer {
        ckpt_auth::Peer::LocalRoot => 0,
        _ => cfg.lease().as_millis() as u64,
    }
}

/// Handler of the Control service.
#[derive(Debug, Clone)]
pub struct ControlHandler {
    coord: Arc<Coordinator>,
}

impl ControlHandler {
    /// Handler over a coordinator.
    pub fn new(coord: Arc<Coordinator>) -> Self {
        ControlHandler { coord }
    }
}

type ProgressStream = Pin<Box<dyn Stream<Item = Result<pb::Progress, Status>> + Send>>;

fn step_msg(s: &Step, started: std::time::Instant) -> pb::Progress {
    pb::Progress {
        job_id: s.job,
        epoch: s.epoch,
        phase: s.phase.name().into(),
        message: s.message.clone(),
        done: false,
        ok: false,
        elapsed_ms: started.elapsed().as_millis() as u64,
        result: None,
        code: 0,
        phase_kind: s.phase.kind().into(),
    }
}

/// Streams progress steps, then one final message built from the operation's result. The
/// operation runs in its own task: a client that disconnects does not stop it.
fn progress_stream<F>(op: F) -> ProgressStream
where
    F: FnOnce(
            mpsc::UnboundedSender<Step>,
        ) -> Pin<Box<dyn std::future::Future<Output = pb::Progress> + Send>>
        + Send
        + 'static,
{
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<pb::Progress, Status>>();
    let (step_tx, mut step_rx) = mpsc::unbounded_channel::<Step>();
    let started = std::time::Instant::now();
    let fut = op(step_tx);
    let fwd = out_tx.clone();
    let forward = tokio::spawn(async move {
        while let Some(s) = step_rx.recv().await {
            let _ = fwd.send(Ok(step_msg(&s, started)));
        }
    });
    tokio::spawn(async move {
        let mut last = fut.await;
        let _ = forward.await;
        last.elapsed_ms = started.elapsed().as_millis() as u64;
        last.done = true;
        let _ = out_tx.send(Ok(last));
    });
    Box::pin(tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx))
}

fn final_msg(
    job: u64,
    epoch: u32,
    phase: OperationPhase,
    r: Result<(String, Option<pb::EpochInfo>), DriveError>,
) -> pb::Progress {
    let (ok, message, result, code) = match r {
        Ok((m, e)) => (true, m, e, 0),
        Err(e) => {
            let s = to_status(&e);
            (false, s.message().to_string(), None, s.code() as i32)
        }
    };
    pb::Progress {
        job_id: job,
        epoch,
        phase: phase.name().into(),
        message,
        done: true,
        ok,
        elapsed_ms: 0,
        result,
        code,
        phase_kind: phase.kind().into(),
    }
}

#[tonic::async_trait]
impl pb::control_server::Control for ControlHandler {
    async fn run(&self, req: Request<pb::RunRequest>) -> Result<Response<pb::RunReply>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let every = if r.every.is_empty() {
            None
        } else {
            Every::parse(&r.every).map_err(Status::invalid_argument)?
        };
        let deadline = (r.deadline_unix_ms > 0).then_some(r.deadline_unix_ms);
        if r.resume {
            let change = PolicyChange {
                every: (!r.every.is_empty()).then_some(every),
                deadline_unix_ms: deadline.map(Some),
            };
            if let crate::driver::Resume::Restart(job, epoch) = self
                .coord
                .resolve_resume(&who, &r.name, change)
                .await
                .map_err(|e| to_status(&e))?
            {
                let mut info = job_info(&job, vec![]);
                info.policy = self.coord.policy_info(&job);
                return Ok(Response::new(pb::RunReply {
                    job: Some(info),
                    resume_epoch: epoch,
                }));
            }
        }
        if let Some(d) = deadline {
            self.coord
                .check_deadline(None, d)
                .await
                .map_err(|e| to_status(&e))?;
        }
        let spec = RunSpec {
            name: r.name,
            argv: r.argv,
            cwd: r.cwd,
            env: r.env,
            node: r.node,
            part_env: r.part_env,
            policy: Policy {
                every,
                deadline_unix_ms: deadline,
            },
            engine: r.engine,
            on_failure: r.on_failure,
            redundancy: r.redundancy,
        };
        let job = self.coord.run(who, spec).await.map_err(|e| to_status(&e))?;
        let nodes = self.coord.inspect(&job).await;
        let mut info = job_info(&job, nodes);
        info.policy = self.coord.policy_info(&job);
        Ok(Response::new(pb::RunReply {
            job: Some(info),
            resume_epoch: 0,
        }))
    }

    type CheckpointStream = ProgressStream;

    async fn checkpoint(
        &self,
        req: Request<pb::CheckpointRequest>,
    ) -> Result<Response<ProgressStream>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let (job, epoch) = self
            .coord
            .begin_checkpoint(&who, r.job_id, r.kill, Trigger::User)
            .await
            .map_err(|e| to_status(&e))?;
        let coord = self.coord.clone();
        let number = epoch.number;
        let stream = progress_stream(move |tx| {
            Box::pin(async move {
                let id = job.id;
                let r = coord.drive_checkpoint(job, epoch, tx).await.map(|e| {
                    (
                        format!("job {id} epoch {} committed", e.number),
                        Some(epoch_info(&e, None)),
                    )
                });
                final_msg(id, number, OperationPhase::Epoch(Phase::Commit), r)
            })
        });
        Ok(Response::new(stream))
    }

    type RestartStream = ProgressStream;

    async fn restart(
        &self,
        req: Request<pb::RestartRequest>,
    ) -> Result<Response<ProgressStream>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let placement = crate::driver::Placement {
            nodes: r.nodes.clone(),
            map: r.map.clone(),
            on_spares: r.on_spares,
            vacate: Vec::new(),
            down: r.down.clone(),
            allocation: r.allocation.as_ref().map(|a| crate::driver::Allocation {
                name: if a.name.is_empty() {
                    "the allocation".into()
                } else {
                    a.name.clone()
                },
                nodes: a.nodes.clone(),
            }),
        };
        let begun = self
            .coord
            .begin_restart(&who, r.job_id, r.epoch, &placement)
            .await
            .map_err(|e| to_status(&e))?;
        let record = begun.record(Trigger::User, format!("ckptctl restart by uid {}", who.uid));
        let coord = self.coord.clone();
        // Only "the latest checkpoint" may fall back to an older one; an epoch asked for by
        // number is that epoch or nothing.
        let fallback = r.epoch == 0;
        let stream = progress_stream(move |tx| {
            Box::pin(async move {
                let id = begun.job.id;
                let asked = begun.epoch.number;
                let r = coord
                    .drive_restart(begun, fallback, record, tx)
                    .await
                    .map(|(_, e, _)| {
                        (
                            format!("job {id} restarted from epoch {}", e.number),
                            Some(epoch_info(&e, None)),
                        )
                    });
                let number = match &r {
                    Ok((_, Some(info))) => info.epoch,
                    _ => asked,
                };
                final_msg(id, number, OperationPhase::Restore, r)
            })
        });
        Ok(Response::new(stream))
    }

    type DrainStream = ProgressStream;

    async fn drain(
        &self,
        req: Request<pb::DrainRequest>,
    ) -> Result<Response<ProgressStream>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let jobs = self
            .coord
            .begin_drain(&who, &r.node, r.migrate)
            .map_err(|e| to_status(&e))?;
        let coord = self.coord.clone();
        let stream = progress_stream(move |tx| {
            Box::pin(async move {
                let node = r.node;
                if jobs.is_empty() {
                    return final_msg(
                        0,
                        0,
                        OperationPhase::Drain,
                        Ok((format!("no live job has a part on {node}"), None)),
                    );
                }
                let done = coord.drive_drain(&node, jobs, r.migrate, tx).await;
                let mut lines = Vec::new();
                let mut first_error = None;
                for d in done {
                    let line = match (&d.error, d.epoch, &d.moved_to) {
                        (None, Some(e), Some(to)) => {
                            format!("job {}: checkpointed to epoch {e}, running again with its {node} part on {to}", d.job)
                        }
                        (None, Some(e), None) => format!(
                            "job {}: checkpointed to epoch {e} and stopped (restart it with `ckptctl restart {} --map {node}=NODE`)",
                            d.job, d.job
                        ),
                        (Some(err), Some(e), _) => format!(
                            "job {}: checkpointed to epoch {e} and stopped, not migrated: {err}",
                            d.job
                        ),
                        (Some(err), None, _) => match d.stopped_at {
                            Some(e) => format!(
                                "job {}: stopped, but its checkpoint failed: {err}; restart it from epoch {e} (`ckptctl restart {} --map {node}=NODE`)",
                                d.job, d.job
                            ),
                            None => format!(
                                "job {}: not checkpointed, still running on {node}: {err}",
                                d.job
                            ),
                        },
                        (None, None, _) => format!("job {}: not checkpointed", d.job),
                    };
                    lines.push(line);
                    if first_error.is_none() {
                        first_error = d.error;
                    }
                }
                let message = lines.join("\n");
                match first_error {
                    None => final_msg(0, 0, OperationPhase::Drain, Ok((message, None))),
                    Some(e) => {
                        let mut p = final_msg(0, 0, OperationPhase::Drain, Err(e));
                        p.message = message;
                        p
                    }
                }
            })
        });
        Ok(Response::new(stream))
    }

    async fn status(
        &self,
        req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusReply>, Status> {
        let who = caller(&req)?;
        let id = req.into_inner().job_id;
        self.coord.job_for(&who, id).map_err(|e| to_status(&e))?;
        let job = self.coord.refresh(id).await.map_err(|e| to_status(&e))?;
        let nodes = self.coord.inspect(&job).await;
        let mut info = job_info(&job, nodes);
        with_unreachable(&mut info, &job, self.coord.unreachable(&job));
        info.flush = self.coord.flush_summary(id);
        info.policy = self.coord.policy_info(&job);
        Ok(Response::new(pb::StatusReply { job: Some(info) }))
    }

    async fn nodes(
        &self,
        req: Request<pb::NodesRequest>,
    ) -> Result<Response<pb::NodesReply>, Status> {
        let who = caller(&req)?;
        let nodes = self.coord.nodes(&who).map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::NodesReply {
            nodes,
            node_timeout_ms: self.coord.cfg.node_timeout.as_millis() as u64,
            version: env!("CARGO_PKG_VERSION").into(),
        }))
    }

    async fn list(&self, req: Request<pb::ListRequest>) -> Result<Response<pb::ListReply>, Status> {
        let who = caller(&req)?;
        // Users see their own jobs; root sees every job.
        let jobs = self
            .coord
            .registry
            .jobs()
            .map_err(|e| to_status(&e.into()))?;
        let jobs = jobs
            .iter()
            .filter(|j| who.uid == 0 || j.owner_uid == who.uid)
            .map(|j| {
                let mut info = job_info(j, vec![]);
                with_unreachable(&mut info, j, self.coord.unreachable(j));
                info.policy = self.coord.policy_info(j);
                info
            })
            .collect();
        Ok(Response::new(pb::ListReply { jobs }))
    }

    async fn epochs(
        &self,
        req: Request<pb::EpochsRequest>,
    ) -> Result<Response<pb::EpochsReply>, Status> {
        let who = caller(&req)?;
        let id = req.into_inner().job_id;
        let job = self.coord.job_for(&who, id).map_err(|e| to_status(&e))?;
        let epochs = self
            .coord
            .registry
            .epochs(id)
            .map_err(|e| to_status(&e.into()))?;
        Ok(Response::new(pb::EpochsReply {
            epochs: epochs
                .iter()
                .map(|e| pb::EpochInfo {
                    // A job keeps its engine: its epochs are all that engine's.
                    engine: job.snapshot_engine().to_string(),
                    ..epoch_info(e, self.coord.flushes.progress(id, e.number))
                })
                .collect(),
        }))
    }

    async fn verify(
        &self,
        req: Request<pb::VerifyRequest>,
    ) -> Result<Response<pb::VerifyReply>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        self.coord
            .verify(&who, r.job_id, r.epoch)
            .await
            .map(Response::new)
            .map_err(|e| to_status(&e))
    }

    async fn set_policy(
        &self,
        req: Request<pb::PolicyRequest>,
    ) -> Result<Response<pb::PolicyReply>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let change = PolicyChange {
            every: if r.every.is_empty() {
                None
            } else {
                Some(Every::parse(&r.every).map_err(Status::invalid_argument)?)
            },
            deadline_unix_ms: r.deadline_unix_ms.map(|d| (d > 0).then_some(d)),
        };
        let job = self
            .coord
            .set_policy(&who, r.job_id, change)
            .await
            .map_err(|e| to_status(&e))?;
        let mut info = job_info(&job, vec![]);
        info.policy = self.coord.policy_info(&job);
        Ok(Response::new(pb::PolicyReply { job: Some(info) }))
    }

    async fn estimate(
        &self,
        req: Request<pb::EstimateRequest>,
    ) -> Result<Response<pb::EstimateReply>, Status> {
        let who = caller(&req)?;
        let id = req.into_inner().job_id;
        let (job, est) = self
            .coord
            .estimate(&who, id)
            .await
            .map_err(|e| to_status(&e))?;
        let (lead, why) = self.coord.deadline_lead(est.as_ref());
        let timing = |p: &crate::model::estimate::Prediction| pb::Timing {
            frozen_ms: p.frozen_ms,
            commit_ms: p.commit_ms,
            durable_ms: p.durable_ms.unwrap_or(0),
        };
        let mut info = job_info(&job, vec![]);
        info.policy = self.coord.policy_info(&job);
        let mut reply = pb::EstimateReply {
            job: Some(info),
            deadline_lead_ms: lead.as_millis() as u64,
            deadline_why: why,
            ..Default::default()
        };
        if let Some(e) = est {
            reply.known = true;
            reply.resident_per_node_bytes = e.resident_per_node;
            reply.predicted = Some(timing(&e.predicted));
            reply.basis = e.basis;
            reply.checks = e
                .checks
                .iter()
                .map(|c| pb::EstimateCheck {
                    epoch: c.epoch,
                    predicted: Some(timing(&c.predicted)),
                    actual: Some(timing(&c.actual)),
                })
                .collect();
        }
        Ok(Response::new(reply))
    }

    async fn cancel(
        &self,
        req: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelReply>, Status> {
        let who = caller(&req)?;
        let id = req.into_inner().job_id;
        let job = self
            .coord
            .cancel(&who, id)
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::CancelReply {
            job: Some(job_info(&job, vec![])),
        }))
    }
}

/// Handler of the Registry service.
#[derive(Debug, Clone)]
pub struct RegistryHandler {
    coord: Arc<Coordinator>,
    id: String,
}

impl RegistryHandler {
    /// Handler over a coordinator.
    pub fn new(coord: Arc<Coordinator>) -> Self {
        RegistryHandler {
            coord,
            id: format!("ckptd-{}-{}", std::process::id(), ckpt_proto::now_ms()),
        }
    }
}

#[tonic::async_trait]
impl pb::registry_server::Registry for RegistryHandler {
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterReply>, Status> {
        // A node's name is bound to its credential: only n2's agent registers as n2, and only
        // root on this machine (the standalone daemon's own agent) on a local socket address.
        let peer = ckpt_auth::peer_of(&req);
        let r = req.get_ref();
        // Who calls first: a caller without the node's credential learns nothing more.
        if !peer.is_node(&r.node) {
            let allowed = format!("the agent holding node {}'s credential", r.node);
            return Err(ckpt_auth::refuse(&req, "Registry.Register", &allowed));
        }
        if !ckpt_auth::valid_node_name(&r.node) {
            return Err(Status::invalid_argument(format!(
                "{:?} is not a valid node name: use letters, digits, '.', '_' and '-' (at most 64)",
                r.node
            )));
        }
        if r.address.starts_with("unix:") && peer != ckpt_auth::Peer::LocalRoot {
            return Err(ckpt_auth::refuse(
                &req,
                "Registry.Register with a local socket address",
                "root on this machine",
            ));
        }
        let r = req.into_inner();
        self.coord
            .register_agent(
                &r.node,
                crate::agents::Registration {
                    address: r.address,
                    host_addresses: names_of(r.host_addresses, r.hostname),
                    shared_dir: r.shared_dir,
                    engines: r.engines.into_iter().map(|e| (e.name, e.version)).collect(),
                    version: r.version,
                    rdma_devices: r.rdma_devices,
                },
            )
            .await
            .map_err(Status::invalid_argument)?;
        Ok(Response::new(pb::RegisterReply {
            coordinator_id: self.id.clone(),
            lease_ms: lease_for(&peer, &self.coord.cfg),
            fence: self.coord.agents.fence().unwrap_or(0),
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatReply>, Status> {
        let peer = ckpt_auth::peer_of(&req);
        if !peer.is_node(&req.get_ref().node) {
            let allowed = format!("the agent holding node {}'s credential", req.get_ref().node);
            return Err(ckpt_auth::refuse(&req, "Registry.Heartbeat", &allowed));
        }
        let r = req.into_inner();
        let staging = (r.staging_total_bytes > 0).then_some((
            r.staging_free_bytes.min(r.staging_total_bytes),
            r.staging_total_bytes,
        ));
        if self.coord.heartbeat(&r.node, r.jobs, staging).await {
            Ok(Response::new(pb::HeartbeatReply {
                lease_ms: lease_for(&peer, &self.coord.cfg),
                fence: self.coord.agents.fence().unwrap_or(0),
            }))
        } else {
            Err(Status::not_found(format!(
                "node {} is not registered; register first",
                r.node
            )))
        }
    }

    async fn attach(
        &self,
        req: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachReply>, Status> {
        self.coord
            .attach(req.into_inner())
            .await
            .map(Response::new)
            .map_err(|e| to_status(&e))
    }

    async fn locate(
        &self,
        req: Request<pb::LocateRequest>,
    ) -> Result<Response<pb::LocateReply>, Status> {
        self.coord
            .locate(req.into_inner())
            .await
            .map(Response::new)
            .map_err(|e| to_status(&e))
    }
}

/// What an MPI host list may call a node besides its node name: its addresses and its host
/// name (the part of it before the first dot too).
fn names_of(mut addresses: Vec<String>, hostname: String) -> Vec<String> {
    if !hostname.is_empty() {
        if let Some((short, _)) = hostname.split_once('.') {
            addresses.push(short.to_string());
        }
        addresses.push(hostname);
    }
    addresses
}
