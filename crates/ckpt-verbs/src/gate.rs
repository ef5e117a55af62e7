//! The gate every call on a shadow object passes: open, it costs a few plain loads and
//! stores; closed (from the start of a quiesce to the end of the rebuild that follows), the
//! caller waits, and the program never sees the checkpoint.
//!
//! The layer's own work around a snapshot (drain, release, rebuild, reconnect) runs, when it
//! can, in a program thread waiting at the closed gate, like ib-quiesce's channels do: the
//! kernel lets only a thread with the opener's credentials write to a verbs device file, a
//! restored process's threads each have credentials of their own, and soft-RoCE rings its
//! doorbell with such a write. So the thread that opens the device must be the one that posts:
//! the gate hands the work to the thread that opened the device (the program's thread that
//! called `ibv_open_device`, then the one that rebuilt), and does it in the control thread only
//! when that thread does not come to the gate within a second (it is computing).
//!
//! A program polls its CQs in a loop, so passing must be cheap: each thread counts its own
//! calls inside in a slot of its own (plain stores, no read-modify-write), and a close looks
//! at every slot. Threads past the slots share one counter. A caller's count must be seen by a
//! close before the caller reads the gate open; the barrier that orders it is the close's
//! where the kernel has private expedited membarriers (a close makes every thread of the
//! process pass a full barrier, so callers need only keep the compiler from reordering), and
//! each caller's fence elsewhere.
use std::cell::Cell;
use std::os::raw::c_int;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{compiler_fence, fence, AtomicBool, AtomicI32, AtomicU32, AtomicUsize};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::shadow::lock;

/// Work handed to a program thread.
type Task = Box<dyn FnOnce() + Send>;

/// How long the control thread waits for the opening thread to take its work.
const PICKUP: Duration = Duration::from_secs(1);

/// Threads with a slot of their own.
const SLOTS: usize = 256;

/// One thread's place at the gate, written by that thread only (a cache line each: threads
/// do not share lines).
#[derive(Debug, Default)]
#[repr(align(64))]
struct Slot {
    /// Its calls at the gate or inside it, which a close waits to see at 0 (more than 1 only
    /// while a signal handler's call interrupts one on its way in or out).
    inside: AtomicU32,
    /// How deep the calls admitted now nest (a signal handler's call in one of them): a
    /// nested call goes in without looking at the gate, since a close waits for the outer one.
    depth: AtomicU32,
}

/// The gate (one per process: every shadow object belongs to it).
#[derive(Debug)]
pub struct Gate {
    closed: AtomicBool,
    /// Whether a close's membarrier orders the callers (else each caller fences).
    asymmetric: AtomicBool,
    /// Per-thread counts of calls inside.
    slots: Box<[Slot]>,
    /// Slots handed out so far (those at and past [`SLOTS`] are not there).
    handed: AtomicUsize,
    /// Calls inside of the threads without a slot.
    inflight: AtomicUsize,
    opener: AtomicI32,
    task: Mutex<Option<TaskSlot>>,
    wake: Condvar,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            closed: AtomicBool::new(false),
            asymmetric: AtomicBool::new(membarrier(MEMBARRIER_REGISTER_PRIVATE_EXPEDITED)),
            slots: (0..SLOTS).map(|_| Slot::default()).collect(),
            handed: AtomicUsize::new(0),
            inflight: AtomicUsize::new(0),
            opener: AtomicI32::new(0),
            task: Mutex::new(None),
            wake: Condvar::new(),
        }
    }
}

/// `membarrier(2)` commands.
const MEMBARRIER_PRIVATE_EXPEDITED: c_int = 1 << 3;
const MEMBARRIER_REGISTER_PRIVATE_EXPEDITED: c_int = 1 << 4;

/// Runs a `membarrier(2)` command; whether it succeeded.
fn membarrier(cmd: c_int) -> bool {
    // SAFETY: plain system call without pointers.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) == 0 }
}

thread_local! {
    /// This thread's slot: (the gate's address, its index there).
    static MY_SLOT: Cell<(usize, usize)> = const { Cell::new((0, usize::MAX)) };
}

/// A task, with no `Debug` of its own.
struct TaskSlot(Task);

impl std::fmt::Debug for TaskSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TaskSlot")
    }
}

/// Held while a call is inside the gate; dropped on the thread that entered (not `Send`).
#[derive(Debug)]
pub struct Pass<'a> {
    gate: &'a Gate,
    how: Admitted<'a>,
    _thread: std::marker::PhantomData<*const ()>,
}

/// How a call went in.
#[derive(Debug)]
enum Admitted<'a> {
    /// The outermost call of a thread with a slot; `inside` was this before it.
    Outer(&'a Slot, u32),
    /// A call nested in an admitted one of the same thread.
    Nested(&'a Slot),
    /// A call of a thread without a slot, counted in the shared counter.
    Shared,
}

impl<'a> Pass<'a> {
    fn new(gate: &'a Gate, how: Admitted<'a>) -> Self {
        Pass {
            gate,
            how,
            _thread: std::marker::PhantomData,
        }
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        match self.how {
            Admitted::Outer(slot, before) => {
                // Out of the nesting first: a signal handler's call between the two stores
                // finds none admitted and goes through the gate.
                slot.depth.store(0, Relaxed);
                compiler_fence(SeqCst);
                slot.inside.store(before, Release);
            }
            Admitted::Nested(slot) => {
                slot.depth.store(slot.depth.load(Relaxed) - 1, Relaxed);
            }
            Admitted::Shared => {
                self.gate.inflight.fetch_sub(1, SeqCst);
            }
        }
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
        let Some(slot) = self.my_slot() else {
            return self.enter_shared();
        };
        let depth = slot.depth.load(Relaxed);
        if depth > 0 {
            slot.depth.store(depth + 1, Relaxed);
            return Pass::new(self, Admitted::Nested(slot));
        }
        // Not 0 only when this call is a signal handler's that interrupted one of this
        // thread's on its way in or out: restored as found.
        let before = slot.inside.load(Relaxed);
        loop {
            // Counted, then the gate read; a close stores, then reads the counts. A barrier
            // on each side between its store and its load (here a fence, or the one the
            // close's membarrier puts in this thread) makes one see the other's store.
            slot.inside.store(before + 1, Relaxed);
            if self.asymmetric.load(Relaxed) {
                compiler_fence(SeqCst);
            } else {
                fence(SeqCst);
            }
            // Acquire: what the rebuild before the last open wrote (the real objects, the
            // tables) is seen by the call.
            if !self.closed.load(Acquire) {
                compiler_fence(SeqCst);
                slot.depth.store(1, Relaxed);
                return Pass::new(self, Admitted::Outer(slot, before));
            }
            slot.inside.store(before, Release);
            self.wait();
        }
    }

    /// This thread's slot (handed out at its first call), or none when all are taken.
    #[inline]
    fn my_slot(&self) -> Option<&Slot> {
        let me = self as *const Gate as usize;
        let (gate, index) = MY_SLOT.with(Cell::get);
        let index = if gate == me {
            index
        } else {
            let i = self.handed.fetch_add(1, Relaxed);
            MY_SLOT.with(|c| c.set((me, i)));
            i
        };
        self.slots.get(index)
    }

    #[cold]
    fn enter_shared(&self) -> Pass<'_> {
        loop {
            self.inflight.fetch_add(1, SeqCst);
            if !self.closed.load(SeqCst) {
                return Pass::new(self, Admitted::Shared);
            }
            self.inflight.fetch_sub(1, SeqCst);
            self.wait();
        }
    }

    /// Calls inside the gate now, over every thread.
    fn inside(&self) -> usize {
        let handed = self.handed.load(Relaxed).min(SLOTS);
        self.inflight.load(SeqCst)
            + self.slots[..handed]
                .iter()
                .map(|s| s.inside.load(SeqCst) as usize)
                .sum::<usize>()
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
        self.barrier_for_callers();
        let begin = Instant::now();
        while self.inside() > 0 {
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

    /// Makes every caller's count stored before it read the gate visible here, once the
    /// gate is stored closed.
    fn barrier_for_callers(&self) {
        fence(SeqCst);
        if !self.asymmetric.load(SeqCst)
            || membarrier(MEMBARRIER_PRIVATE_EXPEDITED)
            // A restored process is not registered (the kernel's registration is not part
            // of an image): again.
            || (membarrier(MEMBARRIER_REGISTER_PRIVATE_EXPEDITED)
                && membarrier(MEMBARRIER_PRIVATE_EXPEDITED))
        {
            return;
        }
        // Restored where the call is refused: callers fence from now on, and those that
        // passed without have long made their counts visible (a store waits in a CPU's
        // buffer for nanoseconds).
        self.asymmetric.store(false, SeqCst);
        fence(SeqCst);
        std::thread::sleep(Duration::from_millis(10));
    }

    /// Opens the gate: waiting calls go on.
    pub fn open(&self) {
        let _slot = lock(&self.task);
        self.closed.store(false, SeqCst);
        self.wake.notify_all();
    }

    /// Runs `f` (with the gate closed) in the opening thread when it waits at the gate, or
    /// here when it does not come within `PICKUP`. The thread that ran it becomes the
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

/// Waits on a proxy for the real call `get` to have something: `get` runs inside the gate
/// (the real object may be released and rebuilt meanwhile), the waiting outside it. A program
/// that made its descriptor non-blocking gets EAGAIN instead of a wait.
pub fn wait_on(proxy: &crate::events::Proxy, mut get: impl FnMut() -> Option<c_int>) -> c_int {
    loop {
        {
            let _pass = gate().enter();
            if let Some(rc) = get() {
                return rc;
            }
            proxy.settle();
            if proxy.nonblocking() {
                crate::real::set_errno(libc::EAGAIN);
                return -1;
            }
        }
        proxy.wait(100);
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
    fn no_call_is_inside_a_closed_gate_whether_its_thread_has_a_slot_or_not() {
        let g: &'static Gate = Box::leak(Box::default());
        if !g.asymmetric.load(SeqCst) {
            eprintln!("this kernel refused membarrier registration: callers fence themselves");
        }
        closes_hold_every_caller(g);
        // Callers that fence themselves (where membarrier is refused).
        let g: &'static Gate = Box::leak(Box::default());
        g.asymmetric.store(false, SeqCst);
        closes_hold_every_caller(g);
    }

    fn closes_hold_every_caller(g: &'static Gate) {
        // More threads than slots: the last ones share the counter.
        let threads = SLOTS + 6;
        let inside = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let callers: Vec<_> = (0..threads)
            .map(|_| {
                let (inside, stop) = (inside.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut calls = 0u64;
                    // (A thread without a slot cannot tell a nested call: not tried.)
                    let nests = g.my_slot().is_some();
                    while !stop.load(SeqCst) {
                        let _p = g.enter();
                        inside.fetch_add(1, SeqCst);
                        // A nested call (a signal handler's) now and then.
                        if nests && calls % 7 == 0 {
                            let _q = g.enter();
                        }
                        inside.fetch_sub(1, SeqCst);
                        calls += 1;
                        if calls % 64 == 0 {
                            std::thread::yield_now();
                        }
                    }
                    calls
                })
            })
            .collect();
        for _ in 0..20 {
            g.close(Duration::from_secs(10))
                .expect("every caller leaves");
            for _ in 0..50 {
                assert_eq!(inside.load(SeqCst), 0, "a call passed a closed gate");
                std::thread::yield_now();
            }
            g.open();
            std::thread::sleep(Duration::from_millis(2));
        }
        stop.store(true, SeqCst);
        let calls: Vec<u64> = callers
            .into_iter()
            .map(|c| c.join().expect("caller"))
            .collect();
        assert!(calls.iter().all(|&c| c > 0), "every thread got through");
        assert!(
            g.handed.load(SeqCst) >= SLOTS,
            "the last threads had no slot"
        );
        assert_eq!(g.inside(), 0);
    }

    #[test]
    fn a_call_that_interrupts_another_on_its_way_in_waits_at_a_closed_gate() {
        let g: &'static Gate = Box::leak(Box::default());
        g.close(Duration::from_secs(1)).expect("nobody inside");
        let passed = Arc::new(AtomicBool::new(false));
        let caller = {
            let passed = passed.clone();
            std::thread::spawn(move || {
                let slot = g.my_slot().expect("a slot");
                // What a signal handler's call finds when it interrupts one of its thread's
                // that has counted itself and not yet read the gate: not admitted.
                slot.inside.store(1, SeqCst);
                {
                    let _p = g.enter();
                    passed.store(true, SeqCst);
                }
                slot.inside.load(SeqCst)
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!passed.load(SeqCst), "a call went into a closed gate");
        g.open();
        assert_eq!(caller.join().expect("caller"), 1, "left as it found it");
        assert!(passed.load(SeqCst));
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
