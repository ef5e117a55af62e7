//! What the two daemons, ckptd and ckpt-agent, share as daemons: reading a TOML config whose
//! errors name the file, the key and the line ([`config`]), the steps of start-up that turn a
//! config or a failure into messages and exit codes ([`startup`]), logging to stderr or, under
//! systemd, to the journal with structured fields ([`init_tracing`], [`journal`]), readiness
//! and status for systemd ([`notify`]), the Prometheus endpoint ([`metrics`]), and the umask
//! that keeps what they create private ([`set_private_umask`]).
#![warn(missing_docs)]

pub mod config;
pub mod journal;
pub mod metrics;
pub mod notify;
pub mod startup;

/// Logs at the level `CKPT_LOG` sets, `info` by default: to the journal with structured fields
/// when stderr is the journal (under systemd, see [`journal`]), else as text to stderr.
pub fn init_tracing() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_env("CKPT_LOG").unwrap_or_else(|_| "info".into())
    };
    if journal::stderr_is_journal() {
        let name = std::env::args()
            .next()
            .and_then(|a| {
                std::path::Path::new(&a)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "ckpt".into());
        if let Ok(layer) =
            journal::JournalLayer::connect(std::path::Path::new(journal::SOCKET), &name)
        {
            tracing_subscriber::registry()
                .with(filter())
                .with(layer)
                .init();
            return;
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter())
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
