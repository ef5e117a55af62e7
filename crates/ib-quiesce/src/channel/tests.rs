//! Tests of [`super`] (channel.rs).
use super::*;
use crate::fake::{Fabric, FakeVerbs};

const T: Duration = Duration::from_secs(5);
const CAPS: QpCaps = QpCaps {
    max_send_wr: 16,
    max_recv_wr: 16,
    max_sge: 1,
};

/// One process: a channel, a 4 KiB buffer registered in it, a CQ and a QP.
struct Side {
    ch: Channel<FakeVerbs>,
    buf: Box<[u8; 4096]>,
    key: u32,
    cq: u32,
    qp: u32,
}

impl Side {
    fn new(f: &Fabric, id: usize) -> Side {
        let mut ch = Channel::open(f.end(id), "").unwrap();
        let buf = Box::new([0u8; 4096]);
        let key = ch.reg_mr(buf.as_ptr() as u64, buf.len(), 0x7).unwrap();
        let cq = ch.create_cq(64).unwrap();
        let qp = ch.create_qp(cq, cq, CAPS).unwrap();
        Side {
            ch,
            buf,
            key,
            cq,
            qp,
        }
    }

    fn addr(&self, off: usize) -> u64 {
        self.buf.as_ptr() as u64 + off as u64
    }

    fn sge(&self, off: usize, len: u32) -> Vec<Sge> {
        vec![Sge {
            addr: self.addr(off),
            len,
            lkey: self.key,
        }]
    }

    /// A send of the `len` bytes at `off` in this side's buffer.
    fn send(&self, wr_id: u64, off: usize, len: u32, signaled: bool) -> SendWr {
        SendWr {
            wr_id,
            op: SendOp::Send,
            sges: self.sge(off, len),
            signaled,
        }
    }

    /// An RDMA write of the `len` bytes at `off` in this side's buffer to `at` in `peer`'s
    /// (through the peer's virtual key).
    fn write_to(&self, peer: &Side, at: usize, wr_id: u64, off: usize, len: u32) -> SendWr {
        SendWr {
            op: SendOp::Write {
                remote_addr: peer.addr(at),
                rkey: peer.key,
            },
            ..self.send(wr_id, off, len, true)
        }
    }
}

fn pair() -> (Fabric, Side, Side) {
    let f = Fabric::new();
    let (mut a, mut b) = (Side::new(&f, 0), Side::new(&f, 1));
    let (ea, eb) = (a.ch.endpoint(a.qp).unwrap(), b.ch.endpoint(b.qp).unwrap());
    a.ch.connect(a.qp, eb).unwrap();
    b.ch.connect(b.qp, ea).unwrap();
    (f, a, b)
}

/// Quiesces both sides at once, as the agents do in the pre-checkpoint phase.
fn quiesce_both(a: Side, b: Side) -> ((Side, QuiesceReport), (Side, QuiesceReport)) {
    let ta = std::thread::spawn(move || {
        let mut a = a;
        let r = a.ch.quiesce(T).unwrap();
        (a, r)
    });
    let mut b = b;
    let rb = b.ch.quiesce(T).unwrap();
    (ta.join().unwrap(), (b, rb))
}

#[test]
fn identifiers_are_virtual_and_checked() {
    let (_f, mut a, _b) = pair();
    assert_eq!(a.key, MR_KEY_BASE);
    assert_eq!(a.qp, QPN_BASE);
    assert_ne!(a.ch.real_qpn(a.qp).unwrap(), a.qp);
    let bad = RecvWr {
        wr_id: 1,
        sges: vec![Sge {
            addr: a.addr(0),
            len: 8,
            lkey: 0x1234,
        }],
    };
    assert!(matches!(
        a.ch.post_recv(a.qp, &bad),
        Err(Error::Unknown {
            what: "memory key",
            ..
        })
    ));
    let wr = a.send(INTERNAL_WR | 5, 0, 8, true);
    assert_eq!(
        a.ch.post_send(a.qp, &wr),
        Err(Error::ReservedWrId(INTERNAL_WR | 5))
    );
    let wr = SendWr {
        wr_id: 6,
        op: SendOp::Write {
            remote_addr: 0,
            rkey: 0x99,
        },
        sges: a.sge(0, 8),
        signaled: true,
    };
    assert!(matches!(
        a.ch.post_send(a.qp, &wr),
        Err(Error::Unknown {
            what: "peer memory key",
            ..
        })
    ));
    assert!(matches!(
        a.ch.post_send(QPN_BASE + 9, &wr),
        Err(Error::Unknown { what: "QP", .. })
    ));
}

#[test]
fn quiesce_flushes_everything_in_flight_and_releases_every_object() {
    let (f, mut a, mut b) = pair();
    // B expects three messages; A sends one, writes into B's buffer (unsignalled) and
    // sends a second, none delivered yet.
    for i in 0..3 {
        let wr = RecvWr {
            wr_id: 100 + i,
            sges: b.sge(1024 * (i as usize + 1), 64),
        };
        b.ch.post_recv(b.qp, &wr).unwrap();
    }
    a.buf[..5].copy_from_slice(b"hello");
    a.buf[8..13].copy_from_slice(b"world");
    a.buf[16..20].copy_from_slice(b"more");
    let wr = a.send(1, 0, 5, true);
    a.ch.post_send(a.qp, &wr).unwrap();
    let write = SendWr {
        signaled: false,
        ..a.write_to(&b, 100, 2, 8, 5)
    };
    a.ch.post_send(a.qp, &write).unwrap();
    let wr = a.send(3, 16, 5, true);
    a.ch.post_send(a.qp, &wr).unwrap();
    assert_eq!(f.in_flight(), 3);

    let ((a, ra), (mut b, rb)) = quiesce_both(a, b);
    assert_eq!(f.in_flight(), 0, "nothing is left on the wire");
    assert_eq!((ra.flushed_qps, rb.flushed_qps), (1, 1));
    assert_eq!(&b.buf[1024..1029], b"hello");
    assert_eq!(&b.buf[100..105], b"world");
    assert_eq!(&b.buf[2048..2052], b"more");
    // One receive is left for later; the two consumed ones wait for B's next poll.
    assert_eq!(rb.kept_receives, 1);
    assert_eq!(rb.held_completions, 2);
    assert_eq!(ra.held_completions, 2, "A's two signalled sends");
    for side in [0, 1] {
        assert_eq!(f.objects_of(side), 0, "end {side} released everything");
    }
    // Release order: QPs, CQs, MRs, PD, device.
    let log: Vec<String> = f
        .log()
        .into_iter()
        .filter(|l| l.starts_with("end 0: ") && !l.contains("post"))
        .collect();
    let pos = |what: &str| log.iter().rposition(|l| l.contains(what)).unwrap();
    assert!(pos("destroy_qp") < pos("destroy_cq"));
    assert!(pos("destroy_cq") < pos("dereg_mr"));
    assert!(pos("dereg_mr") < pos("dealloc_pd"));
    // The pages the adapter could have written are marked after the last QP is gone and
    // before the memory is deregistered.
    let first = |what: &str| log.iter().position(|l| l.contains(what)).unwrap();
    assert!(pos("destroy_qp") < pos("mark_written 2"), "{log:?}");
    assert!(pos("mark_written 2") < first("dereg_mr"), "{log:?}");
    assert!(pos("dealloc_pd") < pos("close"));
    // Posts are refused while down; the held completions are still delivered.
    assert!(matches!(
        b.ch.post_recv(
            b.qp,
            &RecvWr {
                wr_id: 9,
                sges: vec![]
            }
        ),
        Err(Error::WrongState { .. })
    ));
    let got: Vec<u64> =
        b.ch.poll_cq(b.cq, 8)
            .unwrap()
            .iter()
            .map(|c| c.wr_id)
            .collect();
    assert_eq!(got, [100, 101], "consumed in posting order");
    drop(a);
}

#[test]
fn rebuild_gives_new_real_identifiers_behind_the_same_virtual_ones() {
    let (f, a, mut b) = pair();
    let wr = RecvWr {
        wr_id: 7,
        sges: b.sge(512, 64),
    };
    b.ch.post_recv(b.qp, &wr).unwrap();
    let before = (
        a.ch.real_qpn(a.qp).unwrap(),
        b.ch.real_qpn(b.qp).unwrap(),
        b.ch.real_rkey(b.key).unwrap(),
    );
    let ((mut a, _), (mut b, rb)) = quiesce_both(a, b);
    assert_eq!(rb.kept_receives, 1);

    // Each side recreates its objects and publishes endpoints; the coordinator hands each
    // the other's.
    let ea = a.ch.rebuild().unwrap();
    let eb = b.ch.rebuild().unwrap();
    assert_eq!(ea[0].0, a.qp);
    let all: HashMap<QpId, Endpoint> = ea.into_iter().chain(eb).map(|(_, e)| (e.id, e)).collect();
    // Without its peer's endpoint, a QP cannot reconnect.
    let mut partial = all.clone();
    partial.retain(|(ch, _), _| *ch != b.ch.id);
    assert!(matches!(
        a.ch.reconnect(&partial),
        Err(Error::MissingPeer { .. })
    ));
    a.ch.reconnect(&all).unwrap();
    b.ch.reconnect(&all).unwrap();
    let after = (
        a.ch.real_qpn(a.qp).unwrap(),
        b.ch.real_qpn(b.qp).unwrap(),
        b.ch.real_rkey(b.key).unwrap(),
    );
    assert_ne!(before.0, after.0);
    assert_ne!(before.1, after.1);
    assert_ne!(before.2, after.2);
    assert_eq!(a.ch.state(), State::Up);

    // The receive kept across the checkpoint takes A's next send; a write with B's old
    // (virtual) key lands.
    a.buf[..4].copy_from_slice(b"ping");
    let send = a.send(11, 0, 4, true);
    a.ch.post_send(a.qp, &send).unwrap();
    let write = a.write_to(&b, 3000, 12, 0, 4);
    a.ch.post_send(a.qp, &write).unwrap();
    let mut got = Vec::new();
    for _ in 0..20 {
        got.extend(b.ch.poll_cq(b.cq, 4).unwrap());
        got.extend(a.ch.poll_cq(a.cq, 4).unwrap());
    }
    let recv = got
        .iter()
        .find(|c| c.opcode == Opcode::Recv)
        .expect("received");
    assert_eq!((recv.wr_id, recv.status, recv.qpn), (7, 0, b.qp));
    assert!(got
        .iter()
        .filter(|c| c.opcode == Opcode::Send)
        .all(|c| c.status == 0));
    assert_eq!(&b.buf[512..516], b"ping");
    assert_eq!(&b.buf[3000..3004], b"ping");
    assert_eq!(f.in_flight(), 0);
}

/// Rebuilds both sides and connects each to the other's new endpoints.
fn rebuild_both(a: &mut Side, b: &mut Side) {
    let all: HashMap<QpId, Endpoint> = [a.ch.rebuild().unwrap(), b.ch.rebuild().unwrap()]
        .into_iter()
        .flatten()
        .map(|(_, e)| (e.id, e))
        .collect();
    a.ch.reconnect(&all).unwrap();
    b.ch.reconnect(&all).unwrap();
}

#[test]
fn rebuild_reopens_a_matching_device_when_its_own_is_gone() {
    use crate::verbs::{LINK_ETHERNET, LINK_INFINIBAND};
    let (f, a, b) = pair();
    let ((mut a, _), (mut b, _)) = quiesce_both(a, b);
    // Restarted where A's device has another name: the InfiniBand one does not match
    // A's RoCE port, the Ethernet one does.
    f.set_devices(0, &[("mlx5_0", LINK_INFINIBAND), ("rxe1", LINK_ETHERNET)]);
    rebuild_both(&mut a, &mut b);
    assert_eq!(a.ch.endpoint(a.qp).unwrap().port.device, "rxe1");
    a.buf[..4].copy_from_slice(b"move");
    let write = a.write_to(&b, 64, 1, 0, 4);
    a.ch.post_send(a.qp, &write).unwrap();
    for _ in 0..4 {
        b.ch.poll_cq(b.cq, 4).unwrap();
        a.ch.poll_cq(a.cq, 4).unwrap();
    }
    assert_eq!(&b.buf[64..68], b"move");

    // No device of the same kind at all: the rebuild fails and says what it looked for;
    // the channel stays down, and a later rebuild may still succeed.
    let ((mut a, _), (mut b, _)) = quiesce_both(a, b);
    f.set_devices(0, &[("mlx5_0", LINK_INFINIBAND)]);
    let err = a.ch.rebuild().unwrap_err().to_string();
    assert!(err.contains("rxe1 is gone"), "{err}");
    assert!(err.contains("mlx5_0"), "{err}");
    assert!(f
        .log()
        .iter()
        .any(|l| l == "end 0: open_matching Ethernet (RoCE)"));
    assert_eq!(a.ch.state(), State::Down);
    f.set_devices(0, &[("rxe1", LINK_ETHERNET)]);
    rebuild_both(&mut a, &mut b);
    assert_eq!(a.ch.state(), State::Up);
}

#[test]
fn a_peer_that_does_not_quiesce_times_out_and_posts_can_resume() {
    let (_f, mut a, _b) = pair();
    let err = a.ch.quiesce(Duration::from_millis(200)).unwrap_err();
    assert!(
        matches!(&err, Error::Timeout { what, .. } if what.contains("0 of 1 received")),
        "{err}"
    );
    let wr = RecvWr {
        wr_id: 1,
        sges: a.sge(0, 8),
    };
    assert_eq!(a.ch.post_recv(a.qp, &wr), Err(Error::Paused));
    a.ch.resume().unwrap();
    a.ch.post_recv(a.qp, &wr).unwrap();
}

#[test]
fn a_failing_release_is_reported_and_the_rest_is_still_released() {
    let (f, a, b) = pair();
    f.fail_next("ibv_dereg_mr");
    let ta = std::thread::spawn(move || {
        let mut a = a;
        let r = a.ch.quiesce(T);
        (a, r)
    });
    let mut b = b;
    let rb = b.ch.quiesce(T);
    let (a, ra) = ta.join().unwrap();
    let failed = [ra, rb].into_iter().filter(|r| r.is_err()).count();
    assert_eq!(failed, 1, "exactly one side met the failure");
    assert_eq!((a.ch.state(), b.ch.state()), (State::Down, State::Down));
    // The failed MR stays registered; everything else is gone.
    assert!(f.objects_of(0) + f.objects_of(1) <= 2);
}

/// The race of a quiesce under traffic: B's last poll (the one that brings its own marker's
/// completion) returns empty of A's message, A's message completes in B's CQ just after, then
/// A's marker lands in B's memory. B must still hold that completion for its application.
#[test]
fn a_receive_completing_after_the_last_poll_is_held_not_lost() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let (f, mut a, mut b) = pair();
    let wr = RecvWr {
        wr_id: 100,
        sges: b.sge(1024, 64),
    };
    b.ch.post_recv(b.qp, &wr).unwrap();
    let (b_waits, a_done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (waits, done) = (b_waits.clone(), a_done.clone());
    f.after_poll(
        1,
        Box::new(move |got| {
            if !got.iter().any(|c| c.wr_id & INTERNAL_WR != 0) || done.load(SeqCst) {
                return;
            }
            waits.store(true, SeqCst);
            let begin = Instant::now();
            while !done.load(SeqCst) && begin.elapsed() < T {
                std::thread::sleep(Duration::from_millis(1));
            }
        }),
    );
    let tb = std::thread::spawn(move || {
        let r = b.ch.quiesce(T);
        (b, r)
    });
    let begin = Instant::now();
    while !b_waits.load(SeqCst) {
        assert!(
            begin.elapsed() < T,
            "B never polled its marker's completion"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // B's marker is delivered and B is between polls: A's message, then A's quiesce (its
    // marker reaches B after the message).
    a.buf[..5].copy_from_slice(b"hello");
    let send = a.send(1, 0, 5, true);
    a.ch.post_send(a.qp, &send).unwrap();
    a.ch.quiesce(T).unwrap();
    a_done.store(true, SeqCst);
    let (mut b, rb) = tb.join().unwrap();
    let rb = rb.unwrap();
    assert_eq!(
        (rb.held_completions, rb.kept_receives),
        (1, 0),
        "A's message is held for B, its receive is consumed"
    );
    let got = b.ch.poll_cq(b.cq, 8).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].wr_id, got[0].byte_len), (100, 5));
    assert_eq!(&b.buf[1024..1029], b"hello");
}
