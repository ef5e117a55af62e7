//! ckpt-agent: the node agent.
//!
//! One runs on every compute node. It starts a job's processes on its node (each under a shim,
//! see [`shim`]), keeps them in a per-job freezer cgroup (`os/cgroup.rs`), and runs the node's
//! side of every checkpoint phase (the table in `jobs.rs`, the services it shares in `node.rs`;
//! the steps in `launch/`, `checkpoint/`, `restore/` and `copies/`): initial synchronization,
//! freeze, dump with a snapshot engine (`engine/`), thaw or kill, sealing images with a
//! manifest, and restore. The coordinator drives it over gRPC (`rpc/grpc.rs`); the agent
//! registers and heartbeats (`rpc/heartbeat.rs`). A job runs as its owner, who may run jobs by
//! the node's policy, and the agent acts in the owner's directories only as the owner
//! (`os/owner.rs`); what it keeps is root's alone (`os/modes.rs`).
//!
//! The folders are layers: `os/` (the machine) imports nothing above it; `part/` (what a part
//! holds, and the typed notes a dump writes for its restore) uses only `os/`; `launch/` and
//! `copies/` use them and the table; `checkpoint/` and `restore/` are the phases, and
//! `restore/` reads what a dump wrote through `part/`, never from `checkpoint/`; `rpc/` is the
//! transport, its service and heartbeat on top of everything. Each folder's `mod.rs` says what
//! it may import.
//!
//! The public surface is small: [`open_jobs`], [`bind_local`] and [`run`] are the whole daemon;
//! `main.rs` only parses arguments and calls them, and so does `ckptd --standalone`, which embeds
//! an agent. [`config`] is the agent's config file, [`shim`] the per-job process.
#![warn(missing_docs)]

mod checkpoint;
pub mod config;
mod copies;
mod engine;
mod error;
mod failpoint;
mod ibq;
mod jobs;
mod launch;
pub mod metrics;
mod node;
mod os;
mod part;
mod restore;
mod rpc;
pub mod shim;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use ckpt_proto::v1::agent_server::AgentServer;
use ckpt_proto::Engine;
use tokio::net::TcpListener;
use tracing::{info, warn};

pub use config::AgentConfig;
pub use engine::EngineError;
pub use error::AgentError;
pub use jobs::Jobs;
pub use os::cgroup::CgroupError;

pub use ckpt_daemon::{init_tracing, set_private_umask};

/// When CRIU runs this binary as a restore's action script (the restore gate, see
/// `restore/gate.rs`): the exit status. None: it was not started as one.
pub fn restore_gate() -> Option<u8> {
    restore::gate::action_script()
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The snapshot engine is missing or unusable.
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
    /// No freezer cgroup.
    #[error(transparent)]
    Cgroup(#[from] os::cgroup::CgroupError),
    /// Staging or state directory problem.
    #[error("{what} {path}: {source}")]
    Dir {
        /// Which directory.
        what: &'static str,
        /// Path.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A directory root writes into is not root's alone (see `ckpt_store::trust`).
    #[error("{what}: {source}; make it root's and not writable by other users (e.g. `chown root: DIR && chmod 0700 DIR`), or remove it so the agent makes it, or choose another {what} in agent.toml")]
    Untrusted {
        /// Which setting.
        what: &'static str,
        /// Why.
        #[source]
        source: ckpt_store::trust::Untrusted,
    },
    /// The node's credential is missing or unusable.
    #[error(transparent)]
    Auth(#[from] ckpt_auth::AuthError),
    /// `[verbs_layer] preload = "always"` and the layer is missing or unsafe to preload.
    #[error("verbs_layer: {0}")]
    VerbsLayer(String),
    /// The Prometheus endpoint cannot start (its token file, its address).
    #[error("{0}")]
    Metrics(String),
    /// The heartbeat's thread cannot start (out of threads or memory).
    #[error("cannot start the heartbeat thread: {0}")]
    Heartbeat(#[source] std::io::Error),
    /// Serving failed.
    #[error("agent gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
}

impl StartError {
    /// The daemon's exit code for it: 3 when the snapshot engine is missing or unusable, else 4.
    pub fn exit_code(&self) -> u8 {
        match self {
            StartError::Engine(_) => 3,
            _ => 4,
        }
    }
}

/// Refuses a directory root writes into (`what` names its setting) unless it and the way to
/// it are root's alone.
fn trusted(dir: &std::path::Path, what: &'static str) -> Result<(), StartError> {
    ckpt_store::trust::check_root(dir, &ckpt_store::trust::Owners::ROOT)
        .map(|_| ())
        .map_err(|source| StartError::Untrusted { what, source })
}

/// This node's cluster credential from `tls_dir`, checked to name `node_name`.
pub fn load_credential(
    cfg: &AgentConfig,
) -> Result<ckpt_auth::tls::Credential, ckpt_auth::AuthError> {
    ckpt_auth::tls::Credential::load(
        &cfg.tls_dir,
        &ckpt_auth::Identity::Node(cfg.node_name.clone()),
    )
}

/// Checks the engine and the cgroup hierarchy and opens the node's job table. `credential` is
/// the node's cluster credential (none when embedded in a standalone ckptd, which reaches its
/// agent over a local socket only).
pub fn open_jobs(
    cfg: &AgentConfig,
    shim_exe: PathBuf,
    credential: Option<ckpt_auth::tls::Credential>,
) -> Result<Arc<jobs::Jobs>, StartError> {
    let mut criu = engine::criu::Criu::detect(&cfg.criu)?;
    let devices = config::rdma_devices(std::path::Path::new(config::RDMA_CLASS));
    let verbs_layer = match cfg.verbs_layer.resolve(&devices) {
        Ok(Some(p)) => {
            info!(layer = %p.display(), devices = ?devices, "jobs get the verbs layer preloaded");
            Some(p)
        }
        Ok(None) => None,
        Err(problem) if cfg.verbs_layer.preload == config::Preload::Always => {
            return Err(StartError::VerbsLayer(problem))
        }
        Err(problem) => {
            warn!(
                %problem,
                devices = ?devices,
                "no verbs layer for jobs on this RDMA node: a job that opens a verbs device will be refused at checkpoint (fix [verbs_layer] path in agent.toml)"
            );
            None
        }
    };
    let plugin_dir = cfg.state_dir.join("criu-plugins");
    if verbs_layer.is_some() {
        criu = criu.with_plugin_dir(plugin_dir.clone());
    }
    info!(criu = criu.path(), version = %engine::SnapshotEngine::version(&criu), "snapshot engine ready");
    let mut others: Vec<Arc<dyn engine::SnapshotEngine>> = Vec::new();
    match engine::dmtcp::Dmtcp::detect(&cfg.engines)? {
        Some(d) => {
            info!(dmtcp = %d.bin().display(), version = %engine::SnapshotEngine::version(&d), "snapshot engine ready");
            others.push(Arc::new(d));
        }
        None => info!("no DMTCP on this node: jobs asking for --engine dmtcp are refused here (see [engines] in agent.toml)"),
    }
    let cgroups = os::cgroup::CgroupParent::resolve(&cfg.cgroup.parent, &cfg.cgroup.prefix)?;
    // Checked before anything is made or fixed in them, and again once they exist.
    for (dir, what) in [(&cfg.local_dir, "local_dir"), (&cfg.state_dir, "state_dir")] {
        if dir.exists() {
            trusted(dir, what)?;
        }
    }
    let staging =
        ckpt_store::layout::Staging::open(&cfg.local_dir).map_err(|e| StartError::Dir {
            what: "local_dir",
            path: cfg.local_dir.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
    trusted(&cfg.local_dir, "local_dir")?;
    // Where it is mounted now; checked again before every use (it may be mounted later).
    if let Some(shared) = cfg.shared_dir.as_deref().filter(|d| d.is_dir()) {
        copies::trusted_shared(shared).map_err(|source| StartError::Untrusted {
            what: "shared_dir",
            source,
        })?;
    }
    let jobs = jobs::Jobs::open(
        cfg.node_name.clone(),
        cfg.state_dir.clone(),
        staging,
        cgroups,
        Arc::new(criu),
        shim_exe,
    )
    .map_err(|source| StartError::Dir {
        what: "state_dir",
        path: cfg.state_dir.clone(),
        source,
    })?;
    trusted(&cfg.state_dir, "state_dir")?;
    if let Some(layer) = &verbs_layer {
        let src = layer.with_file_name(engine::criu::VERBS_PLUGIN_FILE);
        match engine::criu::install_plugin(&src, &plugin_dir) {
            Ok(p) => {
                info!(plugin = %p.display(), "pre-dumps of jobs over verbs get the CRIU plugin")
            }
            Err(problem) => {
                warn!(%problem, "no CRIU plugin for verbs: jobs over verbs get no pre-copy (their checkpoints are full dumps)")
            }
        }
    }
    let jobs = jobs
        .with_launch_env(node::LaunchEnv {
            coordinator: cfg.coordinator.clone(),
            launcher: cfg.launcher.resolve(),
            set_mpi_env: cfg.launcher.set_mpi_env,
            verbs_layer,
            follow_mounts: cfg.job_network.follow_mounts.clone(),
            ca: credential
                .as_ref()
                .map(|_| cfg.tls_dir.join(ckpt_auth::ca::CA_CERT)),
        })
        .with_job_link(cfg.job_network.resolve(cfg.listen.ip()))
        .with_credential(credential)
        .with_shared(cfg.shared_dir.clone(), cfg.flush.copy_options())
        .with_launch_policy(os::owner::LaunchPolicy {
            allow_root: cfg.allow_root_jobs,
            min_uid: cfg.min_uid,
        })
        .with_slurm_gate(cfg.slurm.clone())
        .with_engines(others);
    let jobs = if cfg.engines.dmtcp_fence && jobs.engines().get(Engine::Dmtcp.as_str()).is_ok() {
        jobs.with_fence(&cfg.cgroup.prefix)
    } else {
        jobs
    };
    let precopy = copies::precopy::Mode::resolve(&cfg.precopy, || jobs.engine().precopy_support());
    Ok(Arc::new(jobs.with_precopy(precopy)))
}

/// Where the Agent service listens.
#[derive(Debug)]
pub enum Listener {
    /// A compute node: TLS on a TCP port with the node's credential, which also authenticates
    /// the agent to the coordinator and to other agents.
    Cluster {
        /// The TCP listener.
        tcp: TcpListener,
        /// The node's credential.
        credential: ckpt_auth::tls::Credential,
    },
    /// Embedded in `ckptd --standalone`: a Unix socket in a root-only directory, and the
    /// coordinator reached over its local socket; no TCP port at all.
    Local {
        /// The listener.
        unix: tokio::net::UnixListener,
        /// Its path (advertised as `unix:PATH`).
        path: PathBuf,
    },
}

/// Binds the embedded agent's socket at `path`, in a directory only root may enter.
pub fn bind_local(path: &std::path::Path) -> std::io::Result<Listener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let unix = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(Listener::Local {
        unix,
        path: path.to_path_buf(),
    })
}

/// Runs the agent until `shutdown` resolves: serves the Agent service on `listener` and, when a
/// coordinator address is configured, registers and heartbeats.
pub async fn run(
    cfg: AgentConfig,
    jobs: Arc<jobs::Jobs>,
    listener: Listener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    let (advertise, dial) = match &listener {
        Listener::Cluster { tcp, credential } => {
            let local = tcp.local_addr().map_err(|source| StartError::Dir {
                what: "listen",
                path: cfg.listen.to_string().into(),
                source,
            })?;
            let advertise = cfg.advertise.clone().unwrap_or_else(|| {
                let ip = if local.ip().is_unspecified() {
                    std::net::IpAddr::from([127, 0, 0, 1])
                } else {
                    local.ip()
                };
                std::net::SocketAddr::new(ip, local.port()).to_string()
            });
            let dial = credential
                .client_config(ckpt_auth::Identity::Coordinator)
                .map_err(StartError::Auth)?;
            (advertise, ckpt_auth::transport::Dial::Tls(dial))
        }
        Listener::Local { path, .. } => (
            format!("unix:{}", path.display()),
            ckpt_auth::transport::Dial::LocalOnly,
        ),
    };
    info!(node = %cfg.node_name, %advertise, "agent listening");
    let hb = if cfg.coordinator.is_empty() {
        None
    } else {
        Some(
            rpc::heartbeat::spawn(cfg.clone(), advertise, dial, jobs.clone())
                .map_err(StartError::Heartbeat)?,
        )
    };
    launch::exits::watch(jobs.node.exits.clone());
    let precopy = tokio::spawn(copies::precopy::run_loop(jobs.clone()));
    let ibq = match jobs.channels().bind() {
        Ok(l) => Some(tokio::spawn(jobs.channels().clone().serve(l))),
        Err(e) => {
            // Jobs without InfiniBand do not need it; jobs with it are refused at checkpoint.
            tracing::warn!(socket = %jobs.channels().socket().display(), error = %e, "ib-quiesce control socket unavailable");
            None
        }
    };
    let fence = jobs.node.leader_fence.clone();
    let server = tonic::transport::Server::builder().add_service(AgentServer::with_interceptor(
        rpc::grpc::AgentHandler::new(jobs),
        move |req| rpc::fence::check(&fence, req),
    ));
    let r = match listener {
        Listener::Cluster { tcp, credential } => {
            let tls = credential.server_config().map_err(StartError::Auth)?;
            server
                .serve_with_incoming_shutdown(
                    ckpt_auth::transport::tls_incoming(tcp, tls),
                    shutdown,
                )
                .await
        }
        Listener::Local { unix, .. } => {
            server
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(unix),
                    shutdown,
                )
                .await
        }
    };
    drop(hb);
    precopy.abort();
    if let Some(h) = ibq {
        h.abort();
    }
    r.map_err(StartError::from)
}
