//! Completion channels and queues, shared receive queues, queue pairs and address handles.
//!
//! One file: one exported function per libibverbs call on queues, QPs and address handles, every
//! one defined (a shadow handed to libibverbs would crash), in verbs.h's order.
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
    addr_of, boxed, free, layer, lock, real_ctx, real_pd, zeroed, Attachment, Layer, ShadowAh,
    ShadowChannel, ShadowCq, ShadowQp, ShadowSrq, Transition,
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
unsafe fn real_cq(cq: *mut ffi::ibv_cq) -> *mut ffi::ibv_cq {
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
unsafe fn real_srq(srq: *mut ffi::ibv_srq) -> *mut ffi::ibv_srq {
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

/// How many real QPs a create may set aside looking for a number of its own (devices hand out
/// QP numbers in turn, so the next one is normally free).
const QPN_TRIES: usize = 64;

/// `ibv_create_qp` (also what the inline `ibv_create_qp_ex` calls for a plain request).
#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut ffi::ibv_pd,
    attr: *mut ffi::ibv_qp_init_attr,
) -> *mut ffi::ibv_qp {
    let create = real_or!(ibv_create_qp, null_mut());
    // SAFETY: the program's PD and attributes.
    unsafe {
        if !layer().is_shadow((*pd).context) {
            return create(pd, attr);
        }
        create_shadow_qp(pd, attr, 0)
    }
}

/// A shadow QP on the shadow PD `pd` over a real one made with `ibv_create_qp`; with the
/// extended post calls of `send_ops` ([`crate::extended`]) when not 0. `attr` gets the
/// capacities the device gave.
///
/// # Safety
/// `pd` is a shadow PD; `attr` the program's valid attributes.
pub(crate) unsafe fn create_shadow_qp(
    pd: *mut ffi::ibv_pd,
    attr: *mut ffi::ibv_qp_init_attr,
    send_ops: u64,
) -> *mut ffi::ibv_qp {
    let create = real_or!(ibv_create_qp, null_mut());
    let l = layer();
    // SAFETY: as the caller promises; `s` lives until the QP is destroyed.
    unsafe {
        let _pass = gate().enter();
        let init = *attr;
        match init.qp_type {
            ffi::ibv_qp_type::IBV_QPT_RC | ffi::ibv_qp_type::IBV_QPT_UD => {}
            t => {
                l.refuse(format!(
                    "ibv_create_qp of type {t} (only RC and UD QPs are supported)"
                ));
                set_errno(libc::EOPNOTSUPP);
                return null_mut();
            }
        }
        let mut qp: ffi::ibv_qp = zeroed();
        qp.context = (*pd).context;
        qp.qp_context = init.qp_context;
        qp.pd = pd;
        qp.send_cq = init.send_cq;
        qp.recv_cq = init.recv_cq;
        qp.srq = init.srq;
        qp.qp_type = init.qp_type;
        let s = boxed(ShadowQp::new(qp, null_mut(), 0, init));
        let mut a = init;
        a.qp_context = s as *mut c_void;
        a.send_cq = real_cq(init.send_cq);
        a.recv_cq = real_cq(init.recv_cq);
        a.srq = real_srq(init.srq);
        // The new QP's virtual number is its real one, which its peers use as it is (they
        // know of no translation for it); a real number that is already a virtual one of this
        // process, or of a node-mate the peers translate for, is set aside for another.
        let me = (*crate::shadow::ShadowCtx::of((*pd).context))
            .ident
            .load(std::sync::atomic::Ordering::Relaxed);
        let mut aside = Vec::new();
        let mut real = create(real_pd(pd), &mut a);
        while !real.is_null()
            && !l.tables.qpn_free_for_new(me, (*real).qp_num)
            && aside.len() < QPN_TRIES
        {
            aside.push(real);
            a = init;
            a.qp_context = s as *mut c_void;
            a.send_cq = real_cq(init.send_cq);
            a.recv_cq = real_cq(init.recv_cq);
            a.srq = real_srq(init.srq);
            real = create(real_pd(pd), &mut a);
        }
        l.counters
            .qpns_set_aside
            .fetch_add(aside.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let destroy = real_or!(ibv_destroy_qp, null_mut());
        for q in aside.drain(..) {
            destroy(q);
        }
        if !real.is_null() && !l.tables.qpn_free_for_new(me, (*real).qp_num) {
            destroy(real);
            l.refuse(format!(
                "ibv_create_qp: {QPN_TRIES} real QP numbers in a row were virtual ones of this job"
            ));
            set_errno(libc::EAGAIN);
            real = null_mut();
        }
        if real.is_null() {
            free(s);
            return real;
        }
        // The device reports the capacities it gave.
        (*attr).cap = a.cap;
        (*s).init.cap = a.cap;
        let v = (*real).qp_num;
        (*s).ex.qp_base.qp_num = v;
        (*s).ex.qp_base.handle = (*real).handle;
        (*s).ex.qp_base.state = (*real).state;
        (*s).real_qpn.store((*real).qp_num, Release);
        (*s).real.store(real, Release);
        if send_ops != 0 {
            crate::extended::offer(&mut *s, send_ops);
        }
        l.tables.set_qp((*real).qp_num, v, s as usize);
        Layer::track(&l.qps, s as usize);
        &mut (*s).ex.qp_base
    }
}

/// `create_qp_ex` of a shadow context: what the header's `ibv_create_qp_ex` calls for a request
/// with more than a PD. A shadow QP over a real one made with `ibv_create_qp`, with the
/// extended post calls when send operations were asked for.
pub unsafe extern "C" fn create_qp_ex(
    ctx: *mut ffi::ibv_context,
    attr: *mut ffi::ibv_qp_init_attr_ex,
) -> *mut ffi::ibv_qp {
    // SAFETY: the program's attributes, as `ibv_create_qp_ex` takes them.
    let a = unsafe { &mut *attr };
    if let Some(why) = crate::extended::refusal(a) {
        layer().refuse(why);
        set_errno(libc::EOPNOTSUPP);
        return null_mut();
    }
    // SAFETY: `pd` is the program's PD, checked above.
    if unsafe { (*a.pd).context } != ctx {
        set_errno(libc::EINVAL);
        return null_mut();
    }
    let mut init = ffi::ibv_qp_init_attr {
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
    };
    let ops = if a.comp_mask & ffi::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
        a.send_ops_flags
    } else {
        0
    };
    // SAFETY: the program's PD and attributes.
    let qp = unsafe { create_shadow_qp(a.pd, &mut init, ops) };
    if !qp.is_null() {
        a.cap = init.cap;
    }
    qp
}

/// `ibv_qp_to_qp_ex`: a shadow QP made with send operations hands out its own `ibv_qp_ex`;
/// another has none (as libibverbs answers for a QP made without them).
#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ffi::ibv_qp) -> *mut ffi::ibv_qp_ex {
    let f = real_or!(ibv_qp_to_qp_ex, null_mut());
    // SAFETY: the program's QP.
    unsafe {
        if !layer().is_shadow((*qp).context) {
            return f(qp);
        }
        let s = qp as *mut ShadowQp;
        if (*s).send_ops == 0 {
            return null_mut();
        }
        &mut (*s).ex
    }
}

/// `ibv_modify_qp`: the peer's QP number and address translated to the real ones, the
/// transition recorded for a rebuild, the shadow's state kept current (libraries read
/// `qp->state`).
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ffi::ibv_qp,
    attr: *mut ffi::ibv_qp_attr,
    mask: c_int,
) -> c_int {
    let modify = real_or!(ibv_modify_qp, libc::ENOSYS);
    let l = layer();
    // SAFETY: the program's QP and attributes.
    unsafe {
        if !l.is_shadow((*qp).context) {
            return modify(qp, attr, mask);
        }
        let _pass = gate().enter();
        let s = &*(qp as *mut ShadowQp);
        let given = *attr;
        let mut a = given;
        let m = mask as c_uint;
        if m & ffi::ibv_qp_attr_mask::IBV_QP_AV.0 != 0 {
            crate::cycle::note_source(s.ex.qp_base.context, &given.ah_attr);
            crate::lookup::meet(addr_of(&given.ah_attr).id());
            crate::cycle::to_real_av(&mut a.ah_attr);
        }
        if m & ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN.0 != 0 {
            let peer = addr_of(&given.ah_attr).id();
            a.dest_qp_num = l.tables.remote_qpn(peer, given.dest_qp_num);
            *lock(&s.peer) = Some((peer, given.dest_qp_num));
        }
        let rc = modify(s.real.load(Acquire), &mut a, mask);
        if rc == 0 {
            if m & ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 != 0 {
                (*(qp as *mut ShadowQp)).ex.qp_base.state = given.qp_state;
            }
            lock(&s.transitions).push(Transition { attr: given, mask });
        }
        rc
    }
}

/// `ibv_query_qp`: the answer with the program's objects and virtual numbers.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ffi::ibv_qp,
    attr: *mut ffi::ibv_qp_attr,
    mask: c_int,
    init: *mut ffi::ibv_qp_init_attr,
) -> c_int {
    let query = real_or!(ibv_query_qp, libc::ENOSYS);
    // SAFETY: the program's QP and out-structs.
    unsafe {
        if !layer().is_shadow((*qp).context) {
            return query(qp, attr, mask, init);
        }
        let _pass = gate().enter();
        let s = &*(qp as *mut ShadowQp);
        let rc = query(s.real.load(Acquire), attr, mask, init);
        if rc == 0 {
            if let Some((_, v)) = *lock(&s.peer) {
                (*attr).dest_qp_num = v;
            }
            if let Some(t) = lock(&s.transitions)
                .iter()
                .rev()
                .find(|t| t.mask as c_uint & ffi::ibv_qp_attr_mask::IBV_QP_AV.0 != 0)
            {
                (*attr).ah_attr = t.attr.ah_attr;
            }
            if !init.is_null() {
                (*init).qp_context = s.ex.qp_base.qp_context;
                (*init).send_cq = s.ex.qp_base.send_cq;
                (*init).recv_cq = s.ex.qp_base.recv_cq;
                (*init).srq = s.ex.qp_base.srq;
            }
        }
        rc
    }
}

/// `ibv_destroy_qp`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ffi::ibv_qp) -> c_int {
    let destroy = real_or!(ibv_destroy_qp, libc::ENOSYS);
    let l = layer();
    // SAFETY: the program's QP.
    unsafe {
        if !l.is_shadow((*qp).context) {
            return destroy(qp);
        }
        let _pass = gate().enter();
        let s = qp as *mut ShadowQp;
        let real_qpn = (*s).real_qpn.load(Acquire);
        let rc = destroy((*s).real.load(Acquire));
        if rc == 0 {
            l.tables.drop_qp(real_qpn);
            l.forget_multicast(s as usize);
            Layer::untrack(&l.qps, s as usize);
            free(s);
        }
        rc
    }
}

/// `ibv_query_qp_data_in_order`.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp_data_in_order(
    qp: *mut ffi::ibv_qp,
    op: c_uint,
    flags: u32,
) -> c_int {
    let query = real_or!(ibv_query_qp_data_in_order, 0);
    let _pass = gate().enter();
    // SAFETY: the program's QP.
    unsafe {
        let real = if layer().is_shadow((*qp).context) {
            (*(qp as *mut ShadowQp)).real.load(Acquire)
        } else {
            qp
        };
        query(real, op, flags)
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

/// Refuses a QP call on a shadow, or passes a real QP's through.
macro_rules! refused_on_shadow_qp {
    ($(#[$m:meta])* $name:ident ( qp $(, $arg:ident : $ty:ty)* ) -> $ret:ty, $fail:expr) => {
        $(#[$m])*
        #[no_mangle]
        pub unsafe extern "C" fn $name(qp: *mut ffi::ibv_qp $(, $arg: $ty)*) -> $ret {
            let f = real_or!($name, $fail);
            // SAFETY: the program's QP.
            if unsafe { layer().is_shadow((*qp).context) } {
                layer().refuse(stringify!($name).to_string());
                set_errno(libc::EOPNOTSUPP);
                return $fail;
            }
            // SAFETY: libibverbs' own QP.
            unsafe { f(qp $(, $arg)*) }
        }
    };
}

refused_on_shadow_qp!(
    /// `ibv_query_ece`: not offered (UCX then does without ECE).
    ibv_query_ece(qp, ece: *mut ffi::ibv_ece) -> c_int, libc::EOPNOTSUPP
);
refused_on_shadow_qp!(
    /// `ibv_set_ece`: not offered.
    ibv_set_ece(qp, ece: *mut ffi::ibv_ece) -> c_int, libc::EOPNOTSUPP
);
/// `ibv_attach_mcast`: passed to the real QP, and the group noted while attached. Nothing
/// rebuilds a group after a snapshot, so while one is attached the layer reports multicast in
/// use to the agent, which refuses to checkpoint the process (and the layer refuses to
/// quiesce): the program keeps a feature it may need, and the job runs on.
#[no_mangle]
pub unsafe extern "C" fn ibv_attach_mcast(
    qp: *mut ffi::ibv_qp,
    gid: *const ffi::ibv_gid,
    lid: u16,
) -> c_int {
    let attach = real_or!(ibv_attach_mcast, libc::ENOSYS);
    let l = layer();
    // SAFETY: the program's QP and group.
    unsafe {
        if !l.is_shadow((*qp).context) {
            return attach(qp, gid, lid);
        }
        let _pass = gate().enter();
        let s = &*(qp as *mut ShadowQp);
        let rc = attach(s.real.load(Acquire), gid, lid);
        if rc == 0 {
            l.attach_multicast(Attachment {
                qp: qp as usize,
                qpn: s.ex.qp_base.qp_num,
                gid: (*gid).raw,
                lid,
            });
        }
        rc
    }
}

/// `ibv_detach_mcast`: passed to the real QP; the group is forgotten once detached.
#[no_mangle]
pub unsafe extern "C" fn ibv_detach_mcast(
    qp: *mut ffi::ibv_qp,
    gid: *const ffi::ibv_gid,
    lid: u16,
) -> c_int {
    let detach = real_or!(ibv_detach_mcast, libc::ENOSYS);
    let l = layer();
    // SAFETY: the program's QP and group.
    unsafe {
        if !l.is_shadow((*qp).context) {
            return detach(qp, gid, lid);
        }
        let _pass = gate().enter();
        let s = &*(qp as *mut ShadowQp);
        let rc = detach(s.real.load(Acquire), gid, lid);
        if rc == 0 {
            l.detach_multicast(qp as usize, (*gid).raw, lid);
        }
        rc
    }
}
