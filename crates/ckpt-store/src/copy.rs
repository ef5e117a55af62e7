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
pub struct Throttle {
    rate: u64,
    state: Mutex<(Instant, u64)>,
}

impl Throttle {
    /// A bucket of `rate` bytes per second.
    pub fn new(rate: u64) -> Self {
        Throttle {
            rate: rate.max(1),
            state: Mutex::new((Instant::now(), 0)),
        }
    }

    /// Takes `n` bytes, sleeping while the bucket is ahead of the rate.
    pub fn take(&self, n: u64) {
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

/// Copies `src` to `dst` (empty) with its holes: only the ranges that hold data are read and
/// written (`SEEK_DATA`/`SEEK_HOLE`), and `dst` gets `src`'s length. Returns the bytes copied.
/// A file system that cannot tell its holes gets a plain copy.
pub fn copy_sparse(src: &mut std::fs::File, dst: &mut std::fs::File) -> std::io::Result<u64> {
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::fd::AsRawFd;
    let len = src.metadata()?.len();
    let fd = src.as_raw_fd();
    let mut copied = 0u64;
    let mut at: i64 = 0;
    let mut buf = vec![0u8; 1 << 20];
    while (at as u64) < len {
        // SAFETY: lseek on a descriptor of ours.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENXIO) => break, // only a hole is left
                Some(libc::EINVAL) if at == 0 => {
                    src.seek(SeekFrom::Start(0))?;
                    return std::io::copy(src, dst);
                }
                _ => return Err(e),
            }
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        src.seek(SeekFrom::Start(data as u64))?;
        dst.seek(SeekFrom::Start(data as u64))?;
        let mut left = (hole - data) as u64;
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            let n = src.read(&mut buf[..want])?;
            if n == 0 {
                break;
            }
            dst.write_all(&buf[..n])?;
            left -= n as u64;
            copied += n as u64;
        }
        at = hole;
    }
    dst.set_len(len)?;
    Ok(copied)
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

    #[test]
    fn a_sparse_file_is_copied_with_its_holes() {
        use std::io::{Seek, SeekFrom, Write};
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a"), d.path().join("b"));
        let mut f = std::fs::File::create(&a).unwrap();
        f.write_all(b"head").unwrap();
        f.seek(SeekFrom::Start(1 << 30)).unwrap();
        f.write_all(b"middle").unwrap();
        f.set_len(4 << 30).unwrap();
        drop(f);
        let mut src = std::fs::File::open(&a).unwrap();
        let mut dst = std::fs::File::create(&b).unwrap();
        let copied = copy_sparse(&mut src, &mut dst).unwrap();
        assert!(copied < 64 << 20, "only the data is copied: {copied}");
        let m = std::fs::metadata(&b).unwrap();
        assert_eq!(m.len(), 4 << 30);
        assert!(m.blocks() * 512 < 64 << 20, "the copy is sparse too");
        let read_at = |off: u64, n: usize| {
            use std::os::unix::fs::FileExt;
            let mut v = vec![0u8; n];
            std::fs::File::open(&b)
                .unwrap()
                .read_exact_at(&mut v, off)
                .unwrap();
            v
        };
        assert_eq!(read_at(0, 4), b"head");
        assert_eq!(read_at(1 << 30, 6), b"middle");
        assert_eq!(read_at(2 << 30, 4), [0; 4]);
    }
}
