//! The extended post calls against a fake device: a session's requests reach the device as one
//! chain with every key, address handle and QP number translated, inline data as it was when
//! the program handed it over, and a failed builder posts nothing.
use std::cell::RefCell;
use std::sync::atomic::AtomicPtr;
use std::sync::atomic::Ordering::Relaxed;

use super::*;
use crate::shadow::{layer, zeroed, ShadowAh};
use crate::xlate::Addr;

/// What the fake device got of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Got {
    wr_id: u64,
    opcode: u32,
    flags: u32,
    lkeys: Vec<u32>,
    rkey: u32,
    inline: Vec<u8>,
    ud: Option<(usize, u32, u32)>,
}

thread_local! {
    static POSTS: RefCell<Vec<Vec<Got>>> = const { RefCell::new(Vec::new()) };
}

unsafe extern "C" fn fake_post_send(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    _bad: *mut *mut ffi::ibv_send_wr,
) -> c_int {
    let mut chain = Vec::new();
    let mut p = wr;
    // SAFETY: the layer's translated chain on the fake QP.
    unsafe {
        let ud = (*qp).qp_type == ffi::ibv_qp_type::IBV_QPT_UD;
        while !p.is_null() {
            let w = &*p;
            let sges = std::slice::from_raw_parts(w.sg_list, w.num_sge as usize);
            let inline = w.send_flags & ffi::ibv_send_flags::IBV_SEND_INLINE.0 != 0;
            chain.push(Got {
                wr_id: w.wr_id,
                opcode: w.opcode,
                flags: w.send_flags,
                lkeys: if inline {
                    vec![]
                } else {
                    sges.iter().map(|s| s.lkey).collect()
                },
                rkey: if ud { 0 } else { w.wr.rdma.rkey },
                inline: if inline {
                    sges.iter()
                        .flat_map(|s| {
                            std::slice::from_raw_parts(s.addr as *const u8, s.length as usize)
                        })
                        .copied()
                        .collect()
                } else {
                    vec![]
                },
                ud: ud.then_some((w.wr.ud.ah as usize, w.wr.ud.remote_qpn, w.wr.ud.remote_qkey)),
            });
            p = w.next;
        }
    }
    POSTS.with(|v| v.borrow_mut().push(chain));
    0
}

fn posts() -> Vec<Vec<Got>> {
    POSTS.with(|v| std::mem::take(&mut *v.borrow_mut()))
}

/// A shadow QP of `qp_type` over a fake real QP on a fake real context, offering every
/// supported send operation; the fake objects are leaked (a test's lifetime).
fn shadow_qp(qp_type: u32, real_qpn: u32) -> &'static mut ShadowQp {
    let real_ctx: &'static mut ffi::ibv_context = Box::leak(Box::new(zeroed()));
    real_ctx.ops.post_send = Some(fake_post_send);
    let real_qp: &'static mut ffi::ibv_qp = Box::leak(Box::new(zeroed()));
    real_qp.context = real_ctx;
    real_qp.qp_type = qp_type;
    let s = Box::leak(Box::new(ShadowQp::new(
        zeroed(),
        real_qp,
        real_qpn,
        zeroed(),
    )));
    s.ex.qp_base.qp_type = qp_type;
    offer(s, SUPPORTED_SEND_OPS);
    s
}

/// The program's side: what `ibv_wr_*` of verbs.h do with an `ibv_qp_ex`.
struct Program(*mut ffi::ibv_qp_ex);

impl Program {
    fn next(&self, wr_id: u64, flags: u32) {
        // SAFETY: the shadow's extended QP, alive for the test.
        unsafe {
            (*self.0).wr_id = wr_id;
            (*self.0).wr_flags = flags;
        }
    }
    fn ex(&self) -> &ffi::ibv_qp_ex {
        // SAFETY: as above.
        unsafe { &*self.0 }
    }
}

const SIGNALED: u32 = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;

#[test]
fn a_session_is_posted_at_complete_as_one_translated_chain_with_inline_data_copied() {
    let l = layer();
    let peer = Addr([0xe1; 16]).id();
    l.tables.set_mr(0x5500, 0x9500, 0x5501, 0x9501);
    l.tables.set_remote_rkey(peer, 0x4601, 0xa601);
    let s = shadow_qp(ffi::ibv_qp_type::IBV_QPT_RC, 0x5a);
    *s.peer.lock().unwrap() = Some((peer, 0x33));
    let qpx = &mut s.ex as *mut ffi::ibv_qp_ex;
    let p = Program(qpx);
    let e = p.ex();
    let mut data = *b"hello";
    let list = [
        ffi::ibv_sge {
            addr: 0x2000,
            length: 16,
            lkey: 0x5500,
        },
        ffi::ibv_sge {
            addr: 0x3000,
            length: 16,
            lkey: 0x7777,
        },
    ];
    let before = l.counters.send_wrs.load(Relaxed);
    // SAFETY: the builders of a shadow QP, as verbs.h's inline calls use them.
    let rc = unsafe {
        e.wr_start.unwrap()(qpx);
        p.next(1, SIGNALED);
        e.wr_rdma_write.unwrap()(qpx, 0x4601, 0x10);
        e.wr_set_sge.unwrap()(qpx, 0x5500, 0x1000, 8);
        p.next(2, 0);
        e.wr_send.unwrap()(qpx);
        e.wr_set_inline_data.unwrap()(qpx, data.as_mut_ptr().cast(), data.len());
        // The program may reuse its buffer once the call returned.
        data.copy_from_slice(b"XXXXX");
        p.next(3, 0);
        e.wr_send_imm.unwrap()(qpx, 7);
        e.wr_set_sge_list.unwrap()(qpx, 2, list.as_ptr());
        assert!(
            posts().is_empty(),
            "nothing reaches the device before complete"
        );
        e.wr_complete.unwrap()(qpx)
    };
    assert_eq!(rc, 0);
    let inline = ffi::ibv_send_flags::IBV_SEND_INLINE.0;
    assert_eq!(
        posts(),
        vec![vec![
            Got {
                wr_id: 1,
                opcode: op::IBV_WR_RDMA_WRITE,
                flags: SIGNALED,
                lkeys: vec![0x9500],
                rkey: 0xa601,
                inline: vec![],
                ud: None,
            },
            Got {
                wr_id: 2,
                opcode: op::IBV_WR_SEND,
                flags: inline,
                lkeys: vec![],
                rkey: 0,
                inline: b"hello".to_vec(),
                ud: None,
            },
            Got {
                wr_id: 3,
                opcode: op::IBV_WR_SEND_WITH_IMM,
                flags: 0,
                lkeys: vec![0x9500, 0x7777],
                rkey: 0,
                inline: vec![],
                ud: None,
            },
        ]],
        "one post, keys translated (an unknown one passed as it is)"
    );
    assert_eq!(
        s.signalled.load(Relaxed),
        1,
        "the signalled write is booked"
    );
    assert!(l.counters.send_wrs.load(Relaxed) >= before + 3);

    // An aborted session posts nothing; a setter before any request, or an operation the
    // layer does not offer, fails the session at complete, with nothing posted.
    // SAFETY: as above.
    unsafe {
        e.wr_start.unwrap()(qpx);
        e.wr_send.unwrap()(qpx);
        e.wr_abort.unwrap()(qpx);
        assert_eq!(e.wr_complete.unwrap()(qpx), 0);
        e.wr_start.unwrap()(qpx);
        e.wr_set_sge.unwrap()(qpx, 0x5500, 0x1000, 8);
        p.next(4, 0);
        e.wr_send.unwrap()(qpx);
        assert_eq!(e.wr_complete.unwrap()(qpx), libc::EINVAL);
        e.wr_start.unwrap()(qpx);
        e.wr_send.unwrap()(qpx);
        e.wr_bind_mw.unwrap()(qpx, null_mut(), 0, std::ptr::null());
        assert_eq!(e.wr_complete.unwrap()(qpx), libc::EOPNOTSUPP);
        // A session after a failed one starts clean.
        e.wr_start.unwrap()(qpx);
        p.next(5, 0);
        e.wr_send.unwrap()(qpx);
        assert_eq!(e.wr_complete.unwrap()(qpx), 0);
    }
    let sent: Vec<Vec<u64>> = posts()
        .iter()
        .map(|c| c.iter().map(|g| g.wr_id).collect())
        .collect();
    assert_eq!(
        sent,
        vec![vec![5]],
        "only the clean session reached the device"
    );
    l.tables.drop_mr(0x5500, 0x5501);
}

#[test]
fn a_ud_session_reaches_the_device_with_the_real_address_handle_and_the_peers_real_qp() {
    let l = layer();
    let peer = Addr([0xe2; 16]).id();
    l.tables.set_remote_qpn(peer, 0x63, 0x97);
    let s = shadow_qp(ffi::ibv_qp_type::IBV_QPT_UD, 0x5b);
    let real_ah: &'static mut ffi::ibv_ah = Box::leak(Box::new(zeroed()));
    let mut ah = ShadowAh {
        ah: zeroed(),
        real: AtomicPtr::new(real_ah),
        dest: peer,
        attr: zeroed(),
    };
    let qpx = &mut s.ex as *mut ffi::ibv_qp_ex;
    let p = Program(qpx);
    let e = p.ex();
    let mut data = [1u8, 2, 3];
    // SAFETY: the builders of a shadow QP; a shadow AH.
    let rc = unsafe {
        e.wr_start.unwrap()(qpx);
        p.next(11, SIGNALED);
        e.wr_send.unwrap()(qpx);
        e.wr_set_ud_addr.unwrap()(qpx, &mut ah.ah, 0x63, 0x1111_1111);
        e.wr_set_inline_data_list.unwrap()(
            qpx,
            2,
            [
                ffi::ibv_data_buf {
                    addr: data.as_mut_ptr().cast(),
                    length: 2,
                },
                ffi::ibv_data_buf {
                    addr: data[2..].as_mut_ptr().cast(),
                    length: 1,
                },
            ]
            .as_ptr(),
        );
        e.wr_complete.unwrap()(qpx)
    };
    assert_eq!(rc, 0);
    let got = posts();
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0][0].ud,
        Some((real_ah as *mut ffi::ibv_ah as usize, 0x97, 0x1111_1111))
    );
    assert_eq!(got[0][0].inline, vec![1, 2, 3], "the buffers, joined");
}

#[test]
fn send_operations_are_named_in_a_refusal() {
    assert_eq!(
        send_op_names((ffi::IBV_QP_EX_WITH_TSO | ffi::IBV_QP_EX_WITH_FLUSH) as u64 | 1 << 40),
        "TSO|FLUSH|0x10000000000"
    );
    let mut a: ffi::ibv_qp_init_attr_ex = zeroed();
    assert!(refusal(&a).unwrap().contains("without a PD"));
    let mut pd: ffi::ibv_pd = zeroed();
    a.pd = &mut pd;
    a.comp_mask = ffi::IBV_QP_INIT_ATTR_PD | ffi::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    a.send_ops_flags = SUPPORTED_SEND_OPS;
    assert_eq!(refusal(&a), None);
}
