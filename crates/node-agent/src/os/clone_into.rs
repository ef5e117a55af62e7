//! Starting a program born in a cgroup (`clone3` with `CLONE_INTO_CGROUP`, Linux 5.7, cgroup
//! v2), for the shim's engine restore.
//!
//! A child that joins its cgroup by writing `cgroup.procs` migrates: the kernel takes the
//! cgroup subsystem's thread-group lock for writing, which waits for an RCU grace period when
//! no migration happened just before; on the test machines that was 7–16 ms of every restart.
//! A child created in the cgroup takes that lock only for reading. Where the kernel cannot
//! (no `clone3`, a cgroup v1 hierarchy), [`spawn`] says so and the caller joins the usual way.
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

/// `CLONE_INTO_CGROUP` (include/uapi/linux/sched.h).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// `struct clone_args` up to `cgroup` (CLONE_ARGS_SIZE_VER2, 88 bytes).
#[repr(C)]
#[derive(Debug, Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// What the child is given.
#[derive(Debug)]
pub struct Child<'a> {
    /// Program (a path, or a name looked up in `PATH`) and its arguments.
    pub argv: &'a [String],
    /// Added to the shim's own environment.
    pub env: Vec<(&'a str, &'a OsStr)>,
    /// Its standard output and error; standard input is `/dev/null`.
    pub stdout: &'a File,
    /// See `stdout`.
    pub stderr: &'a File,
    /// Descriptors the child gets, each (descriptor, as number): the engine's inherited
    /// network namespace, its end of a socket pair. The numbers must not be among the
    /// descriptors passed after them.
    pub pass: &'a [(RawFd, RawFd)],
}

/// Starts `child` in the cgroup directory `cgroup` (v2) and returns its PID, once it has
/// executed the program. `Ok(None)`: this kernel or hierarchy cannot create a child in a cgroup
/// (or the program is not found, which the caller's own spawn reports); nothing was started.
///
/// The calling process must be single-threaded (the shim is): the child is a copy of it that
/// makes only async-signal-safe calls before it executes the program.
pub fn spawn(cgroup: &Path, child: &Child<'_>) -> io::Result<Option<i32>> {
    let (prog, _) = child
        .argv
        .split_first()
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let Some(path) = find_program(prog) else {
        return Ok(None);
    };
    let c = |b: &[u8]| CString::new(b).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
    let path = c(path.as_os_str().as_bytes())?;
    let argv = child
        .argv
        .iter()
        .map(|a| c(a.as_bytes()))
        .collect::<io::Result<Vec<_>>>()?;
    let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(k, _)| !child.env.iter().any(|(name, _)| OsStr::new(name) == k))
        .collect();
    env.extend(
        child
            .env
            .iter()
            .map(|(k, v)| (OsString::from(k), v.to_os_string())),
    );
    let envp = env
        .into_iter()
        .map(|(k, v)| {
            let mut kv = k.into_vec();
            kv.push(b'=');
            kv.extend(v.into_vec());
            c(&kv)
        })
        .collect::<io::Result<Vec<_>>>()?;
    let argv_p: Vec<*const libc::c_char> = argv
        .iter()
        .map(|a| a.as_ptr())
        .chain([std::ptr::null()])
        .collect();
    let envp_p: Vec<*const libc::c_char> = envp
        .iter()
        .map(|a| a.as_ptr())
        .chain([std::ptr::null()])
        .collect();
    let dir = File::open(cgroup)?;
    let null = File::open("/dev/null")?;
    let (err_r, err_w) = pipe_cloexec()?;
    // Above the numbers descriptors are passed as, which would otherwise close it first.
    let err_w = high(err_w)?;
    let args = CloneArgs {
        flags: CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: dir.as_raw_fd() as u64,
        ..CloneArgs::default()
    };
    let fds = (
        null.as_raw_fd(),
        child.stdout.as_raw_fd(),
        child.stderr.as_raw_fd(),
        err_w.as_raw_fd(),
    );
    // SAFETY: clone3 with no stack of its own behaves as fork: the child runs on a copy of
    // this (single-threaded) process's memory. It only calls async-signal-safe functions on
    // memory prepared above, and leaves by execve or _exit.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if pid < 0 {
        // ENOSYS, EBADF (not a v2 cgroup), EOPNOTSUPP, ...: the caller joins instead.
        return Ok(None);
    }
    if pid == 0 {
        exec_child(&path, &argv_p, &envp_p, fds, child.pass);
    }
    drop(err_w);
    let mut errno = [0u8; 4];
    let n = loop {
        // SAFETY: reads at most 4 bytes into a 4-byte buffer.
        let n = unsafe { libc::read(err_r.as_raw_fd(), errno.as_mut_ptr().cast(), errno.len()) };
        if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            break n;
        }
    };
    if n == 4 {
        let mut status = 0;
        // SAFETY: reaps the child that failed to execute.
        unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        return Err(io::Error::from_raw_os_error(i32::from_ne_bytes(errno)));
    }
    Ok(Some(pid as i32))
}

/// The child's side: standard descriptors, the passed descriptors, then the program. Only
/// async-signal-safe calls; a failure's errno goes back through `err`. Call it only in the
/// child of [`spawn`]'s clone.
fn exec_child(
    path: &CString,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    (null, stdout, stderr, err): (RawFd, RawFd, RawFd, RawFd),
    pass: &[(RawFd, RawFd)],
) -> ! {
    // SAFETY: system calls on descriptor numbers and on NUL-terminated strings and
    // NULL-terminated pointer arrays that live in this copy of the parent's memory.
    unsafe {
        // As std's spawn does: the Rust runtime ignores SIGPIPE, which exec would keep.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        let ok = libc::dup2(null, 0) >= 0
            && libc::dup2(stdout, 1) >= 0
            && libc::dup2(stderr, 2) >= 0
            // Nothing else the shim holds reaches the program.
            && cloexec_from_3().is_ok()
            && pass.iter().all(|&(fd, to)| pass_fd(fd, to).is_ok());
        if ok {
            libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr());
        }
        let errno = *libc::__errno_location();
        libc::write(err, errno.to_ne_bytes().as_ptr().cast(), 4);
        libc::_exit(127)
    }
}

/// Marks every descriptor from 3 up close-on-exec. Async-signal-safe: for a child between
/// fork and exec.
pub(crate) fn cloexec_from_3() -> io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range with the CLOEXEC flag only changes descriptor flags.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Gives descriptor `fd` to the program about to be executed as number `to`. Async-signal-safe:
/// for a child between fork and exec.
pub(crate) fn pass_fd(fd: RawFd, to: RawFd) -> io::Result<()> {
    // dup2 clears close-on-exec on the copy, but does nothing when the descriptor already has
    // the number.
    // SAFETY: fcntl and dup2 on descriptor numbers.
    let rc = unsafe {
        if fd == to {
            libc::fcntl(fd, libc::F_SETFD, 0)
        } else {
            libc::dup2(fd, to)
        }
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `prog` itself if it names a path, else the first executable `PATH` entry of that name.
fn find_program(prog: &str) -> Option<PathBuf> {
    if prog.contains('/') {
        return Some(PathBuf::from(prog));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| {
            CString::new(p.as_os_str().as_bytes())
                // SAFETY: a valid NUL-terminated path.
                .is_ok_and(|c| unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0)
        })
}

/// The descriptor moved to a number from [`HIGH_FD`] up (close-on-exec).
pub(crate) fn high(fd: OwnedFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl on a descriptor this function owns.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, HIGH_FD) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor fcntl just returned, owned by nothing else; `fd` closes on return.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// Descriptors a child is given at fixed numbers stay below this.
pub(crate) const HIGH_FD: RawFd = 100;

/// A pipe whose ends are closed on exec.
pub(crate) fn pipe_cloexec() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two-element array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just opened and are owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh cgroup under the v2 root, or why there is none.
    fn test_cgroup() -> Result<PathBuf, String> {
        let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .into_iter()
            .map(Path::new)
            .find(|r| r.join("cgroup.procs").exists() && r.join("cgroup.subtree_control").exists())
            .ok_or("no cgroup v2 hierarchy")?;
        let dir = root.join(format!("ckpt-clone-into-test-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        Ok(dir)
    }

    fn wait(pid: i32) -> i32 {
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        status
    }

    #[test]
    fn a_child_is_born_in_the_cgroup_with_its_descriptors_and_environment() {
        let cgroup = match test_cgroup() {
            Ok(d) => d,
            Err(why) => {
                println!("SKIPPED: {why} (needs root and cgroup v2)");
                return;
            }
        };
        let d = tempfile::tempdir().unwrap();
        let out = File::create(d.path().join("out")).unwrap();
        let passed = File::open("/dev/null").unwrap();
        let argv: Vec<String> = [
            "sh",
            "-c",
            "cat /proc/self/cgroup; echo \"env=$CKPT_CLONE_TEST\"; ls /proc/self/fd; \
             grep SigIgn /proc/self/status",
        ]
        .map(String::from)
        .to_vec();
        let child = Child {
            argv: &argv,
            env: vec![("CKPT_CLONE_TEST", OsStr::new("yes"))],
            stdout: &out,
            stderr: &out,
            pass: &[(passed.as_raw_fd(), 7)],
        };
        let spawned = spawn(&cgroup, &child);
        let Ok(Some(pid)) = spawned else {
            let _ = std::fs::remove_dir(&cgroup);
            println!("SKIPPED: this kernel cannot start a child in a cgroup: {spawned:?}");
            return;
        };
        assert_eq!(wait(pid), 0);
        let _ = std::fs::remove_dir(&cgroup);
        let text = std::fs::read_to_string(d.path().join("out")).unwrap();
        let name = cgroup.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            text.lines()
                .any(|l| l.starts_with("0::") && l.ends_with(&name)),
            "born in {name}: {text}"
        );
        assert!(text.contains("env=yes"), "{text}");
        let ignored = text
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .expect("SigIgn");
        assert_eq!(
            ignored & (1 << (libc::SIGPIPE - 1)),
            0,
            "SIGPIPE is not ignored"
        );
        let fds: Vec<&str> = text.lines().filter(|l| l.parse::<u32>().is_ok()).collect();
        assert!(fds.contains(&"7"), "the passed descriptor is 7: {text}");
        assert!(
            fds.iter().all(|f| ["0", "1", "2", "3", "7"].contains(f)),
            "nothing else leaks (3 is ls's own directory): {fds:?}"
        );

        // A program that cannot be executed is reported, and nothing keeps running.
        let cgroup = test_cgroup().unwrap();
        let argv = vec!["/nonexistent/ckpt-program".to_string()];
        let r = spawn(
            &cgroup,
            &Child {
                argv: &argv,
                env: Vec::new(),
                stdout: &out,
                stderr: &out,
                pass: &[],
            },
        );
        let _ = std::fs::remove_dir(&cgroup);
        assert_eq!(
            r.map_err(|e| e.kind()).unwrap_err(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn programs_are_found_by_path_or_name() {
        assert_eq!(find_program("/x/y"), Some(PathBuf::from("/x/y")));
        assert!(find_program("sh").is_some_and(|p| p.is_absolute()));
        assert_eq!(find_program("no-such-program-ckpt"), None);
    }
}
