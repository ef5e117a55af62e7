//! Work a node does for its jobs' redundancy in the background, at the lowest CPU priority:
//! on a node whose cores the job keeps busy, the job's threads run first and the background
//! work takes what is left; on idle cores it runs at full speed.
use std::future::Future;

/// The nice value of background work.
pub const NICE: i32 = 19;

/// Runs `work` on a thread of its own at nice [`NICE`] (a thread of its own, so that no
/// pooled thread keeps the lowered priority); resolves to its result.
pub fn run<T, F>(name: &str, work: F) -> impl Future<Output = std::io::Result<T>>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            lower_priority();
            let _ = tx.send(work());
        });
    async move {
        spawned?;
        rx.await
            .map_err(|_| std::io::Error::other("the background thread ended without a result"))
    }
}

/// Sets the calling thread's nice value to [`NICE`] (Linux sets it per thread). A failure
/// leaves the thread as it was: the work only runs sooner.
fn lower_priority() {
    // SAFETY: gettid and setpriority on the calling thread, no memory passed.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, NICE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_runs_at_the_lowest_priority_and_returns_its_result() {
        let nice = run("test-background", || {
            // SAFETY: as above; errno cleared first, since -1 is a valid priority.
            unsafe {
                *libc::__errno_location() = 0;
                libc::getpriority(
                    libc::PRIO_PROCESS,
                    libc::syscall(libc::SYS_gettid) as libc::id_t,
                )
            }
        })
        .await
        .unwrap();
        assert_eq!(nice, NICE);
        // SAFETY: as above.
        let here = unsafe {
            libc::getpriority(
                libc::PRIO_PROCESS,
                libc::syscall(libc::SYS_gettid) as libc::id_t,
            )
        };
        assert_ne!(here, NICE, "the caller's thread is left as it was");
    }
}
