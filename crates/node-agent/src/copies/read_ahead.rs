//! Reads of another node's images or parity over `Agent.ReadSegment`, ahead of a coder that
//! asks for them stripe by stripe from a blocking thread: whole blocks of
//! [`MAX_SEGMENT_READ`] bytes, with the next [`DEPTH`] blocks already asked for. A group's
//! members are each read this way, so their reads overlap on the network while the caller
//! codes, instead of one call after another for every stripe of every member.
use std::collections::VecDeque;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_client::AgentClient;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// The most bytes one `ReadSegment` call returns.
pub const MAX_SEGMENT_READ: u64 = 4 << 20;

/// Blocks asked for beyond the one being read.
pub const DEPTH: u64 = 2;

type Block = JoinHandle<Result<Vec<u8>, tonic::Status>>;

/// One member's images (or one parity shard it holds), `len` bytes, read ahead.
pub struct ReadAhead {
    client: AgentClient<Channel>,
    /// The request without offset and length.
    base: pb::SegmentRequest,
    len: u64,
    /// The block read last: its start and bytes.
    have: Option<(u64, Vec<u8>)>,
    /// Blocks asked for, in order: their starts and the calls.
    pending: VecDeque<(u64, Block)>,
}

impl ReadAhead {
    /// Reads of `len` bytes that `base` (its offset and length aside) names, over `client`.
    pub fn new(client: AgentClient<Channel>, base: pb::SegmentRequest, len: u64) -> Self {
        ReadAhead {
            client,
            base,
            len,
            have: None,
            pending: VecDeque::new(),
        }
    }

    /// A client of the same agent.
    pub fn client(&self) -> AgentClient<Channel> {
        self.client.clone()
    }

    /// Whether it reads what `base` names.
    pub fn reads(&self, base: &pb::SegmentRequest) -> bool {
        self.base.node == base.node
            && self.base.parity == base.parity
            && self.base.row == base.row
            && self.base.index == base.index
            && self.base.manifest_digest == base.manifest_digest
    }

    /// Fills `buf` with the bytes at `at`, waiting on `handle` for blocks not yet there.
    pub fn read_at(&mut self, handle: &Handle, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let end = at
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                std::io::Error::other(format!(
                    "{}: bytes {at}..+{} are past its {} bytes",
                    self.base.node,
                    buf.len(),
                    self.len
                ))
            })?;
        let mut pos = at;
        while pos < end {
            if let Some((start, data)) = &self.have {
                let stop = start + data.len() as u64;
                if pos >= *start && pos < stop {
                    let n = (stop.min(end) - pos) as usize;
                    let from = (pos - start) as usize;
                    let to = (pos - at) as usize;
                    buf[to..to + n].copy_from_slice(&data[from..from + n]);
                    pos += n as u64;
                    continue;
                }
            }
            let start = pos - pos % MAX_SEGMENT_READ;
            let data = self.block(handle, start)?;
            self.have = Some((start, data));
            self.ask_ahead(handle, start);
        }
        Ok(())
    }

    /// The block at `start`: the call already made for it, or one made now (what was asked
    /// for before it, or elsewhere, is dropped).
    fn block(&mut self, handle: &Handle, start: u64) -> std::io::Result<Vec<u8>> {
        while let Some((s, _)) = self.pending.front() {
            if *s == start {
                break;
            }
            if let Some((_, call)) = self.pending.pop_front() {
                call.abort();
            }
        }
        let call = match self.pending.pop_front() {
            Some((_, call)) => call,
            None => self.ask(handle, start),
        };
        let node = self.base.node.clone();
        match handle.block_on(call) {
            Ok(Ok(data)) => Ok(data),
            Ok(Err(s)) => Err(std::io::Error::other(format!("{node}: {}", s.message()))),
            Err(e) => Err(std::io::Error::other(format!(
                "{node}: the read failed: {e}"
            ))),
        }
    }

    /// Asks for the [`DEPTH`] blocks after the one at `start` that are not asked for yet.
    fn ask_ahead(&mut self, handle: &Handle, start: u64) {
        let mut next = self
            .pending
            .back()
            .map_or(start + MAX_SEGMENT_READ, |(s, _)| s + MAX_SEGMENT_READ);
        while next < self.len && next <= start + DEPTH * MAX_SEGMENT_READ {
            let call = self.ask(handle, next);
            self.pending.push_back((next, call));
            next += MAX_SEGMENT_READ;
        }
    }

    /// One call for the block at `start` (shorter at the end), running on the runtime.
    fn ask(&self, handle: &Handle, start: u64) -> Block {
        let mut c = self.client.clone();
        let req = pb::SegmentRequest {
            offset: start,
            length: MAX_SEGMENT_READ.min(self.len - start),
            ..self.base.clone()
        };
        handle.spawn(async move { read_remote(&mut c, req).await.map(|(_, _, d)| d) })
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        for (_, call) in self.pending.drain(..) {
            call.abort();
        }
    }
}

/// Reads one range of a member's images or parity through its agent.
pub(super) async fn read_remote(
    c: &mut AgentClient<Channel>,
    req: pb::SegmentRequest,
) -> Result<(u64, u64, Vec<u8>), tonic::Status> {
    use tokio_stream::StreamExt;
    let want = req.length as usize;
    let mut s = c.read_segment(req).await?.into_inner();
    let mut lens = None;
    let mut data = Vec::with_capacity(want);
    while let Some(chunk) = s.next().await {
        let chunk = chunk?;
        if lens.is_none() {
            lens = Some((chunk.stream_len, chunk.manifest_len));
        }
        if data.len() + chunk.data.len() > want {
            return Err(tonic::Status::data_loss("more bytes than asked for"));
        }
        data.extend_from_slice(&chunk.data);
    }
    if data.len() != want {
        return Err(tonic::Status::data_loss(format!(
            "{} bytes of the {want} asked for",
            data.len()
        )));
    }
    let (stream_len, manifest_len) = lens.unwrap_or_default();
    Ok((stream_len, manifest_len, data))
}
