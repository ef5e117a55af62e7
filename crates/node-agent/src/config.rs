//! Agent configuration (`/etc/ckpt/agent.toml`); every key is documented in
//! `packaging/config/agent.toml`.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use ckpt_daemon::config::{load_or_default, parse_toml, ConfigError, TomlConfig};
use serde::Deserialize;

/// `ckpt-agent` configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Name of this node as jobs and operators see it. Default: the host name.
    pub node_name: String,
    /// Address the Agent gRPC service listens on.
    pub listen: SocketAddr,
    /// Address the coordinator uses to reach this agent. Default: `listen` (with the real port
    /// when `listen` has port 0).
    pub advertise: Option<String>,
    /// Coordinator's agent-facing address (`host:port`). Empty when embedded in `ckptd --standalone`.
    pub coordinator: String,
    /// Per-job state: launch specs, stdout/stderr, exit status, engine logs.
    pub state_dir: PathBuf,
    /// Node-local staging for checkpoint images (fast local disk or /dev/shm).
    pub local_dir: PathBuf,
    /// Shared storage (the NFS mount every node sees) that committed epochs are flushed to, in
    /// the background after the job resumed. Unset: no shared copies.
    pub shared_dir: Option<PathBuf>,
    /// How flushes to `shared_dir` run.
    pub flush: FlushConfig,
    /// How often the agent reports its jobs to the coordinator.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// Snapshot engine settings.
    pub criu: CriuConfig,
    /// Freezer cgroup settings.
    pub cgroup: CgroupConfig,
    /// How MPI launchers in jobs reach other nodes.
    pub launcher: LauncherConfig,
    /// Run jobs (and parts of jobs, and restores) as root (uid 0). Off by default: a job runs
    /// with its owner's uid, and root's jobs have no business on a compute node.
    pub allow_root_jobs: bool,
    /// This node's cluster credential (`ca.pem`, `node.pem`, `node.key`), installed by
    /// `ckpt-agent enroll`. Its certificate names the node: it must name `node_name`.
    pub tls_dir: PathBuf,
    /// Lowest uid other than root that jobs may run as: uids below it are system accounts
    /// (daemon, bin, ...), as in `/etc/login.defs`' `UID_MIN`.
    pub min_uid: u32,
}

/// How this node copies images to shared storage.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlushConfig {
    /// Files copied at once.
    pub streams: usize,
    /// Limit in MB/s over all streams of this node (leaves the job its share of the network
    /// and of the file server); 0: no limit.
    pub bandwidth_mb: u64,
}

impl Default for FlushConfig {
    fn default() -> Self {
        FlushConfig {
            streams: 4,
            bandwidth_mb: 0,
        }
    }
}

impl FlushConfig {
    /// The copy options these settings mean.
    pub fn copy_options(&self) -> ckpt_store::copy::CopyOptions {
        ckpt_store::copy::CopyOptions {
            streams: self.streams,
            bandwidth: (self.bandwidth_mb > 0).then_some(self.bandwidth_mb * 1_000_000),
        }
    }
}

/// The launcher program that mpiexec runs instead of ssh.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LauncherConfig {
    /// Path of `ckpt-rsh`, or `auto`: next to the agent's own binary.
    pub path: String,
    /// Point MPICH's Hydra and Open MPI at it in every job's environment (`HYDRA_LAUNCHER`,
    /// `HYDRA_LAUNCHER_EXEC`, `OMPI_MCA_plm`, `OMPI_MCA_plm_rsh_agent`) unless the job sets them.
    pub set_mpi_env: bool,
}

impl Default for LauncherConfig {
    fn default() -> Self {
        LauncherConfig {
            path: "auto".into(),
            set_mpi_env: true,
        }
    }
}

impl LauncherConfig {
    /// The launcher's path, if it exists.
    pub fn resolve(&self) -> Option<PathBuf> {
        let p = if self.path == "auto" {
            std::env::current_exe().ok()?.with_file_name("ckpt-rsh")
        } else {
            PathBuf::from(&self.path)
        };
        p.is_file().then_some(p)
    }
}

/// CRIU engine settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriuConfig {
    /// Path of the `criu` binary, or `auto`: `/opt/ckpt/criu/bin/criu` (installed by
    /// `scripts/setup.sh`) if present, else `criu` on PATH.
    pub path: String,
    /// Network lock method during dump and restore (`nftables` or `iptables`).
    pub network_lock: String,
    /// Extra arguments appended to every `criu dump`.
    pub extra_dump_args: Vec<String>,
    /// Extra arguments appended to every `criu restore`.
    pub extra_restore_args: Vec<String>,
    /// Largest deleted-but-open file CRIU copies into the image (`--ghost-limit`).
    pub ghost_limit: String,
}

/// Freezer cgroup settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CgroupConfig {
    /// Parent cgroup under which each job gets `<prefix><id>`, or `auto`: the v1 freezer
    /// hierarchy if mounted, else the cgroup v2 root.
    pub parent: String,
    /// Name prefix of job cgroups (`<prefix><job id>`). Give each agent sharing a machine its
    /// own prefix.
    pub prefix: String,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            node_name: hostname(),
            listen: "0.0.0.0:7601".parse().expect("valid"),
            advertise: None,
            coordinator: "127.0.0.1:7600".into(),
            state_dir: "/var/lib/ckpt/agent".into(),
            local_dir: "/var/lib/ckpt/local".into(),
            shared_dir: None,
            flush: FlushConfig::default(),
            heartbeat_interval: Duration::from_secs(1),
            criu: CriuConfig::default(),
            cgroup: CgroupConfig::default(),
            launcher: LauncherConfig::default(),
            allow_root_jobs: false,
            tls_dir: ckpt_auth::ca::DEFAULT_DIR.into(),
            min_uid: 1000,
        }
    }
}

impl Default for CriuConfig {
    fn default() -> Self {
        CriuConfig {
            path: "auto".into(),
            network_lock: "nftables".into(),
            extra_dump_args: Vec::new(),
            extra_restore_args: Vec::new(),
            ghost_limit: "256M".into(),
        }
    }
}

impl Default for CgroupConfig {
    fn default() -> Self {
        CgroupConfig {
            parent: "auto".into(),
            prefix: "ckpt-job-".into(),
        }
    }
}

impl AgentConfig {
    /// Default location of the config file.
    pub const DEFAULT_PATH: &'static str = "/etc/ckpt/agent.toml";
}

impl TomlConfig for AgentConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Err(e) = ckpt_store::validate::node_name(&self.node_name) {
            return Err(ConfigError::Invalid {
                key: "node_name",
                problem: e.to_string(),
            });
        }
        if !self.state_dir.is_absolute() {
            return Err(ConfigError::Invalid {
                key: "state_dir",
                problem: "must be an absolute path".into(),
            });
        }
        if !self.local_dir.is_absolute() {
            return Err(ConfigError::Invalid {
                key: "local_dir",
                problem: "must be an absolute path".into(),
            });
        }
        if self.shared_dir.as_ref().is_some_and(|d| !d.is_absolute()) {
            return Err(ConfigError::Invalid {
                key: "shared_dir",
                problem: "must be an absolute path".into(),
            });
        }
        if self.flush.streams == 0 || self.flush.streams > 64 {
            return Err(ConfigError::Invalid {
                key: "flush.streams",
                problem: format!("must be 1 to 64, got {}", self.flush.streams),
            });
        }
        if self.heartbeat_interval < Duration::from_millis(50) {
            return Err(ConfigError::Invalid {
                key: "heartbeat_interval",
                problem: "must be at least 50ms".into(),
            });
        }
        if self.cgroup.prefix.is_empty() || self.cgroup.prefix.contains('/') {
            return Err(ConfigError::Invalid {
                key: "cgroup.prefix",
                problem: format!(
                    "must be a non-empty name without '/', got {:?}",
                    self.cgroup.prefix
                ),
            });
        }
        if !["nftables", "iptables", "skip"].contains(&self.criu.network_lock.as_str()) {
            return Err(ConfigError::Invalid {
                key: "criu.network_lock",
                problem: format!(
                    "must be nftables, iptables or skip, got {:?}",
                    self.criu.network_lock
                ),
            });
        }
        Ok(())
    }
}

/// This machine's host name.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn defaults_are_valid_and_keys_parse() {
        let c = AgentConfig::from_toml(
            Path::new("a.toml"),
            "node_name = \"n1\"\nheartbeat_interval = \"250ms\"\n[criu]\npath = \"/usr/sbin/criu\"\n",
        )
        .unwrap();
        assert_eq!(c.node_name, "n1");
        assert_eq!(c.heartbeat_interval, Duration::from_millis(250));
        assert_eq!(c.criu.path, "/usr/sbin/criu");
        assert_eq!(c.criu.network_lock, "nftables");
        assert!(!c.allow_root_jobs, "root jobs are refused unless allowed");
        assert_eq!(c.min_uid, 1000);
        let c = AgentConfig::from_toml(
            Path::new("a.toml"),
            "allow_root_jobs = true\nmin_uid = 500\n",
        )
        .unwrap();
        assert!(c.allow_root_jobs);
        assert_eq!(c.min_uid, 500);
    }

    #[test]
    fn unknown_key_is_named() {
        let err =
            AgentConfig::from_toml(Path::new("a.toml"), "[criu]\npaht = \"x\"\n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("a.toml") && msg.contains("paht"), "{msg}");
    }

    #[test]
    fn bad_value_is_named() {
        let err =
            AgentConfig::from_toml(Path::new("a.toml"), "local_dir = \"relative\"\n").unwrap_err();
        assert!(err.to_string().contains("local_dir"), "{err}");
    }
}
