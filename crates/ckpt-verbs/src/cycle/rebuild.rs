//! Steps 3 and 4 of the cycle: every object made again behind its shadow, each QP brought
//! back through the program's own state changes, the peers' new numbers learnt.
use std::collections::VecDeque;
use std::os::raw::{c_int, c_uint};
use std::ptr::null_mut;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use ib_quiesce::verbs::Port;
use ib_quiesce::Endpoint;
use ibverbs_sys as ffi;

use super::{all, each, to_real_av};
use crate::exports::real_channel;
use crate::real::{device_name, real};
use crate::shadow::port_attr;
use crate::shadow::{
    addr_of, layer, lock, Receive, ShadowAh, ShadowChannel, ShadowCq, ShadowCtx, ShadowMr,
    ShadowPd, ShadowQp, ShadowSrq, Transition,
};

/// The failure of a call, for the agent.
fn failed(call: &str, what: &str) -> String {
    format!(
        "verbs layer: {call} failed while rebuilding {what}: {}",
        std::io::Error::last_os_error()
    )
}

/// A non-null result, or the failure named.
fn made<T>(p: *mut T, call: &str, what: &str) -> Result<*mut T, String> {
    if p.is_null() {
        Err(failed(call, what))
    } else {
        Ok(p)
    }
}

/// Opens the device named `name` again, or, when it is gone (a restart on a node whose HCA
/// is named otherwise), the first one there is.
fn open_again(name: &str) -> Result<*mut ffi::ibv_context, String> {
    let r = real();
    let (list, free, open) = (
        r.ibv_get_device_list
            .ok_or("libibverbs lacks ibv_get_device_list")?,
        r.ibv_free_device_list
            .ok_or("libibverbs lacks ibv_free_device_list")?,
        r.ibv_open_device
            .ok_or("libibverbs lacks ibv_open_device")?,
    );
    let mut n: c_int = 0;
    // SAFETY: libibverbs' list, freed below; devices stay valid while a context uses them.
    unsafe {
        let devs = list(&mut n);
        if devs.is_null() || n <= 0 {
            if !devs.is_null() {
                free(devs);
            }
            return Err(format!(
                "verbs layer: no RDMA device on this node to open in place of {name}"
            ));
        }
        let all: Vec<*mut ffi::ibv_device> = (0..n as usize).map(|i| *devs.add(i)).collect();
        let dev = all
            .iter()
            .copied()
            .find(|d| device_name(*d) == name)
            .unwrap_or(all[0]);
        let ctx = open(dev);
        free(devs);
        made(ctx, "ibv_open_device", name)
    }
}

/// The real context behind a shadow one.
///
/// # Safety
/// `ctx` is a shadow context.
unsafe fn real_ctx(ctx: *mut ffi::ibv_context) -> *mut ffi::ibv_context {
    // SAFETY: as the caller promises.
    unsafe { (*ShadowCtx::of(ctx)).real.load(Acquire) }
}

/// The real PD behind a shadow one.
///
/// # Safety
/// `pd` is a shadow PD.
unsafe fn real_pd(pd: *mut ffi::ibv_pd) -> *mut ffi::ibv_pd {
    // SAFETY: as the caller promises.
    unsafe { (*(pd as *const ShadowPd)).real.load(Acquire) }
}

/// The real CQ or SRQ behind a shadow one (null stays null).
///
/// # Safety
/// `p` is null or the first field of a shadow whose `real` follows it: a `ShadowCq` or
/// `ShadowSrq`.
unsafe fn real_of<S, T>(p: *mut T, real: impl Fn(&S) -> *mut T) -> *mut T {
    if p.is_null() {
        p
    } else {
        // SAFETY: as the caller promises.
        real(unsafe { &*(p as *const S) })
    }
}

/// Whether a state change needs the peer (its address or QP number).
fn needs_peer(t: &Transition) -> bool {
    let m = t.mask as c_uint;
    m & (ffi::ibv_qp_attr_mask::IBV_QP_AV.0 | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN.0) != 0
}

/// The state changes of `qp` to replay now: before the first that needs a peer (`later` false),
/// or from it on (`later` true). A QP the program moved to the error state goes straight there.
pub(super) fn to_replay(qp: &ShadowQp, later: bool) -> Vec<Transition> {
    let all = lock(&qp.transitions).clone();
    if qp.ex.qp_base.state == ffi::ibv_qp_state::IBV_QPS_ERR {
        if later {
            return Vec::new();
        }
        let mut to_err: ffi::ibv_qp_attr = crate::shadow::zeroed();
        to_err.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        return vec![Transition {
            attr: to_err,
            mask: ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
        }];
    }
    let k = all.iter().position(needs_peer).unwrap_or(all.len());
    if later {
        all[k..].to_vec()
    } else {
        all[..k].to_vec()
    }
}

/// Replays state changes on the real QP of `qp`, pointed at where the peers are now.
fn replay(qp: &ShadowQp, ts: &[Transition]) -> Result<(), String> {
    let l = layer();
    let modify = real()
        .ibv_modify_qp
        .ok_or("libibverbs lacks ibv_modify_qp")?;
    let real_qp = qp.real.load(Acquire);
    for t in ts {
        let mut a = t.attr;
        let m = t.mask as c_uint;
        if m & ffi::ibv_qp_attr_mask::IBV_QP_AV.0 != 0 {
            to_real_av(&mut a.ah_attr);
        }
        if m & ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN.0 != 0 {
            let peer = addr_of(&t.attr.ah_attr).id();
            a.dest_qp_num = l.tables.remote_qpn(peer, t.attr.dest_qp_num);
        }
        // SAFETY: a live real QP and attributes the program once gave it.
        let rc = unsafe { modify(real_qp, &mut a, t.mask) };
        if rc != 0 {
            return Err(format!(
                "verbs layer: QP {:#x}: replaying its change to state {} failed: {}",
                qp.ex.qp_base.qp_num,
                t.attr.qp_state,
                std::io::Error::from_raw_os_error(rc)
            ));
        }
    }
    Ok(())
}

/// Posts kept receives again with `post` (one at a time, translated to the new keys).
fn post_again(
    kept: &VecDeque<Receive>,
    what: &str,
    post: impl Fn(*mut ffi::ibv_recv_wr) -> c_int,
) -> Result<(), String> {
    let t = &layer().tables;
    for r in kept {
        let mut sges: Vec<ffi::ibv_sge> = r
            .sges
            .iter()
            .map(|s| ffi::ibv_sge {
                lkey: t.lkey(s.lkey).value(),
                ..*s
            })
            .collect();
        let mut wr: ffi::ibv_recv_wr = crate::shadow::zeroed();
        wr.wr_id = r.wr_id;
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = sges.len() as c_int;
        let rc = post(&mut wr);
        if rc != 0 {
            return Err(format!(
                "verbs layer: {what}: posting a kept receive again failed: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
    }
    Ok(())
}

/// Step 3: every object made again, in dependency order; returns the QPs' new endpoints.
pub(super) fn rebuild() -> Result<Vec<Endpoint>, String> {
    let l = layer();
    let r = real();
    let missing = |f: &str| format!("libibverbs lacks {f}");
    // SAFETY: live shadows (the gate is closed); each gets a new real object, created on the
    // real objects made just before it.
    unsafe {
        for c in each::<ShadowCtx>(&l.contexts) {
            let real = open_again(&(*c).device)?;
            (*c).ctx.device = (*real).device;
            (*c).ctx.num_comp_vectors = (*real).num_comp_vectors;
            (*c).device = device_name((*real).device);
            (*c).async_proxy.attach((*real).async_fd);
            (*c).real.store(real, Release);
            (*c).cmd_fd.store((*real).cmd_fd, Release);
        }
        let create_ch = r
            .ibv_create_comp_channel
            .ok_or_else(|| missing("ibv_create_comp_channel"))?;
        for ch in all::<ShadowChannel>(&l.channels) {
            let real = made(
                create_ch(real_ctx(ch.ch.context)),
                "ibv_create_comp_channel",
                "a completion channel",
            )?;
            ch.proxy.attach((*real).fd);
            ch.real.store(real, Release);
        }
        let alloc = r.ibv_alloc_pd.ok_or_else(|| missing("ibv_alloc_pd"))?;
        for pd in each::<ShadowPd>(&l.pds) {
            let real = made(
                alloc(real_ctx((*pd).pd.context)),
                "ibv_alloc_pd",
                "a protection domain",
            )?;
            (*pd).pd.handle = (*real).handle;
            (*pd).real.store(real, Release);
        }
        let reg = r
            .ibv_reg_mr_iova2
            .ok_or_else(|| missing("ibv_reg_mr_iova2"))?;
        for mr in each::<ShadowMr>(&l.mrs) {
            let g = (*mr).reg;
            let real = made(
                reg(
                    real_pd((*mr).mr.pd),
                    g.addr as *mut _,
                    g.len,
                    g.iova.unwrap_or(g.addr),
                    g.access,
                ),
                "ibv_reg_mr",
                &format!("the region at {:#x} ({} bytes)", g.addr, g.len),
            )?;
            l.tables
                .set_mr((*mr).mr.lkey, (*real).lkey, (*mr).mr.rkey, (*real).rkey);
            (*mr).mr.handle = (*real).handle;
            (*mr).real.store(real, Release);
        }
        let create_cq = r.ibv_create_cq.ok_or_else(|| missing("ibv_create_cq"))?;
        for cq in each::<ShadowCq>(&l.cqs) {
            let real = made(
                create_cq(
                    real_ctx((*cq).cq.context),
                    (*cq).cqe,
                    cq as *mut _,
                    real_channel((*cq).cq.channel),
                    (*cq).vector,
                ),
                "ibv_create_cq",
                "a completion queue",
            )?;
            (*cq).cq.handle = (*real).handle;
            (*cq).real.store(real, Release);
        }
        let create_srq = r.ibv_create_srq.ok_or_else(|| missing("ibv_create_srq"))?;
        for srq in each::<ShadowSrq>(&l.srqs) {
            let mut a = (*srq).init;
            a.srq_context = srq as *mut _;
            let real = made(
                create_srq(real_pd((*srq).srq.pd), &mut a),
                "ibv_create_srq",
                "a shared receive queue",
            )?;
            (*srq).srq.handle = (*real).handle;
            (*srq).real.store(real, Release);
            let post = (*(*real).context).ops.post_srq_recv.expect("post_srq_recv");
            post_again(&lock(&(*srq).receives), "an SRQ", |w| {
                let mut bad = null_mut();
                post(real, w, &mut bad)
            })?;
        }
        let create_qp = r.ibv_create_qp.ok_or_else(|| missing("ibv_create_qp"))?;
        for qp in each::<ShadowQp>(&l.qps) {
            let mut a = (*qp).init;
            a.qp_context = qp as *mut _;
            a.send_cq = real_of(a.send_cq, |c: &ShadowCq| c.real.load(Acquire));
            a.recv_cq = real_of(a.recv_cq, |c: &ShadowCq| c.real.load(Acquire));
            a.srq = real_of(a.srq, |s: &ShadowSrq| s.real.load(Acquire));
            let what = format!("QP {:#x}", (*qp).ex.qp_base.qp_num);
            let real = made(
                create_qp(real_pd((*qp).ex.qp_base.pd), &mut a),
                "ibv_create_qp",
                &what,
            )?;
            (*qp).ex.qp_base.handle = (*real).handle;
            (*qp).real_qpn.store((*real).qp_num, Release);
            (*qp).real.store(real, Release);
            l.tables
                .set_qp((*real).qp_num, (*qp).ex.qp_base.qp_num, qp as usize);
            replay(&*qp, &to_replay(&*qp, false))?;
        }
    }
    Ok(endpoints())
}

/// The port number a QP was put on (1 if the program never said).
fn port_of(qp: &ShadowQp) -> u8 {
    lock(&qp.transitions)
        .iter()
        .find(|t| t.mask as c_uint & ffi::ibv_qp_attr_mask::IBV_QP_PORT.0 != 0)
        .map(|t| t.attr.port_num)
        .unwrap_or(1)
}

/// What a context's port is now, as its peers need it.
fn port_now(c: &ShadowCtx, port: u8) -> Port {
    let real_ctx = c.real.load(Acquire);
    let attr = port_attr(real_ctx, port).unwrap_or_else(crate::shadow::zeroed);
    let mut gid: ffi::ibv_gid = crate::shadow::zeroed();
    let index = c.gid_index.load(Relaxed).max(0);
    if let Some(q) = real().ibv_query_gid {
        // SAFETY: a live real context and a GID to fill.
        unsafe { q(real_ctx, port, index, &mut gid) };
    }
    Port {
        device: c.device.clone(),
        lid: attr.lid,
        // SAFETY: every bit pattern of the union is a valid `raw` array.
        gid: unsafe { gid.raw },
        link_layer: attr.link_layer,
    }
}

/// Every QP's new endpoint: its identity (the context's address id and its virtual number),
/// where it is now and its real number. The first endpoint of each address carries the keys
/// of the memory registered there.
fn endpoints() -> Vec<Endpoint> {
    let l = layer();
    let mut out: Vec<Endpoint> = Vec::new();
    // SAFETY: live shadows (the gate is closed).
    let (qps, mrs) = unsafe { (all::<ShadowQp>(&l.qps), all::<ShadowMr>(&l.mrs)) };
    for qp in qps {
        // SAFETY: a shadow QP's context is a shadow context.
        let c = unsafe { &*ShadowCtx::of(qp.ex.qp_base.context) };
        let ident = c.ident.load(Relaxed);
        let first = !out.iter().any(|e| e.id.0 == ident);
        let rkeys = if first {
            mrs.iter()
                // SAFETY: a shadow MR's PD is a shadow PD.
                .filter(|m| unsafe { (*m.mr.pd).context } == qp.ex.qp_base.context)
                // SAFETY: its real MR was just registered.
                .map(|m| (m.mr.rkey, unsafe { (*m.real.load(Acquire)).rkey }))
                .collect()
        } else {
            Vec::new()
        };
        out.push(Endpoint {
            id: (ident, qp.ex.qp_base.qp_num),
            port: port_now(c, port_of(qp)),
            qpn: qp.real_qpn.load(Acquire),
            rkeys,
            ..Endpoint::default()
        });
    }
    out
}

/// Step 4: the peers' new numbers learnt, address handles made again, the QPs connected, the
/// kept receives posted again, the CQs the program armed armed again.
pub(super) fn reconnect(eps: &[Endpoint]) -> Result<(), String> {
    let l = layer();
    crate::lookup::learn(eps);
    let r = real();
    let create_ah = r.ibv_create_ah.ok_or("libibverbs lacks ibv_create_ah")?;
    let notify = |cq: *mut ffi::ibv_cq| {
        // SAFETY: a live real CQ.
        unsafe { (*(*cq).context).ops.req_notify_cq.expect("req_notify_cq")(cq, 0) }
    };
    // SAFETY: live shadows (the gate is closed) with their new real objects.
    unsafe {
        for ah in each::<ShadowAh>(&l.ahs) {
            let mut a = (*ah).attr;
            to_real_av(&mut a);
            let real = made(
                create_ah(real_pd((*ah).ah.pd), &mut a),
                "ibv_create_ah",
                "an address handle",
            )?;
            (*ah).ah.handle = (*real).handle;
            (*ah).real.store(real, Release);
        }
        for qp in all::<ShadowQp>(&l.qps) {
            replay(qp, &to_replay(qp, true))?;
            if qp.ex.qp_base.srq.is_null() && qp.ex.qp_base.state != ffi::ibv_qp_state::IBV_QPS_ERR
            {
                let real = qp.real.load(Acquire);
                let post = (*(*real).context).ops.post_recv.expect("post_recv");
                post_again(
                    &lock(&qp.receives),
                    &format!("QP {:#x}", qp.ex.qp_base.qp_num),
                    |w| {
                        let mut bad = null_mut();
                        post(real, w, &mut bad)
                    },
                )?;
            }
        }
        for cq in all::<ShadowCq>(&l.cqs) {
            if cq.armed.load(Relaxed) && notify(cq.real.load(Acquire)) != 0 {
                return Err(failed("ibv_req_notify_cq", "a completion queue"));
            }
        }
    }
    Ok(())
}

/// After the reconnect: a CQ the program armed before the release and whose completions the
/// layer holds would wait for an event the new CQ never raises (its completions are not on
/// it); the layer owes the program that event.
pub(super) fn owe_events() {
    let l = layer();
    // SAFETY: live shadows.
    unsafe {
        for cq in all::<ShadowCq>(&l.cqs) {
            if cq.cq.channel.is_null() || !cq.armed.load(Relaxed) || !cq.has_held.load(Relaxed) {
                continue;
            }
            let ch = &*(cq.cq.channel as *const ShadowChannel);
            cq.credit.fetch_add(1, Relaxed);
            lock(&ch.owed).push_back(cq as *const ShadowCq as usize);
            ch.proxy.raise();
        }
    }
}
