//! `ckpt-init`: process 1 of a job part's sandbox (its own PID, IPC and UTS namespaces).
//!
//! The agent's shim starts it as the first process of a fresh PID namespace, already in the
//! job's cgroup and identity; it starts the part's command as its only child and then does what
//! an init must: it reaps every orphan the namespace re-parents to it, passes the signals a user
//! or batch system sends (TERM, INT, HUP, QUIT, USR1, USR2, CONT, WINCH, ALRM) on to the
//! command, and exits with the command's status (128+N when a signal N ended it) once the
//! command is gone, which ends the namespace. A process 1 without a handler ignores such
//! signals from outside, so the command itself could not be process 1.
//!
//! It is checkpointed and restored with the job like any of its processes: it keeps no state
//! besides the command's PID, which the restore gives back unchanged inside the namespace.
use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStringExt;

/// Signals passed on to the command.
const FORWARDED: [libc::c_int; 9] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGCONT,
    libc::SIGWINCH,
    libc::SIGALRM,
];

fn fail(what: &str) -> ! {
    eprintln!("ckpt-init: {what}: {}", std::io::Error::last_os_error());
    std::process::exit(127);
}

fn main() {
    let args: Vec<CString> = std::env::args_os()
        .skip(1)
        .map(|a: OsString| CString::new(a.into_vec()).unwrap_or_default())
        .collect();
    if args.is_empty() {
        eprintln!(
            "usage: ckpt-init COMMAND [ARGS...]\n\nProcess 1 of a ckpt job sandbox: starts COMMAND, reaps orphans, forwards signals, \
             and exits with COMMAND's status. The agent starts it; there is no reason to run it by hand."
        );
        std::process::exit(2);
    }
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // SAFETY: sigset operations on a local set; sigprocmask on this single-threaded process.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        for s in FORWARDED {
            libc::sigaddset(&mut set, s);
        }
        if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            fail("sigprocmask");
        }
        set
    };
    // SAFETY: fork in a single-threaded process; the child only restores its signal mask and
    // execs (or exits).
    let child = unsafe { libc::fork() };
    if child < 0 {
        fail("fork");
    }
    if child == 0 {
        // SAFETY: async-signal-safe calls on memory prepared before the fork.
        unsafe {
            libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::execvp(argv[0], argv.as_ptr());
            let msg = b"ckpt-init: cannot run the command\n";
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::_exit(127);
        }
    }
    loop {
        // SAFETY: sigwaitinfo writes into a local siginfo.
        let sig = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::sigwaitinfo(&set, &mut info)
        };
        if sig < 0 {
            continue; // EINTR (e.g. after a restore)
        }
        if sig != libc::SIGCHLD {
            // SAFETY: kill with a PID this process started.
            unsafe { libc::kill(child, sig) };
            continue;
        }
        loop {
            let mut status = 0;
            // SAFETY: waitpid writes into a local int.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if pid == child {
                let code = if libc::WIFSIGNALED(status) {
                    128 + libc::WTERMSIG(status)
                } else {
                    libc::WEXITSTATUS(status)
                };
                std::process::exit(code);
            }
        }
    }
}
