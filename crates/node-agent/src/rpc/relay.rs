//! Epochs through relays: an agent's two roles on an `Agent.Epoch` stream that does not come
//! straight from the coordinator to a node's own phases.
//!
//! - **Below a relay.** The stream comes from another node's agent. It must show, on its
//!   commands, the coordinator's signed grant ([`Grant`]): this job, this epoch, these phases,
//!   this node among those it may drive, the caller as the relay, and not yet expired. Anything
//!   else is refused with `PERMISSION_DENIED` and the stream ends.
//! - **A relay.** The coordinator's initial-sync carries a [`pb::RelayPlan`]: for that epoch
//!   this agent runs its own node's phases (a link `epoch.rs` gives) and drives the plan's nodes over
//!   epoch streams of its own (dialled with this node's credential, each showing the grant),
//!   through [`epoch_link::relay::Relay`], and answers for all of them: the first failure,
//!   naming its node, or every node's answer merged.
use std::sync::Arc;
use std::time::Duration;

use ckpt_auth::tls::Credential;
use ckpt_auth::Identity;
use ckpt_proto::v1 as pb;
use epoch_link::failure::{FailureKind, NodeFailure, UNREACHABLE_FIX};
use epoch_link::link::{failure_event, EpochLink, GrpcLink};
use epoch_link::relay::{Authorized, Relay, ShownGrant};
use prost::Message;
use tonic::Status;
use tracing::{info, warn};

use crate::jobs::Jobs;

/// How long a relay may take to connect to one of its nodes (they are dialled together).
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// A checked grant of the coordinator to the relay driving this stream.
#[derive(Debug)]
pub(super) struct Grant {
    relay: String,
    job: u64,
    epoch: u32,
    phases: Vec<pb::Phase>,
    not_after_ms: u64,
    /// The signing ckptd's fence (0: unfenced).
    fence: u64,
    /// The signature it was checked with: a command showing the same one is not checked again.
    signature: Vec<u8>,
}

fn denied(message: String) -> Status {
    Status::permission_denied(message)
}

use ckpt_proto::now_ms;

impl Grant {
    /// Checks the grant node `caller` showed to this node, `me`: signed by the coordinator of
    /// this cluster, to `caller`, over `me`.
    fn check(
        credential: Option<&Credential>,
        me: &str,
        caller: &str,
        a: &pb::DelegatedAuthority,
    ) -> Result<Grant, Status> {
        let Some(cred) = credential else {
            return Err(denied(
                "this agent has no cluster credential to check a relay's grant with".into(),
            ));
        };
        cred.check_signed(&a.issuer, &a.grant, &a.signature, &Identity::Coordinator)
            .map_err(|e| denied(format!("node {caller}'s relay grant is not valid: {e}")))?;
        let g = pb::Delegation::decode(a.grant.as_slice())
            .map_err(|e| denied(format!("node {caller}'s relay grant is unreadable: {e}")))?;
        if g.relay != caller {
            return Err(denied(format!(
                "the relay grant node {caller} showed is node {}'s",
                g.relay
            )));
        }
        if !g.nodes.iter().any(|n| n == me) {
            return Err(denied(format!(
                "node {caller}'s relay grant does not cover this node ({me})"
            )));
        }
        Ok(Grant {
            phases: g.phases().collect(),
            relay: g.relay,
            job: g.job_id,
            epoch: g.epoch,
            not_after_ms: g.not_after_ms,
            fence: g.fence,
            signature: a.signature.clone(),
        })
    }

    /// Refuses `cmd` unless this grant covers it.
    fn covers(&self, cmd: &pb::EpochCommand) -> Result<(), Status> {
        let who = &self.relay;
        if cmd.job_id != self.job {
            return Err(denied(format!(
                "node {who}'s relay grant is for job {}, not job {}",
                self.job, cmd.job_id
            )));
        }
        if cmd.epoch != self.epoch {
            return Err(denied(format!(
                "node {who}'s relay grant is for epoch {} of job {}, not epoch {}",
                self.epoch, self.job, cmd.epoch
            )));
        }
        if !self.phases.contains(&cmd.phase()) {
            return Err(denied(format!(
                "node {who}'s relay grant does not cover {}",
                cmd.phase().name()
            )));
        }
        let now = now_ms();
        if now > self.not_after_ms {
            return Err(denied(format!(
                "node {who}'s relay grant for epoch {} of job {} expired {} ms ago",
                self.epoch,
                self.job,
                now - self.not_after_ms
            )));
        }
        Ok(())
    }
}

/// Checks a command from node `caller` (a relay) on this stream: a relay plan is the
/// coordinator's alone; a grant shown is checked (once per signature) and kept for the
/// stream; the command must be covered by the stream's grant.
pub(super) fn authorize(
    jobs: &Jobs,
    caller: &str,
    grant: &mut Option<Grant>,
    cmd: &pb::EpochCommand,
) -> Result<(), Status> {
    let refused = |s: Status| {
        warn!(
            relay = caller,
            job = cmd.job_id,
            epoch = cmd.epoch,
            error = s.message(),
            "refused an epoch command from a relay"
        );
        s
    };
    if cmd.relay.is_some() {
        return Err(refused(denied(format!(
            "node {caller} sent a relay plan: only the coordinator hands them out"
        ))));
    }
    if let Some(a) = &cmd.authority {
        if grant.as_ref().is_none_or(|g| g.signature != a.signature) {
            *grant =
                Some(Grant::check(jobs.credential(), jobs.node(), caller, a).map_err(refused)?);
        }
    }
    match grant {
        // A grant of a ckptd that another replaced is void like an expired one.
        Some(g) => {
            g.covers(cmd).map_err(refused)?;
            jobs.node.leader_fence.admit(Some(g.fence)).map_err(refused)
        }
        None => Err(refused(denied(format!(
            "Agent.Epoch is only for the coordinator, or a relay showing its grant; node {caller} showed none"
        )))),
    }
}

/// A relay for one epoch: the plan's nodes and this node, driven as one. Its streams stay open
/// for the job's next epoch when that has the same plan (as ckptd keeps its own).
pub(super) struct Relaying {
    epoch: u32,
    children: Vec<pb::RelayChild>,
    authority: ShownGrant,
    relay: Relay,
}

impl Relaying {
    /// Starts relaying the epoch `cmd` begins (an initial-sync carrying `plan`), with `local`
    /// running this node's own phases: dials every node of the plan at once. A node that cannot be reached is the epoch's failure, named.
    pub(super) async fn open(
        jobs: &Arc<Jobs>,
        plan: pb::RelayPlan,
        cmd: &pb::EpochCommand,
        local: Box<dyn EpochLink>,
    ) -> Result<Relaying, NodeFailure> {
        let me = jobs.node().to_string();
        let authority: ShownGrant = Arc::new(std::sync::Mutex::new(plan.authority.clone()));
        let dials = plan.children.iter().map(|c| dial(jobs.credential(), c));
        let mut links: Vec<Box<dyn EpochLink>> = vec![local];
        for (child, client) in plan
            .children
            .iter()
            .zip(futures_util::future::join_all(dials).await)
        {
            links.push(Box::new(Authorized::new(
                GrpcLink::open(&child.node, client?),
                authority.clone(),
            )));
        }
        info!(
            job = cmd.job_id,
            epoch = cmd.epoch,
            nodes = plan.children.len(),
            "relaying the epoch to {} node(s) below {me}",
            plan.children.len()
        );
        Ok(Relaying {
            epoch: cmd.epoch,
            children: plan.children,
            authority,
            relay: Relay::new(&me, links),
        })
    }

    /// This relay again for the epoch `cmd` begins, if `plan` names the same nodes at the same
    /// addresses and every stream is still open and idle; its links then show the new grant.
    pub(super) fn reuse(self, plan: &pb::RelayPlan, cmd: &pb::EpochCommand) -> Option<Relaying> {
        if self.children != plan.children || !self.relay.reusable() {
            return None;
        }
        *self.authority.lock().expect("relay grant lock") = plan.authority.clone();
        Some(Relaying {
            epoch: cmd.epoch,
            ..self
        })
    }

    /// Whether `cmd` belongs to the epoch this relay carries.
    pub(super) fn carries(&self, cmd: &pb::EpochCommand) -> bool {
        cmd.epoch == self.epoch && cmd.phase() != pb::Phase::InitialSync
    }

    /// Runs `cmd` on every node of the relay; the merged answer, or the first failure.
    pub(super) async fn run(&mut self, cmd: pb::EpochCommand) -> pb::EpochEvent {
        let phase = cmd.phase();
        let r = match self.relay.send(cmd) {
            Ok(()) => self.relay.next().await,
            Err(f) => Err(f),
        };
        match r {
            Ok(ev) => ev,
            Err(f) => failure_event(phase, &f),
        }
    }
}

/// A client to a node of the plan, over TLS with this node's credential; the server must prove
/// it is that node.
async fn dial(
    credential: Option<&Credential>,
    child: &pb::RelayChild,
) -> Result<ckpt_proto::FencedAgentClient, NodeFailure> {
    let unreachable = |why: String| NodeFailure {
        node: child.node.clone(),
        kind: FailureKind::Unreachable,
        message: format!(
            "its relay could not reach its agent at {}: {why}; {UNREACHABLE_FIX}",
            child.address
        ),
    };
    if !ckpt_auth::valid_node_name(&child.node) {
        return Err(NodeFailure {
            node: child.node.clone(),
            kind: FailureKind::Internal,
            message: "the relay plan names an invalid node".into(),
        });
    }
    let Some(cred) = credential else {
        return Err(unreachable("this relay has no cluster credential".into()));
    };
    let config = cred
        .client_config(Identity::Node(child.node.clone()))
        .map_err(|e| unreachable(e.to_string()))?;
    let ch = ckpt_auth::transport::connect(
        &child.address,
        ckpt_auth::transport::Dial::Tls(config),
        DIAL_TIMEOUT,
    )
    .await
    .map_err(unreachable)?;
    // Unfenced: the grant the relay shows carries the fence.
    Ok(ckpt_proto::fenced_agent(ch, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signed(coord: &Credential, g: &pb::Delegation) -> pb::DelegatedAuthority {
        let grant = g.encode_to_vec();
        let (signature, issuer) = coord.sign(&grant).unwrap();
        pb::DelegatedAuthority {
            grant,
            signature,
            issuer,
        }
    }

    fn cmd(job: u64, epoch: u32, phase: pb::Phase) -> pb::EpochCommand {
        pb::EpochCommand {
            job_id: job,
            epoch,
            phase: phase as i32,
            ..Default::default()
        }
    }

    /// The grant's checks, each refusal on its own: another job, another epoch, a phase not
    /// granted, expiry, another relay, a node not covered, a signer that is not the coordinator.
    #[test]
    fn a_grant_covers_its_job_epoch_phases_relay_and_nodes_until_it_expires() {
        let d = tempfile::tempdir().unwrap();
        ckpt_auth::ca::init(d.path()).unwrap();
        let coord = Credential::load(d.path(), &Identity::Coordinator).unwrap();
        let node = |n: &str| {
            let b = ckpt_auth::ca::issue(d.path(), n).unwrap();
            Credential::from_bundle(&ckpt_auth::ca::Bundle::parse(&b).unwrap()).unwrap()
        };
        let b = node("b");
        let grant = pb::Delegation {
            job_id: 7,
            epoch: 3,
            relay: "a".into(),
            nodes: vec!["b".into(), "c".into()],
            phases: vec![pb::Phase::InitialSync as i32, pb::Phase::Quiesce as i32],
            not_after_ms: now_ms() + 60_000,
            fence: 0,
        };
        let a = signed(&coord, &grant);
        let g = Grant::check(Some(&b), "b", "a", &a).unwrap();
        g.covers(&cmd(7, 3, pb::Phase::InitialSync)).unwrap();
        g.covers(&cmd(7, 3, pb::Phase::Quiesce)).unwrap();
        let refused = |r: Result<(), Status>| {
            let s = r.unwrap_err();
            assert_eq!(s.code(), tonic::Code::PermissionDenied, "{s:?}");
            s.message().to_string()
        };
        assert!(refused(g.covers(&cmd(8, 3, pb::Phase::Quiesce))).contains("not job 8"));
        assert!(refused(g.covers(&cmd(7, 4, pb::Phase::Quiesce))).contains("not epoch 4"));
        assert!(refused(g.covers(&cmd(7, 3, pb::Phase::LocalCheckpoint)))
            .contains("does not cover local-checkpoint"));
        let old = Grant::check(
            Some(&b),
            "b",
            "a",
            &signed(
                &coord,
                &pb::Delegation {
                    not_after_ms: now_ms() - 1,
                    ..grant.clone()
                },
            ),
        )
        .unwrap();
        assert!(refused(old.covers(&cmd(7, 3, pb::Phase::Quiesce))).contains("expired"));
        // Shown by another node than the relay it names; to a node it does not cover.
        let e = Grant::check(Some(&b), "b", "c", &a).unwrap_err();
        assert!(e.message().contains("is node a's"), "{e:?}");
        let e = Grant::check(Some(&node("d")), "d", "a", &a).unwrap_err();
        assert!(
            e.message().contains("does not cover this node (d)"),
            "{e:?}"
        );
        // A relay that signs a grant of its own, or alters the coordinator's.
        let forged = signed(&node("a"), &grant);
        let e = Grant::check(Some(&b), "b", "a", &forged).unwrap_err();
        assert!(e.message().contains("not valid"), "{e:?}");
        let mut altered = a.clone();
        altered.grant = pb::Delegation {
            job_id: 8,
            ..grant.clone()
        }
        .encode_to_vec();
        let e = Grant::check(Some(&b), "b", "a", &altered).unwrap_err();
        assert!(e.message().contains("not valid"), "{e:?}");
    }
}
