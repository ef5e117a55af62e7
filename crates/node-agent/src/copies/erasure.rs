//! Erasure-coded copies (`[redundancy] scheme = "xor:G"` or `"rs:K+M"` in ckptd.toml): after
//! commit, each member of a group computes the parity of the rows it holds from the other
//! members' images, read by range over `Agent.ReadSegment` with the coordinator's grants, and
//! keeps it in its staging (`<local_dir>/<job>/<epoch>/parity/<row>.<index>`); a node that
//! restores a lost member's part rebuilds its images from the members left and their parity,
//! and unpacks them verified against the committed manifest ([`ckpt_store::erasure`]).
//!
//! The coding runs in a blocking thread; its reads of other nodes go through the async client
//! from there, read ahead in blocks of [`MAX_SEGMENT_READ`] ([`super::read_ahead`]).
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_client::AgentClient;
use ckpt_store::erasure::{self, Encoding, Layout, Losses, NodeStream, ParityShard, Scheme};
use ckpt_store::manifest::NodeManifest;
use tonic::transport::Channel;
use tracing::{info, warn};

use super::read_ahead::{read_remote, ReadAhead, MAX_SEGMENT_READ};
use super::{install, Location, Usable};
use crate::error::AgentError;
use crate::node::Node;

/// Encodes started by this agent, naming their files in progress.
static ENCODES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The largest encoding record a restore request may carry.
pub const MAX_ENCODING_JSON: usize = 1 << 20;

/// A member of a group as the coordinator names it.
#[derive(Debug, Clone)]
pub struct Member {
    /// Its node.
    pub node: String,
    /// Its agent's host:port.
    pub address: String,
    /// The committed digest of its manifest.
    pub digest: String,
}

/// What an encode produced: the parity shards this node holds, and every member's stream and
/// manifest lengths as read.
#[derive(Debug)]
pub struct Encoded {
    /// This node's shards.
    pub shards: Vec<ParityShard>,
    /// Stream lengths, in layout order.
    pub stream_lens: Vec<u64>,
    /// Manifest lengths, in layout order.
    pub manifest_lens: Vec<u64>,
}

fn failed(job: u64, epoch: u32, message: impl std::fmt::Display) -> AgentError {
    AgentError::Erasure {
        job,
        epoch,
        message: message.to_string(),
    }
}

/// Where a node keeps the parity it holds of an epoch.
pub(crate) fn parity_dir(node: &Node, job: u64, epoch: u32) -> PathBuf {
    node.staging.epoch_dir(job, epoch).join("parity")
}

fn parity_path(dir: &Path, row: usize, index: usize) -> PathBuf {
    dir.join(format!("{row}.{index}"))
}

/// How a member's bytes are reached: here, or over its agent.
enum Source {
    Local(Box<NodeStream>),
    Remote(Box<ReadAhead>),
}

impl Node {
    /// Connects to each member (this node's own images read here), learning every member's
    /// stream and manifest lengths. A member that cannot be reached is `None` with why.
    async fn sources(
        &self,
        job: u64,
        epoch: u32,
        members: &[Member],
        skip: Option<usize>,
    ) -> Vec<Result<(Source, u64, u64), String>> {
        let mut out = Vec::with_capacity(members.len());
        for (i, m) in members.iter().enumerate() {
            let r = if Some(i) == skip {
                Err("lost".to_string())
            } else if m.node == self.name {
                let dir = self.staging.node_dir(job, epoch, &m.node);
                let digest = m.digest.clone();
                tokio::task::spawn_blocking(move || NodeStream::open(&dir, &digest))
                    .await
                    .expect("open task")
                    .map(|s| {
                        let ml = s.manifest_len();
                        let len = s.len();
                        (Source::Local(Box::new(s)), len, ml)
                    })
                    .map_err(|e| e.to_string())
            } else {
                match crate::rpc::partner::connect(
                    job,
                    &m.node,
                    &m.address,
                    self.credential.as_ref(),
                )
                .await
                {
                    // Named by the caller: "member n5: its agent: cannot reach ...".
                    Err(AgentError::Partner { message, .. }) => Err(message),
                    Err(e) => Err(e.to_string()),
                    Ok(mut c) => {
                        let probe = pb::SegmentRequest {
                            job_id: job,
                            epoch,
                            node: m.node.clone(),
                            manifest_digest: m.digest.clone(),
                            ..Default::default()
                        };
                        match read_remote(&mut c, probe.clone()).await {
                            Ok((len, ml, _)) => Ok((
                                Source::Remote(Box::new(ReadAhead::new(c, probe, len))),
                                len,
                                ml,
                            )),
                            Err(s) => Err(s.message().to_string()),
                        }
                    }
                }
            };
            out.push(r);
        }
        out
    }

    /// `Agent.Encode`: the parity of the rows of the group this node holds, written into its
    /// staging; every other member must be readable.
    pub async fn encode(
        &self,
        job: u64,
        epoch: u32,
        scheme: &str,
        members: Vec<Member>,
    ) -> Result<Encoded, AgentError> {
        self.failpoint(job, "encode").await?;
        let scheme: Scheme = scheme.parse().map_err(|e| failed(job, epoch, e))?;
        let code = scheme
            .code()
            .ok_or_else(|| failed(job, epoch, "partner copies are not encoded"))?;
        let me = members
            .iter()
            .position(|m| m.node == self.name)
            .ok_or_else(|| {
                failed(
                    job,
                    epoch,
                    format!("node {} is not in the group", self.name),
                )
            })?;
        check_members(job, epoch, &members)?;
        let mut sources = Vec::new();
        let (mut lens, mut mlens) = (Vec::new(), Vec::new());
        for (m, r) in members
            .iter()
            .zip(self.sources(job, epoch, &members, None).await)
        {
            let (s, len, ml) =
                r.map_err(|e| failed(job, epoch, format!("member {}: {e}", m.node)))?;
            sources.push(s);
            lens.push(len);
            mlens.push(ml);
        }
        let layout = Layout::new(scheme.parity(), &lens).map_err(|e| failed(job, epoch, e))?;
        let dir = parity_dir(self, job, epoch);
        let held: Vec<(usize, usize)> = (0..layout.members())
            .filter_map(|r| {
                layout
                    .holders(r)
                    .iter()
                    .position(|&h| h == me)
                    .map(|j| (r, j))
            })
            .collect();
        let handle = tokio::runtime::Handle::current();
        let progress = ckpt_store::copy::CopyProgress::pausing_on(self.frozen.clone());
        // The flush's bandwidth limit bounds what an encode reads too.
        let throttle = self
            .copy_opts
            .bandwidth
            .map(ckpt_store::copy::Throttle::new);
        // At the lowest CPU priority: the job on this node computes first.
        let task =
            crate::os::background::run("encode", move || -> Result<Vec<ParityShard>, String> {
                fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                let mut coder = erasure::Coder::new(code);
                let mut out = Vec::new();
                for (row, j) in held {
                    // Its own name: an encode that ckptd asks for again (after its restart) may
                    // run beside one still going.
                    let tmp = dir.join(format!(
                        ".{row}.{j}.{}.tmp",
                        ENCODES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    ));
                    let mut file =
                        fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
                    let mut read = |m: usize, at: u64, buf: &mut [u8]| -> std::io::Result<()> {
                        // A job frozen on this node gets the CPU and the disk first.
                        progress.wait_unpaused();
                        if let Some(t) = &throttle {
                            t.take(buf.len() as u64);
                        }
                        read_member(&handle, &mut sources[m], at, buf)
                    };
                    let mut write = |jj: usize, b: &[u8]| -> std::io::Result<()> {
                        if jj == j {
                            std::io::Write::write_all(&mut file, b)?;
                        }
                        Ok(())
                    };
                    let shards =
                        erasure::encode_row(&mut coder, &layout, row, &mut read, &mut write)
                            .map_err(|e| e.to_string())?;
                    file.sync_all()
                        .map_err(|e| format!("{}: {e}", tmp.display()))?;
                    let path = parity_path(&dir, row, j);
                    fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
                    out.push(shards.into_iter().nth(j).expect("a shard per index"));
                }
                ckpt_store::atomic::sync_dir(&dir).map_err(|e| e.to_string())?;
                Ok(out)
            });
        let shards = task
            .await
            .map_err(|e| failed(job, epoch, format!("the encoding thread: {e}")))?
            .map_err(|e| failed(job, epoch, e))?;
        info!(job, epoch, %scheme, rows = shards.len(), "parity encoded");
        Ok(Encoded {
            shards,
            stream_lens: lens,
            manifest_lens: mlens,
        })
    }

    /// Rebuilds `node`'s images of the epoch into `tmp` from the members of its group left:
    /// the images rebuilt are unpacked verified against the committed manifest. A parity shard
    /// that fails its digest is left out and the rebuild done again without it when the group
    /// still has enough.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn rebuild_from_group(
        &self,
        job: u64,
        epoch: u32,
        node: &str,
        committed: &str,
        encoding: &Encoding,
        group: &[Member],
        tmp: &Path,
    ) -> Result<NodeManifest, AgentError> {
        let (_, layout) = encoding.layout().map_err(|e| failed(job, epoch, e))?;
        let (lost, code) =
            lost_member(encoding, node, committed).map_err(|e| failed(job, epoch, e))?;
        let members = group_members(encoding, group);
        let (mut sources, losses) = self
            .group_sources(job, epoch, &members, lost, &layout)
            .await;
        let stream = self
            .staging
            .epoch_dir(job, epoch)
            .join(format!(".{node}.rebuild"));
        let handle = tokio::runtime::Handle::current();
        let names: Vec<String> = members.iter().map(|m| m.node.clone()).collect();
        let mut parity = ParityReader {
            job,
            epoch,
            layout: layout.clone(),
            names: names.clone(),
            me: self.name.clone(),
            here: parity_dir(self, job, epoch),
            // Parity is read over readers of its own (the data reads hold the sources), one
            // shard at a time per holder.
            readers: sources
                .iter()
                .map(|s| match s {
                    Some(Source::Remote(r)) => Some((r.client(), None)),
                    _ => None,
                })
                .collect(),
            handle: handle.clone(),
        };
        let member = encoding.members[lost].clone();
        let shards = encoding.parity.clone();
        let dest = tmp.to_path_buf();
        let task = tokio::task::spawn_blocking(move || -> Result<NodeManifest, String> {
            let mut read_parity = |row: usize, index: usize, at: u64, buf: &mut [u8]| {
                parity.read(row, index, at, buf)
            };
            let mut attempt = |losses: &Losses,
                               read_parity: &mut erasure::ReadParity<'_>|
             -> Result<NodeManifest, String> {
                if let Some(parent) = stream.parent() {
                    fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
                }
                let out = fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&stream)
                    .map_err(|e| format!("{}: {e}", stream.display()))?;
                out.set_len(member.stream_len).map_err(|e| e.to_string())?;
                let mut read = |m: usize, at: u64, buf: &mut [u8]| -> std::io::Result<()> {
                    match &mut sources[m] {
                        Some(s) => read_member(&handle, s, at, buf),
                        None => Err(std::io::Error::other(format!("{} is lost", names[m]))),
                    }
                };
                let mut write = |_: usize, at: u64, b: &[u8]| out.write_all_at(b, at);
                erasure::rebuild(
                    &mut erasure::Coder::new(code),
                    &layout,
                    losses,
                    &[lost],
                    &mut read,
                    read_parity,
                    &mut write,
                )
                .map_err(|e| e.to_string())?;
                let mut from = |at: u64, buf: &mut [u8]| out.read_exact_at(buf, at);
                erasure::files::unpack(&mut from, &member, &dest).map_err(|e| e.to_string())
            };
            let first = attempt(&losses, &mut read_parity);
            let result = match first {
                Ok(m) => Ok(m),
                Err(e) => {
                    // A wrong rebuild: find damaged parity, and try once more without it.
                    let damaged =
                        erasure::verify_parity(&layout, &shards, &losses.members, &mut read_parity);
                    if damaged.is_empty() {
                        Err(format!("{e} (every parity shard matches its digest: a surviving member's images may be damaged)"))
                    } else {
                        let again = Losses {
                            members: losses.members.clone(),
                            damaged: damaged.clone(),
                        };
                        attempt(&again, &mut read_parity).map_err(|e2| {
                            format!("parity shards {damaged:?} (row, index) fail their digests; without them: {e2}")
                        })
                    }
                }
            };
            let _ = fs::remove_file(&stream);
            result
        });
        task.await
            .expect("rebuild task")
            .map_err(|e| failed(job, epoch, e))
    }

    /// The members of the group to rebuild member `lost` from, as sources (none where a
    /// member is lost, unreachable or holds images of another length than the record's), and
    /// which members the rebuild goes without.
    async fn group_sources(
        &self,
        job: u64,
        epoch: u32,
        members: &[Member],
        lost: usize,
        layout: &Layout,
    ) -> (Vec<Option<Source>>, Losses) {
        let mut losses = Losses {
            members: vec![lost],
            damaged: Vec::new(),
        };
        let mut sources: Vec<Option<Source>> = Vec::new();
        let mut why = Vec::new();
        let probed = self.sources(job, epoch, members, Some(lost)).await;
        for (i, r) in probed.into_iter().enumerate() {
            match r {
                Ok((s, len, _)) if i != lost && len == layout.len(i) => sources.push(Some(s)),
                Ok(_) if i == lost => sources.push(None),
                Ok((_, len, _)) => {
                    why.push(format!(
                        "{}: its images are {len} bytes, the record says {}",
                        members[i].node,
                        layout.len(i)
                    ));
                    losses.members.push(i);
                    sources.push(None);
                }
                Err(e) => {
                    if i != lost {
                        why.push(format!("{}: {e}", members[i].node));
                        losses.members.push(i);
                    }
                    sources.push(None);
                }
            }
        }
        if !why.is_empty() {
            let node = &members[lost].node;
            warn!(job, epoch, %node, unavailable = %why.join("; "), "members of the group left out of the rebuild");
        }
        (sources, losses)
    }

    /// The rebuild as a source of [`Node::usable_images`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn usable_from_group(
        &self,
        job: u64,
        epoch: u32,
        node: &str,
        committed: &str,
        encoding_json: &str,
        group: &[Member],
        tmp: &Path,
        dest: &Path,
        note: String,
    ) -> Result<Usable, AgentError> {
        if encoding_json.len() > MAX_ENCODING_JSON {
            return Err(failed(job, epoch, "the encoding record is too large"));
        }
        let encoding: Encoding = serde_json::from_str(encoding_json)
            .map_err(|e| failed(job, epoch, format!("the encoding record: {e}")))?;
        let m = self
            .rebuild_from_group(job, epoch, node, committed, &encoding, group, tmp)
            .await?;
        install(job, tmp, dest).await?;
        Ok(Usable {
            manifest: m,
            source: Location::Parity,
            note,
            unverified: Vec::new(),
        })
    }

    /// `Agent.ReadSegment` for data: the length of `node`'s stream here and its manifest, and
    /// `length` bytes at `offset`.
    pub fn read_images(
        &self,
        job: u64,
        epoch: u32,
        node: &str,
        digest: &str,
        offset: u64,
        length: u64,
    ) -> Result<(u64, u64, Vec<u8>), AgentError> {
        let dir = self.staging.node_dir(job, epoch, node);
        let mut s =
            NodeStream::open(&dir, digest).map_err(|source| AgentError::Store { job, source })?;
        let ml = s.manifest_len();
        check_range(job, epoch, offset, length, s.len())?;
        let mut buf = vec![0u8; length as usize];
        s.read_at(offset, &mut buf)
            .map_err(|e| failed(job, epoch, format!("{}: {e}", dir.display())))?;
        Ok((s.len(), ml, buf))
    }

    /// `Agent.ReadSegment` for parity: the shard's length and `length` bytes at `offset`.
    pub fn read_parity(
        &self,
        job: u64,
        epoch: u32,
        row: usize,
        index: usize,
        offset: u64,
        length: u64,
    ) -> Result<(u64, Vec<u8>), AgentError> {
        let path = parity_path(&parity_dir(self, job, epoch), row, index);
        let f = fs::File::open(&path)
            .map_err(|e| failed(job, epoch, format!("{}: {e}", path.display())))?;
        let size = f
            .metadata()
            .map_err(|e| failed(job, epoch, format!("{}: {e}", path.display())))?
            .len();
        check_range(job, epoch, offset, length, size)?;
        let mut buf = vec![0u8; length as usize];
        f.read_exact_at(&mut buf, offset)
            .map_err(|e| failed(job, epoch, format!("{}: {e}", path.display())))?;
        Ok((size, buf))
    }
}

/// A range asked for must lie in what is there, and be at most [`MAX_SEGMENT_READ`].
fn check_range(
    job: u64,
    epoch: u32,
    offset: u64,
    length: u64,
    size: u64,
) -> Result<(), AgentError> {
    if length > MAX_SEGMENT_READ || offset.checked_add(length).is_none_or(|end| end > size) {
        return Err(AgentError::Erasure {
            job,
            epoch,
            message: format!(
                "a read of {length} bytes at {offset} of {size} (at most {MAX_SEGMENT_READ} a call, within the stream)"
            ),
        });
    }
    Ok(())
}

/// Members of a group must have valid, distinct node names and a committed digest each.
fn check_members(job: u64, epoch: u32, members: &[Member]) -> Result<(), AgentError> {
    if members.len() > erasure::MAX_GROUP {
        return Err(failed(
            job,
            epoch,
            format!("a group of {} members", members.len()),
        ));
    }
    for (i, m) in members.iter().enumerate() {
        if !ckpt_auth::valid_node_name(&m.node) || m.digest.is_empty() {
            return Err(failed(
                job,
                epoch,
                format!("member {:?} (no valid name or no digest)", m.node),
            ));
        }
        if members[..i].iter().any(|o| o.node == m.node) {
            return Err(failed(job, epoch, format!("member {} named twice", m.node)));
        }
    }
    Ok(())
}

/// Reads `buf.len()` bytes at `at` of a member's images, here or through its agent.
/// The place of `node` in the group of `encoding` and the group's code, checked against the
/// committed digest of `node`'s manifest.
fn lost_member(
    encoding: &Encoding,
    node: &str,
    committed: &str,
) -> Result<(usize, erasure::Code), String> {
    let lost = encoding
        .members
        .iter()
        .position(|m| m.node == node)
        .ok_or_else(|| format!("node {node} is not in the group"))?;
    if encoding.members[lost].manifest_digest != committed {
        return Err("the group's record is of other images than the committed ones".into());
    }
    let code = encoding
        .scheme
        .parse::<Scheme>()
        .ok()
        .and_then(|s| s.code())
        .ok_or("not an erasure-coded scheme")?;
    Ok((lost, code))
}

/// Reads parity shards for a rebuild: this node's own from its staging, the others' over
/// `ReadSegment` from their holders.
struct ParityReader {
    job: u64,
    epoch: u32,
    layout: Layout,
    /// The group's nodes, in order.
    names: Vec<String>,
    /// This node.
    me: String,
    /// Where this node keeps the parity it holds.
    here: PathBuf,
    /// Per member: a client of its agent and the reader of the shard read last.
    readers: Vec<Option<(AgentClient<Channel>, Option<ReadAhead>)>>,
    handle: tokio::runtime::Handle,
}

impl ParityReader {
    /// Reads `buf` at `at` of shard `index` of row `row`.
    fn read(&mut self, row: usize, index: usize, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let holder = self.layout.holders(row)[index];
        if self.names[holder] == self.me {
            return fs::File::open(parity_path(&self.here, row, index))?.read_exact_at(buf, at);
        }
        let Some((c, reader)) = &mut self.readers[holder] else {
            return Err(std::io::Error::other(format!(
                "{} is not reachable",
                self.names[holder]
            )));
        };
        let base = pb::SegmentRequest {
            job_id: self.job,
            epoch: self.epoch,
            node: self.names[holder].clone(),
            parity: true,
            row: row as u32,
            index: index as u32,
            ..Default::default()
        };
        if !reader.as_ref().is_some_and(|r| r.reads(&base)) {
            *reader = Some(ReadAhead::new(c.clone(), base, self.layout.row_size(row)));
        }
        reader
            .as_mut()
            .expect("a reader of the shard")
            .read_at(&self.handle, at, buf)
    }
}

fn read_member(
    handle: &tokio::runtime::Handle,
    source: &mut Source,
    at: u64,
    buf: &mut [u8],
) -> std::io::Result<()> {
    match source {
        Source::Local(s) => s.read_at(at, buf),
        Source::Remote(r) => r.read_at(handle, at, buf),
    }
}

/// Every member of the encoded group, where the coordinator says its agent is (`group`), with
/// the digest of its manifest.
fn group_members(encoding: &Encoding, group: &[Member]) -> Vec<Member> {
    encoding
        .members
        .iter()
        .map(|m| Member {
            node: m.node.clone(),
            address: group
                .iter()
                .find(|g| g.node == m.node)
                .map(|g| g.address.clone())
                .unwrap_or_default(),
            digest: m.manifest_digest.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(node: &str, digest: &str) -> Member {
        Member {
            node: node.into(),
            address: String::new(),
            digest: digest.into(),
        }
    }

    #[test]
    fn reads_stay_within_what_is_there_and_are_bounded() {
        assert!(check_range(1, 1, 0, 0, 0).is_ok());
        assert!(check_range(1, 1, 10, 90, 100).is_ok());
        for (offset, length, size) in [
            (10, 91, 100),
            (101, 0, 100),
            (u64::MAX, 2, 100),
            (0, MAX_SEGMENT_READ + 1, u64::MAX),
        ] {
            let e = check_range(1, 1, offset, length, size)
                .unwrap_err()
                .to_string();
            assert!(e.contains("within the stream"), "{e}");
        }
    }

    #[test]
    fn a_group_names_each_member_once_with_a_valid_name_and_a_digest() {
        assert!(check_members(1, 1, &[member("n1", "d"), member("n2", "d")]).is_ok());
        for bad in [
            vec![member("n1", "d"), member("n1", "e")],
            vec![member("../x", "d")],
            vec![member("n1", "")],
        ] {
            assert!(check_members(1, 1, &bad).is_err());
        }
        let many: Vec<Member> = (0..=erasure::MAX_GROUP)
            .map(|i| member(&format!("n{i}"), "d"))
            .collect();
        assert!(check_members(1, 1, &many).is_err());
    }
}
