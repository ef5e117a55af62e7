//! The restore's guard against links a user races in. CRIU's restore runs as root and acts on
//! paths in the job owner's directories: it binds the job's named Unix sockets again and then
//! changes their owner and mode by path (`fchownat`/`fchmodat` without `AT_SYMLINK_NOFOLLOW`),
//! and makes ghost and link-remap files beside the files the job held. A user who renames a
//! link over the new socket in the microseconds between the two calls has root give them any
//! file on the machine (shown with CRIU 4.2: 12-72 % of tries won; see docs/security.md).
//!
//! So the shim restores in a mount namespace of its own (a slave copy of the node's), and in it,
//! while the engine restores, no link is followed on the mounts that hold a directory a user
//! controls on the way to such a path ([`crate::part::notes::PartNotes::guards`]), nor on any mount below
//! one: the calls fail and the restore with them, and nothing outside is touched. The flag is set
//! on those same mounts, not on new ones: once the engine is done, and before the restored
//! processes run, it is cleared and the job's view is the node's again, mount for mount (a
//! mark a program placed on a mount still covers its files; no mount of the agent's shows).
//!
//! The flag goes on once the engine runs ([`Guard::arm`], at CRIU's "pre-restore" stage): a
//! program or interpreter started later through a link (`/bin`, `/lib64` on a merged `/usr`)
//! could not start. Root's own trees below a guarded mount where the engine follows its own
//! links (the staging of a pre-copy chain, whose `parent` is one) are bound onto themselves
//! first, and so keep following them; those binds go when the guard is lifted.
//!
//! A command line restore, whose engine starts a program at every stage, and a sandboxed part,
//! whose tmpfs the engine fills with a program (`tar`) once its namespaces exist, are guarded
//! by binds instead: each directory bound onto itself with the flag before the engine starts
//! ([`bind_guard`]). A sandboxed part does not live in this namespace but in the one the engine
//! makes for it, so the binds do not show there; its mounts are clones the engine makes of the
//! mounts at the same paths here, so its dump makes each guarded directory one of them
//! ([`make_mount_points`]) and the clone carries the flag.
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;

use crate::os::sandbox::mounts::unescape;
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

/// Sets (or clears) `nosymfollow` on the mount at `dir` (which must be a mount point), and on
/// every mount below it if `recursive`.
fn set_nosymfollow(dir: &CString, on: bool, recursive: bool) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: if on { MOUNT_ATTR_NOSYMFOLLOW } else { 0 },
        attr_clr: if on { 0 } else { MOUNT_ATTR_NOSYMFOLLOW },
        propagation: 0,
        userns_fd: 0,
    };
    let flags =
        if recursive { AT_RECURSIVE } else { 0 } | libc::AT_SYMLINK_NOFOLLOW as libc::c_uint;
    // SAFETY: mount_setattr reads `size` bytes of `attr`, which lives on this stack, and a
    // NUL-terminated path.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            dir.as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Gives this process a mount namespace of its own whose mounts are slaves of the node's.
fn own_namespace() -> Result<(), String> {
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
    Ok(())
}

/// The guard of one restore, made in the shim's own mount namespace before the engine starts
/// ([`prepare`] or [`bind_guard`]), armed once it runs, lifted before the restored processes run.
pub(super) struct Guard {
    /// The mounts that get the flag, by mount point: those holding a guarded directory and
    /// every mount below one, but the exempt binds and what is below them.
    points: Vec<CString>,
    /// The guarded directories.
    dirs: Vec<CString>,
    /// Root's trees bound onto themselves here, unbound at the lift.
    exempt: Vec<CString>,
    /// Each guarded directory is a bind of its own here, flagged when made ([`bind_guard`]).
    binds: bool,
    /// Whether the flag is on ([`Guard::arm`] ran, or the binds were made).
    armed: std::cell::Cell<bool>,
}

/// The mounts of this process, topmost last: mount ID and mount point.
fn mount_table() -> Vec<(u64, PathBuf)> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let id = f.next()?.parse().ok()?;
            Some((id, PathBuf::from(unescape(f.nth(3)?))))
        })
        .collect()
}

/// The ID of the mount `path` is on.
fn mount_id(path: &CString) -> io::Result<u64> {
    // SAFETY: statx fills the zeroed struct on this stack from a NUL-terminated path.
    unsafe {
        let mut st: libc::statx = std::mem::zeroed();
        if libc::statx(
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_MNT_ID,
            &mut st,
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
        Ok(st.stx_mnt_id)
    }
}

/// Readies the guard of `dirs` in a mount namespace of this process's own (the node's mounts as
/// slaves) without arming it: finds the mounts to flag and binds each of `exempt` on one of
/// them onto itself. None for no directories.
pub(super) fn prepare(dirs: &[PathBuf], exempt: &[PathBuf]) -> Result<Option<Guard>, String> {
    if dirs.is_empty() {
        return Ok(None);
    }
    own_namespace()?;
    let table = mount_table();
    let point_of = |id: u64| table.iter().rev().find(|(i, _)| *i == id).map(|(_, p)| p);
    let mut points: Vec<PathBuf> = Vec::new();
    for d in dirs {
        let c = c_path(d).map_err(|e| format!("{}: {e}", d.display()))?;
        let id = mount_id(&c).map_err(|e| format!("cannot guard {}: {e}", d.display()))?;
        let point = point_of(id).ok_or_else(|| {
            format!(
                "cannot guard {}: its mount {id} is not in this namespace",
                d.display()
            )
        })?;
        points.push(point.clone());
        points.extend(
            table
                .iter()
                .filter(|(_, p)| p.starts_with(d) && p != d)
                .map(|(_, p)| p.clone()),
        );
    }
    let mut bound = Vec::new();
    for e in exempt {
        let Ok(c) = c_path(e) else { continue };
        let on_guarded = mount_id(&c)
            .ok()
            .and_then(point_of)
            .is_some_and(|p| points.contains(p));
        if on_guarded || dirs.iter().any(|d| e.starts_with(d)) {
            bound.push(bind_onto_itself(e)?);
        }
    }
    points.retain(|p| !exempt.iter().any(|e| p.starts_with(e)));
    points.sort();
    points.dedup();
    let cs = |v: &[PathBuf]| -> Result<Vec<CString>, String> {
        v.iter()
            .map(|p| c_path(p).map_err(|e| e.to_string()))
            .collect()
    };
    Ok(Some(Guard {
        points: cs(&points)?,
        dirs: cs(dirs)?,
        exempt: bound,
        binds: false,
        armed: std::cell::Cell::new(false),
    }))
}

/// The guard of a command line restore or a sandboxed part's: in a mount namespace of this process's own, each of
/// `dirs` bound onto itself, recursively, without following links; then each of `exempt`
/// below one of them bound onto itself following links again. Armed at once; the restored job
/// keeps the binds. None for no directories.
pub(super) fn bind_guard(dirs: &[PathBuf], exempt: &[PathBuf]) -> Result<Option<Guard>, String> {
    if dirs.is_empty() {
        return Ok(None);
    }
    own_namespace()?;
    let mut bound = Vec::new();
    for d in dirs {
        let c = bind_onto_itself(d)?;
        set_nosymfollow(&c, true, true)
            .map_err(|e| format!("cannot guard {} against links: {e}", d.display()))?;
        bound.push(c);
    }
    for e in exempt
        .iter()
        .filter(|e| dirs.iter().any(|d| e.starts_with(d)))
    {
        let c = bind_onto_itself(e)?;
        set_nosymfollow(&c, false, true).map_err(|err| format!("{}: {err}", e.display()))?;
    }
    Ok(Some(Guard {
        points: Vec::new(),
        dirs: bound,
        exempt: Vec::new(),
        binds: true,
        armed: std::cell::Cell::new(true),
    }))
}

impl Guard {
    /// Stops the following of links on the guarded mounts, in this namespace (the engine
    /// runs).
    pub(super) fn arm(&self) -> Result<(), String> {
        for p in &self.points {
            set_nosymfollow(p, true, false)
                .map_err(|e| format!("cannot guard the mount at {p:?} against links: {e}"))?;
        }
        self.armed.set(true);
        Ok(())
    }

    /// Lets the guarded mounts follow links again, in this namespace, once the engine made
    /// every file of the job (its "post-restore" stage) and before it lets the processes run:
    /// a process that ran under the flag could not load a library through a link
    /// (`libibverbs.so.1`). The binds of [`bind_guard`] are lifted by [`Guard::lift`] only.
    pub(super) fn disarm(&self) -> Result<(), String> {
        for p in &self.points {
            set_nosymfollow(p, false, false).map_err(|e| format!("{p:?}: {e}"))?;
        }
        Ok(())
    }

    /// Whether the flag went on: a restore that ends without it was not guarded.
    pub(super) fn armed(&self) -> bool {
        self.armed.get()
    }

    /// Lifts the guard for the processes restored under it (the restored root is `root`):
    /// their mounts follow links again. Here, where the root shares this namespace, its view is
    /// then the node's again (the exempt binds unbound); in a sandbox's namespace the engine
    /// made, every mount there is cleared, by a child that enters it.
    pub(super) fn lift(&self, root: i32) -> Result<(), String> {
        let ns = |p: &str| std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
        let theirs = format!("/proc/{root}/ns/mnt");
        let shared = ns("/proc/self/ns/mnt").ok() == ns(&theirs).ok();
        if !shared {
            // Clones made while the flag was on carry it: the sandbox's mounts, all of them.
            let dirs = &self.dirs;
            in_namespace_of(root, "lifting the guard", || {
                // Where no guard reached in that namespace, there is nothing to lift.
                let _ = set_nosymfollow(&CString::from(c"/"), false, true);
                for d in dirs {
                    let _ = set_nosymfollow(d, false, true);
                }
                true
            })?;
        }
        if self.binds {
            for d in &self.dirs {
                set_nosymfollow(d, false, true).map_err(|e| format!("{d:?}: {e}"))?;
            }
        }
        for p in &self.points {
            set_nosymfollow(p, false, false).map_err(|e| format!("{p:?}: {e}"))?;
        }
        for e in &self.exempt {
            // SAFETY: umount2 on a NUL-terminated path; the bind is this namespace's alone.
            if unsafe { libc::umount2(e.as_ptr(), libc::MNT_DETACH) } != 0 {
                return Err(format!(
                    "cannot unbind {e:?}: {}",
                    io::Error::last_os_error()
                ));
            }
        }
        Ok(())
    }
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
        .map(|field| PathBuf::from(crate::os::sandbox::mounts::unescape(field)))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mount_table_names_the_root_and_finds_this_processs_mounts() {
        let table = mount_table();
        assert!(table.iter().any(|(_, p)| p == Path::new("/")), "{table:?}");
        let root = mount_id(&CString::from(c"/")).unwrap();
        assert!(
            table.iter().any(|(id, _)| *id == root),
            "{root} in {table:?}"
        );
    }
}
