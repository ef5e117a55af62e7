//! `ckptctl nodes` and `ckptctl status` without a job: the cluster as ckptd sees it.
use std::collections::BTreeMap;

use ckpt_proto::v1 as pb;
use pb::NodeStateKind as State;
use serde_json::{json, Value};

use crate::show::size;
use crate::when::clock;

pub fn node_json(n: &pb::NodeInfo) -> Value {
    json!({
        "name": n.name, "state": n.state, "spare": n.spare,
        "spare_free": n.spare.then_some(n.free),
        "address": n.address, "version": n.version,
        "heartbeat_age_ms": n.heartbeat_age_ms,
        "down_since_unix_ms": (n.down_since_unix_ms > 0).then_some(n.down_since_unix_ms),
        "engines": n.engines.iter().map(|e| json!({"name": e.name, "version": e.version})).collect::<Vec<_>>(),
        "rdma_devices": n.rdma_devices,
        "staging_free_bytes": (n.staging_total_bytes > 0).then_some(n.staging_free_bytes),
        "staging_total_bytes": (n.staging_total_bytes > 0).then_some(n.staging_total_bytes),
        "jobs": n.jobs, "other_users_jobs": n.other_jobs,
    })
}

pub fn nodes_json(r: &pb::NodesReply) -> Value {
    json!({
        "ckptd_version": r.version,
        "node_timeout_ms": r.node_timeout_ms,
        "nodes": r.nodes.iter().map(node_json).collect::<Vec<_>>(),
    })
}

/// "up", "down since 12:03:04", "absent"; with ", spare (free)" or ", spare (in use)" (", spare"
/// when not up).
fn state_text(n: &pb::NodeInfo) -> String {
    let mut s = match n.state_kind() {
        State::Down if n.down_since_unix_ms > 0 => {
            format!("down since {}", clock(n.down_since_unix_ms))
        }
        _ => n.state.clone(),
    };
    if n.spare {
        s.push_str(match (n.state_kind(), n.free) {
            (State::Up, true) => ", spare (free)",
            (State::Up, false) => ", spare (in use)",
            _ => ", spare",
        });
    }
    s
}

fn age(ms: Option<u64>) -> String {
    match ms {
        None => "never".into(),
        Some(ms) if ms < 10_000 => format!("{:.1}s ago", ms as f64 / 1000.0),
        Some(ms) if ms < 60_000 => format!("{}s ago", ms / 1000),
        Some(ms) if ms < 7_200_000 => format!("{}m {}s ago", ms / 60_000, ms / 1000 % 60),
        Some(ms) => format!("{}h ago", ms / 3_600_000),
    }
}

fn dash(s: String) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s
    }
}

fn jobs_text(n: &pb::NodeInfo) -> String {
    let mut parts: Vec<String> = n.jobs.iter().map(u64::to_string).collect();
    if n.other_jobs > 0 {
        parts.push(format!("+{} other users'", n.other_jobs));
    }
    dash(parts.join(","))
}

/// `ckptctl nodes` in words: a line per node, then what is wrong and what to do.
pub fn print_nodes(r: &pb::NodesReply) {
    let rows: Vec<[String; 9]> = r
        .nodes
        .iter()
        .map(|n| {
            [
                n.name.clone(),
                state_text(n),
                age(n.heartbeat_age_ms),
                dash(n.version.clone()),
                dash(
                    n.engines
                        .iter()
                        .map(|e| format!("{} {}", e.name, e.version))
                        .collect::<Vec<_>>()
                        .join(", "),
                ),
                dash(n.rdma_devices.join(",")),
                if n.staging_total_bytes > 0 {
                    format!(
                        "{} of {}",
                        size(n.staging_free_bytes),
                        size(n.staging_total_bytes)
                    )
                } else {
                    "-".into()
                },
                jobs_text(n),
                dash(n.address.clone()),
            ]
        })
        .collect();
    let head = [
        "NODE",
        "STATE",
        "HEARTBEAT",
        "VERSION",
        "ENGINES",
        "RDMA",
        "STAGING FREE",
        "JOBS",
        "ADDRESS",
    ];
    let mut width: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let text: Vec<String> = cells
            .iter()
            .zip(&width)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        say!("{}", text.join("  ").trim_end());
    };
    line(head.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
    let c = Counts::of(&r.nodes);
    say!("{}", c.summary(r.node_timeout_ms));
    for n in &r.nodes {
        match n.state_kind() {
            State::Down => say!(
                "  {}: no heartbeat for {}: check ckpt-agent there (`systemctl status ckpt-agent`, `journalctl -u ckpt-agent`); a restart of its jobs puts their parts on spares (`ckptctl restart JOB --on-spares`)",
                n.name,
                age(n.heartbeat_age_ms).trim_end_matches(" ago")
            ),
            State::Absent => say!(
                "  {}: no agent has registered since ckptd started: start ckpt-agent there, or check its `coordinator` and node name in agent.toml",
                n.name
            ),
            _ => {}
        }
    }
}

/// Nodes by state.
#[derive(Default)]
struct Counts {
    total: usize,
    up: usize,
    down: usize,
    absent: usize,
    spares: usize,
    spares_free: usize,
}

impl Counts {
    fn of(nodes: &[pb::NodeInfo]) -> Self {
        let mut c = Counts::default();
        for n in nodes {
            c.total += 1;
            match n.state_kind() {
                State::Up => c.up += 1,
                State::Down => c.down += 1,
                State::Absent => c.absent += 1,
                // A state this ckptctl has no value for: counted in the total only.
                State::Unspecified => {}
            }
            if n.spare {
                c.spares += 1;
                if n.free && n.state_kind() == State::Up {
                    c.spares_free += 1;
                }
            }
        }
        c
    }

    /// "3 nodes: 2 up, 1 down (no heartbeat for 3s); spares: 1 of 1 up and free".
    fn summary(&self, timeout_ms: u64) -> String {
        let mut s = format!(
            "{} node{}: {} up",
            self.total,
            if self.total == 1 { "" } else { "s" },
            self.up
        );
        if self.down > 0 {
            s.push_str(&format!(
                ", {} down (no heartbeat for {:.0}s)",
                self.down,
                timeout_ms as f64 / 1000.0
            ));
        }
        if self.absent > 0 {
            s.push_str(&format!(", {} absent", self.absent));
        }
        if self.spares > 0 {
            s.push_str(&format!(
                "; spares: {} of {} up and free",
                self.spares_free, self.spares
            ));
        }
        s
    }
}

/// Live jobs (those whose processes run or are being checkpointed, started or restored), by
/// state in words, and the number of the others.
fn job_counts(jobs: &[pb::JobInfo]) -> (BTreeMap<&str, usize>, usize) {
    use pb::JobStateKind as K;
    let mut live = BTreeMap::new();
    let mut ended = 0;
    for j in jobs {
        match j.state_kind() {
            K::Running | K::Checkpointing | K::Restarting | K::Starting => {
                *live.entry(j.state.as_str()).or_default() += 1
            }
            K::Exited | K::Stopped | K::Cancelled | K::Lost | K::FailedToStart | K::Unspecified => {
                ended += 1
            }
        }
    }
    (live, ended)
}

pub fn cluster_json(r: &pb::NodesReply, jobs: &[pb::JobInfo]) -> Value {
    let c = Counts::of(&r.nodes);
    let (live, ended) = job_counts(jobs);
    json!({
        "ckptd_version": r.version,
        "nodes": {
            "total": c.total, "up": c.up, "down": c.down, "absent": c.absent,
            "spares": c.spares, "spares_free": c.spares_free,
        },
        "down": r.nodes.iter().filter(|n| n.state_kind() != State::Up).map(|n| json!({
            "name": n.name, "state": n.state,
            "down_since_unix_ms": (n.down_since_unix_ms > 0).then_some(n.down_since_unix_ms),
        })).collect::<Vec<_>>(),
        "jobs": { "live": live, "ended": ended },
    })
}

/// `ckptctl status` without a job: nodes and jobs in three lines, and the nodes that are not up.
pub fn print_cluster(r: &pb::NodesReply, jobs: &[pb::JobInfo], all_users: bool) {
    let c = Counts::of(&r.nodes);
    say!("ckptd {}: {}", r.version, c.summary(r.node_timeout_ms));
    for n in r.nodes.iter().filter(|n| n.state_kind() != State::Up) {
        say!("  {} {}", n.name, state_text(n));
    }
    let (live, ended) = job_counts(jobs);
    let live_total: usize = live.values().sum();
    let detail = if live.is_empty() {
        String::new()
    } else {
        format!(
            " ({})",
            live.iter()
                .map(|(s, n)| format!("{n} {s}"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    say!(
        "{} jobs: {live_total} live{detail}, {ended} ended",
        if all_users { "all users'" } else { "your" },
    );
    say!("details: `ckptctl nodes`, `ckptctl list`, `ckptctl status JOB`");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(kind: State, state: &str, spare: bool, free: bool) -> pb::NodeInfo {
        pb::NodeInfo {
            name: "n1".into(),
            state: state.into(),
            state_kind: kind.into(),
            spare,
            free,
            ..Default::default()
        }
    }

    #[test]
    fn a_nodes_state_reads_from_its_kind_in_ckptds_words() {
        assert_eq!(state_text(&node(State::Up, "up", false, false)), "up");
        assert_eq!(
            state_text(&node(State::Up, "up", true, true)),
            "up, spare (free)"
        );
        assert_eq!(
            state_text(&node(State::Up, "up", true, false)),
            "up, spare (in use)"
        );
        assert_eq!(
            state_text(&node(State::Absent, "absent", true, true)),
            "absent, spare"
        );
        assert_eq!(state_text(&node(State::Down, "down", false, false)), "down");
        let since = pb::NodeInfo {
            down_since_unix_ms: 1_000,
            ..node(State::Down, "down", false, false)
        };
        assert!(state_text(&since).starts_with("down since "));
    }

    #[test]
    fn the_summary_counts_nodes_by_kind() {
        let nodes = [
            node(State::Up, "up", false, false),
            node(State::Up, "up", true, true),
            node(State::Down, "down", true, true),
            node(State::Absent, "absent", false, false),
        ];
        assert_eq!(
            Counts::of(&nodes).summary(3_000),
            "4 nodes: 2 up, 1 down (no heartbeat for 3s), 1 absent; spares: 1 of 2 up and free"
        );
    }
}
