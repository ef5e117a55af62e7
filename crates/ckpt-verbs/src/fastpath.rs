//! The header-inline calls: `ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`,
//! `ibv_poll_cq` and `ibv_req_notify_cq` reach these functions through the operation table of
//! a shadow context, so they only ever see shadow objects.
//!
//! A post copies the program's chain of work requests into a per-thread scratch area with
//! every identifier translated (local keys in each scatter/gather entry, the peer's rkey of an
//! RDMA or atomic request, the address handle and QP number of a UD send) and posts the copy on
//! the real QP; a refused request is mapped back to the program's own. The program's requests
//! are never written. A poll translates the QP number of each completion back to the virtual
//! one.
//!
//! Every call passes the gate ([`crate::gate`]), which holds it while the layer is quiesced.
//! What a quiesce must know is kept on the way: each QP's signalled sends not yet completed,
//! and each receive posted and not yet completed (what a rebuild posts again). A poll hands
//! out the completions held at a quiesce first, and drops those of the layer's own flush
//! markers.
// The trampolines below are entries of a verbs operation table, with the contract of the
// inline call of the same name in verbs.h.
#![allow(clippy::missing_safety_doc)]
use std::cell::RefCell;
use std::os::raw::c_int;
use std::sync::atomic::Ordering::{Acquire, Relaxed};

use ffi::ibv_wr_opcode as op;
use ibverbs_sys as ffi;

use crate::gate::gate;
use crate::shadow::{layer, lock, Receive, ShadowAh, ShadowCq, ShadowQp, ShadowSrq};
use crate::xlate::{Addr, Found, Tables};

/// The work request id of the layer's flush markers (not a user-space address, so no
/// program's pointer-valued id is equal to it).
pub const MARKER_WR: u64 = 0xcc4b_7f1a_5400_0001;

/// Work requests in one chain at most: a bound on walking a list the program handed us.
pub const MAX_CHAIN: usize = 1 << 16;

/// Per-thread copies of the chain being posted.
/// (No `Debug`: the verbs request structs hold unions.)
#[allow(missing_debug_implementations)]
#[derive(Default)]
pub struct Scratch {
    sends: Vec<ffi::ibv_send_wr>,
    recvs: Vec<ffi::ibv_recv_wr>,
    sges: Vec<ffi::ibv_sge>,
    starts: Vec<usize>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Why a work request cannot be posted: its index in the chain and the errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// Index of the request in the program's chain.
    pub index: usize,
    /// errno for the program.
    pub errno: c_int,
}

/// What the translation of a send needs to know about its QP.
#[allow(missing_debug_implementations)]
pub struct SendTarget<'a> {
    /// The connected peer (RC), for rkeys: asked only when a request needs it (an RDMA or
    /// atomic one), so that sends and UD traffic take no lock for it.
    pub peer: &'a mut dyn FnMut() -> Option<u64>,
    /// Whether the QP is UD (requests carry an address handle).
    pub ud: bool,
}

/// Copies one scatter/gather list with its local keys translated; returns where it starts.
///
/// # Safety
/// `list` points to `n` entries (or `n` is 0).
unsafe fn copy_sges(
    t: &Tables,
    sges: &mut Vec<ffi::ibv_sge>,
    list: *const ffi::ibv_sge,
    n: c_int,
    inline: bool,
) -> Result<usize, c_int> {
    let start = sges.len();
    if n < 0 {
        return Err(libc::EINVAL);
    }
    for j in 0..n as usize {
        // SAFETY: the caller's list has `n` entries.
        let mut s = unsafe { *list.add(j) };
        if inline {
            // The data is copied into the request at post time; the key is not used.
            sges.push(s);
            continue;
        }
        s.lkey = match t.lkey(s.lkey) {
            Found::Real(k) => k,
            Found::Unknown(k) => {
                layer().counters.unknown_lkeys.fetch_add(1, Relaxed);
                k
            }
        };
        sges.push(s);
    }
    Ok(start)
}

/// A work request kind: what linking the copies of a chain needs.
trait Request: Sized {
    fn num_sge(&self) -> c_int;
    fn next(&self) -> *mut Self;
    fn set_links(&mut self, list: *mut ffi::ibv_sge, next: *mut Self);
}

impl Request for ffi::ibv_send_wr {
    fn num_sge(&self) -> c_int {
        self.num_sge
    }
    fn next(&self) -> *mut Self {
        self.next
    }
    fn set_links(&mut self, list: *mut ffi::ibv_sge, next: *mut Self) {
        self.sg_list = list;
        self.next = next;
    }
}

impl Request for ffi::ibv_recv_wr {
    fn num_sge(&self) -> c_int {
        self.num_sge
    }
    fn next(&self) -> *mut Self {
        self.next
    }
    fn set_links(&mut self, list: *mut ffi::ibv_sge, next: *mut Self) {
        self.sg_list = list;
        self.next = next;
    }
}

/// Points each copy at its own entries in `sges` (from `starts`) and at the next copy. Neither
/// vector may grow afterwards: the pointers are into them.
fn link<W: Request>(wrs: &mut [W], sges: &mut [ffi::ibv_sge], starts: &[usize]) {
    let n = wrs.len();
    let base = sges.as_mut_ptr();
    let first = wrs.as_mut_ptr();
    for (i, w) in wrs.iter_mut().enumerate() {
        let list = if w.num_sge() == 0 {
            std::ptr::null_mut()
        } else {
            base.wrapping_add(starts[i])
        };
        let next = if i + 1 < n {
            first.wrapping_add(i + 1)
        } else {
            std::ptr::null_mut()
        };
        w.set_links(list, next);
    }
}

/// Copies the program's chain (at most [`MAX_CHAIN`] requests) into `out`, each copy as
/// `each(copy)` makes it; the first refusal names the request's place.
///
/// # Safety
/// `wr` is a null-terminated chain of valid requests.
unsafe fn copy_chain<W: Request + Copy>(
    wr: *const W,
    out: &mut Vec<W>,
    mut each: impl FnMut(W) -> Result<W, c_int>,
) -> Result<(), Refused> {
    let mut p = wr;
    let mut index = 0;
    while !p.is_null() {
        if index == MAX_CHAIN {
            return Err(Refused {
                index,
                errno: libc::EINVAL,
            });
        }
        // SAFETY: `p` is an element of the caller's chain.
        let w = unsafe { *p };
        out.push(each(w).map_err(|errno| Refused { index, errno })?);
        p = w.next();
        index += 1;
    }
    Ok(())
}

/// Translates a chain of send requests into `sc.sends` (linked, with their own lists).
///
/// # Safety
/// `wr` is a null-terminated chain of valid requests; a UD request's `ah` is a shadow AH.
pub unsafe fn translate_sends(
    t: &Tables,
    target: SendTarget<'_>,
    wr: *const ffi::ibv_send_wr,
    sc: &mut Scratch,
) -> Result<(), Refused> {
    let Scratch {
        sends,
        sges,
        starts,
        ..
    } = sc;
    sends.clear();
    sges.clear();
    starts.clear();
    let each = |mut w: ffi::ibv_send_wr| {
        let inline = w.send_flags & ffi::ibv_send_flags::IBV_SEND_INLINE.0 != 0;
        // SAFETY: `sg_list` has `num_sge` entries (verbs.h).
        starts.push(unsafe { copy_sges(t, sges, w.sg_list, w.num_sge, inline) }?);
        match w.opcode {
            op::IBV_WR_SEND | op::IBV_WR_SEND_WITH_IMM => {}
            op::IBV_WR_RDMA_WRITE | op::IBV_WR_RDMA_WRITE_WITH_IMM | op::IBV_WR_RDMA_READ => {
                let peer = (target.peer)().ok_or(libc::EINVAL)?;
                // SAFETY: RDMA requests use the `rdma` member of the union.
                unsafe { w.wr.rdma.rkey = t.remote_rkey(peer, w.wr.rdma.rkey) };
            }
            op::IBV_WR_ATOMIC_CMP_AND_SWP | op::IBV_WR_ATOMIC_FETCH_AND_ADD => {
                let peer = (target.peer)().ok_or(libc::EINVAL)?;
                // SAFETY: atomic requests use the `atomic` member of the union.
                unsafe { w.wr.atomic.rkey = t.remote_rkey(peer, w.wr.atomic.rkey) };
            }
            _ => return Err(libc::EOPNOTSUPP),
        }
        if target.ud {
            // SAFETY: UD requests use the `ud` member; its `ah` is a shadow AH of this layer.
            unsafe {
                let ah = w.wr.ud.ah as *const ShadowAh;
                if ah.is_null() {
                    return Err(libc::EINVAL);
                }
                w.wr.ud.remote_qpn = t.remote_qpn((*ah).dest, w.wr.ud.remote_qpn);
                w.wr.ud.ah = (*ah).real.load(Acquire);
            }
        }
        Ok(w)
    };
    // SAFETY: as the caller promises.
    unsafe { copy_chain(wr, sends, each) }?;
    link(sends, sges, starts);
    Ok(())
}

/// Translates a chain of receive requests into `sc.recvs`.
///
/// # Safety
/// `wr` is a null-terminated chain of valid requests.
pub unsafe fn translate_recvs(
    t: &Tables,
    wr: *const ffi::ibv_recv_wr,
    sc: &mut Scratch,
) -> Result<(), Refused> {
    let Scratch {
        recvs,
        sges,
        starts,
        ..
    } = sc;
    recvs.clear();
    sges.clear();
    starts.clear();
    let each = |w: ffi::ibv_recv_wr| {
        // SAFETY: its list has `num_sge` entries.
        starts.push(unsafe { copy_sges(t, sges, w.sg_list, w.num_sge, false) }?);
        Ok(w)
    };
    // SAFETY: as the caller promises.
    unsafe { copy_chain(wr, recvs, each) }?;
    link(recvs, sges, starts);
    Ok(())
}

/// The program's request at `index` of its chain.
///
/// # Safety
/// `wr` is a chain with more than `index` elements.
unsafe fn nth<W: Request>(wr: *mut W, index: usize) -> *mut W {
    let mut p = wr;
    for _ in 0..index {
        // SAFETY: as the caller promises.
        p = unsafe { (*p).next() };
    }
    p
}

/// A request the layer refused: the program's `bad` points at it; returns the errno.
///
/// # Safety
/// `wr` is the program's chain, with more than `r.index` elements.
unsafe fn refused<W: Request>(r: Refused, wr: *mut W, bad: *mut *mut W) -> c_int {
    if !bad.is_null() {
        // SAFETY: as the caller promises.
        unsafe { *bad = nth(wr, r.index) };
    }
    r.errno
}

/// After the real post: counts what the device accepted and, when it refused a request,
/// points the program's `bad` at its own request in that place. Returns how many requests
/// the device accepted.
///
/// # Safety
/// `rbad` is null or one of `copies`; `wr` is the program's chain that `copies` mirror.
unsafe fn report<W: Request>(
    rc: c_int,
    rbad: *mut W,
    copies: &[W],
    wr: *mut W,
    bad: *mut *mut W,
    counter: &std::sync::atomic::AtomicU64,
) -> usize {
    let accepted = if rc == 0 {
        copies.len()
    } else if rbad.is_null() {
        0
    } else {
        // SAFETY: one of our copies.
        (unsafe { rbad.offset_from(copies.as_ptr()) }).max(0) as usize
    };
    counter.fetch_add(accepted as u64, Relaxed);
    if rc != 0 && !bad.is_null() {
        // SAFETY: the program's chain has more than `accepted` elements.
        unsafe { *bad = nth(wr, accepted) };
    }
    accepted
}

/// Whether a completion polled from `cq` is of a receive of `qp` (an error completion says
/// no opcode: the CQ, or the oldest receive's id, tells).
fn is_receive(qp: &ShadowQp, cq: usize, wc: &ffi::ibv_wc) -> bool {
    if wc.is_valid() {
        return wc.opcode() & ffi::ibv_wc_opcode::IBV_WC_RECV != 0;
    }
    match (
        qp.ex.qp_base.send_cq as usize == cq,
        qp.ex.qp_base.recv_cq as usize == cq,
    ) {
        (false, true) => true,
        (true, false) => false,
        _ => {
            qp.ex.qp_base.srq.is_null()
                && lock(&qp.receives)
                    .front()
                    .is_some_and(|r| r.wr_id == wc.wr_id())
        }
    }
}

/// Forgets the receive a completion consumed, and returns it: the oldest of the QP's own (they
/// complete in order), or the SRQ's with its id.
fn consumed(qp: &ShadowQp, wr_id: u64) -> Option<Receive> {
    if qp.ex.qp_base.srq.is_null() {
        return lock(&qp.receives).pop_front();
    }
    // SAFETY: a shadow QP's SRQ is a shadow SRQ, alive while a QP uses it.
    let srq = unsafe { &*(qp.ex.qp_base.srq as *const ShadowSrq) };
    let mut r = lock(&srq.receives);
    let i = r.iter().position(|x| x.wr_id == wr_id)?;
    r.remove(i)
}

/// The sender's GID in the 40 bytes a UD receive starts with when its completion has
/// `IBV_WC_GRH`: an IB or RoCE v1 GRH (an IPv6 header's layout), or for RoCE v2 over IPv4, 20
/// unused bytes then the IPv4 header, whose source address is the GID's IPv4-mapped form.
pub fn grh_source_gid(grh: &[u8; 40]) -> Option<[u8; 16]> {
    if grh[0] >> 4 == 6 {
        return grh[8..24].try_into().ok();
    }
    if grh[20] >> 4 == 4 {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&grh[32..36]);
        return Some(gid);
    }
    None
}

/// A UD receive's `src_qp` back to the sender's virtual QP number, once a peer has rebuilt:
/// the sender is found by the GRH at the head of the receive's buffer (RoCE, and IB with a
/// GRH), or else by its source LID.
fn translate_source(t: &Tables, wc: &mut ffi::ibv_wc, r: &Receive) {
    let from = if wc.wc_flags.0 & ffi::ibv_wc_flags::IBV_WC_GRH.0 != 0 {
        let Some(sge) = r.sges.first().filter(|s| s.length >= 40) else {
            return;
        };
        let mut grh = [0u8; 40];
        // SAFETY: the program's receive buffer, registered and posted with at least 40 bytes,
        // into which the device has just written the GRH (this completion says so).
        unsafe { std::ptr::copy_nonoverlapping(sge.addr as *const u8, grh.as_mut_ptr(), 40) };
        match grh_source_gid(&grh) {
            Some(gid) => Addr(gid),
            None => return,
        }
    } else {
        Addr::lid(wc.slid)
    };
    // A sender the layer holds nothing of since the reconnect: its endpoints are asked for.
    if !t.knows_port(from) && t.needs_lookup(from.id()) {
        crate::lookup::meet(from.id());
    }
    wc.src_qp = t.remote_source_qpn(from, wc.src_qp);
}

/// Settles completions polled from the real CQ behind `cq` (a shadow's address), in place:
/// each QP number back to the virtual one, the QP's books updated, the layer's markers
/// dropped. Returns how many are the program's (moved to the front).
pub fn settle_completions(t: &Tables, cq: usize, wcs: &mut [ffi::ibv_wc]) -> usize {
    let mut kept = 0;
    for i in 0..wcs.len() {
        let mut wc = wcs[i];
        match t.local_qp(wc.qp_num) {
            None => {
                layer().counters.unknown_qpns.fetch_add(1, Relaxed);
            }
            Some((virt, shadow)) => {
                wc.qp_num = virt;
                // SAFETY: the table holds live shadow QPs only.
                let qp = unsafe { &*(shadow as *const ShadowQp) };
                if is_receive(qp, cq, &wc) {
                    let r = consumed(qp, wc.wr_id());
                    if let Some(r) = r.filter(|_| {
                        qp.ex.qp_base.qp_type == ffi::ibv_qp_type::IBV_QPT_UD
                            && wc.is_valid()
                            && t.translates_remote_qpns()
                    }) {
                        translate_source(t, &mut wc, &r);
                    }
                } else if wc.wr_id() == MARKER_WR {
                    let _ = qp
                        .markers
                        .fetch_update(Relaxed, Relaxed, |m| m.checked_sub(1));
                    continue;
                } else {
                    let _ = qp
                        .signalled
                        .fetch_update(Relaxed, Relaxed, |m| m.checked_sub(1));
                }
            }
        }
        wcs[kept] = wc;
        kept += 1;
    }
    kept
}

fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        // Re-entered on this thread (a signal handler posting): a scratch of its own.
        Err(_) => f(&mut Scratch::default()),
    })
}

/// `ibv_post_send` on a shadow QP.
pub unsafe extern "C" fn post_send(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> c_int {
    // SAFETY: this table is only reachable from shadow QPs (their context is a shadow
    // context), whose public struct is the first field of a `ShadowQp`.
    let s = unsafe { &*(qp as *const ShadowQp) };
    let l = layer();
    let _pass = gate().enter();
    let mut peer = || s.peer.lock().ok().and_then(|p| p.map(|(a, _)| a));
    let target = SendTarget {
        peer: &mut peer,
        ud: s.ex.qp_base.qp_type == ffi::ibv_qp_type::IBV_QPT_UD,
    };
    with_scratch(|sc| {
        // SAFETY: the program's chain, as the verbs contract requires.
        if let Err(r) = unsafe { translate_sends(&l.tables, target, wr, sc) } {
            // SAFETY: the chain has more than `r.index` elements.
            return unsafe { refused(r, wr, bad) };
        }
        let real = s.real.load(Acquire);
        let mut rbad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `real` is a live QP of libibverbs; its context's table has post_send.
        let rc = unsafe {
            let f = (*(*real).context).ops.post_send.expect("post_send");
            f(real, sc.sends.as_mut_ptr(), &mut rbad)
        };
        // SAFETY: the provider's bad request, if any, is one of our copies; the program's
        // chain mirrors them.
        let accepted = unsafe { report(rc, rbad, &sc.sends, wr, bad, &l.counters.send_wrs) };
        let all = s.init.sq_sig_all != 0;
        let signalled = sc.sends[..accepted]
            .iter()
            .filter(|w| all || w.send_flags & ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 != 0)
            .count();
        if signalled > 0 {
            s.signalled.fetch_add(signalled as u64, Relaxed);
        }
        rc
    })
}

/// The first `n` requests of the program's chain, as a rebuild posts them again.
///
/// # Safety
/// `wr` is a chain of at least `n` valid requests.
unsafe fn receives(wr: *const ffi::ibv_recv_wr, n: usize) -> impl Iterator<Item = Receive> {
    let mut p = wr;
    (0..n).map(move |_| {
        // SAFETY: as the caller promises; each list has `num_sge` entries.
        unsafe {
            let w = &*p;
            p = w.next;
            let sges = if w.num_sge > 0 {
                smallvec::SmallVec::from_slice(std::slice::from_raw_parts(
                    w.sg_list,
                    w.num_sge as usize,
                ))
            } else {
                smallvec::SmallVec::new()
            };
            Receive {
                wr_id: w.wr_id,
                sges,
            }
        }
    })
}

/// Posts translated receives with `post` (a QP's or an SRQ's), mapping a refusal back, and
/// records those the device accepted in `book`.
///
/// # Safety
/// `wr` is the program's chain; `post` posts on a live real queue.
unsafe fn post_receives(
    wr: *mut ffi::ibv_recv_wr,
    bad: *mut *mut ffi::ibv_recv_wr,
    book: &std::sync::Mutex<std::collections::VecDeque<Receive>>,
    post: impl FnOnce(*mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> c_int,
) -> c_int {
    let l = layer();
    let _pass = gate().enter();
    with_scratch(|sc| {
        // SAFETY: the program's chain.
        if let Err(r) = unsafe { translate_recvs(&l.tables, wr, sc) } {
            // SAFETY: the chain has more than `r.index` elements.
            return unsafe { refused(r, wr, bad) };
        }
        let mut rbad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        let rc = post(sc.recvs.as_mut_ptr(), &mut rbad);
        // SAFETY: the provider's bad request, if any, is one of our copies; the program's
        // chain mirrors them and has `accepted` requests at least.
        unsafe {
            let accepted = report(rc, rbad, &sc.recvs, wr, bad, &l.counters.recv_wrs);
            lock(book).extend(receives(wr, accepted));
        }
        rc
    })
}

/// A receive trampoline: `$name` on the shadow `$shadow` of a `$obj`, posting on its real
/// object through the real context's `$op`.
macro_rules! receive_trampoline {
    ($(#[$m:meta])* $name:ident, $obj:ty, $shadow:ty, $op:ident) => {
        $(#[$m])*
        pub unsafe extern "C" fn $name(
            q: *mut $obj,
            wr: *mut ffi::ibv_recv_wr,
            bad: *mut *mut ffi::ibv_recv_wr,
        ) -> c_int {
            // SAFETY: only shadows reach this table; their public struct comes first.
            let s = unsafe { &*(q as *const $shadow) };
            // SAFETY: `real` is read inside the gate, live there; the chain is the program's.
            unsafe {
                post_receives(wr, bad, &s.receives, |w, b| {
                    let real = s.real.load(Acquire);
                    let f = (*(*real).context).ops.$op.expect(stringify!($op));
                    f(real, w, b)
                })
            }
        }
    };
}

receive_trampoline!(
    /// `ibv_post_recv` on a shadow QP.
    post_recv, ffi::ibv_qp, ShadowQp, post_recv
);
receive_trampoline!(
    /// `ibv_post_srq_recv` on a shadow SRQ.
    post_srq_recv, ffi::ibv_srq, ShadowSrq, post_srq_recv
);

/// Moves up to `n` held completions of `s` to `wc`; returns how many.
///
/// # Safety
/// `wc` has room for `n` completions.
unsafe fn take_held(s: &ShadowCq, n: usize, wc: *mut ffi::ibv_wc) -> usize {
    let mut held = lock(&s.held);
    let k = n.min(held.len());
    for i in 0..k {
        // SAFETY: `i < n`.
        unsafe { *wc.add(i) = held.pop_front().expect("counted") };
    }
    if held.is_empty() {
        s.has_held.store(false, Relaxed);
    }
    k
}

/// `ibv_poll_cq` on a shadow CQ: completions held at a quiesce first, then the device's.
pub unsafe extern "C" fn poll_cq(cq: *mut ffi::ibv_cq, n: c_int, wc: *mut ffi::ibv_wc) -> c_int {
    // SAFETY: only shadow CQs reach this table.
    let s = unsafe { &*(cq as *const ShadowCq) };
    let _pass = gate().enter();
    let n = n.max(0) as usize;
    let mut got = 0;
    if s.has_held.load(Relaxed) {
        // SAFETY: `wc` has room for `n` completions.
        got = unsafe { take_held(s, n, wc) };
    }
    let l = layer();
    while got < n {
        let real = s.real.load(Acquire);
        // SAFETY: `real` is live inside the gate; `wc` has room for `n - got` more.
        let polled = unsafe {
            let f = (*(*real).context).ops.poll_cq.expect("poll_cq");
            f(real, (n - got) as c_int, wc.add(got))
        };
        if polled <= 0 {
            if polled < 0 && got == 0 {
                return polled;
            }
            break;
        }
        // SAFETY: the provider filled `polled` entries.
        let wcs = unsafe { std::slice::from_raw_parts_mut(wc.add(got), polled as usize) };
        let kept = settle_completions(&l.tables, cq as usize, wcs);
        got += kept;
        // Only a marker was dropped when fewer were kept: poll again for the program's.
        if kept == polled as usize {
            break;
        }
    }
    if got > 0 {
        // Not on an empty poll: a program polls in a loop.
        l.counters.completions.fetch_add(got as u64, Relaxed);
    }
    got as c_int
}

/// `ibv_req_notify_cq` on a shadow CQ.
pub unsafe extern "C" fn req_notify_cq(cq: *mut ffi::ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: only shadow CQs reach this table.
    let s = unsafe { &*(cq as *const ShadowCq) };
    let _pass = gate().enter();
    let real = s.real.load(Acquire);
    s.armed.store(true, Relaxed);
    // SAFETY: `real` is a live CQ inside the gate.
    unsafe {
        let f = (*(*real).context).ops.req_notify_cq.expect("req_notify_cq");
        f(real, solicited_only)
    }
}

#[cfg(test)]
mod tests;
