//! The floor under a flat checkpoint round: what the kernel's loopback TCP alone costs for the
//! round's five barriers over N agents, with none of ckpt's work, no TLS, no HTTP/2 and no
//! protobuf. A "coordinator" thread holds one TCP connection per agent; per barrier it writes
//! a 96-byte message to every connection, then reads every 96-byte answer. The "agents" are one
//! task per connection on a second thread, echoing. Each side is a single-threaded tokio
//! runtime on its own OS thread (the two cores of this machine, no work stealing), Nagle off as
//! in the product. The coordination bench's `coordination_round/N` is the same round through
//! the real stack; the ratio of the two is what the stack costs over the kernel.
use std::net::SocketAddr;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bytes of one message: about an `EpochCommand` or `EpochEvent` of a no-op round.
const MSG: usize = 96;
/// Barriers of one round: initial synchronization, quiesce, checkpoint, resume, finalize.
const BARRIERS: usize = 5;

/// Agents answering every message on `n` connections, on a thread of their own; the thread ends
/// when the coordinator's side closes them.
fn agents(n: usize) -> (SocketAddr, std::thread::JoinHandle<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = TcpListener::from_std(listener).unwrap();
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..n {
                let (mut s, _) = listener.accept().await.unwrap();
                s.set_nodelay(true).unwrap();
                tasks.spawn(async move {
                    let mut b = [0u8; MSG];
                    while s.read_exact(&mut b).await.is_ok() {
                        if s.write_all(&b).await.is_err() {
                            break;
                        }
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
        });
    });
    (addr, thread)
}

/// One round: `BARRIERS` times, a message to every agent, then every answer.
async fn round(conns: &mut [TcpStream]) {
    for _ in 0..BARRIERS {
        let out = [1u8; MSG];
        for c in conns.iter_mut() {
            c.write_all(&out).await.unwrap();
        }
        let mut back = [0u8; MSG];
        for c in conns.iter_mut() {
            c.read_exact(&mut back).await.unwrap();
        }
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("transport_floor");
    g.sample_size(20);
    for n in [16usize, 256, 1024] {
        let (addr, thread) = agents(n);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut conns: Vec<TcpStream> = rt.block_on(async {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                let s = TcpStream::connect(addr).await.unwrap();
                s.set_nodelay(true).unwrap();
                v.push(s);
            }
            v
        });
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| rt.block_on(round(&mut conns)))
        });
        drop(conns);
        thread.join().unwrap();
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
