#!/usr/bin/env python3
"""Frozen time of checkpoints taken while earlier epochs flush to shared storage, vs no flush.

What it measures
----------------
A 4-rank MPICH `heat N ITERS SLEEP_US` job (tests/apps) under a private `ckptd --standalone`,
checkpointed K times back to back (`ckptctl checkpoint --wait --json`, GAP seconds apart), in
two modes that alternate for R rounds, each round with a fresh ckptd and job:

* `no flush`: `[flush] every = 0`; images stay in node-local staging.
* `flush`: the agent has `shared_dir` on a separate file system (a loop-mounted ext4 image) and
  `[flush] every = 1`, `bandwidth_mb = BW`: every committed epoch is copied there in the
  background (deduplicated: only chunks the previous epoch lacks are written, at most BW MB/s),
  so each next checkpoint is taken while the previous epochs are still being flushed (the table
  counts how many were). The agent pauses its background copies while a job is frozen.

It reports the median (min-max) frozen time and checkpoint total time per mode, the ratio of
the medians (target: frozen with flush / without <= 1.05) and the flush throughput reached
(image bytes / flush time of each durable epoch).

How to run (root, Debian 12, cgroup v1 freezer, CRIU >= 4.2, MPICH; binaries already built):

    benches/flush_frozen.py --quick                       # N=1000, K=3, R=1
    benches/flush_frozen.py --out benches/results/flush_frozen-$(date +%F).md

Options: --size N (default 2650, ~150 MB of images)  --repeats K (5)  --rounds R (2)
--gap S (1.0)  --bandwidth-mb BW (50)  --bin-dir DIR (default target/release; copied first)
--out FILE  --keep. Every wait is bounded; every process the benchmark starts is stopped by PID,
its cgroups removed and the loop mount unmounted, also on errors.
"""

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import (  # noqa: E402
    BenchError, Daemon, common_args, emit, fmt, keep_or_remove, log, machine_info, med, mono,
    record_checkpoint, run, stage, wait_first_lines, wait_until,
)


def mm(xs):
    return "–" if not xs else f"{fmt(med(xs))} ({fmt(min(xs))}–{fmt(max(xs))})"


def one_round(mode, args, tmp, bindir, shared, app, iters, res):
    d = Daemon(tmp, bindir, mode, shared, args.bandwidth_mb)
    jid = None
    try:
        cmd = ["mpiexec.mpich", "-n", "4", app, str(args.size), str(iters), str(args.sleep_us)]
        jid = d.ctl("run", "--", *cmd, timeout=60)[0].stdout.strip().split()[-1]
        wait_first_lines(os.path.join(d.dir, "state", "jobs", jid, "stdout"), 2, 120, f"job {jid}")
        for i in range(args.repeats):
            before = d.epochs(jid)
            busy = any(e.get("storage") == "flushing" for e in before)
            e = json.loads(d.ctl("--json", "checkpoint", jid, "--wait")[0].stdout)
            record_checkpoint(res, e)
            res["during_flush"] += int(busy)
            log(f"{mode}: epoch {e['epoch']}: frozen {e['frozen_ms']} ms, total {e['total_ms']} ms, "
                f"{int(e['image_bytes']) / 2**20:.0f} MiB{' (a flush was running)' if busy else ''}")
            time.sleep(args.gap)
        if mode == "flush":
            def all_durable():
                es = [e for e in d.epochs(jid) if e["state"] == "committed"]
                if any(e["storage"] == "flush-failed" for e in es):
                    raise BenchError(f"a flush failed: {es}")
                return es if all(e["storage"] in ("durable", "shared-only") for e in es) else None
            timeout = 120 + 3 * args.repeats * max(res["bytes"]) / (args.bandwidth_mb * 1e6)
            for e in wait_until(all_durable, timeout, "every epoch to be durable", 0.5):
                if e["flush_ms"]:
                    # What reached shared storage (deduplicated), per second of flush.
                    res["flush_mbps"].append(e["shared_bytes"] / 1e6 / (e["flush_ms"] / 1000.0))
                    res["shared"].append(e["shared_bytes"])
    finally:
        d.stop(jid)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=2650)
    ap.add_argument("--repeats", type=int, default=5, metavar="K")
    ap.add_argument("--rounds", type=int, default=2, metavar="R")
    ap.add_argument("--gap", type=float, default=1.0)
    ap.add_argument("--bandwidth-mb", type=int, default=50)
    ap.add_argument("--sleep-us", type=int, default=20000)
    common_args(ap)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("must run as root (CRIU, cgroups, loop mount)")
    if args.quick:
        args.size, args.repeats, args.rounds = 1000, 3, 1
    # Long enough that the job outlives every checkpoint: ~ (K * (gap + 3 s)) * rounds margin.
    iters = math.ceil((args.repeats * (args.gap + 4.0) + 60) / (args.sleep_us / 1e6))
    tmp = tempfile.mkdtemp(prefix="ckpt-fbench-", dir="/var/tmp")
    shared = os.path.join(tmp, "shared")
    mounted = False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {m: {"frozen": [], "total": [], "bytes": [], "during_flush": 0, "flush_mbps": [],
                   "shared": []}
               for m in ("no flush", "flush")}
    t0 = mono()
    try:
        bindir, app = stage(tmp, args.bin_dir, "heat.mpich")
        img = os.path.join(tmp, "shared.img")
        os.mkdir(shared)
        run(["truncate", "-s", "8G", img], timeout=30)
        run(["mkfs.ext4", "-q", "-F", img], timeout=120)
        run(["mount", "-o", "loop", img, shared], timeout=30)
        mounted = True
        for r in range(args.rounds):
            for mode in (("no flush", "flush") if r % 2 == 0 else ("flush", "no flush")):
                log(f"=== round {r + 1}: {mode}")
                one_round(mode, args, tmp, bindir, shared, app, iters, results[mode])
        a, b = results["no flush"], results["flush"]
        ratio = med(b["frozen"]) / med(a["frozen"]) if a["frozen"] and b["frozen"] else float("nan")
        criu_v, mpich_v, mem = machine_info(args.criu)
        table = (
            f"Command: `{shlex.join(sys.argv)}`  \n"
            f"Machine: CRIU {criu_v}, MPICH {mpich_v}, {mem} MiB RAM, {os.cpu_count()} CPUs.  \n"
            f"Job: 4-rank MPICH heat N={args.size}; K={args.repeats} checkpoints {args.gap:g} s apart "
            f"per round, {args.rounds} round(s) per mode, modes alternating; flush limited to "
            f"{args.bandwidth_mb} MB/s into a loop-mounted ext4 on the same disk.\n\n"
            "| mode | frozen ms, median (min–max) | checkpoint total ms | image MiB | "
            "written to shared MiB | checkpoints taken during a flush | flush MB/s written |\n"
            "| --- | --- | --- | --- | --- | --- | --- |\n"
            f"| no flush | {mm(a['frozen'])} | {mm(a['total'])} | {fmt(med(a['bytes']) / 2**20)} | – | – | – |\n"
            f"| flush | {mm(b['frozen'])} | {mm(b['total'])} | {fmt(med(b['bytes']) / 2**20)} | "
            f"{fmt(med(b['shared']) / 2**20) if b['shared'] else '–'} | "
            f"{b['during_flush']} of {len(b['frozen'])} | {mm(b['flush_mbps'])} |\n\n"
            f"Frozen time with flush / without: **{ratio:.2f}** (target ≤ 1.05). "
            f"Wall time {(mono() - t0) / 60:.1f} min.\n")
        emit(table, args.out)
        return 0
    finally:
        if mounted:
            subprocess.run(["umount", shared], check=False)
        keep_or_remove(tmp, args.keep)


if __name__ == "__main__":
    sys.exit(main())
