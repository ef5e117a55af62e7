//! A node's sealed images as a stream of chunks, and the receiving end: how images travel to a
//! partner node's staging (and back, when a restore needs the partner's copy).
//!
//! The sender reads the manifest, then every listed file in manifest order in chunks, checking
//! each file's digest as it reads (a damaged source stops the stream). The receiver checks the
//! manifest against the committed digest before writing anything, digests every file as it
//! arrives, fsyncs it, and writes the manifest last and atomically: a copy without MANIFEST is
//! incomplete. Both ends require the committed digest, and the manifest's paths are checked
//! when it is decoded ([`manifest::check`]) and again where each is joined onto a directory.
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::manifest::{self, NodeManifest};
use crate::{atomic, error, Result, StoreError};

/// Size of the chunks a sender produces.
pub const CHUNK: usize = 1 << 20;

/// Reads a node directory's manifest and checks it against the committed digest, which is
/// required (an empty one is [`StoreError::DigestRequired`]); returns the manifest file's bytes
/// and the manifest.
pub fn open_source(dir: &Path, committed: &str) -> Result<(Vec<u8>, NodeManifest)> {
    let path = dir.join(manifest::FILE_NAME);
    require_digest(&path, committed)?;
    let bytes = manifest::read_capped(&path, manifest::MAX_MANIFEST_BYTES)?;
    let m = manifest::decode(&path, &bytes)?;
    check_committed(&path, &bytes, committed)?;
    Ok((bytes, m))
}

/// A committed digest is required wherever one is checked: an empty one would let any intact
/// manifest through.
fn require_digest(path: &Path, committed: &str) -> Result<()> {
    if committed.is_empty() {
        return Err(StoreError::DigestRequired {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

fn check_committed(path: &Path, bytes: &[u8], committed: &str) -> Result<()> {
    require_digest(path, committed)?;
    let found = blake3::hash(bytes).to_hex().to_string();
    if found != committed {
        return Err(StoreError::NotCommitted {
            path: path.to_path_buf(),
            found,
            expected: committed.to_string(),
        });
    }
    Ok(())
}

/// Calls `send(file_index, chunk)` for every chunk of every file of `m` below `dir`, in order;
/// a file that does not match the manifest fails before its last chunk is sent, and a path
/// that [`crate::validate::relative_path`] refuses before anything of it is read. `send`
/// returning false stops early (the receiver went away) without error.
pub fn send_files(
    dir: &Path,
    m: &NodeManifest,
    mut send: impl FnMut(u32, Vec<u8>) -> bool,
) -> Result<()> {
    for (i, f) in m.files.iter().enumerate() {
        let path = error::join_relative(dir, &f.path)?;
        let mut input = File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => StoreError::FileMissing { path: path.clone() },
            _ => StoreError::io("open", &path, e),
        })?;
        let mut hasher = blake3::Hasher::new();
        let mut size = 0u64;
        let mut pending: Option<Vec<u8>> = None;
        loop {
            let mut buf = vec![0u8; CHUNK];
            let n =
                read_full(&mut input, &mut buf).map_err(|e| StoreError::io("read", &path, e))?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
            size += n as u64;
            hasher.update(&buf);
            // Hold one chunk back, so the last one is only sent after the digest is checked.
            if let Some(prev) = pending.replace(buf) {
                if !send(i as u32, prev) {
                    return Ok(());
                }
            }
        }
        f.check_read(&path, size, &hasher)?;
        // An empty file still announces itself, so the receiver creates it.
        if !send(i as u32, pending.unwrap_or_default()) {
            return Ok(());
        }
    }
    Ok(())
}

fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The receiving end: writes a node's images into a directory, verifying as they arrive.
#[derive(Debug)]
pub struct Receiver {
    dest: PathBuf,
    manifest_bytes: Vec<u8>,
    manifest: NodeManifest,
    /// Index of the file being written, its handle, hasher and bytes so far.
    current: Option<(usize, File, blake3::Hasher, u64)>,
    /// Files completed so far (they arrive in manifest order).
    done: usize,
}

impl Receiver {
    /// Starts receiving into `dest` (replaced) the images whose manifest file is
    /// `manifest_bytes`; refused before anything is written unless it is intact, no larger than
    /// [`manifest::MAX_MANIFEST_BYTES`], passes [`manifest::check`] and has the committed
    /// digest, which is required.
    pub fn begin(dest: &Path, manifest_bytes: Vec<u8>, committed: &str) -> Result<Self> {
        let mpath = dest.join(manifest::FILE_NAME);
        require_digest(&mpath, committed)?;
        if manifest_bytes.len() as u64 > manifest::MAX_MANIFEST_BYTES {
            return Err(StoreError::TooLarge {
                path: mpath,
                size: manifest_bytes.len() as u64,
                limit: manifest::MAX_MANIFEST_BYTES,
            });
        }
        let m = manifest::decode(&mpath, &manifest_bytes)?;
        check_committed(&mpath, &manifest_bytes, committed)?;
        if dest.exists() {
            fs::remove_dir_all(dest).map_err(|e| StoreError::io("remove", dest, e))?;
        }
        fs::create_dir_all(dest).map_err(|e| StoreError::io("create", dest, e))?;
        Ok(Receiver {
            dest: dest.to_path_buf(),
            manifest_bytes,
            manifest: m,
            current: None,
            done: 0,
        })
    }

    /// The manifest being received.
    pub fn manifest(&self) -> &NodeManifest {
        &self.manifest
    }

    /// Takes the next chunk of file `file` (an index into the manifest's files).
    pub fn write(&mut self, file: u32, data: &[u8]) -> Result<()> {
        let file = file as usize;
        if self.current.as_ref().map(|c| c.0) != Some(file) {
            self.close_current()?;
            if file != self.done || file >= self.manifest.files.len() {
                return Err(self.out_of_order(file));
            }
            let path = error::join_relative(&self.dest, &self.manifest.files[file].path)?;
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(|e| StoreError::io("create", parent, e))?;
            }
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| StoreError::io("create", &path, e))?;
            self.current = Some((file, f, blake3::Hasher::new(), 0));
        }
        let entry = &self.manifest.files[file];
        let (_, f, hasher, size) = self.current.as_mut().expect("set above");
        *size += data.len() as u64;
        let path = self.dest.join(&entry.path);
        if *size > entry.size {
            return Err(StoreError::FileSize {
                path,
                expected: entry.size,
                actual: *size,
            });
        }
        hasher.update(data);
        f.write_all(data)
            .map_err(|e| StoreError::io("write", &path, e))
    }

    fn out_of_order(&self, file: usize) -> StoreError {
        StoreError::io(
            "receive",
            &self.dest,
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "chunk of file #{file} out of order (expected #{} of {})",
                    self.done,
                    self.manifest.files.len()
                ),
            ),
        )
    }

    fn close_current(&mut self) -> Result<()> {
        let Some((i, f, hasher, size)) = self.current.take() else {
            return Ok(());
        };
        let entry = &self.manifest.files[i];
        let path = self.dest.join(&entry.path);
        entry.check_read(&path, size, &hasher)?;
        f.sync_all()
            .map_err(|e| StoreError::io("fsync", &path, e))?;
        self.done += 1;
        Ok(())
    }

    /// Checks that every file arrived intact, makes them durable and writes the manifest last.
    pub fn finish(mut self) -> Result<NodeManifest> {
        self.close_current()?;
        if self.done != self.manifest.files.len() {
            let missing = &self.manifest.files[self.done];
            return Err(StoreError::FileMissing {
                path: self.dest.join(&missing.path),
            });
        }
        let mut dirs: std::collections::BTreeSet<PathBuf> = self
            .manifest
            .files
            .iter()
            .filter_map(|f| self.dest.join(&f.path).parent().map(Path::to_path_buf))
            .collect();
        dirs.insert(self.dest.clone());
        for d in dirs {
            atomic::sync_dir(&d)?;
        }
        atomic::write_file(&self.dest.join(manifest::FILE_NAME), &self.manifest_bytes)?;
        Ok(self.manifest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{seal_tree, verify_tree};

    fn sealed(dir: &Path) -> String {
        fs::create_dir_all(dir.join("images")).unwrap();
        fs::write(dir.join("images/pages-1.img"), vec![3u8; CHUNK * 2 + 17]).unwrap();
        fs::write(dir.join("images/empty.img"), b"").unwrap();
        fs::write(dir.join("images/core-1.img"), b"core").unwrap();
        let files = seal_tree(dir, &[manifest::FILE_NAME]).unwrap();
        let m = NodeManifest::new(1, 1, "n1", files);
        manifest::write(dir, &m).unwrap()
    }

    fn chunks(src: &Path, digest: &str) -> (Vec<u8>, Vec<(u32, Vec<u8>)>) {
        let (bytes, m) = open_source(src, digest).unwrap();
        let mut out = Vec::new();
        send_files(src, &m, |i, c| {
            out.push((i, c));
            true
        })
        .unwrap();
        (bytes, out)
    }

    #[test]
    fn round_trip_is_complete_and_intact() {
        let d = tempfile::tempdir().unwrap();
        let (src, dest) = (d.path().join("a"), d.path().join("b"));
        let digest = sealed(&src);
        let (bytes, chunks) = chunks(&src, &digest);
        assert_eq!(
            chunks.len(),
            3 + 1 + 1,
            "2 MiB + 17 B in 3 chunks, one each for the others"
        );
        let mut r = Receiver::begin(&dest, bytes, &digest).unwrap();
        for (i, c) in &chunks {
            r.write(*i, c).unwrap();
        }
        let m = r.finish().unwrap();
        verify_tree(&dest, &m.files).unwrap();
        assert_eq!(manifest::read(&dest).unwrap().1, digest);
        assert!(dest.join("images/empty.img").is_file());
    }

    #[test]
    fn damaged_truncated_or_incomplete_streams_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let (src, dest) = (d.path().join("a"), d.path().join("b"));
        let digest = sealed(&src);
        let (bytes, good) = chunks(&src, &digest);

        // A flipped bit in transit.
        let mut r = Receiver::begin(&dest, bytes.clone(), &digest).unwrap();
        let mut bad = good.clone();
        bad[2].1[5] ^= 1;
        let err = bad
            .iter()
            .try_for_each(|(i, c)| r.write(*i, c))
            .and_then(|_| r.finish().map(|_| ()))
            .unwrap_err();
        assert!(matches!(err, StoreError::FileDigest { .. }), "{err}");
        assert!(!dest.join(manifest::FILE_NAME).exists());

        // The stream stops early: no manifest, an error naming the missing file.
        let mut r = Receiver::begin(&dest, bytes.clone(), &digest).unwrap();
        for (i, c) in &good[..2] {
            r.write(*i, c).unwrap();
        }
        assert!(r.finish().is_err());
        assert!(!dest.join(manifest::FILE_NAME).exists());

        // Chunks of a file that is not next.
        let mut r = Receiver::begin(&dest, bytes.clone(), &digest).unwrap();
        assert!(r.write(2, b"x").is_err());

        // Another attempt's manifest, or a damaged one, is refused before anything is written.
        assert!(matches!(
            Receiver::begin(&dest, bytes.clone(), &"00".repeat(32)).unwrap_err(),
            StoreError::NotCommitted { .. }
        ));
        let mut torn = bytes.clone();
        torn.truncate(bytes.len() - 3);
        assert!(Receiver::begin(&dest, torn, &digest).is_err());
    }

    #[test]
    fn a_committed_digest_is_required_at_both_ends() {
        let d = tempfile::tempdir().unwrap();
        let (src, dest) = (d.path().join("a"), d.path().join("b"));
        let digest = sealed(&src);
        let err = open_source(&src, "").unwrap_err();
        assert!(matches!(err, StoreError::DigestRequired { .. }), "{err}");
        assert!(err
            .to_string()
            .contains("committed manifest digest is required"));
        let (bytes, _) = chunks(&src, &digest);
        fs::create_dir_all(&dest).unwrap();
        fs::write(dest.join("keep"), b"x").unwrap();
        let err = Receiver::begin(&dest, bytes, "").unwrap_err();
        assert!(matches!(err, StoreError::DigestRequired { .. }), "{err}");
        assert!(
            dest.join("keep").exists(),
            "refused before anything was touched"
        );
    }

    /// A manifest that lists `path`, framed and intact, with its digest.
    fn forged(path: &str) -> (Vec<u8>, String) {
        let f = crate::digest::FileEntry {
            path: path.into(),
            size: 1,
            blake3: blake3::hash(b"x").to_hex().to_string(),
        };
        let bytes = manifest::encode(&NodeManifest::new(1, 1, "n1", vec![f]));
        let digest = blake3::hash(&bytes).to_hex().to_string();
        (bytes, digest)
    }

    #[test]
    fn a_manifest_with_an_escaping_path_is_refused_before_anything_is_written() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("deep/b");
        for bad in [
            "../escaped",
            "/tmp/escaped",
            "images/../../escaped",
            "a//b",
            "x\0",
        ] {
            let (bytes, digest) = forged(bad);
            let err = Receiver::begin(&dest, bytes, &digest).unwrap_err();
            assert!(
                matches!(err, StoreError::UnsafePath { .. }),
                "{bad:?}: {err}"
            );
            assert!(!dest.exists(), "{bad:?}: destination created");
        }
        assert!(!d.path().join("deep/escaped").exists());
        // Nor does a sender read a path a caller-built manifest gives it.
        let m = NodeManifest::new(
            1,
            1,
            "n1",
            vec![crate::digest::FileEntry {
                path: "../../etc/passwd".into(),
                size: 1,
                blake3: String::new(),
            }],
        );
        let err = send_files(&dest, &m, |_, _| true).unwrap_err();
        assert!(matches!(err, StoreError::UnsafePath { .. }), "{err}");
    }

    #[test]
    fn a_damaged_source_is_not_sent_whole() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("a");
        let digest = sealed(&src);
        let p = src.join("images/pages-1.img");
        let mut b = fs::read(&p).unwrap();
        b[CHUNK + 3] ^= 1;
        fs::write(&p, b).unwrap();
        let (_, m) = open_source(&src, &digest).unwrap();
        let mut sent = 0;
        let err = send_files(&src, &m, |_, _| {
            sent += 1;
            true
        })
        .unwrap_err();
        assert!(matches!(err, StoreError::FileDigest { .. }), "{err}");
        // core and empty, then 2 of the 3 chunks of the damaged file: its last is held back.
        assert_eq!(sent, 4);
    }
}
