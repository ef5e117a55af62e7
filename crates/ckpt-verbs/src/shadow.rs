//! Shadow objects: what the program is handed instead of libibverbs' objects.
//!
//! Each shadow starts with the public verbs struct the program reads (`ibv_qp`, `ibv_cq`...),
//! so a pointer to it is a valid verbs pointer, followed by the real object behind it. A
//! shadow's `context` is always a shadow context, whose operation table routes the
//! header-inline calls (`ibv_post_send`, `ibv_poll_cq`...) into [`crate::fastpath`]. A real
//! object's `context` is a real context: that is how a wrapper tells the two apart when
//! libibverbs or a provider calls an exported function with its own objects.
//!
//! The real object of a QP sits behind an atomic pointer: a rebuild replaces it while the
//! shadow, and everything the program keeps of it, stays.
// The verbs structs hold unions and have no `Debug`; neither do the shadows around them.
#![allow(missing_debug_implementations)]
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use ibverbs_sys as ffi;

use crate::real::real;
use crate::xlate::{Addr, Tables};

/// What the program sees of a verbs object, whose real counterpart a rebuild replaces.
pub type Real<T> = AtomicPtr<T>;

/// A context's `create_qp_ex` operation (the layer's is the exported calls' `create_qp_ex`).
pub type CreateQpEx =
    unsafe extern "C" fn(*mut ffi::ibv_context, *mut ffi::ibv_qp_init_attr_ex) -> *mut ffi::ibv_qp;

/// The extended operations libibverbs' header reads just before a context whose `abi_compat`
/// says it is extended (the tail of rdma-core's `struct verbs_context`, from `create_qp_ex` to
/// the context; operations added later sit before it). `sz` covers only this tail, so the
/// header's `verbs_get_ctx_op` finds every older operation absent and the program falls back
/// to the exported calls, as for a plain context; `create_qp_ex` is the one offered
/// ([`crate::extended`]).
#[repr(C)]
#[derive(Default)]
pub struct ExtendedOps {
    /// `create_qp_ex`.
    pub create_qp_ex: Option<CreateQpEx>,
    /// `get_srq_num`, `create_srq_ex`, `open_xrcd`, `close_xrcd` and a placeholder: none.
    pub none: [usize; 5],
    /// The size of the extended part, counted from `create_qp_ex` to the context's end.
    pub sz: usize,
}

// The context follows its extended operations with no gap, as in `struct verbs_context`.
const _: () = assert!(std::mem::offset_of!(ShadowCtx, ctx) == std::mem::size_of::<ExtendedOps>());

/// The shadow of a device context. The program sees `ctx`, whose `async_fd` is a proxy
/// ([`crate::events`]) that outlives the real context, preceded by its extended operations.
#[repr(C)]
pub struct ShadowCtx {
    /// What libibverbs' header finds before an extended context.
    pub ext: ExtendedOps,
    /// What the program sees: device, fds and the operation table of this layer.
    pub ctx: ffi::ibv_context,
    /// libibverbs' context.
    pub real: Real<ffi::ibv_context>,
    /// The device's name, to open it again after a release.
    pub device: String,
    /// This process's address on the device as its peers know it ([`Addr::id`]): taken from
    /// the source GID (or the LID) of the first connection or address handle made here, and
    /// kept across rebuilds and restores. 0 until then.
    pub ident: AtomicU64,
    /// The GID index of that address (−1: LID addressing), to publish the GID it has now.
    pub gid_index: AtomicI32,
    /// The program's `async_fd`.
    pub async_proxy: crate::events::Proxy,
    /// The real context's command descriptor, open on the device file (−1 until the opener
    /// sets it, and while released):
    /// what the layer tells the agent it holds ([`crate::cycle::Control`]'s `check`). Kept
    /// here so that the check never reads a real context the program may be closing.
    pub cmd_fd: AtomicI32,
}

impl ShadowCtx {
    /// A shadow of `real`, a context on `device`, whose extended operations offer
    /// `create_qp_ex`.
    pub fn new(
        ctx: ffi::ibv_context,
        real: *mut ffi::ibv_context,
        device: String,
        async_proxy: crate::events::Proxy,
        create_qp_ex: CreateQpEx,
    ) -> Self {
        let mut ctx = ctx;
        ctx.abi_compat = usize::MAX as *mut std::ffi::c_void;
        ShadowCtx {
            ext: ExtendedOps {
                create_qp_ex: Some(create_qp_ex),
                none: [0; 5],
                sz: std::mem::size_of::<ExtendedOps>() + std::mem::size_of::<ffi::ibv_context>(),
            },
            ctx,
            real: AtomicPtr::new(real),
            device,
            ident: AtomicU64::new(0),
            gid_index: AtomicI32::new(0),
            async_proxy,
            cmd_fd: AtomicI32::new(-1),
        }
    }

    /// The shadow whose `ctx` is at `ctx`.
    pub fn of(ctx: *const ffi::ibv_context) -> *mut ShadowCtx {
        ctx.wrapping_byte_sub(std::mem::offset_of!(ShadowCtx, ctx)) as *mut ShadowCtx
    }
}

impl ShadowCtx {
    /// The context's address now, at the GID index its peers know it by (port 1), for the
    /// status: after a restart on another node it differs from the one named by
    /// [`ShadowCtx::ident`].
    pub fn addr_now(&self) -> Option<Addr> {
        if self.real.load(Ordering::Acquire).is_null() {
            return None;
        }
        self.own_addr(1, self.gid_index.load(Ordering::Relaxed))
    }

    /// This process's address on the context's `port` now: the GID at `index`, or (−1) the
    /// LID.
    pub fn own_addr(&self, port: u8, index: i32) -> Option<Addr> {
        let real_ctx = self.real.load(Ordering::Acquire);
        if index >= 0 {
            let mut gid: ffi::ibv_gid = zeroed();
            let q = real().ibv_query_gid?;
            // SAFETY: a live real context and a GID to fill.
            // SAFETY: every bit pattern of the union is a valid `raw` array.
            (unsafe { q(real_ctx, port, index, &mut gid) } == 0).then_some(Addr(unsafe { gid.raw }))
        } else {
            port_attr(real_ctx, port).map(|a| Addr::lid(a.lid))
        }
    }
}

/// A port's attributes.
pub(crate) fn port_attr(ctx: *mut ffi::ibv_context, port: u8) -> Option<ffi::ibv_port_attr> {
    let q = real().ibv_query_port?;
    let mut a: ffi::ibv_port_attr = zeroed();
    // SAFETY: a live real context; the exported call fills a `struct ibv_port_attr`.
    (unsafe {
        q(
            ctx,
            port,
            &mut a as *mut _ as *mut ffi::_compat_ibv_port_attr,
        )
    } == 0)
        .then_some(a)
}

/// Where the layer is in the cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Objects exist; the program's calls go through.
    Up,
    /// Drained, objects alive, the program's calls held.
    Drained,
    /// Everything released: the process can be snapshotted.
    Down,
    /// Objects made again, waiting for the peers' new endpoints.
    Rebuilt,
}

static STAGE: Mutex<Stage> = Mutex::new(Stage::Up);

/// Where the layer is.
pub fn stage() -> Stage {
    *lock(&STAGE)
}

pub(crate) fn set_stage(s: Stage) {
    *lock(&STAGE) = s;
}

/// The real context behind `ctx`, or `ctx` itself when it is libibverbs' own.
///
/// # Safety
/// `ctx` is a context pointer; a shadow's is read inside the gate.
pub unsafe fn real_ctx(ctx: *mut ffi::ibv_context) -> *mut ffi::ibv_context {
    if layer().is_shadow(ctx) {
        // SAFETY: a registered shadow context.
        unsafe { (*ShadowCtx::of(ctx)).real.load(Ordering::Acquire) }
    } else {
        ctx
    }
}

/// The real PD behind `pd` (a PD's context tells whether it is a shadow).
///
/// # Safety
/// `pd` is a PD pointer.
pub unsafe fn real_pd(pd: *mut ffi::ibv_pd) -> *mut ffi::ibv_pd {
    // SAFETY: a PD's first field is its context; a shadow PD's is a shadow context.
    unsafe {
        if !pd.is_null() && layer().is_shadow((*pd).context) {
            (*(pd as *mut ShadowPd)).real.load(Ordering::Acquire)
        } else {
            pd
        }
    }
}

/// The shadow of a protection domain.
#[repr(C)]
pub struct ShadowPd {
    /// What the program sees.
    pub pd: ffi::ibv_pd,
    /// The real PD.
    pub real: Real<ffi::ibv_pd>,
}

/// How a memory region was registered, to register it again after a release.
#[derive(Debug, Clone, Copy)]
pub struct Registration {
    /// Start of the memory.
    pub addr: u64,
    /// Its length.
    pub len: usize,
    /// The I/O virtual address, when the program gave one.
    pub iova: Option<u64>,
    /// Access flags.
    pub access: u32,
}

/// The shadow of a memory region; its keys are virtual.
#[repr(C)]
pub struct ShadowMr {
    /// What the program sees (virtual `lkey` and `rkey`).
    pub mr: ffi::ibv_mr,
    /// The real MR.
    pub real: Real<ffi::ibv_mr>,
    /// How it was registered.
    pub reg: Registration,
}

/// The shadow of a completion channel; its `fd` is a proxy that outlives the real channel.
#[repr(C)]
pub struct ShadowChannel {
    /// What the program sees.
    pub ch: ffi::ibv_comp_channel,
    /// The real channel.
    pub real: Real<ffi::ibv_comp_channel>,
    /// The program's `fd`.
    pub proxy: crate::events::Proxy,
    /// Events the layer owes the program (CQs armed before a release that have completions
    /// held for it), delivered before the real channel's.
    pub owed: Mutex<VecDeque<usize>>,
}

/// The shadow of a completion queue. The real CQ's `cq_context` points here, so a completion
/// event finds its shadow without a lookup.
#[repr(C)]
pub struct ShadowCq {
    /// What the program sees (its own `cq_context` and channel).
    pub cq: ffi::ibv_cq,
    /// The real CQ.
    pub real: Real<ffi::ibv_cq>,
    /// The size and completion vector it was created with.
    pub cqe: i32,
    /// Its completion vector.
    pub vector: i32,
    /// Completions taken from the device during a quiesce that the program has not polled
    /// yet; its next polls get them first, in order.
    pub held: Mutex<VecDeque<ffi::ibv_wc>>,
    /// Whether `held` has any (read on every poll without the lock).
    pub has_held: AtomicBool,
    /// Armed for an event (`ibv_req_notify_cq`) that has not come yet.
    pub armed: AtomicBool,
    /// Events handed out from the real CQ and not yet acknowledged to it.
    pub unacked: AtomicU32,
    /// Acknowledgements the program still owes for events the layer acknowledged for it (at
    /// a release) or made up (after a rebuild); not passed on.
    pub credit: AtomicU32,
    /// Its asynchronous events (`IBV_EVENT_CQ_ERR`) not acknowledged.
    pub async_events: AsyncAcks,
}

impl ShadowCq {
    /// A shadow of `real`, made with `cqe` entries on completion vector `vector`.
    pub fn new(cq: ffi::ibv_cq, real: *mut ffi::ibv_cq, cqe: i32, vector: i32) -> Self {
        ShadowCq {
            cq,
            real: AtomicPtr::new(real),
            cqe,
            vector,
            held: Mutex::new(VecDeque::new()),
            has_held: AtomicBool::new(false),
            armed: AtomicBool::new(false),
            unacked: AtomicU32::new(0),
            credit: AtomicU32::new(0),
            async_events: AsyncAcks::default(),
        }
    }
}

/// The asynchronous events of one QP, CQ or SRQ that the program got and has not acknowledged.
/// The device's destroy of the object waits for every event it reported to be acknowledged,
/// so a release acknowledges them itself ([`AsyncAcks::acknowledge_for_program`]) and the
/// program's own acknowledgements of them later stop at the layer.
#[derive(Debug, Default)]
pub struct AsyncAcks {
    /// Events handed to the program and not acknowledged, by it or for it.
    unacked: AtomicU32,
    /// Acknowledgements the program still owes for events the layer acknowledged for it.
    credit: AtomicU32,
}

impl AsyncAcks {
    /// An event of the object was handed to the program.
    pub fn handed_out(&self) {
        self.unacked.fetch_add(1, Ordering::Relaxed);
    }

    /// The program acknowledges one event: whether the acknowledgement goes on to the real
    /// object (false: the layer acknowledged that event for it at a release).
    pub fn program_acknowledges(&self) -> bool {
        if self
            .credit
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_sub(1))
            .is_ok()
        {
            return false;
        }
        let _ = self
            .unacked
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| u.checked_sub(1));
        true
    }

    /// Before the real object is destroyed: how many events to acknowledge to it for the
    /// program, whose own acknowledgements of them the layer will keep.
    pub fn acknowledge_for_program(&self) -> u32 {
        let n = self.unacked.swap(0, Ordering::Relaxed);
        self.credit.fetch_add(n, Ordering::Relaxed);
        n
    }
}

/// A receive the program posted and has not seen complete: what a rebuild posts again.
#[derive(Clone)]
pub struct Receive {
    /// The program's id.
    pub wr_id: u64,
    /// Its scatter list, with virtual keys (held inline: a receive has one or two entries,
    /// and the hot path books one per message).
    pub sges: smallvec::SmallVec<[ffi::ibv_sge; 2]>,
}

/// The shadow of a shared receive queue; the real SRQ's `srq_context` points here.
#[repr(C)]
pub struct ShadowSrq {
    /// What the program sees.
    pub srq: ffi::ibv_srq,
    /// The real SRQ.
    pub real: Real<ffi::ibv_srq>,
    /// The attributes it was created with.
    pub init: ffi::ibv_srq_init_attr,
    /// Receives posted and not completed, in posting order.
    pub receives: Mutex<VecDeque<Receive>>,
    /// Its asynchronous events (limit reached, error) not acknowledged.
    pub async_events: AsyncAcks,
}

/// The shadow of an address handle; `dest` is the peer as the program addressed it.
#[repr(C)]
pub struct ShadowAh {
    /// What the program sees.
    pub ah: ffi::ibv_ah,
    /// The real AH.
    pub real: Real<ffi::ibv_ah>,
    /// The peer's address as the program gave it ([`Addr::id`]).
    pub dest: u64,
    /// The attributes it was created with (a rebuild creates it again).
    pub attr: ffi::ibv_ah_attr,
}

/// One `ibv_modify_qp` as the program made it, replayed on a new QP after a rebuild.
#[derive(Clone, Copy)]
pub struct Transition {
    /// The attributes (peer numbers virtual, as given).
    pub attr: ffi::ibv_qp_attr,
    /// Which attributes are set.
    pub mask: i32,
}

/// The shadow of a queue pair; `ex.qp_base.qp_num` is virtual. The real QP's `qp_context`
/// points here.
#[repr(C)]
pub struct ShadowQp {
    /// What the program sees: the QP (`qp_base`, at the shadow's address) and, for a QP made
    /// with `ibv_create_qp_ex` and send operations, the extended post calls
    /// ([`crate::extended`]) that `ibv_qp_to_qp_ex` hands out.
    pub ex: ffi::ibv_qp_ex,
    /// The real QP.
    pub real: Real<ffi::ibv_qp>,
    /// The real QP number now.
    pub real_qpn: AtomicU32,
    /// The connected peer (RC) as the program addressed it: its address id and virtual QPN.
    pub peer: Mutex<Option<(u64, u32)>>,
    /// Every state change, in order.
    pub transitions: Mutex<Vec<Transition>>,
    /// The attributes it was created with.
    pub init: ffi::ibv_qp_init_attr,
    /// Signalled sends posted whose completion has not been polled.
    pub signalled: AtomicU64,
    /// Receives posted (on the QP itself, not an SRQ) and not completed, in posting order.
    pub receives: Mutex<VecDeque<Receive>>,
    /// Flush markers of a quiesce posted and not yet completed.
    pub markers: AtomicU32,
    /// Its asynchronous events not acknowledged.
    pub async_events: AsyncAcks,
    /// The send operations it was made for (`ibv_create_qp_ex`'s `send_ops_flags`; 0: a
    /// plain QP, without the extended post calls). A rebuild makes the real QP with them too.
    pub send_ops: u64,
    /// The extended post calls' work requests since `ibv_wr_start`, posted at once by
    /// `ibv_wr_complete`.
    pub session: Mutex<crate::extended::session::Session>,
}

impl ShadowQp {
    /// A shadow of `real` (number `real_qpn`), created with `init`.
    pub fn new(
        qp: ffi::ibv_qp,
        real: *mut ffi::ibv_qp,
        real_qpn: u32,
        init: ffi::ibv_qp_init_attr,
    ) -> Self {
        let mut ex: ffi::ibv_qp_ex = zeroed();
        ex.qp_base = qp;
        ShadowQp {
            ex,
            real: AtomicPtr::new(real),
            real_qpn: AtomicU32::new(real_qpn),
            peer: Mutex::new(None),
            transitions: Mutex::new(Vec::new()),
            init,
            signalled: AtomicU64::new(0),
            receives: Mutex::new(VecDeque::new()),
            markers: AtomicU32::new(0),
            async_events: AsyncAcks::default(),
            send_ops: 0,
            session: Mutex::new(crate::extended::session::Session::default()),
        }
    }
}

/// Counters of the layer's work, reported by [`crate::status`].
#[derive(Debug, Default)]
pub struct Counters {
    /// Send work requests posted.
    pub send_wrs: AtomicU64,
    /// Receive work requests posted (QP and SRQ).
    pub recv_wrs: AtomicU64,
    /// Completions handed to the program.
    pub completions: AtomicU64,
    /// Local keys that were not ours (passed unchanged).
    pub unknown_lkeys: AtomicU64,
    /// Completions whose QP number was not ours (passed unchanged).
    pub unknown_qpns: AtomicU64,
    /// Calls refused because the layer does not support them.
    pub refused: AtomicU64,
    /// Real QPs a create set aside because their number was a virtual one of the job's.
    pub qpns_set_aside: AtomicU64,
    /// Asynchronous events the program got and had not acknowledged when a release
    /// acknowledged them for it.
    pub async_events_acked_for_program: AtomicU64,
}

/// Everything the layer knows about the process's verbs objects.
#[derive(Debug, Default)]
pub struct Layer {
    /// Virtual ↔ real identifiers.
    pub tables: Tables,
    /// Work counted.
    pub counters: Counters,
    /// Shadow contexts, by address.
    pub contexts: Mutex<HashSet<usize>>,
    /// Live shadow PDs, by address.
    pub pds: Mutex<HashSet<usize>>,
    /// Live shadow MRs, by address.
    pub mrs: Mutex<HashSet<usize>>,
    /// Live shadow completion channels, by address.
    pub channels: Mutex<HashSet<usize>>,
    /// Live shadow CQs, by address.
    pub cqs: Mutex<HashSet<usize>>,
    /// Live shadow SRQs, by address.
    pub srqs: Mutex<HashSet<usize>>,
    /// Live shadow QPs, by address.
    pub qps: Mutex<HashSet<usize>>,
    /// Live shadow AHs, by address.
    pub ahs: Mutex<HashSet<usize>>,
    /// Features the program asked for that the layer refused, with the call, for the status.
    pub refusals: Mutex<Vec<String>>,
    /// Multicast groups attached to shadow QPs (passed through; nothing rebuilds them).
    pub multicast: Mutex<Vec<Attachment>>,
}

/// A multicast group attached to a shadow QP (`ibv_attach_mcast`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attachment {
    /// The shadow QP, by address.
    pub qp: usize,
    /// Its virtual QP number (for messages).
    pub qpn: u32,
    /// The group's GID.
    pub gid: [u8; 16],
    /// The group's LID.
    pub lid: u16,
}

/// Locks, taking the data of a poisoned lock (every update under these locks is one step).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Layer {
    /// Remembers a shadow context.
    pub fn add_context(&self, c: *mut ShadowCtx) {
        lock(&self.contexts).insert(c as usize);
    }

    /// Forgets one.
    pub fn remove_context(&self, c: *mut ShadowCtx) {
        lock(&self.contexts).remove(&(c as usize));
    }

    /// Whether `ctx` is one of this layer's contexts (otherwise a real one, passed through).
    pub fn is_shadow(&self, ctx: *mut ffi::ibv_context) -> bool {
        !ctx.is_null() && lock(&self.contexts).contains(&(ShadowCtx::of(ctx) as usize))
    }

    /// Records a refused call: counted, kept for the status (at most 64 distinct).
    pub fn refuse(&self, what: String) {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        let mut r = lock(&self.refusals);
        if r.len() < 64 && !r.contains(&what) {
            r.push(what);
        }
    }

    /// Notes a multicast group attached (once per QP, group and LID).
    pub fn attach_multicast(&self, a: Attachment) {
        let mut m = lock(&self.multicast);
        if !m.contains(&a) {
            m.push(a);
        }
    }

    /// Forgets a group detached from a QP.
    pub fn detach_multicast(&self, qp: usize, gid: [u8; 16], lid: u16) {
        lock(&self.multicast).retain(|a| !(a.qp == qp && a.gid == gid && a.lid == lid));
    }

    /// Forgets every group of a QP destroyed (the kernel detaches them with it).
    pub fn forget_multicast(&self, qp: usize) {
        lock(&self.multicast).retain(|a| a.qp != qp);
    }

    /// The features the program uses now that the layer cannot rebuild after a snapshot, each
    /// named with its call; empty when there are none.
    pub fn unsupported_in_use(&self) -> Vec<String> {
        let m = lock(&self.multicast);
        match m.first() {
            None => Vec::new(),
            Some(a) => vec![format!(
                "multicast (ibv_attach_mcast): {} group(s) attached, the first {} on QP {:#x}",
                m.len(),
                std::net::Ipv6Addr::from(a.gid),
                a.qpn
            )],
        }
    }

    /// Adds to a set of live shadows.
    pub fn track(set: &Mutex<HashSet<usize>>, p: usize) {
        lock(set).insert(p);
    }

    /// Removes from a set of live shadows.
    pub fn untrack(set: &Mutex<HashSet<usize>>, p: usize) {
        lock(set).remove(&p);
    }

    /// The addresses in a set of live shadows.
    pub fn live(set: &Mutex<HashSet<usize>>) -> Vec<usize> {
        let mut v: Vec<usize> = lock(set).iter().copied().collect();
        v.sort_unstable();
        v
    }
}

/// The process's layer.
pub fn layer() -> &'static Layer {
    static LAYER: std::sync::OnceLock<Layer> = std::sync::OnceLock::new();
    LAYER.get_or_init(Layer::default)
}

/// The address of the peer an address vector names.
pub fn addr_of(ah: &ffi::ibv_ah_attr) -> Addr {
    if ah.is_global != 0 {
        // SAFETY: every bit pattern of the union is a valid `raw` array.
        Addr(unsafe { ah.grh.dgid.raw })
    } else {
        Addr::lid(ah.dlid)
    }
}

/// Moves a value to the heap and hands out its address; freed with [`free`].
pub fn boxed<T>(v: T) -> *mut T {
    Box::into_raw(Box::new(v))
}

/// Frees what [`boxed`] made.
///
/// # Safety
/// `p` came from [`boxed`] with the same `T` and is not used again.
pub unsafe fn free<T>(p: *mut T) {
    // SAFETY: as the caller promises.
    drop(unsafe { Box::from_raw(p) });
}

pub use crate::real::zeroed;

#[cfg(test)]
mod async_acks_tests {
    use super::AsyncAcks;

    #[test]
    fn events_acknowledged_at_a_release_are_not_acknowledged_again_when_the_program_does() {
        let a = AsyncAcks::default();
        assert_eq!(a.acknowledge_for_program(), 0, "nothing handed out");
        a.handed_out();
        a.handed_out();
        assert!(
            a.program_acknowledges(),
            "the program's own, before a release"
        );
        // A checkpoint comes between the program's get of the second and its ack.
        assert_eq!(a.acknowledge_for_program(), 1);
        assert!(!a.program_acknowledges(), "the layer did it: kept");
        // An event after the rebuild, on the new real object, goes on as before.
        a.handed_out();
        assert_eq!(
            a.acknowledge_for_program(),
            1,
            "unless a release comes first"
        );
        a.handed_out();
        assert!(!a.program_acknowledges());
        assert!(a.program_acknowledges());
        assert!(
            a.program_acknowledges(),
            "an acknowledgement the layer cannot place goes on (the library's own check)"
        );
        assert_eq!(a.acknowledge_for_program(), 0);
    }
}
