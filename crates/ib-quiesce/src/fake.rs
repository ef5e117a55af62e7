//! A recording, in-process fabric for tests without an RDMA device: several [`FakeVerbs`] ends
//! share a [`Fabric`] that delivers sends and RDMA writes between their QPs in order, one
//! operation per poll, copying real bytes between the processes' buffers (all in this process).
//! Every call is recorded, so tests can assert what a channel did and in which order.
//!
//! Object handles, keys and QP numbers are never reused: after a rebuild they differ, as on a
//! real device. Unknown or stale keys and handles are errors, as a device would report them.
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::verbs::{
    link_layer_name, Completion, Handle, MrKeys, Opcode, Port, QpCaps, RecvWr, Remote, SendOp,
    SendWr, VResult, Verbs, VerbsError, LINK_ETHERNET,
};

#[derive(Debug)]
struct Mr {
    end: usize,
    addr: u64,
    len: usize,
}

#[derive(Debug)]
struct Qp {
    end: usize,
    send_cq: Handle,
    recv_cq: Handle,
    qpn: u32,
    peer_qpn: Option<u32>,
    rq: VecDeque<RecvWr>,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    open: HashMap<usize, bool>,
    /// Devices an end sees, (name, link layer); unset: one RoCE device `fake0`.
    devices: HashMap<usize, Vec<(String, u8)>>,
    pds: HashMap<Handle, usize>,
    mrs: HashMap<Handle, Mr>,
    lkeys: HashMap<u32, Handle>,
    rkeys: HashMap<u32, Handle>,
    cqs: HashMap<Handle, (usize, VecDeque<Completion>)>,
    qps: HashMap<Handle, Qp>,
    /// Posted sends not yet delivered: (sender QP handle, request).
    wire: VecDeque<(Handle, SendWr)>,
    log: Vec<String>,
    /// The next call of this name fails (teardown error tests).
    fail: Option<&'static str>,
}

impl State {
    fn failing(&mut self, op: &'static str) -> VResult<()> {
        if self.fail == Some(op) {
            self.fail = None;
            return Err(err(op, "injected failure"));
        }
        Ok(())
    }

    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next * 0x101 + 0x1000
    }

    fn qp_by_qpn(&self, qpn: u32) -> Option<Handle> {
        self.qps.iter().find(|(_, q)| q.qpn == qpn).map(|(h, _)| *h)
    }

    fn check_local(&self, end: usize, lkey: u32, addr: u64, len: u32) -> bool {
        self.lkeys
            .get(&lkey)
            .and_then(|h| self.mrs.get(h))
            .is_some_and(|m| {
                m.end == end && addr >= m.addr && addr + len as u64 <= m.addr + m.len as u64
            })
    }

    /// Delivers the oldest operation on the wire.
    fn deliver_one(&mut self) {
        let Some((from, wr)) = self.wire.pop_front() else {
            return;
        };
        let Some(src) = self.qps.get(&from) else {
            return; // the QP went away: nothing reaches the peer
        };
        let (src_end, send_cq, src_qpn) = (src.end, src.send_cq, src.qpn);
        let dest = src.peer_qpn.and_then(|q| self.qp_by_qpn(q));
        let mut status = 0;
        let total: u32 = wr.sges.iter().map(|s| s.len).sum();
        if !wr
            .sges
            .iter()
            .all(|s| self.check_local(src_end, s.lkey, s.addr, s.len))
        {
            status = 4; // local protection error
        }
        let Some(dest) = dest else {
            self.complete(send_cq, wr.wr_id, Opcode::Send, 5, 0, src_qpn);
            return;
        };
        if status == 0 {
            match wr.op {
                SendOp::Write { remote_addr, rkey } => {
                    let dest_end = self.qps[&dest].end;
                    let ok = self
                        .rkeys
                        .get(&rkey)
                        .and_then(|h| self.mrs.get(h))
                        .is_some_and(|m| {
                            m.end == dest_end
                                && remote_addr >= m.addr
                                && remote_addr + total as u64 <= m.addr + m.len as u64
                        });
                    if ok {
                        let mut at = remote_addr;
                        for s in &wr.sges {
                            copy(s.addr, at, s.len);
                            at += s.len as u64;
                        }
                    } else {
                        status = 10; // remote access error
                    }
                }
                SendOp::Send => {
                    let q = self.qps.get_mut(&dest).expect("dest exists");
                    let (rcq, dqpn) = (q.recv_cq, q.qpn);
                    match q.rq.pop_front() {
                        None => status = 13, // receiver not ready
                        Some(r) => {
                            let mut left = total;
                            let mut src = wr
                                .sges
                                .iter()
                                .flat_map(|s| (0..s.len).map(move |k| s.addr + k as u64));
                            for d in &r.sges {
                                for k in 0..d.len.min(left) {
                                    let a = src.next().expect("counted");
                                    copy(a, d.addr + k as u64, 1);
                                }
                                left -= d.len.min(left);
                            }
                            self.complete(rcq, r.wr_id, Opcode::Recv, 0, total, dqpn);
                        }
                    }
                }
            }
        }
        if wr.signaled || status != 0 {
            self.complete(send_cq, wr.wr_id, Opcode::Send, status, 0, src_qpn);
        }
    }

    fn complete(
        &mut self,
        cq: Handle,
        wr_id: u64,
        opcode: Opcode,
        status: u32,
        len: u32,
        qpn: u32,
    ) {
        if let Some((_, q)) = self.cqs.get_mut(&cq) {
            q.push_back(Completion {
                wr_id,
                opcode,
                status,
                byte_len: len,
                qpn,
            });
        }
    }
}

fn copy(from: u64, to: u64, len: u32) {
    // SAFETY: both ranges were checked against memory regions registered by the test, which
    // owns the buffers and keeps them alive while the fabric runs; they are in this process.
    unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len as usize) }
}

/// What a test runs after an end's poll, with what the poll returned (see
/// [`Fabric::after_poll`]).
pub type PollHook = Box<dyn FnMut(&[Completion]) + Send>;

#[derive(Default)]
struct Hooks(HashMap<usize, PollHook>);

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// The shared medium.
#[derive(Debug, Clone, Default)]
pub struct Fabric {
    s: Arc<Mutex<State>>,
    hooks: Arc<Mutex<Hooks>>,
}

impl Fabric {
    /// A new, empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// A new end (one process's device) on this fabric.
    pub fn end(&self, id: usize) -> FakeVerbs {
        FakeVerbs {
            f: self.clone(),
            end: id,
        }
    }

    /// Every call so far, "end <id>: <call>", in order.
    pub fn log(&self) -> Vec<String> {
        self.s.lock().expect("fabric").log.clone()
    }

    /// Makes the next call of `op` ("ibv_dereg_mr", "ibv_destroy_qp", ...) fail.
    pub fn fail_next(&self, op: &'static str) {
        self.s.lock().expect("fabric").fail = Some(op);
    }

    /// Replaces the devices end `id` sees (a restart on a node whose HCA is named otherwise):
    /// (name, link layer) in listing order.
    pub fn set_devices(&self, id: usize, devices: &[(&str, u8)]) {
        self.s.lock().expect("fabric").devices.insert(
            id,
            devices.iter().map(|(n, l)| (n.to_string(), *l)).collect(),
        );
    }

    /// Runs `hook` after every poll of end `id`, outside the fabric's lock, so that the test
    /// can let other ends act between that poll and the caller's next step (a race made
    /// deterministic).
    pub fn after_poll(&self, id: usize, hook: PollHook) {
        self.hooks.lock().expect("hooks").0.insert(id, hook);
    }

    /// Operations posted and not yet delivered.
    pub fn in_flight(&self) -> usize {
        self.s.lock().expect("fabric").wire.len()
    }

    /// Objects of end `id` still allocated (PDs, MRs, CQs, QPs).
    pub fn objects_of(&self, id: usize) -> usize {
        let s = self.s.lock().expect("fabric");
        s.pds.values().filter(|e| **e == id).count()
            + s.mrs.values().filter(|m| m.end == id).count()
            + s.cqs.values().filter(|c| c.0 == id).count()
            + s.qps.values().filter(|q| q.end == id).count()
    }
}

/// One end of a [`Fabric`].
#[derive(Debug, Clone)]
pub struct FakeVerbs {
    f: Fabric,
    end: usize,
}

fn err(op: &'static str, message: &str) -> VerbsError {
    VerbsError {
        op,
        message: message.to_string(),
    }
}

impl FakeVerbs {
    fn with<T>(&self, call: String, f: impl FnOnce(&mut State) -> T) -> T {
        let mut s = self.f.s.lock().expect("fabric");
        s.log.push(format!("end {}: {call}", self.end));
        f(&mut s)
    }

    fn open_where(&mut self, call: String, usable: impl Fn(&str, u8) -> bool) -> VResult<Port> {
        let end = self.end;
        self.with(call, |s| {
            let devices = s
                .devices
                .get(&end)
                .cloned()
                .unwrap_or_else(|| vec![("fake0".to_string(), LINK_ETHERNET)]);
            let Some((name, link_layer)) = devices.iter().find(|(n, l)| usable(n, *l)) else {
                let names: Vec<&String> = devices.iter().map(|d| &d.0).collect();
                return Err(err(
                    "ibv_open_device",
                    &format!("no such device (found: {names:?})"),
                ));
            };
            s.open.insert(end, true);
            Ok(Port {
                device: name.clone(),
                lid: 0,
                gid: [end as u8; 16],
                link_layer: *link_layer,
            })
        })
    }
}

impl Verbs for FakeVerbs {
    fn open(&mut self, device: &str) -> VResult<Port> {
        self.open_where(format!("open {device:?}"), |name, _| {
            device.is_empty() || name == device
        })
    }

    fn open_matching(&mut self, like: &Port) -> VResult<Port> {
        let want = like.link_layer;
        self.open_where(
            format!("open_matching {}", link_layer_name(want)),
            |_, l| l == want,
        )
    }

    fn mark_written(&mut self, regions: &[(u64, usize)]) {
        // The fabric's memory is not this process's: noted only.
        self.with(format!("mark_written {}", regions.len()), |_| ());
    }

    fn close(&mut self) -> VResult<()> {
        let end = self.end;
        let left = self.f.objects_of(end);
        self.with("close".into(), |s| {
            if left > 0 {
                return Err(err(
                    "ibv_close_device",
                    &format!("{left} objects still allocated"),
                ));
            }
            s.open.insert(end, false);
            Ok(())
        })
    }

    fn alloc_pd(&mut self) -> VResult<Handle> {
        let end = self.end;
        self.with("alloc_pd".into(), |s| {
            if s.open.get(&end) != Some(&true) {
                return Err(err("ibv_alloc_pd", "device not open"));
            }
            let h = s.id();
            s.pds.insert(h, end);
            Ok(h)
        })
    }

    fn dealloc_pd(&mut self, pd: Handle) -> VResult<()> {
        self.with(format!("dealloc_pd {pd:#x}"), |s| {
            s.failing("ibv_dealloc_pd")?;
            s.pds
                .remove(&pd)
                .map(|_| ())
                .ok_or(err("ibv_dealloc_pd", "no such PD"))
        })
    }

    fn reg_mr(&mut self, pd: Handle, addr: u64, len: usize, _access: u32) -> VResult<MrKeys> {
        let end = self.end;
        self.with(format!("reg_mr {addr:#x}+{len}"), |s| {
            if !s.pds.contains_key(&pd) {
                return Err(err("ibv_reg_mr", "no such PD"));
            }
            let h = s.id();
            let (lkey, rkey) = (h as u32, (h as u32) ^ 0x5a5a_0000);
            s.mrs.insert(h, Mr { end, addr, len });
            s.lkeys.insert(lkey, h);
            s.rkeys.insert(rkey, h);
            Ok(MrKeys {
                handle: h,
                lkey,
                rkey,
            })
        })
    }

    fn dereg_mr(&mut self, mr: Handle) -> VResult<()> {
        self.with(format!("dereg_mr {mr:#x}"), |s| {
            s.failing("ibv_dereg_mr")?;
            s.mrs.remove(&mr).ok_or(err("ibv_dereg_mr", "no such MR"))?;
            s.lkeys.retain(|_, h| *h != mr);
            s.rkeys.retain(|_, h| *h != mr);
            Ok(())
        })
    }

    fn create_cq(&mut self, cqe: u32) -> VResult<Handle> {
        let end = self.end;
        self.with(format!("create_cq {cqe}"), |s| {
            let h = s.id();
            s.cqs.insert(h, (end, VecDeque::new()));
            Ok(h)
        })
    }

    fn destroy_cq(&mut self, cq: Handle) -> VResult<()> {
        self.with(format!("destroy_cq {cq:#x}"), |s| {
            if s.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq) {
                return Err(err("ibv_destroy_cq", "a QP still uses it"));
            }
            s.cqs
                .remove(&cq)
                .map(|_| ())
                .ok_or(err("ibv_destroy_cq", "no such CQ"))
        })
    }

    fn create_qp(
        &mut self,
        pd: Handle,
        send_cq: Handle,
        recv_cq: Handle,
        _caps: QpCaps,
    ) -> VResult<(Handle, u32)> {
        let end = self.end;
        self.with("create_qp".into(), |s| {
            if !s.pds.contains_key(&pd)
                || !s.cqs.contains_key(&send_cq)
                || !s.cqs.contains_key(&recv_cq)
            {
                return Err(err("ibv_create_qp", "bad PD or CQ"));
            }
            let h = s.id();
            let qpn = (h as u32) & 0x00ff_ffff;
            s.qps.insert(
                h,
                Qp {
                    end,
                    send_cq,
                    recv_cq,
                    qpn,
                    peer_qpn: None,
                    rq: VecDeque::new(),
                },
            );
            Ok((h, qpn))
        })
    }

    fn connect(&mut self, qp: Handle, _psn: u32, remote: &Remote) -> VResult<()> {
        self.with(format!("connect {qp:#x} -> qpn {:#x}", remote.qpn), |s| {
            let q = s
                .qps
                .get_mut(&qp)
                .ok_or(err("ibv_modify_qp(INIT)", "no such QP"))?;
            q.peer_qpn = Some(remote.qpn);
            Ok(())
        })
    }

    fn destroy_qp(&mut self, qp: Handle) -> VResult<()> {
        self.with(format!("destroy_qp {qp:#x}"), |s| {
            s.failing("ibv_destroy_qp")?;
            s.qps
                .remove(&qp)
                .map(|_| ())
                .ok_or(err("ibv_destroy_qp", "no such QP"))
        })
    }

    fn post_send(&mut self, qp: Handle, wr: &SendWr) -> VResult<()> {
        self.with(format!("post_send {qp:#x} wr {:#x}", wr.wr_id), |s| {
            if !s.qps.contains_key(&qp) {
                return Err(err("ibv_post_send", "no such QP"));
            }
            s.wire.push_back((qp, wr.clone()));
            Ok(())
        })
    }

    fn post_recv(&mut self, qp: Handle, wr: &RecvWr) -> VResult<()> {
        let end = self.end;
        self.with(format!("post_recv {qp:#x} wr {:#x}", wr.wr_id), |s| {
            if !wr
                .sges
                .iter()
                .all(|g| s.check_local(end, g.lkey, g.addr, g.len))
            {
                return Err(err("ibv_post_recv", "bad lkey"));
            }
            let q = s
                .qps
                .get_mut(&qp)
                .ok_or(err("ibv_post_recv", "no such QP"))?;
            q.rq.push_back(wr.clone());
            Ok(())
        })
    }

    fn poll_cq(&mut self, cq: Handle, max: usize) -> VResult<Vec<Completion>> {
        let mut s = self.f.s.lock().expect("fabric");
        // The wire moves one operation per poll, so a quiesce has to keep polling.
        s.deliver_one();
        let (_, q) = s.cqs.get_mut(&cq).ok_or(err("ibv_poll_cq", "no such CQ"))?;
        let n = max.min(q.len());
        let got: Vec<Completion> = q.drain(..n).collect();
        drop(s);
        // Taken out while it runs: a hook may wait for other ends, which poll too.
        let hook = self.f.hooks.lock().expect("hooks").0.remove(&self.end);
        if let Some(mut hook) = hook {
            hook(&got);
            let mut hooks = self.f.hooks.lock().expect("hooks");
            hooks.0.entry(self.end).or_insert(hook);
        }
        Ok(got)
    }
}
