#!/usr/bin/env python3
"""What `[flush] compress` buys: bytes written to shared storage and flush time, per setting.

What it measures
----------------
For each job (the 4-rank MPICH `heat N` program at each grid size, ~50/150/500 MB, and
`memwrite MIB`, whose memory is random data) and each setting of the agent's `[flush] compress`
(none, zstd:1, zstd:3 by default), a private `ckptd --standalone` with a `shared_dir` runs the
job, takes one checkpoint once it printed two progress lines, and waits until that epoch's flush
is durable. The first epoch of a job has nothing to deduplicate against, so every chunk is
new: the table gives the image bytes, the bytes written to shared storage, their ratio, the
flush time (`flush_ms`: the copy of the whole node directory, every byte read and checked,
chunked, compressed and fsynced) and the image bytes per second of that flush. Every setting
runs the same job afresh, one after the other.

How to run (root, CRIU >= 4.2, cgroup v1 freezer, MPICH; binaries already built):

    benches/compress.py --quick                          # heat 1000 and memwrite 64, none/zstd:3
    benches/compress.py --out benches/results/compress-$(date +%F).md

Options: --sizes N1,N2,.. (1000,2650,5400)  --mib MIB (512)  --settings S1,S2,..
(none,zstd:1,zstd:3)  --bin-dir DIR  --out FILE  --keep. Every wait is bounded; jobs and ckptd
are stopped by PID, cgroups removed.
"""

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import (  # noqa: E402
    REPO, Daemon, common_args, emit, keep_or_remove, log, machine_info, mono,
    progress_lines, run, stage, wait_until)


def one(tmp, bindir, setting, cmd, n):
    """Runs `cmd` under a fresh ckptd flushing with `setting`; checkpoints once; returns the
    epoch's (image bytes, shared bytes, flush ms)."""
    shared = os.path.join(tmp, f"shared-{n}")
    os.mkdir(shared)
    d = Daemon(tmp, bindir, "flush", shared, 0, compress=setting)
    jid = None
    try:
        jid = d.ctl("run", "--", *cmd, timeout=60)[0].stdout.strip().split()[-1]
        stdout = os.path.join(d.dir, "state", "jobs", jid, "stdout")
        wait_until(lambda: progress_lines(stdout) >= 2, 300, "two progress lines of the job")
        e = json.loads(d.ctl("--json", "checkpoint", jid, "--wait")[0].stdout)
        x = d.wait_durable(jid, e["epoch"], 900, 0.1)
        return x["image_bytes"], x["shared_bytes"], x["flush_ms"]
    finally:
        d.stop(jid)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,2650,5400")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--settings", default="none,zstd:1,zstd:3")
    common_args(ap)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("must run as root (CRIU, cgroups)")
    if args.quick:
        args.sizes, args.mib, args.settings = "1000", 64, "none,zstd:3"
    sizes = [int(s) for s in args.sizes.split(",") if s]
    settings = [s for s in args.settings.split(",") if s]
    tmp = tempfile.mkdtemp(prefix="ckpt-compress-", dir="/var/tmp")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = mono()
    rows = []
    try:
        bindir, heat = stage(tmp, args.bin_dir, "heat.mpich")
        memwrite = os.path.join(os.path.dirname(heat), "memwrite")
        run(["make", "-s", "-C", os.path.join(REPO, "tests", "apps"),
             f"OUT={os.path.dirname(heat)}", memwrite], timeout=300)
        jobs = [(f"heat {n} (MPICH, 4 ranks)",
                 ["mpiexec.mpich", "-n", "4", heat, str(n), "4000", "10000"]) for n in sizes]
        jobs.append((f"memwrite {args.mib} MiB (random data)",
                     [memwrite, str(args.mib), "10", "1000", "2000"]))
        k = 0
        for name, cmd in jobs:
            for s in settings:
                k += 1
                image, shared, ms = one(tmp, bindir, s, cmd, k)
                rows.append((name, s, image, shared, ms))
                log(f"{name}, {s}: {image / 2**20:.1f} MiB image, {shared / 2**20:.1f} MiB "
                    f"written, flush {ms} ms")
        criu_v, _, mem = machine_info(args.criu)
        table = (
            f"Command: `{shlex.join(sys.argv)}`  \n"
            f"Machine: CRIU {criu_v}, {mem} MiB RAM, {os.cpu_count()} CPUs; shared_dir on the "
            "same disk as local staging, no bandwidth limit, 4 streams.  \n"
            "First epoch of each job (every chunk new); one run per row.\n\n"
            "| job | compress | image MiB | written MiB | written ÷ image | flush ms | image MB/s |\n"
            "| --- | --- | --- | --- | --- | --- | --- |\n"
            + "".join(f"| {j} | {s} | {b / 2**20:,.1f} | {w / 2**20:,.1f} | {w / b:.2f} | {ms} | "
                      f"{b / 1e6 / (ms / 1000):,.0f} |\n" for j, s, b, w, ms in rows if b and ms)
            + f"\nWall time {(mono() - t0) / 60:.1f} min.\n")
        emit(table, args.out)
        return 0
    finally:
        keep_or_remove(tmp, args.keep)


if __name__ == "__main__":
    sys.exit(main())
