//! What the agent's checkpoint and restore steps ask of this machine, behind one small trait
//! ([`Host`]): a job cgroup's members and freezer (freeze for a snapshot, freeze, thaw, state,
//! kill), the `/proc` scans the initial synchronization decides on (processes outside the
//! tree, privileged processes, resident size), and the start of a job's shim (the process
//! that launches the job or runs the engine's restore). [`RealHost`] does each through
//! `cgroup.rs`, `procfs.rs` and a process spawn, unchanged; tests pass a recording fake in
//! with [`crate::jobs::Jobs::with_host`] (`host/fake.rs`) and so run every phase without root.
//!
//! Left as direct calls, because what they return for processes that do not exist (nothing
//! held, nothing open, no device) is what a test wants: the dump's scans of open files, shared
//! memory, threads and TCP endpoints, the verbs and connection-manager checks, the pre-copy
//! scans; the namespaces (a sandbox's, made and removed by `sandbox.rs`, and the mount
//! namespace a guarded restore records), which the tests' parts, without a sandbox or guarded
//! directories, never reach; the machine's restore lock; also the cgroup's creation and
//! removal (directories), the agent's start-up thaw of jobs an earlier run left frozen, the
//! channels' rebuild, and the launch's other steps, heartbeats, exits and pre-copies.

#[cfg(test)]
pub(crate) mod fake;
#[cfg(test)]
pub(crate) mod test_node;

use std::fs;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::path::Path;

use crate::os::cgroup::{CgroupError, Freezer, JobCgroup};
use crate::os::procfs::{self, ProcStat};

/// What the agent asks of the machine for a job's checkpoint and restore.
pub trait Host: Send + Sync + std::fmt::Debug {
    /// PIDs of the processes in the job's cgroup, sorted.
    fn pids(&self, cgroup: &JobCgroup) -> Result<Vec<i32>, CgroupError>;
    /// Whether the job's cgroup exists.
    fn cgroup_exists(&self, cgroup: &JobCgroup) -> bool;
    /// The cgroup's freezer state.
    fn freezer_state(&self, cgroup: &JobCgroup) -> Result<Freezer, CgroupError>;
    /// Freezes the cgroup and waits until it is frozen.
    fn freeze(&self, cgroup: &JobCgroup) -> Result<(), CgroupError>;
    /// Freezes the cgroup for a snapshot (again past a vfork); the retries it took.
    fn freeze_for_snapshot(&self, cgroup: &JobCgroup) -> Result<u32, CgroupError>;
    /// Thaws the cgroup and waits until it is thawed.
    fn thaw(&self, cgroup: &JobCgroup) -> Result<(), CgroupError>;
    /// Kills every process of the cgroup and waits until it is empty.
    fn kill_all(&self, cgroup: &JobCgroup) -> Result<(), CgroupError>;
    /// Processes among `pids` that are not below `root` in the process tree.
    fn outside_tree(&self, root: i32, pids: &[i32]) -> Vec<ProcStat>;
    /// Why process `pid` has more rights than its owner `owner`, if it has.
    fn privilege_of(&self, pid: i32, owner: u32) -> Option<String>;
    /// Resident bytes of process `pid` (0 if it is gone).
    fn rss_bytes(&self, pid: i32) -> u64;
    /// The first of `pids` that is stopped (state T: SIGSTOP, SIGTSTP, a Slurm suspend) or
    /// stopped by a tracer (t), if any: the engine cannot seize such a process in a frozen
    /// cgroup (the kernel keeps it waiting for ever).
    fn stopped(&self, pids: &[i32]) -> Option<ProcStat>;
    /// The TCP connections `pids` hold: (local, remote) ends, listening sockets left out.
    fn tcp_connections(&self, pids: &[i32]) -> Vec<(SocketAddr, SocketAddr)>;
    /// Starts `exe shim SPEC` in a session of its own, its stdout and stderr into `output`,
    /// passing it the write end `ready_fd` of the pipe it says it is ready on, and reaps it
    /// when it ends. Returns its PID and start time (`/proc/PID/stat`), read before it can be
    /// reaped, if known. Must be called within the agent's runtime.
    fn spawn_shim(
        &self,
        exe: &Path,
        spec: &Path,
        output: (fs::File, fs::File),
        ready_fd: RawFd,
    ) -> std::io::Result<Option<(i32, u64)>>;
}

/// The machine itself: each call goes to `cgroup.rs`, `procfs.rs` or a process spawn.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealHost;

impl Host for RealHost {
    fn pids(&self, cgroup: &JobCgroup) -> Result<Vec<i32>, CgroupError> {
        cgroup.pids()
    }

    fn cgroup_exists(&self, cgroup: &JobCgroup) -> bool {
        cgroup.exists()
    }

    fn freezer_state(&self, cgroup: &JobCgroup) -> Result<Freezer, CgroupError> {
        cgroup.state()
    }

    fn freeze(&self, cgroup: &JobCgroup) -> Result<(), CgroupError> {
        cgroup.freeze()
    }

    fn freeze_for_snapshot(&self, cgroup: &JobCgroup) -> Result<u32, CgroupError> {
        cgroup.freeze_for_snapshot()
    }

    fn thaw(&self, cgroup: &JobCgroup) -> Result<(), CgroupError> {
        cgroup.thaw()
    }

    fn kill_all(&self, cgroup: &JobCgroup) -> Result<(), CgroupError> {
        cgroup.kill_all()
    }

    fn outside_tree(&self, root: i32, pids: &[i32]) -> Vec<ProcStat> {
        procfs::outside_tree(root, pids)
    }

    fn privilege_of(&self, pid: i32, owner: u32) -> Option<String> {
        procfs::privilege_of(pid, owner)
    }

    fn rss_bytes(&self, pid: i32) -> u64 {
        procfs::rss_bytes(pid)
    }

    fn stopped(&self, pids: &[i32]) -> Option<ProcStat> {
        pids.iter()
            .filter_map(|&p| procfs::stat(p))
            .find(|s| matches!(s.state, 'T' | 't'))
    }

    fn tcp_connections(&self, pids: &[i32]) -> Vec<(SocketAddr, SocketAddr)> {
        procfs::tcp_endpoints(pids).connections
    }

    fn spawn_shim(
        &self,
        exe: &Path,
        spec: &Path,
        (log, log2): (fs::File, fs::File),
        ready_fd: RawFd,
    ) -> std::io::Result<Option<(i32, u64)>> {
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg("shim")
            .arg(spec)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2);
        // SAFETY: setsid, setrlimit and pass_fd are async-signal-safe; the shim leaves the agent's session
        // so that stopping the agent does not stop jobs, and it alone inherits the pipe.
        unsafe {
            cmd.pre_exec(move || {
                libc::setsid();
                // The shim, and the job it starts, get the open-file limit the agent had.
                ckpt_daemon::restore_open_files();
                crate::os::clone_into::pass_fd(ready_fd, ready_fd)
            });
        }
        let mut child = cmd.spawn()?;
        let shim = child
            .id()
            .and_then(|pid| procfs::stat(pid as i32))
            .map(|s| (s.pid, s.start_ticks));
        // Reap the shim whenever it ends; the job's exit status is in its run directory.
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        Ok(shim)
    }
}
