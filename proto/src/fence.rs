//! Fencing a deposed coordinator out of the agents.
//!
//! With a replicated registry (etcd) one ckptd is active and others stand by. A ckptd that
//! hung (a stopped process, a stalled head node) and was replaced may run on for a moment
//! before it notices: a call it had in flight, or the next phase of an epoch it was driving,
//! would then reach the agents alongside the new ckptd's. Each ckptd that wins the leadership
//! gets a fence, the creation revision of the leadership key, which only grows from one winner
//! to the next. It puts it on every call to an agent (metadata [`FENCE_KEY`]), in the
//! grants it signs for relays, and in its answers to heartbeats. An agent keeps the highest
//! fence it has seen ([`FenceGuard`]) and refuses a call that carries a lower one. Calls
//! without a fence (a ckptd on the embedded registry, the agents' calls to each other) are not
//! fenced.
use std::sync::atomic::{AtomicU64, Ordering};

use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::v1::agent_client::AgentClient;

/// The metadata key of a call's fence (decimal).
pub const FENCE_KEY: &str = "ckpt-fence";

/// Puts the fence on every call (`None`: nothing, unfenced).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fence(pub Option<u64>);

impl tonic::service::Interceptor for Fence {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(f) = self.0 {
            req.metadata_mut().insert(FENCE_KEY, MetadataValue::from(f));
        }
        Ok(req)
    }
}

/// A channel to an agent whose calls carry a [`Fence`].
pub type FencedChannel = InterceptedService<Channel, Fence>;

/// An agent client whose calls carry a [`Fence`].
pub type FencedAgentClient = AgentClient<FencedChannel>;

/// An agent client over `channel` whose calls carry `fence`.
pub fn fenced_agent(channel: Channel, fence: Option<u64>) -> FencedAgentClient {
    AgentClient::with_interceptor(channel, Fence(fence))
}

/// The fence a call carries: `None` without one, an `InvalidArgument` status if it is not a
/// number.
pub fn fence_of<T>(req: &Request<T>) -> Result<Option<u64>, Status> {
    match req.metadata().get(FENCE_KEY) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.parse().ok())
            .map(Some)
            .ok_or_else(|| Status::invalid_argument(format!("{FENCE_KEY} is not a number"))),
    }
}

/// The highest fence an agent has seen; a call with a lower one comes from a deposed ckptd.
#[derive(Debug, Default)]
pub struct FenceGuard(AtomicU64);

impl FenceGuard {
    /// Lets a call with `fence` through (raising the highest seen), or refuses it, naming both.
    pub fn admit(&self, fence: Option<u64>) -> Result<(), Status> {
        let Some(f) = fence.filter(|&f| f > 0) else {
            return Ok(());
        };
        let seen = self.0.fetch_max(f, Ordering::SeqCst);
        if f < seen {
            return Err(Status::failed_precondition(format!(
                "refused: this call comes from a ckptd that another replaced (its fence {f} is \
                 older than {seen}); the active ckptd drives this node now"
            )));
        }
        Ok(())
    }

    /// The active ckptd's fence, learnt from its answer (a heartbeat's): raises the highest seen.
    pub fn raise(&self, fence: u64) {
        self.0.fetch_max(fence, Ordering::SeqCst);
    }

    /// The highest fence seen (0: none).
    pub fn highest(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    #[test]
    fn a_call_from_a_lower_fence_is_refused_and_unfenced_calls_pass() {
        let g = FenceGuard::default();
        assert!(g.admit(None).is_ok());
        assert!(g.admit(Some(7)).is_ok());
        assert!(g.admit(Some(7)).is_ok(), "the same ckptd again");
        let e = g.admit(Some(5)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.message().contains("fence 5 is older than 7"),
            "{}",
            e.message()
        );
        assert!(g.admit(None).is_ok(), "another agent's call");
        g.raise(9);
        assert!(g.admit(Some(7)).is_err(), "a heartbeat's answer raised it");
        assert_eq!(g.highest(), 9);
    }

    #[test]
    fn the_fence_travels_in_the_metadata_and_a_bad_one_is_refused() {
        let req = Fence(Some(42)).call(Request::new(())).unwrap();
        assert_eq!(fence_of(&req).unwrap(), Some(42));
        let req = Fence(None).call(Request::new(())).unwrap();
        assert_eq!(fence_of(&req).unwrap(), None);
        let mut req = Request::new(());
        req.metadata_mut().insert(FENCE_KEY, "x".parse().unwrap());
        assert_eq!(
            fence_of(&req).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }
}
