//! The Agent gRPC service: maps each protocol call onto [`Jobs`] and each [`AgentError`]
//! variant onto a status code. Library errors never carry tonic types; this is the only place
//! where a `Status` is made.
use std::collections::BTreeMap;
use std::sync::Arc;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_server::Agent;
use tonic::{Request, Response, Status};

use crate::error::AgentError;
use crate::jobs::Jobs;
use crate::launch::{LaunchSpec, PartRun};
use crate::os::grants::Grants;
use crate::rpc::wire;

/// Handler of the Agent service.
#[derive(Debug, Clone)]
pub struct AgentHandler {
    pub(super) jobs: Arc<Jobs>,
    pub(super) grants: Arc<Grants>,
}

impl AgentHandler {
    /// Handler over a node's jobs.
    pub fn new(jobs: Arc<Jobs>) -> Self {
        AgentHandler {
            jobs,
            grants: Arc::default(),
        }
    }
}

/// Maps an agent error to a gRPC status, variant by variant.
pub fn to_status(e: AgentError) -> Status {
    let msg = e.to_string();
    match e {
        AgentError::UnknownJob { .. } => Status::not_found(msg),
        AgentError::WrongPhase { .. }
        | AgentError::NotRunning { .. }
        | AgentError::StillRunning { .. } => Status::failed_precondition(msg),
        AgentError::PidsTaken { .. }
        | AgentError::VerbsWithoutChannel { .. }
        | AgentError::LayerNotConnected { .. }
        | AgentError::RdmaCmHeld { .. }
        | AgentError::VerbsFdOutsideLayer { .. }
        | AgentError::VerbsMappedOutsideLayer { .. }
        | AgentError::UnsupportedVerbsFeature { .. }
        | AgentError::AddressMissing { .. }
        | AgentError::OutsideTree { .. }
        | AgentError::Privileged { .. }
        | AgentError::Stopped { .. }
        | AgentError::Unrestorable { .. } => Status::failed_precondition(msg),
        AgentError::BadToken { .. } => Status::permission_denied(msg),
        AgentError::RootRefused { .. }
        | AgentError::UidBelowMinimum { .. }
        | AgentError::UnknownUser { .. }
        | AgentError::NoSlurmAllocation { .. }
        | AgentError::OwnerUnknown { .. }
        | AgentError::FileRefused { .. } => Status::permission_denied(msg),
        AgentError::NoRoom { .. } => Status::resource_exhausted(msg),
        AgentError::Store { .. }
        | AgentError::ManifestMismatch { .. }
        | AgentError::NoUsableCopy { .. } => Status::data_loss(msg),
        AgentError::NoShared { .. }
        | AgentError::NoEngine { .. }
        | AgentError::SlurmAdoption { .. } => Status::failed_precondition(msg),
        AgentError::Partner { .. }
        | AgentError::Fenced { .. }
        | AgentError::Erasure { .. }
        | AgentError::SlurmUnanswered { .. } => Status::unavailable(msg),
        AgentError::Channel { .. } => Status::aborted(msg),
        AgentError::Timeout { .. } => Status::deadline_exceeded(msg),
        AgentError::Engine { .. }
        | AgentError::Cgroup { .. }
        | AgentError::Start { .. }
        | AgentError::Io { .. }
        | AgentError::Injected { .. } => Status::internal(msg),
    }
}

/// How often a flush reports progress.
const FLUSH_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

pub(super) fn us(d: std::time::Duration) -> u64 {
    d.as_micros() as u64
}

/// The reply of a step that took `d`.
pub(super) fn took(d: std::time::Duration) -> Response<pb::PhaseReply> {
    Response::new(pb::PhaseReply { elapsed_us: us(d) })
}

/// Refuses a call from anyone but the coordinator (or root over the standalone daemon's local
/// socket). Every call of this service is the coordinator's except the three below: `Poll`
/// (a job's `ckpt-rsh`, with the job's token), `Receive` and `Send` (the agents of the
/// cluster, each for its own images).
/// A group member as the coordinator names it.
pub(super) fn member_of(g: pb::GroupMember) -> crate::copies::erasure::Member {
    crate::copies::erasure::Member {
        node: g.node,
        address: g.address,
        digest: g.manifest_digest,
    }
}

/// The caller of a call that reads a node's images, refused unless authenticated (who calls is
/// checked first: an anonymous caller learns nothing, not even what it got wrong), and the node
/// it names checked as a name.
pub(super) fn known_caller<T>(
    req: &Request<T>,
    call: &str,
    allowed: &str,
    node: &str,
) -> Result<ckpt_auth::Peer, Status> {
    let peer = ckpt_auth::peer_of(req);
    if matches!(peer, ckpt_auth::Peer::Anonymous) {
        return Err(ckpt_auth::refuse(req, call, allowed));
    }
    if !ckpt_auth::valid_node_name(node) {
        return Err(Status::invalid_argument(format!(
            "{node:?} is not a node name"
        )));
    }
    Ok(peer)
}

pub(super) fn from_coordinator<T>(req: &Request<T>, call: &str) -> Result<(), Status> {
    if ckpt_auth::peer_of(req).is_coordinator() {
        Ok(())
    } else {
        Err(ckpt_auth::refuse(req, call, "the coordinator"))
    }
}

#[tonic::async_trait]
impl Agent for AgentHandler {
    async fn launch(
        &self,
        req: Request<pb::LaunchRequest>,
    ) -> Result<Response<pb::LaunchReply>, Status> {
        from_coordinator(&req, "Agent.Launch")?;
        let r = req.into_inner();
        let spec = LaunchSpec {
            job: r.job_id,
            argv: r.argv,
            cwd: r.cwd.into(),
            env: r.env.into_iter().collect::<BTreeMap<_, _>>(),
            uid: r.uid,
            token: r.token,
            part: r.part,
            engine: r.engine,
            may_move: r.may_move,
            sandbox: match r.job_address.as_str() {
                "" => None,
                a => Some(
                    crate::os::sandbox::JobAddress::parse(a, &r.job_gateway)
                        .map_err(Status::invalid_argument)?,
                ),
            },
        };
        let (pid, incarnation) = crate::launch::launch(&self.jobs, spec)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::LaunchReply {
            pid,
            job_dir: self.jobs.job_dir(r.job_id).display().to_string(),
            incarnation,
        }))
    }

    type EpochStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::EpochEvent, Status>> + Send>>;

    async fn epoch(
        &self,
        req: Request<tonic::Streaming<pb::EpochCommand>>,
    ) -> Result<Response<Self::EpochStream>, Status> {
        // The coordinator, or another node's agent relaying for it: each of its commands
        // must then show the coordinator's grant (checked before it runs).
        let relay_caller = match ckpt_auth::peer_of(&req) {
            p if p.is_coordinator() => None,
            ckpt_auth::Peer::Daemon(ckpt_auth::Identity::Node(n)) => Some(n),
            _ => {
                return Err(ckpt_auth::refuse(
                    &req,
                    "Agent.Epoch",
                    "the coordinator, or a relay",
                ))
            }
        };
        Ok(Response::new(Box::pin(
            self.epoch_stream(relay_caller, req.into_inner()),
        )))
    }

    async fn abort(
        &self,
        req: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        from_coordinator(&req, "Agent.Abort")?;
        let r = req.into_inner();
        crate::checkpoint::CheckpointRun::of(&self.jobs, r.job_id)
            .abort(r.epoch, &r.reason)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::PhaseReply::default()))
    }

    async fn restore(
        &self,
        req: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreReply>, Status> {
        from_coordinator(&req, "Agent.Restore")?;
        let r = req.into_inner();
        if !r.source_node.is_empty() && !ckpt_auth::valid_node_name(&r.source_node) {
            return Err(Status::invalid_argument(format!(
                "{:?} is not a node name",
                r.source_node
            )));
        }
        let begin = std::time::Instant::now();
        let run =
            crate::restore::RestartRun::to_restore(&self.jobs, r.job_id).map_err(to_status)?;
        let done = run
            .restore(
                r.epoch,
                &r.manifest_digest,
                crate::restore::Terms {
                    hold: r.hold,
                    token: &r.token,
                    may_move: r.may_move,
                },
                &crate::copies::Sources {
                    partner: (!r.partner.is_empty()).then_some((r.partner, r.partner_address)),
                    shared_durable: r.shared_durable,
                    local_pruned: r.local_pruned,
                    source_node: (!r.source_node.is_empty()).then_some(r.source_node),
                    group: (!r.encoding.is_empty())
                        .then(|| (r.encoding, r.group.into_iter().map(member_of).collect())),
                },
            )
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::RestoreReply {
            pid: done.pid,
            incarnation: done.incarnation,
            elapsed_us: us(begin.elapsed()),
            source: pb::CopyLocation::from(done.source).into(),
            note: done.note,
            channels: done.channels,
            fetch_us: done.fetch_ms * 1000,
        }))
    }

    async fn encode(
        &self,
        req: Request<pb::EncodeRequest>,
    ) -> Result<Response<pb::EncodeReply>, Status> {
        self.encode_call(req).await
    }

    type ReadSegmentStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::SegmentChunk, Status>> + Send>,
    >;

    async fn read_segment(
        &self,
        req: Request<pb::SegmentRequest>,
    ) -> Result<Response<Self::ReadSegmentStream>, Status> {
        self.read_segment_call(req).await
    }

    async fn rebuild(
        &self,
        req: Request<pb::RebuildRequest>,
    ) -> Result<Response<pb::RebuildReply>, Status> {
        from_coordinator(&req, "Agent.Rebuild")?;
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        let job = self.jobs.get(r.job_id).map_err(to_status)?;
        let (eps, wants) = self
            .jobs
            .node
            .rebuild_channels(&mut *job.lock().await)
            .await
            .map_err(to_status)?;
        let qp = |(channel, qpn): (u64, u32)| pb::QpRef { channel, qpn };
        Ok(Response::new(pb::RebuildReply {
            endpoints: eps.iter().map(wire::endpoint_to_wire).collect(),
            elapsed_us: us(begin.elapsed()),
            wants_all: wants.is_none(),
            wants: wants.unwrap_or_default().into_iter().map(qp).collect(),
        }))
    }

    async fn reconnect(
        &self,
        req: Request<pb::ReconnectRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        from_coordinator(&req, "Agent.Reconnect")?;
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        let eps = r
            .endpoints
            .into_iter()
            .map(wire::endpoint_from_wire)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Status::invalid_argument(format!("reconnect of job {}: {e}", r.job_id)))?;
        let job = self.jobs.get(r.job_id).map_err(to_status)?;
        self.jobs
            .node
            .reconnect_channels(&mut *job.lock().await, &eps)
            .await
            .map_err(to_status)?;
        Ok(took(begin.elapsed()))
    }

    async fn signal(
        &self,
        req: Request<pb::SignalRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        // The coordinator, or a job's ckpt-rsh forwarding a signal to its remote part (with
        // the job's token).
        if !ckpt_auth::peer_of(&req).is_coordinator() {
            let r = req.get_ref();
            if let Err(e) = PartRun::of(&self.jobs, r.job_id)
                .check_token(&r.token)
                .await
            {
                tracing::warn!(job = r.job_id, peer = %ckpt_auth::peer_of(&req), "refused a signal without the job's token");
                return Err(to_status(e));
            }
        }
        let r = req.into_inner();
        PartRun::of(&self.jobs, r.job_id)
            .signal(r.signal)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::PhaseReply::default()))
    }

    async fn inspect(
        &self,
        req: Request<pb::InspectRequest>,
    ) -> Result<Response<pb::NodeJobInfo>, Status> {
        from_coordinator(&req, "Agent.Inspect")?;
        let r = req.into_inner();
        let view = PartRun::of(&self.jobs, r.job_id)
            .part_view()
            .await
            .map_err(to_status)?;
        let (mut state, end) = view.observed.to_wire();
        if view.frozen {
            state = pb::PartState::Frozen;
        }
        Ok(Response::new(pb::NodeJobInfo {
            node: self.jobs.node().to_string(),
            state: state.into(),
            end,
            processes: view
                .processes
                .into_iter()
                .map(|(p, rank)| pb::ProcessInfo {
                    pid: p.pid,
                    comm: p.comm,
                    state: wire::process_state(p.state).into(),
                    rank,
                    rss_bytes: crate::os::procfs::rss_bytes(p.pid),
                })
                .collect(),
            role: if view.busy {
                ""
            } else if view.part == 0 {
                "launcher"
            } else {
                "attached"
            }
            .into(),
            detail: if view.busy {
                "busy: a checkpoint or restore step holds this part".into()
            } else {
                String::new()
            },
            moved_from: String::new(),
            snapshot_mode: view.snapshot_mode,
            // The coordinator knows the part's job address.
            address: String::new(),
        }))
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        from_coordinator(&req, "Agent.Release")?;
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        crate::restore::RestartRun::of(&self.jobs, r.job_id)
            .map_err(to_status)?
            .release(r.kill)
            .await
            .map_err(to_status)?;
        Ok(took(begin.elapsed()))
    }

    async fn verify(
        &self,
        req: Request<pb::VerifyNodeRequest>,
    ) -> Result<Response<pb::NodeVerify>, Status> {
        from_coordinator(&req, "Agent.Verify")?;
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        let node = self.jobs.node().to_string();
        // A damaged image is this call's answer, not its failure.
        let copies: Vec<pb::CopyCheck> = self
            .jobs
            .node
            .verify_copies(
                r.job_id,
                r.epoch,
                &r.manifest_digest,
                !r.local_pruned,
                r.shared_durable,
            )
            .await
            .into_iter()
            .map(|c| match c.result {
                Ok(m) => pb::CopyCheck {
                    location: pb::CopyLocation::from(c.location).into(),
                    ok: true,
                    files: m.files.len() as u32,
                    bytes: m.image_bytes(),
                    error: String::new(),
                },
                Err(e) => pb::CopyCheck {
                    location: pb::CopyLocation::from(c.location).into(),
                    ok: false,
                    error: e.to_string(),
                    ..Default::default()
                },
            })
            .collect();
        // The node is fine if any copy is: a restart uses the first intact one.
        let best = copies
            .iter()
            .find(|c| c.ok)
            .or(copies.first())
            .cloned()
            .unwrap_or_default();
        let elapsed = begin.elapsed();
        crate::metrics::metrics()
            .verify_seconds
            .observe(elapsed.as_secs_f64());
        Ok(Response::new(pb::NodeVerify {
            node,
            ok: best.ok,
            files: best.files,
            bytes: best.bytes,
            error: copies
                .iter()
                .filter(|c| !c.ok)
                .map(|c| format!("{} copy: {}", c.location().name(), c.error))
                .collect::<Vec<_>>()
                .join("; "),
            elapsed_ms: elapsed.as_millis() as u64,
            copies,
            // This agent answered: its copies were judged.
            unreachable: false,
        }))
    }

    async fn prune(
        &self,
        req: Request<pb::PruneRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        from_coordinator(&req, "Agent.Prune")?;
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        self.jobs
            .node
            .prune(r.job_id, &r.epochs, r.shared, r.keep_local)
            .await
            .map_err(to_status)?;
        Ok(took(begin.elapsed()))
    }

    type FlushStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::FlushProgress, Status>> + Send>,
    >;

    async fn flush(
        &self,
        req: Request<pb::FlushRequest>,
    ) -> Result<Response<Self::FlushStream>, Status> {
        from_coordinator(&req, "Agent.Flush")?;
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        let (progress, mut task) = self
            .jobs
            .node
            .flush(r.job_id, r.epoch, &r.manifest_digest)
            .map_err(to_status)?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            use std::sync::atomic::Ordering;
            let msg = |done, bytes_written| pb::FlushProgress {
                bytes_done: progress.done.load(Ordering::Relaxed),
                bytes_total: progress.total.load(Ordering::Relaxed),
                done,
                elapsed_ms: begin.elapsed().as_millis() as u64,
                bytes_written,
            };
            let mut tick = tokio::time::interval(FLUSH_PROGRESS_EVERY);
            let result = loop {
                tokio::select! {
                    r = &mut task => break r.expect("flush task"),
                    _ = tick.tick() => {
                        if tx.send(Ok(msg(false, 0))).await.is_err() {
                            // The coordinator went away: stop copying; it flushes again later.
                            progress.cancel.store(true, Ordering::Relaxed);
                        }
                    }
                }
            };
            let _ = tx
                .send(match result {
                    Ok(stats) => {
                        tracing::info!(
                            job = r.job_id,
                            epoch = r.epoch,
                            image_bytes = stats.image_bytes,
                            written_bytes = stats.written_bytes,
                            new_bytes = stats.new_bytes,
                            chunks = stats.chunks,
                            new_chunks = stats.new_chunks,
                            "flushed to shared storage"
                        );
                        Ok(msg(true, stats.written_bytes))
                    }
                    Err(e) => Err(to_status(e)),
                })
                .await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn publish(
        &self,
        req: Request<pb::PublishRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        from_coordinator(&req, "Agent.Publish")?;
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        self.jobs
            .node
            .publish(ckpt_store::commit::CommitRecord {
                job_id: r.job_id,
                epoch: r.epoch,
                manifests: r.manifests.into_iter().collect(),
                image_bytes: r.image_bytes,
                committed_unix_ms: r.committed_unix_ms,
            })
            .await
            .map_err(to_status)?;
        Ok(took(begin.elapsed()))
    }

    async fn replicate(
        &self,
        req: Request<pb::ReplicateRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        self.replicate_call(req).await
    }

    async fn receive(
        &self,
        req: Request<tonic::Streaming<pb::ImageChunk>>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        self.receive_call(req).await
    }

    type SendStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::ImageChunk, Status>> + Send>>;

    async fn send(
        &self,
        req: Request<pb::SendRequest>,
    ) -> Result<Response<Self::SendStream>, Status> {
        self.send_call(req).await
    }

    async fn allow_fetch(
        &self,
        req: Request<pb::AllowFetchRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        self.allow_fetch_call(req).await
    }

    async fn poll(&self, req: Request<pb::PollRequest>) -> Result<Response<pb::PollReply>, Status> {
        let r = req.into_inner();
        let p = PartRun::of(&self.jobs, r.job_id)
            .poll(&r.token, r.stdout_offset, r.stderr_offset)
            .await
            .map_err(to_status)?;
        let (state, end) = p.observed.to_wire();
        Ok(Response::new(pb::PollReply {
            stdout: p.stdout,
            stderr: p.stderr,
            state: state.into(),
            end,
        }))
    }
}
