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
//! The same program, given a [`PutBack`] task, is the helper that puts a job's files back
//! before a restore: it opens the saved copies as root, then becomes the job's owner for good
//! and does everything in the owner's directories with the owner's rights, never following a
//! symbolic link ([`open_no_symlinks`]).
use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use ckpt_store::manifest::{OpenFile, PreservedFile};
use serde::{Deserialize, Serialize};

/// Who a job runs as: its uid, the primary group of its passwd entry and every group that lists
/// the user, all looked up on this node (as `login` and slurmd do). What a request says about
/// groups is never used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// User.
    pub uid: u32,
    /// Primary group (from the passwd entry).
    pub gid: u32,
    /// Supplementary groups (getgrouplist: the primary group and every group naming the user).
    pub groups: Vec<u32>,
}

impl Identity {
    /// Looks `uid` up in this node's passwd and group databases; `Ok(None)` when the uid has
    /// no passwd entry.
    pub fn of_uid(uid: u32) -> io::Result<Option<Identity>> {
        use nix::unistd::{getgrouplist, Uid, User};
        let errno = |e: nix::Error| io::Error::from_raw_os_error(e as i32);
        let Some(user) = User::from_uid(Uid::from_raw(uid)).map_err(errno)? else {
            return Ok(None);
        };
        let name = CString::new(user.name.as_bytes()).map_err(io::Error::other)?;
        let mut groups: Vec<u32> = getgrouplist(&name, user.gid)
            .map_err(errno)?
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        groups.sort_unstable();
        groups.dedup();
        Ok(Some(Identity {
            uid,
            gid: user.gid.as_raw(),
            groups,
        }))
    }

    /// Makes this (single-threaded) process this identity for good: groups, gid, then uid;
    /// fails if root could be regained.
    fn become_it(&self) -> io::Result<()> {
        // SAFETY: setgroups/setgid/setuid take a pointer to a live Vec and integers; the
        // process is single-threaded here (the helper's main thread, before any other work).
        unsafe {
            if libc::setgroups(self.groups.len(), self.groups.as_ptr()) != 0
                || libc::setgid(self.gid) != 0
                || libc::setuid(self.uid) != 0
            {
                return Err(io::Error::last_os_error());
            }
            if self.uid != 0 && (libc::setuid(0) == 0 || libc::geteuid() == 0) {
                return Err(io::Error::other("root privileges could be regained"));
            }
        }
        Ok(())
    }
}

/// Opens the absolute `path` without following a symbolic link anywhere on it: openat2 with
/// `RESOLVE_NO_SYMLINKS` (a link gives `ELOOP`); where the kernel lacks openat2 (before 5.6, or
/// filtered), `O_NOFOLLOW`, which covers the last component only. `O_CLOEXEC` is always added;
/// `mode` is used with `O_CREAT` only.
pub fn open_no_symlinks(path: &Path, flags: i32, mode: u32) -> io::Result<fs::File> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let flags = flags | libc::O_CLOEXEC | libc::O_NOFOLLOW;
    let mode = if flags & libc::O_CREAT != 0 { mode } else { 0 };
    // SAFETY: open_how is plain integers; all zero is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = flags as u64;
    how.mode = u64::from(mode);
    how.resolve = libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: openat2 reads a NUL-terminated path and an open_how of the size passed; both
    // live across the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    let fd = if fd >= 0 {
        fd as i32
    } else {
        let e = io::Error::last_os_error();
        if !matches!(e.raw_os_error(), Some(libc::ENOSYS) | Some(libc::EPERM)) {
            return Err(e);
        }
        // SAFETY: open on a NUL-terminated path that lives across the call.
        let fd = unsafe { libc::open(c.as_ptr(), flags, mode) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        fd
    };
    // SAFETY: `fd` was just opened here and is owned by nothing else.
    Ok(unsafe { fs::File::from_raw_fd(fd) })
}

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
    },
    /// Run the engine's detached restore command, then adopt the restored root.
    Restore {
        /// Engine command line.
        argv: Vec<String>,
        /// Where the engine writes the restored root's PID.
        pid_file: PathBuf,
    },
}

/// The shim's instructions, written by the agent to `<run_dir>/spec.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShimSpec {
    /// Launch or restore.
    pub mode: ShimMode,
    /// `cgroup.procs` of the job's cgroup; the job (or the restoring engine) joins it.
    pub cgroup_procs: PathBuf,
    /// File the job's stdout is appended to.
    pub stdout: PathBuf,
    /// File the job's stderr is appended to.
    pub stderr: PathBuf,
    /// Directory for `started.json` and `exit.json`.
    pub run_dir: PathBuf,
    /// Uid and gid that own `stdout` and `stderr` (mode 0600); none: left as they are.
    #[serde(default)]
    pub output_owner: Option<(u32, u32)>,
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
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Exit {
    /// Exit code, if it exited.
    pub code: Option<i32>,
    /// Signal, if it was killed.
    pub signal: Option<i32>,
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

/// Reads a JSON file the shim wrote, if present and complete.
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    serde_json::from_slice(&fs::read(path).ok()?).ok()
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
/// put-back helper. Returns the exit code.
pub fn main(spec_path: &Path) -> i32 {
    let Ok(bytes) = fs::read(spec_path) else {
        eprintln!("ckpt shim: cannot read {}", spec_path.display());
        return 2;
    };
    if let Ok(task) = serde_json::from_slice::<PutBackTask>(&bytes) {
        return put_back_main(&task.put_back);
    }
    let spec: ShimSpec = match serde_json::from_slice(&bytes) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ckpt shim: cannot read {}: {e}", spec_path.display());
            return 2;
        }
    };
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let started = spec.run_dir.join(STARTED);
    let root = match start(&spec) {
        Ok(pid) => pid,
        Err(error) => {
            write_json(&started, &Started::Failed { error });
            return 1;
        }
    };
    write_json(&started, &Started::Running { root_pid: root });
    reap_until_empty(root, &spec.run_dir.join(EXIT));
    0
}

fn cgroup_join_path(spec: &ShimSpec) -> Result<CString, String> {
    CString::new(spec.cgroup_procs.display().to_string()).map_err(|e| e.to_string())
}

/// Joins the cgroup from inside a freshly forked child: only async-signal-safe calls.
fn join_cgroup(procs: &CString) -> std::io::Result<()> {
    // SAFETY: open/write/close on a valid C string and a static buffer; async-signal-safe.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let rc = libc::write(fd, b"0".as_ptr().cast(), 1);
        libc::close(fd);
        if rc != 1 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Marks every inherited descriptor above stderr close-on-exec, as sshd does for a session:
/// a leaked listening socket would otherwise be dumped in a state the engine rejects.
fn cloexec_inherited_fds() -> std::io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range with the CLOEXEC flag only changes descriptor flags.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
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
        ]
        .into_iter()
        .find(|s| *s as u8 == b)
    }
}

/// The child's umask: the daemons run with 077, a job gets the usual 022.
const JOB_UMASK: libc::mode_t = 0o022;

fn start(spec: &ShimSpec) -> Result<i32, String> {
    let procs = cgroup_join_path(spec)?;
    let stdout = open_output(&spec.stdout, spec.output_owner)
        .map_err(|e| format!("{}: {e}", spec.stdout.display()))?;
    let stderr = open_output(&spec.stderr, spec.output_owner)
        .map_err(|e| format!("{}: {e}", spec.stderr.display()))?;
    match &spec.mode {
        ShimMode::Launch {
            argv,
            cwd,
            env,
            uid,
            gid,
            groups,
        } => {
            let (prog, args) = argv.split_first().ok_or("empty command")?;
            let (uid, gid) = (*uid, *gid);
            let groups: Vec<libc::gid_t> = groups.clone();
            let child_groups = groups.clone();
            let dir = CString::new(cwd.as_os_str().as_bytes())
                .map_err(|_| format!("working directory {} contains a NUL", cwd.display()))?;
            let (step_r, step_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
                .map_err(|e| format!("cannot start {prog}: pipe: {e}"))?;
            let step_fd = step_w.as_raw_fd();
            let mut cmd = Command::new(prog);
            cmd.args(args)
                .env_clear()
                .envs(env)
                .stdin(Stdio::null())
                .stdout(stdout)
                .stderr(stderr);
            // SAFETY: the closure runs between fork and exec and makes only async-signal-safe
            // system calls (setsid, unshare, open/write/close, setgroups/setgid/setuid, chdir,
            // umask, close_range); `procs`, `groups` and `dir` were allocated before the fork,
            // and `step_fd` stays open in the parent until after the spawn.
            unsafe {
                cmd.pre_exec(move || {
                    let failed = |step: ChildStep| {
                        let e = io::Error::last_os_error();
                        let b = step as u8;
                        libc::write(step_fd, (&b as *const u8).cast(), 1);
                        e
                    };
                    if libc::setsid() < 0 {
                        return Err(failed(ChildStep::Session));
                    }
                    // A private IPC namespace: SysV shared memory of the job is then dumped
                    // and restored with it instead of being shared with the host.
                    if libc::unshare(libc::CLONE_NEWIPC) != 0 {
                        return Err(failed(ChildStep::IpcNamespace));
                    }
                    if join_cgroup(&procs).is_err() {
                        return Err(failed(ChildStep::Cgroup));
                    }
                    if libc::geteuid() == 0
                        && (libc::setgroups(child_groups.len(), child_groups.as_ptr()) != 0
                            || libc::setgid(gid) != 0
                            || libc::setuid(uid) != 0)
                    {
                        return Err(failed(ChildStep::Identity));
                    }
                    // Entered as the job's user, never as root: a directory the user may not
                    // enter stays closed.
                    if libc::chdir(dir.as_ptr()) != 0 {
                        return Err(failed(ChildStep::WorkingDir));
                    }
                    libc::umask(JOB_UMASK);
                    if cloexec_inherited_fds().is_err() {
                        return Err(failed(ChildStep::Descriptors));
                    }
                    Ok(())
                });
            }
            let spawned = cmd.spawn();
            drop(cmd);
            drop(step_w);
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
        ShimMode::Restore { argv, pid_file } => {
            let (prog, args) = argv.split_first().ok_or("empty restore command")?;
            let mut cmd = Command::new(prog);
            cmd.args(args)
                .stdin(Stdio::null())
                .stdout(stdout)
                .stderr(stderr);
            // SAFETY: async-signal-safe calls only, on memory allocated before the fork.
            unsafe {
                cmd.pre_exec(move || {
                    join_cgroup(&procs)?;
                    cloexec_inherited_fds()
                });
            }
            let child = cmd
                .spawn()
                .map_err(|e| format!("cannot start {prog}: {e}"))?;
            let status = wait_pid(child.id() as i32);
            if status
                != (Exit {
                    code: Some(0),
                    signal: None,
                })
            {
                return Err(match status.signal {
                    Some(s) => format!("killed by signal {s}"),
                    None => format!("exit status {}", status.code.unwrap_or(-1)),
                });
            }
            let text =
                fs::read_to_string(pid_file).map_err(|e| format!("{}: {e}", pid_file.display()))?;
            text.trim()
                .parse()
                .map_err(|_| format!("{}: not a pid: {text:?}", pid_file.display()))
        }
    }
}

fn decode(status: libc::c_int) -> Exit {
    if libc::WIFSIGNALED(status) {
        Exit {
            code: None,
            signal: Some(libc::WTERMSIG(status)),
        }
    } else {
        Exit {
            code: Some(libc::WEXITSTATUS(status)),
            signal: None,
        }
    }
}

/// Waits for one specific child.
fn wait_pid(pid: i32) -> Exit {
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes to a valid local int.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        if rc == pid {
            return decode(status);
        }
        if rc < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return Exit {
                code: Some(-1),
                signal: None,
            };
        }
    }
}

/// Reaps every child (the root and any orphans re-parented to this subreaper) until none is
/// left, recording the root's status as soon as it ends.
fn reap_until_empty(root: i32, exit_file: &Path) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes to a valid local int.
        let rc = unsafe { libc::waitpid(-1, &mut status, 0) };
        if rc < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => continue,
                _ => break, // ECHILD: nothing left
            }
        }
        if rc == root {
            write_json(exit_file, &decode(status));
        }
    }
    if !exit_file.exists() {
        // The root was never our descendant (it vanished before adoption).
        write_json(
            exit_file,
            &Exit {
                code: None,
                signal: None,
            },
        );
    }
}

/// The put-back helper's input (`{"put_back": {...}}` on its stdin; see [`PutBack`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutBackTask {
    /// What to put back.
    pub put_back: PutBack,
}

/// Before a restore, brings back the job's files as they were at checkpoint time: output files
/// truncated to their size then (or recreated at it), preserved files (shared memory, Open MPI
/// session files) rewritten from their saved copies. Done by a helper process that opens the
/// saved copies as root and then becomes the job's owner, so everything it does in the owner's
/// directories is limited to the owner's rights, and it never follows a symbolic link.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutBack {
    /// The job's owner.
    pub owner: Identity,
    /// Output files and their size at checkpoint time.
    pub open_files: Vec<OpenFile>,
    /// Preserved files, each belonging to the owner.
    pub preserved: Vec<PreservedFile>,
    /// Directory the preserved files' `saved_as` are relative to (root's staging).
    pub saved_dir: PathBuf,
}

/// Why the put-back helper stopped: the file, and what is wrong with it (printed as JSON on
/// the helper's stdout, exit code 1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutBackFailure {
    /// The file.
    pub path: String,
    /// What is wrong, and what to do.
    pub problem: String,
}

fn put_back_main(task: &PutBack) -> i32 {
    match put_back(task) {
        Ok(()) => 0,
        Err(f) => {
            println!("{}", serde_json::to_string(&f).expect("serializable"));
            1
        }
    }
}

/// What is wrong with a file that is (or has on its path) a symbolic link.
pub const LINK_PROBLEM: &str = "it is a symbolic link now, or a directory on its path is (at checkpoint time it was not), and links are not followed; remove the link and restart again";

/// What an error opening or writing the job's file `path` means for its owner `uid`.
fn problem(uid: u32, path: &Path, e: &io::Error) -> String {
    // A link in a sticky directory gives EACCES rather than ELOOP (protected_symlinks and the
    // sticky-directory creation checks come first).
    let link = fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    match e.raw_os_error() {
        Some(libc::ELOOP) => LINK_PROBLEM.into(),
        Some(libc::EACCES) | Some(libc::EPERM) if link => LINK_PROBLEM.into(),
        Some(libc::EACCES) | Some(libc::EPERM) => format!("uid {uid} may not write it ({e})"),
        Some(libc::ENXIO) | Some(libc::ENODEV) => "it is no longer a regular file".into(),
        _ => e.to_string(),
    }
}

fn put_back(t: &PutBack) -> Result<(), PutBackFailure> {
    let uid = t.owner.uid;
    let fail = |path: &str, problem: String| PutBackFailure {
        path: path.to_string(),
        problem,
    };
    // The saved copies are in root's staging: open them before giving root up.
    let mut saved = Vec::new();
    for pf in &t.preserved {
        if pf.uid != uid {
            return Err(fail(
                &pf.path,
                format!(
                    "it belonged to uid {} at checkpoint time, not to the job's owner",
                    pf.uid
                ),
            ));
        }
        if pf.fifo {
            saved.push(None);
            continue;
        }
        let p = t.saved_dir.join(&pf.saved_as);
        let f = open_no_symlinks(&p, libc::O_RDONLY, 0).map_err(|e| {
            fail(
                &pf.path,
                format!("cannot read its saved copy {}: {e}", p.display()),
            )
        })?;
        saved.push(Some(f));
    }
    t.owner
        .become_it()
        .map_err(|e| fail("-", format!("cannot become uid {uid}: {e}")))?;
    // Every mode below is explicit.
    // SAFETY: umask only changes this process's file creation mask.
    unsafe { libc::umask(0) };
    for f in &t.open_files {
        put_back_output(f).map_err(|(e, what)| {
            fail(
                &f.path,
                what.unwrap_or_else(|| problem(uid, Path::new(&f.path), &e)),
            )
        })?;
    }
    for (pf, copy) in t.preserved.iter().zip(saved) {
        put_back_preserved(pf, copy).map_err(|(e, what)| {
            fail(
                &pf.path,
                what.unwrap_or_else(|| problem(uid, Path::new(&pf.path), &e)),
            )
        })?;
    }
    Ok(())
}

/// An error and, where the errno alone does not say it, what it means.
type Failed = (io::Error, Option<String>);

fn plain(e: io::Error) -> Failed {
    (e, None)
}

/// An output file back at its checkpoint size: truncated if it grew, recreated (0644) if it is
/// gone; one that shrank is refused (zeros would be wrong).
fn put_back_output(f: &OpenFile) -> Result<(), Failed> {
    let p = Path::new(&f.path);
    let flags = libc::O_WRONLY | libc::O_NONBLOCK | libc::O_NOCTTY;
    let file = match open_no_symlinks(p, flags, 0) {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            if let Some(parent) = p.parent() {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(parent)
                    .map_err(plain)?;
            }
            let file =
                open_no_symlinks(p, flags | libc::O_CREAT | libc::O_EXCL, 0o644).map_err(plain)?;
            file.set_len(f.size).map_err(plain)?;
            return Ok(());
        }
        Err(e) => return Err(plain(e)),
    };
    let meta = file.metadata().map_err(plain)?;
    if !meta.is_file() {
        let e = io::Error::from_raw_os_error(libc::ENXIO);
        return Err((e, Some("it is no longer a regular file".into())));
    }
    if meta.len() > f.size {
        file.set_len(f.size).map_err(plain)?;
    } else if meta.len() < f.size {
        let e = io::Error::from_raw_os_error(libc::EINVAL);
        return Err((e, Some(format!(
            "it is {} bytes but was {} at checkpoint time: it was truncated or replaced since; restore it or remove it and restart from an epoch taken after",
            meta.len(),
            f.size
        ))));
    }
    Ok(())
}

/// A preserved file rewritten from its saved copy (or a named pipe recreated), with its mode
/// and group of checkpoint time.
fn put_back_preserved(pf: &PreservedFile, copy: Option<fs::File>) -> Result<(), Failed> {
    let p = Path::new(&pf.path);
    if let Some(parent) = p.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .map_err(plain)?;
    }
    let mode = pf.mode & 0o777;
    let Some(mut copy) = copy else {
        // A named pipe: replace whatever is there (never through a link: unlink removes the
        // link itself), as the owner.
        match fs::symlink_metadata(p) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(plain(io::Error::from_raw_os_error(libc::ELOOP)))
            }
            Ok(_) => fs::remove_file(p).map_err(plain)?,
            Err(_) => {}
        }
        nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(mode))
            .map_err(|e| plain(io::Error::from_raw_os_error(e as i32)))?;
        return Ok(());
    };
    let mut file = open_no_symlinks(
        p,
        libc::O_WRONLY | libc::O_CREAT | libc::O_NONBLOCK | libc::O_NOCTTY,
        mode,
    )
    .map_err(plain)?;
    let meta = file.metadata().map_err(plain)?;
    if !meta.is_file() {
        let e = io::Error::from_raw_os_error(libc::ENXIO);
        return Err((e, Some("it is no longer a regular file".into())));
    }
    if meta.uid() != pf.uid {
        let e = io::Error::from_raw_os_error(libc::EPERM);
        return Err((
            e,
            Some(format!(
                "it belongs to uid {} now, not to the job's owner; remove it and restart again",
                meta.uid()
            )),
        ));
    }
    file.set_len(0).map_err(plain)?;
    io::copy(&mut copy, &mut file).map_err(plain)?;
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(plain)?;
    if meta.gid() != pf.gid {
        // The owner may give it only to one of their groups; otherwise it keeps the group the
        // file system gave it.
        let _ = nix::unistd::fchown(&file, None, Some(pf.gid.into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_comes_from_the_user_databases() {
        let root = Identity::of_uid(0)
            .unwrap()
            .expect("root has a passwd entry");
        assert_eq!((root.uid, root.gid), (0, 0));
        assert!(root.groups.contains(&0), "{root:?}");
        assert_eq!(
            Identity::of_uid(u32::MAX - 7).unwrap(),
            None,
            "an unknown uid has no identity"
        );
    }

    #[test]
    fn opening_refuses_symbolic_links_anywhere_on_the_path() {
        let d = tempfile::tempdir().unwrap();
        let real = d.path().join("real");
        fs::create_dir(&real).unwrap();
        fs::write(real.join("f"), b"x").unwrap();
        std::os::unix::fs::symlink(&real, d.path().join("dirlink")).unwrap();
        std::os::unix::fs::symlink(real.join("f"), d.path().join("filelink")).unwrap();
        assert!(open_no_symlinks(&real.join("f"), libc::O_RDONLY, 0).is_ok());
        for p in [d.path().join("filelink"), d.path().join("dirlink/f")] {
            let e = open_no_symlinks(&p, libc::O_RDONLY, 0).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{}", p.display());
        }
    }

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

    #[test]
    fn put_back_truncates_recreates_and_refuses_links_and_strangers() {
        let d = tempfile::tempdir().unwrap();
        let me = Identity {
            uid: unsafe_free_uid(),
            gid: nix::unistd::getgid().as_raw(),
            groups: vec![],
        };
        let grown = d.path().join("grown");
        fs::write(&grown, b"0123456789").unwrap();
        put_back_output(&OpenFile {
            path: grown.display().to_string(),
            size: 4,
        })
        .unwrap();
        assert_eq!(fs::read(&grown).unwrap(), b"0123");
        let gone = d.path().join("sub/gone");
        put_back_output(&OpenFile {
            path: gone.display().to_string(),
            size: 3,
        })
        .unwrap();
        assert_eq!(fs::metadata(&gone).unwrap().len(), 3);
        let shrunk = put_back_output(&OpenFile {
            path: grown.display().to_string(),
            size: 99,
        })
        .unwrap_err();
        assert!(shrunk.1.unwrap().contains("was 99"));
        let victim = d.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = put_back_output(&OpenFile {
            path: link.display().to_string(),
            size: 1,
        })
        .unwrap_err();
        assert_eq!(e.0.raw_os_error(), Some(libc::ELOOP));
        assert!(problem(me.uid, &link, &e.0).contains("symbolic link"));
        let saved = d.path().join("saved");
        fs::write(&saved, b"shm").unwrap();
        let pf = PreservedFile {
            path: link.display().to_string(),
            saved_as: String::new(),
            mode: 0o600,
            uid: me.uid,
            gid: me.gid,
            fifo: false,
        };
        let e = put_back_preserved(&pf, Some(fs::File::open(&saved).unwrap())).unwrap_err();
        assert_eq!(e.0.raw_os_error(), Some(libc::ELOOP));
        assert_eq!(
            fs::read(&victim).unwrap(),
            b"precious",
            "the link was not followed"
        );
        let own = PreservedFile {
            path: d.path().join("shm/seg").display().to_string(),
            uid: nix::unistd::getuid().as_raw(),
            ..pf
        };
        put_back_preserved(&own, Some(fs::File::open(&saved).unwrap())).unwrap();
        let m = fs::metadata(&own.path).unwrap();
        assert_eq!(
            (fs::read(&own.path).unwrap(), m.mode() & 0o777),
            (b"shm".to_vec(), 0o600)
        );
        let stranger = put_back(&PutBack {
            owner: me,
            open_files: vec![],
            preserved: vec![PreservedFile { uid: 12345, ..own }],
            saved_dir: d.path().into(),
        })
        .unwrap_err();
        assert!(stranger.problem.contains("uid 12345"), "{stranger:?}");
    }

    /// A uid that is not the caller's (for preserved files that must be refused).
    fn unsafe_free_uid() -> u32 {
        nix::unistd::getuid().as_raw().wrapping_add(1)
    }
}
