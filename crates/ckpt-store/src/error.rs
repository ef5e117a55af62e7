//! Errors of the storage layer. Every variant names the file it is about.
//!
//! Also the checks of [`crate::validate`] as this crate applies them to a name or path read
//! from a file or a peer, refusing with an error that names the file or directory: they live
//! here, above `validate`, whose own checks return its refusal types and know no `StoreError`.
use std::path::{Path, PathBuf};

use crate::validate;

/// What went wrong with a stored file or directory.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An I/O call failed; `op` says which step.
    #[error("{op} {path}: {source}")]
    Io {
        /// The step that failed ("open", "write", "fsync", "rename", ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the expected magic bytes.
    #[error("{path}: not a ckpt manifest or commit record (bad magic)")]
    BadMagic {
        /// The file.
        path: PathBuf,
    },
    /// The file was written by a newer, unknown format version.
    #[error("{path}: manifest format version {version} is not supported (this build reads up to {supported})")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// Version found in the header.
        version: u16,
        /// Newest version this build reads.
        supported: u16,
    },
    /// The file is shorter than its header says (a torn or truncated write).
    #[error("{path}: truncated (expected {expected} bytes, found {actual})")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Expected length.
        expected: u64,
        /// Actual length.
        actual: u64,
    },
    /// The file is larger than any valid file of its kind.
    #[error("{path}: {size} bytes is larger than the limit of {limit} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The checksum stored in the file does not match its content.
    #[error("{path}: checksum mismatch (the file is corrupt)")]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
    },
    /// The manifest body is not valid.
    #[error("{path}: cannot decode manifest: {source}")]
    Decode {
        /// The file.
        path: PathBuf,
        /// Decoder error.
        #[source]
        source: serde_json::Error,
    },
    /// A file listed in a manifest is missing.
    #[error("{path}: image file is missing")]
    FileMissing {
        /// The file.
        path: PathBuf,
    },
    /// A file listed in a manifest has the wrong size.
    #[error("{path}: image file has {actual} bytes, the manifest says {expected}")]
    FileSize {
        /// The file.
        path: PathBuf,
        /// Size in the manifest.
        expected: u64,
        /// Size on disk.
        actual: u64,
    },
    /// A file listed in a manifest has the wrong digest.
    #[error("{path}: image file digest mismatch (the file is corrupt)")]
    FileDigest {
        /// The file.
        path: PathBuf,
    },
    /// A manifest is intact but is not the one the coordinator committed (images of another
    /// attempt at the same epoch number).
    #[error("{path}: manifest digest {found} is not the committed one ({expected}); these images are not the committed checkpoint")]
    NotCommitted {
        /// The manifest.
        path: PathBuf,
        /// Digest of the file found.
        found: String,
        /// Digest the coordinator committed.
        expected: String,
    },
    /// A check against the committed manifest digest was asked for without a digest: without
    /// one, any intact manifest would pass.
    #[error("{path}: a committed manifest digest is required to accept these images, and none was given")]
    DigestRequired {
        /// The manifest that was to be checked.
        path: PathBuf,
    },
    /// A file, a peer or a caller named a file with a path that is not allowed (it could
    /// lead outside the directory it belongs to, or it is malformed).
    #[error("{path}: {source}")]
    UnsafePath {
        /// The file the path was read from, or the directory it was to be joined onto.
        path: PathBuf,
        /// The path and what is wrong with it.
        #[source]
        source: validate::InvalidPath,
    },
    /// A file, a peer or a caller named a node with a name that is not allowed as a directory
    /// name.
    #[error("{path}: {source}")]
    UnsafeName {
        /// The file the name was read from, or the directory it was to be joined onto.
        path: PathBuf,
        /// The name and what is wrong with it.
        #[source]
        source: validate::InvalidName,
    },
    /// A count, length or size in a file is above what any valid file of its kind holds.
    #[error("{path}: {what} {value} is above the limit of {limit}")]
    LimitExceeded {
        /// The file.
        path: PathBuf,
        /// What was counted or measured ("file count", "chunk length", ...).
        what: &'static str,
        /// The value found.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// A manifest's pre-copy chain names something other than the node directory's links.
    #[error("{path}: bad pre-copy chain entry {entry:?}: the chain lists pre/1, pre/2, ... oldest first")]
    BadChain {
        /// The manifest, or the path found where a link was expected.
        path: PathBuf,
        /// The entry (truncated), or what was found.
        entry: String,
    },
    /// A digest in a file is not a BLAKE3 hex digest.
    #[error("{path}: the manifest digest of node {node} is {shown}, not a BLAKE3 digest (64 lowercase hex digits)")]
    BadDigest {
        /// The file.
        path: PathBuf,
        /// The node whose digest it is.
        node: String,
        /// The digest, escaped and truncated for display.
        shown: String,
    },
}

impl StoreError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StoreError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// `dir` joined with `rel`, a path from a file or a peer; refused unless
/// [`validate::relative_path`] accepts it. The error names `dir`.
pub(crate) fn join_relative(dir: &Path, rel: &str) -> Result<PathBuf, StoreError> {
    validate::relative_path(rel)
        .map(|p| dir.join(p))
        .map_err(|source| StoreError::UnsafePath {
            path: dir.to_path_buf(),
            source,
        })
}

/// `dir` joined with `name`, a file name from a file or a peer; refused unless
/// [`validate::file_name`] accepts it. The error names `dir`.
pub(crate) fn join_file_name(dir: &Path, name: &str) -> Result<PathBuf, StoreError> {
    validate::file_name(name)
        .map(|n| dir.join(n))
        .map_err(|source| StoreError::UnsafePath {
            path: dir.to_path_buf(),
            source,
        })
}

/// [`validate::node_name`], with the error naming `context` (the file or directory the name is
/// for).
pub(crate) fn check_node(context: &Path, node: &str) -> Result<(), StoreError> {
    validate::node_name(node)
        .map(drop)
        .map_err(|source| StoreError::UnsafeName {
            path: context.to_path_buf(),
            source,
        })
}
