//! ibq_bench: what ib-quiesce costs on a real verbs device (soft-RoCE `rxe0` in the test guest).
//!
//! One file (~1,100 lines) because it is one example binary, which `benches/ibq_rxe.sh` builds
//! and runs in the guest: its two measurements share the raw-verbs baseline, the set-up of both
//! channel ends and the report.
//!
//! Two measurements, in one process, both ends of every connection on the same device
//! (loopback):
//!
//! 1. Quiesce / rebuild / reconnect latency against the number of objects. For each n, two
//!    channels A and B, each with n memory regions (separate 4 KiB buffers; the channel adds its
//!    own control region), one CQ and n RC QPs, QP i of A connected to QP i of B, two receives
//!    posted on every QP (never consumed, so every quiesce keeps them and every reconnect
//!    reposts them). R times: quiesce A and B at once (two threads, as two processes would),
//!    rebuild both, reconnect both (all endpoints of both sides, keyed by [`Endpoint::id`]),
//!    then check, untimed, that one RDMA write per QP lands in the peer's MR under the same
//!    virtual keys. Each step is timed in its own thread; a repetition counts the slower side.
//!    Each repetition also runs the same objects through raw [`Rdma`] calls, before the channel
//!    cycle in even repetitions and after it in odd ones: create (open, PD, n MRs, CQ, n QPs;
//!    the baseline of rebuild), connect + post the receives (of reconnect), one write per QP
//!    (untimed), release (of quiesce, which adds the drain and the flush-marker exchange).
//! 2. Post/poll overhead: K signalled 64-byte RDMA writes on one connected QP pair, each posted
//!    and then polled to completion before the next (latency-bound), through raw [`Rdma`]
//!    calls (its own device contexts, PDs, MRs, CQs and QPs) and through a [`Channel`] pair.
//!    Three repetitions; within each, the two paths alternate in 20 blocks of K/20 writes
//!    (which goes first alternates too), so that both see the same drift of the machine.
//!
//! With `--noop K` it measures only the channel layer's own CPU cost instead: the loop of 2. on
//! a backend that does nothing, directly and through a channel (no device needed; run it on the
//! host for native numbers).
//!
//! Usage: `ibq_bench [--device rxe0] [--sizes 1,4,16,64,256] [--ops 20000] [--reps 3]`,
//! `ibq_bench --noop 1000000 [--reps 3]`
//!
//! Every result is a line starting with `BENCH` (per repetition: `REP`); markdown tables come
//! last. The exit status is 1 when any part failed (the parts that worked are still reported).
use std::collections::HashMap;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use ib_quiesce::channel::QpId;
use ib_quiesce::rdma::Rdma;
use ib_quiesce::verbs::{Completion, Handle, MrKeys, QpCaps, RecvWr, Remote, SendOp, SendWr, Sge};
use ib_quiesce::verbs::{Port, Verbs};
use ib_quiesce::{Channel, Endpoint, QuiesceReport};

type BResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Local write, remote write, remote read (the IBV_ACCESS_* values).
const ACCESS: u32 = 0x1 | 0x2 | 0x4;
const CAPS: QpCaps = QpCaps {
    max_send_wr: 16,
    max_recv_wr: 16,
    max_sge: 1,
};
const BUF: usize = 4096;
/// Receives posted (and kept) per QP in the sweep.
const RECVS_PER_QP: usize = 2;
/// Bytes per RDMA write in the overhead test.
const MSG: u32 = 64;
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on polling for one completion.
const POLL_TIMEOUT: Duration = Duration::from_secs(30);

struct Opts {
    device: String,
    sizes: Vec<usize>,
    ops: usize,
    reps: usize,
    /// `--noop K`: only the layer-cost comparison on a no-op backend (no device), K writes.
    noop: Option<usize>,
}

fn parse_opts() -> BResult<Opts> {
    let mut o = Opts {
        device: "rxe0".into(),
        sizes: vec![1, 4, 16, 64, 256],
        ops: 20_000,
        reps: 3,
        noop: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--device" => o.device = val()?,
            "--sizes" => {
                o.sizes = val()?
                    .split(',')
                    .map(|s| s.trim().parse())
                    .collect::<Result<_, _>>()?
            }
            "--ops" => o.ops = val()?.parse()?,
            "--reps" => o.reps = val()?.parse()?,
            "--noop" => o.noop = Some(val()?.parse()?),
            "-h" | "--help" => {
                println!(
                    "ibq_bench [--device rxe0] [--sizes 1,4,16,64,256] [--ops 20000] [--reps 3]\n\
                     ibq_bench --noop K [--reps 3]   (the channel layer's own CPU cost, no device)"
                );
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    Ok(o)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Median and minimum.
fn med_min(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let med = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    (med, s[0])
}

// ---------------------------------------------------------------------------------------------
// 1. Quiesce / rebuild / reconnect sweep.

/// One channel with n MRs, one CQ and n QPs.
struct Side {
    ch: Channel<Rdma>,
    bufs: Vec<Box<[u8]>>,
    keys: Vec<u32>,
    cq: u32,
    qps: Vec<u32>,
}

impl Side {
    fn new(device: &str, n: usize) -> BResult<Side> {
        let mut ch = Channel::open(Rdma::new(), device)?;
        let bufs: Vec<Box<[u8]>> = (0..n).map(|_| vec![0u8; BUF].into_boxed_slice()).collect();
        let mut keys = Vec::with_capacity(n);
        for b in &bufs {
            keys.push(ch.reg_mr(b.as_ptr() as u64, b.len(), ACCESS)?);
        }
        let cq = ch.create_cq(2 * n as u32 + 16)?;
        let mut qps = Vec::with_capacity(n);
        for _ in 0..n {
            qps.push(ch.create_qp(cq, cq, CAPS)?);
        }
        Ok(Side {
            ch,
            bufs,
            keys,
            cq,
            qps,
        })
    }

    fn addr(&self, i: usize, off: usize) -> u64 {
        self.bufs[i].as_ptr() as u64 + off as u64
    }

    /// Receives into MR i of QP i, at offsets 1024, 2048, ...; never consumed.
    fn post_receives(&mut self) -> BResult<()> {
        for i in 0..self.qps.len() {
            for r in 0..RECVS_PER_QP {
                let wr = RecvWr {
                    wr_id: (i * RECVS_PER_QP + r) as u64,
                    sges: vec![Sge {
                        addr: self.addr(i, 1024 * (r + 1)),
                        len: 64,
                        lkey: self.keys[i],
                    }],
                };
                self.ch.post_recv(self.qps[i], &wr)?;
            }
        }
        Ok(())
    }
}

/// Polls `cq` of `ch` until `want` completions came, all successful.
fn poll_n<V: Verbs>(ch: &mut Channel<V>, cq: u32, want: usize) -> BResult<Vec<Completion>> {
    let begin = Instant::now();
    let mut got = Vec::with_capacity(want);
    while got.len() < want {
        if begin.elapsed() > POLL_TIMEOUT {
            return Err(format!(
                "{} of {want} completions within {POLL_TIMEOUT:?}",
                got.len()
            )
            .into());
        }
        for c in ch.poll_cq(cq, 64)? {
            if c.status != 0 {
                return Err(format!("completion {c:?} failed").into());
            }
            got.push(c);
        }
    }
    Ok(got)
}

/// One RDMA write per QP from A's MR i into B's MR i (virtual keys); checks that it landed.
fn check_writes(a: &mut Side, b: &Side, tag: u64) -> BResult<()> {
    let n = a.qps.len();
    for i in 0..n {
        let v = tag.wrapping_mul(0x1_0000) + i as u64;
        a.bufs[i][..8].copy_from_slice(&v.to_le_bytes());
        let wr = SendWr {
            wr_id: i as u64,
            op: SendOp::Write {
                remote_addr: b.addr(i, 0),
                rkey: b.keys[i],
            },
            sges: vec![Sge {
                addr: a.addr(i, 0),
                len: 8,
                lkey: a.keys[i],
            }],
            signaled: true,
        };
        a.ch.post_send(a.qps[i], &wr)?;
    }
    poll_n(&mut a.ch, a.cq, n)?;
    for i in 0..n {
        let v = tag.wrapping_mul(0x1_0000) + i as u64;
        let got = u64::from_le_bytes(b.bufs[i][..8].try_into().expect("8 bytes"));
        if got != v {
            return Err(format!("write on QP {i}: B's MR holds {got:#x}, expected {v:#x}").into());
        }
    }
    Ok(())
}

/// Runs `f` on both sides at once (side 0 is A, 1 is B), each in its own thread, started
/// together; returns each side's time and result.
fn both<S: Send, T: Send>(
    a: &mut S,
    b: &mut S,
    f: impl Fn(usize, &mut S) -> BResult<T> + Sync,
) -> BResult<[(Duration, T); 2]> {
    let go = Barrier::new(2);
    let timed = |i: usize, s: &mut S| {
        go.wait();
        let t = Instant::now();
        let r = f(i, s);
        (t.elapsed(), r)
    };
    let (ra, rb) = std::thread::scope(|sc| {
        let ta = sc.spawn(|| timed(0, a));
        let rb = timed(1, b);
        (ta.join().expect("thread A"), rb)
    });
    Ok([(ra.0, ra.1?), (rb.0, rb.1?)])
}

/// The same objects as a [`Side`] through raw verbs (no channel, no control region): the
/// baseline for rebuild (create), reconnect (connect + post the receives) and quiesce (release).
struct RawSide {
    v: Rdma,
    bufs: Vec<Box<[u8]>>,
    port: Port,
    pd: Handle,
    mrs: Vec<MrKeys>,
    cq: Handle,
    qps: Vec<(Handle, u32)>,
}

/// Initial PSN of raw QP i (both sides use the same).
fn raw_psn(i: usize) -> u32 {
    (i as u32).wrapping_mul(7919) & 0x00ff_ffff
}

impl RawSide {
    fn new(n: usize) -> RawSide {
        RawSide {
            v: Rdma::new(),
            bufs: (0..n).map(|_| vec![0u8; BUF].into_boxed_slice()).collect(),
            port: Port::default(),
            pd: 0,
            mrs: Vec::new(),
            cq: 0,
            qps: Vec::new(),
        }
    }

    /// Opens the device and creates the PD, n MRs, the CQ and n QPs; returns what the peer
    /// needs to connect QP i.
    fn create(&mut self, device: &str) -> BResult<Vec<Remote>> {
        let n = self.bufs.len();
        self.port = self.v.open(device)?;
        self.pd = self.v.alloc_pd()?;
        self.mrs.clear();
        for b in &self.bufs {
            let k = self.v.reg_mr(self.pd, b.as_ptr() as u64, b.len(), ACCESS)?;
            self.mrs.push(k);
        }
        self.cq = self.v.create_cq(2 * n as u32 + 16)?;
        self.qps.clear();
        for _ in 0..n {
            let q = self.v.create_qp(self.pd, self.cq, self.cq, CAPS)?;
            self.qps.push(q);
        }
        Ok(self
            .qps
            .iter()
            .enumerate()
            .map(|(i, q)| Remote {
                port: self.port.clone(),
                qpn: q.1,
                psn: raw_psn(i),
            })
            .collect())
    }

    /// Connects QP i to `peer[i]` and posts the receives a [`Side`] keeps.
    fn connect(&mut self, peer: &[Remote]) -> BResult<()> {
        for (i, q) in self.qps.iter().enumerate() {
            self.v.connect(q.0, raw_psn(i), &peer[i])?;
        }
        for (i, q) in self.qps.iter().enumerate() {
            for r in 0..RECVS_PER_QP {
                let wr = RecvWr {
                    wr_id: (i * RECVS_PER_QP + r) as u64,
                    sges: vec![Sge {
                        addr: self.bufs[i].as_ptr() as u64 + 1024 * (r as u64 + 1),
                        len: 64,
                        lkey: self.mrs[i].lkey,
                    }],
                };
                self.v.post_recv(q.0, &wr)?;
            }
        }
        Ok(())
    }

    /// One RDMA write per QP into the peer's MR i, polled to completion (untimed; gives the
    /// QPs the traffic a [`Side`]'s have had before its quiesce).
    fn write_all(&mut self, peer: &RawSide) -> BResult<()> {
        let n = self.qps.len();
        for i in 0..n {
            let wr = SendWr {
                wr_id: i as u64,
                op: SendOp::Write {
                    remote_addr: peer.bufs[i].as_ptr() as u64,
                    rkey: peer.mrs[i].rkey,
                },
                sges: vec![Sge {
                    addr: self.bufs[i].as_ptr() as u64,
                    len: 8,
                    lkey: self.mrs[i].lkey,
                }],
                signaled: true,
            };
            self.v.post_send(self.qps[i].0, &wr)?;
        }
        let begin = Instant::now();
        let mut got = 0;
        while got < n {
            if begin.elapsed() > POLL_TIMEOUT {
                return Err(format!("raw: {got} of {n} completions").into());
            }
            got += check_one(&self.v.poll_cq(self.cq, 64)?)?;
        }
        Ok(())
    }

    /// Destroys the QPs and the CQ, deregisters the MRs, frees the PD, closes the device.
    fn release(&mut self) -> BResult<()> {
        for q in self.qps.drain(..) {
            self.v.destroy_qp(q.0)?;
        }
        self.v.destroy_cq(self.cq)?;
        for m in self.mrs.drain(..) {
            self.v.dereg_mr(m.handle)?;
        }
        self.v.dealloc_pd(self.pd)?;
        self.v.close()?;
        Ok(())
    }
}

/// One raw cycle on both sides: create, connect (+ receives), an untimed write per QP, release.
/// Returns the three times, the slower side each.
fn raw_cycle(device: &str, a: &mut RawSide, b: &mut RawSide) -> BResult<[Duration; 3]> {
    let [(ca, ra), (cb, rb)] = both(a, b, |_, s| s.create(device))?;
    let remotes = [ra, rb];
    let [(na, ()), (nb, ())] = both(a, b, |i, s| s.connect(&remotes[1 - i]))?;
    a.write_all(b)?;
    let [(la, ()), (lb, ())] = both(a, b, |_, s| s.release())?;
    Ok([ca.max(cb), na.max(nb), la.max(lb)])
}

#[derive(Default)]
struct SweepResult {
    quiesce: Vec<f64>,
    rebuild: Vec<f64>,
    reconnect: Vec<f64>,
    /// The raw-verbs baseline: create (vs rebuild), connect + receives (vs reconnect),
    /// release (vs quiesce).
    raw_create: Vec<f64>,
    raw_connect: Vec<f64>,
    raw_release: Vec<f64>,
    setup_ms: f64,
}

fn sweep(device: &str, n: usize, reps: usize) -> BResult<SweepResult> {
    let t = Instant::now();
    let mut a = Side::new(device, n)?;
    let mut b = Side::new(device, n)?;
    for i in 0..n {
        let (ea, eb) = (a.ch.endpoint(a.qps[i])?, b.ch.endpoint(b.qps[i])?);
        a.ch.connect(a.qps[i], eb)?;
        b.ch.connect(b.qps[i], ea)?;
    }
    a.post_receives()?;
    b.post_receives()?;
    check_writes(&mut a, &b, 0)?;
    let mut res = SweepResult {
        setup_ms: ms(t.elapsed()),
        ..Default::default()
    };
    println!(
        "REP setup n={n} ms={:.1} (open, {n} MRs, CQ, {n} QPs, connect, receives, both sides)",
        res.setup_ms
    );
    let (mut xa, mut xb) = (RawSide::new(n), RawSide::new(n));
    for rep in 0..reps {
        // The raw cycle runs before the channel cycle in even repetitions, after it in odd ones.
        let raw = |xa: &mut RawSide, xb: &mut RawSide, res: &mut SweepResult| -> BResult<()> {
            let [c, k, l] = raw_cycle(device, xa, xb)?;
            println!(
                "REP n={n} rep={rep} raw_create_ms={:.2} raw_connect_ms={:.2} \
                 raw_release_ms={:.2}",
                ms(c),
                ms(k),
                ms(l)
            );
            res.raw_create.push(ms(c));
            res.raw_connect.push(ms(k));
            res.raw_release.push(ms(l));
            Ok(())
        };
        if rep % 2 == 0 {
            raw(&mut xa, &mut xb, &mut res)?;
        }
        let [(qa, ra), (qb, rb)] = both(&mut a, &mut b, |_, s| -> BResult<QuiesceReport> {
            Ok(s.ch.quiesce(QUIESCE_TIMEOUT)?)
        })?;
        for r in [&ra, &rb] {
            if r.flushed_qps != n || r.kept_receives != n * RECVS_PER_QP {
                return Err(format!("unexpected quiesce report {r:?} for n={n}").into());
            }
        }
        let [(ba, epa), (bb, epb)] = both(&mut a, &mut b, |_, s| Ok(s.ch.rebuild()?))?;
        let all: HashMap<QpId, Endpoint> =
            epa.into_iter().chain(epb).map(|(_, e)| (e.id, e)).collect();
        let [(ca, ()), (cb, ())] = both(&mut a, &mut b, |_, s| Ok(s.ch.reconnect(&all)?))?;
        check_writes(&mut a, &b, rep as u64 + 1)?;
        let (q, r, c) = (ms(qa.max(qb)), ms(ba.max(bb)), ms(ca.max(cb)));
        println!(
            "REP n={n} rep={rep} quiesce_ms={q:.2} (A {:.2} B {:.2}) rebuild_ms={r:.2} \
             (A {:.2} B {:.2}) reconnect_ms={c:.2} (A {:.2} B {:.2}) kept_receives={}",
            ms(qa),
            ms(qb),
            ms(ba),
            ms(bb),
            ms(ca),
            ms(cb),
            ra.kept_receives
        );
        res.quiesce.push(q);
        res.rebuild.push(r);
        res.reconnect.push(c);
        if rep % 2 == 1 {
            raw(&mut xa, &mut xb, &mut res)?;
        }
    }
    // Release everything (untimed): a last quiesce leaves both channels down.
    both(&mut a, &mut b, |_, s| Ok(s.ch.quiesce(QUIESCE_TIMEOUT)?))?;
    Ok(res)
}

// ---------------------------------------------------------------------------------------------
// 2. Post/poll overhead: raw verbs vs the channel.

/// What one pass measured.
#[derive(Clone, Copy, Default)]
struct Pass {
    ops: usize,
    total: Duration,
    post: Duration,
    polls: usize,
}

impl Pass {
    fn add(&mut self, o: &Pass) {
        self.ops += o.ops;
        self.total += o.total;
        self.post += o.post;
        self.polls += o.polls;
    }

    fn ns_per_op(&self) -> f64 {
        self.total.as_nanos() as f64 / self.ops.max(1) as f64
    }

    fn post_ns(&self) -> f64 {
        self.post.as_nanos() as f64 / self.ops.max(1) as f64
    }

    fn polls_per_op(&self) -> f64 {
        self.polls as f64 / self.ops.max(1) as f64
    }
}

/// One end of the raw pair.
struct RawEnd {
    v: Rdma,
    port: Port,
    pd: Handle,
    mr: MrKeys,
    cq: Handle,
    qp: (Handle, u32),
    psn: u32,
}

impl RawEnd {
    fn new(device: &str, buf: &[u8], psn: u32) -> BResult<RawEnd> {
        let mut v = Rdma::new();
        let port = v.open(device)?;
        let pd = v.alloc_pd()?;
        let mr = v.reg_mr(pd, buf.as_ptr() as u64, buf.len(), ACCESS)?;
        let cq = v.create_cq(16)?;
        let qp = v.create_qp(pd, cq, cq, CAPS)?;
        Ok(RawEnd {
            v,
            port,
            pd,
            mr,
            cq,
            qp,
            psn,
        })
    }

    fn remote(&self) -> Remote {
        Remote {
            port: self.port.clone(),
            qpn: self.qp.1,
            psn: self.psn,
        }
    }

    fn release(mut self) -> BResult<()> {
        self.v.destroy_qp(self.qp.0)?;
        self.v.destroy_cq(self.cq)?;
        self.v.dereg_mr(self.mr.handle)?;
        self.v.dealloc_pd(self.pd)?;
        self.v.close()?;
        Ok(())
    }
}

/// The loop both paths run: post `wr`, poll until its completion, `k` times.
fn ping_loop(
    k: usize,
    mut post: impl FnMut() -> BResult<()>,
    mut poll: impl FnMut() -> BResult<usize>,
) -> BResult<Pass> {
    let mut post_time = Duration::ZERO;
    let mut polls = 0usize;
    let begin = Instant::now();
    for _ in 0..k {
        let t0 = Instant::now();
        post()?;
        post_time += t0.elapsed();
        let t1 = Instant::now();
        loop {
            polls += 1;
            if poll()? > 0 {
                break;
            }
            if polls % 1024 == 0 && t1.elapsed() > POLL_TIMEOUT {
                return Err("no completion within the poll timeout".into());
            }
        }
    }
    Ok(Pass {
        ops: k,
        total: begin.elapsed(),
        post: post_time,
        polls,
    })
}

fn check_one(cs: &[Completion]) -> BResult<usize> {
    for c in cs {
        if c.status != 0 {
            return Err(format!("write failed: {c:?}").into());
        }
    }
    Ok(cs.len())
}

struct RawPair {
    a: RawEnd,
    b: RawEnd,
    wr: SendWr,
}

impl RawPair {
    fn new(device: &str, src: &[u8], dst: &[u8]) -> BResult<RawPair> {
        let mut a = RawEnd::new(device, src, 0x00_1234)?;
        let mut b = RawEnd::new(device, dst, 0x00_4321)?;
        let (ra, rb) = (a.remote(), b.remote());
        a.v.connect(a.qp.0, a.psn, &rb)?;
        b.v.connect(b.qp.0, b.psn, &ra)?;
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::Write {
                remote_addr: dst.as_ptr() as u64,
                rkey: b.mr.rkey,
            },
            sges: vec![Sge {
                addr: src.as_ptr() as u64,
                len: MSG,
                lkey: a.mr.lkey,
            }],
            signaled: true,
        };
        Ok(RawPair { a, b, wr })
    }

    fn run(&mut self, k: usize) -> BResult<Pass> {
        let (qp, cq) = (self.a.qp.0, self.a.cq);
        let v = std::cell::RefCell::new(&mut self.a.v);
        let wr = &self.wr;
        ping_loop(
            k,
            || Ok(v.borrow_mut().post_send(qp, wr)?),
            || check_one(&v.borrow_mut().poll_cq(cq, 16)?),
        )
    }
}

struct ChanPair {
    a: Side,
    b: Side,
    wr: SendWr,
}

impl ChanPair {
    fn new(device: &str) -> BResult<ChanPair> {
        let mut a = Side::new(device, 1)?;
        let mut b = Side::new(device, 1)?;
        let (ea, eb) = (a.ch.endpoint(a.qps[0])?, b.ch.endpoint(b.qps[0])?);
        a.ch.connect(a.qps[0], eb)?;
        b.ch.connect(b.qps[0], ea)?;
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::Write {
                remote_addr: b.addr(0, 0),
                rkey: b.keys[0],
            },
            sges: vec![Sge {
                addr: a.addr(0, 0),
                len: MSG,
                lkey: a.keys[0],
            }],
            signaled: true,
        };
        Ok(ChanPair { a, b, wr })
    }

    fn run(&mut self, k: usize) -> BResult<Pass> {
        let (qp, cq) = (self.a.qps[0], self.a.cq);
        let ch = std::cell::RefCell::new(&mut self.a.ch);
        let wr = &self.wr;
        ping_loop(
            k,
            || Ok(ch.borrow_mut().post_send(qp, wr)?),
            || check_one(&ch.borrow_mut().poll_cq(cq, 16)?),
        )
    }
}

struct Overhead {
    raw: Vec<Pass>,
    chan: Vec<Pass>,
    ratio: Vec<f64>,
}

fn overhead(device: &str, k: usize, reps: usize) -> BResult<Overhead> {
    let src = vec![0x5au8; BUF].into_boxed_slice();
    let dst = vec![0u8; BUF].into_boxed_slice();
    let mut raw = RawPair::new(device, &src, &dst)?;
    let mut chan = ChanPair::new(device)?;
    // Warm-up: caches, page faults, the provider's first-use paths.
    raw.run(k / 20 + 1)?;
    chan.run(k / 20 + 1)?;
    let mut out = Overhead {
        raw: Vec::new(),
        chan: Vec::new(),
        ratio: Vec::new(),
    };
    // Each repetition interleaves the two paths in BLOCKS blocks of k / BLOCKS writes each,
    // alternating which goes first (ABBA...), so that both see the same drift of the emulated
    // machine (on this guest the cost of the same loop wanders by up to 2x over seconds).
    const BLOCKS: usize = 20;
    let per = (k / BLOCKS).max(1);
    for rep in 0..reps {
        let (mut r, mut c) = (Pass::default(), Pass::default());
        for blk in 0..BLOCKS {
            if (blk + rep) % 2 == 0 {
                r.add(&raw.run(per)?);
                c.add(&chan.run(per)?);
            } else {
                c.add(&chan.run(per)?);
                r.add(&raw.run(per)?);
            }
        }
        let first = if rep % 2 == 0 { "raw" } else { "channel" };
        println!(
            "REP postpoll rep={rep} k={} blocks={BLOCKS} first={first} raw_ns={:.0} \
             channel_ns={:.0} ratio={:.3} raw_post_ns={:.0} channel_post_ns={:.0} \
             raw_polls={:.2} channel_polls={:.2}",
            r.ops,
            r.ns_per_op(),
            c.ns_per_op(),
            c.ns_per_op() / r.ns_per_op(),
            r.post_ns(),
            c.post_ns(),
            r.polls_per_op(),
            c.polls_per_op()
        );
        out.ratio.push(c.ns_per_op() / r.ns_per_op());
        out.raw.push(r);
        out.chan.push(c);
    }
    if dst[..MSG as usize] != src[..MSG as usize] {
        return Err("the raw writes did not land".into());
    }
    if chan.b.bufs[0][..MSG as usize] != chan.a.bufs[0][..MSG as usize] {
        return Err("the channel writes did not land".into());
    }
    let RawPair { a, b, .. } = raw;
    a.release()?;
    b.release()?;
    let ChanPair {
        a: mut ca,
        b: mut cb,
        ..
    } = chan;
    both(&mut ca, &mut cb, |_, s| {
        Ok(s.ch.quiesce(QUIESCE_TIMEOUT)?)
    })?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// 3. (--noop) The channel layer's own CPU cost: the same post/poll loop on a backend that does
//    nothing (each signalled post queues its completion, the next poll returns it), directly
//    and through a Channel. Needs no device; run on the host, it gives the translation cost in
//    native nanoseconds.

/// A [`Verbs`] backend without a device.
#[derive(Default)]
struct NoopVerbs {
    next: u64,
    done: Vec<Completion>,
}

impl NoopVerbs {
    fn handle(&mut self) -> Handle {
        self.next += 1;
        self.next
    }
}

impl Verbs for NoopVerbs {
    fn open(&mut self, device: &str) -> ib_quiesce::verbs::VResult<Port> {
        Ok(Port {
            device: device.to_string(),
            ..Port::default()
        })
    }
    fn open_matching(&mut self, like: &Port) -> ib_quiesce::verbs::VResult<Port> {
        Ok(like.clone())
    }
    fn close(&mut self) -> ib_quiesce::verbs::VResult<()> {
        Ok(())
    }
    fn alloc_pd(&mut self) -> ib_quiesce::verbs::VResult<Handle> {
        Ok(self.handle())
    }
    fn dealloc_pd(&mut self, _: Handle) -> ib_quiesce::verbs::VResult<()> {
        Ok(())
    }
    fn reg_mr(
        &mut self,
        _: Handle,
        _: u64,
        _: usize,
        _: u32,
    ) -> ib_quiesce::verbs::VResult<MrKeys> {
        let h = self.handle();
        Ok(MrKeys {
            handle: h,
            lkey: h as u32,
            rkey: h as u32 | 0x8000,
        })
    }
    fn dereg_mr(&mut self, _: Handle) -> ib_quiesce::verbs::VResult<()> {
        Ok(())
    }
    fn create_cq(&mut self, _: u32) -> ib_quiesce::verbs::VResult<Handle> {
        Ok(self.handle())
    }
    fn destroy_cq(&mut self, _: Handle) -> ib_quiesce::verbs::VResult<()> {
        Ok(())
    }
    fn create_qp(
        &mut self,
        _: Handle,
        _: Handle,
        _: Handle,
        _: QpCaps,
    ) -> ib_quiesce::verbs::VResult<(Handle, u32)> {
        let h = self.handle();
        Ok((h, h as u32))
    }
    fn connect(&mut self, _: Handle, _: u32, _: &Remote) -> ib_quiesce::verbs::VResult<()> {
        Ok(())
    }
    fn destroy_qp(&mut self, _: Handle) -> ib_quiesce::verbs::VResult<()> {
        Ok(())
    }
    fn post_send(&mut self, qp: Handle, wr: &SendWr) -> ib_quiesce::verbs::VResult<()> {
        std::hint::black_box(&wr.sges);
        if wr.signaled {
            self.done.push(Completion {
                wr_id: wr.wr_id,
                opcode: ib_quiesce::verbs::Opcode::Send,
                status: 0,
                byte_len: 0,
                qpn: qp as u32,
            });
        }
        Ok(())
    }
    fn post_recv(&mut self, _: Handle, _: &RecvWr) -> ib_quiesce::verbs::VResult<()> {
        Ok(())
    }
    fn poll_cq(&mut self, _: Handle, max: usize) -> ib_quiesce::verbs::VResult<Vec<Completion>> {
        let n = max.min(self.done.len());
        Ok(self.done.drain(..n).collect())
    }
}

fn noop_overhead(k: usize, reps: usize) -> BResult<()> {
    let buf_a = vec![0u8; BUF].into_boxed_slice();
    let buf_b = vec![0u8; BUF].into_boxed_slice();
    // Direct.
    let mut v = NoopVerbs::default();
    v.open("noop")?;
    let pd = v.alloc_pd()?;
    let mr = v.reg_mr(pd, buf_a.as_ptr() as u64, BUF, ACCESS)?;
    let cq = v.create_cq(16)?;
    let (qp, _) = v.create_qp(pd, cq, cq, CAPS)?;
    let raw_wr = SendWr {
        wr_id: 1,
        op: SendOp::Write {
            remote_addr: buf_b.as_ptr() as u64,
            rkey: 0x1234,
        },
        sges: vec![Sge {
            addr: buf_a.as_ptr() as u64,
            len: MSG,
            lkey: mr.lkey,
        }],
        signaled: true,
    };
    // Through a channel pair.
    let mut a = Channel::open(NoopVerbs::default(), "noop")?;
    let mut b = Channel::open(NoopVerbs::default(), "noop")?;
    let ka = a.reg_mr(buf_a.as_ptr() as u64, BUF, ACCESS)?;
    let kb = b.reg_mr(buf_b.as_ptr() as u64, BUF, ACCESS)?;
    let (ca, cb) = (a.create_cq(16)?, b.create_cq(16)?);
    let (qa, qb) = (a.create_qp(ca, ca, CAPS)?, b.create_qp(cb, cb, CAPS)?);
    let (ea, eb) = (a.endpoint(qa)?, b.endpoint(qb)?);
    a.connect(qa, eb)?;
    b.connect(qb, ea)?;
    let ch_wr = SendWr {
        wr_id: 1,
        op: SendOp::Write {
            remote_addr: buf_b.as_ptr() as u64,
            rkey: kb,
        },
        sges: vec![Sge {
            addr: buf_a.as_ptr() as u64,
            len: MSG,
            lkey: ka,
        }],
        signaled: true,
    };
    let v = std::cell::RefCell::new(v);
    let a = std::cell::RefCell::new(a);
    let run_raw = |n| {
        ping_loop(
            n,
            || Ok(v.borrow_mut().post_send(qp, &raw_wr)?),
            || check_one(&v.borrow_mut().poll_cq(cq, 16)?),
        )
    };
    let run_chan = |n| {
        ping_loop(
            n,
            || Ok(a.borrow_mut().post_send(qa, &ch_wr)?),
            || check_one(&a.borrow_mut().poll_cq(ca, 16)?),
        )
    };
    run_raw(k / 10 + 1)?;
    run_chan(k / 10 + 1)?;
    const BLOCKS: usize = 20;
    let per = (k / BLOCKS).max(1);
    let (mut raws, mut chans, mut diffs) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..reps {
        let (mut r, mut c) = (Pass::default(), Pass::default());
        for blk in 0..BLOCKS {
            if (blk + rep) % 2 == 0 {
                r.add(&run_raw(per)?);
                c.add(&run_chan(per)?);
            } else {
                c.add(&run_chan(per)?);
                r.add(&run_raw(per)?);
            }
        }
        println!(
            "REP noop rep={rep} k={} raw_ns={:.1} channel_ns={:.1} diff_ns={:.1} \
             raw_post_ns={:.1} channel_post_ns={:.1}",
            r.ops,
            r.ns_per_op(),
            c.ns_per_op(),
            c.ns_per_op() - r.ns_per_op(),
            r.post_ns(),
            c.post_ns()
        );
        raws.push(r.ns_per_op());
        chans.push(c.ns_per_op());
        diffs.push(c.ns_per_op() - r.ns_per_op());
    }
    let (rm, _) = med_min(&raws);
    let (cm, _) = med_min(&chans);
    let (dm, _) = med_min(&diffs);
    println!("BENCH noop path=raw k={k} ns_per_op={rm:.1}");
    println!("BENCH noop path=channel k={k} ns_per_op={cm:.1}");
    println!("BENCH noop channel_minus_raw_ns={dm:.1} (median of per-repetition differences)");
    Ok(())
}

fn main() {
    let o = match parse_opts() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ibq_bench: {e}");
            std::process::exit(2);
        }
    };
    if let Some(k) = o.noop {
        if let Err(e) = noop_overhead(k, o.reps) {
            println!("BENCH error noop: {e}");
            std::process::exit(1);
        }
        return;
    }
    let begin = Instant::now();
    let mut failed = false;
    println!(
        "BENCH config device={} sizes={:?} ops={} postpoll_reps={} recvs_per_qp={RECVS_PER_QP} \
         caps={}/{}/{} msg={MSG}",
        o.device, o.sizes, o.ops, o.reps, CAPS.max_send_wr, CAPS.max_recv_wr, CAPS.max_sge
    );

    let mut rows = Vec::new();
    let mut largest_ok = None;
    for &n in &o.sizes {
        let reps = if n <= 64 { 5 } else { 3 };
        let t = Instant::now();
        match sweep(&o.device, n, reps) {
            Ok(r) => {
                let (q, qmin) = med_min(&r.quiesce);
                let (b, bmin) = med_min(&r.rebuild);
                let (c, cmin) = med_min(&r.reconnect);
                println!("BENCH quiesce n={n} reps={reps} ms={q:.2} min_ms={qmin:.2}");
                println!("BENCH rebuild n={n} reps={reps} ms={b:.2} min_ms={bmin:.2}");
                println!("BENCH reconnect n={n} reps={reps} ms={c:.2} min_ms={cmin:.2}");
                for (what, v) in [
                    ("raw_release", &r.raw_release),
                    ("raw_create", &r.raw_create),
                    ("raw_connect", &r.raw_connect),
                ] {
                    let (m, min) = med_min(v);
                    println!("BENCH {what} n={n} reps={reps} ms={m:.2} min_ms={min:.2}");
                }
                println!(
                    "BENCH setup n={n} ms={:.1} wall_s={:.1}",
                    r.setup_ms,
                    t.elapsed().as_secs_f64()
                );
                rows.push((n, reps, r));
                largest_ok = Some(n);
            }
            Err(e) => {
                println!("BENCH error sweep n={n}: {e}");
                failed = true;
                break;
            }
        }
    }
    if let Some(n) = largest_ok {
        println!("BENCH largest_n_ok n={n}");
    }

    let ov = match overhead(&o.device, o.ops, o.reps) {
        Ok(ov) => {
            let raw: Vec<f64> = ov.raw.iter().map(|p| p.ns_per_op()).collect();
            let chan: Vec<f64> = ov.chan.iter().map(|p| p.ns_per_op()).collect();
            let (rm, _) = med_min(&raw);
            let (cm, _) = med_min(&chan);
            let (ratio, _) = med_min(&ov.ratio);
            println!("BENCH postpoll path=raw k={} ns_per_op={rm:.0}", o.ops);
            println!("BENCH postpoll path=channel k={} ns_per_op={cm:.0}", o.ops);
            println!(
                "BENCH postpoll ratio={ratio:.3} (channel/raw, median of per-repetition ratios)"
            );
            Some(ov)
        }
        Err(e) => {
            println!("BENCH error postpoll: {e}");
            failed = true;
            None
        }
    };

    // Tables, between markers for benches/ibq_rxe.sh.
    println!("--- tables");
    println!(
        "| QPs and MRs per channel | reps | quiesce | raw release | rebuild | raw create | \
         reconnect | raw connect + receives |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (n, reps, r) in &rows {
        let cell = |v: &[f64]| {
            let (m, min) = med_min(v);
            format!("{m:.1} ({min:.1})")
        };
        println!(
            "| {n} | {reps} | {} | {} | {} | {} | {} | {} |",
            cell(&r.quiesce),
            cell(&r.raw_release),
            cell(&r.rebuild),
            cell(&r.raw_create),
            cell(&r.reconnect),
            cell(&r.raw_connect)
        );
    }
    if let Some(ov) = &ov {
        println!();
        println!(
            "| path ({} signalled 64-byte RDMA writes, post then poll) | ns/op, median (min–max) \
             | in post_send, ns/op | polls/op |",
            o.ops
        );
        println!("|---|---|---|---|");
        for (name, v) in [
            ("raw verbs (`Rdma`)", &ov.raw),
            ("ib-quiesce `Channel`", &ov.chan),
        ] {
            let ns: Vec<f64> = v.iter().map(|p| p.ns_per_op()).collect();
            let post: Vec<f64> = v.iter().map(|p| p.post_ns()).collect();
            let polls: Vec<f64> = v.iter().map(|p| p.polls_per_op()).collect();
            let (m, min) = med_min(&ns);
            let max = ns.iter().copied().fold(f64::MIN, f64::max);
            println!(
                "| {name} | {m:.0} ({min:.0}–{max:.0}) | {:.0} | {:.1} |",
                med_min(&post).0,
                med_min(&polls).0
            );
        }
        let (ratio, rmin) = med_min(&ov.ratio);
        let rmax = ov.ratio.iter().copied().fold(f64::MIN, f64::max);
        println!();
        println!(
            "Channel ÷ raw, median of {} alternating repetitions: **{ratio:.3}** \
             ({rmin:.3}–{rmax:.3}).",
            ov.ratio.len()
        );
    }
    println!("--- end");
    println!("BENCH wall_s={:.1}", begin.elapsed().as_secs_f64());
    if failed {
        std::process::exit(1);
    }
}
