//! Registration with the coordinator and periodic reports of this node's jobs.
use std::sync::Arc;
use std::time::Duration;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::registry_client::RegistryClient;
use tracing::{debug, info, warn};

use crate::config::AgentConfig;
use crate::jobs::{Jobs, Observed};

/// How long one registration or heartbeat call may take: the coordinator answers from memory,
/// so a slow answer means it is down or unreachable. Less under a lease ([`call_timeout`]).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a call (or a connection to one address) may take under `lease`: a quarter of it,
/// so that a ckptd that hangs (a stopped process, a head node hung) is given up in time to reach
/// a standby that took over, or ckptd restarted, before the lease ends and the parts are fenced.
fn call_timeout(lease: Option<Duration>) -> Duration {
    match lease {
        Some(l) => (l / 4).clamp(Duration::from_millis(500), CALL_TIMEOUT),
        None => CALL_TIMEOUT,
    }
}

/// The reports of every job of this node whose lock is free.
pub fn reports(jobs: &Jobs) -> Vec<pb::JobReport> {
    let mut out = Vec::new();
    for j in jobs.snapshot() {
        let Ok(job) = j.try_lock() else { continue };
        let observed = job.observe(jobs.node.host.as_ref());
        if observed != Observed::Running {
            // The job is over on this node (ended, or its shim gone with it): its (empty)
            // cgroup is not needed until a restore, which creates it again.
            job.remove_empty_cgroup();
        }
        if observed != Observed::Running && job.record.sandbox.is_some() {
            // Nor is its sandbox's network namespace, whose job address would otherwise stay
            // on the network (a restore elsewhere needs it). Only a part in a sandbox has one:
            // the path is a machine-wide name another agent may use.
            // The removal runs later, under the job's lock, and only if the part is still
            // this incarnation and still not running: a restore that took the lock first has
            // made a namespace of the same name for its new incarnation.
            let netns = jobs.node.netns(job.id());
            if netns.exists() {
                let incarnation = job.incarnation();
                let j = Arc::clone(&j);
                let host = Arc::clone(&jobs.node.host);
                tokio::spawn(async move {
                    let job = j.lock().await;
                    if job.incarnation() == incarnation
                        && job.observe(host.as_ref()) != Observed::Running
                    {
                        crate::os::sandbox::remove(&netns).await;
                    }
                });
            }
        }
        if observed == Observed::Running {
            jobs.node.exits.track(
                job.id(),
                job.incarnation(),
                &job.cgroup.pids().unwrap_or_default(),
                crate::os::procfs::mpi_rank,
            );
        }
        let (state, end) = observed.to_wire();
        let fenced = (observed != Observed::Running)
            .then(|| {
                crate::shim::read_json::<crate::rpc::lease::Fenced>(
                    &job.run_dir().join(crate::rpc::lease::FENCED),
                )
            })
            .flatten();
        out.push(pb::JobReport {
            job_id: job.id(),
            state: state.into(),
            end,
            incarnation: job.incarnation(),
            fenced_after_ms: fenced.map_or(0, |f| f.after_ms.max(1)),
            killed: jobs
                .node
                .exits
                .killed(job.id(), job.incarnation())
                .unwrap_or_default(),
        });
    }
    out
}

/// Runs [`run`] on a thread and a runtime of its own, so that no other work of the agent (a
/// dump's blocking steps, a restore's copies, a flood of calls) delays a heartbeat: a late one
/// costs the node its lease. The heartbeats stop when the returned handle is dropped.
pub fn spawn(
    cfg: AgentConfig,
    advertise: String,
    dial: ckpt_auth::transport::Dial,
    jobs: Arc<Jobs>,
) -> std::io::Result<tokio::sync::oneshot::Sender<()>> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("heartbeat".into())
        .spawn(move || {
            rt.block_on(async move {
                tokio::select! {
                    _ = run(cfg, advertise, dial, jobs) => {}
                    _ = stopped => {}
                }
            })
        })?;
    Ok(stop)
}

/// Registers, then heartbeats every `heartbeat_interval`; re-registers after any failure
/// (for example a restarted coordinator). `dial` says how the coordinator is reached (TLS with
/// this node's credential, or its local socket).
pub async fn run(
    cfg: AgentConfig,
    advertise: String,
    dial: ckpt_auth::transport::Dial,
    jobs: Arc<Jobs>,
) {
    let mut registered = false;
    let mut client: Option<RegistryClient<tonic::transport::Channel>> = None;
    // ckptd and its standbys: one address at a time, the next after a failed call, so that one
    // that hangs is given up after a call's timeout however the list is ordered.
    let addresses = ckpt_auth::transport::addresses(&cfg.coordinator);
    // With one ckptd there is nowhere else to go: a slow answer is waited for as long as ever
    // and the connection kept (a new TLS handshake costs a loaded node more than it saves).
    let standbys = addresses.len() > 1;
    let mut at = 0;
    loop {
        let timeout = if standbys {
            call_timeout(jobs.node.lease.granted())
        } else {
            CALL_TIMEOUT
        };
        let coordinator = addresses
            .get(at % addresses.len().max(1))
            .map_or("", String::as_str);
        if client.is_none() {
            match ckpt_auth::transport::channel(coordinator, dial.clone(), timeout) {
                Ok(ch) => client = Some(RegistryClient::new(ch)),
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
                host_addresses: crate::os::procfs::local_addresses()
                    .iter()
                    .map(|a| a.to_string())
                    .collect(),
                hostname: crate::config::hostname(),
                shared_dir: jobs
                    .node
                    .shared_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default(),
                engines: jobs
                    .engines()
                    .list()
                    .into_iter()
                    .map(|(name, version)| pb::EngineInfo { name, version })
                    .collect(),
                rdma_devices: crate::config::rdma_devices(std::path::Path::new(
                    crate::config::RDMA_CLASS,
                )),
            };
            let sent = crate::rpc::lease::boottime_ms();
            match tokio::time::timeout(timeout, c.register(req)).await {
                Ok(Ok(r)) => {
                    info!(coordinator, "registered");
                    renew(&jobs, sent, r.get_ref().lease_ms, r.get_ref().fence);
                    registered = true;
                }
                Ok(Err(e))
                    if matches!(
                        e.code(),
                        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated
                    ) =>
                {
                    warn!(error = %e.message(), "the coordinator refused the registration; retrying");
                }
                Ok(Err(e)) => {
                    debug!(coordinator, error = %e, "registration failed; retrying");
                    next(&mut client, &mut at, standbys);
                }
                Err(_) => {
                    debug!(coordinator, "registration timed out; retrying");
                    next(&mut client, &mut at, standbys);
                }
            }
        } else {
            let (staging_free_bytes, staging_total_bytes) =
                jobs.node.staging.space().unwrap_or((0, 0));
            let req = pb::HeartbeatRequest {
                node: cfg.node_name.clone(),
                jobs: reports(&jobs),
                staging_free_bytes,
                staging_total_bytes,
            };
            let sent = crate::rpc::lease::boottime_ms();
            match tokio::time::timeout(timeout, c.heartbeat(req)).await {
                Ok(Ok(r)) => renew(&jobs, sent, r.get_ref().lease_ms, r.get_ref().fence),
                Ok(Err(e)) => {
                    warn!(coordinator, error = %e, "heartbeat failed; registering again");
                    registered = false;
                    next(&mut client, &mut at, standbys);
                }
                Err(_) => {
                    warn!(coordinator, "heartbeat timed out; registering again");
                    registered = false;
                    next(&mut client, &mut at, standbys);
                }
            }
        }
        tokio::time::sleep(interval(cfg.heartbeat_interval, jobs.node.lease.granted())).await;
    }
}

/// After a failed call: with standbys, the next address on a new connection (the one that
/// failed may be to a ckptd that hangs, where a standby now serves); with one ckptd, the same
/// connection, which reconnects by itself when it broke.
fn next(
    client: &mut Option<RegistryClient<tonic::transport::Channel>>,
    at: &mut usize,
    standbys: bool,
) {
    if standbys {
        *client = None;
        *at += 1;
    }
}

/// Renews the node's lease with ckptd's answer to a call sent at `sent` (`CLOCK_BOOTTIME`, ms),
/// and warns when the lease had run more than half out: at its end the shims kill the node's
/// job parts. Learns the answering ckptd's `fence` ([`ckpt_proto::FenceGuard`]).
fn renew(jobs: &Jobs, sent: u64, lease_ms: u64, fence: u64) {
    jobs.node.leader_fence.raise(fence);
    if let Some(unrenewed) = jobs.node.lease.renew(sent, lease_ms) {
        warn!(
            unrenewed_ms = unrenewed.as_millis() as u64,
            lease_ms,
            "ckptd's answer came late, past half of this node's lease: had none come within the lease, this node's parts of jobs with a restart policy (--on-failure restart) would have been killed (fenced); a ckptd or a node this loaded needs a longer node_timeout and fence_lease in ckptd.toml"
        );
    }
}

/// How long to wait between heartbeats: the configured interval, or less, so that at least
/// three heartbeats fit in the lease (one lost or slow call must not fence the node).
fn interval(configured: Duration, lease: Option<Duration>) -> Duration {
    match lease {
        Some(l) => configured.min(l / 4).max(Duration::from_millis(20)),
        None => configured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_given_up_within_a_quarter_of_the_lease() {
        assert_eq!(call_timeout(None), CALL_TIMEOUT);
        assert_eq!(
            call_timeout(Some(Duration::from_secs(5))),
            Duration::from_millis(1250)
        );
        assert_eq!(
            call_timeout(Some(Duration::from_secs(1))),
            Duration::from_millis(500)
        );
        assert_eq!(call_timeout(Some(Duration::from_secs(60))), CALL_TIMEOUT);
    }

    #[test]
    fn heartbeats_fit_several_times_in_the_lease() {
        let s = Duration::from_secs;
        assert_eq!(interval(s(1), None), s(1));
        assert_eq!(interval(s(1), Some(s(5))), s(1));
        assert_eq!(interval(s(1), Some(s(2))), Duration::from_millis(500));
        assert_eq!(
            interval(s(1), Some(Duration::ZERO)),
            Duration::from_millis(20)
        );
    }
}
