//! The cycle around a snapshot: quiesce (drain, flush markers, release), resume after a failed
//! quiesce, rebuild with new real objects, reconnect to the peers' new endpoints.
use super::*;

impl<V: Verbs> Channel<V> {
    /// Drains, flushes and releases everything (see the module documentation). On a timeout
    /// or a failed flush the channel stays `Quiescing` with its objects intact: call
    /// [`Channel::resume`] to let posts through again.
    pub fn quiesce(&mut self, timeout: Duration) -> Result<QuiesceReport> {
        self.need(State::Up, "quiesce")?;
        self.state = State::Quiescing;
        let begin = Instant::now();
        let timed_out = |what: &str| Error::Timeout {
            what: what.to_string(),
            waited: timeout,
        };
        let mut internal = Vec::new();
        // 1. Every signalled send completes.
        while self.outstanding > 0 {
            if begin.elapsed() > timeout {
                return Err(timed_out(&format!("{} signalled sends", self.outstanding)));
            }
            for i in 0..self.cqs.len() {
                self.poll_into(i, &mut internal)?;
            }
        }
        // 2. A marker each way on every connected QP.
        self.marker += 1;
        self.ctrl[0] = self.marker;
        let ctrl = self.ctrl_mr.expect("device open");
        let src = Sge {
            addr: self.ctrl.as_ptr() as u64,
            len: 8,
            lkey: ctrl.lkey,
        };
        let connected: Vec<usize> = (0..self.qps.len())
            .filter(|i| self.qps[*i].peer.is_some())
            .collect();
        for &i in &connected {
            let peer = self.qps[i].peer.as_ref().expect("connected");
            let wr = SendWr {
                wr_id: INTERNAL_WR | i as u64,
                op: SendOp::Write {
                    remote_addr: peer.ctrl_addr,
                    rkey: peer.ctrl_rkey,
                },
                sges: vec![src],
                signaled: true,
            };
            self.v.post_send(self.qps[i].real.expect("up").0, &wr)?;
        }
        let mut acked: HashSet<usize> = HashSet::new();
        loop {
            for c in internal.drain(..) {
                if c.status != 0 {
                    return Err(Error::Failed {
                        wr_id: c.wr_id,
                        qpn: c.qpn,
                        status: c.status,
                    });
                }
                acked.insert((c.wr_id & !INTERNAL_WR) as usize);
            }
            let heard = connected
                .iter()
                .filter(|i| self.slot(**i) >= self.marker)
                .count();
            if acked.len() == connected.len() && heard == connected.len() {
                break;
            }
            if begin.elapsed() > timeout {
                return Err(timed_out(&format!(
                    "flush markers ({} of {} sent, {} of {} received)",
                    acked.len(),
                    connected.len(),
                    heard,
                    connected.len()
                )));
            }
            for i in 0..self.cqs.len() {
                self.poll_into(i, &mut internal)?;
            }
        }
        // 3. A last sweep of every CQ. The peer's marker reached our memory after everything
        // it sent before, but a receive that completed after our last poll is still in the CQ:
        // it must be held for the application before the CQ goes, or its message is lost while
        // its receive is posted again. Nothing is in flight any more, so this ends.
        for i in 0..self.cqs.len() {
            loop {
                let before = self.cqs[i].held.len() + internal.len();
                self.poll_into(i, &mut internal)?;
                if self.cqs[i].held.len() + internal.len() == before {
                    break;
                }
                if begin.elapsed() > timeout {
                    return Err(timed_out("the last sweep of the completion queues"));
                }
            }
        }
        let report = QuiesceReport {
            flushed_qps: connected.len(),
            kept_receives: self.qps.iter().map(|q| q.receives.len()).sum(),
            held_completions: self.cqs.iter().map(|c| c.held.len()).sum(),
        };
        // 4. Release everything.
        let released = self.release_all();
        self.state = State::Down;
        released.map(|()| report)
    }

    /// Releases every real object (QPs, CQs, memory regions after marking what the adapter
    /// wrote, the PD, the device), continuing past errors so that nothing is left open; the
    /// first error.
    fn release_all(&mut self) -> Result<()> {
        let mut first: Option<VerbsError> = None;
        let mut keep = |r: std::result::Result<(), VerbsError>| {
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        };
        for q in &mut self.qps {
            if let Some((h, _)) = q.real.take() {
                keep(self.v.destroy_qp(h));
            }
        }
        self.by_real.clear();
        for c in &mut self.cqs {
            if let Some(h) = c.real.take() {
                keep(self.v.destroy_cq(h));
            }
        }
        // No QP is left to DMA into them: what the adapter wrote is made visible to a
        // pre-copy before the snapshot (crate::dirty).
        let mut written: Vec<(u64, usize)> = self
            .mrs
            .iter()
            .filter(|m| m.real.is_some() && m.access & crate::dirty::WRITE_ACCESS != 0)
            .map(|m| (m.addr, m.len))
            .collect();
        if self.ctrl_mr.is_some() {
            // The peers' flush markers land there.
            written.push((self.ctrl.as_ptr() as u64, self.ctrl.len() * 8));
        }
        self.v.mark_written(&written);
        for m in &mut self.mrs {
            if let Some(k) = m.real.take() {
                keep(self.v.dereg_mr(k.handle));
            }
        }
        if let Some(k) = self.ctrl_mr.take() {
            keep(self.v.dereg_mr(k.handle));
        }
        if let Some(pd) = self.pd.take() {
            keep(self.v.dealloc_pd(pd));
        }
        keep(self.v.close());
        match first {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Lets posts through again after a quiesce that failed before releasing anything.
    pub fn resume(&mut self) -> Result<()> {
        self.need(State::Quiescing, "resume")?;
        self.state = State::Up;
        Ok(())
    }

    fn slot(&self, i: usize) -> u64 {
        // SAFETY: the slot is inside `ctrl`, which lives as long as `self`; the device (or a
        // peer through it) writes it concurrently, so it is read volatile.
        unsafe { std::ptr::read_volatile(self.ctrl.as_ptr().add(1 + i)) }
    }

    /// Rebuild, first step: reopen the device, register the same memory, recreate CQs and QPs.
    /// Returns every QP's new endpoint (virtual QP number, endpoint) to publish to its peer.
    pub fn rebuild(&mut self) -> Result<Vec<(u32, Endpoint)>> {
        self.need(State::Down, "rebuild")?;
        self.open_device()?;
        let pd = self.pd.expect("open");
        for m in &mut self.mrs {
            m.real = Some(self.v.reg_mr(pd, m.addr, m.len, m.access)?);
        }
        for c in &mut self.cqs {
            c.real = Some(self.v.create_cq(c.cqe)?);
        }
        for i in 0..self.qps.len() {
            let (s, r) = (self.qps[i].send_cq, self.qps[i].recv_cq);
            let real = self.v.create_qp(
                pd,
                self.cqs[s].real.expect("created"),
                self.cqs[r].real.expect("created"),
                self.qps[i].caps,
            )?;
            self.qps[i].real = Some(real);
            self.by_real.insert(real.1, i);
            self.qps[i].psn = psn_for(self.marker, i);
        }
        self.state = State::Rebuilt;
        Ok((0..self.qps.len())
            .map(|i| (QPN_BASE + i as u32, self.endpoint_of(i)))
            .collect())
    }

    /// Rebuild, second step: connect every connected QP to its peer's new endpoint, found in
    /// `endpoints` (all endpoints of the job, as the coordinator gathered them) by the peer's
    /// [`QpId`]; repost the receives kept at quiesce, and let posts through.
    pub fn reconnect(&mut self, endpoints: &HashMap<QpId, Endpoint>) -> Result<()> {
        self.need(State::Rebuilt, "reconnect")?;
        // Every peer's endpoint first: a QP half way to RTS cannot be connected again.
        let mut found = Vec::new();
        for (i, q) in self.qps.iter().enumerate() {
            let Some(old) = &q.peer else {
                continue;
            };
            let ep = endpoints.get(&old.id).ok_or(Error::MissingPeer {
                qp: QPN_BASE + i as u32,
                peer: old.id,
            })?;
            found.push((i, ep));
        }
        // Every peer channel's keys changed: one new table each, built from the first of its
        // endpoints (one rebuild published them all, with the same keys) and shared by its QPs.
        let mut tables: HashMap<u64, PeerKeys> = HashMap::new();
        for (i, ep) in found {
            let keys = tables
                .entry(ep.id.0)
                .or_insert_with(|| peer_keys(&ep.rkeys, None))
                .clone();
            self.connect_index(i, ep, keys)?;
        }
        for q in &self.qps {
            let real = &mut self.recv_wr;
            for wr in &q.receives {
                Self::local_sges(&self.mrs, &wr.sges, &mut real.sges)?;
                real.wr_id = wr.wr_id;
                self.v.post_recv(q.real.expect("rebuilt").0, real)?;
            }
        }
        self.state = State::Up;
        Ok(())
    }

    /// The peer QPs this channel's QPs are connected to (their identities outlive rebuilds):
    /// the endpoints a reconnect needs, and the only ones it needs.
    pub fn peers(&self) -> Vec<QpId> {
        let mut p: Vec<QpId> = self
            .qps
            .iter()
            .filter_map(|q| q.peer.as_ref().map(|e| e.id))
            .collect();
        p.sort_unstable();
        p.dedup();
        p
    }

    /// The current real QP number behind a virtual one (diagnostics and tests).
    pub fn real_qpn(&self, vqpn: u32) -> Result<u32> {
        let i = self.qp_index(vqpn)?;
        self.qps[i].real.map(|r| r.1).ok_or(Error::WrongState {
            op: "real_qpn",
            state: self.state.name(),
        })
    }

    /// The current real rkey behind a virtual memory key (diagnostics and tests).
    pub fn real_rkey(&self, vkey: u32) -> Result<u32> {
        Self::mr(&self.mrs, vkey)?
            .real
            .map(|k| k.rkey)
            .ok_or(Error::WrongState {
                op: "real_rkey",
                state: self.state.name(),
            })
    }
}
