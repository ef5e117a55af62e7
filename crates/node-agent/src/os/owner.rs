//! Who a job runs as, and what the agent does in its owner's name.
//!
//! A job's [`Identity`] comes from this node's user databases, never from a request. Inside
//! directories a user controls, root neither follows a symbolic link ([`open_no_symlinks`]) nor
//! acts with its own rights: before a restore, a helper process ([`PutBack`], started as
//! `ckpt-agent shim` with the task on its stdin) opens the saved copies as root, becomes the job's
//! owner for good, and only then puts the job's files back. Who may run jobs at all is the
//! node's [`LaunchPolicy`]; after a restore, [`verify_restored`] checks that the processes hold
//! nothing their owner may not use. A job's stdout and stderr are given to its owner through
//! the open file ([`give_output`]), also in a job directory an older agent made
//! ([`fix_job_dir_modes`], which brings the rest of it to the modes of `modes.rs`).
//!
//! One file: every act root does in a user's name, so that the rules for those acts (no link
//! followed, the owner's credentials) are checked in one place.
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::FromRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ckpt_store::manifest::{OpenFile, PreservedFile};
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::error::{io_err, AgentError};
use crate::os::cgroup::JobCgroup;
use crate::os::modes::{set_mode, PRIVATE_DIR, PRIVATE_FILE, TRAVERSE_ONLY};
use crate::os::procfs;

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
    /// The primary group of `uid` in this node's passwd database; the uid itself when it has
    /// no entry there (as a user private group would be).
    pub fn primary_gid(uid: u32) -> u32 {
        nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
            .ok()
            .flatten()
            .map_or(uid, |u| u.gid.as_raw())
    }

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

pub(crate) fn put_back_main(task: &PutBack) -> i32 {
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

/// Creates the directories missing above `p`, with `mode`.
fn make_parents(p: &Path, mode: u32) -> Result<(), Failed> {
    if let Some(parent) = p.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(parent)
            .map_err(plain)?;
    }
    Ok(())
}

/// An output file back at its checkpoint size: truncated if it grew, recreated (0644) if it is
/// gone; one that shrank is refused (zeros would be wrong).
fn put_back_output(f: &OpenFile) -> Result<(), Failed> {
    let p = Path::new(&f.path);
    let flags = libc::O_WRONLY | libc::O_NONBLOCK | libc::O_NOCTTY;
    let file = match open_no_symlinks(p, flags, 0) {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            make_parents(p, 0o755)?;
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
    make_parents(p, 0o700)?;
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
    ckpt_store::copy::copy_sparse(&mut copy, &mut file).map_err(plain)?;
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(plain)?;
    if meta.gid() != pf.gid {
        // The owner may give it only to one of their groups; otherwise it keeps the group the
        // file system gave it.
        let _ = nix::unistd::fchown(&file, None, Some(pf.gid.into()));
    }
    Ok(())
}

/// How long the put-back before a restore may take: it copies the saved shared-memory and
/// session files back; at a pessimistic 100 MB/s this covers 60 GB.
pub const PUT_BACK_TIMEOUT: Duration = Duration::from_secs(600);

/// Who may run jobs on this node (`allow_root_jobs` and `min_uid` in the agent config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchPolicy {
    /// Jobs may run as root.
    pub allow_root: bool,
    /// Lowest uid other than root that jobs may run as.
    pub min_uid: u32,
}

impl Default for LaunchPolicy {
    fn default() -> Self {
        LaunchPolicy {
            allow_root: false,
            min_uid: 1000,
        }
    }
}

impl LaunchPolicy {
    /// The identity that job `job`, owned by `uid`, runs as on `node`; or why it may not run
    /// there. Applies to launches, attached parts and restores alike.
    pub fn authorize(&self, job: u64, node: &str, uid: u32) -> Result<Identity, AgentError> {
        let node = node.to_string();
        if uid == 0 && !self.allow_root {
            return Err(AgentError::RootRefused { job, node });
        }
        if uid != 0 && uid < self.min_uid {
            return Err(AgentError::UidBelowMinimum {
                job,
                node,
                uid,
                min_uid: self.min_uid,
            });
        }
        match Identity::of_uid(uid) {
            Ok(Some(id)) => Ok(id),
            Ok(None) => Err(AgentError::UnknownUser { job, node, uid }),
            Err(e) => Err(AgentError::Start {
                job,
                message: format!("cannot look up uid {uid} in the user database: {e}"),
            }),
        }
    }
}

/// The name (`stdout`, `stderr`) of the part's own output at `path`: in its job directory
/// `own_dir`, or where a sandbox sees that directory ([`crate::os::sandbox::job_dir::JOB_DIR`]).
pub(crate) fn own_output<'a>(path: &'a Path, own_dir: &Path) -> Option<&'a str> {
    let parent = path.parent()?;
    let name = path.file_name()?.to_str()?;
    ((parent == own_dir || parent == Path::new(crate::os::sandbox::job_dir::JOB_DIR))
        && (name == "stdout" || name == "stderr"))
        .then_some(name)
}

/// Brings the job's own stdout or stderr (in the job directory, which root controls) back to
/// its checkpoint size, recreating it if it is gone; 0600 and the owner's, through the open
/// file.
pub(crate) fn put_back_own_output(
    job: u64,
    f: &OpenFile,
    owner: &Identity,
    saved: Option<&Path>,
) -> Result<(), AgentError> {
    let p = Path::new(&f.path);
    let io = |what, path: &Path| io_err(job, what, path);
    let flags = libc::O_WRONLY | libc::O_NONBLOCK;
    let (file, created) = match crate::os::owner::open_no_symlinks(p, flags, 0) {
        Ok(file) => (file, false),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            let file = crate::os::owner::open_no_symlinks(p, flags | libc::O_CREAT, PRIVATE_FILE)
                .map_err(io("create", p))?;
            (file, true)
        }
        Err(e) => return Err(io("open", p)(e)),
    };
    let meta = file.metadata().map_err(io("stat", p))?;
    if !meta.is_file() {
        return Err(io("open", p)(std::io::Error::other("not a regular file")));
    }
    nix::unistd::fchown(&file, Some(owner.uid.into()), Some(owner.gid.into()))
        .map_err(|e| io("chown", p)(std::io::Error::from_raw_os_error(e as i32)))?;
    file.set_permissions(fs::Permissions::from_mode(PRIVATE_FILE))
        .map_err(io("chmod", p))?;
    // The epoch's copy of the output, if it has one of the size the checkpoint saw.
    let copy = || {
        saved
            .and_then(|s| fs::File::open(s).ok())
            .filter(|c| c.metadata().is_ok_and(|m| m.len() == f.size))
    };
    if meta.len() < f.size && !created {
        // An older incarnation's output: the part ran here, moved away and came back. The
        // epoch's copy is what it printed since.
        if let Some(copy) = copy() {
            file.set_len(0).map_err(io("truncate", p))?;
            let mut file = &file;
            std::io::copy(&mut &copy, &mut file).map_err(io("write", p))?;
            return Ok(());
        }
        // The engine will refuse; extend with zeros is wrong, so say what happened.
        return Err(AgentError::Start {
            job,
            message: format!(
                "{} is {} bytes but was {} at checkpoint time: it was truncated or replaced since; restore it or remove it and restart from an epoch taken after",
                f.path,
                meta.len(),
                f.size
            ),
        });
    }
    // Recreated: what the job had written, from the epoch's copy of it where it has one (the
    // part moved, or its node lost its disks); else zeros, as the engine needs only the size.
    if created {
        if let Some(copy) = copy() {
            let mut file = &file;
            std::io::copy(&mut &copy, &mut file).map_err(io("write", p))?;
        }
    }
    // Longer: truncated back.
    if meta.len() != f.size {
        file.set_len(f.size).map_err(io("truncate", p))?;
    }
    Ok(())
}

/// Brings a job directory made by an older agent to today's modes: the directory 0711, its
/// record and other files 0600, `logs/` and `run/` 0700, stdout and stderr 0600 and, when the
/// owner is known, the owner's (through the open file).
pub(crate) fn fix_job_dir_modes(dir: &Path, owner: Option<u32>) {
    let fix = |path: &Path, r: std::io::Result<()>| {
        if let Err(e) = r {
            warn!(path = %path.display(), error = %e, "cannot fix the mode of a job file");
        }
    };
    fix(dir, set_mode(dir, TRAVERSE_ONLY));
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        let Ok(t) = e.file_type() else { continue };
        let name = e.file_name();
        if t.is_dir() {
            fix(&p, set_mode(&p, PRIVATE_DIR));
        } else if name == "stdout" || name == "stderr" {
            fix(&p, give_output(&p, owner));
        } else if t.is_file() {
            fix(&p, set_mode(&p, PRIVATE_FILE));
        }
    }
}

/// Makes a job's stdout or stderr 0600 and, if known, its owner's, through the open file.
pub(crate) fn give_output(path: &Path, owner: Option<u32>) -> std::io::Result<()> {
    let f = crate::os::owner::open_no_symlinks(path, libc::O_RDONLY | libc::O_NONBLOCK, 0)?;
    if !f.metadata()?.is_file() {
        return Ok(());
    }
    f.set_permissions(fs::Permissions::from_mode(PRIVATE_FILE))?;
    if let Some(uid) = owner {
        let gid = Identity::of_uid(uid).ok().flatten().map(|i| i.gid.into());
        nix::unistd::fchown(&f, Some(uid.into()), gid)
            .map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
    }
    Ok(())
}

/// Checks, while the restored processes are still frozen, that each holds only files its owner
/// may use as it does. The engine reopens the job's files by path, as root, and follows links:
/// a file the user swapped for a link (to root's secrets, or a file only root may write) since
/// the put-back would otherwise stay open in the user's process. Judged by the mode bits, and
/// where a file has an ACL by the kernel itself: a child process with the owner's identity
/// reopens it ([`owner_opens`]). Devices and named pipes are judged as files are (a link to
/// `/dev/mem` or a disk is refused unless the owner may open it anyway). Root's jobs are not
/// checked. The processes are the cgroup's members as `host` lists them.
pub(crate) fn verify_restored(
    job: u64,
    (host, cgroup): (&dyn crate::os::host::Host, &JobCgroup),
    owner: &Identity,
) -> Result<(), AgentError> {
    if owner.uid == 0 {
        return Ok(());
    }
    let refuse = |pid: i32, h: &procfs::Held, why: String| {
        AgentError::FileRefused {
        job,
        action: "restore",
        path: h.path.display().to_string(),
        uid: owner.uid,
        problem: format!(
            "the restored process {pid} would hold it {}, {why}; it was replaced, e.g. by a link, after the checkpoint; the restored processes were killed",
            match (h.access.write, h.access.read) {
                _ if h.access.search => "as its working directory",
                (true, _) => "open for writing",
                _ => "open for reading",
            }
        ),
    }
    };
    for pid in host.pids(cgroup).unwrap_or_default() {
        let mut by_kernel = Vec::new();
        for h in procfs::held_files(pid) {
            let by_mode = owner_may(owner, &h.meta, h.access);
            if has_acl(&h.handle) {
                by_kernel.push(h);
            } else if !by_mode {
                let why = format!(
                    "which its owner may not (it belongs to uid {}, mode 0{:o})",
                    h.meta.uid(),
                    h.meta.mode() & 0o7777
                );
                return Err(refuse(pid, &h, why));
            }
        }
        let verdicts = owner_opens(owner, &by_kernel).map_err(|e| AgentError::Start {
            job,
            message: format!(
                "cannot check the restored files' access as uid {}: {e}",
                owner.uid
            ),
        })?;
        if let Some((h, _)) = by_kernel.iter().zip(verdicts).find(|(_, ok)| !ok) {
            return Err(refuse(
                pid,
                h,
                "which its owner may not (the file's ACL does not let them)".into(),
            ));
        }
    }
    Ok(())
}

/// Whether the owner may open each of `held` as it is held, by the kernel's own judgement
/// (ACLs, groups and all): each is opened here as root by its `/proc` handle without any
/// access (`O_PATH`), then a child process that has become the owner (uid, gid, groups)
/// reopens it through its own descriptor with the access the job has (a working directory:
/// enters it). Nothing is read or written; a pipe is opened without waiting.
pub(crate) fn owner_opens(owner: &Identity, held: &[procfs::Held]) -> std::io::Result<Vec<bool>> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    if held.is_empty() {
        return Ok(Vec::new());
    }
    let mut handles: Vec<OwnedFd> = Vec::new();
    let mut asks: Vec<(CString, libc::c_int, bool)> = Vec::new();
    for h in held {
        let c =
            CString::new(h.handle.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
        // SAFETY: open with a NUL-terminated path.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor just opened, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let flags = match (h.access.read, h.access.write) {
            (_, false) => libc::O_RDONLY,
            (false, true) => libc::O_WRONLY,
            (true, true) => libc::O_RDWR,
        } | libc::O_NONBLOCK
            | libc::O_NOCTTY
            | libc::O_CLOEXEC;
        let path = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map_err(std::io::Error::other)?;
        asks.push((path, flags, h.access.search));
        handles.push(fd);
    }
    let (r, w) = nix::unistd::pipe().map_err(std::io::Error::from)?;
    let groups: Vec<libc::gid_t> = owner.groups.clone();
    let (uid, gid) = (owner.uid, owner.gid);
    let wfd = w.as_raw_fd();
    // SAFETY: the child makes only system calls (setgroups, setgid, setuid, open, close,
    // chdir, write, _exit) on memory prepared before the fork.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if child == 0 {
        // SAFETY: see above.
        unsafe {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                libc::_exit(2);
            }
            for (path, flags, search) in &asks {
                let ok = if *search {
                    libc::chdir(path.as_ptr()) == 0
                } else {
                    let fd = libc::open(path.as_ptr(), *flags);
                    if fd >= 0 {
                        libc::close(fd);
                        true
                    } else {
                        // A pipe without a reader: the permission check passed first.
                        *libc::__errno_location() == libc::ENXIO
                    }
                };
                let b: u8 = if ok { b'1' } else { b'0' };
                libc::write(wfd, (&b as *const u8).cast(), 1);
            }
            libc::_exit(0);
        }
    }
    drop(w);
    let mut answers = Vec::new();
    use std::io::Read;
    std::fs::File::from(r).read_to_end(&mut answers)?;
    let mut status = 0;
    // SAFETY: waitpid on our own child, into a local int.
    unsafe { libc::waitpid(child, &mut status, 0) };
    drop(handles);
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 || answers.len() != asks.len() {
        return Err(std::io::Error::other(format!(
            "the checking process ended with status {status} after {} of {} answers",
            answers.len(),
            asks.len()
        )));
    }
    Ok(answers.iter().map(|&b| b == b'1').collect())
}

/// Whether `owner` may use a file as `access` says, by its mode bits (the owner's class, else
/// the group's, else the others').
pub(crate) fn owner_may(owner: &Identity, meta: &fs::Metadata, access: procfs::Access) -> bool {
    let mode = meta.mode();
    let bits = if meta.uid() == owner.uid {
        (mode >> 6) & 7
    } else if meta.gid() == owner.gid || owner.groups.contains(&meta.gid()) {
        (mode >> 3) & 7
    } else {
        mode & 7
    };
    (!access.read || bits & 4 != 0)
        && (!access.write || bits & 2 != 0)
        && (!access.search || bits & 1 != 0)
}

/// Whether the file reached through `handle` has a POSIX access ACL.
pub(crate) fn has_acl(handle: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(handle.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: getxattr with a NUL-terminated path and name, and a null buffer of size 0 (it
    // only returns the value's size).
    let n = unsafe {
        libc::getxattr(
            c.as_ptr(),
            c"system.posix_acl_access".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    n > 0
}

/// Runs the put-back helper (`<shim_exe> shim -` with `task` on its stdin) and turns
/// its report into an error naming the file.
pub(crate) async fn run_put_back(
    job: u64,
    shim_exe: &Path,
    task: &PutBackTask,
) -> Result<(), AgentError> {
    use tokio::io::AsyncWriteExt;
    let failed = |message: String| AgentError::Start {
        job,
        message: format!("put-back helper: {message}"),
    };
    let mut child = tokio::process::Command::new(shim_exe)
        .arg("shim")
        .arg("-")
        .env_clear()
        .current_dir("/")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| failed(format!("cannot start {}: {e}", shim_exe.display())))?;
    let input = serde_json::to_vec(task).expect("serializable");
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(&input)
            .await
            .map_err(|e| failed(format!("cannot send its task: {e}")))?;
    }
    let out = tokio::time::timeout(PUT_BACK_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| AgentError::Timeout {
            job,
            what: "putting back the job's files",
            waited: PUT_BACK_TIMEOUT,
        })?
        .map_err(|e| failed(e.to_string()))?;
    if out.status.success() {
        return Ok(());
    }
    match serde_json::from_slice::<PutBackFailure>(&out.stdout) {
        Ok(f) => Err(AgentError::FileRefused {
            job,
            action: "put back",
            path: f.path,
            uid: task.put_back.owner.uid,
            problem: f.problem,
        }),
        Err(_) => Err(failed(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
    }
}

#[cfg(test)]
mod tests;
