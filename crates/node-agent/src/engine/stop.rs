//! An engine's dump in progress that another step may end: the abort of its epoch (a deadline
//! passed on some node) and a cancel of the job. A dump runs holding its job's lock, so
//! nothing that waits for that lock could end it: a dump that hangs (CRIU seizing a stopped
//! process inside a frozen cgroup waits for ever) kept the job frozen for ever and every call
//! on the job waiting. The stop is reached without the job's lock ([`crate::jobs::Jobs`] keeps
//! one per job beside it); it kills the engine's process group, and the dump then returns an
//! error at once, releasing the lock for the abort's thaw.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

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

    /// Stops the dump of `epoch` (of any epoch: None) if one runs: its engine's process group
    /// is killed, and a dump whose engine has not started yet never starts it. Returns whether
    /// a dump was running.
    pub fn stop(&self, epoch: Option<u32>) -> bool {
        let mut s = self.state.lock().expect("engine stop lock");
        let running = s.epoch.is_some_and(|e| epoch.is_none_or(|want| want == e));
        if !running {
            return false;
        }
        s.stopped = true;
        if let Some(g) = s.group {
            kill_group(g);
        }
        self.changed.notify_all();
        true
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::sync::Arc;

    #[test]
    fn a_stop_kills_the_running_engine_and_its_children_and_only_that_epoch() {
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
        let status = child.wait().expect("wait");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        // The group's other member is gone too (its parent was the shell, now reaped: it
        // would be re-parented, and kill(-group, 0) would still find it).
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
