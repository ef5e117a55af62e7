//! Registration with the coordinator and periodic reports of this node's jobs.
use std::sync::Arc;
use std::time::Duration;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::registry_client::RegistryClient;
use tracing::{debug, info, warn};

use crate::config::AgentConfig;
use crate::jobs::{Jobs, Observed};

/// How long one registration or heartbeat call may take: the coordinator answers from memory,
/// so a slow answer means it is down or unreachable.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The reports of every job of this node whose lock is free.
pub fn reports(jobs: &Jobs) -> Vec<pb::JobReport> {
    let mut out = Vec::new();
    for j in jobs.snapshot() {
        let Ok(job) = j.try_lock() else { continue };
        let (state, code, signal) = match job.observe() {
            Observed::Running => ("running", None, None),
            Observed::Exited(e) => {
                // The job is over on this node: its (empty) cgroup is not needed until a
                // restore, which creates it again.
                job.remove_empty_cgroup();
                ("exited", e.code, e.signal)
            }
            Observed::Lost => ("absent", None, None),
        };
        out.push(pb::JobReport {
            job_id: job.id(),
            state: state.into(),
            exit_code: code,
            exit_signal: signal,
            incarnation: job.incarnation(),
        });
    }
    out
}

/// Registers, then heartbeats every `heartbeat_interval`; re-registers after any failure
/// (for example a restarted coordinator).
pub async fn run(cfg: AgentConfig, advertise: String, jobs: Arc<Jobs>) {
    let url = format!("http://{}", cfg.coordinator);
    let mut registered = false;
    let mut client: Option<RegistryClient<tonic::transport::Channel>> = None;
    loop {
        if client.is_none() {
            match tonic::transport::Endpoint::from_shared(url.clone()) {
                Ok(ep) => {
                    client = Some(RegistryClient::new(ep.timeout(CALL_TIMEOUT).connect_lazy()));
                }
                Err(e) => {
                    warn!(coordinator = %cfg.coordinator, error = %e, "bad coordinator address");
                    return;
                }
            }
        }
        let c = client.as_mut().expect("set above");
        if !registered {
            let req = pb::RegisterRequest {
                node: cfg.node_name.clone(),
                address: advertise.clone(),
                version: env!("CARGO_PKG_VERSION").into(),
                engine: jobs.engine().name().into(),
                engine_version: jobs.engine().version().into(),
                host_addresses: crate::procfs::local_addresses()
                    .iter()
                    .map(|a| a.to_string())
                    .collect(),
                shared_dir: jobs
                    .shared_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default(),
            };
            match c.register(req).await {
                Ok(_) => {
                    info!(coordinator = %cfg.coordinator, "registered");
                    registered = true;
                }
                Err(e) => debug!(error = %e, "registration failed; retrying"),
            }
        } else {
            let req = pb::HeartbeatRequest {
                node: cfg.node_name.clone(),
                jobs: reports(&jobs),
            };
            if let Err(e) = c.heartbeat(req).await {
                warn!(error = %e, "heartbeat failed; registering again");
                registered = false;
            }
        }
        tokio::time::sleep(cfg.heartbeat_interval).await;
    }
}
