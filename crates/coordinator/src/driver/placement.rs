//! Where a restart puts each part of a job: on the nodes the epoch ran on, or elsewhere
//! (`ckptctl restart --nodes`, `--map`). A part moves with its sandbox (its PIDs, host name
//! and job address), so only a job that ran in sandboxes may move.

use std::collections::{BTreeMap, BTreeSet};

use super::{Coordinator, DriveError};
use crate::model::{Epoch, Job, JobState};

/// What the caller asked for.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    /// The epoch's nodes, in order, replaced by these.
    pub nodes: Vec<String>,
    /// Single moves, `OLD=NEW`.
    pub map: Vec<String>,
}

/// The epoch's nodes that move, to where; nodes not in it restart where they ran.
pub type Moves = BTreeMap<String, String>;

impl Coordinator {
    /// Checks a placement against an epoch and the registered nodes; returns the moves.
    pub(super) fn place(
        &self,
        job: &Job,
        epoch: &Epoch,
        placement: &Placement,
    ) -> Result<Moves, DriveError> {
        let (id, number) = (job.id, epoch.number);
        let ran_on = epoch.nodes.join(", ");
        let mut moves = Moves::new();
        match (placement.nodes.is_empty(), placement.map.is_empty()) {
            (false, false) => {
                return Err(DriveError::Invalid(
                    "give either --nodes (every node, in order) or --map (single moves), not both"
                        .into(),
                ))
            }
            (false, true) => {
                if placement.nodes.len() != epoch.nodes.len() {
                    return Err(DriveError::Invalid(format!(
                        "epoch {number} of job {id} ran on {} node(s) ({ran_on}) but --nodes names {}: name one node for each, in that order",
                        epoch.nodes.len(),
                        placement.nodes.len()
                    )));
                }
                for (old, new) in epoch.nodes.iter().zip(&placement.nodes) {
                    if old != new {
                        moves.insert(old.clone(), new.clone());
                    }
                }
            }
            (true, false) => {
                for m in &placement.map {
                    let (old, new) = m
                        .split_once('=')
                        .map(|(a, b)| (a.trim(), b.trim()))
                        .filter(|(a, b)| !a.is_empty() && !b.is_empty())
                        .ok_or_else(|| {
                            DriveError::Invalid(format!("--map {m:?}: write OLD=NEW, e.g. n3=n4"))
                        })?;
                    if !epoch.nodes.iter().any(|n| n == old) {
                        return Err(DriveError::Invalid(format!(
                            "--map {m}: {old} is not a node of epoch {number} of job {id} (it ran on {ran_on})"
                        )));
                    }
                    if moves.insert(old.to_string(), new.to_string()).is_some() {
                        return Err(DriveError::Invalid(format!("--map names {old} twice")));
                    }
                }
                moves.retain(|old, new| old != new);
            }
            (true, true) => {}
        }
        if !moves.is_empty() && job.addresses.is_empty() {
            return Err(DriveError::NodeNotFree {
                node: moves.values().next().cloned().unwrap_or_default(),
                reason: format!(
                    "job {id} ran without a job network (ckptd.toml [job_network]), so its parts keep the nodes' PIDs and addresses: it restarts only on the nodes it ran on ({ran_on})"
                ),
            });
        }
        // Every part lands on a registered node, one part per node.
        let mut taken = BTreeSet::new();
        for n in &epoch.nodes {
            let target = moves.get(n).unwrap_or(n);
            if self.agents.address(target).is_none() {
                let hint = if moves.contains_key(n) {
                    format!("{target} has no registered agent (see which nodes are up in ckptd's log); name another node")
                } else {
                    format!(
                        "node {n} of epoch {number} has no registered agent (is ckpt-agent running there?); restart its part elsewhere with --map {n}=NODE, or name every node with --nodes"
                    )
                };
                return Err(DriveError::UnknownNode {
                    node: target.clone(),
                    hint,
                });
            }
            if !taken.insert(target.clone()) {
                return Err(DriveError::NodeNotFree {
                    node: target.clone(),
                    reason: format!(
                        "it would get two parts of job {id}; a job has one part per node"
                    ),
                });
            }
        }
        // A node that another running job uses is not free for a moved part.
        let jobs = if moves.is_empty() {
            Vec::new()
        } else {
            self.registry.jobs()?
        };
        for target in moves.values() {
            if let Some(other) = jobs.iter().find(|j| {
                j.id != id
                    && matches!(
                        j.state,
                        JobState::Starting
                            | JobState::Running
                            | JobState::Checkpointing
                            | JobState::Restarting
                    )
                    && j.nodes().iter().any(|n| n == target)
            }) {
                return Err(DriveError::NodeNotFree {
                    node: target.clone(),
                    reason: format!("job {} runs a part there", other.id),
                });
            }
        }
        Ok(moves)
    }
}
