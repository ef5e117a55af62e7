//! 1. Quiesce / rebuild / reconnect sweep.
use super::*;

/// One channel with n MRs, one CQ and n QPs.
pub(super) struct Side {
    pub(super) ch: Channel<Rdma>,
    pub(super) bufs: Vec<Box<[u8]>>,
    pub(super) keys: Vec<u32>,
    pub(super) cq: u32,
    pub(super) qps: Vec<u32>,
}

impl Side {
    pub(super) fn new(device: &str, n: usize) -> BResult<Side> {
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

    pub(super) fn addr(&self, i: usize, off: usize) -> u64 {
        self.bufs[i].as_ptr() as u64 + off as u64
    }

    /// Receives into MR i of QP i, at offsets 1024, 2048, ...; never consumed.
    pub(super) fn post_receives(&mut self) -> BResult<()> {
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
pub(super) fn poll_n<V: Verbs>(
    ch: &mut Channel<V>,
    cq: u32,
    want: usize,
) -> BResult<Vec<Completion>> {
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
pub(super) fn check_writes(a: &mut Side, b: &Side, tag: u64) -> BResult<()> {
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
pub(super) fn both<S: Send, T: Send>(
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
pub(super) struct RawSide {
    pub(super) v: Rdma,
    pub(super) bufs: Vec<Box<[u8]>>,
    pub(super) port: Port,
    pub(super) pd: Handle,
    pub(super) mrs: Vec<MrKeys>,
    pub(super) cq: Handle,
    pub(super) qps: Vec<(Handle, u32)>,
}

/// Initial PSN of raw QP i (both sides use the same).
pub(super) fn raw_psn(i: usize) -> u32 {
    (i as u32).wrapping_mul(7919) & 0x00ff_ffff
}

impl RawSide {
    pub(super) fn new(n: usize) -> RawSide {
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
    pub(super) fn create(&mut self, device: &str) -> BResult<Vec<Remote>> {
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
    pub(super) fn connect(&mut self, peer: &[Remote]) -> BResult<()> {
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
    pub(super) fn write_all(&mut self, peer: &RawSide) -> BResult<()> {
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
    pub(super) fn release(&mut self) -> BResult<()> {
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
pub(super) fn raw_cycle(device: &str, a: &mut RawSide, b: &mut RawSide) -> BResult<[Duration; 3]> {
    let [(ca, ra), (cb, rb)] = both(a, b, |_, s| s.create(device))?;
    let remotes = [ra, rb];
    let [(na, ()), (nb, ())] = both(a, b, |i, s| s.connect(&remotes[1 - i]))?;
    a.write_all(b)?;
    let [(la, ()), (lb, ())] = both(a, b, |_, s| s.release())?;
    Ok([ca.max(cb), na.max(nb), la.max(lb)])
}

#[derive(Default)]
pub(super) struct SweepResult {
    pub(super) quiesce: Vec<f64>,
    pub(super) rebuild: Vec<f64>,
    pub(super) reconnect: Vec<f64>,
    /// The raw-verbs baseline: create (vs rebuild), connect + receives (vs reconnect),
    /// release (vs quiesce).
    pub(super) raw_create: Vec<f64>,
    pub(super) raw_connect: Vec<f64>,
    pub(super) raw_release: Vec<f64>,
    pub(super) setup_ms: f64,
}

pub(super) fn sweep(device: &str, n: usize, reps: usize) -> BResult<SweepResult> {
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
