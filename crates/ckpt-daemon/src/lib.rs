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

/// The soft limit on open files the daemon was started with, before [`raise_open_files`]:
/// what processes it starts for jobs get back ([`restore_open_files`]).
static STARTED_WITH: std::sync::OnceLock<libc::rlimit> = std::sync::OnceLock::new();

/// Raises the soft limit on open files to the hard one (at most 1,048,576); call first thing
/// in a daemon's `main`. A daemon holds a descriptor per connection (ckptctl, agents, job
/// channels, partner streams): at the usual soft limit of 1,024, a user holding a thousand
/// connections would stop it answering anyone. Returns (soft before, soft now).
pub fn raise_open_files() -> std::io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit, which lives on this stack.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let _ = STARTED_WITH.set(lim);
    let want = lim.rlim_max.min(1 << 20);
    if want > lim.rlim_cur {
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit, which lives on this stack.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        return Ok((lim.rlim_cur, want));
    }
    Ok((lim.rlim_cur, lim.rlim_cur))
}

/// Puts the soft limit on open files back to what the daemon started with, in a process it
/// starts for a job (call between fork and exec: one async-signal-safe system call). Jobs see
/// the limit they would see without ckpt.
pub fn restore_open_files() {
    if let Some(lim) = STARTED_WITH.get() {
        // SAFETY: setrlimit reads one rlimit, which lives in a static.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, lim) };
    }
}

#[cfg(test)]
mod open_files_tests {
    #[test]
    fn the_soft_limit_is_raised_and_given_back() {
        let (before, now) = super::raise_open_files().unwrap();
        assert!(now >= before);
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit into a local.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        assert_eq!(lim.rlim_cur, now);
        super::restore_open_files();
        // SAFETY: as above.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        assert_eq!(lim.rlim_cur, before);
    }
}
