//! `ckptd`: parses arguments, loads the config, sets up logging and runs the coordinator
//! (with an embedded agent under `--standalone`).
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use coordinator::config::{CoordinatorConfig, TomlConfig};
use coordinator::driver::Coordinator;
use coordinator::registry::Registry;

/// The ckpt global checkpoint coordinator.
///
/// Drives coordinated checkpoints of MPI jobs across the ckpt-agent of every node, keeps the job
/// registry and epoch history in an embedded database, and serves ckptctl on a Unix socket.
/// With --standalone it also runs an agent for this machine, so one daemon serves one server.
///
/// Exit codes: 0 clean shutdown, 2 bad config or arguments, 3 snapshot engine (CRIU) missing or
/// unusable (--standalone), 4 cannot open the database or bind a socket.
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
    /// Internal: the per-job shim of the embedded agent (not for direct use).
    #[command(hide = true)]
    Shim {
        /// Shim spec.
        spec: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Cmd::Shim { spec }) = &cli.cmd {
        return ExitCode::from(node_agent::shim::main(spec) as u8);
    }
    node_agent::init_tracing();
    let default_path = std::path::Path::new(CoordinatorConfig::DEFAULT_PATH);
    let mut cfg: CoordinatorConfig =
        match node_agent::config::load_or_default(&cli.config, default_path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("ckptd: {e}");
                return ExitCode::from(2);
            }
        };
    if let Some(s) = cli.socket {
        cfg.socket = s;
    }
    if let Some(d) = cli.database {
        cfg.database = d;
    }
    if let Some(l) = cli.listen {
        cfg.listen = l;
    } else if cli.standalone && cli.config == default_path && !cli.config.exists() {
        // A standalone coordinator without a config serves only this machine.
        cfg.listen = "127.0.0.1:7600".parse().expect("valid");
    }
    if let Some(d) = cli.state_dir {
        cfg.agent.state_dir = d;
    }
    if let Some(d) = cli.local_dir {
        cfg.agent.local_dir = d;
    }
    if let Err(e) = cfg.validate() {
        eprintln!("ckptd: {e}");
        return ExitCode::from(2);
    }
    if cli.check_config {
        println!("ckptd: config {} is valid", cli.config.display());
        return ExitCode::SUCCESS;
    }
    let jobs = if cli.standalone {
        let exe = std::env::current_exe().unwrap_or_else(|_| "ckptd".into());
        // Jobs of the embedded agent reach the coordinator (ckpt-rsh) over loopback.
        let mut acfg = cfg.agent.clone();
        acfg.coordinator = format!("127.0.0.1:{}", cfg.listen.port());
        match node_agent::open_jobs(&acfg, exe) {
            Ok(j) => Some(j),
            Err(node_agent::StartError::Engine(e)) => {
                eprintln!("ckptd: {e}");
                return ExitCode::from(3);
            }
            Err(e) => {
                eprintln!("ckptd: {e}");
                return ExitCode::from(4);
            }
        }
    } else {
        None
    };
    let registry = match Registry::open(&cfg.database) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ckptd: {e}");
            return ExitCode::from(4);
        }
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let r: Result<(), String> = rt.block_on(async move {
        let coord: Arc<Coordinator> =
            Coordinator::new(registry, cfg.clone()).map_err(|e| e.to_string())?;
        let agents = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
        let control = coordinator::server::bind_control_socket(&cfg.socket)
            .map_err(|e| format!("cannot bind control socket {}: {e}", cfg.socket.display()))?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        if let Some(jobs) = jobs {
            let mut acfg = cfg.agent.clone();
            let port = agents.local_addr().map_err(|e| e.to_string())?.port();
            acfg.coordinator = format!("127.0.0.1:{port}");
            // Only this process calls the embedded agent: keep it on loopback, on a free port.
            acfg.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
            acfg.advertise = None;
            let l = tokio::net::TcpListener::bind(acfg.listen)
                .await
                .map_err(|e| format!("cannot listen on {}: {e}", acfg.listen))?;
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
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = stop_tx.send(true);
        });
        let mut rx = stop_rx;
        coordinator::server::run(coord, agents, control, async move {
            let _ = rx.wait_for(|v| *v).await;
        })
        .await
        .map_err(|e| e.to_string())
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ckptd: {e}");
            ExitCode::from(4)
        }
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
