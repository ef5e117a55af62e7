//! `ckptctl nodes`: every node ckptd knows, with what its agent reported and the live jobs on
//! it.
use std::collections::BTreeMap;

use ckpt_proto::v1 as pb;

use super::{Caller, Coordinator, DriveError};

/// Whether ckptd hears from a node's agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    /// Its agent sent a heartbeat within `node_timeout`.
    Up,
    /// Registered, but no heartbeat within `node_timeout`.
    Down,
    /// A spare or a node of a live job whose agent has not registered since ckptd started.
    Absent,
}

impl NodeState {
    /// Name shown to users: "up", "down", "absent".
    pub fn name(self) -> &'static str {
        match self {
            NodeState::Up => "up",
            NodeState::Down => "down",
            NodeState::Absent => "absent",
        }
    }

    /// Its value in the Control API (`NodeInfo.state_kind`).
    pub fn kind(self) -> pb::NodeStateKind {
        match self {
            NodeState::Up => pb::NodeStateKind::Up,
            NodeState::Down => pb::NodeStateKind::Down,
            NodeState::Absent => pb::NodeStateKind::Absent,
        }
    }

    /// `NodeInfo.state` and `state_kind` set to this state.
    fn set(self, info: &mut pb::NodeInfo) {
        info.state = self.name().into();
        info.set_state_kind(self.kind());
    }
}

impl Coordinator {
    /// Registered agents, configured spares and the nodes of live jobs, sorted by name. Jobs are
    /// named to their owner and root; other users' are only counted.
    pub fn nodes(&self, caller: &Caller) -> Result<Vec<pb::NodeInfo>, DriveError> {
        let timeout = self.cfg.node_timeout;
        let mut out: BTreeMap<String, pb::NodeInfo> = BTreeMap::new();
        for a in self.agents.views() {
            let up = a.since_seen <= timeout;
            let (free, total) = a.staging.unwrap_or((0, 0));
            let mut info = pb::NodeInfo {
                name: a.node.clone(),
                address: a.info.address,
                version: a.info.version,
                heartbeat_age_ms: Some(a.since_seen.as_millis() as u64),
                down_since_unix_ms: if up { 0 } else { a.last_seen_unix_ms },
                engines: a
                    .info
                    .engines
                    .into_iter()
                    .map(|(name, version)| pb::EngineInfo { name, version })
                    .collect(),
                rdma_devices: a.info.rdma_devices,
                staging_free_bytes: free,
                staging_total_bytes: total,
                ..Default::default()
            };
            if up { NodeState::Up } else { NodeState::Down }.set(&mut info);
            out.insert(a.node, info);
        }
        let absent = |name: &str| {
            let mut info = pb::NodeInfo {
                name: name.to_string(),
                ..Default::default()
            };
            NodeState::Absent.set(&mut info);
            info
        };
        for s in &self.cfg.spares.nodes {
            out.entry(s.clone()).or_insert_with(|| absent(s)).spare = true;
        }
        for job in self.registry.jobs()?.iter().filter(|j| j.is_live()) {
            let mut nodes = job.nodes();
            nodes.sort();
            nodes.dedup();
            for n in nodes {
                let info = out.entry(n.clone()).or_insert_with(|| absent(&n));
                if caller.may_act_on(job).is_ok() {
                    info.jobs.push(job.id);
                } else {
                    info.other_jobs += 1;
                }
            }
        }
        for info in out.values_mut() {
            info.free = info.spare && info.jobs.is_empty() && info.other_jobs == 0;
        }
        Ok(out.into_values().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_node_state_has_the_value_of_its_name() {
        for n in [NodeState::Up, NodeState::Down, NodeState::Absent] {
            // A new state does not compile here until it is listed above.
            match n {
                NodeState::Up | NodeState::Down | NodeState::Absent => {}
            }
            let want = format!("NODE_STATE_KIND_{}", n.name().to_uppercase());
            assert_eq!(n.kind().as_str_name(), want);
            let mut info = pb::NodeInfo::default();
            n.set(&mut info);
            assert_eq!(
                (info.state.as_str(), info.state_kind()),
                (n.name(), n.kind())
            );
        }
    }
}
