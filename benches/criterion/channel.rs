//! ib-quiesce's own work in a reconnect, without a device: on the in-process fake fabric, a
//! channel whose n QPs are each connected to one QP of a single peer channel holding n MRs is
//! quiesced and rebuilt with its peer, then handed all 2n new endpoints (each carrying the n
//! keys of its channel) and reconnects every QP. Only that last call is timed. The device's part
//! of a reconnect (RTR/RTS) is what `benches/ibq_rxe.sh` measures on soft-RoCE; this is the
//! bookkeeping around it, which must not grow as QPs × MRs.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use ib_quiesce::channel::QpId;
use ib_quiesce::fake::{Fabric, FakeVerbs};
use ib_quiesce::verbs::QpCaps;
use ib_quiesce::{Channel, Endpoint};

const CAPS: QpCaps = QpCaps {
    max_send_wr: 4,
    max_recv_wr: 4,
    max_sge: 1,
};
const T: Duration = Duration::from_secs(30);

/// One process: n registered 4 KiB buffers, one CQ, n QPs.
struct Side {
    ch: Channel<FakeVerbs>,
    _bufs: Vec<Box<[u8]>>,
}

fn side(f: &Fabric, end: usize, n: usize) -> Side {
    let mut ch = Channel::open(f.end(end), "").unwrap();
    let bufs: Vec<Box<[u8]>> = (0..n).map(|_| vec![0u8; 4096].into()).collect();
    for b in &bufs {
        ch.reg_mr(b.as_ptr() as u64, b.len(), 0x7).unwrap();
    }
    let cq = ch.create_cq(4 * n as u32).unwrap();
    for _ in 0..n {
        ch.create_qp(cq, cq, CAPS).unwrap();
    }
    Side { ch, _bufs: bufs }
}

/// Two sides with QP i of one connected to QP i of the other.
fn pair(n: usize) -> (Side, Side) {
    let f = Fabric::new();
    let (mut a, mut b) = (side(&f, 0, n), side(&f, 1, n));
    for i in 0..n as u32 {
        let q = ib_quiesce::channel::QPN_BASE + i;
        let (ea, eb) = (a.ch.endpoint(q).unwrap(), b.ch.endpoint(q).unwrap());
        a.ch.connect(q, eb).unwrap();
        b.ch.connect(q, ea).unwrap();
    }
    (a, b)
}

/// Quiesces both sides at once and rebuilds them; returns every new endpoint by QP identity.
fn down_and_rebuilt(a: &mut Side, b: &mut Side) -> HashMap<QpId, Endpoint> {
    std::thread::scope(|s| {
        let t = s.spawn(|| a.ch.quiesce(T).unwrap());
        b.ch.quiesce(T).unwrap();
        t.join().unwrap();
    });
    [a.ch.rebuild().unwrap(), b.ch.rebuild().unwrap()]
        .into_iter()
        .flatten()
        .map(|(_, e)| (e.id, e))
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("ibq_reconnect (fake fabric, n QPs x n MRs)");
    g.sample_size(10);
    for n in [16usize, 64, 256, 512] {
        let (mut a, mut b) = pair(n);
        g.bench_function(BenchmarkId::from_parameter(n), |bench| {
            bench.iter_custom(|iters| {
                let mut took = Duration::ZERO;
                for _ in 0..iters {
                    let all = down_and_rebuilt(&mut a, &mut b);
                    let t = Instant::now();
                    a.ch.reconnect(&all).unwrap();
                    took += t.elapsed();
                    b.ch.reconnect(&all).unwrap();
                }
                took
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
