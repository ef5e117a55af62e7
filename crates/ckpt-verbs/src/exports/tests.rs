//! The refusals, on shadow objects that have no device behind them: a refused call never
//! reaches libibverbs, answers EOPNOTSUPP and is named in the status.
use std::ptr::null_mut;
use std::sync::atomic::AtomicPtr;

use ibverbs_sys as ffi;

use super::device::{ibv_reg_dmabuf_mr, ibv_rereg_mr};
use super::queues::{ibv_create_qp, ibv_qp_to_qp_ex};
use crate::events::Proxy;
use crate::shadow::{boxed, free, layer, zeroed, ShadowCtx, ShadowPd, ShadowQp};
use crate::status::report;

fn errno() -> i32 {
    // SAFETY: this thread's errno.
    unsafe { *libc::__errno_location() }
}

fn refused(call: &str) -> bool {
    report()["refused"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r.as_str().unwrap().starts_with(call))
}

#[test]
fn unsupported_qp_types_extended_qps_and_foreign_memory_are_refused_and_named() {
    let l = layer();
    // A shadow context and PD with nothing real behind them: a call that reached libibverbs
    // would crash on the null pointers.
    let ctx = boxed(ShadowCtx::new(
        zeroed(),
        null_mut(),
        "none".into(),
        Proxy::new().expect("eventfd"),
    ));
    l.add_context(ctx);
    // SAFETY: `ctx` was just made.
    let ctx_ptr = unsafe { &mut (*ctx).ctx as *mut ffi::ibv_context };
    let mut pd = ShadowPd {
        pd: zeroed(),
        real: AtomicPtr::new(null_mut()),
    };
    pd.pd.context = ctx_ptr;

    let mut attr: ffi::ibv_qp_init_attr = zeroed();
    attr.qp_type = ffi::ibv_qp_type::IBV_QPT_UC;
    // SAFETY: a shadow PD and valid attributes.
    let qp = unsafe { ibv_create_qp(&mut pd.pd, &mut attr) };
    assert!(qp.is_null());
    assert_eq!(errno(), libc::EOPNOTSUPP);
    assert!(refused("ibv_create_qp of type 3"), "{}", report());

    let mut shadow_qp = ShadowQp::new(zeroed(), null_mut(), 0, zeroed());
    shadow_qp.qp.context = ctx_ptr;
    // SAFETY: a shadow QP.
    assert!(unsafe { ibv_qp_to_qp_ex(&mut shadow_qp.qp) }.is_null());
    assert_eq!(errno(), libc::EOPNOTSUPP);
    assert!(refused("ibv_qp_to_qp_ex"));

    // SAFETY: refused before any argument is used.
    assert!(unsafe { ibv_reg_dmabuf_mr(&mut pd.pd, 0, 4096, 0, -1, 0) }.is_null());
    assert!(refused("ibv_reg_dmabuf_mr"));
    assert_eq!(
        // SAFETY: as above.
        unsafe { ibv_rereg_mr(null_mut(), 0, null_mut(), null_mut(), 0, 0) },
        -1
    );
    assert!(refused("ibv_rereg_mr"));

    l.remove_context(ctx);
    // SAFETY: made by `boxed` above, no longer registered.
    unsafe { free(ctx) };
}
