//! How copies of images between stores run: the number of parallel streams, a bandwidth limit
//! shared by all of them, and progress that another thread can read (and use to cancel).
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a copy runs.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Files copied at once (at least 1).
    pub streams: usize,
    /// Bytes per second over all streams; `None` for no limit.
    pub bandwidth: Option<u64>,
    /// zstd level for chunks a flush stores in shared storage; `None`: stored as they are.
    pub compress: Option<i32>,
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            streams: 4,
            bandwidth: None,
            compress: None,
        }
    }
}

/// Progress of a copy, readable from another thread while it runs.
#[derive(Debug, Default)]
pub struct CopyProgress {
    /// Bytes copied so far.
    pub done: AtomicU64,
    /// Bytes to copy (set once the manifest is read).
    pub total: AtomicU64,
    /// Set to stop the copy early; it then fails with an `Interrupted` I/O error.
    pub cancel: AtomicBool,
    /// While above zero the copy waits between chunks (the node agent raises it while any job
    /// on the node is frozen, so a background copy takes no CPU or disk from a dump).
    pub pause: Arc<AtomicUsize>,
}

/// Longest a copy waits for a pause to end before going on anyway.
const MAX_PAUSE: Duration = Duration::from_secs(900);

impl CopyProgress {
    /// Progress that pauses whenever `pause` is above zero.
    pub fn pausing_on(pause: Arc<AtomicUsize>) -> Self {
        CopyProgress {
            pause,
            ..Default::default()
        }
    }

    /// Waits (bounded) while paused.
    pub fn wait_unpaused(&self) {
        let begin = Instant::now();
        while self.pause.load(Ordering::Relaxed) > 0
            && !self.cancel.load(Ordering::Relaxed)
            && begin.elapsed() < MAX_PAUSE
        {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// A token bucket shared by every stream: a stream that got ahead of the rate sleeps.
#[derive(Debug)]
pub(crate) struct Throttle {
    rate: u64,
    state: Mutex<(Instant, u64)>,
}

impl Throttle {
    pub(crate) fn new(rate: u64) -> Self {
        Throttle {
            rate: rate.max(1),
            state: Mutex::new((Instant::now(), 0)),
        }
    }

    pub(crate) fn take(&self, n: u64) {
        let due = {
            let mut s = self.state.lock().expect("throttle lock");
            s.1 += n;
            s.0 + Duration::from_secs_f64(s.1 as f64 / self.rate as f64)
        };
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_holds_until_lifted() {
        let p = Arc::new(CopyProgress::pausing_on(Arc::new(AtomicUsize::new(1))));
        let q = p.clone();
        let waiter = std::thread::spawn(move || {
            q.wait_unpaused();
            Instant::now()
        });
        std::thread::sleep(Duration::from_millis(50));
        let lifted = Instant::now();
        p.pause.store(0, Ordering::Relaxed);
        assert!(waiter.join().unwrap() >= lifted, "returned while paused");
    }

    #[test]
    fn the_limit_holds_over_all_streams() {
        // 3 MB through 3 threads at 20 MB/s cannot take less than ~150 ms. The bound is a floor
        // implied by the limit, not a speed expectation of this machine.
        let t = Throttle::new(20_000_000);
        let begin = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..10 {
                        t.take(100_000);
                    }
                });
            }
        });
        assert!(
            begin.elapsed() >= Duration::from_millis(140),
            "{:?}",
            begin.elapsed()
        );
    }
}
