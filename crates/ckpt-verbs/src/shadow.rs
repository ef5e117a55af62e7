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
use std::collections::HashSet;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use ibverbs_sys as ffi;

use crate::xlate::{Addr, Tables};

/// The shadow of a device context. The program sees `ctx`.
#[repr(C)]
pub struct ShadowCtx {
    /// What the program sees: device, fds and the operation table of this layer.
    pub ctx: ffi::ibv_context,
    /// libibverbs' context.
    pub real: *mut ffi::ibv_context,
}

/// The shadow of a protection domain.
#[repr(C)]
#[derive(Debug)]
pub struct ShadowPd {
    /// What the program sees.
    pub pd: ffi::ibv_pd,
    /// The real PD.
    pub real: *mut ffi::ibv_pd,
}

/// The shadow of a memory region; its keys are virtual.
#[repr(C)]
#[derive(Debug)]
pub struct ShadowMr {
    /// What the program sees (virtual `lkey` and `rkey`).
    pub mr: ffi::ibv_mr,
    /// The real MR.
    pub real: *mut ffi::ibv_mr,
    /// Access flags it was registered with (a rebuild registers it again).
    pub access: u32,
}

/// The shadow of a completion channel.
#[repr(C)]
#[derive(Debug)]
pub struct ShadowChannel {
    /// What the program sees.
    pub ch: ffi::ibv_comp_channel,
    /// The real channel.
    pub real: *mut ffi::ibv_comp_channel,
}

/// The shadow of a completion queue. The real CQ's `cq_context` points here, so a completion
/// event finds its shadow without a lookup.
#[repr(C)]
pub struct ShadowCq {
    /// What the program sees (its own `cq_context` and channel).
    pub cq: ffi::ibv_cq,
    /// The real CQ.
    pub real: AtomicPtr<ffi::ibv_cq>,
}

/// The shadow of a shared receive queue; the real SRQ's `srq_context` points here.
#[repr(C)]
pub struct ShadowSrq {
    /// What the program sees.
    pub srq: ffi::ibv_srq,
    /// The real SRQ.
    pub real: AtomicPtr<ffi::ibv_srq>,
}

/// The shadow of an address handle; `dest` is the peer as the program addressed it.
#[repr(C)]
pub struct ShadowAh {
    /// What the program sees.
    pub ah: ffi::ibv_ah,
    /// The real AH.
    pub real: AtomicPtr<ffi::ibv_ah>,
    /// The peer's address.
    pub dest: Addr,
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

/// The shadow of a queue pair; `qp.qp_num` is virtual. The real QP's `qp_context` points here.
#[repr(C)]
pub struct ShadowQp {
    /// What the program sees.
    pub qp: ffi::ibv_qp,
    /// The real QP.
    pub real: AtomicPtr<ffi::ibv_qp>,
    /// The real QP number now.
    pub real_qpn: AtomicU32,
    /// The connected peer (RC/UC) as the program addressed it.
    pub peer: Mutex<Option<(Addr, u32)>>,
    /// Every state change, in order.
    pub transitions: Mutex<Vec<Transition>>,
    /// The attributes it was created with.
    pub init: ffi::ibv_qp_init_attr,
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
}

/// Everything the layer knows about the process's verbs objects.
#[derive(Debug, Default)]
pub struct Layer {
    /// Virtual ↔ real identifiers.
    pub tables: Tables,
    /// Work counted.
    pub counters: Counters,
    /// Shadow contexts, by address.
    contexts: Mutex<HashSet<usize>>,
    /// Live shadow QPs, by address.
    pub qps: Mutex<HashSet<usize>>,
    /// Live shadow MRs, by address.
    pub mrs: Mutex<HashSet<usize>>,
    /// Features the program asked for that the layer refused, with the call, for the status.
    pub refusals: Mutex<Vec<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
        !ctx.is_null() && lock(&self.contexts).contains(&(ctx as usize))
    }

    /// Records a refused call: counted, kept for the status (at most 64 distinct).
    pub fn refuse(&self, what: String) {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        let mut r = lock(&self.refusals);
        if r.len() < 64 && !r.contains(&what) {
            r.push(what);
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

/// A zeroed plain-data verbs struct (all of them are valid zeroed, mutexes included: glibc's
/// static initializer is all zeros).
pub fn zeroed<T>() -> T {
    // SAFETY: used only for libibverbs' plain C structs, for which all-zero is valid.
    unsafe { std::mem::zeroed() }
}
