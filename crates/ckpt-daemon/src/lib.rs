//! What the two daemons, ckptd and ckpt-agent, share as daemons: reading a TOML config whose
//! errors name the file, the key and the line ([`config`]), the steps of start-up that turn a
//! config or a failure into messages and exit codes ([`startup`]), logging to stderr for
//! journald ([`init_tracing`]), readiness and status for systemd ([`notify`]), the Prometheus endpoint ([`metrics`]), and the umask
//! that keeps what they create private ([`set_private_umask`]).
#![warn(missing_docs)]

pub mod config;
pub mod metrics;
pub mod notify;
pub mod startup;

/// Logs to stderr (journald under systemd) at the level `CKPT_LOG` sets, `info` by default.
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CKPT_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        // Colours only on a terminal: journald and log files get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Makes every file and directory the daemon creates private (umask 077); call first thing in
/// a daemon's `main`. Directories users must pass through, and the files they may read (a job's
/// stdout and stderr), get their modes explicitly; jobs get umask 022 from the agent.
pub fn set_private_umask() {
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
}
