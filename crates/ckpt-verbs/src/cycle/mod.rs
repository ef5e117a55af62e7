//! The layer's cycle around a snapshot, driven by the node agent through ib-quiesce's control
//! channel ([`ib_quiesce::control`]: the same protocol, socket, agent code and coordinator
//! relay as ib-quiesce's own channels).
//!
//! 1. **Drain** (the agent's `quiesce`): the gate closes, so the program's calls wait. Every
//!    connected RC QP gets a flush marker, a zero-length signalled RDMA write on the program's
//!    own QP (it needs no memory at the peer and consumes none of its receives): RC completes
//!    in order, so its completion means every send posted before it was acknowledged by the
//!    peer. Then the CQs are polled until every marker and every signalled send of every QP
//!    (UD too) completed. The program's completions are held for its next polls. The answer is
//!    `drained`: the objects stay, because a peer may still be sending to us.
//! 2. **Release** (the agent's `release`, once every node of the job drained: nothing is in
//!    flight in either direction any more): a last sweep of the CQs, then every real object is
//!    released and the device closed; what the program holds (shadows, virtual numbers, proxy
//!    descriptors, held completions, posted receives) stays.
//! 3. **Rebuild** (`rebuild.rs`): the device opened again, every object created again, each QP
//!    brought back through the state changes the program made, up to the first that needs the
//!    peer; the new endpoints go to the agent, which relays them through the coordinator.
//! 4. **Reconnect**: the peers' new numbers and keys learnt, the remaining state changes
//!    replayed against them, address handles made again, the kept receives posted again; the
//!    gate opens.
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ib_quiesce::control::{Controlled, Holdings, Quiesce, Wants};
use ib_quiesce::{Endpoint, QuiesceReport};
use ibverbs_sys as ffi;

use crate::fastpath::{settle_completions, MARKER_WR};
use crate::gate::gate;
use crate::real::real;
use crate::shadow::{
    addr_of, layer, lock, Layer, ShadowAh, ShadowChannel, ShadowCq, ShadowCtx, ShadowMr, ShadowPd,
    ShadowQp, ShadowSrq,
};

mod peers;
mod rebuild;
use crate::shadow::set_stage;
pub use crate::shadow::{stage, Stage};

/// What the last release kept for the program (for the status after the rebuild).
static KEPT: Mutex<Option<QuiesceReport>> = Mutex::new(None);

fn need(want: Stage, op: &str) -> Result<(), String> {
    let now = stage();
    if now == want {
        Ok(())
    } else {
        Err(format!(
            "verbs layer: {op} is not possible while it is {now:?} (expected {want:?})"
        ))
    }
}

/// Shadows of one kind, live now.
///
/// # Safety
/// `set` holds addresses of live `T`s.
unsafe fn all<T>(set: &Mutex<std::collections::HashSet<usize>>) -> Vec<&'static T> {
    // SAFETY: as the caller promises.
    unsafe { each::<T>(set) }
        .into_iter()
        // SAFETY: shadows are freed only after leaving their set, which the program's
        // destroy calls do inside the gate, closed while the layer works.
        .map(|p| unsafe { &*p })
        .collect()
}

/// Shadows of one kind, live now, as pointers (for the fields a rebuild writes).
///
/// # Safety
/// `set` holds addresses of live `T`s.
unsafe fn each<T>(set: &Mutex<std::collections::HashSet<usize>>) -> Vec<*mut T> {
    Layer::live(set).into_iter().map(|p| p as *mut T).collect()
}

/// The control channel's target: the whole layer of this process.
#[derive(Debug)]
pub struct Control;

/// Starts the control thread once, under a ckpt agent (ib-quiesce's socket variable set).
pub fn start_control() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        ib_quiesce::control::start(&std::sync::Arc::new(Control));
    });
}

impl Controlled for Control {
    fn hello(&self) -> (u64, usize, usize) {
        let l = layer();
        // SAFETY: live contexts.
        let ident = unsafe { all::<ShadowCtx>(&l.contexts) }
            .first()
            .map(|c| c.ident.load(std::sync::atomic::Ordering::Relaxed))
            .unwrap_or(0);
        (ident, Layer::live(&l.qps).len(), Layer::live(&l.mrs).len())
    }

    fn quiesce(&self, timeout: Duration) -> Result<Quiesce, String> {
        need(Stage::Up, "quiesce")?;
        // The agent refuses these at initial sync; one taken into use since is refused here,
        // before anything is drained.
        let unsupported = layer().unsupported_in_use();
        if !unsupported.is_empty() {
            return Err(format!(
                "verbs layer: in use and not rebuilt after a snapshot: {}",
                unsupported.join("; ")
            ));
        }
        let g = gate();
        g.close(timeout)?;
        match g.run(false, move || drain(timeout)) {
            Ok(report) => {
                set_stage(Stage::Drained);
                Ok(Quiesce::Drained(report))
            }
            Err(e) => {
                g.open();
                Err(e)
            }
        }
    }

    fn release(&self) -> Result<QuiesceReport, String> {
        need(Stage::Drained, "release")?;
        let r = gate().run(false, release);
        set_stage(Stage::Down);
        if let Ok(kept) = &r {
            *lock(&KEPT) = Some(kept.clone());
        }
        r
    }

    fn resume(&self) -> Result<(), String> {
        match stage() {
            Stage::Up | Stage::Drained => {
                set_stage(Stage::Up);
                gate().open();
                Ok(())
            }
            s => Err(format!(
                "verbs layer: everything is released ({s:?}); it needs a rebuild, not a resume"
            )),
        }
    }

    fn is_down(&self) -> bool {
        matches!(stage(), Stage::Down | Stage::Rebuilt)
    }

    fn rebuild(&self) -> Result<(Vec<Endpoint>, Wants), String> {
        need(Stage::Down, "rebuild")?;
        let eps = gate().run(true, rebuild::rebuild)?;
        set_stage(Stage::Rebuilt);
        Ok((eps, peers::named()))
    }

    /// The command descriptors of the real contexts (none while released), and the
    /// features in use that no rebuild brings back.
    fn check(&self) -> Holdings {
        let l = layer();
        let contexts = lock(&l.contexts);
        let fds = contexts
            .iter()
            .map(|&c| {
                // SAFETY: a registered shadow context; it is freed only after it leaves the
                // set, whose lock is held.
                let ctx = unsafe { &*(c as *const ShadowCtx) };
                ctx.cmd_fd.load(std::sync::atomic::Ordering::Acquire)
            })
            .filter(|&fd| fd >= 0)
            .collect();
        drop(contexts);
        Holdings {
            fds: Some(fds),
            unsupported: l.unsupported_in_use(),
        }
    }

    fn reconnect(&self, endpoints: &[Endpoint]) -> Result<(), String> {
        need(Stage::Rebuilt, "reconnect")?;
        let eps = endpoints.to_vec();
        gate().run(false, move || rebuild::reconnect(&eps))?;
        // What the rebuild named (the shadows have not changed since: the gate is closed),
        // and whatever else came.
        let named = match peers::named() {
            Wants::Addresses(a) => a,
            _ => Vec::new(),
        };
        layer()
            .tables
            .reconnected(named.into_iter().chain(endpoints.iter().map(|e| e.id.0)));
        set_stage(Stage::Up);
        gate().open();
        rebuild::owe_events();
        crate::status::rebuilt(&lock(&KEPT).take().unwrap_or_default(), endpoints.len());
        Ok(())
    }
}

/// Notes the source address of a connection or address handle made on `ctx` (a shadow
/// context): the first one names this process's port to its peers ([`ShadowCtx::ident`]).
///
/// # Safety
/// `ctx` is a shadow context, live, inside the gate.
pub unsafe fn note_source(ctx: *mut ffi::ibv_context, ah: &ffi::ibv_ah_attr) {
    use std::sync::atomic::Ordering::Relaxed;
    // SAFETY: as the caller promises.
    let c = unsafe { &*ShadowCtx::of(ctx) };
    if c.ident.load(Relaxed) != 0 {
        return;
    }
    let index = if ah.is_global != 0 {
        i32::from(ah.grh.sgid_index)
    } else {
        -1
    };
    let port = if ah.port_num == 0 { 1 } else { ah.port_num };
    if let Some(me) = c.own_addr(port, index) {
        c.gid_index.store(index, Relaxed);
        let _ = c.ident.compare_exchange(0, me.id(), Relaxed, Relaxed);
    }
}

/// Points an address vector the program gave (its peer as it knows it) at where that peer is
/// now. Before any peer moved, nothing changes.
pub fn to_real_av(ah: &mut ffi::ibv_ah_attr) {
    if let Some(p) = layer().tables.peer(addr_of(ah).id()) {
        if ah.is_global != 0 {
            ah.grh.dgid.raw = p.gid;
        }
        ah.dlid = p.lid;
    }
}

/// Polls every CQ dry: the program's completions are held for it, the layer's markers
/// counted off. Returns how many the program got.
fn sweep() -> Result<usize, String> {
    let l = layer();
    let poll = |cq: *mut ffi::ibv_cq, n: i32, wc: *mut ffi::ibv_wc| {
        // SAFETY: a live real CQ; room for `n` completions.
        unsafe { (*(*cq).context).ops.poll_cq.expect("poll_cq")(cq, n, wc) }
    };
    let mut held = 0;
    // SAFETY: live shadow CQs (the gate is closed).
    for cq in unsafe { all::<ShadowCq>(&l.cqs) } {
        let real = cq.real.load(std::sync::atomic::Ordering::Acquire);
        let mut wcs: [ffi::ibv_wc; 16] = crate::shadow::zeroed();
        // Bounded: a CQ holds at most `cqe` completions and nothing new is posted.
        for _ in 0..=(cq.cqe.max(1) as usize) {
            let n = poll(real, wcs.len() as i32, wcs.as_mut_ptr());
            if n < 0 {
                return Err(format!("ibv_poll_cq failed ({n}) while draining"));
            }
            if n == 0 {
                break;
            }
            let kept = settle_completions(
                &l.tables,
                cq as *const ShadowCq as usize,
                &mut wcs[..n as usize],
            );
            let mut h = lock(&cq.held);
            h.extend(wcs[..kept].iter().copied());
            if !h.is_empty() {
                cq.has_held
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
            held += kept;
        }
    }
    Ok(held)
}

/// Posts a flush marker on an RC QP in RTS; false while its send queue is full.
fn post_marker(qp: &ShadowQp) -> Result<bool, String> {
    let mut wr: ffi::ibv_send_wr = crate::shadow::zeroed();
    wr.wr_id = MARKER_WR;
    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
    wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    let real = qp.real.load(std::sync::atomic::Ordering::Acquire);
    let mut bad = std::ptr::null_mut();
    // SAFETY: a live real QP; a zero-length request with no scatter list.
    let rc =
        unsafe { (*(*real).context).ops.post_send.expect("post_send")(real, &mut wr, &mut bad) };
    match rc {
        0 => {
            qp.markers
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(true)
        }
        libc::ENOMEM => Ok(false),
        e => Err(format!(
            "QP {:#x}: the flush marker could not be posted: {}",
            qp.ex.qp_base.qp_num,
            std::io::Error::from_raw_os_error(e)
        )),
    }
}

/// Whether a QP carries traffic that must drain: connected (RC in RTS) or sending (UD).
fn live_rc(qp: &ShadowQp) -> bool {
    qp.ex.qp_base.qp_type == ffi::ibv_qp_type::IBV_QPT_RC
        && qp.ex.qp_base.state == ffi::ibv_qp_state::IBV_QPS_RTS
}

/// What is still in flight on a QP, for messages.
fn in_flight(qp: &ShadowQp) -> Option<String> {
    use std::sync::atomic::Ordering::Relaxed;
    if matches!(
        qp.ex.qp_base.state,
        ffi::ibv_qp_state::IBV_QPS_ERR | ffi::ibv_qp_state::IBV_QPS_RESET
    ) {
        return None;
    }
    let (s, m) = (qp.signalled.load(Relaxed), qp.markers.load(Relaxed));
    (s > 0 || m > 0).then(|| {
        format!(
            "QP {:#x}: {s} signalled send(s), {m} marker(s)",
            qp.ex.qp_base.qp_num
        )
    })
}

/// Step 1 (see the module documentation). Runs with the gate closed.
fn drain(timeout: Duration) -> Result<QuiesceReport, String> {
    let begin = Instant::now();
    let l = layer();
    // SAFETY: live shadow QPs (the gate is closed).
    let qps = unsafe { all::<ShadowQp>(&l.qps) };
    let mut unmarked: Vec<&ShadowQp> = qps.iter().copied().filter(|q| live_rc(q)).collect();
    let flushed = unmarked.len();
    loop {
        let mut still = Vec::new();
        for qp in unmarked {
            if !post_marker(qp)? {
                still.push(qp);
            }
        }
        unmarked = still;
        sweep()?;
        let busy: Vec<String> = qps.iter().filter_map(|q| in_flight(q)).collect();
        if busy.is_empty() && unmarked.is_empty() {
            break;
        }
        if begin.elapsed() > timeout {
            return Err(format!(
                "verbs layer: sends still in flight after {timeout:?} ({}{})",
                busy.join("; "),
                if unmarked.is_empty() {
                    String::new()
                } else {
                    format!("; {} QP(s) with a full send queue", unmarked.len())
                }
            ));
        }
        std::thread::yield_now();
    }
    Ok(report(flushed))
}

/// What the layer keeps for the program now.
fn report(flushed_qps: usize) -> QuiesceReport {
    let l = layer();
    // SAFETY: live shadows (the gate is closed).
    let (qps, srqs, cqs) = unsafe {
        (
            all::<ShadowQp>(&l.qps),
            all::<ShadowSrq>(&l.srqs),
            all::<ShadowCq>(&l.cqs),
        )
    };
    QuiesceReport {
        flushed_qps,
        kept_receives: qps.iter().map(|q| lock(&q.receives).len()).sum::<usize>()
            + srqs.iter().map(|s| lock(&s.receives).len()).sum::<usize>(),
        held_completions: cqs.iter().map(|c| lock(&c.held).len()).sum(),
    }
}

/// Collects the first error of a series of release calls, going on past each.
#[derive(Default)]
struct FirstError(Option<String>);

impl FirstError {
    fn check(&mut self, call: &str, rc: i32) {
        if rc != 0 && self.0.is_none() {
            self.0 = Some(format!(
                "{call} failed while releasing: {}",
                std::io::Error::from_raw_os_error(rc.abs())
            ));
        }
    }
}

/// Acknowledges, before the release, every event the device's destroy calls wait for: the
/// completion events of `cqs` handed out, and the asynchronous events of a QP, CQ or SRQ the
/// program got and has not acknowledged (its own acknowledgements of them then stop at the
/// layer).
///
/// # Safety
/// As in [`release`]: live shadows with live real objects, the gate closed.
unsafe fn acknowledge_events(l: &Layer, r: &crate::real::Real, cqs: &[&ShadowCq]) {
    use std::sync::atomic::Ordering::{Acquire, Relaxed};
    // SAFETY: as the caller promises.
    unsafe {
        // The device's destroy waits for every event handed out to be acknowledged.
        for cq in cqs {
            let n = cq.unacked.swap(0, Relaxed);
            if n > 0 {
                r.ibv_ack_cq_events.expect("resolved")(cq.real.load(Acquire), n);
                cq.credit.fetch_add(n, Relaxed);
            }
        }
        // So does it for the asynchronous events of a QP, CQ or SRQ: those the program got
        // and has not acknowledged are acknowledged for it (its own acknowledgements of them
        // then stop at the layer).
        let ack_async = r.ibv_ack_async_event.expect("resolved");
        let mut acked_for_program = 0;
        let mut ack_for_program = |n: u32, mut e: ffi::ibv_async_event| {
            for _ in 0..n {
                ack_async(&mut e);
            }
            acked_for_program += n;
        };
        for cq in cqs {
            let mut e: ffi::ibv_async_event = crate::shadow::zeroed();
            e.event_type = ffi::IBV_EVENT_CQ_ERR;
            e.element.cq = cq.real.load(Acquire);
            ack_for_program(cq.async_events.acknowledge_for_program(), e);
        }
        for qp in all::<ShadowQp>(&l.qps) {
            let mut e: ffi::ibv_async_event = crate::shadow::zeroed();
            e.event_type = ffi::IBV_EVENT_QP_FATAL;
            e.element.qp = qp.real.load(Acquire);
            ack_for_program(qp.async_events.acknowledge_for_program(), e);
        }
        for srq in all::<ShadowSrq>(&l.srqs) {
            let mut e: ffi::ibv_async_event = crate::shadow::zeroed();
            e.event_type = ffi::IBV_EVENT_SRQ_ERR;
            e.element.srq = srq.real.load(Acquire);
            ack_for_program(srq.async_events.acknowledge_for_program(), e);
        }
        if acked_for_program > 0 {
            l.counters
                .async_events_acked_for_program
                .fetch_add(u64::from(acked_for_program), Relaxed);
        }
    }
}

/// Step 2 (see the module documentation). Runs with the gate closed; goes on past errors so
/// that nothing is left open, and names the first.
fn release() -> Result<QuiesceReport, String> {
    use std::sync::atomic::Ordering::{Acquire, Release};
    sweep()?;
    let l = layer();
    let r = real();
    let mut err = FirstError::default();
    // SAFETY: live shadows with live real objects (the gate is closed); each real object is
    // released once and its pointer cleared.
    unsafe {
        let cqs = all::<ShadowCq>(&l.cqs);
        acknowledge_events(l, r, &cqs);
        for ah in all::<ShadowAh>(&l.ahs) {
            err.check(
                "ibv_destroy_ah",
                r.ibv_destroy_ah.expect("resolved")(ah.real.swap(std::ptr::null_mut(), Release)),
            );
        }
        for qp in all::<ShadowQp>(&l.qps) {
            l.tables.drop_qp(qp.real_qpn.load(Acquire));
            err.check(
                "ibv_destroy_qp",
                r.ibv_destroy_qp.expect("resolved")(qp.real.swap(std::ptr::null_mut(), Release)),
            );
        }
        for srq in all::<ShadowSrq>(&l.srqs) {
            err.check(
                "ibv_destroy_srq",
                r.ibv_destroy_srq.expect("resolved")(srq.real.swap(std::ptr::null_mut(), Release)),
            );
        }
        for cq in cqs {
            err.check(
                "ibv_destroy_cq",
                r.ibv_destroy_cq.expect("resolved")(cq.real.swap(std::ptr::null_mut(), Release)),
            );
        }
        // No QP is left to DMA into them: what the adapter wrote is made visible to a
        // pre-copy before the snapshot (ib_quiesce::dirty).
        let written: Vec<(u64, usize)> = all::<ShadowMr>(&l.mrs)
            .iter()
            .filter(|m| m.reg.access & ib_quiesce::dirty::WRITE_ACCESS != 0)
            .map(|m| (m.reg.addr, m.reg.len))
            .collect();
        ib_quiesce::dirty::mark_written(&written);
        for mr in all::<ShadowMr>(&l.mrs) {
            err.check(
                "ibv_dereg_mr",
                r.ibv_dereg_mr.expect("resolved")(mr.real.swap(std::ptr::null_mut(), Release)),
            );
        }
        for pd in all::<ShadowPd>(&l.pds) {
            err.check(
                "ibv_dealloc_pd",
                r.ibv_dealloc_pd.expect("resolved")(pd.real.swap(std::ptr::null_mut(), Release)),
            );
        }
        for ch in all::<ShadowChannel>(&l.channels) {
            ch.proxy.detach();
            err.check(
                "ibv_destroy_comp_channel",
                r.ibv_destroy_comp_channel.expect("resolved")(
                    ch.real.swap(std::ptr::null_mut(), Release),
                ),
            );
        }
        for ctx in all::<ShadowCtx>(&l.contexts) {
            ctx.async_proxy.detach();
            ctx.cmd_fd.store(-1, Release);
            err.check(
                "ibv_close_device",
                r.ibv_close_device.expect("resolved")(ctx.real.swap(std::ptr::null_mut(), Release)),
            );
        }
    }
    if let Some(e) = err.0 {
        return Err(e);
    }
    if let Some(dev) = ib_quiesce::control::verbs_left() {
        return Err(format!(
            "{dev} is still mapped or open after the verbs layer released everything: another \
             library in this process uses the device without going through the layer"
        ));
    }
    Ok(report(0))
}

#[cfg(test)]
mod tests;
