//! Digesting and verifying image trees.
//!
//! Every file of a node's image directory is hashed with BLAKE3 and fsynced before the node's
//! manifest is written; restore verifies every file against the manifest before any process is
//! recreated, so a corrupt image is refused instead of restored.
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};

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

/// Hashes one file and returns (size, hex digest).
pub fn file_digest(path: &Path) -> Result<(u64, String)> {
    let mut f = File::open(path).map_err(|e| StoreError::io("open", path, e))?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; READ_BUF];
    let mut size = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| StoreError::io("read", path, e))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        hasher.update(&buf[..n]);
    }
    Ok((size, hasher.finalize().to_hex().to_string()))
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
    let mut entries = Vec::new();
    let mut dirs = std::collections::BTreeSet::new();
    for rel in list_files(root, skip)? {
        let path = root.join(&rel);
        let (size, blake3) = file_digest(&path)?;
        File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| StoreError::io("fsync", &path, e))?;
        if let Some(parent) = path.parent() {
            dirs.insert(parent.to_path_buf());
        }
        entries.push(FileEntry {
            path: rel,
            size,
            blake3,
        });
    }
    dirs.insert(root.to_path_buf());
    for d in dirs {
        atomic::sync_dir(&d)?;
    }
    Ok(entries)
}

/// Checks every listed file below `root`: present, same size, same digest. Stops at the first
/// mismatch and names the file; refuses a path that [`crate::validate::relative_path`] refuses
/// before looking at it.
pub fn verify_tree(root: &Path, entries: &[FileEntry]) -> Result<()> {
    for e in entries {
        let path = crate::validate::join_relative(root, &e.path)?;
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
        let (_, digest) = file_digest(&path)?;
        if digest != e.blake3 {
            return Err(StoreError::FileDigest { path });
        }
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
}
