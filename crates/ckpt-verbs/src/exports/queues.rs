//! Completion channels and queues, shared receive queues and address handles.
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::atomic::AtomicPtr;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Mutex;

use ibverbs_sys as ffi;

use super::{real_or, set_errno};
use crate::events::{nothing_yet, Proxy};
use crate::gate::{gate, wait_on};
use crate::shadow::{
    addr_of, boxed, free, layer, lock, real_ctx, real_pd, zeroed, Layer, ShadowAh, ShadowChannel,
    ShadowCq, ShadowSrq,
};

/// `ibv_create_comp_channel`: the real channel behind a shadow whose `fd` is a proxy.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(
    ctx: *mut ffi::ibv_context,
) -> *mut ffi::ibv_comp_channel {
    let create = real_or!(ibv_create_comp_channel, null_mut());
    if !layer().is_shadow(ctx) {
        // SAFETY: libibverbs' own context.
        return unsafe { create(ctx) };
    }
    let proxy = match Proxy::new() {
        Ok(p) => p,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EMFILE));
            return null_mut();
        }
    };
    let _pass = gate().enter();
    // SAFETY: a shadow context.
    let real = unsafe { create(real_ctx(ctx)) };
    if real.is_null() {
        proxy.close();
        return real;
    }
    let mut ch: ffi::ibv_comp_channel = zeroed();
    ch.context = ctx;
    ch.fd = proxy.fd();
    // SAFETY: a live channel.
    proxy.attach(unsafe { (*real).fd });
    let s = boxed(ShadowChannel {
        ch,
        real: AtomicPtr::new(real),
        proxy,
        owed: Mutex::new(Default::default()),
    });
    Layer::track(&layer().channels, s as usize);
    // SAFETY: just made.
    unsafe { &mut (*s).ch }
}

/// The real channel behind `ch` (null stays null).
///
/// # Safety
/// `ch` is null or a channel pointer.
pub(crate) unsafe fn real_channel(ch: *mut ffi::ibv_comp_channel) -> *mut ffi::ibv_comp_channel {
    // SAFETY: a channel's first field is its context.
    unsafe {
        if !ch.is_null() && layer().is_shadow((*ch).context) {
            (*(ch as *mut ShadowChannel)).real.load(Acquire)
        } else {
            ch
        }
    }
}

/// `ibv_destroy_comp_channel`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ffi::ibv_comp_channel) -> c_int {
    let destroy = real_or!(ibv_destroy_comp_channel, libc::ENOSYS);
    // SAFETY: the program's channel.
    unsafe {
        if !layer().is_shadow((*ch).context) {
            return destroy(ch);
        }
        let _pass = gate().enter();
        let s = ch as *mut ShadowChannel;
        (*s).proxy.detach();
        let rc = destroy((*s).real.load(Acquire));
        if rc == 0 {
            Layer::untrack(&layer().channels, s as usize);
            (*s).proxy.close();
            free(s);
        } else {
            (*s).proxy.attach((*(*s).real.load(Acquire)).fd);
        }
        rc
    }
}

/// `ibv_create_cq`. The real CQ's user context is the shadow, so that completion and
/// asynchronous events find it.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    ctx: *mut ffi::ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ffi::ibv_comp_channel,
    vector: c_int,
) -> *mut ffi::ibv_cq {
    let create = real_or!(ibv_create_cq, null_mut());
    if !layer().is_shadow(ctx) {
        // SAFETY: libibverbs' own objects.
        return unsafe { create(ctx, cqe, cq_context, channel, vector) };
    }
    let _pass = gate().enter();
    let mut cq: ffi::ibv_cq = zeroed();
    cq.context = ctx;
    cq.channel = channel;
    cq.cq_context = cq_context;
    let s = boxed(ShadowCq::new(cq, null_mut(), cqe, vector));
    // SAFETY: a shadow context and channel; `s` lives until the CQ is destroyed.
    unsafe {
        let real = create(
            real_ctx(ctx),
            cqe,
            s as *mut c_void,
            real_channel(channel),
            vector,
        );
        if real.is_null() {
            free(s);
            return real;
        }
        (*s).cq.handle = (*real).handle;
        (*s).cq.cqe = (*real).cqe;
        (*s).real.store(real, Release);
        Layer::track(&layer().cqs, s as usize);
        &mut (*s).cq
    }
}

/// `ibv_resize_cq`.
#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut ffi::ibv_cq, cqe: c_int) -> c_int {
    let resize = real_or!(ibv_resize_cq, libc::ENOSYS);
    // SAFETY: the program's CQ.
    unsafe {
        if !layer().is_shadow((*cq).context) {
            return resize(cq, cqe);
        }
        let _pass = gate().enter();
        let s = cq as *mut ShadowCq;
        let real = (*s).real.load(Acquire);
        let rc = resize(real, cqe);
        if rc == 0 {
            (*s).cq.cqe = (*real).cqe;
            (*s).cqe = cqe;
        }
        rc
    }
}

/// `ibv_destroy_cq`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ffi::ibv_cq) -> c_int {
    let destroy = real_or!(ibv_destroy_cq, libc::ENOSYS);
    // SAFETY: the program's CQ.
    unsafe {
        if !layer().is_shadow((*cq).context) {
            return destroy(cq);
        }
        let _pass = gate().enter();
        let s = cq as *mut ShadowCq;
        let rc = destroy((*s).real.load(Acquire));
        if rc == 0 {
            Layer::untrack(&layer().cqs, s as usize);
            free(s);
        }
        rc
    }
}

/// `ibv_get_cq_event`: an event the layer owes the program first (a CQ armed before a
/// release), then the real channel's, for the shadow CQ and the program's CQ context; waits on
/// the proxy (or says EAGAIN) as a read of the program's `fd` would.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut ffi::ibv_comp_channel,
    cq: *mut *mut ffi::ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    let get = real_or!(ibv_get_cq_event, -1);
    // SAFETY: the program's channel and out-pointers. A shadow channel's CQs are shadows
    // whose real CQ's user context is the shadow.
    unsafe {
        if !layer().is_shadow((*ch).context) {
            return get(ch, cq, cq_context);
        }
        let c = &*(ch as *mut ShadowChannel);
        let deliver = |s: *mut ShadowCq| {
            (*s).armed.store(false, Relaxed);
            *cq = &mut (*s).cq;
            *cq_context = (*s).cq.cq_context;
        };
        wait_on(&c.proxy, || {
            if let Some(s) = lock(&c.owed).pop_front() {
                deliver(s as *mut ShadowCq);
                return Some(0);
            }
            let real = c.real.load(Acquire);
            if real.is_null() {
                return None;
            }
            let mut rcq = null_mut();
            let mut rctx = null_mut();
            let rc = get(real, &mut rcq, &mut rctx);
            if nothing_yet(rc) {
                return None;
            }
            if rc == 0 {
                let s = rctx as *mut ShadowCq;
                (*s).unacked.fetch_add(1, Relaxed);
                deliver(s);
            }
            Some(rc)
        })
    }
}

/// `ibv_ack_cq_events`: passed on, less those the layer acknowledged or made up itself.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ffi::ibv_cq, n: c_uint) {
    let ack = real_or!(ibv_ack_cq_events);
    // SAFETY: the program's CQ.
    unsafe {
        if !layer().is_shadow((*cq).context) {
            return ack(cq, n);
        }
        let _pass = gate().enter();
        let s = &*(cq as *mut ShadowCq);
        let mut credit = s.credit.load(Relaxed);
        let mine = loop {
            let take = credit.min(n);
            match s
                .credit
                .compare_exchange(credit, credit - take, Relaxed, Relaxed)
            {
                Ok(_) => break take,
                Err(c) => credit = c,
            }
        };
        let rest = n - mine;
        if rest > 0 {
            let _ = s
                .unacked
                .fetch_update(Relaxed, Relaxed, |u| Some(u.saturating_sub(rest)));
            ack(s.real.load(Acquire), rest)
        }
    }
}

/// The real CQ behind `cq` (null stays null).
///
/// # Safety
/// `cq` is null or a CQ pointer.
pub(super) unsafe fn real_cq(cq: *mut ffi::ibv_cq) -> *mut ffi::ibv_cq {
    // SAFETY: a CQ's first field is its context.
    unsafe {
        if !cq.is_null() && layer().is_shadow((*cq).context) {
            (*(cq as *mut ShadowCq)).real.load(Acquire)
        } else {
            cq
        }
    }
}

/// The real SRQ behind `srq` (null stays null).
///
/// # Safety
/// `srq` is null or an SRQ pointer.
pub(super) unsafe fn real_srq(srq: *mut ffi::ibv_srq) -> *mut ffi::ibv_srq {
    // SAFETY: an SRQ's first field is its context.
    unsafe {
        if !srq.is_null() && layer().is_shadow((*srq).context) {
            (*(srq as *mut ShadowSrq)).real.load(Acquire)
        } else {
            srq
        }
    }
}

/// `ibv_create_srq`.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut ffi::ibv_pd,
    attr: *mut ffi::ibv_srq_init_attr,
) -> *mut ffi::ibv_srq {
    let create = real_or!(ibv_create_srq, null_mut());
    // SAFETY: the program's PD and attributes; `s` lives until the SRQ is destroyed.
    unsafe {
        if !layer().is_shadow((*pd).context) {
            return create(pd, attr);
        }
        let _pass = gate().enter();
        let mut srq: ffi::ibv_srq = zeroed();
        srq.context = (*pd).context;
        srq.pd = pd;
        srq.srq_context = (*attr).srq_context;
        let s = boxed(ShadowSrq {
            srq,
            real: AtomicPtr::new(null_mut()),
            init: *attr,
            receives: Mutex::new(Default::default()),
            async_events: Default::default(),
        });
        let mut a = *attr;
        a.srq_context = s as *mut c_void;
        let real = create(real_pd(pd), &mut a);
        if real.is_null() {
            free(s);
            return real;
        }
        (*attr).attr = a.attr;
        (*s).srq.handle = (*real).handle;
        (*s).real.store(real, Release);
        Layer::track(&layer().srqs, s as usize);
        &mut (*s).srq
    }
}

/// `ibv_modify_srq`.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ffi::ibv_srq,
    attr: *mut ffi::ibv_srq_attr,
    mask: c_int,
) -> c_int {
    let modify = real_or!(ibv_modify_srq, libc::ENOSYS);
    let _pass = gate().enter();
    // SAFETY: the program's SRQ.
    unsafe { modify(real_srq(srq), attr, mask) }
}

/// `ibv_query_srq`.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(
    srq: *mut ffi::ibv_srq,
    attr: *mut ffi::ibv_srq_attr,
) -> c_int {
    let query = real_or!(ibv_query_srq, libc::ENOSYS);
    let _pass = gate().enter();
    // SAFETY: the program's SRQ.
    unsafe { query(real_srq(srq), attr) }
}

/// `ibv_destroy_srq`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ffi::ibv_srq) -> c_int {
    let destroy = real_or!(ibv_destroy_srq, libc::ENOSYS);
    // SAFETY: the program's SRQ.
    unsafe {
        if !layer().is_shadow((*srq).context) {
            return destroy(srq);
        }
        let _pass = gate().enter();
        let s = srq as *mut ShadowSrq;
        let rc = destroy((*s).real.load(Acquire));
        if rc == 0 {
            Layer::untrack(&layer().srqs, s as usize);
            free(s);
        }
        rc
    }
}

/// `ibv_create_ah`: the peer as the program addressed it is kept, for translating the QP
/// numbers of the UD sends that use this handle and for recreating it after a rebuild.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(
    pd: *mut ffi::ibv_pd,
    attr: *mut ffi::ibv_ah_attr,
) -> *mut ffi::ibv_ah {
    let create = real_or!(ibv_create_ah, null_mut());
    // SAFETY: the program's PD and attributes.
    unsafe {
        if !layer().is_shadow((*pd).context) {
            return create(pd, attr);
        }
        let _pass = gate().enter();
        let given = *attr;
        crate::cycle::note_source((*pd).context, &given);
        crate::lookup::meet(addr_of(&given).id());
        let mut a = given;
        crate::cycle::to_real_av(&mut a);
        let real = create(real_pd(pd), &mut a);
        if real.is_null() {
            return real;
        }
        let mut ah: ffi::ibv_ah = zeroed();
        ah.context = (*pd).context;
        ah.pd = pd;
        ah.handle = (*real).handle;
        let s = boxed(ShadowAh {
            ah,
            real: AtomicPtr::new(real),
            dest: addr_of(&given).id(),
            attr: given,
        });
        Layer::track(&layer().ahs, s as usize);
        &mut (*s).ah
    }
}

/// `ibv_create_ah_from_wc` (exported; it calls `ibv_init_ah_from_wc` and `ibv_create_ah`,
/// which come back here with the shadow PD).
#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ffi::ibv_pd,
    wc: *mut ffi::ibv_wc,
    grh: *mut ffi::ibv_grh,
    port: u8,
) -> *mut ffi::ibv_ah {
    let mut attr: ffi::ibv_ah_attr = zeroed();
    // SAFETY: the program's PD, completion and GRH.
    unsafe {
        if ibv_init_ah_from_wc((*pd).context, port, wc, grh, &mut attr) != 0 {
            return null_mut();
        }
        ibv_create_ah(pd, &mut attr)
    }
}

/// `ibv_init_ah_from_wc`.
#[no_mangle]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    ctx: *mut ffi::ibv_context,
    port: u8,
    wc: *mut ffi::ibv_wc,
    grh: *mut ffi::ibv_grh,
    attr: *mut ffi::ibv_ah_attr,
) -> c_int {
    let init = real_or!(ibv_init_ah_from_wc, -1);
    let _pass = layer().is_shadow(ctx).then(|| gate().enter());
    // SAFETY: the real context behind the program's; the rest is the program's.
    unsafe { init(real_ctx(ctx), port, wc, grh, attr) }
}

/// `ibv_destroy_ah`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut ffi::ibv_ah) -> c_int {
    let destroy = real_or!(ibv_destroy_ah, libc::ENOSYS);
    // SAFETY: the program's AH.
    unsafe {
        if !layer().is_shadow((*ah).context) {
            return destroy(ah);
        }
        let _pass = gate().enter();
        let s = ah as *mut ShadowAh;
        let rc = destroy((*s).real.load(Acquire));
        if rc == 0 {
            Layer::untrack(&layer().ahs, s as usize);
            free(s);
        }
        rc
    }
}
