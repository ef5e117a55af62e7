//! Harness for ckpt's end-to-end tests: real daemons, real CRIU, real MPI jobs.
//!
//! A [`Ckptd`] is one coordinator (standalone, or with a separate `ckpt-agent` process) with
//! its own temporary directories, socket, database, port 0, and a cgroup prefix no other test
//! uses. Dropping it kills, by PID, every process it started and every process left in its
//! cgroups, and removes those cgroups, even when the test failed.
//!
//! Binaries come from `CKPT_BIN_DIR`, else `target/release` (built once by `.ci/run`); the MPI
//! test programs are built from `tests/apps` into `target/apps` on first use.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod ckptd;
mod ctl;
pub mod etcd;
mod files;
pub mod hosts;
mod mpi;
pub mod netns;
pub mod prometheus;
pub mod slurm;
pub mod sockets;
pub mod vm;

pub use ckptd::{free_port, Ckptd, Options};
pub use ctl::Ctl;
pub use files::{flip_byte_in_largest, flip_byte_in_largest_named, script};
pub use mpi::{apps, checksum_in, Mpi};

/// Workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Directory holding `ckptd`, `ckptctl` and `ckpt-agent`.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("CKPT_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/release"))
}

fn which(prog: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(prog))
            .find(|p| p.is_file())
    })
}

/// The CRIU the agent will pick (same rule as the agent's `auto`).
pub fn criu_path() -> Option<PathBuf> {
    let private = PathBuf::from("/opt/ckpt/criu/bin/criu");
    if private.is_file() {
        return Some(private);
    }
    which("criu")
}

/// Why the e2e tests cannot run here, if they cannot.
pub fn skip_reason(needs: &[&str]) -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (cgroups, CRIU)".into());
    }
    for b in ["ckptd", "ckptctl", "ckpt-agent"] {
        if !bin_dir().join(b).is_file() {
            return Some(format!(
                "needs {} (run `cargo build --release` first)",
                bin_dir().join(b).display()
            ));
        }
    }
    match criu_path() {
        None => return Some("needs CRIU >= 4.2 (run scripts/setup.sh)".into()),
        Some(c) => {
            let ok = Command::new(&c)
                .arg("check")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if !ok.map(|s| s.success()).unwrap_or(false) {
                return Some(format!("`{} check` fails on this kernel", c.display()));
            }
        }
    }
    for n in needs {
        if which(n).is_none() {
            return Some(format!("needs {n} (run scripts/setup.sh)"));
        }
    }
    if !Path::new("/sys/fs/cgroup/freezer/cgroup.procs").exists()
        && !Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
    {
        return Some("needs a freezer cgroup hierarchy".into());
    }
    None
}

/// Returns early from a test, printing why, when the environment cannot run it.
#[macro_export]
macro_rules! skip_unless_ready {
    ($($need:expr),*) => {
        if let Some(why) = $crate::skip_reason(&[$($need),*]) {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
}

/// The environment switch that runs the slow variants: tests that take a path another test
/// already takes in every run, with one thing changed (the other MPI, the other copy, a second
/// guest run). `CKPT_FULL=1 scripts/test.sh` runs them; each issue's must-show runs it once.
pub const FULL_ENV: &str = "CKPT_FULL";

/// Whether the slow variants run ([`FULL_ENV`] set to 1).
pub fn full() -> bool {
    std::env::var(FULL_ENV).is_ok_and(|v| v == "1")
}

/// Skips a slow variant unless [`FULL_ENV`] asks for it, saying which test covers its path in
/// every run.
#[macro_export]
macro_rules! slow_variant {
    ($covered_by:expr) => {
        if !$crate::full() {
            eprintln!(
                "SKIPPED: a slow variant of {}; {}=1 runs it",
                $covered_by,
                $crate::FULL_ENV
            );
            return;
        }
    };
}

/// The unprivileged user tests act as.
pub const NOBODY: u32 = 65534;

/// Makes `cmd` run as `uid` (gid `uid`, no supplementary groups), as `setpriv` would; the
/// switch happens after std entered the command's working directory as root.
pub fn as_user(cmd: &mut Command, uid: u32) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: setgroups/setgid/setuid between fork and exec, on values copied in.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(uid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}
