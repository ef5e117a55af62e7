//! The per-node manifest: which files make up a node's part of an epoch, their sizes and
//! digests, and what the restore needs besides the images.
//!
//! On-disk format (version 1, all integers little-endian; see `docs/formats.md`):
//!
//! ```text
//! offset  size  field
//! 0       8     magic  "CKPTMNFT"
//! 8       2     format version (1)
//! 10      2     reserved, 0
//! 12      4     body length N
//! 16      N     body: JSON of [`NodeManifest`]
//! 16+N    32    BLAKE3 of bytes 0 .. 16+N
//! ```
//!
//! Written with [`crate::atomic::write_file`]; read with a size cap, so a torn, truncated,
//! oversized or bit-flipped manifest is refused with an error naming the file. Decoding also
//! checks every path and name in it ([`check`]): a manifest is never trusted to stay inside
//! the directory it describes.
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::digest::FileEntry;
use crate::{atomic, error, validate, Result, StoreError};

/// Magic bytes at the start of every manifest.
pub const MAGIC: &[u8; 8] = b"CKPTMNFT";
/// Newest format version this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;
/// Largest manifest accepted: a manifest lists files, it never holds image data.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// File name of the manifest inside a node's image directory.
pub use crate::layout::MANIFEST_FILE as FILE_NAME;
/// Most image files a node's part of an epoch may have (manifest and recipe alike). CRIU
/// writes a few files per process; a 64 MiB manifest cannot list many more than half a
/// million files anyway.
pub const MAX_FILES: usize = 1 << 20;
/// Largest total of image bytes of one node (1 EiB): any real total is far below it, and sums
/// of sizes below it cannot overflow.
pub const MAX_IMAGE_BYTES: u64 = 1 << 60;

const HEADER: usize = 16;
const TRAILER: usize = 32;

/// A regular file the job had open for writing, with its size at checkpoint time.
///
/// The snapshot engine refuses to restore a process whose open file changed size; the agent
/// truncates each of these back before restoring.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenFile {
    /// Absolute path.
    pub path: String,
    /// Size at checkpoint time.
    pub size: u64,
}

/// A file outside the images that the engine does not save but the job needs at restore
/// (for example Open MPI's shared-memory segments); saved under `extra/` in the image dir.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreservedFile {
    /// Absolute path the file is put back to.
    pub path: String,
    /// Path relative to the image directory where the copy is.
    pub saved_as: String,
    /// Permission bits.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// A named pipe: recreated with mkfifo, nothing is copied (`saved_as` is empty).
    #[serde(default)]
    pub fifo: bool,
}

/// Everything about one node's part of one epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeManifest {
    /// Job id.
    pub job_id: u64,
    /// Epoch number.
    pub epoch: u32,
    /// Node name.
    pub node: String,
    /// Snapshot engine that wrote the images ("criu").
    pub engine: String,
    /// Version of that engine.
    pub engine_version: String,
    /// When the dump finished, in milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// PID of the root of the dumped process tree.
    pub root_pid: i32,
    /// Every PID in the dumped tree: all must be free before a restore.
    #[serde(default)]
    pub pids: Vec<i32>,
    /// Thread IDs of those processes other than their main threads: they must be free too.
    #[serde(default)]
    pub tids: Vec<i32>,
    /// Image files, sorted by path.
    pub files: Vec<FileEntry>,
    /// Files open for writing, with their sizes at checkpoint time.
    #[serde(default)]
    pub open_files: Vec<OpenFile>,
    /// Files saved beside the images and put back before restore.
    #[serde(default)]
    pub preserved: Vec<PreservedFile>,
    /// Local TCP ports of the job's sockets: stale TIME_WAIT entries on them (left when the
    /// job was killed) would keep the restored connections from binding.
    #[serde(default)]
    pub tcp_ports: Vec<u16>,
    /// Local addresses of the job's TCP sockets (other than loopback and wildcard): the
    /// restored connections need them configured on the node again.
    #[serde(default)]
    pub tcp_addrs: Vec<String>,
    /// Free-form facts for operators (engine flags, timings).
    #[serde(default)]
    pub notes: BTreeMap<String, String>,
    /// The pre-copy chain below `images/`, oldest first (`pre/1`, `pre/2`, ...; see
    /// [`crate::chain`]); empty for a full dump. Left out when empty, so that a full dump's
    /// manifest reads the same as before chains existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chain: Vec<String>,
}

impl NodeManifest {
    /// A manifest listing `files`, with nothing else recorded (tools and tests; the agent fills
    /// in every field).
    pub fn new(job_id: u64, epoch: u32, node: &str, files: Vec<FileEntry>) -> Self {
        NodeManifest {
            job_id,
            epoch,
            node: node.to_string(),
            engine: "criu".into(),
            engine_version: String::new(),
            created_unix_ms: 0,
            root_pid: 0,
            pids: Vec::new(),
            tids: Vec::new(),
            files,
            open_files: Vec::new(),
            preserved: Vec::new(),
            tcp_ports: Vec::new(),
            tcp_addrs: Vec::new(),
            notes: BTreeMap::new(),
            chain: Vec::new(),
        }
    }

    /// Total bytes of image files.
    pub fn image_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// Encodes a manifest into its on-disk bytes.
pub fn encode(m: &NodeManifest) -> Vec<u8> {
    encode_framed(MAGIC, &serde_json::to_vec(m).expect("manifest serializes"))
}

/// Decodes on-disk bytes; `path` only names the file in errors. Refuses a manifest that
/// [`check`] refuses.
pub fn decode(path: &Path, bytes: &[u8]) -> Result<NodeManifest> {
    decode_framed_json(path, MAGIC, bytes, check)
}

/// Checks what a manifest makes a reader do with paths and names: the node name
/// ([`validate::node_name`]), every image file path and every `saved_as`
/// ([`validate::relative_path`]), every host path a restore puts back
/// ([`validate::absolute_path`]), at most [`MAX_FILES`] files of at most [`MAX_IMAGE_BYTES`] in
/// total. `path` names the manifest in errors.
pub fn check(path: &Path, m: &NodeManifest) -> Result<()> {
    let unsafe_path = |source| StoreError::UnsafePath {
        path: path.to_path_buf(),
        source,
    };
    error::check_node(path, &m.node)?;
    if m.files.len() > MAX_FILES {
        return Err(StoreError::LimitExceeded {
            path: path.to_path_buf(),
            what: "file count",
            value: m.files.len() as u64,
            limit: MAX_FILES as u64,
        });
    }
    let mut total = 0u64;
    for f in &m.files {
        validate::relative_path(&f.path).map_err(unsafe_path)?;
        total = total.saturating_add(f.size);
    }
    if total > MAX_IMAGE_BYTES {
        return Err(StoreError::LimitExceeded {
            path: path.to_path_buf(),
            what: "total image bytes",
            value: total,
            limit: MAX_IMAGE_BYTES,
        });
    }
    for f in &m.open_files {
        validate::absolute_path(&f.path).map_err(unsafe_path)?;
    }
    crate::chain::check(path, &m.chain)?;
    for p in &m.preserved {
        validate::absolute_path(&p.path).map_err(unsafe_path)?;
        // A named pipe is recreated, not copied: it has no saved copy.
        if !(p.fifo && p.saved_as.is_empty()) {
            validate::relative_path(&p.saved_as).map_err(unsafe_path)?;
        }
    }
    Ok(())
}

/// Frames `body` as magic, version, length, body, BLAKE3 trailer (the layout above; the commit
/// record uses it with its own magic).
pub(crate) fn encode_framed(magic: &[u8; 8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + body.len() + TRAILER);
    out.extend_from_slice(magic);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

/// Decodes a framed JSON record (a manifest, or with its own magic a commit record): checks the
/// frame, parses the body and refuses what `check` refuses. `path` only names the file in
/// errors.
pub(crate) fn decode_framed_json<T: serde::de::DeserializeOwned>(
    path: &Path,
    magic: &[u8; 8],
    bytes: &[u8],
    check: fn(&Path, &T) -> Result<()>,
) -> Result<T> {
    let body = decode_framed(path, magic, bytes)?;
    let v = serde_json::from_slice(body).map_err(|source| StoreError::Decode {
        path: path.to_path_buf(),
        source,
    })?;
    check(path, &v)?;
    Ok(v)
}

/// Checks the frame of on-disk bytes and returns the body.
pub(crate) fn decode_framed<'a>(path: &Path, magic: &[u8; 8], bytes: &'a [u8]) -> Result<&'a [u8]> {
    let path_buf = || path.to_path_buf();
    if bytes.len() < HEADER || &bytes[..8] != magic {
        return Err(StoreError::BadMagic { path: path_buf() });
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    if version == 0 || version > FORMAT_VERSION {
        return Err(StoreError::UnsupportedVersion {
            path: path_buf(),
            version,
            supported: FORMAT_VERSION,
        });
    }
    let body_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    let expected = HEADER + body_len + TRAILER;
    if bytes.len() < expected {
        return Err(StoreError::Truncated {
            path: path_buf(),
            expected: expected as u64,
            actual: bytes.len() as u64,
        });
    }
    if bytes.len() > expected {
        return Err(StoreError::ChecksumMismatch { path: path_buf() });
    }
    let sum = blake3::hash(&bytes[..HEADER + body_len]);
    if sum.as_bytes() != &bytes[HEADER + body_len..] {
        return Err(StoreError::ChecksumMismatch { path: path_buf() });
    }
    Ok(&bytes[HEADER..HEADER + body_len])
}

/// Reads a framed file whole, refusing one over `limit` bytes.
pub(crate) fn read_capped(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let f = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => StoreError::FileMissing {
            path: path.to_path_buf(),
        },
        _ => StoreError::io("open", path, e),
    })?;
    let size = f
        .metadata()
        .map_err(|e| StoreError::io("stat", path, e))?
        .len();
    if size > limit {
        return Err(StoreError::TooLarge {
            path: path.to_path_buf(),
            size,
            limit,
        });
    }
    let mut bytes = Vec::with_capacity(size as usize);
    f.take(limit)
        .read_to_end(&mut bytes)
        .map_err(|e| StoreError::io("read", path, e))?;
    Ok(bytes)
}

/// Writes `m` atomically as `dir/MANIFEST` and returns the BLAKE3 hex digest of the file.
/// Refuses (writing nothing) a manifest that [`check`] refuses, so no epoch is sealed with a
/// manifest its restore would refuse.
pub fn write(dir: &Path, m: &NodeManifest) -> Result<String> {
    let path = dir.join(FILE_NAME);
    check(&path, m)?;
    let bytes = encode(m);
    atomic::write_file(&path, &bytes)?;
    Ok(blake3::hash(&bytes).to_hex().to_string())
}

/// Reads and checks `dir/MANIFEST`; returns it with the BLAKE3 hex digest of the file.
pub fn read(dir: &Path) -> Result<(NodeManifest, String)> {
    let path = dir.join(FILE_NAME);
    let bytes = read_capped(&path, MAX_MANIFEST_BYTES)?;
    let m = decode(&path, &bytes)?;
    Ok((m, blake3::hash(&bytes).to_hex().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> NodeManifest {
        NodeManifest {
            job_id: 7,
            epoch: 2,
            node: "n1".into(),
            engine: "criu".into(),
            engine_version: "4.2.1".into(),
            created_unix_ms: 1,
            root_pid: 100,
            pids: vec![100, 101],
            tids: vec![102],
            files: vec![FileEntry {
                path: "criu/core-100.img".into(),
                size: 4,
                blake3: "00".repeat(32),
            }],
            open_files: vec![OpenFile {
                path: "/tmp/out".into(),
                size: 10,
            }],
            preserved: vec![],
            tcp_ports: vec![4000],
            tcp_addrs: vec!["10.0.0.1".into()],
            notes: BTreeMap::new(),
            chain: Vec::new(),
        }
    }

    #[test]
    fn round_trip_and_digest_is_stable() {
        let d = tempfile::tempdir().unwrap();
        let digest = write(d.path(), &sample()).unwrap();
        let (m, digest2) = read(d.path()).unwrap();
        assert_eq!(m, sample());
        assert_eq!(digest, digest2);
    }

    #[test]
    fn every_single_bit_flip_is_rejected() {
        let bytes = encode(&sample());
        let p = Path::new("MANIFEST");
        for i in 0..bytes.len() {
            for bit in [0u8, 3, 7] {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                assert!(
                    decode(p, &b).is_err(),
                    "flip at byte {i} bit {bit} accepted"
                );
            }
        }
    }

    #[test]
    fn every_truncation_is_rejected() {
        let bytes = encode(&sample());
        for len in 0..bytes.len() {
            assert!(
                decode(Path::new("M"), &bytes[..len]).is_err(),
                "truncated to {len} accepted"
            );
        }
    }

    #[test]
    fn trailing_garbage_and_future_versions_are_rejected() {
        let mut b = encode(&sample());
        b.push(0);
        assert!(decode(Path::new("M"), &b).is_err());
        let mut b = encode(&sample());
        b[8] = 9;
        let err = decode(Path::new("M"), &b).unwrap_err();
        assert!(
            matches!(err, StoreError::UnsupportedVersion { version: 9, .. }),
            "{err}"
        );
    }

    #[test]
    fn missing_manifest_is_named() {
        let d = tempfile::tempdir().unwrap();
        let err = read(d.path()).unwrap_err();
        assert!(matches!(err, StoreError::FileMissing { .. }));
        assert!(err.to_string().contains("MANIFEST"));
    }
}
