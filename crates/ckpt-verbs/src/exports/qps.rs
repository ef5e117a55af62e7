//! Queue pairs: made over real ones (the extended `create_qp_ex` too), their state changes
//! recorded for a rebuild, the calls refused on them (ECE), and multicast, passed through and
//! reported in use.
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::atomic::Ordering::{Acquire, Release};

use ibverbs_sys as ffi;

use super::queues::{real_cq, real_srq};
use super::{real_or, set_errno};
use crate::gate::gate;
use crate::shadow::{
    addr_of, boxed, free, layer, lock, real_pd, zeroed, Attachment, Layer, ShadowQp, Transition,
};

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
