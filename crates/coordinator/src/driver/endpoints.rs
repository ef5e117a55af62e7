//! The InfiniBand step after a resume or a restore: every node rebuilds its ib-quiesce
//! channels, and each is sent the new endpoints of its channels' peers.
use std::collections::HashMap;
use std::time::Instant;

use ckpt_proto::v1 as pb;

use super::Coordinator;
use crate::agents::{FailureKind, NodeFailure};

impl Coordinator {
    /// Post-checkpoint coordination for InfiniBand: every node's down channels recreate their
    /// objects and report new endpoints and the peer QPs they need; each node then gets the
    /// endpoints it asked for and reconnects. Returns the number of QPs and the time taken.
    pub(super) async fn rebuild_channels(
        &self,
        nodes: &[String],
        id: u64,
        number: u32,
    ) -> Result<ChannelsRebuilt, NodeFailure> {
        let begin = Instant::now();
        let d = self.cfg.deadlines.resume;
        let rebuilt = self
            .on_all(nodes, "rebuild", d, |mut c| async move {
                c.rebuild(pb::RebuildRequest {
                    job_id: id,
                    epoch: number,
                })
                .await
            })
            .await?;
        let for_node = route_endpoints(&rebuilt)?;
        let qps = rebuilt.iter().map(|(_, r)| r.endpoints.len()).sum();
        let relayed = for_node.values().map(Vec::len).sum();
        let for_node = &for_node;
        self.on_each(nodes, "reconnect", d, |node, mut c| async move {
            let endpoints = for_node.get(node).cloned().unwrap_or_default();
            c.reconnect(pb::ReconnectRequest {
                job_id: id,
                epoch: number,
                endpoints,
            })
            .await
        })
        .await?;
        Ok(ChannelsRebuilt {
            qps,
            relayed,
            took: begin.elapsed(),
        })
    }
}

/// What the post-checkpoint InfiniBand coordination did.
pub(super) struct ChannelsRebuilt {
    /// QPs rebuilt on all nodes.
    pub(super) qps: usize,
    /// Endpoints sent to the nodes (each node gets those of its channels' peers).
    pub(super) relayed: usize,
    pub(super) took: std::time::Duration,
}

impl ChannelsRebuilt {
    /// The progress line of `channels` channels.
    pub(super) fn say(&self, channels: u32) -> String {
        format!(
            "{channels} ib-quiesce channel(s) rebuilt and reconnected: {} QP(s), {} endpoint(s) \
             relayed, in {} ms",
            self.qps,
            self.relayed,
            self.took.as_millis()
        )
    }
}

/// After a rebuild: for each node, the endpoints its channels asked for (`wants`), from all
/// nodes' replies; every endpoint of the job to a node that could not say (`wants_all`). A QP
/// asked for that no node reported is a failure of the node that asked, named here rather
/// than by the channel that would not connect.
fn route_endpoints(
    rebuilt: &[(String, pb::RebuildReply)],
) -> Result<HashMap<String, Vec<pb::QpEndpoint>>, NodeFailure> {
    let mut by_id: HashMap<(u64, u32), &pb::QpEndpoint> = HashMap::new();
    for (node, r) in rebuilt {
        for e in &r.endpoints {
            let Some(id) = &e.id else {
                return Err(NodeFailure {
                    node: node.clone(),
                    kind: FailureKind::Internal,
                    message: format!(
                        "rebuild: an endpoint (QP {:#x}) without its QP id (is the agent older \
                         than ckptd?)",
                        e.qpn
                    ),
                });
            };
            by_id.insert((id.channel, id.qpn), e);
        }
    }
    let mut out = HashMap::new();
    for (node, r) in rebuilt {
        let eps: Vec<pb::QpEndpoint> = if r.wants_all {
            rebuilt
                .iter()
                .flat_map(|(_, r)| r.endpoints.iter().cloned())
                .collect()
        } else {
            r.wants
                .iter()
                .map(|w| {
                    by_id
                        .get(&(w.channel, w.qpn))
                        .map(|e| (*e).clone())
                        .ok_or_else(|| NodeFailure {
                            node: node.clone(),
                            kind: FailureKind::Refused,
                            message: format!(
                                "a channel there is connected to QP {:#x} of channel {:#x}, \
                                 which no node of the job rebuilt (did that process exit?)",
                                w.qpn, w.channel
                            ),
                        })
                })
                .collect::<Result<_, _>>()?
        };
        out.insert(node.clone(), eps);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(eps: &[(u64, u32)], wants: Option<&[(u64, u32)]>) -> pb::RebuildReply {
        let qp = |&(channel, qpn): &(u64, u32)| pb::QpRef { channel, qpn };
        pb::RebuildReply {
            endpoints: eps
                .iter()
                .map(|id| pb::QpEndpoint {
                    id: Some(qp(id)),
                    device: format!("{}/{}", id.0, id.1),
                    ..Default::default()
                })
                .collect(),
            wants: wants.unwrap_or_default().iter().map(qp).collect(),
            wants_all: wants.is_none(),
            elapsed_us: 0,
        }
    }

    /// Which endpoints these are, by the `channel/qpn` names `reply` gives them.
    fn names(v: &[pb::QpEndpoint]) -> Vec<String> {
        v.iter().map(|e| e.device.clone()).collect()
    }

    #[test]
    fn each_node_gets_the_endpoints_its_channels_asked_for() {
        let rebuilt = vec![
            (
                "n1".to_string(),
                reply(&[(1, 10), (1, 11)], Some(&[(2, 10)])),
            ),
            (
                "n2".to_string(),
                reply(&[(2, 10)], Some(&[(1, 10), (1, 11)])),
            ),
            ("n3".to_string(), reply(&[], Some(&[]))),
            ("n4".to_string(), reply(&[], None)),
        ];
        let r = route_endpoints(&rebuilt).unwrap();
        assert_eq!(names(&r["n1"]), ["2/10"]);
        assert_eq!(names(&r["n2"]), ["1/10", "1/11"]);
        assert!(r["n3"].is_empty(), "no channels, nothing to send");
        assert_eq!(
            names(&r["n4"]),
            ["1/10", "1/11", "2/10"],
            "could not say: all"
        );
    }

    #[test]
    fn a_peer_nobody_rebuilt_or_an_endpoint_without_an_id_is_a_named_failure() {
        let rebuilt = vec![
            ("n1".to_string(), reply(&[(1, 10)], Some(&[(9, 0x710003)]))),
            ("n2".to_string(), reply(&[(2, 10)], Some(&[(1, 10)]))),
        ];
        let e = route_endpoints(&rebuilt).unwrap_err();
        assert_eq!(e.node, "n1");
        assert!(
            e.message.contains("QP 0x710003 of channel 0x9"),
            "{}",
            e.message
        );
        let mut bad = reply(&[(1, 10)], Some(&[]));
        bad.endpoints[0].id = None;
        bad.endpoints[0].qpn = 0x33;
        let e = route_endpoints(&[("n5".to_string(), bad)]).unwrap_err();
        assert_eq!((e.node.as_str(), e.kind), ("n5", FailureKind::Internal));
        assert!(
            e.message.contains("endpoint (QP 0x33) without its QP id"),
            "{}",
            e.message
        );
    }
}
