//! Phases through a tree of relays, for clusters too large for one coordinator to hold a stream
//! to every node.
//!
//! With N nodes and a fan-out F, the coordinator holds F links; each is a [`Relay`] that holds
//! up to F links of its own (to nodes, or to relays below it), so a phase crosses
//! ⌈log_F N⌉ levels and no process handles more than F messages per phase each way. A relay
//! forwards each command to its links with the command's deadline less [`RELAY_MARGIN`], waits
//! for every answer that long (so that a node that does not answer is named by the
//! relay just above it, not lost in a deadline higher up), merges the answers, and passes the
//! first failure up unchanged: the driver sees one answer per link, with the failing node's own
//! name, whichever level it sits at.
//!
//! Deployed, ckptd makes relays of agents for epochs over more than `[relays] above` nodes,
//! one level deep: a relay agent drives its group's nodes over `Agent.Epoch` streams it opens
//! with its own credential, each command showing ckptd's signed grant ([`Authorized`]). Deeper
//! trees run in the unit tests below and in `benches/criterion/relay_tree.rs`, which simulates
//! 16,384 nodes in virtual time.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ckpt_proto::v1 as pb;

use crate::failure::{FailureKind, NodeFailure};
use crate::link::{barrier, send_all, EpochLink};

/// The grant a relay's links show: ckptd's signed delegation for the current epoch, replaced
/// when the job's next epoch reuses the links.
pub type ShownGrant = Arc<Mutex<Option<pb::DelegatedAuthority>>>;

/// A link below a relay: every command it sends shows the current grant, and never a relay
/// plan (a node below a relay relays nothing).
#[derive(Debug)]
pub struct Authorized<L> {
    inner: L,
    grant: ShownGrant,
}

impl<L: EpochLink> Authorized<L> {
    pub fn new(inner: L, grant: ShownGrant) -> Self {
        Authorized { inner, grant }
    }
}

#[tonic::async_trait]
impl<L: EpochLink> EpochLink for Authorized<L> {
    fn node(&self) -> &str {
        self.inner.node()
    }
    fn send(&mut self, cmd: pb::EpochCommand) -> Result<(), NodeFailure> {
        let authority = self.grant.lock().expect("relay grant lock").clone();
        self.inner.send(pb::EpochCommand {
            authority,
            relay: None,
            ..cmd
        })
    }
    fn reusable(&self) -> bool {
        self.inner.reusable()
    }
    async fn next(&mut self) -> Result<pb::EpochEvent, NodeFailure> {
        self.inner.next().await
    }
}

/// What each level of relays keeps of a phase's deadline to report a silent node below it.
pub const RELAY_MARGIN: Duration = Duration::from_millis(200);

/// A link over a subtree: forwards every command to its links and answers with their merged
/// answers.
pub struct Relay {
    node: String,
    links: Vec<Box<dyn EpochLink>>,
    /// Deadlines of the commands sent and not yet answered.
    pending: std::collections::VecDeque<(pb::Phase, Duration)>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("node", &self.node)
            .field("links", &self.links.len())
            .field("pending", &self.pending)
            .finish()
    }
}

impl Relay {
    /// A relay on `node` over `links`.
    pub fn new(node: &str, links: Vec<Box<dyn EpochLink>>) -> Relay {
        Relay {
            node: node.into(),
            links,
            pending: Default::default(),
        }
    }
}

#[tonic::async_trait]
impl EpochLink for Relay {
    fn node(&self) -> &str {
        &self.node
    }

    fn send(&mut self, cmd: pb::EpochCommand) -> Result<(), NodeFailure> {
        let full = Duration::from_millis(u64::from(cmd.deadline_ms));
        // This relay answers within the deadline it got; what it waits for below is shorter
        // by a margin, and again at every level down, so that each level names a silent node
        // before its parent gives up on it.
        let below = full.saturating_sub(RELAY_MARGIN);
        self.pending.push_back((cmd.phase(), below));
        send_all(
            &mut self.links,
            pb::EpochCommand {
                deadline_ms: below.as_millis() as u32,
                ..cmd
            },
        )
    }

    fn reusable(&self) -> bool {
        self.pending.is_empty() && self.links.iter().all(|l| l.reusable())
    }

    async fn next(&mut self) -> Result<pb::EpochEvent, NodeFailure> {
        let Some((phase, deadline)) = self.pending.pop_front() else {
            return Err(NodeFailure {
                node: self.node.clone(),
                kind: FailureKind::Internal,
                message: "relay asked for an answer to a phase it was not sent".into(),
            });
        };
        barrier(&mut self.links, phase, deadline).await
    }
}

/// Builds a tree over `leaves` with at most `fanout` links per relay and per coordinator:
/// returns the coordinator's links. A relay runs on the first node of its subtree.
pub fn tree(leaves: Vec<Box<dyn EpochLink>>, fanout: usize) -> Vec<Box<dyn EpochLink>> {
    assert!(fanout >= 2, "a relay tree needs a fan-out of at least 2");
    let mut level = leaves;
    while level.len() > fanout {
        let mut up: Vec<Box<dyn EpochLink>> = Vec::with_capacity(level.len().div_ceil(fanout));
        let mut it = level.into_iter().peekable();
        while it.peek().is_some() {
            let group: Vec<Box<dyn EpochLink>> = it.by_ref().take(fanout).collect();
            let node = group[0].node().to_string();
            up.push(Box::new(Relay::new(&node, group)));
        }
        level = up;
    }
    level
}

/// Levels of relays a tree over `n` nodes with `fanout` has (0: flat).
pub fn levels(n: usize, fanout: usize) -> u32 {
    let mut reach = fanout.max(2);
    let mut l = 0;
    while reach < n {
        reach = reach.saturating_mul(fanout.max(2));
        l += 1;
    }
    l
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::{barrier, send_all};

    /// A node answering every phase at once, or failing or hanging in one.
    #[derive(Debug)]
    struct Leaf {
        node: String,
        fail_in: Option<pb::Phase>,
        hang_in: Option<pb::Phase>,
        queue: std::collections::VecDeque<pb::EpochCommand>,
    }

    fn leaf(i: usize) -> Leaf {
        Leaf {
            node: format!("n{i}"),
            fail_in: None,
            hang_in: None,
            queue: Default::default(),
        }
    }

    #[tonic::async_trait]
    impl EpochLink for Leaf {
        fn node(&self) -> &str {
            &self.node
        }
        fn send(&mut self, cmd: pb::EpochCommand) -> Result<(), NodeFailure> {
            self.queue.push_back(cmd);
            Ok(())
        }
        async fn next(&mut self) -> Result<pb::EpochEvent, NodeFailure> {
            let cmd = self.queue.pop_front().expect("a command");
            if self.hang_in == Some(cmd.phase()) {
                std::future::pending::<()>().await;
            }
            if self.fail_in == Some(cmd.phase()) {
                return Err(NodeFailure {
                    node: self.node.clone(),
                    kind: FailureKind::NoRoom,
                    message: "staging full".into(),
                });
            }
            Ok(pb::EpochEvent {
                phase: cmd.phase,
                nodes: 1,
                processes: 2,
                frozen_us: self.node[1..].parse().expect("number"),
                manifests: [(self.node.clone(), "d".into())].into(),
                ..Default::default()
            })
        }
    }

    fn leaves(n: usize, f: impl Fn(&mut Leaf)) -> Vec<Box<dyn EpochLink>> {
        (0..n)
            .map(|i| {
                let mut l = leaf(i);
                f(&mut l);
                Box::new(l) as Box<dyn EpochLink>
            })
            .collect()
    }

    fn cmd(phase: pb::Phase, deadline: Duration) -> pb::EpochCommand {
        pb::EpochCommand {
            job_id: 1,
            epoch: 1,
            phase: phase as i32,
            kill: false,
            deadline_ms: deadline.as_millis() as u32,
            ..Default::default()
        }
    }

    #[test]
    fn a_tree_holds_at_most_the_fanout_at_every_level() {
        assert_eq!(levels(16, 32), 0);
        assert_eq!(levels(1024, 32), 1);
        assert_eq!(levels(16_384, 32), 2);
        assert_eq!(levels(16_384, 128), 1);
        let top = tree(leaves(1000, |_| {}), 10);
        assert_eq!(top.len(), 10);
        assert_eq!(top[0].node(), "n0");
        assert_eq!(top[1].node(), "n100");
    }

    #[tokio::test]
    async fn through_a_tree_every_node_answers_and_the_answers_merge() {
        let mut top = tree(leaves(1000, |_| {}), 8);
        let d = Duration::from_secs(5);
        send_all(&mut top, cmd(pb::Phase::Resume, d)).unwrap();
        let all = barrier(&mut top, pb::Phase::Resume, d).await.unwrap();
        assert_eq!(all.nodes, 1000);
        assert_eq!(all.processes, 2000);
        assert_eq!(all.frozen_us, 999);
        assert_eq!(all.manifests.len(), 1000);
    }

    #[tokio::test]
    async fn a_failure_deep_in_the_tree_reaches_the_driver_naming_its_node() {
        let mut top = tree(
            leaves(600, |l| {
                if l.node == "n437" {
                    l.fail_in = Some(pb::Phase::LocalCheckpoint);
                }
            }),
            6,
        );
        let d = Duration::from_secs(5);
        for p in [pb::Phase::Quiesce, pb::Phase::LocalCheckpoint] {
            send_all(&mut top, cmd(p, d)).unwrap();
        }
        barrier(&mut top, pb::Phase::Quiesce, d).await.unwrap();
        let f = barrier(&mut top, pb::Phase::LocalCheckpoint, d)
            .await
            .unwrap_err();
        assert_eq!(f.node, "n437");
        assert_eq!(f.kind, FailureKind::NoRoom);
    }

    #[tokio::test]
    async fn a_silent_node_is_named_by_the_relay_above_it_before_the_drivers_deadline() {
        let mut top = tree(
            leaves(200, |l| {
                if l.node == "n123" {
                    l.hang_in = Some(pb::Phase::Quiesce);
                }
            }),
            5,
        );
        assert_eq!(levels(200, 5), 3);
        // Three levels of relays wait 800, 600 and 400 ms below the driver's second.
        let d = Duration::from_secs(1);
        send_all(&mut top, cmd(pb::Phase::Quiesce, d)).unwrap();
        let f = barrier(&mut top, pb::Phase::Quiesce, d).await.unwrap_err();
        assert_eq!(f.node, "n123", "{f}");
        assert_eq!(f.kind, FailureKind::Deadline);
    }
}
