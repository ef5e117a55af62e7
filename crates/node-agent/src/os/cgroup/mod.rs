//! The job's freezer cgroup: one per job per node, holding exactly the job's processes, used to
//! freeze them all at once (cgroup v1 `freezer.state` or cgroup v2 `cgroup.freeze`), to list
//! them, and to kill them.
use std::fs;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod lent;
mod mountinfo;

pub use lent::{members, Lent};
use mountinfo::{hierarchy_path, v1_root};
pub(crate) use mountinfo::{v1_freezer_mounted, v1_mount};

/// How long a freeze or thaw may take before it is reported as stuck. Freezing waits for every
/// task to leave the kernel at a safe point; a task in uninterruptible sleep (D state, e.g. on a
/// hung NFS mount) can hold it up, and 30 s is far beyond a healthy freeze (milliseconds).
pub const FREEZE_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a freeze or thaw that has not completed is requested again.
const REASSERT_EVERY: Duration = Duration::from_secs(1);

const V1_FREEZER: &str = "/sys/fs/cgroup/freezer";
const V2_ROOTS: [&str; 2] = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"];

/// A freezer's state, as cgroup v1's `freezer.state` names it (v2's `cgroup.freeze` and
/// `cgroup.events` read as the same three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freezer {
    /// Its processes run.
    Thawed,
    /// Asked to freeze, some processes not frozen yet.
    Freezing,
    /// Every process frozen.
    Frozen,
}

impl Freezer {
    /// The word cgroup v1 reads and writes for it.
    pub fn name(self) -> &'static str {
        match self {
            Freezer::Thawed => "THAWED",
            Freezer::Freezing => "FREEZING",
            Freezer::Frozen => "FROZEN",
        }
    }
}

impl std::fmt::Display for Freezer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors of cgroup handling, each naming the cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No usable freezer hierarchy.
    #[error("no freezer cgroup found: mount the cgroup v1 freezer at {V1_FREEZER} or cgroup v2 at /sys/fs/cgroup, or set [cgroup] parent")]
    NoFreezer,
    /// A cgroup file operation failed.
    #[error("cgroup {path}: {op}: {source}")]
    Io {
        /// Step.
        op: &'static str,
        /// File or directory.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The freezer did not reach the wanted state in time.
    #[error("cgroup {path}: still {state} after {waited:?} waiting to become {wanted} (a task may be stuck in uninterruptible sleep); its tasks: {tasks}")]
    Stuck {
        /// Cgroup directory.
        path: PathBuf,
        /// State seen.
        state: String,
        /// State wanted.
        wanted: &'static str,
        /// Time waited.
        waited: Duration,
        /// The cgroup's tasks when it gave up, as "pid N (comm) state S in WCHAN".
        tasks: String,
    },
    /// A cgroup lent by Slurm (a job's extern step) is gone: its Slurm job has ended.
    #[error("cgroup {path}: gone, with the Slurm job {slurm_job} it belonged to; start the part again inside a running Slurm job")]
    Gone {
        /// Cgroup directory.
        path: PathBuf,
        /// Slurm's job.
        slurm_job: u64,
    },
    /// Frozen, but some task stayed where a snapshot cannot take it, through every attempt.
    #[error("cgroup {path}: {tasks} stayed in uninterruptible sleep (D) or running through {attempts} freezes: a parent waiting for a vfork child that has not called exec yet cannot be snapshotted; the job was thawed, try again (a child that never execs, e.g. one stopped by a debugger, must finish first)")]
    Unsettled {
        /// Cgroup directory.
        path: PathBuf,
        /// The tasks, as "pid N (comm)".
        tasks: String,
        /// Freezes tried.
        attempts: u32,
    },
}

/// How many times [`JobCgroup::freeze_for_snapshot`] freezes before it gives up.
pub const SNAPSHOT_FREEZE_ATTEMPTS: u32 = 20;

/// The scheduler state letter of a task (`/proc/TID/stat`, after the command name), if it exists.
fn task_state(tid: i32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{tid}/stat")).ok()?;
    stat_state(&stat)
}

/// The state letter in the text of a `stat` file: the command name may hold spaces and
/// parentheses, so the field after its last ')'.
fn stat_state(stat: &str) -> Option<char> {
    stat.get(stat.rfind(')')? + 1..)?
        .trim_start()
        .chars()
        .next()
}

/// Which freezer interface a cgroup has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// cgroup v1 freezer controller.
    V1,
    /// cgroup v2 core freezer.
    V2,
}

/// The parent directory under which job cgroups are made.
#[derive(Debug, Clone)]
pub struct CgroupParent {
    path: PathBuf,
    flavor: Flavor,
    prefix: String,
}

impl CgroupParent {
    /// Resolves the configured parent (`auto` or a path).
    pub fn resolve(configured: &str, prefix: &str) -> Result<Self, CgroupError> {
        let prefix = prefix.to_string();
        let pick = |p: &Path| -> Option<Flavor> {
            if p.join("freezer.state").exists()
                || p.starts_with(V1_FREEZER) && p.join("cgroup.procs").exists()
            {
                Some(Flavor::V1)
            } else if p.join("cgroup.controllers").exists() {
                Some(Flavor::V2)
            } else {
                None
            }
        };
        if configured != "auto" {
            let p = PathBuf::from(configured);
            let flavor = pick(&p).ok_or(CgroupError::NoFreezer)?;
            return Ok(CgroupParent {
                path: p,
                flavor,
                prefix,
            });
        }
        let v1 = Path::new(V1_FREEZER);
        if v1.join("cgroup.procs").exists() {
            return Ok(CgroupParent {
                path: v1.to_path_buf(),
                flavor: Flavor::V1,
                prefix,
            });
        }
        for root in V2_ROOTS {
            let p = Path::new(root);
            if p.join("cgroup.controllers").exists() {
                return Ok(CgroupParent {
                    path: p.to_path_buf(),
                    flavor: Flavor::V2,
                    prefix,
                });
            }
        }
        Err(CgroupError::NoFreezer)
    }

    /// The cgroup of a job (not created yet).
    pub fn job(&self, job_id: u64) -> JobCgroup {
        JobCgroup {
            path: self.path.join(format!("{}{job_id}", self.prefix)),
            flavor: self.flavor,
            lent: None,
            tree: None,
        }
    }
}

/// The cgroup holding one job's processes on this node: the agent's own, or one Slurm lends.
#[derive(Debug, Clone)]
pub struct JobCgroup {
    path: PathBuf,
    flavor: Flavor,
    lent: Option<Lent>,
    /// In a cgroup Slurm lent, the job's processes are the descendants of its shim (PID and
    /// start time): the step also holds Slurm's `sleep`, ssh sessions Slurm adopted, and
    /// processes the user moved into cgroups below it.
    tree: Option<(i32, u64)>,
}

impl JobCgroup {
    /// The cgroup Slurm lends (cgroup v1).
    pub fn lent(lent: Lent) -> JobCgroup {
        JobCgroup {
            path: lent.freezer.clone(),
            flavor: Flavor::V1,
            lent: Some(lent),
            tree: None,
        }
    }

    /// Names the job's shim (PID, start time): in a cgroup Slurm lent, the job's processes are
    /// its descendants.
    pub fn set_tree(&mut self, shim: Option<(i32, u64)>) {
        self.tree = shim;
    }

    /// What Slurm lent, if it did.
    pub fn lender(&self) -> Option<&Lent> {
        self.lent.as_ref()
    }

    /// The `cgroup.procs` files a process joins besides [`Self::procs_file`]: those of the
    /// other hierarchies of a cgroup Slurm lent.
    pub fn other_procs_files(&self) -> Vec<PathBuf> {
        self.lent
            .iter()
            .flat_map(|l| l.others.iter().map(|d| d.join("cgroup.procs")))
            .collect()
    }

    /// Cgroup directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The engine's name for this cgroup when restoring into it: `freezer:/PATH` (v1) or
    /// `/PATH` (v2), PATH being the cgroup's path within its hierarchy. `None` if no mounted
    /// hierarchy holds the directory.
    pub fn engine_root(&self) -> Option<String> {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
        let rel = hierarchy_path(&mountinfo, &self.path, self.flavor)?;
        Some(match self.flavor {
            Flavor::V1 => format!("freezer:{rel}"),
            Flavor::V2 => rel,
        })
    }

    /// [`Self::engine_root`], and for a cgroup Slurm lent, each other hierarchy's as
    /// `CONTROLLERS:/PATH`, so that a restored tree lands in every one of the step's cgroups.
    pub fn engine_roots(&self) -> Option<Vec<String>> {
        let mut roots = vec![self.engine_root()?];
        if let Some(l) = &self.lent {
            let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
            for d in &l.others {
                roots.push(v1_root(&mountinfo, d)?);
            }
        }
        Some(roots)
    }

    /// The `cgroup.procs` file a process writes "0" to in order to join.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    fn io(&self, op: &'static str, path: PathBuf) -> impl FnOnce(std::io::Error) -> CgroupError {
        move |source| CgroupError::Io { op, path, source }
    }

    /// Creates the cgroup (thawed) if it does not exist; one Slurm lent must exist.
    pub fn create(&self) -> Result<(), CgroupError> {
        if let Some(l) = &self.lent {
            return match self.path.is_dir() {
                true => Ok(()),
                false => Err(CgroupError::Gone {
                    path: self.path.clone(),
                    slurm_job: l.slurm_job,
                }),
            };
        }
        fs::create_dir_all(&self.path).map_err(self.io("create", self.path.clone()))?;
        Ok(())
    }

    /// Whether the directory exists.
    pub fn exists(&self) -> bool {
        self.path.exists()
    }

    /// PIDs of the processes in the cgroup.
    pub fn pids(&self) -> Result<Vec<i32>, CgroupError> {
        let f = self.procs_file();
        let text = match fs::read_to_string(&f) {
            Ok(t) => t,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(self.io("read", f)(e)),
        };
        let mut v: Vec<i32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if self.lent.is_some() {
            v = match self.tree {
                Some((pid, start)) => members(&f, Some((pid, Some(start)))),
                None => Vec::new(),
            };
        }
        v.sort_unstable();
        v.dedup();
        Ok(v)
    }

    fn state_file(&self) -> PathBuf {
        match self.flavor {
            Flavor::V1 => self.path.join("freezer.state"),
            Flavor::V2 => self.path.join("cgroup.freeze"),
        }
    }

    /// Current freezer state.
    pub fn state(&self) -> Result<Freezer, CgroupError> {
        match self.flavor {
            Flavor::V1 => {
                let f = self.state_file();
                let text = fs::read_to_string(&f).map_err(self.io("read", f))?;
                Ok([Freezer::Frozen, Freezer::Freezing]
                    .into_iter()
                    .find(|f| f.name() == text.trim())
                    .unwrap_or(Freezer::Thawed))
            }
            Flavor::V2 => {
                let ev = self.path.join("cgroup.events");
                let text = fs::read_to_string(&ev).map_err(self.io("read", ev))?;
                let frozen = text.lines().any(|l| l.trim() == "frozen 1");
                let want = fs::read_to_string(self.state_file()).unwrap_or_default();
                Ok(match (frozen, want.trim()) {
                    (true, _) => Freezer::Frozen,
                    (false, "1") => Freezer::Freezing,
                    _ => Freezer::Thawed,
                })
            }
        }
    }

    fn write_state(&self, frozen: bool) -> Result<(), CgroupError> {
        let f = self.state_file();
        let value = match (self.flavor, frozen) {
            (Flavor::V1, true) => Freezer::Frozen.name(),
            (Flavor::V1, false) => Freezer::Thawed.name(),
            (Flavor::V2, true) => "1",
            (Flavor::V2, false) => "0",
        };
        fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .and_then(|mut h| h.write_all(value.as_bytes()))
            .map_err(self.io("write", f))
    }

    /// Waits until the freezer reports `wanted`. The request is written again every
    /// [`REASSERT_EVERY`] while the cgroup is in between: writing the state makes the kernel
    /// signal every task of the cgroup again, which frees a freeze a task missed (one that
    /// joined the cgroup, or forked, at the moment of the first write) at no cost to a healthy
    /// one.
    fn wait_for(&self, wanted: Freezer) -> Result<(), CgroupError> {
        let start = Instant::now();
        let mut asserted = start;
        let mut pause = Duration::from_micros(200);
        loop {
            let s = self.state()?;
            if s == wanted {
                return Ok(());
            }
            if start.elapsed() > FREEZE_TIMEOUT {
                return Err(CgroupError::Stuck {
                    path: self.path.clone(),
                    state: s.name().into(),
                    wanted: wanted.name(),
                    waited: start.elapsed(),
                    tasks: self.describe_tasks(),
                });
            }
            if asserted.elapsed() >= REASSERT_EVERY {
                self.write_state(wanted == Freezer::Frozen)?;
                asserted = Instant::now();
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// The cgroup's tasks for an error message: "pid N (comm) state S in WCHAN", at most 16.
    fn describe_tasks(&self) -> String {
        let pids = self.pids().unwrap_or_default();
        if pids.is_empty() {
            return "none".into();
        }
        let mut out: Vec<String> = pids
            .iter()
            .take(16)
            .map(|&pid| {
                let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                let wchan = fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
                let state = task_state(pid).unwrap_or('?');
                let wchan = match wchan.trim() {
                    "" | "0" => "-".to_string(),
                    w => w.to_string(),
                };
                format!("pid {pid} ({}) state {state} in {wchan}", comm.trim())
            })
            .collect();
        if pids.len() > 16 {
            out.push(format!("and {} more", pids.len() - 16));
        }
        out.join(", ")
    }

    /// Freezes every process in the cgroup and waits until the kernel reports FROZEN.
    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.write_state(true)?;
        self.wait_for(Freezer::Frozen)
    }

    /// Freezes for a snapshot. cgroup v2 counts a parent blocked in `vfork()` (state D until its
    /// child calls exec) as frozen, and the snapshot engine cannot seize such a task; when the
    /// freeze lands in that window (a shell starting a command, `posix_spawn`, `system()`), the
    /// cgroup is thawed, the parent is given up to 100 ms to come out, and the freeze is tried
    /// again, up to [`SNAPSHOT_FREEZE_ATTEMPTS`] times. Returns how many retries it took; fails
    /// thawed with [`CgroupError::Unsettled`] naming the tasks.
    pub fn freeze_for_snapshot(&self) -> Result<u32, CgroupError> {
        for retry in 0..SNAPSHOT_FREEZE_ATTEMPTS {
            self.freeze()?;
            let stuck = self.unsettled_tasks();
            if stuck.is_empty() {
                return Ok(retry);
            }
            self.thaw()?;
            if retry + 1 == SNAPSHOT_FREEZE_ATTEMPTS {
                return Err(CgroupError::Unsettled {
                    path: self.path.clone(),
                    tasks: stuck
                        .iter()
                        .map(|(tid, comm)| format!("pid {tid} ({comm})"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    attempts: SNAPSHOT_FREEZE_ATTEMPTS,
                });
            }
            let begin = Instant::now();
            let mut pause = Duration::from_micros(100);
            while begin.elapsed() < Duration::from_millis(100)
                && stuck.iter().any(|(tid, _)| task_state(*tid) == Some('D'))
            {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Tasks (threads) of a frozen v2 cgroup that a snapshot cannot take, with their names:
    /// those in uninterruptible sleep (D). A vfork parent is counted frozen a moment before it
    /// goes to sleep, so a task still running (R) is watched for up to 20 ms until it settles
    /// in the freezer (S), a stop (t, T) or D; one that does not counts as unsettled too. Empty
    /// on cgroup v1, whose frozen tasks all report D.
    fn unsettled_tasks(&self) -> Vec<(i32, String)> {
        if self.flavor != Flavor::V2 {
            return Vec::new();
        }
        let mut tasks = Vec::new();
        for pid in self.pids().unwrap_or_default() {
            let Ok(dir) = fs::read_dir(format!("/proc/{pid}/task")) else {
                continue;
            };
            for t in dir.flatten() {
                if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
                    tasks.push((pid, tid));
                }
            }
        }
        let begin = Instant::now();
        loop {
            let states: Vec<(i32, i32, char)> = tasks
                .iter()
                .filter_map(|&(pid, tid)| Some((pid, tid, task_state(tid)?)))
                .collect();
            let running = states.iter().any(|&(_, _, st)| st == 'R');
            if running && begin.elapsed() < Duration::from_millis(20) {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            return states
                .into_iter()
                .filter(|&(_, _, st)| st == 'D' || st == 'R')
                .map(|(pid, tid, _)| {
                    let comm = fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                        .unwrap_or_default();
                    (tid, comm.trim().to_string())
                })
                .collect();
        }
    }

    /// Thaws the cgroup and waits until it reports THAWED.
    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.write_state(false)?;
        self.wait_for(Freezer::Thawed)
    }

    /// Sends `sig` to every process in the cgroup. A PID read from `cgroup.procs` may belong
    /// to another process by the time it is signalled (its process exited and the PID was
    /// reused, possibly by another user's): SIGKILL on cgroup v2 goes through `cgroup.kill`,
    /// which the kernel applies to the cgroup's members only; any other signal goes through a
    /// pidfd, opened first and used only if that PID is still in the cgroup once it is held.
    pub fn signal_all(&self, sig: i32) -> Result<usize, CgroupError> {
        let pids = self.pids()?;
        if sig == libc::SIGKILL && self.flavor == Flavor::V2 && self.lent.is_none() {
            let kill = self.path.join("cgroup.kill");
            match fs::OpenOptions::new().write(true).open(&kill) {
                Ok(mut f) => {
                    f.write_all(b"1").map_err(self.io("write", kill))?;
                    return Ok(pids.len());
                }
                // Before Linux 5.14: by pidfd as for other signals.
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(self.io("open", kill)(e)),
            }
        }
        let mut sent = 0;
        for &p in &pids {
            // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p, 0) };
            if fd < 0 {
                continue; // exited meanwhile
            }
            // SAFETY: the descriptor just returned, owned by nothing else.
            let pidfd =
                unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
            // Held: the PID is this process's for as long as it lives. Still a member?
            if !self.pids()?.contains(&p) {
                continue;
            }
            use std::os::fd::AsRawFd;
            // SAFETY: pidfd_send_signal on a pidfd of ours, without siginfo.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    pidfd.as_raw_fd(),
                    sig,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
            if rc == 0 {
                sent += 1;
            }
        }
        Ok(sent)
    }

    /// SIGKILLs every process (thawing first, so the kill is delivered) and waits, bounded by
    /// [`FREEZE_TIMEOUT`], until the cgroup is empty.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        self.signal_all(libc::SIGKILL)?;
        if self.state().is_ok_and(|s| s != Freezer::Thawed) {
            self.thaw()?;
        }
        let start = Instant::now();
        while !self.pids()?.is_empty() {
            if start.elapsed() > FREEZE_TIMEOUT {
                return Err(CgroupError::Stuck {
                    path: self.path.clone(),
                    state: format!("{} processes left", self.pids()?.len()),
                    wanted: "empty",
                    waited: start.elapsed(),
                    tasks: self.describe_tasks(),
                });
            }
            self.signal_all(libc::SIGKILL)?;
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Removes the (empty) cgroup; one Slurm lent stays, for Slurm to remove.
    pub fn remove(&self) -> Result<(), CgroupError> {
        if self.lent.is_some() {
            return Ok(());
        }
        match fs::remove_dir(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.io("remove", self.path.clone())(e)),
        }
    }
}

/// For tests: a cgroup parent named after `name` and this process, or `None` (with the
/// reason printed) when not root or no freezer is mounted.
#[cfg(test)]
pub(crate) fn test_parent(name: &str) -> Option<CgroupParent> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: needs root to make a cgroup");
        return None;
    }
    CgroupParent::resolve("auto", &format!("ckpt-unit-{name}-{}-", std::process::id()))
        .map_err(|e| eprintln!("SKIPPED: {e}"))
        .ok()
}

#[cfg(test)]
mod tests;
