//! The end of the shim's children: waiting for them, and ending what a job's command left
//! running in its cgroup once the command has ended, as a batch job's end does.
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use super::{fence, job_members, Exit};

pub(super) fn decode(status: libc::c_int) -> Exit {
    if libc::WIFSIGNALED(status) {
        Exit {
            signal: Some(libc::WTERMSIG(status)),
            ..Exit::default()
        }
    } else {
        Exit {
            code: Some(libc::WEXITSTATUS(status)),
            ..Exit::default()
        }
    }
}

/// Waits for one specific child.
pub(super) fn wait_pid(pid: i32) -> Exit {
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
                ..Exit::default()
            };
        }
    }
}

/// How long the processes a job's command left running have after SIGTERM before SIGKILL
/// (as Slurm's `KillWait` gives a batch job's, but short: the job's result is in already).
const LEFT_GRACE: Duration = Duration::from_secs(2);
/// How long the shim waits for them after the SIGKILL (a process in uninterruptible sleep, or
/// frozen by a checkpoint that began meanwhile) before it records the job's end anyway.
const LEFT_WAIT: Duration = Duration::from_secs(30);

/// Reaps every child (the root and any orphans re-parented to this subreaper). A job ends with
/// its command, as a batch job does: once the root has ended, what is left of the job in its
/// cgroup (`procs`; a daemon it started, a helper in the background) is ended too
/// ([`end_left`]), and the job's end is the root's status with how many were. Returns once
/// nothing of the job is left (or [`LEFT_WAIT`] after the SIGKILL).
pub(super) fn reap_until_empty(root: i32, procs: &Path) -> Exit {
    let mut exit: Option<Exit> = None;
    let mut ending: Option<Ending> = None;
    loop {
        let mut status = 0;
        let flags = if exit.is_some() { libc::WNOHANG } else { 0 };
        // SAFETY: waitpid writes to a valid local int.
        let rc = unsafe { libc::waitpid(-1, &mut status, flags) };
        if rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if rc == root {
            exit = Some(decode(status));
            ending = Some(Ending::begin(procs));
            continue;
        }
        if rc > 0 {
            continue;
        }
        // ECHILD (no child left) or, after the root, no child ended since the last look.
        let Some(e) = exit.as_mut() else {
            // The root was never our descendant (it vanished before adoption).
            return Exit::default();
        };
        let Some(end) = ending.as_mut() else {
            return *e;
        };
        if !end.go_on(procs) {
            e.ended = end.count;
            return *e;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Ending what a job's command left running: SIGTERM, then SIGKILL after [`LEFT_GRACE`].
struct Ending {
    /// When the SIGTERM went.
    begun: Instant,
    /// How many processes were left when the root ended.
    count: u32,
    /// Whether the SIGKILL went.
    killed: bool,
}

impl Ending {
    /// Sends SIGTERM to every process left in the job's cgroup.
    fn begin(procs: &Path) -> Self {
        let left = job_members(procs);
        for &pid in &left {
            // SAFETY: kill takes integers only.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        Ending {
            begun: Instant::now(),
            count: left.len() as u32,
            killed: false,
        }
    }

    /// Whether any process of the job is left to wait for; SIGKILLs them past the grace.
    fn go_on(&mut self, procs: &Path) -> bool {
        let left = job_members(procs);
        if left.is_empty() {
            return false;
        }
        let waited = self.begun.elapsed();
        if !self.killed && waited >= LEFT_GRACE {
            fence::kill_cgroup(procs);
            self.killed = true;
        }
        waited < LEFT_GRACE + LEFT_WAIT
    }
}

/// Tells the job's owner, on the job's stderr, that processes its command left running were
/// ended with it. The file is in the agent's job directory (root's); never through a link.
pub(super) fn note_ended(stderr: &Path, exit: &Exit) {
    let opened = OpenOptions::new()
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(stderr);
    if let Ok(mut f) = opened {
        let _ = std::io::Write::write_all(
            &mut f,
            format!(
                "ckpt: the job's command ended ({}); {} process(es) it left running were ended with it (a job ends with its command, as a batch job does: run a program that must go on in the foreground)\n",
                Exit { ended: 0, ..*exit }.text(),
                exit.ended
            )
            .as_bytes(),
        );
    }
}
