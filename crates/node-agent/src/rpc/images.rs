//! The Agent calls that move images and parity between nodes: partner copies (`Replicate`,
//! `Receive`, `Send`), the coordinator's grants (`AllowFetch`), and erasure coding (`Encode`,
//! `ReadSegment`). The service's trait methods in `grpc.rs` call these.
use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_server::Agent;
use tonic::{Request, Response, Status};

use super::grpc::{from_coordinator, known_caller, member_of, to_status, took, us, AgentHandler};
use crate::error::AgentError;

impl AgentHandler {
    pub(super) async fn encode_call(
        &self,
        req: Request<pb::EncodeRequest>,
    ) -> Result<Response<pb::EncodeReply>, Status> {
        from_coordinator(&req, "Agent.Encode")?;
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        let e = self
            .jobs
            .node
            .encode(
                r.job_id,
                r.epoch,
                &r.scheme,
                r.members.into_iter().map(member_of).collect(),
            )
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::EncodeReply {
            shards: e
                .shards
                .iter()
                .map(|s| pb::ParityShardInfo {
                    row: s.row as u32,
                    index: s.index as u32,
                    size: s.size,
                    digest: s.digest.clone(),
                })
                .collect(),
            stream_lens: e.stream_lens,
            manifest_lens: e.manifest_lens,
            elapsed_us: us(begin.elapsed()),
        }))
    }

    pub(super) async fn read_segment_call(
        &self,
        req: Request<pb::SegmentRequest>,
    ) -> Result<Response<<Self as Agent>::ReadSegmentStream>, Status> {
        let peer = known_caller(
            &req,
            "Agent.ReadSegment",
            "a node of this cluster with the coordinator's grant, or the coordinator",
            &req.get_ref().node,
        )?;
        let r = req.get_ref();
        let granted = match &peer {
            ckpt_auth::Peer::Daemon(ckpt_auth::Identity::Node(g)) if r.parity => {
                r.node == self.jobs.node() && self.grants.permits_parity(g, r.job_id, r.epoch)
            }
            ckpt_auth::Peer::Daemon(ckpt_auth::Identity::Node(g)) => {
                self.grants
                    .permits(g, r.job_id, r.epoch, &r.node, &r.manifest_digest)
            }
            _ => false,
        };
        if !(peer.is_coordinator() || granted) {
            let allowed = if r.parity {
                format!(
                    "a node the coordinator let read the parity {} holds",
                    r.node
                )
            } else {
                format!("a node the coordinator let read node {}'s images", r.node)
            };
            return Err(ckpt_auth::refuse(&req, "Agent.ReadSegment", &allowed));
        }
        let r = req.into_inner();
        let jobs = self.jobs.clone();
        let read = tokio::task::spawn_blocking(move || {
            if r.parity {
                jobs.node
                    .read_parity(
                        r.job_id,
                        r.epoch,
                        r.row as usize,
                        r.index as usize,
                        r.offset,
                        r.length,
                    )
                    .map(|(size, data)| (size, 0, data))
            } else {
                jobs.node.read_images(
                    r.job_id,
                    r.epoch,
                    &r.node,
                    &r.manifest_digest,
                    r.offset,
                    r.length,
                )
            }
        })
        .await
        .expect("read task")
        .map_err(to_status)?;
        let (stream_len, manifest_len, data) = read;
        let mut chunks: Vec<Result<pb::SegmentChunk, Status>> = data
            .chunks(ckpt_store::stream::CHUNK)
            .map(|c| {
                Ok(pb::SegmentChunk {
                    data: c.to_vec(),
                    ..Default::default()
                })
            })
            .collect();
        if chunks.is_empty() {
            chunks.push(Ok(pb::SegmentChunk::default()));
        }
        if let Some(Ok(first)) = chunks.first_mut() {
            first.stream_len = stream_len;
            first.manifest_len = manifest_len;
        }
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    pub(super) async fn replicate_call(
        &self,
        req: Request<pb::ReplicateRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        from_coordinator(&req, "Agent.Replicate")?;
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        self.jobs
            .node
            .replicate(
                r.job_id,
                r.epoch,
                &r.manifest_digest,
                &r.partner,
                &r.partner_address,
            )
            .await
            .map_err(to_status)?;
        Ok(took(begin.elapsed()))
    }

    pub(super) async fn receive_call(
        &self,
        req: Request<tonic::Streaming<pb::ImageChunk>>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        let begin = std::time::Instant::now();
        // Another node's agent, keeping its own images here: nothing is read from anyone else.
        let peer = ckpt_auth::peer_of(&req);
        if !matches!(
            peer,
            ckpt_auth::Peer::Daemon(ckpt_auth::Identity::Node(_)) | ckpt_auth::Peer::LocalRoot
        ) {
            return Err(ckpt_auth::refuse(
                &req,
                "Agent.Receive",
                "the agents of the cluster",
            ));
        }
        let (header, rest) = crate::rpc::partner::split_header(req.into_inner()).await?;
        if !peer.is_node(&header.node) {
            tracing::warn!(%peer, node = %header.node, job = header.job_id, "refused a partner copy sent for another node");
            return Err(Status::permission_denied(format!(
                "{peer} cannot send node {}'s images: a node sends only its own",
                header.node
            )));
        }
        if header.node == self.jobs.node() || !ckpt_auth::valid_node_name(&header.node) {
            return Err(Status::invalid_argument(format!(
                "node {} cannot keep a partner copy of {:?}",
                self.jobs.node(),
                header.node
            )));
        }
        let (job, digest) = (header.job_id, header.manifest_digest.clone());
        let dest = self.jobs.node.node_dir(job, header.epoch, &header.node);
        let sender = header.node.clone();
        crate::rpc::partner::receive(job, &sender, dest, header, &digest, rest)
            .await
            .map_err(|e| match e {
                // What the peer sent is unusable (a path leaving the directory, a bad name, no
                // digest, an absurd count): its fault, not damaged data here.
                AgentError::Store {
                    source:
                        ckpt_store::StoreError::UnsafePath { .. }
                        | ckpt_store::StoreError::UnsafeName { .. }
                        | ckpt_store::StoreError::LimitExceeded { .. }
                        | ckpt_store::StoreError::DigestRequired { .. }
                        | ckpt_store::StoreError::BadDigest { .. },
                    ..
                } => {
                    tracing::warn!(%peer, job, error = %e, "refused a partner copy");
                    Status::invalid_argument(e.to_string())
                }
                e => to_status(e),
            })?;
        Ok(took(begin.elapsed()))
    }

    pub(super) async fn send_call(
        &self,
        req: Request<pb::SendRequest>,
    ) -> Result<Response<<Self as Agent>::SendStream>, Status> {
        use tokio_stream::StreamExt;
        let peer = known_caller(
            &req,
            "Agent.Send",
            "a node of this cluster or the coordinator",
            &req.get_ref().node,
        )?;
        let r = req.get_ref();
        // A node fetches back its own images (or the coordinator asks on its behalf); the node
        // a restart moved a part to fetches that part's images with the coordinator's grant.
        let granted = match &peer {
            ckpt_auth::Peer::Daemon(ckpt_auth::Identity::Node(g)) => {
                self.grants
                    .permits(g, r.job_id, r.epoch, &r.node, &r.manifest_digest)
            }
            _ => false,
        };
        if !(peer.is_node(&r.node) || peer.is_coordinator() || granted) {
            let allowed = format!(
                "node {}, the coordinator, or a node the coordinator moved its part to",
                r.node
            );
            return Err(ckpt_auth::refuse(&req, "Agent.Send", &allowed));
        }
        let r = req.into_inner();
        let header = pb::ChunkHeader {
            job_id: r.job_id,
            epoch: r.epoch,
            node: r.node.clone(),
            ..Default::default()
        };
        let rx = crate::rpc::partner::chunks(
            self.jobs.node.node_dir(r.job_id, r.epoch, &r.node),
            header,
            r.manifest_digest,
            // A restore is waiting for this copy: it does not yield to checkpoints.
            std::sync::Arc::default(),
        );
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx).map(|c| c.map_err(to_status)),
        )))
    }

    pub(super) async fn allow_fetch_call(
        &self,
        req: Request<pb::AllowFetchRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        from_coordinator(&req, "Agent.AllowFetch")?;
        let r = req.into_inner();
        for n in [&r.node, &r.grantee] {
            if !ckpt_auth::valid_node_name(n) {
                return Err(Status::invalid_argument(format!(
                    "{n:?} is not a node name"
                )));
            }
        }
        if r.parity {
            if r.node != self.jobs.node() {
                return Err(Status::invalid_argument(format!(
                    "node {} grants reads of its own parity only, not {}'s",
                    self.jobs.node(),
                    r.node
                )));
            }
            self.grants.allow_parity(
                r.job_id,
                r.epoch,
                &r.grantee,
                std::time::Duration::from_millis(r.ttl_ms),
            );
            tracing::info!(job = r.job_id, epoch = r.epoch, grantee = %r.grantee,
                "allowed a node to read the parity kept here");
            return Ok(Response::new(pb::PhaseReply::default()));
        }
        if r.manifest_digest.is_empty() {
            return Err(Status::invalid_argument(
                "a grant names the committed manifest digest of the copy",
            ));
        }
        self.grants.allow(
            r.job_id,
            r.epoch,
            &r.node,
            &r.grantee,
            &r.manifest_digest,
            std::time::Duration::from_millis(r.ttl_ms),
        );
        tracing::info!(job = r.job_id, epoch = r.epoch, node = %r.node, grantee = %r.grantee,
            "allowed a moved part's node to fetch the partner copy kept here");
        Ok(Response::new(pb::PhaseReply::default()))
    }
}
