//! The replay of a QP's recorded state changes after a rebuild, and what the layer tells the
//! agent it holds (`check`, multicast groups in use).
use std::ptr::null_mut;

use ibverbs_sys as ffi;

use super::rebuild::to_replay;
use crate::shadow::{zeroed, ShadowQp, Transition};

fn change(state: u32, mask: u32) -> Transition {
    let mut attr: ffi::ibv_qp_attr = zeroed();
    attr.qp_state = state;
    Transition {
        attr,
        mask: mask as i32,
    }
}

#[test]
fn a_qp_is_replayed_up_to_its_peer_then_on_from_there_and_an_errored_one_goes_to_error() {
    use ffi::ibv_qp_attr_mask as m;
    use ffi::ibv_qp_state as s;
    let mut qp = ShadowQp::new(zeroed(), null_mut(), 9, zeroed());
    let init = change(s::IBV_QPS_INIT, m::IBV_QP_STATE.0 | m::IBV_QP_PORT.0);
    let rtr = change(
        s::IBV_QPS_RTR,
        m::IBV_QP_STATE.0 | m::IBV_QP_AV.0 | m::IBV_QP_DEST_QPN.0,
    );
    let rts = change(s::IBV_QPS_RTS, m::IBV_QP_STATE.0 | m::IBV_QP_SQ_PSN.0);
    qp.transitions.lock().unwrap().extend([init, rtr, rts]);
    qp.ex.qp_base.state = s::IBV_QPS_RTS;
    let states = |ts: Vec<Transition>| ts.iter().map(|t| t.attr.qp_state).collect::<Vec<_>>();
    assert_eq!(
        states(to_replay(&qp, false)),
        [s::IBV_QPS_INIT],
        "before the peer is known"
    );
    assert_eq!(
        states(to_replay(&qp, true)),
        [s::IBV_QPS_RTR, s::IBV_QPS_RTS],
        "with the peer's new numbers"
    );
    // A UD QP needs no peer: everything at once.
    let mut ud = ShadowQp::new(zeroed(), null_mut(), 10, zeroed());
    let ud_rtr = change(s::IBV_QPS_RTR, m::IBV_QP_STATE.0);
    ud.transitions.lock().unwrap().extend([init, ud_rtr, rts]);
    ud.ex.qp_base.state = s::IBV_QPS_RTS;
    assert_eq!(to_replay(&ud, false).len(), 3);
    assert!(to_replay(&ud, true).is_empty());
    // A QP the program moved to the error state goes straight there, and no further.
    qp.ex.qp_base.state = s::IBV_QPS_ERR;
    let e = to_replay(&qp, false);
    assert_eq!(states(e.clone()), [s::IBV_QPS_ERR]);
    assert_eq!(e[0].mask as u32, m::IBV_QP_STATE.0);
    assert!(to_replay(&qp, true).is_empty());
}

/// A multicast group is in use from its attach to its detach (or its QP's destroy), named
/// with the call; other groups and QPs are kept apart.
#[test]
fn a_multicast_group_is_in_use_while_attached() {
    use crate::shadow::{Attachment, Layer};
    let l = Layer::default();
    assert!(l.unsupported_in_use().is_empty());
    let mut gid = [0u8; 16];
    gid[0] = 0xff;
    gid[1] = 0x0e;
    gid[15] = 1;
    let a = Attachment {
        qp: 0x1000,
        qpn: 0x12,
        gid,
        lid: 0,
    };
    l.attach_multicast(a);
    l.attach_multicast(a);
    let b = Attachment { qp: 0x2000, ..a };
    l.attach_multicast(b);
    let used = l.unsupported_in_use();
    assert_eq!(used.len(), 1, "{used:?}");
    assert!(
        used[0].starts_with(
            "multicast (ibv_attach_mcast): 2 group(s) attached, the first ff0e::1 on QP 0x12"
        ),
        "{used:?}"
    );
    l.detach_multicast(a.qp, gid, 1);
    assert_eq!(
        l.multicast.lock().unwrap().len(),
        2,
        "another LID is another group"
    );
    l.detach_multicast(a.qp, gid, 0);
    assert_eq!(*l.multicast.lock().unwrap(), vec![b]);
    l.forget_multicast(b.qp);
    assert!(l.unsupported_in_use().is_empty());
}

/// `check` names the command descriptors of the live contexts (not of released ones) and the
/// features in use; a quiesce with a group attached is refused before anything is drained.
#[test]
fn check_reports_the_contexts_descriptors_and_quiesce_refuses_a_group_in_use() {
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::Duration;

    use ib_quiesce::control::Controlled;

    use crate::events::Proxy;
    use crate::shadow::{boxed, free, layer, Attachment, ShadowCtx};

    let l = layer();
    let ctx = |fd| {
        let c = boxed(ShadowCtx::new(
            zeroed(),
            null_mut(),
            "none".into(),
            Proxy::new().expect("eventfd"),
            crate::exports::create_qp_ex,
        ));
        // SAFETY: just made.
        unsafe { (*c).cmd_fd.store(fd, Relaxed) };
        l.add_context(c);
        c
    };
    let (live, released) = (ctx(917), ctx(-1));
    let held = super::Control.check();
    let fds = held.fds.expect("the layer knows its descriptors");
    assert!(fds.contains(&917), "{fds:?}");
    assert!(!fds.contains(&-1), "{fds:?}");

    let a = Attachment {
        qp: 0x3000,
        qpn: 0x33,
        gid: [0xff; 16],
        lid: 7,
    };
    l.attach_multicast(a);
    let held = super::Control.check();
    l.forget_multicast(a.qp);
    assert!(
        held.unsupported
            .iter()
            .any(|u| u.starts_with("multicast (ibv_attach_mcast)") && u.contains("QP 0x33")),
        "{held:?}"
    );
    l.attach_multicast(a);
    let q = super::Control.quiesce(Duration::from_millis(100));
    l.forget_multicast(a.qp);
    let e = q.expect_err("refused");
    assert!(e.contains("multicast (ibv_attach_mcast)"), "{e}");
    assert_eq!(super::stage(), super::Stage::Up, "nothing was drained");
    assert!(!crate::gate::gate().is_closed());

    for c in [live, released] {
        l.remove_context(c);
        // SAFETY: made by `boxed` above, no longer registered.
        unsafe { free(c) };
    }
}
