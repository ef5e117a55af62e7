//! `ckptd`: parses arguments, loads the config, sets up logging and runs the coordinator
//! (with an embedded agent under `--standalone`).
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use ckpt_daemon::startup;
use clap::{Parser, Subcommand};
use config::CkptdConfig;
use coordinator::config::CoordinatorConfig;
use coordinator::driver::Coordinator;
use coordinator::registry::{etcd, Registry};

mod config;

/// The ckpt global checkpoint coordinator.
///
/// Drives coordinated checkpoints of MPI jobs across the ckpt-agent of every node, keeps the job
/// registry and epoch history in an embedded database, and serves ckptctl on a Unix socket.
/// With --standalone it also runs an agent for this machine, so one daemon serves one server.
///
/// Agents and ckptd authenticate each other with the cluster's CA (`ckptd ca init`, then
/// `ckptd ca issue NODE | ssh NODE ckpt-agent enroll -`); a standalone ckptd without one opens
/// no TCP port.
///
/// With `[registry] backend = "etcd"` the registry lives in an etcd cluster instead, and
/// several ckptd (on several head nodes) may run: one is active, the others stand by, serve
/// nothing, and take over when it is lost (docs/operations.md, "A standby ckptd").
///
/// Exit codes: 0 clean shutdown, 2 bad config or arguments or no usable cluster credential, 3
/// snapshot engine (CRIU) missing or unusable (--standalone), 4 cannot open the database or bind
/// a socket, 5 lost the leadership to another ckptd (etcd registry; restarted, it stands by).
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Cli {
    /// Config file (TOML). Keys are documented in packaging/config/ckptd.toml.
    #[arg(
        short,
        long,
        default_value = CoordinatorConfig::DEFAULT_PATH,
        env = "CKPTD_CONFIG"
    )]
    config: PathBuf,
    /// Also run a node agent for this machine (single-node use).
    #[arg(long)]
    standalone: bool,
    /// Override `socket` (ckptctl's Unix socket).
    #[arg(long, env = "CKPT_SOCKET")]
    socket: Option<PathBuf>,
    /// Override `database`.
    #[arg(long)]
    database: Option<PathBuf>,
    /// Override `listen` (agents' address).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Override the embedded agent's `state_dir` (--standalone).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Override the embedded agent's `local_dir` (--standalone).
    #[arg(long)]
    local_dir: Option<PathBuf>,
    /// Only check the config file (and overrides) and exit: 0 if valid, 2 if not.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The cluster CA that ckptd and the agents authenticate each other with.
    ///
    /// Set-up, once: `ckptd ca init` on the head node; then, per compute node,
    /// `ckptd ca issue NODE | ssh NODE ckpt-agent enroll -`. Files live in `tls_dir`
    /// (default /etc/ckpt/tls); see docs/security.md.
    Ca {
        #[command(subcommand)]
        cmd: CaCmd,
    },
    /// Internal: the per-job shim of the embedded agent (not for direct use).
    #[command(hide = true)]
    Shim {
        /// Shim spec.
        spec: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum CaCmd {
    /// Creates the cluster CA and ckptd's own credential in `tls_dir`. Refuses to replace an
    /// existing CA.
    Init {
        /// Where to create it (default: `tls_dir` of the config).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Issues NODE's credential and prints it as one bundle for `ckpt-agent enroll` on that
    /// node. The bundle holds the node's private key: send it straight to the node (a pipe
    /// through ssh), do not leave it lying around.
    Issue {
        /// The node's name, as its agent's `node_name` says (letters, digits, '.', '_', '-').
        node: String,
        /// The CA's directory (default: `tls_dir` of the config).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Write the bundle to this file (created 0600) instead of standard output.
        #[arg(long, short)]
        out: Option<PathBuf>,
    },
}

/// `ckptd ca ...`.
fn ca_command(cmd: &CaCmd, tls_dir: &std::path::Path) -> ExitCode {
    match cmd {
        CaCmd::Init { dir } => {
            let dir = dir.as_deref().unwrap_or(tls_dir);
            match ckpt_auth::ca::init(dir) {
                Ok(()) => {
                    println!(
                        "ckptd: cluster CA and ckptd's credential created in {}\n\
                         next, for every compute node: ckptd ca issue NODE | ssh NODE ckpt-agent enroll -",
                        dir.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => startup::fail("ckptd", e, 2),
            }
        }
        CaCmd::Issue { node, dir, out } => {
            let dir = dir.as_deref().unwrap_or(tls_dir);
            let bundle = match ckpt_auth::ca::issue(dir, node) {
                Ok(b) => b,
                Err(e) => return startup::fail("ckptd", e, 2),
            };
            let written = match out {
                None => std::io::Write::write_all(&mut std::io::stdout(), bundle.as_bytes()),
                Some(path) => {
                    use std::os::unix::fs::OpenOptionsExt;
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(path)
                        .and_then(|mut f| std::io::Write::write_all(&mut f, bundle.as_bytes()))
                }
            };
            match written {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => startup::fail("ckptd", format_args!("cannot write the bundle: {e}"), 2),
            }
        }
    }
}

fn main() -> ExitCode {
    // Run by CRIU as the embedded agent's restore gate, with no arguments: before anything else.
    if let Some(code) = node_agent::restore_gate() {
        return ExitCode::from(code);
    }
    // Everything the daemon creates is root's alone unless it says otherwise.
    ckpt_daemon::set_private_umask();
    let cli = Cli::parse();
    if let Some(Cmd::Shim { spec }) = &cli.cmd {
        return ExitCode::from(node_agent::shim::main(spec) as u8);
    }
    if let Err(e) = ckpt_daemon::raise_open_files() {
        eprintln!("ckptd: cannot raise the open-file limit: {e}");
    }
    // Before any thread starts: nothing ckptd starts inherits the variable.
    let notifier = ckpt_daemon::notify::Notifier::from_env();
    ckpt_daemon::init_tracing();
    let default_path = std::path::Path::new(CoordinatorConfig::DEFAULT_PATH);
    let loaded = CkptdConfig::load_or_default(&cli.config, default_path);
    let overrides = |whole: &mut CkptdConfig| {
        let (cfg, acfg) = (&mut whole.coordinator, &mut whole.agent);
        startup::set(&mut cfg.socket, cli.socket);
        startup::set(&mut cfg.database, cli.database);
        startup::set(&mut cfg.listen, cli.listen);
        startup::set(&mut acfg.state_dir, cli.state_dir);
        startup::set(&mut acfg.local_dir, cli.local_dir);
        // The embedded agent and its jobs (ckpt-rsh) reach the coordinator on its local socket.
        acfg.coordinator = format!("unix:{}", cfg.socket.display());
    };
    let CkptdConfig {
        coordinator: cfg,
        agent: acfg,
    } = match startup::config("ckptd", loaded, overrides, CkptdConfig::validate) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Some(Cmd::Ca { cmd }) = &cli.cmd {
        return ca_command(cmd, &cfg.tls_dir);
    }
    if cli.check_config {
        return startup::config_is_valid("ckptd", &cli.config);
    }
    let credential = match credential(&cfg.tls_dir, cli.standalone) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let jobs = if cli.standalone {
        let exe = std::env::current_exe().unwrap_or_else(|_| "ckptd".into());
        match node_agent::open_jobs(&acfg, exe, None) {
            Ok(j) => Some(j),
            Err(e) => return startup::fail("ckptd", &e, e.exit_code()),
        }
    } else {
        None
    };
    let registry = if cfg.registry.etcd() {
        match etcd::Store::connect(&cfg.registry) {
            Ok(s) => Db::Etcd(s),
            Err(e) => return startup::fail("ckptd", e, 4),
        }
    } else {
        match Registry::open(&cfg.database) {
            Ok(r) => Db::Redb(r),
            Err(e) => return startup::fail("ckptd", e, 4),
        }
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let r = rt.block_on(serve(Serve {
        registry,
        cfg,
        acfg,
        credential,
        jobs,
        notifier,
    }));
    // Blocking work still running (a copy, a dump of the embedded agent) is not waited for:
    // a restart must be back within the agents' leases.
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => startup::fail("ckptd", e, 4),
    }
}

/// Says why the leadership was lost; the exit code that says so.
fn deposed(why: &str) -> u8 {
    eprintln!(
        "ckptd: lost the leadership ({why}): stopping, so that only the active ckptd acts; started again, this one stands by"
    );
    5
}

/// Where the registry lives.
enum Db {
    /// In this head node's file.
    Redb(Registry),
    /// In etcd: usable once this ckptd has won the leadership.
    Etcd(etcd::Store),
}

/// Waits (etcd registry) until this ckptd is the active one; meanwhile it stands by, serving
/// nothing. `None` if asked to stop first.
async fn stand_by(
    mut store: etcd::Store,
    cfg: &CoordinatorConfig,
    notifier: &ckpt_daemon::notify::Notifier,
) -> Option<(Registry, etcd::Leader)> {
    let me = format!(
        "{} pid {} (agents on {}, ckptctl on {})",
        node_agent::config::hostname(),
        std::process::id(),
        cfg.listen,
        cfg.socket.display()
    );
    notifier.ready(&format!("standing by: campaigning in {}", store.name()));
    tracing::info!(
        registry = store.name(),
        "campaigning to be the active ckptd"
    );
    let campaign = async {
        loop {
            let standby = |active: &str| {
                tracing::info!(active, "standing by: another ckptd is active");
                notifier.status(&format!("standing by; active: {active}"));
            };
            match store.campaign(&me, cfg.registry.lease, standby).await {
                Ok(leader) => return leader,
                Err(e) => {
                    tracing::warn!(registry = store.name(), error = %e, "cannot reach etcd; trying again");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            }
        }
    };
    tokio::select! {
        leader = campaign => {
            tracing::info!(registry = store.name(), "this ckptd is now the active one");
            Some((Registry::on_etcd(store), leader))
        }
        _ = shutdown_signal() => None,
    }
}

/// The cluster credential. A standalone ckptd without one serves this machine only, on local
/// sockets: no TCP port at all. Without one otherwise, the exit code of the refusal.
fn credential(
    tls_dir: &std::path::Path,
    standalone: bool,
) -> Result<Option<ckpt_auth::tls::Credential>, ExitCode> {
    let have_credential = tls_dir.join(ckpt_auth::ca::COORDINATOR_CERT).exists();
    if !have_credential && standalone {
        return Ok(None);
    }
    match ckpt_auth::tls::Credential::load(tls_dir, &ckpt_auth::Identity::Coordinator) {
        Ok(c) => Ok(Some(c)),
        Err(e) => Err(startup::fail(
            "ckptd",
            format_args!(
                "no usable cluster credential: {e}\n\
                 (a cluster needs one: `ckptd ca init`; one machine needs none: `ckptd --standalone`)"
            ),
            2,
        )),
    }
}

/// What [`serve`] runs with, once configured.
struct Serve {
    registry: Db,
    cfg: CoordinatorConfig,
    acfg: node_agent::AgentConfig,
    credential: Option<ckpt_auth::tls::Credential>,
    /// The embedded agent's jobs (standalone).
    jobs: Option<Arc<node_agent::Jobs>>,
    notifier: ckpt_daemon::notify::Notifier,
}

/// Binds every socket (agents over TLS, ckptctl's, metrics, the embedded agent's), tells
/// systemd it serves, and serves until SIGTERM or SIGINT.
async fn serve(s: Serve) -> Result<(), String> {
    let Serve {
        registry,
        cfg,
        acfg,
        credential,
        jobs,
        notifier,
    } = s;
    notifier.spawn_watchdog();
    let (registry, leader) = match registry {
        Db::Redb(r) => (r, None),
        Db::Etcd(store) => match stand_by(store, &cfg, &notifier).await {
            Some((r, l)) => (r, Some(Arc::new(l))),
            None => {
                notifier.stopping();
                return Ok(());
            }
        },
    };

    let coord: Arc<Coordinator> =
        Coordinator::new(registry, cfg.clone(), credential.clone()).map_err(|e| e.to_string())?;
    let agents = match &credential {
        Some(c) => {
            let tls = c.server_config().map_err(|e| e.to_string())?;
            let l = tokio::net::TcpListener::bind(cfg.listen)
                .await
                .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
            Some((l, tls))
        }
        None => None,
    };
    let control = coordinator::server::bind_control_socket(&cfg.socket)
        .map_err(|e| format!("cannot bind control socket {}: {e}", cfg.socket.display()))?;
    let metrics = ckpt_daemon::metrics::Endpoint::bind(&cfg.metrics).await?;
    let mut serving = match &agents {
        Some((l, _)) => format!(
            "serving ckptctl on {}, agents on {} (TLS)",
            cfg.socket.display(),
            l.local_addr().map(|a| a.to_string()).unwrap_or_default()
        ),
        None => format!(
            "serving ckptctl on {}; this machine only (no cluster credential)",
            cfg.socket.display()
        ),
    };
    if let Some(m) = metrics {
        serving.push_str(&format!(
            ", metrics on {}",
            m.local_addr().map(|a| a.to_string()).unwrap_or_default()
        ));
        // The embedded agent's metrics are in the same registry: one endpoint covers both.
        let (coord, jobs) = (coord.clone(), jobs.clone());
        if jobs.is_some() {
            node_agent::metrics::metrics();
        }
        tokio::spawn(m.serve(Arc::new(move || {
            coord.refresh_metrics();
            if let Some(j) = &jobs {
                node_agent::metrics::refresh(j);
            }
        })));
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    if let Some(jobs) = jobs {
        // Only this process calls the embedded agent: a socket in a directory only root
        // may enter, no TCP port.
        let sock = acfg.state_dir.join("rpc").join("agent.sock");
        let l = node_agent::bind_local(&sock)
            .map_err(|e| format!("cannot bind {}: {e}", sock.display()))?;
        let mut rx = stop_rx.clone();
        tokio::spawn(async move {
            if let Err(e) = node_agent::run(acfg, jobs, l, async move {
                let _ = rx.wait_for(|v| *v).await;
            })
            .await
            {
                tracing::error!(error = %e, "embedded agent stopped");
            }
        });
    }
    // Every socket is bound: connections wait in their queues until served.
    notifier.ready(&serving);
    tokio::spawn(async move {
        shutdown_signal().await;
        notifier.stopping();
        let _ = stop_tx.send(true);
    });
    let mut rx = stop_rx;
    let leader_ref = leader.clone();
    coordinator::server::run(coord, agents, control, async move {
        let lost = async {
            match leader_ref {
                Some(l) => l.lost().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = rx.wait_for(|v| *v) => {}
            why = lost => {
                // At once, calls in flight too: a standby may win a third of a lease from now.
                tracing::error!(reason = %why, "lost the leadership: stopping");
                std::process::exit(deposed(&why).into());
            }
        }
    })
    .await
    .map_err(|e| e.to_string())?;
    if let Some(l) = &leader {
        // A standby takes over now rather than after the lease.
        l.resign().await;
    }
    Ok(())
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
