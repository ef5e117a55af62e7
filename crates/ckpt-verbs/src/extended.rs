//! rdma-core's newer post calls (`ibv_create_qp_ex` with send operations, `ibv_qp_to_qp_ex`,
//! `ibv_wr_start` ... `ibv_wr_complete`), which libraries other than UCX use.
//!
//! The header's `ibv_create_qp_ex` finds the exported calls' `create_qp_ex` among a shadow context's extended
//! operations ([`crate::shadow::ExtendedOps`]); the QP it makes is a shadow like any other, over
//! a real QP made with `ibv_create_qp`, so a rebuild makes it again the same way. Its
//! `ibv_qp_ex` (the shadow's first field, as the provider's is) carries this module's builders:
//! between `ibv_wr_start` and `ibv_wr_complete` they only note each work request in the QP's
//! [`session::Session`] (inline data copied, as the calls promise), and `ibv_wr_complete` posts the lot as
//! one chain through [`crate::fastpath::post_send`]. So the requests are translated, counted
//! and held at the gate exactly as `ibv_post_send`'s are, a session never straddles a
//! checkpoint, and what the device sees of it is one post, as from the provider's builders.
//!
//! Two differences from a provider's own builders: a request the layer cannot take (an unknown
//! key, a missing address handle) fails the whole session at `ibv_wr_complete`, before
//! anything is posted, as a provider's builder error does; a request the *device* refuses in
//! the middle of the chain leaves those before it posted, as `ibv_post_send` does. Operations
//! whose keys or objects the layer does not translate (memory windows, invalidation, TSO, XRC,
//! flush, atomic write) are refused at `ibv_create_qp_ex`, naming them.
// The builders are entries of an `ibv_qp_ex`, with the contract of the inline call of the same
// name in verbs.h (`ibv_wr_send` calls `wr_send`...); they are not restated per function.
#![allow(clippy::missing_safety_doc)]
use std::os::raw::{c_int, c_void};
use std::ptr::null_mut;

use ffi::ibv_wr_opcode as op;
use ibverbs_sys as ffi;

use crate::shadow::{lock, ShadowQp};

pub mod session;

use session::Noted;

/// The send operations a shadow QP offers through the extended calls: those
/// [`crate::fastpath`] translates.
pub const SUPPORTED_SEND_OPS: u64 = (ffi::IBV_QP_EX_WITH_RDMA_WRITE
    | ffi::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | ffi::IBV_QP_EX_WITH_SEND
    | ffi::IBV_QP_EX_WITH_SEND_WITH_IMM
    | ffi::IBV_QP_EX_WITH_RDMA_READ
    | ffi::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | ffi::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD) as u64;

/// The names of send operations, for a refusal.
const SEND_OP_NAMES: [(u32, &str); 13] = [
    (ffi::IBV_QP_EX_WITH_RDMA_WRITE, "RDMA_WRITE"),
    (
        ffi::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM,
        "RDMA_WRITE_WITH_IMM",
    ),
    (ffi::IBV_QP_EX_WITH_SEND, "SEND"),
    (ffi::IBV_QP_EX_WITH_SEND_WITH_IMM, "SEND_WITH_IMM"),
    (ffi::IBV_QP_EX_WITH_RDMA_READ, "RDMA_READ"),
    (ffi::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP, "ATOMIC_CMP_AND_SWP"),
    (
        ffi::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD,
        "ATOMIC_FETCH_AND_ADD",
    ),
    (ffi::IBV_QP_EX_WITH_LOCAL_INV, "LOCAL_INV"),
    (ffi::IBV_QP_EX_WITH_BIND_MW, "BIND_MW"),
    (ffi::IBV_QP_EX_WITH_SEND_WITH_INV, "SEND_WITH_INV"),
    (ffi::IBV_QP_EX_WITH_TSO, "TSO"),
    (ffi::IBV_QP_EX_WITH_FLUSH, "FLUSH"),
    (ffi::IBV_QP_EX_WITH_ATOMIC_WRITE, "ATOMIC_WRITE"),
];

/// The names of the send operations in `ops`, `|`-joined (unknown bits in hex).
pub fn send_op_names(ops: u64) -> String {
    let mut left = ops;
    let mut names: Vec<String> = Vec::new();
    for (bit, name) in SEND_OP_NAMES {
        if left & bit as u64 != 0 {
            names.push(name.to_string());
            left &= !(bit as u64);
        }
    }
    if left != 0 {
        names.push(format!("{left:#x}"));
    }
    names.join("|")
}

/// The shadow QP whose `ibv_qp_ex` is `qp`, with the program's id and flags for the next
/// request.
///
/// # Safety
/// `qp` is a shadow QP's `ex` (only those carry these builders).
unsafe fn shadow(qp: *mut ffi::ibv_qp_ex) -> (&'static ShadowQp, u64, u32) {
    // SAFETY: `ex` is a shadow QP's first field; the program writes `wr_id` and `wr_flags`
    // before each builder, on the thread that calls it.
    unsafe { (&*(qp as *const ShadowQp), (*qp).wr_id, (*qp).wr_flags) }
}

/// Notes a new request of `opcode` in `qp`'s session and lets `fill` complete it.
///
/// # Safety
/// As [`shadow`].
unsafe fn note(qp: *mut ffi::ibv_qp_ex, opcode: u32, fill: impl FnOnce(&mut ffi::ibv_send_wr)) {
    // SAFETY: as the caller promises.
    let (s, wr_id, flags) = unsafe { shadow(qp) };
    fill(lock(&s.session).begin(wr_id, flags, opcode));
}

/// Applies a setter to the last request of `qp`'s session.
///
/// # Safety
/// As [`shadow`].
unsafe fn set(qp: *mut ffi::ibv_qp_ex, f: impl FnOnce(&mut Noted)) {
    // SAFETY: as the caller promises.
    let (s, _, _) = unsafe { shadow(qp) };
    if let Some(n) = lock(&s.session).last() {
        f(n);
    }
}

unsafe extern "C" fn wr_start(qp: *mut ffi::ibv_qp_ex) {
    // SAFETY: a shadow's builders.
    unsafe { lock(&shadow(qp).0.session).clear() };
}

unsafe extern "C" fn wr_abort(qp: *mut ffi::ibv_qp_ex) {
    // SAFETY: a shadow's builders.
    unsafe { lock(&shadow(qp).0.session).clear() };
}

unsafe extern "C" fn wr_complete(qp: *mut ffi::ibv_qp_ex) -> c_int {
    // SAFETY: a shadow's builders; the chain lives in the session, locked until the post
    // returns (a builder of this QP from another thread meanwhile is the program's error).
    unsafe {
        let (s, _, _) = shadow(qp);
        let mut session = lock(&s.session);
        let error = session.error;
        if error != 0 {
            session.clear();
            return error;
        }
        let head = session.link();
        if head.is_null() {
            return 0;
        }
        let mut bad = null_mut();
        let rc = crate::fastpath::post_send(qp as *mut ffi::ibv_qp, head, &mut bad);
        session.clear();
        rc
    }
}

unsafe extern "C" fn wr_send(qp: *mut ffi::ibv_qp_ex) {
    // SAFETY: a shadow's builders.
    unsafe { note(qp, op::IBV_WR_SEND, |_| {}) };
}

unsafe extern "C" fn wr_send_imm(qp: *mut ffi::ibv_qp_ex, imm: u32) {
    // SAFETY: a shadow's builders; sends with data carry it in the first union.
    unsafe {
        note(qp, op::IBV_WR_SEND_WITH_IMM, |w| {
            w.__bindgen_anon_1.imm_data = imm
        })
    };
}

/// Sets an RDMA request's peer key and address.
fn rdma(w: &mut ffi::ibv_send_wr, rkey: u32, remote_addr: u64) {
    w.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
}

unsafe extern "C" fn wr_rdma_write(qp: *mut ffi::ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: a shadow's builders.
    unsafe { note(qp, op::IBV_WR_RDMA_WRITE, |w| rdma(w, rkey, addr)) };
}

unsafe extern "C" fn wr_rdma_write_imm(qp: *mut ffi::ibv_qp_ex, rkey: u32, addr: u64, imm: u32) {
    // SAFETY: a shadow's builders.
    unsafe {
        note(qp, op::IBV_WR_RDMA_WRITE_WITH_IMM, |w| {
            rdma(w, rkey, addr);
            w.__bindgen_anon_1.imm_data = imm;
        })
    };
}

unsafe extern "C" fn wr_rdma_read(qp: *mut ffi::ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: a shadow's builders.
    unsafe { note(qp, op::IBV_WR_RDMA_READ, |w| rdma(w, rkey, addr)) };
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut ffi::ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    compare_add: u64,
    swap: u64,
) {
    // SAFETY: a shadow's builders.
    unsafe {
        note(qp, op::IBV_WR_ATOMIC_CMP_AND_SWP, |w| {
            w.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                remote_addr,
                compare_add,
                swap,
                rkey,
            }
        })
    };
}

unsafe extern "C" fn wr_atomic_fetch_add(
    qp: *mut ffi::ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    add: u64,
) {
    // SAFETY: a shadow's builders.
    unsafe {
        note(qp, op::IBV_WR_ATOMIC_FETCH_AND_ADD, |w| {
            w.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                remote_addr,
                compare_add: add,
                swap: 0,
                rkey,
            }
        })
    };
}

unsafe extern "C" fn wr_set_sge(qp: *mut ffi::ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    // SAFETY: a shadow's builders.
    unsafe {
        set(qp, |n| {
            n.sges.clear();
            n.sges.push(ffi::ibv_sge { addr, length, lkey });
        })
    };
}

unsafe extern "C" fn wr_set_sge_list(
    qp: *mut ffi::ibv_qp_ex,
    num: usize,
    list: *const ffi::ibv_sge,
) {
    // SAFETY: a shadow's builders; the program's list has `num` entries.
    unsafe {
        set(qp, |n| {
            n.sges.clear();
            if num > 0 && !list.is_null() {
                n.sges
                    .extend_from_slice(std::slice::from_raw_parts(list, num));
            }
        })
    };
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut ffi::ibv_qp_ex, addr: *mut c_void, length: usize) {
    let buf = ffi::ibv_data_buf { addr, length };
    // SAFETY: a shadow's builders; one buffer.
    unsafe { wr_set_inline_data_list(qp, 1, &buf) };
}

unsafe extern "C" fn wr_set_inline_data_list(
    qp: *mut ffi::ibv_qp_ex,
    num: usize,
    list: *const ffi::ibv_data_buf,
) {
    // SAFETY: a shadow's builders; the program's buffers, copied now (the call's contract:
    // they may be reused once it returns).
    unsafe {
        set(qp, |n| {
            n.inline.clear();
            n.sges.clear();
            if !list.is_null() {
                for b in std::slice::from_raw_parts(list, num) {
                    if b.length > 0 {
                        n.inline.extend_from_slice(std::slice::from_raw_parts(
                            b.addr as *const u8,
                            b.length,
                        ));
                    }
                }
            }
            n.wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        })
    };
}

unsafe extern "C" fn wr_set_ud_addr(
    qp: *mut ffi::ibv_qp_ex,
    ah: *mut ffi::ibv_ah,
    remote_qpn: u32,
    remote_qkey: u32,
) {
    // SAFETY: a shadow's builders; the AH is the program's (a shadow, translated at the post).
    unsafe {
        set(qp, |n| {
            n.wr.wr.ud = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
                ah,
                remote_qpn,
                remote_qkey,
            }
        })
    };
}

/// Marks the session failed: an operation the QP was not made for (refused at creation).
///
/// # Safety
/// As [`shadow`].
unsafe fn not_offered(qp: *mut ffi::ibv_qp_ex) {
    // SAFETY: as the caller promises.
    let mut s = lock(unsafe { &shadow(qp).0.session });
    if s.error == 0 {
        s.error = libc::EOPNOTSUPP;
    }
}

unsafe extern "C" fn wr_with_u32(qp: *mut ffi::ibv_qp_ex, _: u32) {
    // SAFETY: a shadow's builders.
    unsafe { not_offered(qp) };
}

unsafe extern "C" fn wr_bind_mw(
    qp: *mut ffi::ibv_qp_ex,
    _: *mut ffi::ibv_mw,
    _: u32,
    _: *const ffi::ibv_mw_bind_info,
) {
    // SAFETY: a shadow's builders.
    unsafe { not_offered(qp) };
}

unsafe extern "C" fn wr_send_tso(qp: *mut ffi::ibv_qp_ex, _: *mut c_void, _: u16, _: u16) {
    // SAFETY: a shadow's builders.
    unsafe { not_offered(qp) };
}

unsafe extern "C" fn wr_atomic_write(qp: *mut ffi::ibv_qp_ex, _: u32, _: u64, _: *const c_void) {
    // SAFETY: a shadow's builders.
    unsafe { not_offered(qp) };
}

unsafe extern "C" fn wr_flush(qp: *mut ffi::ibv_qp_ex, _: u32, _: u64, _: usize, _: u8, _: u8) {
    // SAFETY: a shadow's builders.
    unsafe { not_offered(qp) };
}

/// Gives a shadow QP made for `send_ops` its builders.
pub fn offer(s: &mut ShadowQp, send_ops: u64) {
    s.send_ops = send_ops;
    let e = &mut s.ex;
    e.wr_start = Some(wr_start);
    e.wr_complete = Some(wr_complete);
    e.wr_abort = Some(wr_abort);
    e.wr_send = Some(wr_send);
    e.wr_send_imm = Some(wr_send_imm);
    e.wr_rdma_write = Some(wr_rdma_write);
    e.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    e.wr_rdma_read = Some(wr_rdma_read);
    e.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    e.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    e.wr_set_sge = Some(wr_set_sge);
    e.wr_set_sge_list = Some(wr_set_sge_list);
    e.wr_set_inline_data = Some(wr_set_inline_data);
    e.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    e.wr_set_ud_addr = Some(wr_set_ud_addr);
    e.wr_local_inv = Some(wr_with_u32);
    e.wr_send_inv = Some(wr_with_u32);
    e.wr_set_xrc_srqn = Some(wr_with_u32);
    e.wr_bind_mw = Some(wr_bind_mw);
    e.wr_send_tso = Some(wr_send_tso);
    e.wr_atomic_write = Some(wr_atomic_write);
    e.wr_flush = Some(wr_flush);
}

/// Why the layer cannot make a QP `ibv_create_qp_ex` asks for, if it cannot.
pub(crate) fn refusal(a: &ffi::ibv_qp_init_attr_ex) -> Option<String> {
    let known = ffi::IBV_QP_INIT_ATTR_PD | ffi::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    if a.comp_mask & ffi::IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
        return Some("ibv_create_qp_ex without a PD (XRC and RSS QPs are not supported)".into());
    }
    if a.comp_mask & !known != 0 {
        return Some(format!(
            "ibv_create_qp_ex with comp_mask {:#x} (only PD and SEND_OPS_FLAGS are supported)",
            a.comp_mask
        ));
    }
    let ops = if a.comp_mask & ffi::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
        a.send_ops_flags
    } else {
        0
    };
    if ops & !SUPPORTED_SEND_OPS != 0 {
        return Some(format!(
            "ibv_create_qp_ex with send operations {} (supported: {})",
            send_op_names(ops & !SUPPORTED_SEND_OPS),
            send_op_names(SUPPORTED_SEND_OPS)
        ));
    }
    None
}

#[cfg(test)]
mod tests;
