//! The job shim: a small process per job incarnation (`ckpt-agent shim SPEC`) that the agent
//! starts, and that owns the job's process tree the way a container shim does.
//!
//! It is a child subreaper, so it can collect the exit status of the job's root both when it
//! started the root itself (launch) and when the snapshot engine restored it (the engine's
//! detached restore re-parents the restored tree to the nearest subreaper). It writes
//! `started.json` once the root runs and `exit.json` when the root exits, atomically, in its run
//! directory; the agent reads those files, so jobs keep running and their exit is recorded even
//! while the agent itself restarts.
//!
//! The job's identity comes from this node's user databases ([`Identity`]). Between fork and
//! exec the child joins the job's cgroup, switches to that identity and only then enters the
//! working directory, so root never enters a directory for the user; the job gets umask 022
//! (the daemons run with 077). The job's stdout and stderr are created 0600 and owned by the
//! user, through the open file.
//!
//! The same program, given a [`crate::os::owner::PutBack`] task, is the helper that puts a job's
//! files back before a restore as the job's owner (see [`crate::os::owner`]).
//!
//! One file: the shim's spec, its main and the child's steps between fork and exec, which must be
//! read together (the child may not allocate).
use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

mod fence;
pub(crate) mod guard;
mod reap;
mod restore;

pub use crate::os::modes::read_json;

/// What the shim starts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ShimMode {
    /// Start the job's command.
    Launch {
        /// Command and arguments.
        argv: Vec<String>,
        /// Working directory.
        cwd: PathBuf,
        /// Complete environment.
        env: BTreeMap<String, String>,
        /// User to run as.
        uid: u32,
        /// Group to run as.
        gid: u32,
        /// Supplementary groups.
        groups: Vec<u32>,
        /// Run it in a sandbox; none: in the node's namespaces.
        #[serde(default)]
        sandbox: Option<Sandbox>,
    },
    /// Run the engine's detached restore command, then adopt the restored root.
    Restore {
        /// Engine command line.
        argv: Vec<String>,
        /// Where the engine writes the restored root's PID.
        pid_file: PathBuf,
        /// The part's network namespace, given to the engine as descriptor
        /// [`RESTORE_NETNS_FD`].
        #[serde(default)]
        netns: Option<PathBuf>,
        /// The restore gate's FIFO, given to the engine's action script in its environment.
        #[serde(default)]
        gate: Option<PathBuf>,
        /// Directories users control in which the engine acts by path: bound without
        /// following links while it restores (see `shim/guard.rs`).
        #[serde(default)]
        guard: Vec<PathBuf>,
        /// Directories of root's alone below a guarded one (staging, the agent's state): the
        /// engine follows its own links there (a pre-copy chain's `parent`).
        #[serde(default)]
        exempt: Vec<PathBuf>,
    },
}

impl ShimMode {
    /// The network namespace of the part's sandbox, if it has one.
    pub fn netns(&self) -> Option<&Path> {
        match self {
            ShimMode::Launch { sandbox, .. } => sandbox.as_ref().map(|s| s.netns.as_path()),
            ShimMode::Restore { netns, .. } => netns.as_deref(),
        }
    }
}

/// A part's sandbox: fresh PID, IPC, UTS (the node's host name kept) and mount namespaces
/// whose process 1 is `init`, which starts the command, in the network namespace `netns`.
/// The mount namespace is a copy of the node's, private to the part but for the mount points
/// in `follow` (slaves of the node's: their later submounts still arrive), with a `/proc` of
/// the sandbox's PIDs (programs that read `/proc/<pid>` of a peer, as UCX does, find it there)
/// and a private `/dev/shm`, which moves with the part.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sandbox {
    /// `ckpt-init`.
    pub init: PathBuf,
    /// The part's network namespace (a file under /run/netns).
    pub netns: PathBuf,
    /// The namespace's first PIDs are taken after this one, so that the parts of different
    /// jobs on a node do not all count from 1 (launchers name session files after their PID).
    pub pid_base: u32,
    /// Mount points whose later submounts the part keeps seeing (see
    /// [`crate::os::sandbox::mounts`]).
    #[serde(default)]
    pub follow: Vec<PathBuf>,
}

/// The descriptor number a restore gets the part's network namespace on.
pub const RESTORE_NETNS_FD: i32 = 3;

/// The shim's instructions, written by the agent to `<run_dir>/spec.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShimSpec {
    /// Launch or restore.
    pub mode: ShimMode,
    /// `cgroup.procs` of the job's cgroup; the job (or the restoring engine) joins it.
    pub cgroup_procs: PathBuf,
    /// More `cgroup.procs` it joins: those of the other hierarchies of a cgroup Slurm lent.
    #[serde(default)]
    pub also_join: Vec<PathBuf>,
    /// The job's cgroup is one Slurm lent: the job's processes there are the shim's
    /// descendants only (its kills leave the rest alone).
    #[serde(default)]
    pub lent: bool,
    /// File the job's stdout is appended to.
    pub stdout: PathBuf,
    /// File the job's stderr is appended to.
    pub stderr: PathBuf,
    /// Directory for `started.json` and `exit.json`.
    pub run_dir: PathBuf,
    /// Uid and gid that own `stdout` and `stderr` (mode 0600); none: left as they are.
    #[serde(default)]
    pub output_owner: Option<(u32, u32)>,
    /// A pipe's write end, inherited from the agent: one byte is written to it once
    /// `started.json` is, so the agent need not poll for the file; its end-of-file without that
    /// byte tells the agent the shim died first. Kept from the job and the engine.
    #[serde(default)]
    pub ready_fd: Option<i32>,
    /// The node's lease file ([`crate::rpc::lease`]): the shim kills the part once it runs out.
    /// None: never fenced.
    #[serde(default)]
    pub lease: Option<PathBuf>,
}

/// Written once the job's root process runs (or could not be started).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum Started {
    /// The root's PID.
    Running {
        /// PID.
        root_pid: i32,
    },
    /// Why it did not start.
    Failed {
        /// Message.
        error: String,
    },
}

/// How the job's root ended.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Exit {
    /// Exit code, if it exited.
    pub code: Option<i32>,
    /// Signal, if it was killed.
    pub signal: Option<i32>,
    /// Processes the root left running that the shim ended after it ([`end_left`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ended: u32,
}

impl Exit {
    /// In words: "exited with code 0", "killed by signal 9", and how many processes the root
    /// left running were ended with it.
    pub fn text(&self) -> String {
        let how = match (self.code, self.signal) {
            (Some(c), _) => format!("exited with code {c}"),
            (None, Some(s)) => format!("killed by signal {s}"),
            _ => "ended".into(),
        };
        match self.ended {
            0 => how,
            n => format!("{how}; {n} process(es) it left running were ended with it"),
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// File names in the run directory.
pub const STARTED: &str = "started.json";
/// See [`STARTED`].
pub const EXIT: &str = "exit.json";
/// See [`STARTED`].
pub const SPEC: &str = "spec.json";

fn write_json<T: Serialize>(path: &Path, v: &T) {
    let bytes = serde_json::to_vec(v).expect("serializable");
    if let Err(e) = ckpt_store::atomic::write_file(path, &bytes) {
        eprintln!("ckpt shim: {e}");
    }
}

/// The uid the newest launch of a job (in `dir`, incarnations up to `incarnation`) ran as.
pub(crate) fn launched_as(dir: &Path, incarnation: u32) -> Option<u32> {
    (1..=incarnation).rev().find_map(|n| {
        let spec = dir.join("run").join(n.to_string()).join(SPEC);
        match read_json::<ShimSpec>(&spec)?.mode {
            ShimMode::Launch { uid, .. } => Some(uid),
            ShimMode::Restore { .. } => None,
        }
    })
}

/// Opens a job's stdout or stderr for appending, creating it 0600; never through a symbolic
/// link, and only a regular file. With `owner`, the open file is given to the job's user.
fn open_output(p: &Path, owner: Option<(u32, u32)>) -> io::Result<fs::File> {
    let f = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(p)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    if let Some((uid, gid)) = owner {
        nix::unistd::fchown(&f, Some(uid.into()), Some(gid.into()))
            .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
    }
    f.set_permissions(fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

/// Entry point of `ckpt-agent shim SPEC`: runs a job's shim, or with a [`PutBack`] task the
/// put-back helper. `SPEC` `-` is standard input (no `/dev/stdin`: a minimal `/dev` lacks it).
/// Returns the exit code.
pub fn main(spec_path: &Path) -> i32 {
    let read = if spec_path == Path::new("-") {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes).map(|_| bytes)
    } else {
        fs::read(spec_path)
    };
    let Ok(bytes) = read else {
        eprintln!("ckpt shim: cannot read {}", spec_path.display());
        return 2;
    };
    if let Ok(task) = serde_json::from_slice::<crate::os::owner::PutBackTask>(&bytes) {
        return crate::os::owner::put_back_main(&task.put_back);
    }
    let spec: ShimSpec = match serde_json::from_slice(&bytes) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ckpt shim: cannot read {}: {e}", spec_path.display());
            return 2;
        }
    };
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes integer arguments only; fcntl on a
    // descriptor number (an error, if it is not open, is ignored).
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
        if let Some(fd) = spec.ready_fd {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
    LENT.store(spec.lent, std::sync::atomic::Ordering::Relaxed);
    // The part's network namespace, held from here to the end: its interface is taken off
    // the network when the part ends or is fenced ([`fence::unplug`]).
    let job_net = spec.mode.netns().and_then(|p| fs::File::open(p).ok());
    if let Some(lease) = &spec.lease {
        fence::fence_on_expiry(
            crate::rpc::lease::Expiry::new(lease.clone()),
            spec.cgroup_procs.clone(),
            job_net.as_ref().and_then(|f| f.try_clone().ok()),
            spec.run_dir.join(crate::rpc::lease::FENCED),
        );
    }
    let started = spec.run_dir.join(STARTED);
    let root = match start(&spec) {
        Ok(pid) => pid,
        Err(error) => {
            write_json(&started, &Started::Failed { error });
            tell_ready(spec.ready_fd);
            return 1;
        }
    };
    write_json(&started, &Started::Running { root_pid: root });
    tell_ready(spec.ready_fd);
    let exit = reap::reap_until_empty(root, &spec.cgroup_procs);
    if exit.ended > 0 {
        reap::note_ended(&spec.stderr, &exit);
    }
    if let Some(ns) = &job_net {
        fence::unplug(ns);
    }
    write_json(&spec.run_dir.join(EXIT), &exit);
    0
}

/// Writes the byte that tells the agent `started.json` is there, and closes the pipe.
fn tell_ready(fd: Option<i32>) {
    if let Some(fd) = fd {
        // SAFETY: a one-byte buffer that outlives the call; the descriptor is ours to close.
        unsafe {
            libc::write(fd, b"1".as_ptr().cast(), 1);
            libc::close(fd);
        }
    }
}

/// Whether this shim's job cgroup is one Slurm lent ([`ShimSpec::lent`]).
static LENT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The processes of the job's cgroup (`procs`) that the shim's kills reach: all of them, or in
/// a cgroup Slurm lent, the shim's descendants.
pub(super) fn job_members(procs: &Path) -> Vec<i32> {
    let of = LENT
        .load(std::sync::atomic::Ordering::Relaxed)
        .then(|| (std::process::id() as i32, None));
    crate::os::cgroup::members(procs, of)
}

/// The `cgroup.procs` files the job joins: its cgroup's first.
fn cgroup_join_paths(spec: &ShimSpec) -> Result<Vec<CString>, String> {
    std::iter::once(&spec.cgroup_procs)
        .chain(&spec.also_join)
        .map(|p| CString::new(p.display().to_string()).map_err(|e| e.to_string()))
        .collect()
}

/// Joins the cgroups from inside a freshly forked child: only async-signal-safe calls.
fn join_cgroup(procs: &[CString]) -> std::io::Result<()> {
    for p in procs {
        // SAFETY: open/write/close on a valid C string and a static buffer; async-signal-safe.
        unsafe {
            let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let rc = libc::write(fd, b"0".as_ptr().cast(), 1);
            libc::close(fd);
            if rc != 1 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// Marks every inherited descriptor above stderr close-on-exec, as sshd does for a session:
/// a leaked listening socket would otherwise be dumped in a state the engine rejects.
/// In a fresh mount namespace of a process that is 1 of a fresh PID namespace: stops mount
/// events from going back to the node, and from coming in but below the followed mount
/// points (every mount of `unfollow` made private), drops the node's network namespace files
/// (they belong to other jobs and would tie the part's images to them), mounts a `/proc` of
/// the new PID namespace and a `/dev/shm` of the part's own. Async-signal-safe.
fn sandbox_mounts(job_dir: &CString, unfollow: &[CString]) -> io::Result<()> {
    // SAFETY: mount and umount2 on NUL-terminated strings allocated before the fork.
    unsafe {
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
        for point in unfollow {
            // A mount point hidden under another mount is not reached by its path: it stays a
            // slave, unseen.
            libc::mount(
                std::ptr::null(),
                point.as_ptr(),
                std::ptr::null(),
                libc::MS_PRIVATE,
                std::ptr::null(),
            );
        }
        // Not a mount point where no network namespace was ever named: nothing to drop.
        libc::umount2(c"/run/netns".as_ptr(), libc::MNT_DETACH);
        if libc::mount(
            c"proc".as_ptr(),
            c"/proc".as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
        if libc::mount(
            job_dir.as_ptr(),
            crate::os::sandbox::job_dir::JOB_DIR_C.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
        // POSIX shared memory of the part's own: dumped with it, and restored with it on
        // whichever node it moves to.
        if libc::mount(
            c"tmpfs".as_ptr(),
            c"/dev/shm".as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            c"mode=1777".as_ptr().cast(),
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Opens the job's stdout and stderr again by their paths (in the agent's job directory, as
/// the sandbox sees it) and /dev/null for stdin, in the current mount namespace, and puts them on 0, 1 and 2;
/// refuses an output that is no longer the file already open on 1 or 2. Async-signal-safe.
fn reopen_stdio(stdout: &CString, stderr: &CString) -> io::Result<()> {
    // SAFETY: open, fstat, dup2 and close on descriptors this process owns and on
    // NUL-terminated paths allocated before the fork.
    unsafe {
        for (path, target) in [(stdout, 1), (stderr, 2)] {
            let fd = libc::open(
                path.as_ptr(),
                libc::O_WRONLY | libc::O_APPEND | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            );
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut now: libc::stat = std::mem::zeroed();
            let mut before: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut now) != 0
                || libc::fstat(target, &mut before) != 0
                || now.st_dev != before.st_dev
                || now.st_ino != before.st_ino
                || libc::dup2(fd, target) < 0
            {
                libc::close(fd);
                return Err(io::Error::from_raw_os_error(libc::EXDEV));
            }
            libc::close(fd);
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if null < 0 || libc::dup2(null, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
        libc::close(null);
    }
    Ok(())
}

/// What the child does between fork and exec, in order; the one that fails is reported to the
/// shim through a pipe, so that the error says which (std only passes the errno back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum ChildStep {
    Session = 1,
    IpcNamespace,
    Cgroup,
    Identity,
    WorkingDir,
    Descriptors,
    NetNamespace,
    Namespaces,
    PidBase,
    Mounts,
    Stdio,
}

impl ChildStep {
    fn from_byte(b: u8) -> Option<Self> {
        [
            ChildStep::Session,
            ChildStep::IpcNamespace,
            ChildStep::Cgroup,
            ChildStep::Identity,
            ChildStep::WorkingDir,
            ChildStep::Descriptors,
            ChildStep::NetNamespace,
            ChildStep::Namespaces,
            ChildStep::PidBase,
            ChildStep::Mounts,
            ChildStep::Stdio,
        ]
        .into_iter()
        .find(|s| *s as u8 == b)
    }
}

/// The child's umask: the daemons run with 077, a job gets the usual 022.
const JOB_UMASK: libc::mode_t = 0o022;

fn start(spec: &ShimSpec) -> Result<i32, String> {
    let procs = cgroup_join_paths(spec)?;
    let stdout = open_output(&spec.stdout, spec.output_owner)
        .map_err(|e| format!("{}: {e}", spec.stdout.display()))?;
    let stderr = open_output(&spec.stderr, spec.output_owner)
        .map_err(|e| format!("{}: {e}", spec.stderr.display()))?;
    match &spec.mode {
        ShimMode::Launch { .. } => launch(spec, procs, stdout, stderr),
        ShimMode::Restore {
            argv,
            pid_file,
            netns,
            gate,
            guard,
            exempt,
        } => {
            let engine = restore::Engine {
                cgroup_procs: &spec.cgroup_procs,
                procs: &procs,
                stdout: &stdout,
                stderr: &stderr,
            };
            restore::start(
                &engine,
                &spec.run_dir,
                argv,
                pid_file,
                netns.as_deref(),
                gate.as_deref(),
                (guard, exempt),
            )
        }
    }
}

/// What the launched child does between fork and exec, in order ([`ChildSetup::run`]); each
/// step that fails writes its [`ChildStep`] to `step_fd` for the parent to name.
struct ChildSetup {
    step_fd: libc::c_int,
    /// The sandbox's network namespace, joined.
    netns_fd: Option<libc::c_int>,
    /// The job directory, bound at [`crate::os::sandbox::JOB_DIR`] in a sandbox.
    job_dir: CString,
    /// The node's mount points the sandbox makes private (all but those it follows).
    unfollow: Vec<CString>,
    /// stdout and stderr, opened again through that bind in a sandbox.
    out_path: CString,
    err_path: CString,
    /// The sandbox's first PIDs follow this one.
    pid_base: Option<CString>,
    /// The job cgroups' `cgroup.procs`.
    procs: Vec<CString>,
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
    /// The working directory.
    dir: CString,
}

impl ChildSetup {
    /// The steps, in the child between fork and exec.
    ///
    /// # Safety
    /// Only between fork and exec: it makes only async-signal-safe system calls (setsid,
    /// setns, unshare, open/write/close, setgroups/setgid/setuid, chdir, umask, close_range)
    /// on what was allocated before the fork.
    unsafe fn run(&self) -> io::Result<()> {
        // SAFETY: see above; each call is a plain system call on values owned by `self`.
        unsafe {
            const LAST_PID: &[u8] = b"/proc/sys/kernel/ns_last_pid\0";
            let failed = |step: ChildStep| {
                let e = io::Error::last_os_error();
                let b = step as u8;
                libc::write(self.step_fd, (&b as *const u8).cast(), 1);
                e
            };
            if libc::setsid() < 0 {
                return Err(failed(ChildStep::Session));
            }
            if let Some(fd) = self.netns_fd {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(failed(ChildStep::NetNamespace));
                }
                if libc::unshare(libc::CLONE_NEWUTS | libc::CLONE_NEWNS) != 0 {
                    return Err(failed(ChildStep::Namespaces));
                }
                if sandbox_mounts(&self.job_dir, &self.unfollow).is_err() {
                    return Err(failed(ChildStep::Mounts));
                }
                if reopen_stdio(&self.out_path, &self.err_path).is_err() {
                    return Err(failed(ChildStep::Stdio));
                }
            }
            if let Some(base) = &self.pid_base {
                // This process is 1 of the new namespace: the next PIDs follow the base there.
                let fd = libc::open(LAST_PID.as_ptr().cast(), libc::O_WRONLY | libc::O_CLOEXEC);
                let len = base.as_bytes().len();
                if fd < 0 || libc::write(fd, base.as_ptr().cast(), len) != len as isize {
                    return Err(failed(ChildStep::PidBase));
                }
                libc::close(fd);
            }
            // A private IPC namespace: SysV shared memory of the job is then dumped and restored
            // with it instead of being shared with the host.
            if libc::unshare(libc::CLONE_NEWIPC) != 0 {
                return Err(failed(ChildStep::IpcNamespace));
            }
            if join_cgroup(&self.procs).is_err() {
                return Err(failed(ChildStep::Cgroup));
            }
            if libc::geteuid() == 0
                && (libc::setgroups(self.groups.len(), self.groups.as_ptr()) != 0
                    || libc::setgid(self.gid) != 0
                    || libc::setuid(self.uid) != 0)
            {
                return Err(failed(ChildStep::Identity));
            }
            // Entered as the job's user, never as root: a directory the user may not enter stays
            // closed.
            if libc::chdir(self.dir.as_ptr()) != 0 {
                return Err(failed(ChildStep::WorkingDir));
            }
            libc::umask(JOB_UMASK);
            if crate::os::clone_into::cloexec_from_3().is_err() {
                return Err(failed(ChildStep::Descriptors));
            }
            Ok(())
        }
    }
}

/// The part's network namespace, opened, and the base of its PID namespace's numbers, for a
/// part in a sandbox: the shim's children from here on go into a new PID namespace. Nothing
/// for a part without one.
fn enter_sandbox(sandbox: Option<&Sandbox>) -> Result<(Option<fs::File>, Option<CString>), String> {
    Ok(match sandbox {
        Some(sb) => {
            let f = fs::File::open(&sb.netns).map_err(|e| {
                format!(
                    "cannot open the part's network namespace {}: {e}",
                    sb.netns.display()
                )
            })?;
            // SAFETY: unshare with a flag that only affects the children made after it.
            if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
                return Err(format!(
                    "cannot make the part's PID namespace: {}",
                    io::Error::last_os_error()
                ));
            }
            let base = CString::new(sb.pid_base.to_string()).expect("digits");
            (Some(f), Some(base))
        }
        None => (None, None),
    })
}

/// Starts the job's command (in a sandbox: `ckpt-init`, which starts it, as process 1 of a new
/// PID namespace, in the part's network namespace and IPC and UTS ones of its own) as the
/// job's user, in its cgroup; a failed step of the child is named in the error.
fn launch(
    spec: &ShimSpec,
    procs: Vec<CString>,
    stdout: fs::File,
    stderr: fs::File,
) -> Result<i32, String> {
    let ShimMode::Launch {
        argv,
        cwd,
        env,
        uid,
        gid,
        groups,
        sandbox,
    } = &spec.mode
    else {
        return Err("the shim was asked to launch without a command".into());
    };
    let (prog, args) = argv.split_first().ok_or("empty command")?;
    let (uid, gid) = (*uid, *gid);
    let (netns, pid_base) = enter_sandbox(sandbox.as_ref())?;
    // In a sandbox, the job directory (which holds the outputs) is bound at the same path on
    // every node, and the outputs are opened again through it: a file open through a mount of
    // another namespace is one the engine cannot dump, and one bound per node follows the part
    // to another node.
    let c_path = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| format!("{} contains a NUL", p.display()))
    };
    let in_sandbox = |p: &Path| {
        Path::new(crate::os::sandbox::job_dir::JOB_DIR).join(p.file_name().unwrap_or_default())
    };
    if sandbox.is_some() && spec.stdout.parent() != spec.stderr.parent() {
        return Err("a sandboxed part's stdout and stderr must be in one directory".into());
    }
    let (step_r, step_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| format!("cannot start {prog}: pipe: {e}"))?;
    // The node's mounts, read here (the child may not allocate): those the sandbox does not
    // follow become private to it.
    let unfollow = match sandbox {
        Some(sb) => {
            let info = fs::read_to_string("/proc/self/mountinfo")
                .map_err(|e| format!("cannot read the node's mounts: {e}"))?;
            crate::os::sandbox::mounts::to_make_private(&info, &sb.follow)
                .iter()
                .filter_map(|p| c_path(p).ok())
                .collect()
        }
        None => Vec::new(),
    };
    let setup = ChildSetup {
        step_fd: step_w.as_raw_fd(),
        netns_fd: netns.as_ref().map(|f| f.as_raw_fd()),
        job_dir: c_path(spec.stdout.parent().unwrap_or(Path::new("/")))?,
        unfollow,
        out_path: c_path(&in_sandbox(&spec.stdout))?,
        err_path: c_path(&in_sandbox(&spec.stderr))?,
        pid_base,
        procs,
        uid,
        gid,
        groups: groups.clone(),
        dir: CString::new(cwd.as_os_str().as_bytes())
            .map_err(|_| format!("working directory {} contains a NUL", cwd.display()))?,
    };
    let mut cmd = match sandbox {
        Some(sb) => {
            let mut c = Command::new(&sb.init);
            c.arg(prog);
            c
        }
        None => Command::new(prog),
    };
    cmd.args(args)
        .env_clear()
        .envs(env)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr);
    // SAFETY: `ChildSetup::run` is made for the child between fork and exec (see there); what
    // it uses was allocated before the fork, and `step_fd` stays open in the parent until
    // after the spawn.
    unsafe {
        cmd.pre_exec(move || setup.run());
    }
    let spawned = cmd.spawn();
    drop(cmd);
    drop(step_w);
    drop(netns);
    let child = spawned.map_err(|e| {
        let mut b = [0u8; 1];
        let step = match nix::unistd::read(&step_r, &mut b) {
            Ok(1) => ChildStep::from_byte(b[0]),
            _ => None,
        };
        match step {
            Some(ChildStep::WorkingDir) => format!(
                "cannot enter working directory {} as uid {uid}: {e}; the job's user must be able to enter it and every directory above it",
                cwd.display()
            ),
            Some(ChildStep::Identity) => {
                format!("cannot switch to uid {uid}, gid {gid}, groups {groups:?}: {e}")
            }
            Some(s) => format!("cannot start {prog}: {s:?}: {e}"),
            None => format!("cannot start {prog}: {e}"),
        }
    })?;
    Ok(child.id() as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn output_files_are_private_and_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("stdout");
        let f = open_output(&out, None).unwrap();
        assert_eq!(f.metadata().unwrap().mode() & 0o777, 0o600);
        let target = d.path().join("target");
        fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, d.path().join("stderr")).unwrap();
        assert!(open_output(&d.path().join("stderr"), None).is_err());
        assert_eq!(fs::read(&target).unwrap(), b"keep");
    }
}
