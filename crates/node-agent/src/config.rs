//! Agent configuration (`/etc/ckpt/agent.toml`); every key is documented in
//! `packaging/config/agent.toml`.
//!
//! One file: every key of agent.toml with its default and its check, in the order
//! `packaging/config/agent.toml` documents them.
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
    /// The Prometheus endpoint (`[metrics] listen`, `token_file`); off by default. An agent
    /// embedded in a standalone ckptd has none: ckptd's covers it.
    pub metrics: ckpt_daemon::metrics::MetricsConfig,
    /// Address the Agent gRPC service listens on.
    pub listen: SocketAddr,
    /// Address the coordinator uses to reach this agent. Default: `listen` (with the real port
    /// when `listen` has port 0).
    pub advertise: Option<String>,
    /// Coordinator's agent-facing address (`host:port`); with standby ckptd, all of theirs,
    /// comma-separated (`head1:7600,head2:7600`): the agent and its jobs' `ckpt-rsh` reach
    /// whichever is active. Empty when embedded in `ckptd --standalone`.
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
    /// The other snapshot engines this node offers (`ckptctl run --engine NAME`).
    pub engines: EnginesConfig,
    /// Pre-copy: memory copied while jobs run, so checkpoints freeze them only for what changed.
    pub precopy: PrecopyConfig,
    /// Freezer cgroup settings.
    pub cgroup: CgroupConfig,
    /// How MPI launchers in jobs reach other nodes.
    pub launcher: LauncherConfig,
    /// The verbs layer preloaded into jobs that may use RDMA devices.
    pub verbs_layer: VerbsLayerConfig,
    /// Where job sandboxes' addresses go.
    pub job_network: JobNetworkConfig,
    /// Run jobs (and parts of jobs, and restores) as root (uid 0). Off by default: a job runs
    /// with its owner's uid, and root's jobs have no business on a compute node.
    pub allow_root_jobs: bool,
    /// This node's cluster credential (`ca.pem`, `node.pem`, `node.key`), installed by
    /// `ckpt-agent enroll`. Its certificate names the node: it must name `node_name`.
    pub tls_dir: PathBuf,
    /// Lowest uid other than root that jobs may run as: uids below it are system accounts
    /// (daemon, bin, ...), as in `/etc/login.defs`' `UID_MIN`.
    pub min_uid: u32,
    /// `[slurm]`: on a node Slurm schedules, jobs only for users Slurm gave this node.
    pub slurm: crate::os::slurm::SlurmGate,
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
    /// How chunks are stored in shared storage: `"none"`, or `"zstd:LEVEL"` (1-19).
    pub compress: Compress,
}

impl Default for FlushConfig {
    fn default() -> Self {
        FlushConfig {
            streams: 4,
            bandwidth_mb: 0,
            compress: Compress(None),
        }
    }
}

/// `[flush] compress`: a zstd level, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Compress(pub Option<i32>);

impl TryFrom<String> for Compress {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        let bad = || {
            format!("compress = \"{s}\": expected \"none\" or \"zstd:LEVEL\" with LEVEL 1 to 19 (3 is zstd's default)")
        };
        match s.as_str() {
            "none" => Ok(Compress(None)),
            "zstd" => Ok(Compress(Some(3))),
            _ => {
                let level: i32 = s
                    .strip_prefix("zstd:")
                    .and_then(|l| l.parse().ok())
                    .ok_or_else(bad)?;
                if (1..=19).contains(&level) {
                    Ok(Compress(Some(level)))
                } else {
                    Err(bad())
                }
            }
        }
    }
}

impl FlushConfig {
    /// The copy options these settings mean.
    pub fn copy_options(&self) -> ckpt_store::copy::CopyOptions {
        ckpt_store::copy::CopyOptions {
            streams: self.streams,
            bandwidth: (self.bandwidth_mb > 0).then_some(self.bandwidth_mb * 1_000_000),
            compress: self.compress.0,
        }
    }
}

/// When this node pre-dumps its jobs' memory between checkpoints (see `copies/precopy.rs`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecopyConfig {
    /// Pre-copy where the kernel tracks written pages (`criu check --feature
    /// mem_dirty_track`); elsewhere, and with `false`, checkpoints are full dumps.
    pub enabled: bool,
    /// The first pre-dump of a job comes this long after it starts, is restored, or a
    /// checkpoint of it ends on this node.
    #[serde(with = "humantime_serde")]
    pub first_after: Duration,
    /// Part k of a job (its k-th node) pre-dumps k times this much later than part 0, so that
    /// a job's nodes do not all write at once.
    #[serde(with = "humantime_serde")]
    pub stagger: Duration,
    /// Another pre-dump is taken when the pages written since the last one would keep the job
    /// frozen longer than this at a checkpoint.
    #[serde(with = "humantime_serde")]
    pub target_frozen: Duration,
    /// How often the pages written since the last pre-dump are counted.
    #[serde(with = "humantime_serde")]
    pub check_every: Duration,
    /// Shortest time between two pre-dumps of a job: bounds the disk traffic of a job that
    /// writes its memory faster than pre-dumps can follow.
    #[serde(with = "humantime_serde")]
    pub min_interval: Duration,
    /// Pre-dumps in one chain; past it, a new chain starts with a full pre-dump.
    pub max_links: u32,
}

impl Default for PrecopyConfig {
    fn default() -> Self {
        PrecopyConfig {
            enabled: true,
            first_after: Duration::from_secs(10),
            stagger: Duration::from_secs(5),
            target_frozen: Duration::from_millis(500),
            check_every: Duration::from_secs(5),
            min_interval: Duration::from_secs(30),
            max_links: 8,
        }
    }
}

/// The node's side of the job network (ckptd's `[job_network]` hands out the addresses).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobNetworkConfig {
    /// The interface job addresses are put on (each sandbox gets a macvlan of it), or `auto`:
    /// the one carrying the agent's `listen` address, else that of the default route.
    pub interface: String,
    /// Mount points whose later submounts a sandboxed part keeps seeing (automount roots,
    /// network file systems); every other mount of the node is private to the part once it
    /// starts (`os/sandbox/mounts.rs`). Each must exist on every node a part may move to.
    pub follow_mounts: Vec<PathBuf>,
}

impl Default for JobNetworkConfig {
    fn default() -> Self {
        JobNetworkConfig {
            interface: "auto".into(),
            follow_mounts: Vec::new(),
        }
    }
}

impl JobNetworkConfig {
    /// The interface, if there is one.
    pub fn resolve(&self, listen: std::net::IpAddr) -> Option<String> {
        if self.interface != "auto" {
            return Some(self.interface.clone());
        }
        crate::os::sandbox::interface_for(Some(listen))
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

/// When the agent preloads the verbs layer (`libckpt_verbs.so`) into a job's processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preload {
    /// When this node has an RDMA device (`/sys/class/infiniband` is not empty).
    Auto,
    /// On every launch.
    Always,
    /// Never: jobs that open a verbs device are refused at checkpoint.
    Never,
}

/// The verbs layer that lets unmodified programs' verbs objects be released and rebuilt.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VerbsLayerConfig {
    /// When to put it in front of the job's `LD_PRELOAD`.
    pub preload: Preload,
    /// Path of `libckpt_verbs.so`, or `auto`: next to the agent's own binary.
    pub path: String,
}

impl Default for VerbsLayerConfig {
    fn default() -> Self {
        VerbsLayerConfig {
            preload: Preload::Auto,
            path: "auto".into(),
        }
    }
}

/// The verbs layer's file name: what `auto` finds next to the agent, and how a process that
/// has it loaded (or preloads its own) is recognized.
pub const VERBS_LAYER_FILE: &str = "libckpt_verbs.so";

/// Where the kernel lists RDMA devices.
pub const RDMA_CLASS: &str = "/sys/class/infiniband";

impl VerbsLayerConfig {
    /// The layer to preload into jobs on a node whose RDMA devices are `devices`: none when
    /// preloading is off (or `auto` without devices); an error naming the file and what is
    /// wrong when it is missing or could be replaced by someone other than root (the agent
    /// puts it into every job's processes).
    pub fn resolve(&self, devices: &[String]) -> Result<Option<PathBuf>, String> {
        match self.preload {
            Preload::Never => return Ok(None),
            Preload::Auto if devices.is_empty() => return Ok(None),
            _ => {}
        }
        let p = if self.path == "auto" {
            std::env::current_exe()
                .map_err(|e| format!("cannot find the agent's own binary: {e}"))?
                .with_file_name(VERBS_LAYER_FILE)
        } else {
            PathBuf::from(&self.path)
        };
        trusted_file(&p).map(|()| Some(p))
    }
}

/// Fails unless `p` is a regular file that only root (or this daemon's user) can replace: it and
/// its directory are owned by one of them and not writable by group or others.
pub fn trusted_file(p: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let me = nix::unistd::geteuid().as_raw();
    let check = |p: &std::path::Path, what: &str| -> Result<std::fs::Metadata, String> {
        let m = std::fs::symlink_metadata(p).map_err(|e| format!("{}: {e}", p.display()))?;
        if m.uid() != 0 && m.uid() != me {
            return Err(format!(
                "{what} {} is owned by uid {}, not root: whoever owns it could put code into every job",
                p.display(),
                m.uid()
            ));
        }
        if m.mode() & 0o022 != 0 {
            return Err(format!(
                "{what} {} is writable by group or others (mode {:o}): only root may be able to replace it",
                p.display(),
                m.mode() & 0o7777
            ));
        }
        Ok(m)
    };
    if !p.is_absolute() {
        return Err(format!("{} is not an absolute path", p.display()));
    }
    let m = check(p, "verbs layer")?;
    if !m.file_type().is_file() {
        return Err(format!("verbs layer {} is not a regular file", p.display()));
    }
    check(p.parent().unwrap_or(std::path::Path::new("/")), "directory")?;
    Ok(())
}

/// The RDMA devices the kernel lists in `class` (normally [`RDMA_CLASS`]), sorted.
pub fn rdma_devices(class: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(class)
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// CRIU engine settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriuConfig {
    /// Path of the `criu` binary, or `auto`: the package's `/usr/lib/ckpt/criu/bin/criu`,
    /// else `/opt/ckpt/criu/bin/criu` (installed by `scripts/setup.sh`), else `criu` on PATH.
    pub path: String,
    /// Network lock method during dump and restore (`nftables` or `iptables`).
    pub network_lock: String,
    /// Extra arguments appended to every `criu dump`.
    pub extra_dump_args: Vec<String>,
    /// Extra arguments appended to every `criu restore`.
    pub extra_restore_args: Vec<String>,
    /// Largest deleted-but-open file CRIU copies into the image (`--ghost-limit`).
    pub ghost_limit: String,
    /// A restore from a local copy with at least this many MiB of page data verifies the page
    /// data while CRIU restores, CRIU waiting for the verdict in an action script before any
    /// restored process runs; with less, all of it is verified before CRIU starts, which costs
    /// less than CRIU's script runs (about 20 ms a restore). 0: always while CRIU restores.
    pub restore_gate_min_mb: u64,
}

/// Snapshot engines besides CRIU (which every node has).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnginesConfig {
    /// DMTCP: `auto` (the prefix in /etc/ckpt/dmtcp-path that `scripts/setup.sh` writes, else
    /// `dmtcp_launch` on PATH, else in /opt/dmtcp/bin or /usr/local/bin; none found: this node
    /// has no DMTCP), `off`, or its install prefix or bin directory.
    pub dmtcp: String,
    /// How long a DMTCP checkpoint may take, from the request to its last image.
    #[serde(with = "humantime_serde")]
    pub dmtcp_checkpoint_timeout: Duration,
    /// Fence each DMTCP job's coordinator with nftables, so that only the job's owner on this
    /// node reaches it (DMTCP's coordinator has no authentication and listens on every
    /// address). Without nftables, DMTCP jobs are then refused; `false` lets them run unfenced.
    pub dmtcp_fence: bool,
}

impl Default for EnginesConfig {
    fn default() -> Self {
        EnginesConfig {
            dmtcp: "auto".into(),
            dmtcp_checkpoint_timeout: Duration::from_secs(600),
            dmtcp_fence: true,
        }
    }
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
            metrics: Default::default(),
            listen: "0.0.0.0:7601".parse().expect("valid"),
            advertise: None,
            coordinator: "127.0.0.1:7600".into(),
            state_dir: "/var/lib/ckpt/agent".into(),
            local_dir: "/var/lib/ckpt/local".into(),
            shared_dir: None,
            flush: FlushConfig::default(),
            heartbeat_interval: Duration::from_secs(1),
            criu: CriuConfig::default(),
            engines: EnginesConfig::default(),
            precopy: PrecopyConfig::default(),
            cgroup: CgroupConfig::default(),
            launcher: LauncherConfig::default(),
            verbs_layer: VerbsLayerConfig::default(),
            job_network: JobNetworkConfig::default(),
            allow_root_jobs: false,
            tls_dir: ckpt_auth::ca::DEFAULT_DIR.into(),
            min_uid: 1000,
            slurm: Default::default(),
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
            restore_gate_min_mb: 64,
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
        self.metrics.validate()?;
        crate::os::sandbox::mounts::check_follow(&self.job_network.follow_mounts).map_err(
            |problem| ConfigError::Invalid {
                key: "job_network.follow_mounts",
                problem,
            },
        )?;
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
        if self.precopy.check_every < Duration::from_millis(100) {
            return Err(ConfigError::Invalid {
                key: "precopy.check_every",
                problem: "must be at least 100ms".into(),
            });
        }
        let most = ckpt_store::chain::MAX_LINKS as u32;
        if self.precopy.max_links == 0 || self.precopy.max_links > most {
            return Err(ConfigError::Invalid {
                key: "precopy.max_links",
                problem: format!("must be 1 to {most}, got {}", self.precopy.max_links),
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
    fn precopy_settings_parse_and_impossible_ones_are_refused() {
        let c = AgentConfig::from_toml(
            Path::new("a.toml"),
            "[precopy]\nenabled = false\nfirst_after = \"3s\"\nmax_links = 4\n",
        )
        .unwrap();
        assert!(!c.precopy.enabled);
        assert_eq!(c.precopy.first_after, Duration::from_secs(3));
        assert_eq!(c.precopy.max_links, 4);
        assert!(
            AgentConfig::from_toml(Path::new("a.toml"), "")
                .unwrap()
                .precopy
                .enabled
        );
        for (bad, key) in [
            ("max_links = 0", "precopy.max_links"),
            ("max_links = 65", "precopy.max_links"),
            ("check_every = \"10ms\"", "precopy.check_every"),
        ] {
            let e = AgentConfig::from_toml(Path::new("a.toml"), &format!("[precopy]\n{bad}\n"))
                .unwrap_err();
            assert!(e.to_string().contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn the_verbs_layer_is_preloaded_only_where_asked_and_only_if_root_owns_it() {
        let c = AgentConfig::from_toml(Path::new("a.toml"), "").unwrap();
        assert_eq!(c.verbs_layer.preload, Preload::Auto);
        assert_eq!(c.verbs_layer.resolve(&[]).unwrap(), None, "auto, no device");
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let lib = dir.path().join("libckpt_verbs.so");
        std::fs::write(&lib, b"x").unwrap();
        let mode = |p: &Path, m| {
            std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(m)).unwrap()
        };
        mode(&lib, 0o644);
        let c = AgentConfig::from_toml(
            Path::new("a.toml"),
            &format!("[verbs_layer]\npath = \"{}\"\n", lib.display()),
        )
        .unwrap();
        let rxe = ["rxe0".to_string()];
        assert_eq!(c.verbs_layer.resolve(&rxe).unwrap(), Some(lib.clone()));
        mode(&lib, 0o666);
        let e = c.verbs_layer.resolve(&rxe).unwrap_err();
        assert!(e.contains("writable by group or others"), "{e}");
        mode(&lib, 0o644);
        mode(dir.path(), 0o777);
        let e = c.verbs_layer.resolve(&rxe).unwrap_err();
        assert!(e.contains("directory") && e.contains("writable"), "{e}");
        mode(dir.path(), 0o755);
        let missing = VerbsLayerConfig {
            preload: Preload::Always,
            path: "/nonexistent/libckpt_verbs.so".into(),
        };
        let e = missing.resolve(&[]).unwrap_err();
        assert!(e.contains("/nonexistent/libckpt_verbs.so"), "{e}");
        let never = VerbsLayerConfig {
            preload: Preload::Never,
            ..missing
        };
        assert_eq!(never.resolve(&rxe).unwrap(), None);
        let err = AgentConfig::from_toml(
            Path::new("a.toml"),
            "[verbs_layer]\npreload = \"sometimes\"\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("sometimes"), "{err}");
    }

    #[test]
    fn packaged_example_is_valid_and_has_every_section() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/config/agent.toml");
        let text = std::fs::read_to_string(&p).unwrap();
        let c = AgentConfig::from_toml(&p, &text).unwrap();
        assert_eq!(c.verbs_layer.preload, Preload::Auto);
        for section in [
            "[flush]",
            "[criu]",
            "[cgroup]",
            "[launcher]",
            "[verbs_layer]",
        ] {
            assert!(text.contains(section), "{section} is documented");
        }
    }

    #[test]
    fn flush_compression_is_none_or_a_zstd_level() {
        let level = |v: &str| {
            AgentConfig::from_toml(
                Path::new("a.toml"),
                &format!("[flush]\ncompress = \"{v}\"\n"),
            )
            .map(|c| c.flush.copy_options().compress)
        };
        assert_eq!(level("none").unwrap(), None);
        assert_eq!(level("zstd").unwrap(), Some(3));
        assert_eq!(level("zstd:9").unwrap(), Some(9));
        assert_eq!(AgentConfig::default().flush.copy_options().compress, None);
        for bad in ["zstd:0", "zstd:23", "lz4", "zstd:fast"] {
            let err = level(bad).unwrap_err().to_string();
            assert!(err.contains(bad) && err.contains("zstd:LEVEL"), "{err}");
        }
    }

    #[test]
    fn rdma_devices_are_the_class_directory_entries() {
        let dir = tempfile::tempdir().unwrap();
        assert!(rdma_devices(&dir.path().join("none")).is_empty());
        std::fs::create_dir(dir.path().join("rxe0")).unwrap();
        std::fs::create_dir(dir.path().join("mlx5_0")).unwrap();
        assert_eq!(rdma_devices(dir.path()), ["mlx5_0", "rxe0"]);
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
