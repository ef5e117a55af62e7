#!/usr/bin/env python3
"""Bytes written to shared storage per epoch for a job that rewrites 10 % of its memory.

What it measures
----------------
`memwrite MIB 10 STEPS SLEEP_MS` (tests/apps: one process holding MIB MiB of random data that
rewrites one contiguous tenth of it per step) runs under a private `ckptd --standalone` whose
agent flushes every epoch to a `shared_dir`. K checkpoints are taken, each right after a step
(so exactly one step, 10 % of the memory, changes between two epochs), and each epoch's flush
is waited for. For every epoch the table gives the image bytes CRIU wrote, the bytes the flush
wrote to shared storage (new chunks only) and their ratio; the first epoch has nothing to
deduplicate against. Target: epochs after the first write <= 15 % of their image bytes.

How to run (root, CRIU >= 4.2, cgroup v1 freezer; binaries already built):

    benches/dedup_ratio.py --quick                      # 64 MiB, K=3
    benches/dedup_ratio.py --out benches/results/dedup_ratio-$(date +%F).md

Options: --mib MIB (512)  --repeats K (5)  --step-ms MS (4000)  --bin-dir DIR  --out FILE
--keep. Every wait is bounded; the job and ckptd are stopped by PID, cgroups removed.
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
    BenchError, Daemon, common_args, emit, keep_or_remove, log, machine_info, med, mono,
    progress_lines, stage, wait_until)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5, metavar="K")
    ap.add_argument("--step-ms", type=int, default=4000)
    common_args(ap)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("must run as root (CRIU, cgroups)")
    if args.quick:
        args.mib, args.repeats = 64, 3
    tmp = tempfile.mkdtemp(prefix="ckpt-dedup-", dir="/var/tmp")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = mono()
    d = None
    jid = None
    rows = []
    try:
        bindir, app = stage(tmp, args.bin_dir, "memwrite")
        shared = os.path.join(tmp, "shared")
        os.mkdir(shared)
        d = Daemon(tmp, bindir, "flush", shared, 0)
        steps = 2 * args.repeats + 10
        cmd = [app, str(args.mib), "10", str(steps), str(args.step_ms)]
        jid = d.ctl("run", "--", *cmd, timeout=60)[0].stdout.strip().split()[-1]
        stdout = os.path.join(d.dir, "state", "jobs", jid, "stdout")
        for i in range(args.repeats):
            # Right after a step: the next one lands between this checkpoint and the next.
            seen = progress_lines(stdout)
            wait_until(lambda: progress_lines(stdout) > seen, 60 + args.step_ms / 1000,
                       "a new step of the job")
            e = json.loads(d.ctl("--json", "checkpoint", jid, "--wait")[0].stdout)
            n = e["epoch"]
            x = d.wait_durable(jid, n, 600)
            rows.append((n, x["image_bytes"], x["shared_bytes"], x["flush_ms"]))
            log(f"epoch {n}: {x['image_bytes'] / 2**20:.1f} MiB image, "
                f"{x['shared_bytes'] / 2**20:.1f} MiB written to shared storage")
            if progress_lines(stdout) >= steps:
                raise BenchError("the job finished during the run; use a larger --step-ms")
        later = [w / b for _, b, w, _ in rows[1:] if b]
        criu_v, _, mem = machine_info(args.criu)
        table = (
            f"Command: `{shlex.join(sys.argv)}`  \n"
            f"Machine: CRIU {criu_v}, {mem} MiB RAM, {os.cpu_count()} CPUs.  \n"
            f"Job: memwrite {args.mib} MiB, 10 % rewritten per step, one step between epochs.\n\n"
            "| epoch | image MiB | written to shared MiB | % of image | flush ms |\n"
            "| --- | --- | --- | --- | --- |\n"
            + "".join(f"| {n} | {b / 2**20:,.1f} | {w / 2**20:,.1f} | {100 * w / b:.1f} % | {ms} |\n"
                      for n, b, w, ms in rows)
            + (f"\nEpochs after the first: median **{100 * med(later):.1f} %** of the image "
               f"written (target ≤ 15 %). " if later else "\n")
            + f"Wall time {(mono() - t0) / 60:.1f} min.\n")
        emit(table, args.out)
        return 0
    finally:
        if d is not None:
            d.stop(jid)
        keep_or_remove(tmp, args.keep)


if __name__ == "__main__":
    sys.exit(main())
