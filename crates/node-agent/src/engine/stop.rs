//! An engine's dump in progress that another step may end: the abort of its epoch (a deadline
//! passed on some node) and a cancel of the job. A dump runs holding its job's lock, so
//! nothing that waits for that lock could end it: a dump that hangs (CRIU seizing a stopped
//! process inside a frozen cgroup waits for ever) kept the job frozen for ever and every call
//! on the job waiting. The stop is reached without the job's lock ([`crate::jobs::Jobs`] keeps
//! one per job beside it). A dump told to stop is not killed while it makes progress: killed
//! half-way, CRIU leaves the job's TCP sockets in repair mode (its connections then fail) and
//! its code in the processes; one that stops progressing (its log and images stop growing for
//! a while, [`EngineStop::wait`]) is hung, and its process group is killed. The dump then
//! returns an error, releasing the lock for the abort's thaw.

use std::process::{Child, ExitStatus};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// What runs for one job now, and whether it was told to stop.
#[derive(Debug, Default)]
struct State {
    /// The epoch whose dump runs; None: no dump.
    epoch: Option<u32>,
    /// The engine's process group, once it has started.
    group: Option<i32>,
    /// The running dump was told to stop.
    stopped: bool,
}

/// One job's dump in progress, stoppable without the job's lock.
#[derive(Debug, Default)]
pub struct EngineStop {
    state: Mutex<State>,
    changed: Condvar,
}

impl EngineStop {
    /// A dump of `epoch` begins; what a stop said to an earlier one is forgotten.
    pub fn begin(&self, epoch: u32) {
        let mut s = self.state.lock().expect("engine stop lock");
        *s = State {
            epoch: Some(epoch),
            group: None,
            stopped: false,
        };
    }

    /// The engine started as process group `group`. False: the dump was stopped before the
    /// engine started, and the caller kills it now (this call has already).
    pub fn started(&self, group: i32) -> bool {
        let mut s = self.state.lock().expect("engine stop lock");
        if s.stopped {
            kill_group(group);
            return false;
        }
        s.group = Some(group);
        true
    }

    /// The dump ended (its engine has exited).
    pub fn end(&self) {
        let mut s = self.state.lock().expect("engine stop lock");
        *s = State::default();
        self.changed.notify_all();
    }

    /// Tells the dump of `epoch` (of any epoch: None) to stop, if one runs: an engine that has
    /// not started yet is killed as it starts; one that runs is killed by [`EngineStop::wait`]
    /// once it makes no progress. Returns whether a dump was running.
    pub fn stop(&self, epoch: Option<u32>) -> bool {
        let mut s = self.state.lock().expect("engine stop lock");
        let running = s.epoch.is_some_and(|e| epoch.is_none_or(|want| want == e));
        if !running {
            return false;
        }
        s.stopped = true;
        self.changed.notify_all();
        true
    }

    /// Waits for `child`, the engine (the leader of its process group). Once the dump is told
    /// to stop, `progress` (a number that grows while the engine works: the bytes of its log
    /// and images) is watched, and the group is killed when it has not changed for `stall`.
    pub fn wait(
        &self,
        child: &mut Child,
        progress: impl Fn() -> u64,
        stall: Duration,
    ) -> std::io::Result<ExitStatus> {
        let mut seen: Option<(u64, Instant)> = None;
        let mut killed = false;
        // The engine's end is seen at once (its pidfd turns readable), not at the next tick: the
        // job is frozen until then.
        let exited = pidfd(child.id());
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if self.stopped() && !killed {
                let now = progress();
                match seen {
                    Some((last, since)) if last == now => {
                        if since.elapsed() >= stall {
                            kill_group(child.id() as i32);
                            killed = true;
                        }
                    }
                    _ => seen = Some((now, Instant::now())),
                }
            }
            wait_readable(exited.as_ref(), Duration::from_millis(50));
        }
    }

    /// Whether the running dump was told to stop.
    pub fn stopped(&self) -> bool {
        self.state.lock().expect("engine stop lock").stopped
    }

    /// Waits up to `limit` for a stop (for engines that wait on something else than a
    /// process, and tests). Returns whether the dump was stopped.
    pub fn wait_stopped(&self, limit: Duration) -> bool {
        let s = self.state.lock().expect("engine stop lock");
        let (s, _) = self
            .changed
            .wait_timeout_while(s, limit, |s| !s.stopped)
            .expect("engine stop lock");
        s.stopped
    }
}

/// SIGKILL to every process of `group` (the engine and the helpers it forked).
fn kill_group(group: i32) {
    if group > 1 {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory is passed.
        unsafe {
            libc::kill(-group, libc::SIGKILL);
        }
    }
}

/// A pidfd of process `pid` (None where the kernel has none).
fn pidfd(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open returns a new descriptor this function owns, or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
    // SAFETY: `fd` is a descriptor just opened, owned by nothing else.
    (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Waits up to `limit` for `fd` to turn readable (a pidfd: its process ended); sleeps `limit`
/// without one.
fn wait_readable(fd: Option<&std::os::fd::OwnedFd>, limit: Duration) {
    use std::os::fd::AsRawFd;
    match fd {
        Some(fd) => {
            let mut p = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one pollfd on this stack.
            unsafe { libc::poll(&mut p, 1, limit.as_millis() as libc::c_int) };
        }
        None => std::thread::sleep(limit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::sync::Arc;

    /// A stopped engine that makes no progress (as one that hangs) is killed with its
    /// children once it has not progressed for the stall; an abort of another epoch stops
    /// nothing.
    #[test]
    fn a_stopped_engine_that_makes_no_progress_is_killed_with_its_children() {
        let stop = EngineStop::default();
        assert!(!stop.stop(None), "nothing runs");
        stop.begin(3);
        // A shell that starts a child and waits: both must go.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 600 & wait"])
            .process_group(0)
            .spawn()
            .expect("sh");
        assert!(stop.started(child.id() as i32));
        assert!(!stop.stop(Some(2)), "another epoch's abort stops nothing");
        assert!(!stop.stopped());
        assert!(stop.stop(Some(3)));
        let status = stop
            .wait(&mut child, || 7, Duration::from_millis(300))
            .expect("wait");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        // The group's other member is gone too.
        let begin = std::time::Instant::now();
        // SAFETY: signal 0 only checks that the group exists.
        while unsafe { libc::kill(-(child.id() as i32), 0) } == 0 {
            assert!(
                begin.elapsed() < Duration::from_secs(5),
                "the sleep survived"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(stop.stopped());
        stop.end();
        assert!(!stop.stopped());
    }

    /// A stopped engine that still makes progress is left to finish: killed half-way, a dump
    /// leaves the job's sockets in repair mode.
    #[test]
    fn a_stopped_engine_that_makes_progress_finishes() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        let stop = EngineStop::default();
        stop.begin(1);
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "for i in 1 2 3 4 5 6 7 8; do echo step >> {}; sleep 0.1; done",
                log.display()
            ))
            .process_group(0)
            .spawn()
            .expect("sh");
        assert!(stop.started(child.id() as i32));
        assert!(stop.stop(None));
        let progress = || std::fs::metadata(&log).map_or(0, |m| m.len());
        let status = stop
            .wait(&mut child, progress, Duration::from_millis(500))
            .expect("wait");
        assert!(status.success(), "not killed: {status:?}");
        assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 8);
    }

    #[test]
    fn a_stop_before_the_engine_starts_kills_it_as_it_starts() {
        let stop = Arc::new(EngineStop::default());
        stop.begin(1);
        assert!(stop.stop(None));
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .expect("sleep");
        assert!(!stop.started(child.id() as i32));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.wait().expect("wait").signal(), Some(libc::SIGKILL));
        let waiter = {
            let stop = stop.clone();
            std::thread::spawn(move || stop.wait_stopped(Duration::from_secs(5)))
        };
        assert!(waiter.join().expect("waiter"));
    }
}
