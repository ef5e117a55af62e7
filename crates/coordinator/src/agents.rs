//! The agents that have registered, with a gRPC client to each, and the wrapper every call to
//! an agent goes through: a deadline, and a failure that names the node.
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use ckpt_proto::v1::agent_client::AgentClient;
use tonic::transport::Channel;

/// Connecting (TCP and the TLS handshake) to an agent on the cluster network takes
/// milliseconds; one that has not answered in this long is down.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How an agent call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The agent could not be reached.
    Unreachable,
    /// It did not answer within the deadline.
    Deadline,
    /// It refused: wrong state, unknown job, verbs without channel.
    Refused,
    /// The job is unknown there.
    NotFound,
    /// Images are corrupt or missing.
    DataLoss,
    /// Staging is full.
    NoRoom,
    /// Anything else (engine failure, I/O).
    Internal,
}

/// A failed call to one agent.
#[derive(Debug, Clone, thiserror::Error)]
#[error("node {node}: {message}")]
pub struct NodeFailure {
    /// Node name.
    pub node: String,
    /// Category.
    pub kind: FailureKind,
    /// What the agent said, or what happened.
    pub message: String,
}

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

/// The failure a node's error status means; `what` names the step.
pub fn from_status(node: &str, what: &str, s: &tonic::Status) -> NodeFailure {
    use tonic::Code;
    let kind = match s.code() {
        Code::Unavailable | Code::Unknown | Code::Cancelled => FailureKind::Unreachable,
        Code::DeadlineExceeded => FailureKind::Deadline,
        Code::FailedPrecondition | Code::InvalidArgument => FailureKind::Refused,
        Code::NotFound => FailureKind::NotFound,
        Code::DataLoss => FailureKind::DataLoss,
        Code::ResourceExhausted => FailureKind::NoRoom,
        _ => FailureKind::Internal,
    };
    let message = if kind == FailureKind::Unreachable {
        format!("agent unreachable during {what} ({})", s.message())
    } else {
        s.message().to_string()
    };
    NodeFailure {
        node: node.into(),
        kind,
        message,
    }
}

#[derive(Debug, Clone)]
struct Entry {
    address: String,
    host_addresses: Vec<String>,
    shared_dir: String,
    client: AgentClient<Channel>,
    last_seen: Instant,
}

/// Registered agents by node name.
#[derive(Debug, Default)]
pub struct Agents {
    map: RwLock<BTreeMap<String, Entry>>,
}

impl Agents {
    /// Records a registration (a re-registration replaces the address and client).
    pub fn register(
        &self,
        node: &str,
        address: &str,
        host_addresses: Vec<String>,
        shared_dir: String,
        dial: ckpt_auth::transport::Dial,
    ) -> Result<(), String> {
        let channel = ckpt_auth::transport::channel(address, dial, AGENT_CONNECT_TIMEOUT)
            .map_err(|e| format!("bad agent address {address:?}: {e}"))?;
        let client = AgentClient::new(channel);
        self.map.write().expect("agents lock").insert(
            node.to_string(),
            Entry {
                address: address.to_string(),
                host_addresses,
                shared_dir,
                client,
                last_seen: Instant::now(),
            },
        );
        Ok(())
    }

    /// Records a heartbeat; false if the node is not registered.
    pub fn seen(&self, node: &str) -> bool {
        match self.map.write().expect("agents lock").get_mut(node) {
            Some(e) => {
                e.last_seen = Instant::now();
                true
            }
            None => false,
        }
    }

    /// A client for a node.
    pub fn client(&self, node: &str) -> Result<AgentClient<Channel>, NodeFailure> {
        self.map
            .read()
            .expect("agents lock")
            .get(node)
            .map(|e| e.client.clone())
            .ok_or_else(|| NodeFailure {
                node: node.into(),
                kind: FailureKind::Unreachable,
                message: "no agent is registered for this node (is ckpt-agent running there and pointed at this ckptd?)"
                    .into(),
            })
    }

    /// Opens a node's epoch stream (the call leaves with the first phase sent over it).
    pub fn open_epoch(&self, node: &str) -> Result<crate::link::GrpcLink, NodeFailure> {
        Ok(crate::link::GrpcLink::open(node, self.client(node)?))
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
        F: FnOnce(AgentClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let client = self.client(node)?;
        call(node, what, deadline, f(client)).await
    }

    /// The node whose agent listens on `ip`, or that has `ip` among its interface addresses.
    pub fn node_with_address(&self, ip: &str) -> Option<String> {
        let agent_ip = |a: &str| {
            a.parse::<std::net::SocketAddr>()
                .map(|s| s.ip().to_string())
                .unwrap_or_else(|_| a.rsplit_once(':').map_or(a, |(h, _)| h).to_string())
        };
        self.map
            .read()
            .expect("agents lock")
            .iter()
            .find(|(_, e)| agent_ip(&e.address) == ip || e.host_addresses.iter().any(|a| a == ip))
            .map(|(n, _)| n.clone())
    }

    /// The shared storage mount a node flushes to, if it has one and is registered.
    pub fn shared_dir(&self, node: &str) -> Option<String> {
        self.map
            .read()
            .expect("agents lock")
            .get(node)
            .map(|e| e.shared_dir.clone())
            .filter(|d| !d.is_empty())
    }

    /// Whether every node is registered.
    pub fn all_registered(&self, nodes: &[String]) -> bool {
        let m = self.map.read().expect("agents lock");
        nodes.iter().all(|n| m.contains_key(n))
    }

    /// A node's agent address.
    pub fn address(&self, node: &str) -> Option<String> {
        self.map
            .read()
            .expect("agents lock")
            .get(node)
            .map(|e| e.address.clone())
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
                    e.address.clone(),
                    e.last_seen.elapsed().as_secs(),
                )
            })
            .collect()
    }
}
