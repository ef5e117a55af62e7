//! The restore gate: a restore may start before the page data files of its images are verified,
//! because the engine only copies them into the restored processes; none of those processes
//! runs before the verification has passed.
//!
//! The agent makes a FIFO in the incarnation's run directory (root's, 0700) and holds it open
//! for reading and writing, so that whatever it writes waits there for a reader and a reader
//! that comes after the agent died reads end-of-file. At "post-restore" (every process rebuilt,
//! none resumed) one line is read from it, and only `ok` lets CRIU go on: by the job shim
//! ([`wait_verdict`]), which answers CRIU's RPC service, or, when the shim runs `criu restore`
//! as a command, by the agent's own binary run as CRIU's action script with [`ENV`] naming the
//! FIFO ([`action_script`]). Any other outcome, the agent gone included, fails that stage, and
//! CRIU then kills the tree it restored.
use std::fs::{self, File};
use std::io::{self, BufRead, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Names the FIFO in the environment of the engine and so of its action scripts.
pub const ENV: &str = "CKPT_RESTORE_GATE";
/// What CRIU sets, in its action scripts' environment, to the stage it reached.
const ACTION_ENV: &str = "CRTOOLS_SCRIPT_ACTION";
/// The stage at which every restored process has its memory and none has run.
const POST_RESTORE: &str = "post-restore";
/// Its name in the run directory.
const FIFO: &str = "verified";
/// The agent gives up on a restore after this long; the gate too (seconds).
const WAIT_LIMIT_S: u32 = super::RESTORE_TIMEOUT.as_secs() as u32;

/// The agent's end of a gate.
#[derive(Debug)]
pub struct Gate {
    path: PathBuf,
    fifo: File,
}

impl Gate {
    /// Makes the gate's FIFO in `run_dir` (a directory only root may write) and opens it.
    pub fn open(run_dir: &Path) -> io::Result<Gate> {
        let path = run_dir.join(FIFO);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let c = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a valid NUL-terminated path.
        if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // Read and write: never blocks, and the FIFO keeps what is written until it is read.
        let fifo = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?;
        Ok(Gate { path, fifo })
    }

    /// The FIFO, for [`ENV`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Lets the restored processes run (`true`) or has the engine kill them (`false`). The
    /// gate must stay open until the engine is done: a FIFO nobody holds forgets its data.
    pub fn decide(&mut self, verified: bool) {
        let line: &[u8] = if verified { b"ok\n" } else { b"refused\n" };
        // A full FIFO cannot happen (one short line); an error leaves the reader waiting
        // for end-of-file, which comes when the gate is dropped: a refusal either way.
        let _ = self.fifo.write_all(line);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// When this binary runs as the engine's action script ([`ACTION_ENV`] and [`ENV`] set): the
/// exit status to end with. None: it was not started as one.
pub fn action_script() -> Option<u8> {
    let action = std::env::var_os(ACTION_ENV)?;
    let fifo = std::env::var_os(ENV)?;
    if action == POST_RESTORE {
        // SAFETY: alarm has no preconditions; its default action ends the process.
        unsafe { libc::alarm(WAIT_LIMIT_S) };
    }
    Some(verdict(&action, Path::new(&fifo)))
}

/// The action script's exit status at stage `action`: at post-restore, 0 only if the line in
/// `fifo` is `ok`; at any other stage 0 at once.
fn verdict(action: &std::ffi::OsStr, fifo: &Path) -> u8 {
    if action != POST_RESTORE {
        return 0;
    }
    let line = File::open(fifo).and_then(|f| {
        let mut line = Vec::new();
        io::BufReader::new(f.take(32)).read_until(b'\n', &mut line)?;
        Ok(line)
    });
    match line {
        Ok(line) if line == b"ok\n" => 0,
        Ok(line) => {
            eprintln!(
                "ckpt restore gate: the images' page data did not pass verification ({:?}): the restored processes are killed before they run",
                String::from_utf8_lossy(&line)
            );
            1
        }
        Err(e) => {
            eprintln!("ckpt restore gate: cannot read {}: {e}", fifo.display());
            1
        }
    }
}

/// The agent's verdict for a restore that CRIU runs for the shim through its RPC service
/// (the shim answers CRIU's post-restore notice with it): Ok only for `ok`. Waits at most
/// [`WAIT_LIMIT_S`]. The agent gone is a refusal: at once when it removed the FIFO or closed it
/// after this opened it; a FIFO left by an agent killed before has no writer to hang up, and
/// is waited out.
pub fn wait_verdict(fifo: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    // Non-blocking: opening does not wait for a writer, and end-of-file shows as a hang-up.
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(fifo)
        .map_err(|e| format!("cannot read {}: {e}", fifo.display()))?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(WAIT_LIMIT_S.into());
    let mut line = Vec::new();
    let mut buf = [0u8; 32];
    while !line.ends_with(b"\n") && line.len() < 32 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(format!(
                "no verdict on the page data within {WAIT_LIMIT_S} s"
            ));
        }
        let mut pfd = libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(60_000) as i32) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(format!("cannot wait on {}: {e}", fifo.display()));
        }
        if n == 0 {
            continue;
        }
        match (&f).read(&mut buf) {
            Ok(0) => break,
            Ok(k) => line.extend_from_slice(&buf[..k]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("cannot read {}: {e}", fifo.display())),
        }
    }
    if line == b"ok\n" {
        Ok(())
    } else {
        Err(format!(
            "the images' page data did not pass verification ({:?}): the restored processes are killed before they run",
            String::from_utf8_lossy(&line)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::thread;
    use std::time::Duration;

    /// The action script's verdict at `action`, on its own thread as CRIU's child would
    /// wait on its own.
    fn reader(gate: &Path, action: &'static str) -> thread::JoinHandle<u8> {
        let gate = gate.to_path_buf();
        thread::spawn(move || verdict(OsStr::new(action), &gate))
    }

    #[test]
    fn what_is_decided_before_or_after_the_reader_comes_reaches_it() {
        let d = tempfile::tempdir().unwrap();
        let mut g = Gate::open(d.path()).unwrap();
        let meta = fs::symlink_metadata(g.path()).unwrap();
        assert!(meta.file_type().is_fifo());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        // Decided before anyone reads: the line waits in the FIFO.
        g.decide(true);
        assert_eq!(reader(g.path(), POST_RESTORE).join().unwrap(), 0);
        // The reader first, then a refusal.
        let r = reader(g.path(), POST_RESTORE);
        thread::sleep(Duration::from_millis(50));
        assert!(!r.is_finished(), "it waits for the decision");
        g.decide(false);
        assert_eq!(r.join().unwrap(), 1);
        // Other stages pass without reading.
        assert_eq!(reader(g.path(), "pre-restore").join().unwrap(), 0);
        // The agent gone before deciding: end-of-file, a refusal.
        let r = reader(g.path(), POST_RESTORE);
        thread::sleep(Duration::from_millis(50));
        let path = g.path().to_path_buf();
        drop(g);
        assert_eq!(r.join().unwrap(), 1);
        assert!(!path.exists(), "the FIFO is removed with the gate");
        assert_eq!(
            verdict(OsStr::new(POST_RESTORE), &path),
            1,
            "and then refuses"
        );
    }

    #[test]
    fn the_shims_wait_gets_the_same_verdicts() {
        let d = tempfile::tempdir().unwrap();
        let mut g = Gate::open(d.path()).unwrap();
        g.decide(true);
        assert_eq!(wait_verdict(g.path()), Ok(()));
        let waiter = |p: &Path| {
            let p = p.to_path_buf();
            thread::spawn(move || wait_verdict(&p))
        };
        let w = waiter(g.path());
        thread::sleep(Duration::from_millis(50));
        assert!(!w.is_finished(), "it waits for the decision");
        g.decide(false);
        let refused = w.join().unwrap().unwrap_err();
        assert!(refused.contains("did not pass verification"), "{refused}");
        // The agent gone before deciding: end-of-file, a refusal, at once.
        let w = waiter(g.path());
        thread::sleep(Duration::from_millis(50));
        drop(g);
        assert!(w.join().unwrap().is_err());
    }
}
