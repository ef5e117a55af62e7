//! 2. Post/poll overhead: raw verbs vs the channel.
use super::*;

/// What one pass measured.
#[derive(Clone, Copy, Default)]
pub(super) struct Pass {
    pub(super) ops: usize,
    pub(super) total: Duration,
    pub(super) post: Duration,
    pub(super) polls: usize,
}

impl Pass {
    pub(super) fn add(&mut self, o: &Pass) {
        self.ops += o.ops;
        self.total += o.total;
        self.post += o.post;
        self.polls += o.polls;
    }

    pub(super) fn ns_per_op(&self) -> f64 {
        self.total.as_nanos() as f64 / self.ops.max(1) as f64
    }

    pub(super) fn post_ns(&self) -> f64 {
        self.post.as_nanos() as f64 / self.ops.max(1) as f64
    }

    pub(super) fn polls_per_op(&self) -> f64 {
        self.polls as f64 / self.ops.max(1) as f64
    }
}

/// One end of the raw pair.
pub(super) struct RawEnd {
    pub(super) v: Rdma,
    pub(super) port: Port,
    pub(super) pd: Handle,
    pub(super) mr: MrKeys,
    pub(super) cq: Handle,
    pub(super) qp: (Handle, u32),
    pub(super) psn: u32,
}

impl RawEnd {
    pub(super) fn new(device: &str, buf: &[u8], psn: u32) -> BResult<RawEnd> {
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

    pub(super) fn remote(&self) -> Remote {
        Remote {
            port: self.port.clone(),
            qpn: self.qp.1,
            psn: self.psn,
        }
    }

    pub(super) fn release(mut self) -> BResult<()> {
        self.v.destroy_qp(self.qp.0)?;
        self.v.destroy_cq(self.cq)?;
        self.v.dereg_mr(self.mr.handle)?;
        self.v.dealloc_pd(self.pd)?;
        self.v.close()?;
        Ok(())
    }
}

/// The loop both paths run: post `wr`, poll until its completion, `k` times.
pub(super) fn ping_loop(
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

pub(super) fn check_one(cs: &[Completion]) -> BResult<usize> {
    for c in cs {
        if c.status != 0 {
            return Err(format!("write failed: {c:?}").into());
        }
    }
    Ok(cs.len())
}

pub(super) struct RawPair {
    pub(super) a: RawEnd,
    pub(super) b: RawEnd,
    pub(super) wr: SendWr,
}

impl RawPair {
    pub(super) fn new(device: &str, src: &[u8], dst: &[u8]) -> BResult<RawPair> {
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

    pub(super) fn run(&mut self, k: usize) -> BResult<Pass> {
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

pub(super) struct ChanPair {
    pub(super) a: Side,
    pub(super) b: Side,
    pub(super) wr: SendWr,
}

impl ChanPair {
    pub(super) fn new(device: &str) -> BResult<ChanPair> {
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

    pub(super) fn run(&mut self, k: usize) -> BResult<Pass> {
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

pub(super) struct Overhead {
    pub(super) raw: Vec<Pass>,
    pub(super) chan: Vec<Pass>,
    pub(super) ratio: Vec<f64>,
}

pub(super) fn overhead(device: &str, k: usize, reps: usize) -> BResult<Overhead> {
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
