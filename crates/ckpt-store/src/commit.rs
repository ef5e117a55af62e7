//! The global commit record of an epoch in shared storage, `<shared>/<job>/<epoch>/COMMIT`.
//!
//! Written last, once every node's flushed copy is complete: it lists each node's manifest
//! digest, so a shared copy can be recognised as a complete, committed checkpoint without the
//! coordinator's database. Same frame as the node manifest (see [`crate::manifest`]) with magic
//! `CKPTCMIT`. A record is only read or written with valid node names and digests ([`check`]).
use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::manifest::{decode_framed_json, encode_framed, read_capped};
use crate::{atomic, error, validate, Result, StoreError};

/// Magic bytes at the start of every commit record.
pub const MAGIC: &[u8; 8] = b"CKPTCMIT";
/// File name of the commit record inside an epoch directory.
pub const FILE_NAME: &str = "COMMIT";

/// What a committed epoch consists of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitRecord {
    /// Job id.
    pub job_id: u64,
    /// Epoch number.
    pub epoch: u32,
    /// BLAKE3 hex digest of each node's MANIFEST, by node name.
    pub manifests: BTreeMap<String, String>,
    /// Total image bytes over all nodes.
    pub image_bytes: u64,
    /// When the epoch was committed, in milliseconds since the Unix epoch.
    pub committed_unix_ms: u64,
}

/// Encodes a commit record into its on-disk bytes.
pub fn encode(r: &CommitRecord) -> Vec<u8> {
    encode_framed(
        MAGIC,
        &serde_json::to_vec(r).expect("commit record serializes"),
    )
}

/// Decodes on-disk bytes; `path` only names the file in errors. Refuses a record that
/// [`check`] refuses.
pub fn decode(path: &Path, bytes: &[u8]) -> Result<CommitRecord> {
    decode_framed_json(path, MAGIC, bytes, check)
}

/// Checks that every node name of a record is a valid node name (it is a directory name in
/// shared storage) and every digest a BLAKE3 hex digest (an empty one would check nothing).
/// `path` names the record in errors.
pub fn check(path: &Path, r: &CommitRecord) -> Result<()> {
    for (node, digest) in &r.manifests {
        error::check_node(path, node)?;
        if !validate::is_hex_digest(digest) {
            return Err(StoreError::BadDigest {
                path: path.to_path_buf(),
                node: node.clone(),
                shown: validate::shown(digest),
            });
        }
    }
    Ok(())
}

/// Writes the record atomically as `epoch_dir/COMMIT`; refuses (writing nothing) a record that
/// [`check`] refuses.
pub fn write(epoch_dir: &Path, r: &CommitRecord) -> Result<()> {
    let path = epoch_dir.join(FILE_NAME);
    check(&path, r)?;
    atomic::write_file(&path, &encode(r))
}

/// Reads and checks `epoch_dir/COMMIT`.
pub fn read(epoch_dir: &Path) -> Result<CommitRecord> {
    let path = epoch_dir.join(FILE_NAME);
    decode(
        &path,
        &read_capped(&path, crate::manifest::MAX_MANIFEST_BYTES)?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CommitRecord {
        CommitRecord {
            job_id: 3,
            epoch: 4,
            manifests: [("n1".to_string(), "ab".repeat(32))].into(),
            image_bytes: 99,
            committed_unix_ms: 5,
        }
    }

    #[test]
    fn round_trip_and_damage_is_rejected() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), &sample()).unwrap();
        assert_eq!(read(d.path()).unwrap(), sample());
        let bytes = encode(&sample());
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(decode(Path::new("C"), &b).is_err(), "flip at {i} accepted");
        }
        for len in 0..bytes.len() {
            assert!(decode(Path::new("C"), &bytes[..len]).is_err());
        }
    }

    #[test]
    fn a_manifest_is_not_a_commit_record() {
        let m = crate::manifest::encode_framed(crate::manifest::MAGIC, b"{}");
        assert!(matches!(
            decode(Path::new("C"), &m).unwrap_err(),
            StoreError::BadMagic { .. }
        ));
    }
}
