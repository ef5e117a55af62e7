//! Digesting and verifying image trees.
//!
//! Every file of a node's image directory is hashed with BLAKE3 and fsynced before the node's
//! manifest is written; restore verifies every file against the manifest before any process is
//! recreated, so a corrupt image is refused instead of restored.
//!
//! Both run on every core: the files are spread over rayon's threads, largest first, and a
//! large file's blocks are hashed on several threads at once (BLAKE3 is a tree hash, so the
//! digest is the same). A node's images are a few large page files beside many small ones;
//! single-threaded hashing (~2 GiB/s) was most of the time a restart spent before the
//! engine's restore.
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{atomic, Result, StoreError};

/// One file of an image tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the image directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// BLAKE3 digest, lowercase hex.
    pub blake3: String,
}

impl FileEntry {
    /// Checks what was read of this file, `size` bytes that `hasher` hashed, against the entry:
    /// the size first, then the digest. Each error names the file as `path`.
    pub fn check_read(&self, path: &Path, size: u64, hasher: &blake3::Hasher) -> Result<()> {
        if size != self.size {
            return Err(StoreError::FileSize {
                path: path.to_path_buf(),
                expected: self.size,
                actual: size,
            });
        }
        if hasher.finalize().to_hex().as_str() != self.blake3 {
            return Err(StoreError::FileDigest {
                path: path.to_path_buf(),
            });
        }
        Ok(())
    }
}

const READ_BUF: usize = 1 << 20;

/// Files at least this large are read in [`PARALLEL_BUF`] blocks, each hashed on several
/// threads.
const PARALLEL_FROM: u64 = 8 << 20;
const PARALLEL_BUF: usize = 4 << 20;

/// Hashes one file and returns (size, hex digest).
pub fn file_digest(path: &Path) -> Result<(u64, String)> {
    let mut f = File::open(path).map_err(|e| StoreError::io("open", path, e))?;
    let large = f.metadata().is_ok_and(|m| m.len() >= PARALLEL_FROM);
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; if large { PARALLEL_BUF } else { READ_BUF }];
    let mut size = 0u64;
    loop {
        let n = read_full(&mut f, &mut buf).map_err(|e| StoreError::io("read", path, e))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        if large {
            hasher.update_rayon(&buf[..n]);
        } else {
            hasher.update(&buf[..n]);
        }
    }
    Ok((size, hasher.finalize().to_hex().to_string()))
}

/// Reads until `buf` is full or the file ends; the bytes read.
fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// `f` of every item, on rayon's threads, largest (`size`) first so that a large file does
/// not start last; the results in `items`' order, or the error of the first item in that
/// order that failed.
fn largest_first<T: Sync, R: Send>(
    items: &[T],
    size: impl Fn(&T) -> u64,
    f: impl Fn(&T) -> Result<R> + Sync + Send,
) -> Result<Vec<R>> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(size(&items[i])));
    let mut done: Vec<(usize, Result<R>)> =
        order.into_par_iter().map(|i| (i, f(&items[i]))).collect();
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// Lists every regular file below `root` (sorted, relative), skipping names in `skip` at the top
/// level.
pub fn list_files(root: &Path, skip: &[&str]) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        let rd = fs::read_dir(&dir).map_err(|e| StoreError::io("list", &dir, e))?;
        for ent in rd {
            let ent = ent.map_err(|e| StoreError::io("list", &dir, e))?;
            let name = ent.file_name().to_string_lossy().into_owned();
            if rel.as_os_str().is_empty() && skip.contains(&name.as_str()) {
                continue;
            }
            let ty = ent
                .file_type()
                .map_err(|e| StoreError::io("stat", ent.path(), e))?;
            let child = rel.join(&name);
            if ty.is_dir() {
                stack.push(child);
            } else if ty.is_file() {
                out.push(child.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Digests and fsyncs every file below `root` (except top-level names in `skip`), then fsyncs the
/// directories, and returns the entries sorted by path.
pub fn seal_tree(root: &Path, skip: &[&str]) -> Result<Vec<FileEntry>> {
    let sized: Vec<(String, u64)> = list_files(root, skip)?
        .into_iter()
        .map(|rel| {
            let len = fs::metadata(root.join(&rel)).map_or(0, |m| m.len());
            (rel, len)
        })
        .collect();
    let entries = largest_first(
        &sized,
        |(_, len)| *len,
        |(rel, _)| {
            let path = root.join(rel);
            let (size, blake3) = file_digest(&path)?;
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| StoreError::io("fsync", &path, e))?;
            Ok(FileEntry {
                path: rel.clone(),
                size,
                blake3,
            })
        },
    )?;
    let mut dirs: std::collections::BTreeSet<PathBuf> = entries
        .iter()
        .filter_map(|e| root.join(&e.path).parent().map(Path::to_path_buf))
        .collect();
    dirs.insert(root.to_path_buf());
    for d in dirs {
        atomic::sync_dir(&d)?;
    }
    Ok(entries)
}

/// Checks every listed file below `root`: present, same size, same digest, on every core.
/// Names the first file in `entries`' order that does not match; refuses a path that
/// [`crate::validate::relative_path`] refuses before looking at any file.
pub fn verify_tree(root: &Path, entries: &[FileEntry]) -> Result<()> {
    let paths = entries
        .iter()
        .map(|e| crate::error::join_relative(root, &e.path))
        .collect::<Result<Vec<PathBuf>>>()?;
    let items: Vec<(&FileEntry, PathBuf)> = entries.iter().zip(paths).collect();
    largest_first(&items, |(e, _)| e.size, |(e, path)| verify_file(e, path)).map(drop)
}

fn verify_file(e: &FileEntry, path: &Path) -> Result<()> {
    let path = path.to_path_buf();
    let meta = match fs::metadata(&path) {
        Ok(m) => m,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(StoreError::FileMissing { path })
        }
        Err(err) => return Err(StoreError::io("stat", &path, err)),
    };
    if meta.len() != e.size {
        return Err(StoreError::FileSize {
            path,
            expected: e.size,
            actual: meta.len(),
        });
    }
    let (size, digest) = file_digest(&path)?;
    if size != e.size {
        return Err(StoreError::FileSize {
            path,
            expected: e.size,
            actual: size,
        });
    }
    if digest != e.blake3 {
        return Err(StoreError::FileDigest { path });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    fn tree() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("criu")).unwrap();
        fs::write(d.path().join("criu/pages-1.img"), vec![7u8; 300_000]).unwrap();
        fs::write(d.path().join("criu/core-1.img"), b"core").unwrap();
        fs::write(d.path().join("MANIFEST"), b"skipped").unwrap();
        d
    }

    #[test]
    fn seal_lists_sorted_and_skips_manifest() {
        let d = tree();
        let e = seal_tree(d.path(), &["MANIFEST"]).unwrap();
        let names: Vec<_> = e.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(names, ["criu/core-1.img", "criu/pages-1.img"]);
        assert_eq!(e[1].size, 300_000);
        verify_tree(d.path(), &e).unwrap();
    }

    #[test]
    fn flipped_byte_is_detected() {
        let d = tree();
        let e = seal_tree(d.path(), &["MANIFEST"]).unwrap();
        let p = d.path().join("criu/pages-1.img");
        let mut f = fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.seek(SeekFrom::Start(123_456)).unwrap();
        f.write_all(&[8]).unwrap();
        drop(f);
        let err = verify_tree(d.path(), &e).unwrap_err();
        assert!(matches!(err, StoreError::FileDigest { .. }), "{err}");
        assert!(err.to_string().contains("pages-1.img"));
    }

    #[test]
    fn truncated_and_missing_files_are_detected() {
        let d = tree();
        let e = seal_tree(d.path(), &["MANIFEST"]).unwrap();
        let p = d.path().join("criu/pages-1.img");
        fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(10)
            .unwrap();
        assert!(matches!(
            verify_tree(d.path(), &e).unwrap_err(),
            StoreError::FileSize {
                expected: 300_000,
                actual: 10,
                ..
            }
        ));
        fs::remove_file(&p).unwrap();
        assert!(matches!(
            verify_tree(d.path(), &e).unwrap_err(),
            StoreError::FileMissing { .. }
        ));
    }

    #[test]
    fn large_files_hashed_on_several_threads_have_the_plain_digest() {
        let d = tempfile::tempdir().unwrap();
        // Not a multiple of the block size, and large enough for parallel hashing.
        let data: Vec<u8> = (0..(PARALLEL_FROM as usize + PARALLEL_BUF + 12_345))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        fs::write(d.path().join("pages-9.img"), &data).unwrap();
        fs::write(d.path().join("small"), b"x").unwrap();
        let e = seal_tree(d.path(), &[]).unwrap();
        assert_eq!(e[0].path, "pages-9.img");
        assert_eq!(e[0].size, data.len() as u64);
        assert_eq!(e[0].blake3, blake3::hash(&data).to_hex().as_str());
        assert_eq!(e[1].blake3, blake3::hash(b"x").to_hex().as_str());
        verify_tree(d.path(), &e).unwrap();
    }

    #[test]
    fn with_several_bad_files_the_first_listed_is_named() {
        let d = tempfile::tempdir().unwrap();
        for (name, len) in [("a", 10), ("b", 20_000_000), ("c", 5_000)] {
            fs::write(d.path().join(name), vec![1u8; len]).unwrap();
        }
        let e = seal_tree(d.path(), &[]).unwrap();
        for name in ["b", "c"] {
            fs::write(d.path().join(name), b"changed").unwrap();
        }
        // "b" is checked first (largest) and "c" may fail first in time; "b" is listed first.
        match verify_tree(d.path(), &e).unwrap_err() {
            StoreError::FileSize { path, .. } => assert!(path.ends_with("b"), "{path:?}"),
            other => panic!("{other}"),
        }
    }
}
