//! The refusals, on shadow objects that have no device behind them: a refused call never
//! reaches libibverbs, answers EOPNOTSUPP and is named in the status.
use std::ptr::null_mut;
use std::sync::atomic::AtomicPtr;

use ibverbs_sys as ffi;

use super::device::{ibv_reg_dmabuf_mr, ibv_rereg_mr};
use super::qps::ibv_create_qp;
use super::qps::ibv_qp_to_qp_ex;
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
fn unsupported_qp_types_extended_qp_requests_and_foreign_memory_are_refused_and_named() {
    let l = layer();
    // A shadow context and PD with nothing real behind them: a call that reached libibverbs
    // would crash on the null pointers.
    let ctx = boxed(ShadowCtx::new(
        zeroed(),
        null_mut(),
        "none".into(),
        Proxy::new().expect("eventfd"),
        super::create_qp_ex,
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

    // The header's `ibv_create_qp_ex` finds the layer's extended operation on the shadow
    // context; what it cannot rebuild or translate is refused there, named.
    // SAFETY: `ctx` is live; the extended part precedes its context, as verbs.h reads it.
    let create_ex = unsafe {
        assert_eq!(
            (*ctx).ctx.abi_compat as usize,
            usize::MAX,
            "an extended context"
        );
        let ops = &*(ctx_ptr.byte_sub(std::mem::size_of::<crate::shadow::ExtendedOps>())
            as *const crate::shadow::ExtendedOps);
        assert_eq!(
            ops.sz,
            std::mem::size_of::<crate::shadow::ExtendedOps>()
                + std::mem::size_of::<ffi::ibv_context>(),
            "nothing before create_qp_ex is offered"
        );
        ops.create_qp_ex.expect("create_qp_ex offered")
    };
    let mut ex: ffi::ibv_qp_init_attr_ex = zeroed();
    ex.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
    ex.pd = &mut pd.pd;
    ex.comp_mask = ffi::IBV_QP_INIT_ATTR_PD | ffi::IBV_QP_INIT_ATTR_CREATE_FLAGS;
    // SAFETY: a shadow context and valid attributes.
    assert!(unsafe { create_ex(ctx_ptr, &mut ex) }.is_null());
    assert_eq!(errno(), libc::EOPNOTSUPP);
    assert!(
        refused("ibv_create_qp_ex with comp_mask 0x5"),
        "{}",
        report()
    );
    ex.comp_mask = ffi::IBV_QP_INIT_ATTR_PD | ffi::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    ex.send_ops_flags = (ffi::IBV_QP_EX_WITH_SEND | ffi::IBV_QP_EX_WITH_BIND_MW) as u64;
    // SAFETY: as above.
    assert!(unsafe { create_ex(ctx_ptr, &mut ex) }.is_null());
    assert!(
        refused("ibv_create_qp_ex with send operations BIND_MW (supported: RDMA_WRITE|"),
        "{}",
        report()
    );

    // A QP made without send operations has no extended QP, as libibverbs answers.
    let mut shadow_qp = ShadowQp::new(zeroed(), null_mut(), 0, zeroed());
    shadow_qp.ex.qp_base.context = ctx_ptr;
    // SAFETY: a shadow QP.
    assert!(unsafe { ibv_qp_to_qp_ex(&mut shadow_qp.ex.qp_base) }.is_null());

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
