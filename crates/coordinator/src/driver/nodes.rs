//! `ckptctl nodes`: every node ckptd knows, with what its agent reported and the live jobs on
//! it.
use std::collections::BTreeMap;

use ckpt_proto::v1 as pb;

use super::{Caller, Coordinator, DriveError};

impl Coordinator {
    /// Registered agents, configured spares and the nodes of live jobs, sorted by name. Jobs are
    /// named to their owner and root; other users' are only counted.
    pub fn nodes(&self, caller: &Caller) -> Result<Vec<pb::NodeInfo>, DriveError> {
        let timeout = self.cfg.node_timeout;
        let mut out: BTreeMap<String, pb::NodeInfo> = BTreeMap::new();
        for a in self.agents.views() {
            let up = a.since_seen <= timeout;
            let (free, total) = a.staging.unwrap_or((0, 0));
            out.insert(
                a.node.clone(),
                pb::NodeInfo {
                    name: a.node,
                    state: if up { "up" } else { "down" }.into(),
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
                },
            );
        }
        let absent = |name: &str| pb::NodeInfo {
            name: name.to_string(),
            state: "absent".into(),
            ..Default::default()
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
