//! The fast path against a fake device: translation of every kind of work request, and the
//! trampolines of the operation table end to end (a fake context's `post_send`, `post_recv`
//! and `poll_cq` record what reaches the "device").
use std::cell::RefCell;
use std::ptr::null_mut;
use std::sync::atomic::AtomicPtr;

use super::*;
use crate::shadow::{zeroed, ShadowAh, ShadowCq, ShadowQp};
use crate::xlate::{Addr, Tables};

fn sge(addr: u64, lkey: u32) -> ffi::ibv_sge {
    ffi::ibv_sge {
        addr,
        length: 64,
        lkey,
    }
}

fn send(wr_id: u64, opcode: u32, sges: &mut [ffi::ibv_sge]) -> ffi::ibv_send_wr {
    let mut w: ffi::ibv_send_wr = zeroed();
    w.wr_id = wr_id;
    w.opcode = opcode;
    w.sg_list = sges.as_mut_ptr();
    w.num_sge = sges.len() as i32;
    w.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    w
}

/// Links a slice of requests into a chain, in order.
fn chain(wrs: &mut [ffi::ibv_send_wr]) -> *mut ffi::ibv_send_wr {
    let n = wrs.len();
    let base = wrs.as_mut_ptr();
    for i in 0..n {
        // SAFETY: indexes within the slice.
        unsafe {
            (*base.add(i)).next = if i + 1 < n {
                base.add(i + 1)
            } else {
                null_mut()
            }
        };
    }
    base
}

fn peer() -> u64 {
    Addr([0xfe; 16]).id()
}

fn tables() -> Tables {
    let t = Tables::default();
    // Two regions, rebuilt: new real keys behind the virtual ones.
    t.set_mr(0x1100, 0x9100, 0x1101, 0x9101);
    t.set_mr(0x2200, 0x9200, 0x2201, 0x9201);
    // The peer rebuilt too: its QP 0x33 is now 0x77, its rkey 0x4401 is now 0xa401.
    t.set_remote_qpn(peer(), 0x33, 0x77);
    t.set_remote_rkey(peer(), 0x4401, 0xa401);
    t
}

#[test]
fn every_send_kind_is_translated_into_a_copy_and_the_programs_requests_stay_untouched() {
    let t = tables();
    let mut s0 = [sge(0x1000, 0x1100), sge(0x2000, 0x2200)];
    let mut s1 = [sge(0x3000, 0x1100)];
    let mut s2 = [sge(0x4000, 0x2200)];
    let mut s3 = [sge(0x5000, 0x1100)];
    let mut s4 = [sge(0x6000, 0x2200)];
    let mut s5 = [sge(0x7000, 0x1100)];
    let mut s6 = [sge(0x8000, 0x5555)];
    let mut wrs = [
        send(1, op::IBV_WR_SEND, &mut s0),
        send(2, op::IBV_WR_SEND_WITH_IMM, &mut s1),
        send(3, op::IBV_WR_RDMA_WRITE, &mut s2),
        send(4, op::IBV_WR_RDMA_WRITE_WITH_IMM, &mut s3),
        send(5, op::IBV_WR_RDMA_READ, &mut s4),
        send(6, op::IBV_WR_ATOMIC_FETCH_AND_ADD, &mut s5),
        send(7, op::IBV_WR_ATOMIC_CMP_AND_SWP, &mut []),
        send(8, op::IBV_WR_SEND, &mut s6),
    ];
    wrs[7].send_flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
    for w in &mut wrs[2..5] {
        w.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: 0xabc000,
            rkey: 0x4401,
        };
    }
    for w in &mut wrs[5..7] {
        w.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
            remote_addr: 0xabc008,
            compare_add: 1,
            swap: 2,
            rkey: 0x4401,
        };
    }
    let head = chain(&mut wrs);
    let mut sc = Scratch::default();
    let target = SendTarget {
        peer: &mut || Some(peer()),
        ud: false,
    };
    // SAFETY: a valid chain built above.
    unsafe { translate_sends(&t, target, head, &mut sc) }.unwrap();

    assert_eq!(sc.sends.len(), 8);
    let out: Vec<_> = sc.sends.iter().collect();
    for (i, w) in out.iter().enumerate() {
        assert_eq!(w.wr_id, i as u64 + 1);
        let next = if i + 1 < 8 {
            &sc.sends[i + 1] as *const _ as *mut _
        } else {
            null_mut()
        };
        assert_eq!(w.next, next, "the copies are linked in order");
    }
    let keys = |w: &ffi::ibv_send_wr| -> Vec<u32> {
        (0..w.num_sge as usize)
            // SAFETY: the copies' lists point into the scratch area.
            .map(|j| unsafe { (*w.sg_list.add(j)).lkey })
            .collect()
    };
    assert_eq!(keys(out[0]), [0x9100, 0x9200]);
    assert_eq!(keys(out[1]), [0x9100]);
    assert_eq!(
        keys(out[7]),
        [0x5555],
        "an inline send's key is not used, not translated"
    );
    assert!(out[6].sg_list.is_null() && out[6].num_sge == 0);
    // SAFETY: the union members of each opcode.
    unsafe {
        for w in &out[2..5] {
            assert_eq!(w.wr.rdma.rkey, 0xa401);
            assert_eq!(w.wr.rdma.remote_addr, 0xabc000);
        }
        for w in &out[5..7] {
            assert_eq!(w.wr.atomic.rkey, 0xa401);
            assert_eq!((w.wr.atomic.compare_add, w.wr.atomic.swap), (1, 2));
        }
        // The program's own requests are as they were.
        assert_eq!(s0[0].lkey, 0x1100);
        assert_eq!(wrs[2].wr.rdma.rkey, 0x4401);
        assert_eq!(wrs[0].sg_list, s0.as_mut_ptr());
    }
}

#[test]
fn a_ud_send_gets_the_real_address_handle_and_the_peers_real_qp_number() {
    let t = tables();
    let real_ah = 0x5eed_0000usize as *mut ffi::ibv_ah;
    let ah = ShadowAh {
        ah: zeroed(),
        real: AtomicPtr::new(real_ah),
        dest: peer(),
        attr: zeroed(),
    };
    let mut s = [sge(0x1000, 0x2200)];
    let mut w = send(9, op::IBV_WR_SEND, &mut s);
    w.wr.ud = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
        ah: &ah as *const ShadowAh as *mut ffi::ibv_ah,
        remote_qpn: 0x33,
        remote_qkey: 0x1ee7a330,
    };
    let mut sc = Scratch::default();
    let target = SendTarget {
        peer: &mut || None,
        ud: true,
    };
    // SAFETY: one valid request with a shadow AH.
    unsafe { translate_sends(&t, target, &w, &mut sc) }.unwrap();
    // SAFETY: UD requests use the `ud` member.
    unsafe {
        assert_eq!(sc.sends[0].wr.ud.ah, real_ah);
        assert_eq!(sc.sends[0].wr.ud.remote_qpn, 0x77);
        assert_eq!(sc.sends[0].wr.ud.remote_qkey, 0x1ee7a330);
        assert_eq!((*sc.sends[0].sg_list).lkey, 0x9200);
    }
}

#[test]
fn unsupported_or_unaddressed_requests_are_refused_naming_their_place_in_the_chain() {
    let t = tables();
    let mut wrs = [
        send(1, op::IBV_WR_SEND, &mut []),
        send(2, op::IBV_WR_LOCAL_INV, &mut []),
    ];
    let head = chain(&mut wrs);
    let mut sc = Scratch::default();
    let rc = SendTarget {
        peer: &mut || Some(peer()),
        ud: false,
    };
    // SAFETY: a valid chain.
    let r = unsafe { translate_sends(&t, rc, head, &mut sc) }.unwrap_err();
    assert_eq!(
        r,
        Refused {
            index: 1,
            errno: libc::EOPNOTSUPP
        }
    );
    // An RDMA write on a QP that was never connected has no peer to take the rkey from.
    let mut w = send(3, op::IBV_WR_RDMA_WRITE, &mut []);
    w.next = null_mut();
    let unconnected = SendTarget {
        peer: &mut || None,
        ud: false,
    };
    // SAFETY: one valid request.
    let r = unsafe { translate_sends(&t, unconnected, &w, &mut sc) }.unwrap_err();
    assert_eq!(r.errno, libc::EINVAL);
}

#[test]
fn receives_have_their_keys_translated() {
    let t = tables();
    let mut s = [sge(0x1000, 0x1100), sge(0x2000, 0x2200)];
    let mut r: ffi::ibv_recv_wr = zeroed();
    r.wr_id = 42;
    r.sg_list = s.as_mut_ptr();
    r.num_sge = 2;
    let mut sc = Scratch::default();
    // SAFETY: one valid request.
    unsafe { translate_recvs(&t, &r, &mut sc) }.unwrap();
    assert_eq!(sc.recvs[0].wr_id, 42);
    assert!(sc.recvs[0].next.is_null());
    // SAFETY: the copy's list is in the scratch area.
    unsafe {
        assert_eq!((*sc.recvs[0].sg_list).lkey, 0x9100);
        assert_eq!((*sc.recvs[0].sg_list.add(1)).lkey, 0x9200);
    }
    assert_eq!(s[0].lkey, 0x1100);
}

// ---- The trampolines against a fake device ----

thread_local! {
    /// What the fake device's post calls received: (wr_id, lkeys, rkey).
    static POSTED: RefCell<Vec<(u64, Vec<u32>, u32)>> = const { RefCell::new(Vec::new()) };
}

/// wr_id the fake device refuses.
const REFUSED_WR: u64 = 0xbad;
/// The fake device's QP number for QP 0x71 (virtual).
const REAL_QPN: u32 = 0x1c;
const VIRTUAL_QPN: u32 = 0x71;

unsafe extern "C" fn fake_post_send(
    _qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> c_int {
    let mut p = wr;
    while !p.is_null() {
        // SAFETY: the layer's translated chain.
        let w = unsafe { &*p };
        if w.wr_id == REFUSED_WR {
            // SAFETY: the provider reports the first request it refused.
            unsafe { *bad = p };
            return libc::ENOMEM;
        }
        // SAFETY: as above.
        let keys = (0..w.num_sge as usize)
            .map(|j| unsafe { (*w.sg_list.add(j)).lkey })
            .collect();
        // SAFETY: RDMA requests use the `rdma` member.
        let rkey = unsafe { w.wr.rdma.rkey };
        POSTED.with(|v| v.borrow_mut().push((w.wr_id, keys, rkey)));
        p = w.next;
    }
    0
}

unsafe extern "C" fn fake_post_recv(
    _qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_recv_wr,
    _bad: *mut *mut ffi::ibv_recv_wr,
) -> c_int {
    // SAFETY: the layer's translated chain.
    let w = unsafe { &*wr };
    // SAFETY: as above.
    let keys = (0..w.num_sge as usize)
        .map(|j| unsafe { (*w.sg_list.add(j)).lkey })
        .collect();
    POSTED.with(|v| v.borrow_mut().push((w.wr_id, keys, 0)));
    0
}

unsafe extern "C" fn fake_poll_cq(_cq: *mut ffi::ibv_cq, n: c_int, wc: *mut ffi::ibv_wc) -> c_int {
    let k = n.min(2);
    for i in 0..k as usize {
        let mut c: ffi::ibv_wc = zeroed();
        c.qp_num = REAL_QPN;
        // SAFETY: room for `n` completions.
        unsafe { *wc.add(i) = c };
    }
    k
}

#[test]
fn the_operation_table_posts_translated_requests_maps_a_refusal_back_and_translates_completions() {
    let l = layer();
    l.tables.set_mr(0x3300, 0x9300, 0x3301, 0x9301);

    let mut real_ctx: ffi::ibv_context = zeroed();
    real_ctx.ops.post_send = Some(fake_post_send);
    real_ctx.ops.post_recv = Some(fake_post_recv);
    real_ctx.ops.poll_cq = Some(fake_poll_cq);
    let mut real_qp: ffi::ibv_qp = zeroed();
    real_qp.context = &mut real_ctx;
    let mut real_cq: ffi::ibv_cq = zeroed();
    real_cq.context = &mut real_ctx;

    let mut shadow_ctx: ffi::ibv_context = zeroed();
    shadow_ctx.ops.post_send = Some(post_send);
    shadow_ctx.ops.post_recv = Some(post_recv);
    shadow_ctx.ops.poll_cq = Some(poll_cq);
    let mut qp = ShadowQp::new(zeroed(), &mut real_qp, REAL_QPN, zeroed());
    *qp.peer.lock().unwrap() = Some((peer(), 0x33));
    l.tables
        .set_qp(REAL_QPN, VIRTUAL_QPN, &qp as *const ShadowQp as usize);
    qp.ex.qp_base.context = &mut shadow_ctx;
    qp.ex.qp_base.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
    qp.ex.qp_base.qp_num = VIRTUAL_QPN;
    let mut cq = ShadowCq::new(zeroed(), &mut real_cq, 16, 0);
    cq.cq.context = &mut shadow_ctx;
    let qpp = &mut qp.ex.qp_base as *mut ffi::ibv_qp;
    let cqp = &mut cq.cq as *mut ffi::ibv_cq;

    // What a program does: the header's inline calls go through its context's table.
    let mut s = [sge(0x1000, 0x3300)];
    let mut s2 = [sge(0x2000, 0x3300)];
    let mut wrs = [
        send(1, op::IBV_WR_SEND, &mut s),
        send(REFUSED_WR, op::IBV_WR_RDMA_WRITE, &mut s2),
        send(3, op::IBV_WR_SEND, &mut []),
    ];
    wrs[1].wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
        remote_addr: 0,
        rkey: 0x1234,
    };
    let head = chain(&mut wrs);
    let mut bad: *mut ffi::ibv_send_wr = null_mut();
    // SAFETY: a shadow QP on a context whose table is the layer's; a valid chain.
    let rc = unsafe {
        let f = (*(*qpp).context).ops.post_send.unwrap();
        f(qpp, head, &mut bad)
    };
    assert_eq!(rc, libc::ENOMEM, "the device's answer reaches the program");
    assert_eq!(
        bad, &mut wrs[1] as *mut _,
        "bad_wr is the program's own request"
    );
    let posted = POSTED.with(|v| std::mem::take(&mut *v.borrow_mut()));
    assert_eq!(posted, [(1, vec![0x9300], 0)]);

    let mut r: ffi::ibv_recv_wr = zeroed();
    r.wr_id = 77;
    r.sg_list = s.as_mut_ptr();
    r.num_sge = 1;
    let mut rbad = null_mut();
    // SAFETY: as above.
    let rc = unsafe {
        let f = (*(*qpp).context).ops.post_recv.unwrap();
        f(qpp, &mut r, &mut rbad)
    };
    assert_eq!(rc, 0);
    let posted = POSTED.with(|v| std::mem::take(&mut *v.borrow_mut()));
    assert_eq!(posted, [(77, vec![0x9300], 0)]);

    let mut wcs: [ffi::ibv_wc; 4] = zeroed();
    // SAFETY: a shadow CQ; room for 4 completions.
    let got = unsafe {
        let f = (*(*cqp).context).ops.poll_cq.unwrap();
        f(cqp, 4, wcs.as_mut_ptr())
    };
    assert_eq!(got, 2);
    assert!(wcs[..2].iter().all(|w| w.qp_num == VIRTUAL_QPN));
    l.tables.drop_mr(0x3300, 0x3301);
    l.tables.drop_qp(REAL_QPN);
}

/// A completion as a device writes it (the crate's struct keeps these fields private; its C
/// layout starts with `wr_id`, `status`, `opcode`).
fn wc(wr_id: u64, status: u32, opcode: u32, qp_num: u32) -> ffi::ibv_wc {
    let mut c: ffi::ibv_wc = zeroed();
    let p = &mut c as *mut ffi::ibv_wc as *mut u8;
    // SAFETY: offsets 0, 8 and 12 of `struct ibv_wc` (verbs.h), inside `c`.
    unsafe {
        std::ptr::write_unaligned(p as *mut u64, wr_id);
        std::ptr::write_unaligned(p.add(8) as *mut u32, status);
        std::ptr::write_unaligned(p.add(12) as *mut u32, opcode);
    }
    c.qp_num = qp_num;
    c
}

fn receive(wr_id: u64) -> crate::shadow::Receive {
    crate::shadow::Receive {
        wr_id,
        sges: smallvec::smallvec![sge(0x1000, 0x1100)],
    }
}

#[test]
fn completions_settle_the_qps_books_and_the_layers_markers_never_reach_the_program() {
    use std::sync::atomic::Ordering::Relaxed;
    let t = Tables::default();
    let (send_cq, recv_cq) = (0x1000usize, 0x2000usize);
    let mut qp = ShadowQp::new(zeroed(), null_mut(), 0x3c, zeroed());
    qp.ex.qp_base.send_cq = send_cq as *mut ffi::ibv_cq;
    qp.ex.qp_base.recv_cq = recv_cq as *mut ffi::ibv_cq;
    qp.signalled.store(2, Relaxed);
    qp.markers.store(1, Relaxed);
    qp.receives
        .lock()
        .unwrap()
        .extend([receive(5), receive(6), receive(7)]);
    t.set_qp(0x3c, 0x71, &qp as *const ShadowQp as usize);

    let ok = ffi::ibv_wc_status::IBV_WC_SUCCESS;
    let flushed = ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
    let mut sends = [
        wc(1, ok, ffi::ibv_wc_opcode::IBV_WC_SEND, 0x3c),
        wc(MARKER_WR, ok, ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE, 0x3c),
        wc(2, ok, ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE, 0x3c),
    ];
    assert_eq!(settle_completions(&t, send_cq, &mut sends), 2);
    assert_eq!(
        (sends[0].wr_id(), sends[1].wr_id()),
        (1, 2),
        "in order, marker out"
    );
    assert!(sends[..2].iter().all(|w| w.qp_num == 0x71), "virtual QPN");
    assert_eq!(qp.signalled.load(Relaxed), 0);
    assert_eq!(qp.markers.load(Relaxed), 0);

    // A receive consumes the oldest booked one; a flushed one (no opcode) on the receive CQ too.
    let mut recvs = [
        wc(5, ok, ffi::ibv_wc_opcode::IBV_WC_RECV, 0x3c),
        wc(6, flushed, 0, 0x3c),
    ];
    assert_eq!(settle_completions(&t, recv_cq, &mut recvs), 2);
    let left: Vec<u64> = qp
        .receives
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.wr_id)
        .collect();
    assert_eq!(left, [7], "what a rebuild posts again");
    t.drop_qp(0x3c);
}

#[test]
fn completions_held_at_a_quiesce_come_first_in_order_and_once() {
    let mut real_ctx: ffi::ibv_context = zeroed();
    real_ctx.ops.poll_cq = Some(fake_poll_cq);
    let mut real_cq: ffi::ibv_cq = zeroed();
    real_cq.context = &mut real_ctx;
    let mut cq = ShadowCq::new(zeroed(), &mut real_cq, 16, 0);
    let ok = ffi::ibv_wc_status::IBV_WC_SUCCESS;
    cq.held
        .lock()
        .unwrap()
        .extend((100..103).map(|id| wc(id, ok, ffi::ibv_wc_opcode::IBV_WC_SEND, VIRTUAL_QPN)));
    cq.has_held
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let cqp = &mut cq.cq as *mut ffi::ibv_cq;
    let mut out: [ffi::ibv_wc; 4] = zeroed();
    // SAFETY: a shadow CQ over a fake device; room for 4.
    let got = unsafe { poll_cq(cqp, 4, out.as_mut_ptr()) };
    assert_eq!(got, 4);
    let ids: Vec<u64> = out.iter().map(|w| w.wr_id()).collect();
    assert_eq!(
        ids,
        [100, 101, 102, 0],
        "held first, in order, then the device's"
    );
    // SAFETY: as above.
    let got = unsafe { poll_cq(cqp, 4, out.as_mut_ptr()) };
    assert_eq!(
        got, 2,
        "only the device's now: nothing held is handed out twice"
    );
    assert!(out[..2].iter().all(|w| w.wr_id() == 0));
}

#[test]
fn a_ud_receive_names_its_sender_by_the_virtual_qp_number_after_the_sender_moved() {
    let t = Tables::default();
    let recv_cq = 0x2000usize;
    let mut qp = ShadowQp::new(zeroed(), null_mut(), 0x3d, zeroed());
    qp.ex.qp_base.qp_type = ffi::ibv_qp_type::IBV_QPT_UD;
    qp.ex.qp_base.recv_cq = recv_cq as *mut ffi::ibv_cq;
    t.set_qp(0x3d, 0x72, &qp as *const ShadowQp as usize);
    // Two senders, both rebuilt: one known by an IPv4-mapped GID that moved to 10.0.0.9 (RoCE
    // v2 over IPv4), one by an IPv6 GID that stayed. Their QP 0x12 is real 0x51 and 0x52 now.
    let v4 = Addr([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1]);
    let v6 = Addr([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
    let mut now = [0u8; 16];
    now[10..].copy_from_slice(&[0xff, 0xff, 10, 0, 0, 9]);
    t.set_peer(v4.id(), crate::xlate::PeerPort { gid: now, lid: 0 });
    t.set_remote_qpn(v4.id(), 0x12, 0x51);
    t.set_remote_qpn(v6.id(), 0x12, 0x52);

    // Their messages as the device leaves them: the GRH area first, then the payload.
    let mut from_v4 = [0u8; 64];
    from_v4[20] = 0x45;
    from_v4[32..36].copy_from_slice(&[10, 0, 0, 9]);
    let mut from_v6 = [0u8; 64];
    from_v6[0] = 0x60;
    from_v6[8..24].copy_from_slice(&v6.0);
    let from_new = from_v6;
    let at = |b: &[u8; 64]| crate::shadow::Receive {
        wr_id: 0,
        sges: smallvec::smallvec![sge(b.as_ptr() as u64, 0x1100)],
    };
    let ok = ffi::ibv_wc_status::IBV_WC_SUCCESS;
    let mut wcs: Vec<ffi::ibv_wc> = (1..=4)
        .map(|id| {
            let mut c = wc(id, ok, ffi::ibv_wc_opcode::IBV_WC_RECV, 0x3d);
            c.wc_flags = ffi::ibv_wc_flags::IBV_WC_GRH;
            c
        })
        .collect();
    wcs[0].src_qp = 0x51;
    wcs[1].src_qp = 0x52;
    // A QP the IPv6 sender made after its rebuild: its number is its own.
    wcs[2].src_qp = 0x60;
    // Without a GRH the area is not read: an unknown LID, the number as it came.
    wcs[3].src_qp = 0x51;
    wcs[3].wc_flags = ffi::ibv_wc_flags(0);
    qp.receives.lock().unwrap().extend(
        [&from_v4, &from_v6, &from_new, &from_v4]
            .into_iter()
            .enumerate()
            .map(|(i, b)| crate::shadow::Receive {
                wr_id: i as u64 + 1,
                ..at(b)
            }),
    );
    assert_eq!(settle_completions(&t, recv_cq, &mut wcs), 4);
    let src: Vec<u32> = wcs.iter().map(|w| w.src_qp).collect();
    assert_eq!(src, [0x12, 0x12, 0x60, 0x51]);
    assert!(
        wcs.iter().all(|w| w.qp_num == 0x72),
        "our own QP's virtual number"
    );
    assert!(qp.receives.lock().unwrap().is_empty());
    t.drop_qp(0x3d);
}

#[test]
fn a_grh_names_its_sender_for_roce_v2_over_ipv4_and_for_an_ipv6_layout() {
    let mut g = [0u8; 40];
    assert_eq!(grh_source_gid(&g), None, "no header at all");
    g[20] = 0x45;
    g[32..36].copy_from_slice(&[192, 168, 98, 2]);
    let mut want = [0u8; 16];
    want[10..].copy_from_slice(&[0xff, 0xff, 192, 168, 98, 2]);
    assert_eq!(grh_source_gid(&g), Some(want));
    let mut g = [0u8; 40];
    g[0] = 0x60;
    g[8..24].copy_from_slice(&[7; 16]);
    assert_eq!(grh_source_gid(&g), Some([7; 16]));
}
