//! The agent's side of fencing a replaced ckptd ([`ckpt_proto::FenceGuard`]): every call is
//! checked before its handler runs.
use ckpt_proto::FenceGuard;
use tonic::{Request, Status};

/// Lets `req` through unless it carries the fence of a ckptd that another replaced. Only the
/// coordinator's fence counts: a node (or anyone) that sent one could otherwise raise the
/// highest fence past the active ckptd's and cut it off from this node.
pub(crate) fn check(guard: &FenceGuard, req: Request<()>) -> Result<Request<()>, Status> {
    if ckpt_auth::peer_of(&req).is_coordinator() {
        guard.admit(ckpt_proto::fence_of(&req)?).inspect_err(|s| {
            tracing::warn!(reason = s.message(), "refused a replaced ckptd's call")
        })?;
    }
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_auth::{Identity, Peer, PeerInfo};

    fn call(from: Identity, fence: Option<u64>) -> Request<()> {
        let mut req = Request::new(());
        if let Some(f) = fence {
            req.metadata_mut()
                .insert(ckpt_proto::FENCE_KEY, f.to_string().parse().unwrap());
        }
        req.extensions_mut().insert(PeerInfo {
            peer: Peer::Daemon(from),
            addr: None,
        });
        req
    }

    #[test]
    fn a_replaced_ckptds_call_is_refused_and_a_nodes_fence_counts_for_nothing() {
        let g = FenceGuard::default();
        assert!(check(&g, call(Identity::Coordinator, Some(4))).is_ok());
        // Another node's call with a huge fence: not refused for it, and it raises nothing.
        assert!(check(&g, call(Identity::Node("n2".into()), Some(u64::MAX))).is_ok());
        assert_eq!(g.highest(), 4);
        assert!(check(&g, call(Identity::Coordinator, Some(4))).is_ok());
        // A standby took over with fence 9; the one it replaced comes back with 4.
        assert!(check(&g, call(Identity::Coordinator, Some(9))).is_ok());
        let e = check(&g, call(Identity::Coordinator, Some(4))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.message().contains("fence 4 is older than 9"),
            "{}",
            e.message()
        );
        // A ckptd on the embedded registry is not fenced.
        assert!(check(&g, call(Identity::Coordinator, None)).is_ok());
    }
}
