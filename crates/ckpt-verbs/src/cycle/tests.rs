//! The replay of a QP's recorded state changes after a rebuild.
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
    qp.qp.state = s::IBV_QPS_RTS;
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
    ud.qp.state = s::IBV_QPS_RTS;
    assert_eq!(to_replay(&ud, false).len(), 3);
    assert!(to_replay(&ud, true).is_empty());
    // A QP the program moved to the error state goes straight there, and no further.
    qp.qp.state = s::IBV_QPS_ERR;
    let e = to_replay(&qp, false);
    assert_eq!(states(e.clone()), [s::IBV_QPS_ERR]);
    assert_eq!(e[0].mask as u32, m::IBV_QP_STATE.0);
    assert!(to_replay(&qp, true).is_empty());
}
