//! The gate every call on a shadow object passes: open, it costs two atomic operations; closed
//! (from the start of a quiesce to the end of the rebuild that follows), the caller waits,
//! and the program never sees the checkpoint.
//!
//! The layer's own work around a snapshot (drain, release, rebuild, reconnect) runs, when it
//! can, in a program thread waiting at the closed gate, like ib-quiesce's channels do: the
//! kernel lets only a thread with the opener's credentials write to a verbs device file, a
//! restored process's threads each have credentials of their own, and soft-RoCE rings its
//! doorbell with such a write. So the thread that opens the device must be the one that posts:
//! the gate hands the work to the thread that opened the device (the program's thread that
//! called `ibv_open_device`, then the one that rebuilt), and does it in the control thread only
//! when that thread does not come to the gate within a second (it is computing).
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::shadow::lock;

/// Work handed to a program thread.
type Task = Box<dyn FnOnce() + Send>;

/// How long the control thread waits for the opening thread to take its work.
const PICKUP: Duration = Duration::from_secs(1);

/// The gate (one per process: every shadow object belongs to it).
#[derive(Debug, Default)]
pub struct Gate {
    closed: AtomicBool,
    inflight: AtomicUsize,
    opener: AtomicI32,
    task: Mutex<Option<TaskSlot>>,
    wake: Condvar,
}

/// A task, with no `Debug` of its own.
struct TaskSlot(Task);

impl std::fmt::Debug for TaskSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TaskSlot")
    }
}

/// Held while a call is inside the gate.
#[derive(Debug)]
pub struct Pass<'a>(&'a Gate);

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, SeqCst);
    }
}

/// The calling thread's id.
pub fn tid() -> i32 {
    // SAFETY: plain system call.
    unsafe { libc::gettid() }
}

/// The process's gate.
pub fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(Gate::default)
}

impl Gate {
    /// Enters (waiting while closed, and doing the layer's work if it is this thread's).
    #[inline]
    pub fn enter(&self) -> Pass<'_> {
        loop {
            self.inflight.fetch_add(1, SeqCst);
            if !self.closed.load(SeqCst) {
                return Pass(self);
            }
            self.inflight.fetch_sub(1, SeqCst);
            self.wait();
        }
    }

    /// Whether the gate is closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(SeqCst)
    }

    /// Notes the thread that opened the device: the layer's work is handed to it.
    pub fn set_opener(&self, tid: i32) {
        self.opener.store(tid, SeqCst);
    }

    #[cold]
    fn wait(&self) {
        let me = tid();
        let mut slot = lock(&self.task);
        while self.closed.load(SeqCst) {
            let opener = self.opener.load(SeqCst);
            if slot.is_some() && (opener == 0 || opener == me) {
                let TaskSlot(task) = slot.take().expect("checked");
                drop(slot);
                task();
                slot = lock(&self.task);
                continue;
            }
            // Timed: a wake-up lost to a race costs 100 ms, never a hang.
            slot = self
                .wake
                .wait_timeout(slot, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Closes the gate and waits until no call is inside it (at most `timeout`; then it opens
    /// again and says why).
    pub fn close(&self, timeout: Duration) -> Result<(), String> {
        self.closed.store(true, SeqCst);
        let begin = Instant::now();
        while self.inflight.load(SeqCst) > 0 {
            if begin.elapsed() > timeout {
                self.open();
                return Err(format!(
                    "a verbs call of the program did not return within {timeout:?}"
                ));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    /// Opens the gate: waiting calls go on.
    pub fn open(&self) {
        let _slot = lock(&self.task);
        self.closed.store(false, SeqCst);
        self.wake.notify_all();
    }

    /// Runs `f` (with the gate closed) in the opening thread when it waits at the gate, or
    /// here when it does not come within [`PICKUP`]. The thread that ran it becomes the
    /// opener when `opens` (it opened the device again).
    pub fn run<R: Send + 'static>(
        &'static self,
        opens: bool,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        let task: Task = Box::new(move || {
            if opens {
                self.set_opener(tid());
            }
            let _ = tx.send(f());
        });
        *lock(&self.task) = Some(TaskSlot(task));
        self.wake.notify_all();
        match rx.recv_timeout(PICKUP) {
            Ok(r) => r,
            Err(_) => {
                let mine = lock(&self.task).take();
                if let Some(TaskSlot(task)) = mine {
                    task();
                }
                rx.recv().expect("a taken task always answers")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_closed_gate_holds_callers_and_hands_the_work_to_the_opener() {
        let g: &'static Gate = Box::leak(Box::default());
        let passed = Arc::new(AtomicUsize::new(0));
        let caller = {
            let passed = passed.clone();
            std::thread::spawn(move || {
                g.set_opener(tid());
                let me = tid();
                for _ in 0..200 {
                    let _p = g.enter();
                    passed.fetch_add(1, SeqCst);
                    std::thread::sleep(Duration::from_millis(1));
                }
                me
            })
        };
        while passed.load(SeqCst) < 5 {
            std::thread::sleep(Duration::from_millis(1));
        }
        g.close(Duration::from_secs(5))
            .expect("the caller leaves the gate");
        let before = passed.load(SeqCst);
        // The work runs in the caller (the opener), which waits at the gate.
        let ran_in = g.run(false, tid);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(passed.load(SeqCst), before, "nothing passed a closed gate");
        g.open();
        let caller_tid = caller.join().expect("caller");
        assert_eq!(ran_in, caller_tid, "the opener did the work");
        assert_eq!(passed.load(SeqCst), 200);
    }

    #[test]
    fn work_nobody_takes_runs_in_the_control_thread() {
        let g: &'static Gate = Box::leak(Box::default());
        g.set_opener(-7);
        g.close(Duration::from_secs(1)).expect("nobody inside");
        assert_eq!(g.run(true, tid), tid());
        g.open();
        assert_eq!(
            g.opener.load(SeqCst),
            tid(),
            "an opening task moves the opener"
        );
    }
}
