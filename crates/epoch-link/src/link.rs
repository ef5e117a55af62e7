//! How the phase driver talks to the nodes of an epoch: one [`EpochLink`] per node for the
//! length of the epoch, and the [`barrier`] that waits for every link's answer to a phase within
//! the phase's deadline.
//!
//! A link carries phase commands out and their answers back, in order. The deployed link is
//! [`GrpcLink`], one `Agent.Epoch` stream to a node's agent; a phase costs one message each way
//! per node instead of a unary call. [`crate::relay::Relay`] is a link over other links (a
//! subtree of nodes), and tests and benches put in-process links in their place: the driver does
//! not know which it talks to.
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use ckpt_proto::v1 as pb;
use ckpt_proto::FencedAgentClient;
use futures_util::future::join_all;
use tokio::sync::mpsc;
use tonic::Streaming;

use crate::failure::{from_status, FailureKind, NodeFailure, UNREACHABLE_FIX};

/// One node's (or one subtree's) end of an epoch.
#[tonic::async_trait]
pub trait EpochLink: Send + std::fmt::Debug {
    /// The node the link reaches (a relay: the node it runs on); names failures the link
    /// cannot attribute to a node below it.
    fn node(&self) -> &str;
    /// Queues a phase command; its answer is a later [`EpochLink::next`], in order.
    fn send(&mut self, cmd: pb::EpochCommand) -> Result<(), NodeFailure>;
    /// The answer to the oldest unanswered command: the event, or the node that failed and how.
    async fn next(&mut self) -> Result<pb::EpochEvent, NodeFailure>;
    /// Whether the link can carry the job's next epoch: every command answered, and the link
    /// not known to be broken. Links that cannot be kept say no.
    fn reusable(&self) -> bool {
        false
    }
}

/// The failure an event reports, if it reports one: the node it names, the kind its code
/// means and its message as it is.
pub fn failure_of(ev: &pb::EpochEvent) -> Option<NodeFailure> {
    ev.failure.as_ref().map(|f| NodeFailure {
        node: f.node.clone(),
        kind: FailureKind::of(tonic::Code::from_i32(f.code)),
        message: f.message.clone(),
    })
}

/// The event that reports `failure` in `phase` (a relay answering for the nodes below it);
/// [`failure_of`] reads it back.
pub fn failure_event(phase: pb::Phase, failure: &NodeFailure) -> pb::EpochEvent {
    pb::EpochEvent {
        phase: phase as i32,
        failure: Some(pb::PhaseFailure {
            node: failure.node.clone(),
            code: failure.kind.code() as i32,
            message: failure.message.clone(),
        }),
        ..Default::default()
    }
}

/// Adds one answer to the answers gathered so far: counts add up, times take the longest,
/// free staging the smallest, manifests are merged.
pub fn merge(into: &mut pb::EpochEvent, ev: pb::EpochEvent) {
    if into.nodes == 0 {
        *into = ev;
        return;
    }
    into.nodes += ev.nodes;
    into.elapsed_us = into.elapsed_us.max(ev.elapsed_us);
    into.processes += ev.processes;
    into.estimated_bytes += ev.estimated_bytes;
    into.staging_free_bytes = into.staging_free_bytes.min(ev.staging_free_bytes);
    into.channels += ev.channels;
    into.drained += ev.drained;
    into.frozen_us = into.frozen_us.max(ev.frozen_us);
    into.image_bytes += ev.image_bytes;
    into.image_files += ev.image_files;
    into.manifests.extend(ev.manifests);
}

/// Waits for every link's next answer, each within `deadline`, and merges them; the first
/// failing link in `links` order names the failure. `phase` names a missed deadline.
pub async fn barrier(
    links: &mut [Box<dyn EpochLink>],
    phase: pb::Phase,
    deadline: Duration,
) -> Result<pb::EpochEvent, NodeFailure> {
    let answers = join_all(links.iter_mut().map(|l| async move {
        match tokio::time::timeout(deadline, l.next()).await {
            Ok(r) => r,
            Err(_) => Err(missed(l.node(), phase.name(), deadline)),
        }
    }))
    .await;
    let mut all = pb::EpochEvent::default();
    for a in answers {
        merge(&mut all, a?);
    }
    all.phase = phase as i32;
    Ok(all)
}

/// Sends the same command over every link.
pub fn send_all(
    links: &mut [Box<dyn EpochLink>],
    cmd: pb::EpochCommand,
) -> Result<(), NodeFailure> {
    for l in links.iter_mut() {
        l.send(cmd.clone())?;
    }
    Ok(())
}

/// The failure of a node that did not answer `what` within `deadline`.
pub fn missed(node: &str, what: &str, deadline: Duration) -> NodeFailure {
    NodeFailure {
        node: node.into(),
        kind: FailureKind::Deadline,
        message: format!(
            "{what} did not finish within the {} deadline",
            humantime::format_duration(deadline)
        ),
    }
}

type Opening = Pin<
    Box<
        dyn Future<Output = Result<tonic::Response<Streaming<pb::EpochEvent>>, tonic::Status>>
            + Send,
    >,
>;

enum Inbound {
    /// The call is on its way: the first commands travel with it.
    Opening(Opening),
    Open(Streaming<pb::EpochEvent>),
    /// The stream failed; every later answer fails the same way.
    Broken(NodeFailure),
}

/// One `Agent.Epoch` stream to a node's agent. It carries one job's epochs, one after the
/// other: a committed epoch leaves it open for the next (the coordinator's `Agents::epoch_link`).
pub struct GrpcLink {
    node: String,
    out: mpsc::UnboundedSender<pb::EpochCommand>,
    inbound: Inbound,
    /// Phases sent and not yet answered, to name what a broken stream interrupted.
    pending: VecDeque<pb::Phase>,
    /// The nodes its answers speak for: its own, then, when the epoch's initial-sync carried a
    /// relay plan, the plan's nodes.
    speaks_for: Vec<String>,
}

impl std::fmt::Debug for GrpcLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcLink")
            .field("node", &self.node)
            .field("pending", &self.pending)
            .finish_non_exhaustive()
    }
}

impl GrpcLink {
    /// Opens the epoch stream over a node's client (the call leaves with the first command).
    pub fn open(node: &str, mut client: FencedAgentClient) -> GrpcLink {
        let (tx, rx) = mpsc::unbounded_channel();
        let call = async move {
            client
                .epoch(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
                .await
        };
        GrpcLink {
            node: node.into(),
            out: tx,
            inbound: Inbound::Opening(Box::pin(call)),
            pending: VecDeque::new(),
            speaks_for: vec![node.to_string()],
        }
    }

    fn broken(&mut self, what: &str, s: &tonic::Status) -> NodeFailure {
        let f = from_status(&self.node, what, s);
        self.inbound = Inbound::Broken(f.clone());
        f
    }
}

#[tonic::async_trait]
impl EpochLink for GrpcLink {
    fn node(&self) -> &str {
        &self.node
    }

    fn send(&mut self, cmd: pb::EpochCommand) -> Result<(), NodeFailure> {
        let phase = cmd.phase();
        if phase == pb::Phase::InitialSync {
            self.speaks_for.truncate(1);
            if let Some(plan) = &cmd.relay {
                self.speaks_for
                    .extend(plan.children.iter().map(|c| c.node.clone()));
            }
        }
        self.out.send(cmd).map_err(|_| NodeFailure {
            node: self.node.clone(),
            kind: FailureKind::Unreachable,
            message: format!(
                "agent unreachable during {} (the epoch stream is closed); {}",
                phase.name(),
                UNREACHABLE_FIX
            ),
        })?;
        self.pending.push_back(phase);
        Ok(())
    }

    fn reusable(&self) -> bool {
        self.pending.is_empty() && !self.out.is_closed() && matches!(self.inbound, Inbound::Open(_))
    }

    async fn next(&mut self) -> Result<pb::EpochEvent, NodeFailure> {
        let what = self.pending.front().map_or("the epoch", |p| p.name());
        if let Inbound::Opening(call) = &mut self.inbound {
            match call.await {
                Ok(r) => self.inbound = Inbound::Open(r.into_inner()),
                Err(s) => return Err(self.broken(what, &s)),
            }
        }
        let stream = match &mut self.inbound {
            Inbound::Open(s) => s,
            Inbound::Broken(f) => return Err(f.clone()),
            Inbound::Opening(_) => unreachable!("opened above"),
        };
        let ev = match stream.message().await {
            Ok(Some(ev)) => ev,
            Ok(None) => {
                let s = tonic::Status::unavailable("the agent ended the epoch stream");
                return Err(self.broken(what, &s));
            }
            Err(s) => return Err(self.broken(what, &s)),
        };
        self.pending.pop_front();
        if self.speaks_for.len() > 1 {
            return self.relayed(what, ev);
        }
        // An agent speaks for its own node only, whatever it says: its failure and its
        // manifest are its node's.
        if let Some(f) = failure_of(&ev) {
            return Err(NodeFailure {
                node: self.node.clone(),
                ..f
            });
        }
        if ev.manifests.len() > 1 {
            return Err(NodeFailure {
                node: self.node.clone(),
                kind: FailureKind::Internal,
                message: format!(
                    "the agent answered {what} with {} manifests; a node seals one",
                    ev.manifests.len()
                ),
            });
        }
        let manifests = ev
            .manifests
            .into_values()
            .map(|d| (self.node.clone(), d))
            .collect();
        Ok(pb::EpochEvent {
            nodes: 1,
            manifests,
            ..ev
        })
    }
}

impl GrpcLink {
    /// A relay's answer: it speaks for the nodes of its plan and no other, for each of them
    /// once. A failure it reports names one of them (else the relay itself); an answer that
    /// counts other nodes, or seals a manifest for a node outside the plan or not for every
    /// node in it, is the relay's failure.
    fn relayed(&self, what: &str, ev: pb::EpochEvent) -> Result<pb::EpochEvent, NodeFailure> {
        let ours = |n: &str| self.speaks_for.iter().any(|x| x == n);
        let wrong = |message: String| NodeFailure {
            node: self.node.clone(),
            kind: FailureKind::Internal,
            message,
        };
        if let Some(f) = failure_of(&ev) {
            return Err(if ours(&f.node) {
                f
            } else {
                NodeFailure {
                    node: self.node.clone(),
                    message: format!(
                        "{} (the relay named node {:?}, not one of its nodes)",
                        f.message, f.node
                    ),
                    ..f
                }
            });
        }
        let n = self.speaks_for.len();
        if ev.nodes as usize != n {
            return Err(wrong(format!(
                "the relay answered {what} for {} node(s), not its {n}",
                ev.nodes
            )));
        }
        if let Some(other) = ev.manifests.keys().find(|k| !ours(k)) {
            return Err(wrong(format!(
                "the relay sealed a manifest for node {other:?}, not one of its nodes"
            )));
        }
        if ev.phase() == pb::Phase::Finalize && ev.manifests.len() != n {
            return Err(wrong(format!(
                "the relay sealed {} manifest(s) for its {n} nodes",
                ev.manifests.len()
            )));
        }
        Ok(ev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(nodes: u32, processes: u32, frozen_us: u64, free: u64, node: &str) -> pb::EpochEvent {
        pb::EpochEvent {
            nodes,
            processes,
            frozen_us,
            staging_free_bytes: free,
            manifests: [(node.to_string(), format!("d-{node}"))].into(),
            ..Default::default()
        }
    }

    #[test]
    fn answers_merge_counts_longest_times_smallest_room_and_every_manifest() {
        let mut all = pb::EpochEvent::default();
        merge(&mut all, ev(1, 2, 500, 10, "a"));
        merge(&mut all, ev(3, 5, 900, 4, "b"));
        merge(&mut all, ev(1, 1, 100, 7, "c"));
        assert_eq!(all.nodes, 5);
        assert_eq!(all.processes, 8);
        assert_eq!(all.frozen_us, 900);
        assert_eq!(all.staging_free_bytes, 4);
        assert_eq!(all.manifests.len(), 3);
        assert_eq!(all.manifests["b"], "d-b");
    }

    #[test]
    fn a_failure_event_names_its_node_and_kind() {
        let e = pb::EpochEvent {
            phase: pb::Phase::LocalCheckpoint as i32,
            failure: Some(pb::PhaseFailure {
                node: "n7".into(),
                code: tonic::Code::ResourceExhausted as i32,
                message: "staging full".into(),
            }),
            ..Default::default()
        };
        let f = failure_of(&e).expect("a failure");
        assert_eq!(f.node, "n7");
        assert_eq!(f.kind, FailureKind::NoRoom);
        assert_eq!(f.message, "staging full");
        assert!(failure_of(&pb::EpochEvent::default()).is_none());
    }
}
