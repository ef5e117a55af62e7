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
    /// Nodes the caller says are down for good: a part of a job without a restart policy
    /// moves off one of them though ckptd never heard it was gone ([`DriveError::PartMayRun`]).
    pub down: Vec<String>,
    /// The nodes a batch scheduler gave the job: its parts restart there (see
    /// [`onto_allocation`]).
    pub allocation: Option<Allocation>,
}

/// A batch scheduler's allocation (`ckptctl run --resume` inside a Slurm job).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Allocation {
    /// Whose it is, for messages: "Slurm job 42".
    pub name: String,
    /// Its nodes, in the scheduler's order.
    pub nodes: Vec<String>,
}

/// The moves that put an epoch's parts on an allocation with at least as many nodes: a part
/// that ran on a node of the allocation stays there; the others take its unused nodes, in the
/// allocation's order (the epoch's order decides which part gets which). The same epoch and
/// allocation always give the same moves.
pub fn onto_allocation(epoch_nodes: &[String], allocation: &[String]) -> Moves {
    let mut free = allocation.iter().filter(|n| !epoch_nodes.contains(n));
    epoch_nodes
        .iter()
        .filter(|n| !allocation.contains(n))
        .filter_map(|old| free.next().map(|new| (old.clone(), new.clone())))
        .collect()
}

/// The moves that `--nodes` (every node, in the epoch's order) or `--map` (OLD=NEW) name.
fn named_moves(id: u64, epoch: &Epoch, placement: &Placement) -> Result<Moves, DriveError> {
    let number = epoch.number;
    let ran_on = epoch.nodes.join(", ");
    let mut moves = Moves::new();
    if !placement.nodes.is_empty() && !placement.map.is_empty() {
        return Err(DriveError::Invalid(
            "give either --nodes (every node, in order) or --map (single moves), not both".into(),
        ));
    }
    if !placement.nodes.is_empty() {
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
        return Ok(moves);
    }
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
    Ok(moves)
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
        let id = job.id;
        let ran_on = epoch.nodes.join(", ");
        let mut moves = Moves::new();
        let named = !placement.nodes.is_empty() || !placement.map.is_empty();
        if let Some(a) = &placement.allocation {
            if named || placement.on_spares {
                return Err(DriveError::Invalid(format!(
                    "a restart onto {}'s nodes places every part itself; --nodes, --map and --on-spares do not go with it",
                    a.name
                )));
            }
            moves = self.fit_allocation(job, epoch, a)?;
        }
        if placement.on_spares && named {
            return Err(DriveError::Invalid(
                "--on-spares replaces the nodes that are down; name nodes with --nodes or --map instead, not both".into(),
            ));
        }
        if named {
            moves = named_moves(id, epoch, placement)?;
        } else if placement.allocation.is_none()
            && (placement.on_spares
                || !placement.vacate.is_empty()
                || !self.cfg.spares.nodes.is_empty())
        {
            moves = self.onto_spares(job, epoch, placement)?;
        }
        // DMTCP virtualizes PIDs and reconnects sockets itself: its jobs move without one.
        if !moves.is_empty() && job.addresses.is_empty() && !job.engine_virtualizes() {
            let reason = match &placement.allocation {
                Some(a) => format!(
                    "{} has the nodes {}, but job {id} ran on {ran_on} ({} outside them) without a job network (ckptd.toml [job_network]): its parts keep the nodes' PIDs and addresses, so they restart only where they ran. Ask the scheduler for those nodes (sbatch --nodelist={}), or run a job that must move with a job network",
                    a.name,
                    a.nodes.join(", "),
                    moves.keys().map(String::as_str).collect::<Vec<_>>().join(", "),
                    epoch.nodes.join(","),
                ),
                None => format!(
                    "job {id} ran without a job network (ckptd.toml [job_network]), so its parts keep the nodes' PIDs and addresses: it restarts only on the nodes it ran on ({ran_on})"
                ),
            };
            return Err(DriveError::NodeNotFree {
                node: moves.values().next().cloned().unwrap_or_default(),
                reason,
            });
        }
        self.check_targets(job, epoch, placement, &moves)?;
        Ok(moves)
    }

    /// Every part lands on a registered node that is up and has the job's engine, one part
    /// per node, and no node a moved part goes to runs a part of another job.
    fn check_targets(
        &self,
        job: &Job,
        epoch: &Epoch,
        placement: &Placement,
        moves: &Moves,
    ) -> Result<(), DriveError> {
        let (id, number) = (job.id, epoch.number);
        let engine = job.snapshot_engine();
        let mut taken = BTreeSet::new();
        for n in &epoch.nodes {
            let target = moves.get(n).unwrap_or(n);
            let down = moves.contains_key(n) && !self.agents.up(target, self.cfg.node_timeout);
            if self.agents.address(target).is_none() || down {
                let hint = if let Some(a) = &placement.allocation {
                    format!(
                        "{target} is a node of {} but has no ckpt agent up there; start ckpt-agent on it, with agent.toml node_name set to the scheduler's name for the node",
                        a.name
                    )
                } else if moves.contains_key(n) {
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
        Ok(())
    }

    /// The moves onto a scheduler's allocation ([`onto_allocation`]); refused when it has fewer
    /// nodes than the epoch has parts, or names a node twice.
    fn fit_allocation(
        &self,
        job: &Job,
        epoch: &Epoch,
        a: &Allocation,
    ) -> Result<Moves, DriveError> {
        let (id, number) = (job.id, epoch.number);
        let mut seen = BTreeSet::new();
        if let Some(twice) = a.nodes.iter().find(|n| !seen.insert(*n)) {
            return Err(DriveError::Invalid(format!(
                "{} names node {twice} twice",
                a.name
            )));
        }
        if a.nodes.len() < epoch.nodes.len() {
            return Err(DriveError::Invalid(format!(
                "epoch {number} of job {id} has {} parts, one per node ({}), but {} has {} node(s) ({}): ask for at least {} (sbatch --nodes={})",
                epoch.nodes.len(),
                epoch.nodes.join(", "),
                a.name,
                a.nodes.len(),
                a.nodes.join(", "),
                epoch.nodes.len(),
                epoch.nodes.len(),
            )));
        }
        Ok(onto_allocation(&epoch.nodes, &a.nodes))
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

#[cfg(test)]
mod tests {
    use super::onto_allocation;

    fn names(s: &str) -> Vec<String> {
        s.split(',').map(str::to_string).collect()
    }

    fn moves(epoch: &str, allocation: &str) -> Vec<(String, String)> {
        onto_allocation(&names(epoch), &names(allocation))
            .into_iter()
            .collect()
    }

    #[test]
    fn parts_on_the_allocation_stay_and_the_others_take_its_free_nodes_in_order() {
        assert!(moves("a,b,c", "a,b,c").is_empty());
        assert!(moves("a,b,c", "c,b,a,d").is_empty());
        assert_eq!(moves("a,b,c", "b,c,d"), [("a".into(), "d".into())]);
        assert_eq!(
            moves("a,b,c", "d,e,f,b"),
            [("a".into(), "d".into()), ("c".into(), "e".into())]
        );
        // The epoch's order decides which part takes which node.
        assert_eq!(
            moves("c,a,b", "x,y,z"),
            [
                ("a".into(), "y".into()),
                ("b".into(), "z".into()),
                ("c".into(), "x".into())
            ]
        );
    }
}
