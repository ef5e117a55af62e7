//! The restore's guard against links a user races in. CRIU's restore runs as root and acts on
//! paths in the job owner's directories: it binds the job's named Unix sockets again and then
//! changes their owner and mode by path (`fchownat`/`fchmodat` without `AT_SYMLINK_NOFOLLOW`),
//! and makes ghost and link-remap files beside the files the job held. A user who renames a
//! link over the new socket in the microseconds between the two calls has root give them any
//! file on the machine (shown with CRIU 4.2: 12-72 % of tries won; see docs/security.md).
//!
//! So the shim restores in a mount namespace of its own (a slave copy of the node's) in which
//! every directory a user controls on the way to such a path ([`crate::checkpoint::guards`]) is
//! bound onto itself with `nosymfollow`: no link there is followed, the calls fail and the
//! restore with them, and nothing outside is touched. The restored processes live in that
//! namespace; once the engine is done, and before they run, the flag is cleared on those same
//! mounts, so the job follows its links as before. A sandbox's mounts are clones the engine
//! makes of the mounts at the same paths here, so its dump makes each guarded directory one of
//! them ([`make_mount_points`]) and the clone carries the flag.
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `MOUNT_ATTR_NOSYMFOLLOW` (include/uapi/linux/mount.h).
const MOUNT_ATTR_NOSYMFOLLOW: u64 = 0x0020_0000;
/// `AT_RECURSIVE` (include/uapi/linux/fcntl.h).
const AT_RECURSIVE: libc::c_uint = 0x8000;

/// `struct mount_attr` (include/uapi/linux/mount.h).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

fn c_path(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other)
}

/// Sets (or clears) `nosymfollow` on the mounts at and below `dir`.
fn set_nosymfollow(dir: &CString, on: bool) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: if on { MOUNT_ATTR_NOSYMFOLLOW } else { 0 },
        attr_clr: if on { 0 } else { MOUNT_ATTR_NOSYMFOLLOW },
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr reads `size` bytes of `attr`, which lives on this stack, and a
    // NUL-terminated path.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            dir.as_ptr(),
            AT_RECURSIVE | libc::AT_SYMLINK_NOFOLLOW as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Guards `dirs` for the engine about to start from this thread: a mount namespace of its
/// own (node's mounts as slaves), each directory bound onto itself, recursively, without
/// following links; then each of `exempt` below one of them (directories of root's alone, such
/// as staging under `/tmp` or `/dev/shm`) bound onto itself following links again. Nothing to
/// do for none.
pub(super) fn guard(dirs: &[PathBuf], exempt: &[PathBuf]) -> Result<(), String> {
    if dirs.is_empty() {
        return Ok(());
    }
    // SAFETY: unshare and mount with NUL-terminated strings; affects this process alone.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Err(format!(
                "cannot make the restore's mount namespace: {}",
                io::Error::last_os_error()
            ));
        }
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        ) != 0
        {
            return Err(format!(
                "cannot make the restore's mounts slaves: {}",
                io::Error::last_os_error()
            ));
        }
    }
    for d in dirs {
        let c = bind_onto_itself(d)?;
        set_nosymfollow(&c, true)
            .map_err(|e| format!("cannot guard {} against links: {e}", d.display()))?;
    }
    for e in exempt
        .iter()
        .filter(|e| dirs.iter().any(|d| e.starts_with(d)))
    {
        let c = bind_onto_itself(e)?;
        set_nosymfollow(&c, false).map_err(|err| format!("{}: {err}", e.display()))?;
    }
    Ok(())
}

/// Binds `dir` onto itself (with what is mounted below it) in this mount namespace.
fn bind_onto_itself(dir: &Path) -> Result<CString, String> {
    let c = c_path(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if bind_raw(&c) != 0 {
        return Err(format!(
            "cannot bind {} for the restore: {}",
            dir.display(),
            io::Error::last_os_error()
        ));
    }
    Ok(c)
}

/// The mount points process `pid` sees.
pub(crate) fn mount_points(pid: i32) -> std::collections::HashSet<PathBuf> {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .collect()
}

/// Makes each of `dirs` a mount point of its own in the mount namespace of process `pid` (a
/// sandbox's). The dump then records it as one of the sandbox's mounts, which the restore
/// clones from the same path as the engine sees it: from the restore's guard
/// (this file), its flag included. Without it, the guard would not reach the sandbox: the
/// engine clones the directory's mount without what is mounted on it. A directory that is one
/// already is left as it is; the bind is a slave of the node's mount, as the sandbox's others
/// are, so the part sees the same files and later mounts of the node.
pub(crate) fn make_mount_points(pid: i32, dirs: &[PathBuf]) -> Result<(), String> {
    let points = mount_points(pid);
    let dirs: Vec<std::ffi::CString> = dirs
        .iter()
        .filter(|d| !points.contains(*d))
        .filter_map(|d| std::ffi::CString::new(d.as_os_str().as_encoded_bytes()).ok())
        .collect();
    if dirs.is_empty() {
        return Ok(());
    }
    in_namespace_of(pid, "making the sandbox's guard mounts", || {
        dirs.iter().all(|d| bind_raw(d) == 0)
    })
}

/// Binds `dir` onto itself, recursively; mount(2)'s result. Makes no allocation.
pub(crate) fn bind_raw(dir: &CString) -> libc::c_int {
    // SAFETY: mount with NUL-terminated strings.
    unsafe {
        libc::mount(
            dir.as_ptr(),
            dir.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        )
    }
}

/// Runs `work` in a child that entered the mount namespace of process `pid`; `work` must make
/// system calls only (the child of a threaded process may not allocate). `what` names it in
/// the error.
pub(crate) fn in_namespace_of(pid: i32, what: &str, work: impl Fn() -> bool) -> Result<(), String> {
    let theirs = format!("/proc/{pid}/ns/mnt");
    let target = std::fs::File::open(&theirs).map_err(|e| format!("{theirs}: {e}"))?;
    use std::os::fd::AsRawFd;
    let fd = target.as_raw_fd();
    // SAFETY: the child makes only system calls (setns, what `work` makes, _exit) on memory
    // made before the fork.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(format!("fork: {}", io::Error::last_os_error()));
    }
    if child == 0 {
        // SAFETY: see above.
        unsafe {
            if libc::setns(fd, libc::CLONE_NEWNS) != 0 {
                libc::_exit(2);
            }
            libc::_exit(if work() { 0 } else { 1 });
        }
    }
    match super::reap::wait_pid(child) {
        super::Exit {
            code: Some(0),
            signal: None,
            ..
        } => Ok(()),
        e => Err(format!("{what} in {theirs} failed: {e:?}")),
    }
}

/// Lifts the guard of `dirs` for the processes restored under it (the restored root is
/// `root`): their mounts follow links again. In this namespace where the root shares it,
/// else (a sandbox's namespace the engine made) by a child that enters the root's.
pub(super) fn lift(dirs: &[PathBuf], root: i32) -> Result<(), String> {
    if dirs.is_empty() {
        return Ok(());
    }
    let paths: Vec<CString> = dirs
        .iter()
        .map(|d| c_path(d))
        .collect::<io::Result<_>>()
        .map_err(|e| e.to_string())?;
    let ns = |p: &str| std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
    let theirs = format!("/proc/{root}/ns/mnt");
    if ns("/proc/self/ns/mnt").ok() == ns(&theirs).ok() {
        for p in &paths {
            set_nosymfollow(p, false).map_err(|e| format!("{p:?}: {e}"))?;
        }
        return Ok(());
    }
    in_namespace_of(root, "lifting the guard", || {
        for p in &paths {
            // Where no guard was made in that namespace, there is nothing to lift.
            let _ = set_nosymfollow(p, false);
        }
        true
    })
}
