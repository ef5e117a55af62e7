//! 3. (--noop) The channel layer's own CPU cost: the same post/poll loop on a backend that does
//!    nothing (each signalled post queues its completion, the next poll returns it), directly
//!    and through a Channel. Needs no device; run on the host, it gives the translation cost in
//!    native nanoseconds.
use super::*;

/// A [`Verbs`] backend without a device.
#[derive(Default)]
pub(super) struct NoopVerbs {
    pub(super) next: u64,
    pub(super) done: Vec<Completion>,
}

impl NoopVerbs {
    pub(super) fn handle(&mut self) -> Handle {
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

pub(super) fn noop_overhead(k: usize, reps: usize) -> BResult<()> {
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
