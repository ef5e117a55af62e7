//! The verbs layer's per-call bookkeeping on the host, without a device: passing the gate every
//! post and poll goes through, and the lkey translation every scatter/gather entry takes, each
//! against the way the layer did it before (a shared in-flight counter changed with atomic
//! read-modify-writes; a read lock on the table), alone and with a second thread doing the
//! same at once (an MPI rank's progress thread beside its main thread). Emulated guests
//! (`benches/verbs_layer.sh`) cannot resolve costs this small.
use std::collections::HashMap;
use std::hint::black_box;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use ckpt_verbs::gate::Gate;
use ckpt_verbs::xlate::Tables;
use criterion::{criterion_group, criterion_main, Criterion};

/// The gate as it was: one in-flight counter for every thread.
#[derive(Default)]
struct SharedCounterGate {
    closed: AtomicBool,
    inflight: AtomicUsize,
}

impl SharedCounterGate {
    fn pass(&self) {
        self.inflight.fetch_add(1, SeqCst);
        black_box(self.closed.load(SeqCst));
        self.inflight.fetch_sub(1, SeqCst);
    }
}

/// Times `iters` calls of `f` on this thread, with `busy` threads calling `f` meanwhile.
fn timed(iters: u64, busy: usize, f: &(impl Fn() + Sync)) -> Duration {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..busy {
            s.spawn(|| {
                while !stop.load(SeqCst) {
                    for _ in 0..64 {
                        f();
                    }
                }
            });
        }
        let begin = Instant::now();
        for _ in 0..iters {
            f();
        }
        let took = begin.elapsed();
        stop.store(true, SeqCst);
        took
    })
}

fn gate(c: &mut Criterion) {
    let mut g = c.benchmark_group("verbs_gate");
    let now: &'static Gate = Box::leak(Box::default());
    let before: &'static SharedCounterGate = Box::leak(Box::default());
    for busy in [0, 1] {
        let threads = busy + 1;
        g.bench_function(format!("per-thread slots, {threads} thread(s)"), |b| {
            b.iter_custom(|n| {
                timed(n, busy, &|| {
                    black_box(now.enter());
                })
            })
        });
        g.bench_function(
            format!("shared counter (before), {threads} thread(s)"),
            |b| b.iter_custom(|n| timed(n, busy, &|| before.pass())),
        );
    }
    g.finish();
}

fn lkeys(c: &mut Criterion) {
    let mut g = c.benchmark_group("verbs_lkey");
    let now: &'static Tables = Box::leak(Box::default());
    let before: &'static RwLock<HashMap<u32, u32>> = Box::leak(Box::default());
    // A rank's handful of regions (keys as rxe and mlx5 make them: index << 8 | key byte).
    for i in 1..=8u32 {
        let k = i << 8 | 0x11;
        now.set_mr(k, k + 0x1000, k, k + 0x1000);
        before.write().unwrap().insert(k, k + 0x1000);
    }
    let key = 3 << 8 | 0x11;
    for busy in [0, 1] {
        let threads = busy + 1;
        g.bench_function(format!("per-thread cache, {threads} thread(s)"), |b| {
            b.iter_custom(|n| {
                timed(n, busy, &|| {
                    black_box(now.lkey(black_box(key)));
                })
            })
        });
        g.bench_function(format!("read lock (before), {threads} thread(s)"), |b| {
            b.iter_custom(|n| {
                timed(n, busy, &|| {
                    black_box(before.read().unwrap().get(&black_box(key)).copied());
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, gate, lkeys);
criterion_main!(benches);
