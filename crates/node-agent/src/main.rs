//! `ckpt-agent`: parses arguments, loads the config, sets up logging and runs the agent.
use std::path::PathBuf;
use std::process::ExitCode;

use ckpt_daemon::startup;
use clap::{Parser, Subcommand};
use node_agent::config::TomlConfig;
use node_agent::AgentConfig;

/// The ckpt node agent: launches, freezes, snapshots and restores a job's processes on this node.
///
/// Runs as root under systemd (packaging/systemd/ckpt-agent.service). Exit codes: 0 clean
/// shutdown, 2 bad config or no usable cluster credential (`ckpt-agent enroll`), 3 snapshot
/// engine (CRIU) missing or unusable, 4 other start failure.
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Cli {
    /// Config file (TOML). Keys are documented in packaging/config/agent.toml.
    #[arg(
        short,
        long,
        default_value = AgentConfig::DEFAULT_PATH,
        env = "CKPT_AGENT_CONFIG"
    )]
    config: PathBuf,
    /// Override `node_name`.
    #[arg(long)]
    node_name: Option<String>,
    /// Override `coordinator` (host:port of ckptd's agent port).
    #[arg(long)]
    coordinator: Option<String>,
    /// Override `listen`.
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Only check the config file (and overrides) and exit: 0 if valid, 2 if not.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Installs this node's cluster credential: the bundle `ckptd ca issue NODE` printed on the
    /// head node (a file, or - for standard input), into `tls_dir` (default /etc/ckpt/tls).
    ///
    /// One command per node, e.g.: ckptd ca issue n1 | ssh n1 ckpt-agent enroll -
    ///
    /// The bundle must be issued for this node's `node_name`: the coordinator accepts a
    /// node's registration only from that node's credential.
    Enroll {
        /// The bundle file, or - for standard input.
        bundle: PathBuf,
    },
    /// Internal: the per-job shim the agent starts (not for direct use).
    #[command(hide = true)]
    Shim {
        /// Shim spec written by the agent.
        spec: PathBuf,
    },
}

fn main() -> ExitCode {
    // Run by CRIU as a restore's action script, with no arguments: before anything else.
    if let Some(code) = node_agent::restore_gate() {
        return ExitCode::from(code);
    }
    node_agent::set_private_umask();
    let cli = Cli::parse();
    if let Some(Cmd::Shim { spec }) = &cli.cmd {
        return ExitCode::from(node_agent::shim::main(spec) as u8);
    }
    if let Err(e) = ckpt_daemon::raise_open_files() {
        eprintln!("ckpt-agent: cannot raise the open-file limit: {e}");
    }
    let enroll = match cli.cmd {
        Some(Cmd::Enroll { bundle }) => Some(bundle),
        _ => None,
    };
    // Before any thread starts: no job, shim or engine the agent starts inherits the variable.
    let notifier = ckpt_daemon::notify::Notifier::from_env();
    node_agent::init_tracing();
    let default_path = std::path::Path::new(AgentConfig::DEFAULT_PATH);
    let loaded = node_agent::config::load_or_default(&cli.config, default_path);
    let overrides = |cfg: &mut AgentConfig| {
        startup::set(&mut cfg.node_name, cli.node_name);
        startup::set(&mut cfg.coordinator, cli.coordinator);
        startup::set(&mut cfg.listen, cli.listen);
    };
    let cfg = match startup::config("ckpt-agent", loaded, overrides, AgentConfig::validate) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Some(bundle) = enroll {
        return enroll_node(&cfg, &bundle);
    }
    if cli.check_config {
        return startup::config_is_valid("ckpt-agent", &cli.config);
    }
    // The node's software first (exit 3), then its enrollment (exit 2).
    let credential = node_agent::load_credential(&cfg);
    let exe = std::env::current_exe().unwrap_or_else(|_| "ckpt-agent".into());
    let jobs = match node_agent::open_jobs(&cfg, exe, credential.as_ref().ok().cloned()) {
        Ok(j) => j,
        Err(e) => return startup::fail("ckpt-agent", &e, e.exit_code()),
    };
    let credential = match credential {
        Ok(c) => c,
        Err(e) => {
            return startup::fail("ckpt-agent", format_args!("node {}: {e}", cfg.node_name), 2)
        }
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let r = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|source| node_agent::StartError::Dir {
                what: "listen",
                path: cfg.listen.to_string().into(),
                source,
            })?;
        let metrics = ckpt_daemon::metrics::Endpoint::bind(&cfg.metrics)
            .await
            .map_err(node_agent::StartError::Metrics)?;
        let mut serving = format!(
            "node {} serving on {}; coordinator {}",
            cfg.node_name,
            listener
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_default(),
            if cfg.coordinator.is_empty() {
                "none configured"
            } else {
                cfg.coordinator.as_str()
            }
        );
        if let Some(m) = metrics {
            serving.push_str(&format!(
                "; metrics on {}",
                m.local_addr().map(|a| a.to_string()).unwrap_or_default()
            ));
            node_agent::metrics::metrics();
            let jobs = jobs.clone();
            tokio::spawn(m.serve(std::sync::Arc::new(move || {
                node_agent::metrics::refresh(&jobs)
            })));
        }
        let listener = node_agent::Listener::Cluster {
            tcp: listener,
            credential,
        };
        // The listener is bound: connections wait in its queue until served.
        notifier.ready(&serving);
        notifier.spawn_watchdog();
        node_agent::run(cfg, jobs, listener, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => startup::fail("ckpt-agent", e, 4),
    }
}

/// `ckpt-agent enroll BUNDLE`.
fn enroll_node(cfg: &AgentConfig, bundle: &std::path::Path) -> ExitCode {
    let text = if bundle == std::path::Path::new("-") {
        let mut t = String::new();
        match std::io::Read::read_to_string(&mut std::io::stdin(), &mut t) {
            Ok(_) => t,
            Err(e) => {
                return startup::fail(
                    "ckpt-agent",
                    format_args!("cannot read the bundle from standard input: {e}"),
                    2,
                )
            }
        }
    } else {
        match std::fs::read_to_string(bundle) {
            Ok(t) => t,
            Err(e) => {
                return startup::fail("ckpt-agent", format_args!("{}: {e}", bundle.display()), 2)
            }
        }
    };
    match ckpt_auth::ca::install(&text, &cfg.tls_dir, Some(&cfg.node_name)) {
        Ok(id) => {
            println!(
                "ckpt-agent: enrolled as {id}: credential installed in {} (start the agent: systemctl restart ckpt-agent)",
                cfg.tls_dir.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => startup::fail("ckpt-agent", e, 2),
    }
}
