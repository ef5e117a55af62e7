//! The agents that have registered, with a gRPC client to each, and the wrapper every call to
//! an agent goes through: a deadline, and a failure that names the node.
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use ckpt_proto::{Engine, FencedAgentClient};

use crate::link::EpochLink;
use ckpt_proto::now_ms;

pub use crate::failure::{from_status, FailureKind, NodeFailure, UNREACHABLE_FIX};

/// Connecting (TCP and the TLS handshake) to an agent on the cluster network takes
/// milliseconds; one that has not answered in this long is down.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Calls an agent with a deadline; `what` names the step in the error.
pub async fn call<T>(
    node: &str,
    what: &str,
    deadline: Duration,
    fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, NodeFailure> {
    match tokio::time::timeout(deadline, fut).await {
        Err(_) => Err(NodeFailure {
            node: node.into(),
            kind: FailureKind::Deadline,
            message: format!(
                "{what} did not finish within the {} deadline",
                humantime::format_duration(deadline)
            ),
        }),
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(from_status(node, what, &s)),
    }
}

/// Jobs whose epoch streams a node keeps open between epochs, at most: a job checkpointed
/// again reuses its stream and saves the call's setup (a third of a phase round at 1,024 nodes).
const IDLE_EPOCH_LINKS: usize = 256;

/// The failure of a call to a node without an agent.
fn not_registered(node: &str) -> NodeFailure {
    NodeFailure {
        node: node.into(),
        kind: FailureKind::Unreachable,
        message: "no agent is registered for this node (is ckpt-agent running there and pointed at this ckptd?)"
            .into(),
    }
}

/// What an agent says of its node when it registers.
#[derive(Debug, Clone, Default)]
pub struct Registration {
    /// host:port where it serves (or `unix:PATH` for a standalone ckptd's own agent).
    pub address: String,
    /// Its interfaces' addresses and its host name.
    pub host_addresses: Vec<String>,
    /// The shared storage mount it flushes to; empty if none.
    pub shared_dir: String,
    /// Its snapshot engines: (name, version).
    pub engines: Vec<(String, String)>,
    /// The agent's version.
    pub version: String,
    /// The node's RDMA devices.
    pub rdma_devices: Vec<String>,
}

#[derive(Debug)]
struct Entry {
    info: Registration,
    client: FencedAgentClient,
    last_seen: Instant,
    /// The same moment on the wall clock (ms since the Unix epoch).
    last_seen_unix_ms: u64,
    /// Node-local staging as of the last heartbeat that reported it: (free, total) bytes.
    staging: Option<(u64, u64)>,
    /// Which registration this is: links opened under an earlier one are not kept.
    generation: u64,
    /// Epoch streams left open by a job's last committed epoch, by job.
    idle: BTreeMap<u64, std::sync::Mutex<Box<dyn EpochLink>>>,
}

/// A registered agent as `ckptctl nodes` shows it.
#[derive(Debug, Clone)]
pub struct AgentView {
    /// Node name.
    pub node: String,
    /// What it registered with.
    pub info: Registration,
    /// Since its last heartbeat (or registration).
    pub since_seen: Duration,
    /// Its last heartbeat (ms since the Unix epoch).
    pub last_seen_unix_ms: u64,
    /// Staging (free, total) bytes, if reported.
    pub staging: Option<(u64, u64)>,
}

/// Registered agents by node name.
#[derive(Debug, Default)]
pub struct Agents {
    map: RwLock<BTreeMap<String, Entry>>,
    registrations: std::sync::atomic::AtomicU64,
    /// Put on every call to an agent ([`ckpt_proto::FenceGuard`]).
    fence: Option<u64>,
}

impl Agents {
    /// No agent yet; every call to one will carry `fence`.
    pub fn fenced(fence: Option<u64>) -> Self {
        Agents {
            fence,
            ..Agents::default()
        }
    }

    /// The fence every call to an agent carries.
    pub fn fence(&self) -> Option<u64> {
        self.fence
    }

    /// Records a registration (a re-registration replaces the address and client).
    pub fn register(
        &self,
        node: &str,
        info: Registration,
        dial: ckpt_auth::transport::Dial,
    ) -> Result<(), String> {
        let address = &info.address;
        // One agent address per node: a node cannot take another's (the address is what ckptd
        // dials, and where jobs' hosts are found by address).
        if let Some((other, _)) = self
            .map
            .read()
            .expect("agents lock")
            .iter()
            .find(|(n, e)| n.as_str() != node && e.info.address == *address)
        {
            return Err(format!(
                "agent address {address:?} is node {other}'s: a node registers only its own address (if {other} moved, stop its agent first)"
            ));
        }
        let channel = ckpt_auth::transport::channel(address, dial, AGENT_CONNECT_TIMEOUT)
            .map_err(|e| format!("bad agent address {address:?}: {e}"))?;
        let client = ckpt_proto::fenced_agent(channel, self.fence);
        self.map.write().expect("agents lock").insert(
            node.to_string(),
            Entry {
                info,
                client,
                last_seen: Instant::now(),
                last_seen_unix_ms: now_ms(),
                staging: None,
                generation: self
                    .registrations
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                idle: BTreeMap::new(),
            },
        );
        Ok(())
    }

    /// Every registered agent, by node name.
    pub fn views(&self) -> Vec<AgentView> {
        self.map
            .read()
            .expect("agents lock")
            .iter()
            .map(|(n, e)| AgentView {
                node: n.clone(),
                info: e.info.clone(),
                since_seen: e.last_seen.elapsed(),
                last_seen_unix_ms: e.last_seen_unix_ms,
                staging: e.staging,
            })
            .collect()
    }

    /// A link for one epoch of `job` on `node`: the stream its last epoch left open if it is
    /// still whole, else a new one. Returns the registration it belongs to, for
    /// [`Agents::keep_epoch_link`].
    pub fn epoch_link(
        &self,
        node: &str,
        job: u64,
    ) -> Result<(Box<dyn EpochLink>, u64), NodeFailure> {
        let mut m = self.map.write().expect("agents lock");
        let e = m.get_mut(node).ok_or_else(|| not_registered(node))?;
        if let Some(l) = e.idle.remove(&job) {
            let l = l.into_inner().expect("idle link lock");
            if l.reusable() {
                return Ok((l, e.generation));
            }
        }
        let link = crate::link::GrpcLink::open(node, e.client.clone());
        Ok((Box::new(link), e.generation))
    }

    /// Keeps a job's link to a node for its next epoch, if the node has not registered again
    /// since it was opened and every command on it was answered.
    pub fn keep_epoch_link(&self, node: &str, job: u64, link: Box<dyn EpochLink>, generation: u64) {
        let mut m = self.map.write().expect("agents lock");
        if let Some(e) = m.get_mut(node) {
            if e.generation == generation
                && link.reusable()
                && (e.idle.len() < IDLE_EPOCH_LINKS || e.idle.contains_key(&job))
            {
                e.idle.insert(job, std::sync::Mutex::new(link));
            }
        }
    }

    /// Closes the epoch streams a job left open (it ended, or restarts).
    pub fn forget_job(&self, job: u64) {
        for e in self.map.write().expect("agents lock").values_mut() {
            e.idle.remove(&job);
        }
    }

    /// The snapshot engines `node`'s agent reported: (name, version); none if it is not
    /// registered.
    pub fn engines(&self, node: &str) -> Vec<(String, String)> {
        self.map
            .read()
            .expect("agents lock")
            .get(node)
            .map(|e| e.info.engines.clone())
            .unwrap_or_default()
    }

    /// Whether `node` has the engine `name`. An agent that reports no engines at all is of a
    /// version before engines were reported, and has CRIU only.
    pub fn has_engine(&self, node: &str, engine: Engine) -> bool {
        let has = self.engines(node);
        match has.is_empty() {
            true => engine == Engine::Criu,
            false => has.iter().any(|(n, _)| n == engine.as_str()),
        }
    }

    /// Records a heartbeat, with the staging space it reported (free, total bytes) if any;
    /// false if the node is not registered.
    pub fn seen(&self, node: &str, staging: Option<(u64, u64)>) -> bool {
        match self.map.write().expect("agents lock").get_mut(node) {
            Some(e) => {
                e.last_seen = Instant::now();
                e.last_seen_unix_ms = now_ms();
                if staging.is_some() {
                    e.staging = staging;
                }
                true
            }
            None => false,
        }
    }

    /// A client for a node.
    pub fn client(&self, node: &str) -> Result<FencedAgentClient, NodeFailure> {
        self.map
            .read()
            .expect("agents lock")
            .get(node)
            .map(|e| e.client.clone())
            .ok_or_else(|| not_registered(node))
    }

    /// Calls a node's agent with a deadline; `f` makes the call on the node's client.
    pub async fn call<T, F, Fut>(
        &self,
        node: &str,
        what: &str,
        deadline: Duration,
        f: F,
    ) -> Result<T, NodeFailure>
    where
        F: FnOnce(FencedAgentClient) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let client = self.client(node)?;
        call(node, what, deadline, f(client)).await
    }

    /// The node whose agent listens on `ip`, else the one node that has `ip` among the
    /// interface addresses (or as the host name) it reported. The agent's address comes first:
    /// ckptd dials it and checks the node's credential there on every call, where the other
    /// names are only what the node said. A name two nodes report is nobody's: a node that
    /// reports another's addresses must not receive that node's parts.
    pub fn node_with_address(&self, ip: &str) -> Option<String> {
        let agent_ip = |a: &str| {
            a.parse::<std::net::SocketAddr>()
                .map(|s| s.ip().to_string())
                .unwrap_or_else(|_| a.rsplit_once(':').map_or(a, |(h, _)| h).to_string())
        };
        let map = self.map.read().expect("agents lock");
        let only = |found: Vec<&String>| (found.len() == 1).then(|| found[0].clone());
        only(
            map.iter()
                .filter(|(_, e)| agent_ip(&e.info.address) == ip)
                .map(|(n, _)| n)
                .collect(),
        )
        .or_else(|| {
            only(
                map.iter()
                    .filter(|(_, e)| e.info.host_addresses.iter().any(|a| a == ip))
                    .map(|(n, _)| n)
                    .collect(),
            )
        })
    }

    /// The shared storage mount a node flushes to, if it has one and is registered.
    pub fn shared_dir(&self, node: &str) -> Option<String> {
        self.map
            .read()
            .expect("agents lock")
            .get(node)
            .map(|e| e.info.shared_dir.clone())
            .filter(|d| !d.is_empty())
    }

    /// Whether every node is registered.
    pub fn all_registered(&self, nodes: &[String]) -> bool {
        let m = self.map.read().expect("agents lock");
        nodes.iter().all(|n| m.contains_key(n))
    }

    /// Whether a node's agent is registered and sent a heartbeat within `timeout`.
    pub fn up(&self, node: &str, timeout: Duration) -> bool {
        self.map
            .read()
            .expect("agents lock")
            .get(node)
            .is_some_and(|e| e.last_seen.elapsed() <= timeout)
    }

    /// A node's agent address.
    pub fn address(&self, node: &str) -> Option<String> {
        self.map
            .read()
            .expect("agents lock")
            .get(node)
            .map(|e| e.info.address.clone())
    }

    /// Registered nodes with their address and seconds since the last heartbeat.
    pub fn list(&self) -> Vec<(String, String, u64)> {
        self.map
            .read()
            .expect("agents lock")
            .iter()
            .map(|(n, e)| {
                (
                    n.clone(),
                    e.info.address.clone(),
                    e.last_seen.elapsed().as_secs(),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration(address: &str, names: &[&str]) -> Registration {
        Registration {
            address: address.into(),
            host_addresses: names.iter().map(|n| n.to_string()).collect(),
            ..Registration::default()
        }
    }

    /// A compromised node claims n1's interface address and host name in its registration:
    /// n1's jobs' hosts still resolve to n1 (its agent listens there), a name both claim
    /// resolves to no one, and n1's own agent address cannot be taken.
    #[tokio::test]
    async fn a_node_cannot_take_another_nodes_addresses() {
        let a = Agents::default();
        let dial = || ckpt_auth::transport::Dial::LocalOnly;
        a.register(
            "n1",
            registration("10.0.0.1:7001", &["10.0.0.1", "node-one", "10.9.0.1"]),
            dial(),
        )
        .unwrap();
        a.register(
            "evil",
            registration("10.0.0.9:7001", &["10.0.0.9", "10.0.0.1", "node-one"]),
            dial(),
        )
        .unwrap();
        assert_eq!(a.node_with_address("10.0.0.1").as_deref(), Some("n1"));
        assert_eq!(
            a.node_with_address("node-one"),
            None,
            "claimed twice: nobody's"
        );
        assert_eq!(a.node_with_address("10.9.0.1").as_deref(), Some("n1"));
        assert_eq!(a.node_with_address("10.0.0.9").as_deref(), Some("evil"));
        let e = a
            .register("evil", registration("10.0.0.1:7001", &[]), dial())
            .unwrap_err();
        assert!(e.contains("node n1's"), "{e}");
        // n1 registering again (a restart of its agent) keeps its address.
        a.register("n1", registration("10.0.0.1:7001", &["10.0.0.1"]), dial())
            .unwrap();
    }
}
