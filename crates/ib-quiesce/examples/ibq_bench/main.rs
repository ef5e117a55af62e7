//! ibq_bench: what ib-quiesce costs on a real verbs device (soft-RoCE `rxe0` in the test guest).
//!
//! One example binary, which `benches/ibq_rxe.sh` builds and runs in the guest: options, shared
//! helpers and the report here; the measurements in `sweep.rs` (1), `overhead.rs` (2) and
//! `noop.rs` (3).
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

mod noop;
mod overhead;
mod sweep;
use noop::*;
use overhead::*;
use sweep::*;

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

    print_tables(&rows, ov.as_ref(), o.ops);
    println!("BENCH wall_s={:.1}", begin.elapsed().as_secs_f64());
    if failed {
        std::process::exit(1);
    }
}

/// The results as markdown tables, between the markers benches/ibq_rxe.sh reads: the cycle's
/// steps per size (`rows`), and the post-and-poll overhead (`ov`, of `ops` operations).
fn print_tables(rows: &[(usize, usize, SweepResult)], ov: Option<&Overhead>, ops: usize) {
    println!("--- tables");
    println!(
        "| QPs and MRs per channel | reps | quiesce | raw release | rebuild | raw create | \
         reconnect | raw connect + receives |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (n, reps, r) in rows {
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
    if let Some(ov) = ov {
        println!();
        println!(
            "| path ({} signalled 64-byte RDMA writes, post then poll) | ns/op, median (min–max) \
             | in post_send, ns/op | polls/op |",
            ops
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
}
