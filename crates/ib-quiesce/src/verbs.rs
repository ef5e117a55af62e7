//! The verbs operations a [`crate::Channel`] needs, as a trait: the real backend calls
//! rdma-core; tests pass a recording fake ([`crate::fake`]). Every handle and key here is a
//! *real* one, valid only until the next teardown; applications never see them.

/// A backend object handle (PD, MR, CQ or QP), opaque to the channel.
pub type Handle = u64;

/// What an operation on the device failed with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {message}")]
pub struct VerbsError {
    /// The verbs call ("ibv_reg_mr", "ibv_modify_qp(RTR)", ...).
    pub op: &'static str,
    /// What the device or library said.
    pub message: String,
}

/// Result of a backend call.
pub type VResult<T> = Result<T, VerbsError>;

/// The port the channel uses, as a peer needs to address it.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Port {
    /// Device name (e.g. `rxe0`, `mlx5_0`).
    pub device: String,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID at the index in use (RoCE addressing).
    pub gid: [u8; 16],
    /// The port's link layer, as libibverbs numbers it: [`LINK_INFINIBAND`] or
    /// [`LINK_ETHERNET`] (RoCE); 0 when unknown.
    #[serde(default)]
    pub link_layer: u8,
}

/// [`Port::link_layer`] of an InfiniBand port.
pub const LINK_INFINIBAND: u8 = 1;
/// [`Port::link_layer`] of an Ethernet (RoCE) port.
pub const LINK_ETHERNET: u8 = 2;

/// A link layer's name, for messages.
pub fn link_layer_name(l: u8) -> &'static str {
    match l {
        LINK_INFINIBAND => "InfiniBand",
        LINK_ETHERNET => "Ethernet (RoCE)",
        _ => "unknown",
    }
}

/// Keys of a registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrKeys {
    /// Backend handle.
    pub handle: Handle,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

/// Queue sizes of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per work request.
    pub max_sge: u32,
}

/// What a peer needs to connect an RC QP to ours.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Remote {
    /// Peer port.
    pub port: Port,
    /// Peer QP number (real).
    pub qpn: u32,
    /// Peer's initial packet sequence number.
    pub psn: u32,
}

/// One scatter/gather element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Address in the process.
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// Local key of the MR holding it.
    pub lkey: u32,
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided send: consumes a receive posted by the peer.
    Send,
    /// One-sided RDMA write to the peer's memory.
    Write {
        /// Address in the peer process.
        remote_addr: u64,
        /// Remote key of the peer's MR.
        rkey: u32,
    },
}

/// A send work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local buffers.
    pub sges: Vec<Sge>,
    /// Generate a completion.
    pub signaled: bool,
}

/// A receive work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where received data goes.
    pub sges: Vec<Sge>,
}

/// Which queue a completion is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    /// A send or write completed.
    Send,
    /// A receive consumed a peer's send.
    Recv,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The request's identifier.
    pub wr_id: u64,
    /// Send or receive side.
    pub opcode: Opcode,
    /// 0 on success, the verbs status otherwise.
    pub status: u32,
    /// Bytes received (receives).
    pub byte_len: u32,
    /// Real number of the QP it belongs to.
    pub qpn: u32,
}

/// The device operations a channel uses, in the order it uses them. Teardown calls return
/// errors; none may panic.
pub trait Verbs: Send {
    /// Opens `device` (or, when empty or absent, the first active one) and returns its port.
    fn open(&mut self, device: &str) -> VResult<Port>;
    /// Opens the first device whose port is active and has `like`'s link layer: what a
    /// rebuild falls back to when the device it had is gone (a restart on a node whose HCA
    /// has another name).
    fn open_matching(&mut self, like: &Port) -> VResult<Port>;
    /// Closes the device; every object must be gone.
    fn close(&mut self) -> VResult<()>;
    /// Allocates the protection domain.
    fn alloc_pd(&mut self) -> VResult<Handle>;
    /// Frees it.
    fn dealloc_pd(&mut self, pd: Handle) -> VResult<()>;
    /// Registers memory the process owns at `addr`.
    fn reg_mr(&mut self, pd: Handle, addr: u64, len: usize, access: u32) -> VResult<MrKeys>;
    /// Deregisters it.
    fn dereg_mr(&mut self, mr: Handle) -> VResult<()>;
    /// Makes the pages of `regions` (start, length) soft-dirty: called between the last DMA
    /// into them and their deregistration ([`crate::dirty`]).
    fn mark_written(&mut self, regions: &[(u64, usize)]) {
        crate::dirty::mark_written(regions);
    }
    /// Creates a completion queue.
    fn create_cq(&mut self, cqe: u32) -> VResult<Handle>;
    /// Destroys it.
    fn destroy_cq(&mut self, cq: Handle) -> VResult<()>;
    /// Creates an RC QP in the INIT state (receives may be posted); returns it and its number.
    fn create_qp(
        &mut self,
        pd: Handle,
        send_cq: Handle,
        recv_cq: Handle,
        caps: QpCaps,
    ) -> VResult<(Handle, u32)>;
    /// Moves a QP through RTR and RTS towards `remote`, with our initial PSN `psn`.
    fn connect(&mut self, qp: Handle, psn: u32, remote: &Remote) -> VResult<()>;
    /// Destroys a QP.
    fn destroy_qp(&mut self, qp: Handle) -> VResult<()>;
    /// Posts a send work request.
    fn post_send(&mut self, qp: Handle, wr: &SendWr) -> VResult<()>;
    /// Posts a receive work request.
    fn post_recv(&mut self, qp: Handle, wr: &RecvWr) -> VResult<()>;
    /// Polls up to `max` completions.
    fn poll_cq(&mut self, cq: Handle, max: usize) -> VResult<Vec<Completion>>;
    /// The descriptors this backend holds open on verbs device files (an open context's
    /// command descriptor), for the agent's check that the process holds no others. `None`:
    /// it cannot tell (a backend with no device files), and the agent does not check.
    fn device_fds(&self) -> Option<Vec<i32>> {
        None
    }
}
