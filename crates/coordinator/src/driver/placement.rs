//! Where a restart puts each part of a job: on the nodes the epoch ran on, or elsewhere
//! (`ckptctl restart --nodes`, `--map`, `--on-spares`, `ckptctl drain --migrate`). A part moves
//! with its sandbox (its PIDs, host name and job address), so only a job that ran in sandboxes
//! may move.

use std::collections::{BTreeMap, BTreeSet};

use super::{Coordinator, DriveError};
use crate::model::{Epoch, Job};

/// What the caller asked for.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    /// The epoch's nodes, in order, replaced by these.
    pub nodes: Vec<String>,
    /// Single moves, `OLD=NEW`.
    pub map: Vec<String>,
    /// Every node of the epoch that is down goes to a free spare (`[spares]`). Also what a
    /// restart without `--nodes`/`--map` does when spares are configured.
    pub on_spares: bool,
    /// Nodes whose parts go to spares even though they are up (a node being drained).
    pub vacate: Vec<String>,
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
        let named = !placement.nodes.is_empty() || !placement.map.is_empty();
        if placement.on_spares && named {
            return Err(DriveError::Invalid(
                "--on-spares replaces the nodes that are down; name nodes with --nodes or --map instead, not both".into(),
            ));
        }
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
            (true, true) => {
                if placement.on_spares
                    || !placement.vacate.is_empty()
                    || !self.cfg.spares.nodes.is_empty()
                {
                    moves = self.onto_spares(job, epoch, placement)?;
                }
            }
        }
        // DMTCP virtualizes PIDs and reconnects sockets itself: its jobs move without one.
        let engine = job.snapshot_engine();
        if !moves.is_empty() && job.addresses.is_empty() && !job.engine_virtualizes() {
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
            let down = moves.contains_key(n) && !self.agents.up(target, self.cfg.node_timeout);
            if self.agents.address(target).is_none() || down {
                let hint = if moves.contains_key(n) {
                    format!("{target} has no registered agent, or it has sent no heartbeat for {} (ckptd.toml node_timeout); name another node", humantime::format_duration(self.cfg.node_timeout))
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
            if !self.agents.has_engine(target, engine) {
                return Err(DriveError::NodeNotFree {
                    node: target.clone(),
                    reason: format!(
                        "job {id} runs under {engine}, which its agent did not report; install it there (docs/dmtcp.md) or name another node"
                    ),
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
            if let Some(other) = jobs
                .iter()
                .find(|j| j.id != id && j.is_live() && j.nodes().contains(target))
            {
                return Err(DriveError::NodeNotFree {
                    node: target.clone(),
                    reason: format!("job {} runs a part there", other.id),
                });
            }
        }
        Ok(moves)
    }

    /// Moves every node of the epoch that is down, or to be vacated, to a free spare: one that
    /// is up, is not a node of the epoch, and runs no part of a live job. Spares are taken in
    /// the order ckptd.toml lists them.
    fn onto_spares(
        &self,
        job: &Job,
        epoch: &Epoch,
        placement: &Placement,
    ) -> Result<Moves, DriveError> {
        let timeout = self.cfg.node_timeout;
        let leave: Vec<&String> = epoch
            .nodes
            .iter()
            .filter(|n| placement.vacate.contains(n) || !self.agents.up(n, timeout))
            .collect();
        if leave.is_empty() {
            return Ok(Moves::new());
        }
        let jobs = self.registry.jobs()?;
        let used = |n: &String| {
            jobs.iter()
                .any(|j| j.id != job.id && j.is_live() && j.nodes().contains(n))
        };
        let spares = &self.cfg.spares.nodes;
        let free: Vec<&String> = spares
            .iter()
            .filter(|s| {
                !epoch.nodes.contains(s)
                    && !placement.vacate.contains(s)
                    && self.agents.up(s, timeout)
                    && !used(s)
            })
            .collect();
        if free.len() < leave.len() {
            let why = |n: &&String| {
                if placement.vacate.contains(n) {
                    format!("{n} (drained)")
                } else {
                    format!("{n} (down)")
                }
            };
            let down = leave.iter().map(why).collect::<Vec<_>>().join(", ");
            let (free, hint) = if spares.is_empty() {
                (
                    "no spare nodes are configured".to_string(),
                    "list spares in ckptd.toml [spares] nodes, or name the nodes with --nodes or --map"
                        .to_string(),
                )
            } else {
                (
                    match free.len() {
                        0 => format!("no spare is free (spares: {})", spares.join(", ")),
                        k => format!(
                            "only {k} spare(s) are free ({})",
                            free.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                        ),
                    },
                    format!(
                        "a spare is free when its agent is up and no live job runs on it; wait for a job to end, add spares, or name the nodes with --nodes or --map (`ckptctl restart {} --map OLD=NEW`)",
                        job.id
                    ),
                )
            };
            return Err(DriveError::NoSpare { down, free, hint });
        }
        Ok(leave
            .into_iter()
            .zip(free)
            .map(|(old, new)| (old.clone(), new.clone()))
            .collect())
    }
}
