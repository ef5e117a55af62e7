//! Copying a node's sealed images from one store to another: node-local staging to shared
//! storage (flush), and back (a restore whose local copy is missing or damaged).
//!
//! Every byte is digested as it is read and checked against the manifest, so a damaged source
//! fails the copy (naming the file) instead of spreading. Files are copied by several threads
//! ("streams") at once under an optional shared bandwidth limit; each file is fsynced, and the
//! manifest is written last and atomically, so a copy without a MANIFEST is incomplete.
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::digest::FileEntry;
use crate::manifest::{self, NodeManifest};
use crate::{atomic, Result, StoreError};

const BUF: usize = 1 << 20;

/// How a copy runs.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Files copied at once (at least 1).
    pub streams: usize,
    /// Bytes per second over all streams; `None` for no limit.
    pub bandwidth: Option<u64>,
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            streams: 4,
            bandwidth: None,
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
}

/// A token bucket shared by every stream: a stream that got ahead of the rate sleeps.
#[derive(Debug)]
struct Throttle {
    rate: u64,
    state: Mutex<(Instant, u64)>,
}

impl Throttle {
    fn new(rate: u64) -> Self {
        Throttle {
            rate: rate.max(1),
            state: Mutex::new((Instant::now(), 0)),
        }
    }

    fn take(&self, n: u64) {
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

/// Copies the node directory `src` (images and MANIFEST) to `dest`, which is replaced.
///
/// `committed` is the digest the coordinator committed for this node's manifest; a source
/// whose manifest differs is refused before anything is copied. Returns the manifest.
pub fn copy_node_dir(
    src: &Path,
    dest: &Path,
    committed: Option<&str>,
    opts: &CopyOptions,
    progress: &CopyProgress,
) -> Result<NodeManifest> {
    let mpath = src.join(manifest::FILE_NAME);
    let mbytes = manifest::read_capped(&mpath)?;
    let m = manifest::decode(&mpath, &mbytes)?;
    let digest = blake3::hash(&mbytes).to_hex().to_string();
    if let Some(want) = committed.filter(|c| !c.is_empty()) {
        if digest != want {
            return Err(StoreError::NotCommitted {
                path: mpath,
                found: digest,
                expected: want.to_string(),
            });
        }
    }
    progress.total.store(m.image_bytes(), Ordering::Relaxed);
    if dest.exists() {
        fs::remove_dir_all(dest).map_err(|e| StoreError::io("remove", dest, e))?;
    }
    fs::create_dir_all(dest).map_err(|e| StoreError::io("create", dest, e))?;

    // Largest first, so one big file does not start last and run alone.
    let mut queue: Vec<&FileEntry> = m.files.iter().collect();
    queue.sort_by_key(|f| std::cmp::Reverse(f.size));
    let queue = Mutex::new(queue);
    let throttle = opts.bandwidth.map(Throttle::new);
    let failed: Mutex<Option<StoreError>> = Mutex::new(None);
    let streams = opts.streams.clamp(1, 64).min(m.files.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..streams {
            s.spawn(|| loop {
                if failed.lock().expect("lock").is_some() {
                    return;
                }
                let Some(f) = queue.lock().expect("lock").pop() else {
                    return;
                };
                if let Err(e) = copy_file(src, dest, f, throttle.as_ref(), progress) {
                    failed.lock().expect("lock").get_or_insert(e);
                    return;
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().expect("lock") {
        return Err(e);
    }
    let mut dirs: std::collections::BTreeSet<_> = m
        .files
        .iter()
        .filter_map(|f| dest.join(&f.path).parent().map(Path::to_path_buf))
        .collect();
    dirs.insert(dest.to_path_buf());
    for d in dirs {
        atomic::sync_dir(&d)?;
    }
    atomic::write_file(&dest.join(manifest::FILE_NAME), &mbytes)?;
    Ok(m)
}

fn copy_file(
    src_root: &Path,
    dest_root: &Path,
    f: &FileEntry,
    throttle: Option<&Throttle>,
    progress: &CopyProgress,
) -> Result<()> {
    let src = src_root.join(&f.path);
    let dest = dest_root.join(&f.path);
    if let Some(parent) = dest.parent() {
        fs::create_dir_all(parent).map_err(|e| StoreError::io("create", parent, e))?;
    }
    let mut input = File::open(&src).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => StoreError::FileMissing { path: src.clone() },
        _ => StoreError::io("open", &src, e),
    })?;
    let mut out = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&dest)
        .map_err(|e| StoreError::io("create", &dest, e))?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; BUF];
    let mut size = 0u64;
    loop {
        if progress.cancel.load(Ordering::Relaxed) {
            return Err(StoreError::io(
                "copy",
                &dest,
                std::io::Error::new(std::io::ErrorKind::Interrupted, "copy cancelled"),
            ));
        }
        let n = input
            .read(&mut buf)
            .map_err(|e| StoreError::io("read", &src, e))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        if size > f.size {
            break;
        }
        hasher.update(&buf[..n]);
        if let Some(t) = throttle {
            t.take(n as u64);
        }
        out.write_all(&buf[..n])
            .map_err(|e| StoreError::io("write", &dest, e))?;
        progress.done.fetch_add(n as u64, Ordering::Relaxed);
    }
    if size != f.size {
        return Err(StoreError::FileSize {
            path: src,
            expected: f.size,
            actual: size.max(input.metadata().map(|m| m.len()).unwrap_or(size)),
        });
    }
    if hasher.finalize().to_hex().as_str() != f.blake3 {
        return Err(StoreError::FileDigest { path: src });
    }
    out.sync_all()
        .map_err(|e| StoreError::io("fsync", &dest, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{seal_tree, verify_tree};
    use std::collections::BTreeMap;

    fn sealed(dir: &Path) -> String {
        fs::create_dir_all(dir.join("images")).unwrap();
        for i in 0..5u8 {
            fs::write(
                dir.join(format!("images/pages-{i}.img")),
                vec![i; 200_000 * (i as usize + 1)],
            )
            .unwrap();
        }
        let files = seal_tree(dir, &[manifest::FILE_NAME]).unwrap();
        let m = NodeManifest {
            job_id: 1,
            epoch: 1,
            node: "n1".into(),
            engine: "criu".into(),
            engine_version: "x".into(),
            created_unix_ms: 0,
            root_pid: 1,
            pids: vec![],
            tids: vec![],
            files,
            open_files: vec![],
            preserved: vec![],
            tcp_ports: vec![],
            tcp_addrs: vec![],
            notes: BTreeMap::new(),
        };
        manifest::write(dir, &m).unwrap()
    }

    #[test]
    fn copy_is_complete_and_verifies() {
        let d = tempfile::tempdir().unwrap();
        let (src, dest) = (d.path().join("a"), d.path().join("b"));
        let digest = sealed(&src);
        let p = CopyProgress::default();
        let m = copy_node_dir(&src, &dest, Some(&digest), &CopyOptions::default(), &p).unwrap();
        assert_eq!(p.done.load(Ordering::Relaxed), m.image_bytes());
        let (m2, digest2) = manifest::read(&dest).unwrap();
        assert_eq!((m2, digest2), (m.clone(), digest));
        verify_tree(&dest, &m.files).unwrap();
    }

    #[test]
    fn a_damaged_source_fails_naming_the_file_and_leaves_no_manifest() {
        let d = tempfile::tempdir().unwrap();
        let (src, dest) = (d.path().join("a"), d.path().join("b"));
        let digest = sealed(&src);
        let victim = src.join("images/pages-2.img");
        let mut bytes = fs::read(&victim).unwrap();
        bytes[1000] ^= 1;
        fs::write(&victim, bytes).unwrap();
        let err = copy_node_dir(
            &src,
            &dest,
            Some(&digest),
            &CopyOptions::default(),
            &CopyProgress::default(),
        )
        .unwrap_err();
        assert!(matches!(err, StoreError::FileDigest { .. }), "{err}");
        assert!(err.to_string().contains("pages-2.img"), "{err}");
        assert!(!dest.join(manifest::FILE_NAME).exists());
        // Truncated source.
        fs::OpenOptions::new()
            .write(true)
            .open(&victim)
            .unwrap()
            .set_len(10)
            .unwrap();
        let err = copy_node_dir(
            &src,
            &dest,
            None,
            &CopyOptions::default(),
            &CopyProgress::default(),
        )
        .unwrap_err();
        assert!(matches!(err, StoreError::FileSize { .. }), "{err}");
    }

    #[test]
    fn another_attempts_manifest_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("a");
        sealed(&src);
        let err = copy_node_dir(
            &src,
            &d.path().join("b"),
            Some(&"00".repeat(32)),
            &CopyOptions::default(),
            &CopyProgress::default(),
        )
        .unwrap_err();
        assert!(matches!(err, StoreError::NotCommitted { .. }), "{err}");
    }

    #[test]
    fn bandwidth_limit_spreads_the_copy_over_time() {
        // 3 MB at 20 MB/s cannot finish in less than ~150 ms; unlimited takes a few ms. The
        // bound is a floor implied by the limit, not a speed expectation of this machine.
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("a");
        sealed(&src);
        let opts = CopyOptions {
            streams: 3,
            bandwidth: Some(20_000_000),
        };
        let t = Instant::now();
        copy_node_dir(
            &src,
            &d.path().join("b"),
            None,
            &opts,
            &CopyProgress::default(),
        )
        .unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(140),
            "{:?}",
            t.elapsed()
        );
    }
}
