//! ckptd configuration (`/etc/ckpt/ckptd.toml`); every key is documented in
//! `packaging/config/ckptd.toml`.
//!
//! One file: every key of ckptd.toml with its default and its check, in the order
//! `packaging/config/ckptd.toml` documents them.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use ckpt_daemon::config::{ConfigError, TomlConfig};
use serde::Deserialize;

mod registry;
pub use registry::RegistryConfig;

/// `ckptd` configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// Address agents register and heartbeat on.
    pub listen: SocketAddr,
    /// Unix socket ckptctl connects to.
    pub socket: PathBuf,
    /// Job registry and epoch history (redb file), unless `[registry]` puts them in etcd.
    pub database: PathBuf,
    /// Where the registry lives: this file (the default), or an etcd cluster shared by an
    /// active ckptd and its standbys.
    pub registry: RegistryConfig,
    /// Phase deadlines.
    pub deadlines: Deadlines,
    /// How many checkpoints are kept.
    pub retention: Retention,
    /// Which checkpoints are copied to shared storage.
    pub flush: Flush,
    /// Extra copies in node-local storage.
    pub redundancy: Redundancy,
    /// Addresses for job sandboxes.
    pub job_network: JobNetwork,
    /// Nodes kept free to take the parts of nodes that are down.
    pub spares: Spares,
    /// When an epoch's phases go through relay agents instead of from ckptd to every node.
    pub relays: Relays,
    /// Periodic checkpoints (`ckptctl run --every`, `ckptctl policy`).
    pub policy: PolicyConfig,
    /// What one user may hold and ask for.
    pub limits: Limits,
    /// What ckptd does by itself when a job fails.
    pub recovery: RecoveryConfig,
    /// A node whose agent has not sent a heartbeat for this long is down (agents beat every
    /// second by default): a restart replaces it with a spare.
    #[serde(with = "humantime_serde")]
    pub node_timeout: Duration,
    /// The lease ckptd grants each agent with every answer: an agent that ckptd has not
    /// answered for this long kills its parts (its shims do, even with the agent dead), so that
    /// a node cut off from ckptd never runs a part ckptd restarts elsewhere. Shorter than
    /// `node_timeout` by at least [`LEASE_MARGIN`]; unset: half of it.
    #[serde(default, with = "humantime_serde")]
    pub fence_lease: Option<Duration>,
    /// The cluster credential (`ca.pem`, `ckptd.pem`, `ckptd.key`) made by `ckptd ca init`.
    /// Agents and ckptd authenticate each other with it on every connection. A standalone
    /// ckptd without one opens no TCP port at all.
    pub tls_dir: PathBuf,
    /// The Prometheus endpoint (`[metrics] listen`, `token_file`); off by default. With
    /// `--standalone` it covers the embedded agent too.
    pub metrics: ckpt_daemon::metrics::MetricsConfig,
    /// The `[agent]` table: the embedded agent's settings, used with `--standalone`. The ckptd
    /// binary reads and validates it; the coordinator does not look inside.
    pub agent: toml::Table,
}

/// The `[recovery]` table: what ckptd does when a job fails (a node of it lost, a process of it
/// killed by a signal ckpt did not send).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecoveryConfig {
    /// For jobs run without `--on-failure`: `stop` (a person restarts them), `restart` or
    /// `restart:N` (ckptd does, at most N times). Applies to jobs that can move (sandboxes).
    pub on_failure: String,
    /// The wait before a job's second automatic restart; each later one waits twice as long
    /// as the one before. The first comes at once.
    #[serde(with = "humantime_serde")]
    pub backoff: Duration,
}

impl Default for RecoveryConfig {
    fn default() -> Self {
        RecoveryConfig {
            on_failure: "stop".into(),
            backoff: Duration::from_secs(10),
        }
    }
}

/// What one user other than root may hold and ask for, so that no user can take the cluster's
/// job addresses, the coordinator's time or the nodes' disks from the others. 0: no limit.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Live jobs (starting, running, checkpointing or restarting) per user: `run` and
    /// `restart` beyond it are refused.
    pub jobs: u32,
    /// Job addresses the jobs of one user may hold (running or restartable jobs keep theirs).
    pub addresses: u32,
    /// Checkpoints of one user's jobs started in any hour, asked for or periodic. A
    /// checkpoint with `--kill` (the last one before a preemption or a time limit) and one
    /// root takes (drain, deadline) are never refused, nor counted.
    pub checkpoints_per_hour: u32,
    /// `ckptctl verify` runs of one user in progress at once (each reads every image of an
    /// epoch on every node).
    pub verifies: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            jobs: 256,
            addresses: 1024,
            checkpoints_per_hour: 360,
            verifies: 2,
        }
    }
}

/// How many committed checkpoints of each job keep their images.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Retention {
    /// Committed epochs per job kept in node-local staging (the newest ones); older epochs are
    /// marked `expired` and their images deleted on every node. 0 keeps every epoch.
    pub keep_local: u32,
    /// Durable epochs per job kept in shared storage (the newest ones); older ones are marked
    /// `expired` and their shared and local copies deleted. 0 keeps every epoch.
    pub keep_shared: u32,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            keep_local: 3,
            keep_shared: 0,
        }
    }
}

/// Copies of each node's images kept on other nodes.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Redundancy {
    /// After commit, every node of a job on several nodes also sends its images to the next
    /// node of the job (in name order, the last to the first), which keeps them in its
    /// `local_dir`: a node whose copy is lost or damaged restores from there before trying
    /// shared storage. Doubles the local space a checkpoint takes. With `scheme` other than
    /// `partner` this is not used; `partner = false` with `scheme = "partner"` turns redundancy
    /// off.
    pub partner: bool,
    /// How a committed epoch survives lost nodes without shared storage: `partner` (the copy
    /// above), `xor:G` (XOR parity over groups of G nodes: one lost node per group) or
    /// `rs:K+M` (Reed-Solomon, M parity shards per K data: M lost nodes per group of K+M).
    /// Checked at start.
    pub scheme: String,
    /// Failure domains (rack, switch, power) by node name: the members of a group are taken
    /// from different domains in turn. Nodes not named are a domain each.
    pub domains: std::collections::BTreeMap<String, String>,
}

impl Redundancy {
    /// The scheme in force: none when partner copies are off and no other scheme is set.
    pub fn scheme(&self) -> Option<ckpt_store::erasure::Scheme> {
        use ckpt_store::erasure::Scheme;
        match self.scheme.parse::<Scheme>() {
            Ok(Scheme::Partner) if !self.partner => None,
            Ok(s) => Some(s),
            Err(_) => None,
        }
    }

    /// The scheme of a job that chose `own` (`ckptctl run --redundancy`: a scheme, `none`, or
    /// empty for this configuration's).
    pub fn scheme_for(&self, own: &str) -> Option<ckpt_store::erasure::Scheme> {
        match own {
            "" => self.scheme(),
            "none" => None,
            s => s.parse().ok(),
        }
    }
}

impl Default for Redundancy {
    fn default() -> Self {
        Redundancy {
            partner: true,
            scheme: "partner".into(),
            domains: Default::default(),
        }
    }
}

/// The job network: every part of a job gets one of its addresses and runs in a sandbox (its own
/// PID, IPC and UTS namespaces, and a network namespace with that address, made by the node's
/// agent), so that a restart may put the part on any node. Unset: no sandboxes, and a job
/// restarts only on the nodes it ran on.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobNetwork {
    /// The addresses handed out, `FIRST-LAST` (IPv4, on the cluster network the nodes' agents
    /// put them on, and used by nothing else). Empty: no job network.
    pub addresses: String,
    /// Prefix length of the job network (e.g. 24).
    pub prefix: u8,
    /// Default gateway of the sandboxes, if the network has one.
    pub gateway: String,
}

impl JobNetwork {
    /// The first and last address, if configured.
    pub fn range(&self) -> Result<Option<(std::net::Ipv4Addr, std::net::Ipv4Addr)>, String> {
        if self.addresses.trim().is_empty() {
            return Ok(None);
        }
        let (a, b) = self
            .addresses
            .split_once('-')
            .ok_or_else(|| format!("{:?} is not FIRST-LAST", self.addresses))?;
        let parse = |t: &str| {
            t.trim()
                .parse::<std::net::Ipv4Addr>()
                .map_err(|_| format!("{t:?} is not an IPv4 address"))
        };
        let (first, last) = (parse(a)?, parse(b)?);
        if u32::from(first) > u32::from(last) {
            return Err(format!("{first} comes after {last}"));
        }
        if !(1..=32).contains(&self.prefix) {
            return Err("set [job_network] prefix to the network's prefix length (1-32)".into());
        }
        let mask = u32::MAX << (32 - u32::from(self.prefix));
        if u32::from(first) & mask != u32::from(last) & mask {
            return Err(format!(
                "{first} and {last} are not in one /{} network",
                self.prefix
            ));
        }
        Ok(Some((first, last)))
    }
}

/// Spare nodes: registered agents that run no job until a restart needs them. `ckptctl restart
/// --on-spares` (and a plain restart, when a node of the epoch is down) puts the part of every
/// node that is down on the first free spare, in the order listed; `ckptctl drain NODE
/// --migrate` moves the parts on NODE there. Only jobs that run in sandboxes move.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Spares {
    /// Node names (as their agents register).
    pub nodes: Vec<String>,
}

/// Relays: above `above` nodes, ckptd drives an epoch through relay agents instead of holding
/// a stream to every node. The job's nodes are cut into groups of `fanout` in their order;
/// the first node of each group relays, for that epoch only, to the others, under a grant
/// ckptd signs for that job, epoch, relay and group, void when the epoch's deadlines have all
/// passed. ckptd then handles one stream per group.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Relays {
    /// Epochs over at most this many nodes are driven flat, ckptd to every node; 0 never
    /// relays.
    pub above: usize,
    /// Nodes per group (the relay's own included); at least 2.
    pub fanout: usize,
}

impl Default for Relays {
    fn default() -> Self {
        Relays {
            above: 256,
            fanout: 32,
        }
    }
}

impl Relays {
    /// The groups of `nodes` an epoch is driven through: one per link ckptd holds, its first
    /// node the relay (a group of one is a node driven directly).
    pub fn groups<'n>(&self, nodes: &'n [String]) -> Vec<&'n [String]> {
        if self.above == 0 || nodes.len() <= self.above {
            return nodes.chunks(1).collect();
        }
        nodes.chunks(self.fanout.max(2)).collect()
    }
}

/// When committed epochs are copied to shared storage (nodes without `shared_dir` never are).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Flush {
    /// Flush every F-th epoch of a job (epochs F, 2F, ...); 1 flushes every epoch, 0 none.
    pub every: u32,
}

impl Default for Flush {
    fn default() -> Self {
        Flush { every: 1 }
    }
}

/// What `--every auto` derives its interval from, and its bounds.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Mean time between failures of one node (hardware, kernel, network: whatever ends the
    /// job). A job on N nodes fails N times as often.
    #[serde(with = "humantime_serde")]
    pub node_mtbf: Duration,
    /// `--every auto` before any checkpoint of the job was measured: the first checkpoint comes
    /// this long after the start, and its cost sets the interval from then on.
    #[serde(with = "humantime_serde")]
    pub auto_first: Duration,
    /// Shortest interval `--every auto` picks.
    #[serde(with = "humantime_serde")]
    pub auto_min: Duration,
    /// Longest interval `--every auto` picks.
    #[serde(with = "humantime_serde")]
    pub auto_max: Duration,
    /// A deadline's final checkpoint starts this long, plus one and a half times its
    /// estimated time to durable, before the deadline.
    #[serde(with = "humantime_serde")]
    pub deadline_margin: Duration,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            // humantime's "5years" (a year of 365.25 days).
            node_mtbf: Duration::from_secs(5 * 31_557_600),
            auto_first: Duration::from_secs(600),
            auto_min: Duration::from_secs(60),
            auto_max: Duration::from_secs(24 * 3600),
            deadline_margin: Duration::from_secs(60),
        }
    }
}

impl PolicyConfig {
    /// As the interval computation takes it.
    pub fn auto_params(&self) -> crate::model::policy::AutoParams {
        crate::model::policy::AutoParams {
            node_mtbf: self.node_mtbf,
            first: self.auto_first,
            min: self.auto_min,
            max: self.auto_max,
        }
    }
}

/// How long each protocol step may take on every node before the epoch is aborted.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Deadlines {
    /// Initial synchronization: only checks, so seconds.
    #[serde(with = "humantime_serde")]
    pub sync: Duration,
    /// Quiesce and freeze: the freezer answers in milliseconds unless a task is stuck in D state.
    #[serde(with = "humantime_serde")]
    pub quiesce: Duration,
    /// Local checkpoint: grows with memory; 10 min covers ~60 GB per node at local-disk speed.
    #[serde(with = "humantime_serde")]
    pub dump: Duration,
    /// Thaw (or kill) and rebuild.
    #[serde(with = "humantime_serde")]
    pub resume: Duration,
    /// Digest and fsync of images: reads everything once more, so as long as a dump.
    #[serde(with = "humantime_serde")]
    pub finalize: Duration,
    /// Restore of one node, including digest verification.
    #[serde(with = "humantime_serde")]
    pub restore: Duration,
    /// Abort on every node after a failure.
    #[serde(with = "humantime_serde")]
    pub abort: Duration,
    /// A flush to shared storage that reports no progress for this long is failed (it has no
    /// overall deadline: a bandwidth-limited copy of a large job takes as long as it takes).
    #[serde(with = "humantime_serde")]
    pub flush_stall: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            sync: Duration::from_secs(30),
            quiesce: Duration::from_secs(60),
            dump: Duration::from_secs(600),
            resume: Duration::from_secs(60),
            finalize: Duration::from_secs(600),
            restore: Duration::from_secs(900),
            abort: Duration::from_secs(60),
            flush_stall: Duration::from_secs(120),
        }
    }
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            listen: "0.0.0.0:7600".parse().expect("valid"),
            socket: "/run/ckpt/ckptd.sock".into(),
            database: "/var/lib/ckpt/ckptd.redb".into(),
            registry: RegistryConfig::default(),
            deadlines: Deadlines::default(),
            retention: Retention::default(),
            flush: Flush::default(),
            redundancy: Redundancy::default(),
            job_network: JobNetwork::default(),
            spares: Spares::default(),
            relays: Relays::default(),
            policy: PolicyConfig::default(),
            limits: Limits::default(),
            recovery: RecoveryConfig::default(),
            node_timeout: Duration::from_secs(10),
            fence_lease: None,
            tls_dir: ckpt_auth::ca::DEFAULT_DIR.into(),
            metrics: Default::default(),
            agent: toml::Table::new(),
        }
    }
}

/// How much shorter than `node_timeout` the lease must be: the time a node's shims take to
/// notice the lease ran out (a tenth of a second) and to kill their parts, with room to spare.
pub const LEASE_MARGIN: Duration = Duration::from_millis(500);

impl CoordinatorConfig {
    /// Default location of the config file.
    pub const DEFAULT_PATH: &'static str = "/etc/ckpt/ckptd.toml";

    /// The lease agents get: `fence_lease`, or half of `node_timeout`.
    pub fn lease(&self) -> Duration {
        self.fence_lease.unwrap_or(self.node_timeout / 2)
    }
}

impl TomlConfig for CoordinatorConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.metrics.validate()?;
        let d = &self.deadlines;
        for (key, v) in [
            ("deadlines.sync", d.sync),
            ("deadlines.quiesce", d.quiesce),
            ("deadlines.dump", d.dump),
            ("deadlines.resume", d.resume),
            ("deadlines.finalize", d.finalize),
            ("deadlines.restore", d.restore),
            ("deadlines.abort", d.abort),
            ("deadlines.flush_stall", d.flush_stall),
            ("node_timeout", self.node_timeout),
            ("policy.node_mtbf", self.policy.node_mtbf),
            ("policy.auto_first", self.policy.auto_first),
            ("policy.auto_min", self.policy.auto_min),
        ] {
            if v.is_zero() {
                return Err(ConfigError::Invalid {
                    key,
                    problem: "must be greater than zero".into(),
                });
            }
        }
        self.redundancy
            .scheme
            .parse::<ckpt_store::erasure::Scheme>()
            .map_err(|problem| ConfigError::Invalid {
                key: "redundancy.scheme",
                problem,
            })?;
        crate::model::OnFailure::parse(&self.recovery.on_failure).map_err(|problem| {
            ConfigError::Invalid {
                key: "recovery.on_failure",
                problem: problem.replace("--on-failure ", ""),
            }
        })?;
        let lease = self.lease();
        if lease.is_zero() || lease + LEASE_MARGIN > self.node_timeout {
            return Err(ConfigError::Invalid {
                key: "fence_lease",
                problem: format!(
                    "must be above zero and at least {} shorter than node_timeout ({}): a node's parts must be dead before ckptd may declare it lost and restart them elsewhere",
                    humantime::format_duration(LEASE_MARGIN),
                    humantime::format_duration(self.node_timeout)
                ),
            });
        }
        self.registry.validate(lease)?;
        self.job_network
            .range()
            .map_err(|problem| ConfigError::Invalid {
                key: "job_network.addresses",
                problem,
            })?;
        if !self.job_network.gateway.is_empty()
            && self
                .job_network
                .gateway
                .parse::<std::net::Ipv4Addr>()
                .is_err()
        {
            return Err(ConfigError::Invalid {
                key: "job_network.gateway",
                problem: "must be an IPv4 address".into(),
            });
        }
        if self.policy.auto_min > self.policy.auto_max {
            return Err(ConfigError::Invalid {
                key: "policy.auto_min",
                problem: "must not exceed policy.auto_max".into(),
            });
        }
        if self.relays.fanout < 2 {
            return Err(ConfigError::Invalid {
                key: "relays.fanout",
                problem: "must be at least 2 (a relay and one node below it)".into(),
            });
        }
        let mut seen = std::collections::BTreeSet::new();
        for n in &self.spares.nodes {
            if n.trim().is_empty() || !seen.insert(n) {
                return Err(ConfigError::Invalid {
                    key: "spares.nodes",
                    problem: format!("{n:?} is empty or listed twice"),
                });
            }
        }
        if !self.database.is_absolute() {
            return Err(ConfigError::Invalid {
                key: "database",
                problem: "must be an absolute path".into(),
            });
        }
        // ckptctl takes a list of sockets (`CKPT_SOCKET=a,b`, one per ckptd of a machine);
        // ckptd, reading the same variable, would bind one file named after the whole list.
        if self.socket.as_os_str().as_encoded_bytes().contains(&b',') {
            return Err(ConfigError::Invalid {
                key: "socket",
                problem: format!(
                    "{} is a list: a list of sockets is for ckptctl (CKPT_SOCKET, --socket); ckptd binds one, so give it one path (unset CKPT_SOCKET where ckptd starts, or pass --socket PATH)",
                    self.socket.display()
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn relays_cut_a_large_epoch_into_groups_in_node_order() {
        let nodes: Vec<String> = (0..10).map(|i| format!("n{i}")).collect();
        let flat = Relays::default().groups(&nodes);
        assert_eq!(flat.len(), 10);
        assert!(flat.iter().all(|g| g.len() == 1));
        let r = Relays {
            above: 4,
            fanout: 4,
        };
        let g = r.groups(&nodes);
        assert_eq!(g.iter().map(|g| g.len()).collect::<Vec<_>>(), [4, 4, 2]);
        assert_eq!(g[1][0], "n4");
        assert_eq!(
            Relays {
                above: 0,
                fanout: 4
            }
            .groups(&nodes)
            .len(),
            10
        );
        assert_eq!(
            Relays {
                above: 10,
                fanout: 4
            }
            .groups(&nodes)
            .len(),
            10
        );
    }

    /// `CKPT_SOCKET=a,b`, the documented list for ckptctl, reaches ckptd too: refused, not
    /// bound as one file named after the list.
    #[test]
    fn a_socket_list_is_refused_naming_what_to_do() {
        let e = CoordinatorConfig::from_toml(
            Path::new("c.toml"),
            "socket = \"/run/a/ckptd.sock,/run/b/ckptd.sock\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("socket") && e.contains("is a list") && e.contains("--socket PATH"),
            "{e}"
        );
        assert!(
            CoordinatorConfig::from_toml(Path::new("c.toml"), "socket = \"/run/a.sock\"\n").is_ok()
        );
    }

    #[test]
    fn parses_deadlines_and_agent_table() {
        let c = CoordinatorConfig::from_toml(
            Path::new("c.toml"),
            "[deadlines]\ndump = \"2m\"\n[agent]\nnode_name = \"head\"\n",
        )
        .unwrap();
        assert_eq!(c.deadlines.dump, Duration::from_secs(120));
        assert_eq!(c.deadlines.sync, Duration::from_secs(30));
        assert_eq!(c.agent["node_name"].as_str(), Some("head"));
    }

    #[test]
    fn an_etcd_registry_is_reached_over_tls_with_a_client_certificate_and_outlasted_by_the_fence() {
        let c = |t: &str| CoordinatorConfig::from_toml(Path::new("c.toml"), t);
        let tls = "ca = \"/etc/ckpt/etcd/ca.pem\"\ncert = \"/etc/ckpt/etcd/ckptd.pem\"\nkey = \"/etc/ckpt/etcd/ckptd.key\"\n";
        let ok = c(&format!(
            "fence_lease = \"11s\"\nnode_timeout = \"12s\"\n[registry]\nbackend = \"etcd\"\nendpoints = [\"https://h1:2379\", \"https://h2:2379\"]\n{tls}"
        ))
        .unwrap();
        assert!(ok.registry.etcd());
        assert_eq!(ok.registry.lease, Duration::from_secs(5));
        assert!(!c("").unwrap().registry.etcd(), "redb is the default");
        for (bad, key, says) in [
            ("backend = \"zk\"\n", "registry.backend", "\"etcd\""),
            ("backend = \"etcd\"\n", "registry.endpoints", "https://"),
            (
                "backend = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n",
                "registry.endpoints",
                "TLS only",
            ),
            (
                "backend = \"etcd\"\nendpoints = [\"https://h1:2379\"]\nca = \"/ca.pem\"\n",
                "registry.ca",
                "client certificate",
            ),
            (
                &format!("backend = \"etcd\"\nendpoints = [\"https://h1:2379\"]\n{tls}lease = \"1500ms\"\n"),
                "registry.lease",
                "whole seconds",
            ),
            (
                &format!("backend = \"etcd\"\nendpoints = [\"https://h1:2379\"]\n{tls}lease = \"6s\"\n"),
                "registry.lease",
                "fence_lease (11s) of twice it and 1 s more, 13s (node_timeout 26s",
            ),
            (
                &format!("backend = \"etcd\"\nendpoints = [\"https://h1:2379\"]\n{tls}prefix = \"ckpt\"\n"),
                "registry.prefix",
                "'/'",
            ),
        ] {
            let e = c(&format!(
                "fence_lease = \"11s\"\nnode_timeout = \"12s\"\n[registry]\n{bad}"
            ))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains(says), "{bad}: {e}");
        }
        // The default fence (half of node_timeout's 10 s) is too short for a failover: the
        // error says what to set.
        let e = c(&format!(
            "[registry]\nbackend = \"etcd\"\nendpoints = [\"https://h1:2379\"]\n{tls}"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("11s (node_timeout 22s"), "{e}");
        // A longer lease fits a longer fence.
        let long = c(&format!(
            "node_timeout = \"26s\"\n[registry]\nbackend = \"etcd\"\nendpoints = [\"https://h1:2379\"]\n{tls}lease = \"6s\"\n"
        ))
        .unwrap();
        assert_eq!(long.registry.lease, Duration::from_secs(6));
    }

    #[test]
    fn the_lease_is_shorter_than_node_timeout() {
        let c = |t: &str| CoordinatorConfig::from_toml(Path::new("c.toml"), t);
        assert_eq!(c("").unwrap().lease(), Duration::from_secs(5));
        assert_eq!(
            c("node_timeout = \"2s\"\n").unwrap().lease(),
            Duration::from_secs(1)
        );
        assert_eq!(
            c("fence_lease = \"7s\"\n").unwrap().lease(),
            Duration::from_secs(7)
        );
        for bad in [
            "fence_lease = \"10s\"\n",
            "fence_lease = \"9600ms\"\n",
            "fence_lease = \"0s\"\n",
            "node_timeout = \"600ms\"\n",
        ] {
            let e = c(bad).unwrap_err().to_string();
            assert!(
                e.contains("fence_lease") && e.contains("node_timeout"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn errors_name_the_key() {
        let e = CoordinatorConfig::from_toml(Path::new("c.toml"), "[deadlines]\ndump = \"0s\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("deadlines.dump"), "{e}");
        let e = CoordinatorConfig::from_toml(Path::new("c.toml"), "listen = 5\n").unwrap_err();
        assert!(e.to_string().contains("c.toml"), "{e}");
        let e = CoordinatorConfig::from_toml(Path::new("c.toml"), "[deadlines]\ndumpp = \"1s\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("dumpp"), "{e}");
    }
}

#[cfg(test)]
mod example_config {
    use super::*;
    use std::path::Path;

    #[test]
    fn packaged_example_is_valid() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/config/ckptd.toml");
        let c = CoordinatorConfig::load(&p).unwrap();
        assert_eq!(c.deadlines.dump, Duration::from_secs(600));
        assert_eq!((c.relays.above, c.relays.fanout), (256, 32));
    }

    #[test]
    fn a_relay_fanout_below_two_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ckptd.toml");
        std::fs::write(&p, "[relays]\nfanout = 1\n").unwrap();
        let e = CoordinatorConfig::load(&p).unwrap_err().to_string();
        assert!(
            e.contains("relays.fanout") && e.contains("at least 2"),
            "{e}"
        );
    }
}
