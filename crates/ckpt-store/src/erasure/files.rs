//! A member's sealed node directory as the byte stream the code protects, and the way back from
//! a rebuilt stream to a node directory, verified.
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{ParityShard, Scheme};
use crate::manifest::NodeManifest;
use crate::stream::{self, Receiver, CHUNK};
use crate::{error, Result, StoreError};

/// A group member as the encoding record keeps it: enough to rebuild its node directory with
/// nothing of the member left.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncodedMember {
    /// The node whose images these are.
    pub node: String,
    /// Its stream's length: the manifest file and every file it lists.
    pub stream_len: u64,
    /// The manifest file's length (the stream starts with it).
    pub manifest_len: u64,
    /// The committed digest of its manifest.
    pub manifest_digest: String,
}

/// What an epoch's encoding of one group committed: the scheme, the members in layout order,
/// and every parity shard with its holder and digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Encoding {
    /// The scheme, as written in the configuration (`xor:8`, `rs:4+2`).
    pub scheme: String,
    /// The group's members, in layout order.
    pub members: Vec<EncodedMember>,
    /// The parity shards.
    pub parity: Vec<ParityShard>,
}

impl Encoding {
    /// The scheme and layout the record describes, checked: a record that names an unknown
    /// scheme, members that do not fit it, or shards the layout does not have is refused.
    pub fn layout(&self) -> std::result::Result<(Scheme, super::Layout), String> {
        let scheme: Scheme = self.scheme.parse()?;
        let lens: Vec<u64> = self.members.iter().map(|m| m.stream_len).collect();
        let layout = super::Layout::new(scheme.parity(), &lens)?;
        for s in &self.parity {
            if s.row >= layout.members()
                || layout.holders(s.row).get(s.index) != Some(&s.holder)
                || s.size != layout.row_size(s.row)
            {
                return Err(format!(
                    "parity shard {} of row {} (held by member {}, {} bytes) does not fit a \
                     group of {} under {}",
                    s.index,
                    s.row,
                    s.holder,
                    s.size,
                    layout.members(),
                    self.scheme
                ));
            }
        }
        Ok((scheme, layout))
    }
}

/// A sealed node directory read as one stream: the manifest file, then each listed file in
/// manifest order.
#[derive(Debug)]
pub struct NodeStream {
    dir: PathBuf,
    manifest_bytes: Vec<u8>,
    manifest: NodeManifest,
    /// Where each file starts in the stream.
    starts: Vec<u64>,
    len: u64,
    open: Option<(usize, File)>,
}

impl NodeStream {
    /// The stream of the node directory `dir`, whose manifest must have the committed digest.
    /// The files are read as they are: [`NodeStream::verify`] checks them first.
    pub fn open(dir: &Path, committed: &str) -> Result<NodeStream> {
        let (manifest_bytes, manifest) = stream::open_source(dir, committed)?;
        let mut at = manifest_bytes.len() as u64;
        let mut starts = Vec::with_capacity(manifest.files.len());
        for f in &manifest.files {
            starts.push(at);
            at += f.size;
        }
        Ok(NodeStream {
            dir: dir.to_path_buf(),
            manifest_bytes,
            manifest,
            starts,
            len: at,
            open: None,
        })
    }

    /// Checks every file against the manifest (size and digest).
    pub fn verify(&self) -> Result<()> {
        crate::digest::verify_tree(&self.dir, &self.manifest.files)
    }

    /// The stream's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The manifest file's length (the stream starts with it).
    pub fn manifest_len(&self) -> u64 {
        self.manifest_bytes.len() as u64
    }

    /// Whether the stream is empty (never: it holds the manifest).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The record of this member for the encoding.
    pub fn member(&self, node: &str, committed: &str) -> EncodedMember {
        EncodedMember {
            node: node.to_string(),
            stream_len: self.len,
            manifest_len: self.manifest_len(),
            manifest_digest: committed.to_string(),
        }
    }

    /// Fills `buf` from `offset` of the stream; reading past its end is an error.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let end = offset + buf.len() as u64;
        if end > self.len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: stream is {} bytes, read to {end}",
                    self.dir.display(),
                    self.len
                ),
            ));
        }
        let mut at = offset;
        let mut done = 0;
        while done < buf.len() {
            let mlen = self.manifest_bytes.len() as u64;
            if at < mlen {
                let n = ((mlen - at) as usize).min(buf.len() - done);
                buf[done..done + n]
                    .copy_from_slice(&self.manifest_bytes[at as usize..at as usize + n]);
                done += n;
                at += n as u64;
                continue;
            }
            // The file holding `at`: the last that starts at or before it and is not empty.
            let i = self.starts.partition_point(|&s| s <= at) - 1;
            let (start, size) = (self.starts[i], self.manifest.files[i].size);
            let n = ((start + size - at) as usize).min(buf.len() - done);
            let f = self.file(i)?;
            f.read_exact_at(&mut buf[done..done + n], at - start)?;
            done += n;
            at += n as u64;
        }
        Ok(())
    }

    fn file(&mut self, i: usize) -> std::io::Result<&File> {
        if self.open.as_ref().map(|(j, _)| *j) != Some(i) {
            let path = error::join_relative(&self.dir, &self.manifest.files[i].path)
                .map_err(std::io::Error::other)?;
            self.open = Some((i, File::open(&path)?));
        }
        Ok(&self.open.as_ref().expect("just opened").1)
    }
}

/// Unpacks a rebuilt stream (read through `read(offset, buf)`) of `member` into `dest`
/// (replaced): its manifest is checked against the committed digest before anything is
/// written, and every file against the manifest as it is written ([`Receiver`]), so a wrong
/// rebuild is refused, not restored.
pub fn unpack(
    read: &mut dyn FnMut(u64, &mut [u8]) -> std::io::Result<()>,
    member: &EncodedMember,
    dest: &Path,
) -> Result<NodeManifest> {
    let io = |op: &'static str, e: std::io::Error| StoreError::io(op, dest, e);
    if member.manifest_len > crate::manifest::MAX_MANIFEST_BYTES {
        return Err(io(
            "rebuild",
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a manifest of {} bytes", member.manifest_len),
            ),
        ));
    }
    let mut manifest_bytes = vec![0u8; member.manifest_len as usize];
    read(0, &mut manifest_bytes).map_err(|e| io("read rebuilt manifest", e))?;
    let mut r = Receiver::begin(dest, manifest_bytes, &member.manifest_digest)?;
    let files: Vec<u64> = r.manifest().files.iter().map(|f| f.size).collect();
    let mut at = member.manifest_len;
    let mut buf = vec![0u8; CHUNK];
    for (i, size) in files.into_iter().enumerate() {
        if size == 0 {
            r.write(i as u32, &[])?;
        }
        let mut left = size;
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            read(at, &mut buf[..n]).map_err(|e| io("read rebuilt stream", e))?;
            r.write(i as u32, &buf[..n])?;
            at += n as u64;
            left -= n as u64;
        }
    }
    if at != member.stream_len {
        return Err(io(
            "rebuild",
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the manifest lists {at} bytes of stream, the record {}",
                    member.stream_len
                ),
            ),
        ));
    }
    r.finish()
}
