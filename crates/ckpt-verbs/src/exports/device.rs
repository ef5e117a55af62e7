//! Contexts, asynchronous events, queries, protection domains, memory regions, and the calls
//! this layer refuses.
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::atomic::AtomicPtr;
use std::sync::atomic::Ordering::Acquire;

use ibverbs_sys as ffi;

use super::{real_or, set_errno};
use crate::events::{nothing_yet, Proxy};
use crate::fastpath;
use crate::gate::{gate, tid, wait_on};
use crate::real::device_name;
use crate::shadow::{
    boxed, free, layer, real_ctx, real_pd, zeroed, Layer, Registration, ShadowCq, ShadowCtx,
    ShadowMr, ShadowPd, ShadowQp, ShadowSrq,
};

/// Whether the program drives its verbs objects through ib-quiesce's own channel
/// (`libib_quiesce.so` is loaded): then that channel takes them through checkpoints, and the
/// layer stays out of its way. (This library carries a copy of ib-quiesce's C interface too,
/// so the test is for the other library, not for its symbols.)
fn has_own_channel() -> bool {
    static OWN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OWN.get_or_init(|| {
        // SAFETY: a no-load query by a nul-terminated name; the handle is only compared.
        let h = unsafe {
            libc::dlopen(
                c"libib_quiesce.so".as_ptr(),
                libc::RTLD_NOLOAD | libc::RTLD_LAZY,
            )
        };
        !h.is_null()
    })
}

/// `ibv_open_device`: the real context, behind a shadow whose operation table is this
/// layer's and whose `async_fd` is a proxy. Of the extended operations only `create_qp_ex` is
/// offered ([`crate::shadow::ExtendedOps`]); for the others callers fall back to the exported
/// calls: `ibv_create_cq_ex` fails with EOPNOTSUPP and UCX creates its CQs with
/// `ibv_create_cq`; `ibv_query_port` and `ibv_query_device_ex` use the exported queries. Under a ckpt agent, the first shadow starts
/// the layer's control thread.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(dev: *mut ffi::ibv_device) -> *mut ffi::ibv_context {
    let open = real_or!(ibv_open_device, null_mut());
    // SAFETY: the program's device pointer, from libibverbs' list.
    let rc = unsafe { open(dev) };
    if rc.is_null() || has_own_channel() {
        return rc;
    }
    let proxy = match Proxy::new() {
        Ok(p) => p,
        Err(e) => {
            // SAFETY: the context just opened, not handed out.
            unsafe { real_or!(ibv_close_device, null_mut())(rc) };
            set_errno(e.raw_os_error().unwrap_or(libc::EMFILE));
            return null_mut();
        }
    };
    let _pass = gate().enter();
    let mut ctx: ffi::ibv_context = zeroed();
    // SAFETY: `rc` is a live context.
    let name = unsafe {
        ctx.device = (*rc).device;
        ctx.cmd_fd = -1;
        ctx.num_comp_vectors = (*rc).num_comp_vectors;
        proxy.attach((*rc).async_fd);
        device_name((*rc).device)
    };
    ctx.async_fd = proxy.fd();
    ctx.ops.post_send = Some(fastpath::post_send);
    ctx.ops.post_recv = Some(fastpath::post_recv);
    ctx.ops.post_srq_recv = Some(fastpath::post_srq_recv);
    ctx.ops.poll_cq = Some(fastpath::poll_cq);
    ctx.ops.req_notify_cq = Some(fastpath::req_notify_cq);
    let s = boxed(ShadowCtx::new(
        ctx,
        rc,
        name.clone(),
        proxy,
        super::qps::create_qp_ex,
    ));
    // SAFETY: `s` was just made, `rc` is a live context.
    unsafe {
        (*s).cmd_fd
            .store((*rc).cmd_fd, std::sync::atomic::Ordering::Release)
    };
    layer().add_context(s);
    gate().set_opener(tid());
    crate::status::opened(name);
    crate::cycle::start_control();
    // SAFETY: just made.
    unsafe { &mut (*s).ctx }
}

/// `ibv_close_device`.
#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut ffi::ibv_context) -> c_int {
    let close = real_or!(ibv_close_device, -1);
    let l = layer();
    if !l.is_shadow(ctx) {
        // SAFETY: libibverbs' own context.
        return unsafe { close(ctx) };
    }
    let _pass = gate().enter();
    let s = ShadowCtx::of(ctx);
    // SAFETY: a registered shadow; freed only once closed.
    unsafe {
        (*s).async_proxy.detach();
        let rc = close((*s).real.load(Acquire));
        if rc == 0 {
            l.remove_context(s);
            (*s).async_proxy.close();
            free(s);
        }
        rc
    }
}

/// Where an asynchronous event's object is: a shadow's real object points back to its shadow
/// through its user context.
fn event_kind(t: ffi::ibv_event_type) -> Option<char> {
    match t {
        ffi::IBV_EVENT_CQ_ERR => Some('c'),
        ffi::IBV_EVENT_QP_FATAL
        | ffi::IBV_EVENT_QP_REQ_ERR
        | ffi::IBV_EVENT_QP_ACCESS_ERR
        | ffi::IBV_EVENT_COMM_EST
        | ffi::IBV_EVENT_SQ_DRAINED
        | ffi::IBV_EVENT_PATH_MIG
        | ffi::IBV_EVENT_PATH_MIG_ERR
        | ffi::IBV_EVENT_QP_LAST_WQE_REACHED => Some('q'),
        ffi::IBV_EVENT_SRQ_ERR | ffi::IBV_EVENT_SRQ_LIMIT_REACHED => Some('s'),
        _ => None,
    }
}

/// `ibv_get_async_event`: the real event, its QP, CQ or SRQ replaced by the shadow; waits on
/// the proxy (or says EAGAIN) as a read of the program's `async_fd` would.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut ffi::ibv_context,
    ev: *mut ffi::ibv_async_event,
) -> c_int {
    let get = real_or!(ibv_get_async_event, -1);
    if !layer().is_shadow(ctx) {
        // SAFETY: libibverbs' own context.
        return unsafe { get(ctx, ev) };
    }
    let s = ShadowCtx::of(ctx);
    // SAFETY: a shadow context; `ev` is the program's event to fill. The real objects of a
    // shadow context were all made by this layer, with their user context set to the shadow.
    unsafe {
        wait_on(&(*s).async_proxy, || {
            let real = (*s).real.load(Acquire);
            if real.is_null() {
                return None;
            }
            let rc = get(real, ev);
            if nothing_yet(rc) {
                return None;
            }
            if rc == 0 {
                let e = &mut *ev;
                match event_kind(e.event_type) {
                    Some('c') => {
                        e.element.cq = (*e.element.cq).cq_context as *mut ffi::ibv_cq;
                        (*(e.element.cq as *mut ShadowCq)).async_events.handed_out();
                    }
                    Some('q') => {
                        e.element.qp = (*e.element.qp).qp_context as *mut ffi::ibv_qp;
                        (*(e.element.qp as *mut ShadowQp)).async_events.handed_out();
                    }
                    Some('s') => {
                        e.element.srq = (*e.element.srq).srq_context as *mut ffi::ibv_srq;
                        (*(e.element.srq as *mut ShadowSrq))
                            .async_events
                            .handed_out();
                    }
                    _ => {}
                }
            }
            Some(rc)
        })
    }
}

/// `ibv_ack_async_event`: acknowledged on the real object, unless the layer acknowledged that
/// event for the program when it released the object (a checkpoint between the program's get
/// and its ack).
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(ev: *mut ffi::ibv_async_event) {
    let ack = real_or!(ibv_ack_async_event);
    let l = layer();
    let _pass = gate().enter();
    // SAFETY: the program's event, as `ibv_get_async_event` filled it.
    unsafe {
        let mut e = *ev;
        match event_kind(e.event_type) {
            Some('c') if l.is_shadow((*e.element.cq).context) => {
                let s = &*(e.element.cq as *mut ShadowCq);
                if !s.async_events.program_acknowledges() {
                    return;
                }
                e.element.cq = s.real.load(Acquire)
            }
            Some('q') if l.is_shadow((*e.element.qp).context) => {
                let s = &*(e.element.qp as *mut ShadowQp);
                if !s.async_events.program_acknowledges() {
                    return;
                }
                e.element.qp = s.real.load(Acquire)
            }
            Some('s') if l.is_shadow((*e.element.srq).context) => {
                let s = &*(e.element.srq as *mut ShadowSrq);
                if !s.async_events.program_acknowledges() {
                    return;
                }
                e.element.srq = s.real.load(Acquire)
            }
            _ => {}
        }
        ack(&mut e)
    }
}

macro_rules! on_real_ctx {
    ($(#[$m:meta])* $name:ident ( ctx $(, $arg:ident : $ty:ty)* ) -> $ret:ty, $fail:expr) => {
        $(#[$m])*
        #[no_mangle]
        pub unsafe extern "C" fn $name(ctx: *mut ffi::ibv_context $(, $arg: $ty)*) -> $ret {
            let f = real_or!($name, $fail);
            let _pass = layer().is_shadow(ctx).then(|| gate().enter());
            // SAFETY: the real context behind the program's (or libibverbs' own).
            unsafe { f(real_ctx(ctx) $(, $arg)*) }
        }
    };
}

on_real_ctx!(
    /// `ibv_query_device`.
    ibv_query_device(ctx, attr: *mut ffi::ibv_device_attr) -> c_int, libc::ENOSYS
);
on_real_ctx!(
    /// `ibv_query_port` (the exported, compatible one; the header's inline version comes here
    /// because extended operations are hidden).
    ibv_query_port(ctx, port: u8, attr: *mut ffi::_compat_ibv_port_attr) -> c_int, libc::ENOSYS
);
on_real_ctx!(
    /// `ibv_query_gid`.
    ibv_query_gid(ctx, port: u8, index: c_int, gid: *mut ffi::ibv_gid) -> c_int, -1
);
on_real_ctx!(
    /// `ibv_query_pkey`.
    ibv_query_pkey(ctx, port: u8, index: c_int, pkey: *mut u16) -> c_int, -1
);
on_real_ctx!(
    /// `ibv_get_pkey_index`.
    ibv_get_pkey_index(ctx, port: u8, pkey: u16) -> c_int, -1
);
on_real_ctx!(
    /// `ibv_query_gid_ex` (the exported half of the inline call).
    _ibv_query_gid_ex(ctx, port: u32, index: u32, entry: *mut ffi::ibv_gid_entry, flags: u32, size: usize) -> c_int, libc::ENOSYS
);
on_real_ctx!(
    /// `ibv_query_gid_table` (the exported half of the inline call).
    _ibv_query_gid_table(ctx, entries: *mut ffi::ibv_gid_entry, max: usize, flags: u32, size: usize) -> isize, -(libc::ENOSYS as isize)
);
on_real_ctx!(
    /// `ibv_resolve_eth_l2_from_gid`.
    ibv_resolve_eth_l2_from_gid(ctx, attr: *mut ffi::ibv_ah_attr, mac: *mut u8, vid: *mut u16) -> c_int, libc::ENOSYS
);

/// `ibv_alloc_pd`.
#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(ctx: *mut ffi::ibv_context) -> *mut ffi::ibv_pd {
    let alloc = real_or!(ibv_alloc_pd, null_mut());
    if !layer().is_shadow(ctx) {
        // SAFETY: libibverbs' own context.
        return unsafe { alloc(ctx) };
    }
    let _pass = gate().enter();
    // SAFETY: a shadow context.
    let real = unsafe { alloc(real_ctx(ctx)) };
    if real.is_null() {
        return real;
    }
    let mut pd: ffi::ibv_pd = zeroed();
    pd.context = ctx;
    // SAFETY: a live PD.
    pd.handle = unsafe { (*real).handle };
    let s = boxed(ShadowPd {
        pd,
        real: AtomicPtr::new(real),
    });
    Layer::track(&layer().pds, s as usize);
    // SAFETY: just made.
    unsafe { &mut (*s).pd }
}

/// `ibv_dealloc_pd`.
#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ffi::ibv_pd) -> c_int {
    let dealloc = real_or!(ibv_dealloc_pd, libc::ENOSYS);
    // SAFETY: the program's PD.
    unsafe {
        if !layer().is_shadow((*pd).context) {
            return dealloc(pd);
        }
        let _pass = gate().enter();
        let s = pd as *mut ShadowPd;
        let rc = dealloc((*s).real.load(Acquire));
        if rc == 0 {
            Layer::untrack(&layer().pds, s as usize);
            free(s);
        }
        rc
    }
}

/// A new region's virtual key: the real one, unless a region registered before a rebuild
/// holds it as its virtual key; then the first free one above.
fn virtual_key(real: u32) -> u32 {
    let t = &layer().tables;
    let mut k = real;
    // Bounded by the 2^24 keys with this low byte; a process never holds that many regions.
    for _ in 0..1 << 24 {
        if !t.key_in_use(k) {
            break;
        }
        k = k.wrapping_add(0x100);
    }
    k
}

/// Wraps a real MR in a shadow with virtual keys.
///
/// # Safety
/// `pd` is a shadow PD and `real` a live MR registered on its real PD.
unsafe fn shadow_mr(
    pd: *mut ffi::ibv_pd,
    real: *mut ffi::ibv_mr,
    reg: Registration,
) -> *mut ffi::ibv_mr {
    let l = layer();
    let mut mr: ffi::ibv_mr = zeroed();
    // SAFETY: as the caller promises.
    unsafe {
        mr.context = (*pd).context;
        mr.pd = pd;
        mr.addr = (*real).addr;
        mr.length = (*real).length;
        mr.handle = (*real).handle;
        mr.lkey = virtual_key((*real).lkey);
        mr.rkey = if (*real).rkey == (*real).lkey {
            mr.lkey
        } else {
            virtual_key((*real).rkey)
        };
        l.tables
            .set_mr(mr.lkey, (*real).lkey, mr.rkey, (*real).rkey);
    }
    let s = boxed(ShadowMr {
        mr,
        real: AtomicPtr::new(real),
        reg,
    });
    Layer::track(&l.mrs, s as usize);
    // SAFETY: just made.
    unsafe { &mut (*s).mr }
}

/// Registers memory on the real PD behind a shadow one and wraps the region; a real PD's
/// registration passes through. `reg` is the real call with the program's other arguments.
///
/// # Safety
/// `pd` is a PD pointer; `reg` registers memory the program owns.
unsafe fn register(
    pd: *mut ffi::ibv_pd,
    how: Registration,
    reg: impl FnOnce(*mut ffi::ibv_pd) -> *mut ffi::ibv_mr,
) -> *mut ffi::ibv_mr {
    // SAFETY: the program's PD.
    unsafe {
        if !layer().is_shadow((*pd).context) {
            return reg(pd);
        }
        let _pass = gate().enter();
        let real = reg(real_pd(pd));
        if real.is_null() {
            return real;
        }
        shadow_mr(pd, real, how)
    }
}

/// How memory at `addr` is registered.
fn how(addr: *mut c_void, len: usize, iova: Option<u64>, access: u32) -> Registration {
    Registration {
        addr: addr as u64,
        len,
        iova,
        access,
    }
}

/// `ibv_reg_mr` (what the header's macro calls for constant access flags).
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ffi::ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ffi::ibv_mr {
    let reg = real_or!(ibv_reg_mr, null_mut());
    // SAFETY: the program's PD and memory.
    unsafe {
        register(pd, how(addr, len, None, access as u32), |pd| {
            reg(pd, addr, len, access)
        })
    }
}

/// `ibv_reg_mr_iova`.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ffi::ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ffi::ibv_mr {
    let reg = real_or!(ibv_reg_mr_iova, null_mut());
    // SAFETY: the program's PD and memory.
    unsafe {
        register(pd, how(addr, len, Some(iova), access as u32), |pd| {
            reg(pd, addr, len, iova, access)
        })
    }
}

/// `ibv_reg_mr_iova2` (what the header's macro calls for variable access flags: UCX).
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ffi::ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ffi::ibv_mr {
    let reg = real_or!(ibv_reg_mr_iova2, null_mut());
    // SAFETY: the program's PD and memory.
    unsafe {
        register(pd, how(addr, len, Some(iova), access), |pd| {
            reg(pd, addr, len, iova, access)
        })
    }
}

/// `ibv_dereg_mr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ffi::ibv_mr) -> c_int {
    let dereg = real_or!(ibv_dereg_mr, libc::ENOSYS);
    let l = layer();
    // SAFETY: the program's MR.
    unsafe {
        if !l.is_shadow((*mr).context) {
            return dereg(mr);
        }
        let _pass = gate().enter();
        let s = mr as *mut ShadowMr;
        let rc = dereg((*s).real.load(Acquire));
        if rc == 0 {
            l.tables.drop_mr((*s).mr.lkey, (*s).mr.rkey);
            Layer::untrack(&l.mrs, s as usize);
            free(s);
        }
        rc
    }
}

/// Refuses a call on shadow objects: the feature is not one the layer can take through a
/// checkpoint. Counted and named in the status; the program sees EOPNOTSUPP and falls back.
fn refuse(call: &str) {
    layer().refuse(call.to_string());
    set_errno(libc::EOPNOTSUPP);
}

/// `ibv_rereg_mr`: refused on shadows (no library on the supported list uses it).
#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut ffi::ibv_mr,
    _flags: c_int,
    _pd: *mut ffi::ibv_pd,
    _addr: *mut c_void,
    _len: usize,
    _access: c_int,
) -> c_int {
    let _ = mr;
    refuse("ibv_rereg_mr");
    // IBV_REREG_MR_ERR_INPUT: the region is unchanged.
    -1
}

/// `ibv_reg_dmabuf_mr`: refused (device memory of another driver cannot be re-registered
/// after a restore), so libraries report dmabuf unsupported.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_dmabuf_mr(
    _pd: *mut ffi::ibv_pd,
    _offset: u64,
    _len: usize,
    _iova: u64,
    _fd: c_int,
    _access: c_int,
) -> *mut ffi::ibv_mr {
    refuse("ibv_reg_dmabuf_mr");
    null_mut()
}

/// `ibv_import_device`: refused (a context shared with another process cannot be rebuilt).
#[no_mangle]
pub unsafe extern "C" fn ibv_import_device(_cmd_fd: c_int) -> *mut ffi::ibv_context {
    refuse("ibv_import_device");
    null_mut()
}

/// `ibv_import_pd`: refused.
#[no_mangle]
pub unsafe extern "C" fn ibv_import_pd(
    _ctx: *mut ffi::ibv_context,
    _handle: u32,
) -> *mut ffi::ibv_pd {
    refuse("ibv_import_pd");
    null_mut()
}

/// `ibv_import_mr`: refused.
#[no_mangle]
pub unsafe extern "C" fn ibv_import_mr(_pd: *mut ffi::ibv_pd, _handle: u32) -> *mut ffi::ibv_mr {
    refuse("ibv_import_mr");
    null_mut()
}

/// `ibv_unimport_pd`: nothing was imported.
#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_pd(_pd: *mut ffi::ibv_pd) {}

/// `ibv_unimport_mr`: nothing was imported.
#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_mr(_mr: *mut ffi::ibv_mr) {}
