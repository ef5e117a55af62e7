//! The Agent gRPC service: maps each protocol call onto [`Jobs`] and each [`AgentError`]
//! variant onto a status code. Library errors never carry tonic types; this is the only place
//! where a `Status` is made.
use std::collections::BTreeMap;
use std::sync::Arc;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_server::Agent;
use tonic::{Request, Response, Status};

use crate::error::AgentError;
use crate::jobs::{exit_text, Jobs, LaunchSpec, Observed};

/// Handler of the Agent service.
#[derive(Debug, Clone)]
pub struct AgentHandler {
    jobs: Arc<Jobs>,
}

impl AgentHandler {
    /// Handler over a node's jobs.
    pub fn new(jobs: Arc<Jobs>) -> Self {
        AgentHandler { jobs }
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
        | AgentError::AddressMissing { .. }
        | AgentError::OutsideTree { .. } => Status::failed_precondition(msg),
        AgentError::BadToken { .. } => Status::permission_denied(msg),
        AgentError::NoRoom { .. } => Status::resource_exhausted(msg),
        AgentError::Store { .. } | AgentError::ManifestMismatch { .. } => Status::data_loss(msg),
        AgentError::Timeout { .. } => Status::deadline_exceeded(msg),
        AgentError::Engine { .. }
        | AgentError::Cgroup { .. }
        | AgentError::Start { .. }
        | AgentError::Io { .. }
        | AgentError::Injected { .. } => Status::internal(msg),
    }
}

fn us(d: std::time::Duration) -> u64 {
    d.as_micros() as u64
}

/// The reply of a step that took `d` and froze nothing.
fn took(d: std::time::Duration) -> Response<pb::PhaseReply> {
    Response::new(pb::PhaseReply {
        elapsed_us: us(d),
        frozen_us: 0,
    })
}

#[tonic::async_trait]
impl Agent for AgentHandler {
    async fn launch(
        &self,
        req: Request<pb::LaunchRequest>,
    ) -> Result<Response<pb::LaunchReply>, Status> {
        let r = req.into_inner();
        let spec = LaunchSpec {
            job: r.job_id,
            argv: r.argv,
            cwd: r.cwd.into(),
            env: r.env.into_iter().collect::<BTreeMap<_, _>>(),
            uid: r.uid,
            gid: r.gid,
            groups: r.groups,
            token: r.token,
            part: r.part,
        };
        let (pid, incarnation) = self.jobs.launch(spec).await.map_err(to_status)?;
        Ok(Response::new(pb::LaunchReply {
            pid,
            job_dir: self.jobs.job_dir(r.job_id).display().to_string(),
            incarnation,
        }))
    }

    async fn prepare(
        &self,
        req: Request<pb::PhaseRequest>,
    ) -> Result<Response<pb::PrepareReply>, Status> {
        let r = req.into_inner();
        let p = self
            .jobs
            .prepare(r.job_id, r.epoch)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::PrepareReply {
            processes: p.processes,
            estimated_bytes: p.estimated_bytes,
            staging_free_bytes: p.staging_free_bytes,
        }))
    }

    async fn quiesce(
        &self,
        req: Request<pb::PhaseRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        let r = req.into_inner();
        let d = self
            .jobs
            .quiesce(r.job_id, r.epoch)
            .await
            .map_err(to_status)?;
        Ok(took(d))
    }

    async fn dump(
        &self,
        req: Request<pb::PhaseRequest>,
    ) -> Result<Response<pb::DumpReply>, Status> {
        let r = req.into_inner();
        let (d, frozen) = self.jobs.dump(r.job_id, r.epoch).await.map_err(to_status)?;
        Ok(Response::new(pb::DumpReply {
            elapsed_us: us(d),
            frozen_us: us(frozen),
        }))
    }

    async fn resume(
        &self,
        req: Request<pb::ResumeRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        let r = req.into_inner();
        let (d, frozen) = self
            .jobs
            .resume(r.job_id, r.epoch, r.kill)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::PhaseReply {
            elapsed_us: us(d),
            frozen_us: us(frozen),
        }))
    }

    async fn finalize(
        &self,
        req: Request<pb::PhaseRequest>,
    ) -> Result<Response<pb::FinalizeReply>, Status> {
        let r = req.into_inner();
        let f = self
            .jobs
            .finalize(r.job_id, r.epoch)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::FinalizeReply {
            image_bytes: f.image_bytes,
            image_files: f.image_files,
            manifest_digest: f.manifest_digest,
        }))
    }

    async fn abort(
        &self,
        req: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        let r = req.into_inner();
        self.jobs
            .abort(r.job_id, r.epoch, &r.reason)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::PhaseReply::default()))
    }

    async fn restore(
        &self,
        req: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreReply>, Status> {
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        let (pid, incarnation) = self
            .jobs
            .restore(r.job_id, r.epoch, &r.manifest_digest, r.hold, &r.token)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::RestoreReply {
            pid,
            incarnation,
            elapsed_us: us(begin.elapsed()),
        }))
    }

    async fn signal(
        &self,
        req: Request<pb::SignalRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        let r = req.into_inner();
        self.jobs
            .signal(r.job_id, r.signal)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::PhaseReply::default()))
    }

    async fn inspect(
        &self,
        req: Request<pb::InspectRequest>,
    ) -> Result<Response<pb::NodeJobInfo>, Status> {
        let r = req.into_inner();
        let (observed, part, procs) = self.jobs.processes(r.job_id).await.map_err(to_status)?;
        Ok(Response::new(pb::NodeJobInfo {
            node: self.jobs.node().to_string(),
            state: observed_text(&observed),
            processes: procs
                .into_iter()
                .map(|(p, rank)| pb::ProcessInfo {
                    pid: p.pid,
                    comm: p.comm,
                    state: p.state.to_string(),
                    rank,
                })
                .collect(),
            role: if part == 0 { "launcher" } else { "attached" }.into(),
        }))
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        self.jobs
            .release(r.job_id, r.kill)
            .await
            .map_err(to_status)?;
        Ok(took(begin.elapsed()))
    }

    async fn verify(
        &self,
        req: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::NodeVerify>, Status> {
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        let node = self.jobs.node().to_string();
        let reply = match self
            .jobs
            .verify(r.job_id, r.epoch, &r.manifest_digest)
            .await
        {
            Ok(m) => pb::NodeVerify {
                node,
                ok: true,
                files: m.files.len() as u32,
                bytes: m.image_bytes(),
                error: String::new(),
                elapsed_ms: begin.elapsed().as_millis() as u64,
            },
            // A damaged image is this call's answer, not its failure.
            Err(e) => pb::NodeVerify {
                node,
                ok: false,
                error: e.to_string(),
                elapsed_ms: begin.elapsed().as_millis() as u64,
                ..Default::default()
            },
        };
        Ok(Response::new(reply))
    }

    async fn prune(
        &self,
        req: Request<pb::PruneRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        let r = req.into_inner();
        let begin = std::time::Instant::now();
        self.jobs
            .prune(r.job_id, &r.epochs)
            .await
            .map_err(to_status)?;
        Ok(took(begin.elapsed()))
    }

    async fn poll(&self, req: Request<pb::PollRequest>) -> Result<Response<pb::PollReply>, Status> {
        let r = req.into_inner();
        let p = self
            .jobs
            .poll(r.job_id, &r.token, r.stdout_offset, r.stderr_offset)
            .await
            .map_err(to_status)?;
        let (state, exit_code, exit_signal) = match p.observed {
            Observed::Exited(e) => ("exited", e.code, e.signal),
            Observed::Lost => ("absent", None, None),
            Observed::Running => ("running", None, None),
        };
        Ok(Response::new(pb::PollReply {
            stdout: p.stdout,
            stderr: p.stderr,
            state: state.into(),
            exit_code,
            exit_signal,
        }))
    }
}

/// Wire text of an observed state.
pub fn observed_text(o: &Observed) -> String {
    match o {
        Observed::Running => "running".into(),
        Observed::Exited(e) => exit_text(e),
        Observed::Lost => "absent".into(),
    }
}
