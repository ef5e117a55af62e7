//! A channel: the verbs objects of one process, created and owned through it, with what is
//! needed to tear them down before a snapshot and rebuild them afterwards.
//!
//! Here: the objects and their translation on every post and poll. The quiesce / rebuild /
//! reconnect cycle is in `channel/cycle.rs`, the tests in `channel/tests.rs`.
//!
//! Applications see *virtual* identifiers: a QP number and memory keys that the channel
//! assigns once and keeps across rebuilds. Every post translates them to the real ones of the
//! current incarnation (and a peer's virtual rkeys to its real ones, learned with its endpoint).
//!
//! Quiesce, in order: refuse new posts; poll until every signalled send completed (keeping the
//! application's completions for its next poll); on every connected QP, RDMA-write a marker
//! (the quiesce count) into a slot of the peer's control region and wait both for that write's
//! completion and for the peer's marker in our own slot. RC delivers in order, so once both are
//! seen nothing is in flight in either direction. A last sweep of the CQs holds the completions
//! that arrived after the last poll. Receives posted but not consumed are kept. Then QPs, CQs, MRs, the PD and the device are released. Rebuild reopens the device, registers
//! the same memory (new keys), creates new QPs, publishes their endpoints, connects to the
//! peers' new endpoints, reposts the kept receives and lets posts through again. It reopens
//! the device by name, or, when that device is gone (a restart on a node whose HCA is named
//! otherwise), the first active one with the same link layer.
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::verbs::{
    Completion, Handle, MrKeys, Opcode, Port, QpCaps, RecvWr, Remote, SendOp, SendWr, Sge, Verbs,
    VerbsError,
};

/// First virtual memory key; keys are `MR_KEY_BASE + index`.
pub const MR_KEY_BASE: u32 = 0x7100_0000;
/// First virtual QP number; QPs are `QPN_BASE + index`.
pub const QPN_BASE: u32 = 0x0071_0000;
/// Work request ids with this bit belong to the channel; applications may not use them.
pub const INTERNAL_WR: u64 = 1 << 63;
/// QPs one channel can hold (one control slot each).
pub const MAX_QPS: usize = 1024;
/// Virtual memory keys a peer table holds at most (a bound on what a peer's endpoint can make
/// us allocate).
const MAX_PEER_KEYS: usize = 1 << 20;
/// Access flags for the control region: local write, remote write.
const CTRL_ACCESS: u32 = 0x1 | 0x2;

/// Why a channel call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Posts are refused while the channel is quiesced for a checkpoint; retry after rebuild.
    #[error("the channel is quiesced for a checkpoint; posts resume after the rebuild")]
    Paused,
    /// The call does not fit the channel's state.
    #[error("{op} is not possible while the channel is {state}")]
    WrongState {
        /// The call.
        op: &'static str,
        /// The state.
        state: &'static str,
    },
    /// An identifier the channel did not hand out.
    #[error("unknown {what} {id:#x}")]
    Unknown {
        /// "QP", "CQ", "memory key", "peer memory key".
        what: &'static str,
        /// The identifier.
        id: u64,
    },
    /// A work request id with the channel's reserved bit.
    #[error("work request id {0:#x} uses the bit reserved for the channel (1 << 63)")]
    ReservedWrId(u64),
    /// The QP is not connected.
    #[error("QP {0:#x} is not connected")]
    NotConnected(u32),
    /// After a rebuild, the new endpoint of a QP's peer was not given.
    #[error("QP {qp:#x}: no new endpoint for its peer (channel {:#x}, QP {:#x})", peer.0, peer.1)]
    MissingPeer {
        /// Our virtual QP number.
        qp: u32,
        /// The peer's identity.
        peer: QpId,
    },
    /// Too many QPs.
    #[error("a channel holds at most {MAX_QPS} QPs")]
    TooManyQps,
    /// A step of quiesce did not finish in time.
    #[error("quiesce: {what} did not finish within {waited:?}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long.
        waited: Duration,
    },
    /// A completion reported an error during quiesce.
    #[error("quiesce: work request {wr_id:#x} on QP {qpn:#x} failed with status {status}")]
    Failed {
        /// Request.
        wr_id: u64,
        /// Real QP number.
        qpn: u32,
        /// Verbs status.
        status: u32,
    },
    /// The device said no.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
}

/// Result of a channel call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a peer needs to reach one of our QPs, exchanged out of band (by the application at
/// first, through the node agents and the coordinator after a rebuild).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    /// Which QP this is, stable across rebuilds and restarts: the channel's id and the QP's
    /// virtual number. After a rebuild, each QP finds its peer's new endpoint by this.
    pub id: QpId,
    /// Our port.
    pub port: Port,
    /// The QP's real number and initial PSN.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Where the peer writes its quiesce marker for this QP, and the control region's rkey.
    pub ctrl_addr: u64,
    /// Real rkey of our control region.
    pub ctrl_rkey: u32,
    /// Our memory keys: (virtual, real) for every MR.
    pub rkeys: Vec<(u32, u32)>,
}

/// A QP's identity across rebuilds: (channel id, virtual QP number).
pub type QpId = (u64, u32);

/// Where the channel is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Objects exist, posts go through.
    Up,
    /// Quiesce began: posts are refused.
    Quiescing,
    /// Everything released: the process can be snapshotted.
    Down,
    /// Objects recreated, waiting for the peers' new endpoints.
    Rebuilt,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Up => "up",
            State::Quiescing => "quiescing",
            State::Down => "down (quiesced)",
            State::Rebuilt => "rebuilt, not yet connected",
        }
    }
}

/// What a quiesce did.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct QuiesceReport {
    /// Connected QPs whose markers were exchanged.
    pub flushed_qps: usize,
    /// Receives posted but not consumed, kept for reposting.
    pub kept_receives: usize,
    /// Application completions held for its next poll.
    pub held_completions: usize,
}

#[derive(Debug)]
struct MrRec {
    addr: u64,
    len: usize,
    access: u32,
    real: Option<MrKeys>,
}

#[derive(Debug)]
struct CqRec {
    cqe: u32,
    real: Option<Handle>,
    held: VecDeque<Completion>,
}

#[derive(Debug)]
struct QpRec {
    send_cq: usize,
    recv_cq: usize,
    caps: QpCaps,
    real: Option<(Handle, u32)>,
    psn: u32,
    /// The peer's endpoint, without its keys (those are in `peer_keys`).
    peer: Option<Endpoint>,
    /// The peer channel's real rkeys by virtual key, shared by every QP to that channel.
    peer_keys: PeerKeys,
    /// Posted, not yet completed receives, in posting order, with virtual keys.
    receives: VecDeque<RecvWr>,
}

/// A peer channel's real rkeys, indexed by virtual key − [`MR_KEY_BASE`].
type PeerKeys = Arc<[Option<u32>]>;

/// The index of virtual memory key `v` (in a channel's MRs or a peer key table).
fn key_index(v: u32) -> Option<usize> {
    v.checked_sub(MR_KEY_BASE).map(|k| k as usize)
}

/// The key table of `rkeys` (virtual, real), or `cached` when it holds the same keys.
fn peer_keys(rkeys: &[(u32, u32)], cached: Option<&PeerKeys>) -> PeerKeys {
    let index = |v: u32| key_index(v).filter(|k| *k < MAX_PEER_KEYS);
    if let Some(c) = cached {
        let same = c.iter().filter(|k| k.is_some()).count() == rkeys.len()
            && rkeys
                .iter()
                .all(|&(v, r)| index(v).and_then(|k| c.get(k).copied().flatten()) == Some(r));
        if same {
            return c.clone();
        }
    }
    let mut t: Vec<Option<u32>> = Vec::with_capacity(rkeys.len());
    for &(v, r) in rkeys {
        if let Some(k) = index(v) {
            if t.len() <= k {
                t.resize(k + 1, None);
            }
            t[k] = Some(r);
        }
    }
    t.into()
}

/// The verbs objects of one process, behind virtual identifiers.
#[derive(Debug)]
pub struct Channel<V: Verbs> {
    v: V,
    /// Random, fixed for the life of the process (and kept by a snapshot).
    id: u64,
    device: String,
    port: Port,
    pd: Option<Handle>,
    state: State,
    marker: u64,
    mrs: Vec<MrRec>,
    cqs: Vec<CqRec>,
    qps: Vec<QpRec>,
    /// Index of the QP behind each real QP number (completions name real ones).
    by_real: HashMap<u32, usize>,
    /// The request being posted, in real keys; its buffers are reused from post to post.
    send_wr: SendWr,
    recv_wr: RecvWr,
    /// Slot 0: the marker value we write; slot 1 + i: where QP i's peer writes its marker.
    ctrl: Box<[u64]>,
    ctrl_mr: Option<MrKeys>,
    /// Signalled application sends not yet completed.
    outstanding: u64,
}

impl<V: Verbs> Channel<V> {
    /// Opens `device` (empty: the first one) and allocates the protection domain.
    pub fn open(v: V, device: &str) -> Result<Self> {
        let mut c = Channel {
            v,
            id: channel_id(),
            device: device.to_string(),
            port: Port::default(),
            pd: None,
            state: State::Down,
            marker: 0,
            mrs: Vec::new(),
            cqs: Vec::new(),
            qps: Vec::new(),
            by_real: HashMap::new(),
            send_wr: SendWr {
                wr_id: 0,
                op: SendOp::Send,
                sges: Vec::new(),
                signaled: false,
            },
            recv_wr: RecvWr {
                wr_id: 0,
                sges: Vec::new(),
            },
            ctrl: vec![0u64; 1 + MAX_QPS].into_boxed_slice(),
            ctrl_mr: None,
            outstanding: 0,
        };
        c.open_device()?;
        c.state = State::Up;
        Ok(c)
    }

    fn open_device(&mut self) -> Result<()> {
        self.port = if self.port.device.is_empty() {
            self.v.open(&self.device)?
        } else {
            // A rebuild: the same device by name, else one whose port matches.
            match self.v.open(&self.port.device) {
                Ok(p) => p,
                Err(by_name) => self.v.open_matching(&self.port).map_err(|e| VerbsError {
                    op: e.op,
                    message: format!(
                        "{} is gone ({}), and there is no other: {}",
                        self.port.device, by_name.message, e.message
                    ),
                })?,
            }
        };
        let pd = self.v.alloc_pd()?;
        self.pd = Some(pd);
        let addr = self.ctrl.as_ptr() as u64;
        self.ctrl_mr = Some(self.v.reg_mr(pd, addr, self.ctrl.len() * 8, CTRL_ACCESS)?);
        Ok(())
    }

    /// The channel's id, fixed for the life of the process and kept by a snapshot.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The descriptors the channel's backend holds open on verbs device files (`None`: it
    /// cannot tell; see [`Verbs::device_fds`]).
    pub fn device_fds(&self) -> Option<Vec<i32>> {
        self.v.device_fds()
    }

    /// How many QPs and MRs the channel holds (the control region not counted).
    pub fn counts(&self) -> (usize, usize) {
        (self.qps.len(), self.mrs.len())
    }

    /// The channel's state.
    pub fn state(&self) -> State {
        self.state
    }

    /// The backend (tests inspect the recording fake through it).
    pub fn backend(&self) -> &V {
        &self.v
    }

    fn need(&self, want: State, op: &'static str) -> Result<()> {
        if self.state == want {
            Ok(())
        } else if self.state == State::Quiescing && op.starts_with("post") {
            Err(Error::Paused)
        } else {
            Err(Error::WrongState {
                op,
                state: self.state.name(),
            })
        }
    }

    /// Registers `len` bytes at `addr`; returns the virtual key, used as both lkey and rkey.
    pub fn reg_mr(&mut self, addr: u64, len: usize, access: u32) -> Result<u32> {
        self.need(State::Up, "reg_mr")?;
        let keys = self.v.reg_mr(self.pd.expect("up"), addr, len, access)?;
        self.mrs.push(MrRec {
            addr,
            len,
            access,
            real: Some(keys),
        });
        Ok(MR_KEY_BASE + (self.mrs.len() - 1) as u32)
    }

    /// Creates a completion queue; returns its id.
    pub fn create_cq(&mut self, cqe: u32) -> Result<u32> {
        self.need(State::Up, "create_cq")?;
        let h = self.v.create_cq(cqe)?;
        self.cqs.push(CqRec {
            cqe,
            real: Some(h),
            held: VecDeque::new(),
        });
        Ok((self.cqs.len() - 1) as u32)
    }

    fn cq_index(&self, cq: u32) -> Result<usize> {
        let i = cq as usize;
        (i < self.cqs.len()).then_some(i).ok_or(Error::Unknown {
            what: "CQ",
            id: cq as u64,
        })
    }

    fn qp_index(&self, vqpn: u32) -> Result<usize> {
        vqpn.checked_sub(QPN_BASE)
            .map(|i| i as usize)
            .filter(|i| *i < self.qps.len())
            .ok_or(Error::Unknown {
                what: "QP",
                id: vqpn as u64,
            })
    }

    /// Creates an RC QP; returns its virtual QP number.
    pub fn create_qp(&mut self, send_cq: u32, recv_cq: u32, caps: QpCaps) -> Result<u32> {
        self.need(State::Up, "create_qp")?;
        if self.qps.len() >= MAX_QPS {
            return Err(Error::TooManyQps);
        }
        let (s, r) = (self.cq_index(send_cq)?, self.cq_index(recv_cq)?);
        let i = self.qps.len();
        let psn = psn_for(self.marker, i);
        let real = self.v.create_qp(
            self.pd.expect("up"),
            self.cqs[s].real.expect("up"),
            self.cqs[r].real.expect("up"),
            caps,
        )?;
        self.qps.push(QpRec {
            send_cq: s,
            recv_cq: r,
            caps,
            real: Some(real),
            psn,
            peer: None,
            peer_keys: Arc::new([]),
            receives: VecDeque::new(),
        });
        self.by_real.insert(real.1, i);
        Ok(QPN_BASE + i as u32)
    }

    fn endpoint_of(&self, i: usize) -> Endpoint {
        let ctrl = self.ctrl_mr.expect("device open");
        Endpoint {
            id: (self.id, QPN_BASE + i as u32),
            port: self.port.clone(),
            qpn: self.qps[i].real.expect("objects exist").1,
            psn: self.qps[i].psn,
            ctrl_addr: self.ctrl.as_ptr() as u64 + 8 * (1 + i as u64),
            ctrl_rkey: ctrl.rkey,
            rkeys: self
                .mrs
                .iter()
                .enumerate()
                .map(|(k, m)| (MR_KEY_BASE + k as u32, m.real.expect("objects exist").rkey))
                .collect(),
        }
    }

    /// What a peer needs to connect to QP `vqpn`.
    pub fn endpoint(&self, vqpn: u32) -> Result<Endpoint> {
        if !matches!(self.state, State::Up | State::Rebuilt) {
            return Err(Error::WrongState {
                op: "endpoint",
                state: self.state.name(),
            });
        }
        Ok(self.endpoint_of(self.qp_index(vqpn)?))
    }

    fn connect_index(&mut self, i: usize, peer: &Endpoint, keys: PeerKeys) -> Result<()> {
        let remote = Remote {
            port: peer.port.clone(),
            qpn: peer.qpn,
            psn: peer.psn,
        };
        let q = &mut self.qps[i];
        self.v
            .connect(q.real.expect("objects exist").0, q.psn, &remote)?;
        q.peer_keys = keys;
        q.peer = Some(Endpoint {
            id: peer.id,
            port: remote.port,
            qpn: peer.qpn,
            psn: peer.psn,
            ctrl_addr: peer.ctrl_addr,
            ctrl_rkey: peer.ctrl_rkey,
            rkeys: Vec::new(),
        });
        Ok(())
    }

    /// Connects QP `vqpn` to a peer's endpoint.
    pub fn connect(&mut self, vqpn: u32, peer: Endpoint) -> Result<()> {
        self.need(State::Up, "connect")?;
        let i = self.qp_index(vqpn)?;
        // Share the table of another QP to the same peer channel, unless the peer registered
        // memory since (compared).
        let cached = self
            .qps
            .iter()
            .find(|q| q.peer.as_ref().is_some_and(|p| p.id.0 == peer.id.0))
            .map(|q| &q.peer_keys);
        let keys = peer_keys(&peer.rkeys, cached);
        self.connect_index(i, &peer, keys)
    }

    /// The MR behind virtual key `vkey`.
    fn mr(mrs: &[MrRec], vkey: u32) -> Result<&MrRec> {
        key_index(vkey)
            .and_then(|k| mrs.get(k))
            .ok_or(Error::Unknown {
                what: "memory key",
                id: vkey as u64,
            })
    }

    /// Translates `sges` (virtual keys) into `out` (real keys).
    fn local_sges(mrs: &[MrRec], sges: &[Sge], out: &mut Vec<Sge>) -> Result<()> {
        out.clear();
        for s in sges {
            let m = Self::mr(mrs, s.lkey)?;
            out.push(Sge {
                lkey: m.real.expect("objects exist").lkey,
                ..*s
            });
        }
        Ok(())
    }

    /// The index of the QP `vqpn` that `op` posts the application's work request `wr_id` to:
    /// the channel must be up, the id must not carry the channel's own marker, and the QP must
    /// exist.
    fn app_qp(&self, op: &'static str, vqpn: u32, wr_id: u64) -> Result<usize> {
        self.need(State::Up, op)?;
        if wr_id & INTERNAL_WR != 0 {
            return Err(Error::ReservedWrId(wr_id));
        }
        self.qp_index(vqpn)
    }

    /// Posts a send (virtual keys; a write names the peer's virtual rkey).
    pub fn post_send(&mut self, vqpn: u32, wr: &SendWr) -> Result<()> {
        let i = self.app_qp("post_send", vqpn, wr.wr_id)?;
        let q = &self.qps[i];
        if q.peer.is_none() {
            return Err(Error::NotConnected(vqpn));
        }
        let op = match wr.op {
            SendOp::Send => SendOp::Send,
            SendOp::Write { remote_addr, rkey } => SendOp::Write {
                remote_addr,
                rkey: key_index(rkey)
                    .and_then(|k| q.peer_keys.get(k).copied().flatten())
                    .ok_or(Error::Unknown {
                        what: "peer memory key",
                        id: rkey as u64,
                    })?,
            },
        };
        let real = &mut self.send_wr;
        Self::local_sges(&self.mrs, &wr.sges, &mut real.sges)?;
        real.wr_id = wr.wr_id;
        real.op = op;
        real.signaled = wr.signaled;
        self.v.post_send(q.real.expect("up").0, real)?;
        if wr.signaled {
            self.outstanding += 1;
        }
        Ok(())
    }

    /// Posts a receive (virtual keys).
    pub fn post_recv(&mut self, vqpn: u32, wr: &RecvWr) -> Result<()> {
        let i = self.app_qp("post_recv", vqpn, wr.wr_id)?;
        let real = &mut self.recv_wr;
        Self::local_sges(&self.mrs, &wr.sges, &mut real.sges)?;
        real.wr_id = wr.wr_id;
        self.v.post_recv(self.qps[i].real.expect("up").0, real)?;
        self.qps[i].receives.push_back(wr.clone());
        Ok(())
    }

    /// Polls the backend CQ `i` once and files what it returns: the channel's own completions
    /// into `internal`, the application's (with virtual QP numbers) into the CQ's held list.
    fn poll_into(&mut self, i: usize, internal: &mut Vec<Completion>) -> Result<()> {
        let real = self.cqs[i].real.expect("objects exist");
        let cqe = self.cqs[i].cqe.max(1) as usize;
        for mut c in self.v.poll_cq(real, cqe)? {
            if c.wr_id & INTERNAL_WR != 0 {
                internal.push(c);
                continue;
            }
            if let Some(&qi) = self.by_real.get(&c.qpn) {
                match c.opcode {
                    Opcode::Recv => {
                        let q = &mut self.qps[qi];
                        if let Some(p) = q.receives.iter().position(|r| r.wr_id == c.wr_id) {
                            q.receives.remove(p);
                        }
                    }
                    Opcode::Send => self.outstanding = self.outstanding.saturating_sub(1),
                }
                c.qpn = QPN_BASE + qi as u32;
            }
            self.cqs[i].held.push_back(c);
        }
        Ok(())
    }

    /// Polls up to `max` completions of CQ `cq` (QP numbers in them are virtual).
    pub fn poll_cq(&mut self, cq: u32, max: usize) -> Result<Vec<Completion>> {
        let i = self.cq_index(cq)?;
        if self.cqs[i].held.len() < max && self.state == State::Up {
            let mut internal = Vec::new();
            self.poll_into(i, &mut internal)?;
        }
        let n = max.min(self.cqs[i].held.len());
        Ok(self.cqs[i].held.drain(..n).collect())
    }
}

/// A random channel id: time, PID and a counter, mixed.
fn channel_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut z = t ^ ((std::process::id() as u64) << 32) ^ N.fetch_add(1, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A fresh initial PSN per QP and incarnation (24 bits).
fn psn_for(marker: u64, i: usize) -> u32 {
    ((marker
        .wrapping_mul(0x9e37_79b9)
        .wrapping_add(i as u64 * 7919))
        & 0x00ff_ffff) as u32
}

mod cycle;
#[cfg(test)]
mod tests;
