#!/usr/bin/env python3
"""Runs inside one test guest for benches/precopy_storage.sh (the guest's kernel tracks written
pages; the host's does not): peak write bandwidth to storage during the checkpoints of a 3-node
job, without pre-copy and with staggered pre-copy, and the bytes each epoch writes.

Three test nodes and one ckptd with an agent per node, set up by benches/multinode_vs_criu.py
(network + UTS namespaces, cluster CA, enrollment, configs, clean-up). Both modes run the same
job: `ckptctl run --node n1 -- mpiexec.mpich -hosts <n1,n2,n3> -n 3 memwrite MIB PCT STEPS
SLEEP_MS` (one tests/apps/memwrite per node, each holding MIB MiB and rewriting PCT % of it per
step; mpiexec reaches n2 and n3 through ckpt-rsh). Per mode the cluster is made afresh (the
agents' [precopy] differs) and the job checkpointed K+1 times (epoch 1 is a warm-up):
  none:    [precopy] enabled = false; each checkpoint GAP s after the previous commit (by
           default the median of that wait in the precopy mode, which runs first);
  precopy: [precopy] enabled, first_after F, stagger S (part k pre-dumps k*S later),
           check_every 200ms, min_interval 1h (one full pre-dump per node per epoch); each
           checkpoint once every node has a pre-dump ready and one more step ran.
Partner copies are off ([redundancy] partner = false) and nothing is flushed unless --shared
(then every epoch is flushed to one shared dir, reported separately); keep_local = 2.

A thread scans every node's local_dir (and the shared dir) every --every-ms ms and keeps, per
file (device, inode), the largest size seen, filed under what it was when first seen: a
pre-dump (<job>/.precopy/...), the node's checkpoint (<job>/<epoch>/<node>/...), a partner copy,
or shared. The sum of those sizes is the bytes written so far: deleted files (retention) and
renames (pre-dumps moved into the epoch) change nothing. From it: peak write bandwidth over a
sliding window (250 ms and 1 s) during each checkpoint (`ckptctl checkpoint` start to its
return at commit; only bytes written in that span) and overall (measured epochs, pre-dumps
included), and the bytes each epoch wrote (checkpoint vs pre-dumps).

Prints "GUEST ..." (machine), "RUN ..." (one line per measured epoch), "PRE ..." (pre-dump
windows per node and epoch) and "REPORT ..." lines (the table); the host script collects them.
Standard library only; every wait bounded; every process, namespace and cgroup it makes is
removed, also on errors.
"""

import argparse
import bisect
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchutil import (  # noqa: E402
    FREEZER, BenchError, cg_pids, log, machine_info, mono, progress_lines,
    read_text, require_root_and_freezer, run, wait_until)
from multinode_vs_criu import (  # noqa: E402
    ANSI, Ckpt, Cluster, stage_bins, stop_on_signals, teardown)

MiB = 2 ** 20
WINDOWS = (0.25, 1.0)


# ---------------------------------------------------------------- guest set-up

def guest_setup(work, size):
    """The guest mounts only cgroup v2 at /sys/fs/cgroup; the helpers (and the host) use the v1
    freezer at /sys/fs/cgroup/freezer: lay out the host's hybrid hierarchy. Staging goes to a
    tmpfs of its own (the guest's root is a 1 GiB tmpfs overlay)."""
    if not os.path.exists(os.path.join(FREEZER, "cgroup.procs")):
        run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=755", "cgroup_root", "/sys/fs/cgroup"], 30)
        os.makedirs(FREEZER)
        run(["mount", "-t", "cgroup", "-o", "freezer", "freezer", FREEZER], 30)
        os.makedirs("/sys/fs/cgroup/unified")
        run(["mount", "-t", "cgroup2", "cgroup2", "/sys/fs/cgroup/unified"], 30)
    os.makedirs(work, exist_ok=True)
    run(["mount", "-t", "tmpfs", "-o", f"size={size}", "precopystorage", work], 30)


# ---------------------------------------------------------------- storage sampler

class StorageSampler(threading.Thread):
    """Every `every` s: scans each node's local_dir and the shared dir; cumulative bytes written
    per (node, kind), kind one of pre, ckpt, partner, shared (see the module doc)."""

    def __init__(self, roots, every):
        super().__init__(daemon=True)
        self.roots = roots  # [(node name or "shared", path)]
        self.every = every
        self.stop = threading.Event()
        self.seen = {}  # (dev, ino) -> [key, max size]
        self.totals = {}
        self.samples = []  # (t, {key: bytes})
        self.scan_s = []
        self.lock = threading.Lock()

    @staticmethod
    def kind(node, rel):
        if node == "shared":
            return "shared"
        parts = rel.split(os.sep)
        if len(parts) >= 2 and parts[1] == ".precopy":
            return "pre"
        if len(parts) >= 3 and parts[1].isdigit():
            return "ckpt" if parts[2] == node else "partner"
        return "other"

    def scan(self):
        for node, root in self.roots:
            stack = [""]
            while stack:
                rel = stack.pop()
                try:
                    it = os.scandir(os.path.join(root, rel) if rel else root)
                except OSError:
                    continue
                with it:
                    for e in it:
                        r = os.path.join(rel, e.name) if rel else e.name
                        try:
                            if e.is_dir(follow_symlinks=False):
                                stack.append(r)
                                continue
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        ent = self.seen.get((st.st_dev, st.st_ino))
                        if ent is None:
                            ent = self.seen[(st.st_dev, st.st_ino)] = [(node, self.kind(node, r)), 0]
                        if st.st_size > ent[1]:
                            self.totals[ent[0]] = self.totals.get(ent[0], 0) + st.st_size - ent[1]
                            ent[1] = st.st_size

    def run(self):
        nxt = mono()
        while not self.stop.is_set():
            with self.lock:
                t0 = mono()
                self.scan()
                t1 = mono()
                self.samples.append((t1, dict(self.totals)))
                self.scan_s.append(t1 - t0)
            nxt = max(nxt + self.every, t1)
            self.stop.wait(max(0.0, nxt - mono()))

    def mark(self):
        """One scan now (from the caller's thread, under the lock): the state at this instant."""
        with self.lock:
            self.scan()
            self.samples.append((mono(), dict(self.totals)))

    def series(self, pick):
        """(times, cumulative bytes) of the keys `pick` accepts."""
        with self.lock:
            ts = [t for t, _ in self.samples]
            cs = [sum(v for k, v in d.items() if pick(k)) for _, d in self.samples]
        return ts, cs


def cum_at(ts, cs, t):
    """Cumulative bytes at time t, linear between samples."""
    if not ts or t <= ts[0]:
        return cs[0] if cs else 0
    if t >= ts[-1]:
        return cs[-1]
    i = bisect.bisect_right(ts, t)
    t0, t1, c0, c1 = ts[i - 1], ts[i], cs[i - 1], cs[i]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1


def peak(ts, cs, w, lo, hi):
    """Peak bytes/s over any window of w s, counting only bytes written in [lo, hi]."""
    cands = [t for t in ts if lo <= t <= hi + w] + [lo + w, hi, hi + w]
    best = 0.0
    for t in cands:
        a, b = max(t - w, lo), min(t, hi)
        if b > a:
            best = max(best, (cum_at(ts, cs, b) - cum_at(ts, cs, a)) / w)
    return best


def growth_span(ts, cs, lo, hi):
    """(first, last) sample time in [lo, hi] at which the series grew; None if it did not."""
    first = last = None
    for i in range(1, len(ts)):
        if lo <= ts[i] <= hi and cs[i] > cs[i - 1]:
            first = ts[i - 1] if first is None else first
            last = ts[i]
    return None if first is None else (first, last)


# ---------------------------------------------------------------- ckptd and agents

class StorageCkpt(Ckpt):
    """multinode_vs_criu's ckptd + agents, with this benchmark's [precopy], retention and no
    partner copies."""

    def __init__(self, tmp, bindir, criu, cluster, args, precopy):
        super().__init__(tmp, bindir, criu, cluster, tls=True, shared=args.shared)
        self.args = args
        self.precopy = precopy

    def write_ckptd_config(self):
        super().write_ckptd_config()  # top-level keys only: the tables follow them
        with open(self.cfg, "a") as f:
            f.write(f"[retention]\nkeep_local = {self.args.keep_local}\n"
                    "[redundancy]\npartner = false\n"
                    f"[flush]\nevery = {1 if self.args.shared else 0}\n")

    def write_agent_config(self, node):
        acfg = super().write_agent_config(node)
        a = self.args
        with open(acfg, "a") as f:
            if self.precopy:
                f.write(f'[precopy]\nenabled = true\nfirst_after = "{a.first_after}s"\n'
                        f'stagger = "{a.stagger}s"\ncheck_every = "200ms"\nmin_interval = "1h"\n')
            else:
                f.write("[precopy]\nenabled = false\n")
        return acfg


# ---------------------------------------------------------------- one mode

def snapshot_modes(ckpt, jid):
    return {n.get("node"): n.get("snapshot_mode", "") for n in ckpt.status(jid).get("nodes", [])}


def run_mode(mode, args, bindir, app, work, gap):
    precopy = mode == "precopy"
    stop_on_signals()
    tmp = tempfile.mkdtemp(prefix=f"ckpt-bench-ps-{mode}-", dir=work)
    cluster = Cluster(3)
    ckpt = None
    res = {"mode": mode, "epochs": [], "pre": [], "notes": []}
    sampler = StorageSampler([], args.every_ms / 1000.0)
    try:
        cluster.create()
        ckpt = StorageCkpt(tmp, bindir, args.criu, cluster, args, precopy)
        ckpt.start()
        nodes = cluster.nodes
        sampler.roots = [(nd.name, os.path.join(nd.dir, "local")) for nd in nodes]
        if ckpt.shared:
            sampler.roots.append(("shared", ckpt.shared))
        sampler.start()
        hosts = ",".join(nd.ip for nd in nodes)
        cmd = ["mpiexec.mpich", "-hosts", hosts, "-n", "3", app, str(args.mib), str(args.pct),
               "1000000", str(args.sleep_ms)]
        jid = ckpt.run_job("memwrite", "n1", cmd)
        stdout = os.path.join(nodes[0].dir, "state", "jobs", jid, "stdout")
        stderr = os.path.join(nodes[0].dir, "state", "jobs", jid, "stderr")
        log(f"{mode}: job {jid}: {shlex.join(cmd)}")

        def started():
            st = str(ckpt.status(jid).get("state", ""))
            if st and not st.startswith("running"):
                raise BenchError(f"job {jid} is {st!r}: {read_text(stderr)[-800:]}")
            return progress_lines(stdout) >= 3
        wait_until(started, 300, f"job {jid}: a first step on every node", 0.5)
        for nd in nodes:
            cg = nd.cgroup(jid)
            wait_until(lambda: len(cg_pids(cg)) >= 2, 60, f"processes in {cg}", 0.2)
        res["procs"] = {nd.name: len(cg_pids(nd.cgroup(jid))) for nd in nodes}
        log(f"{mode}: job {jid} running; processes per node {res['procs']}")
        if precopy:
            log(f"{mode}: snapshot modes {snapshot_modes(ckpt, jid)}")

        prev_end = mono()
        for i in range(args.k + 1):
            if precopy:
                def ready():
                    m = snapshot_modes(ckpt, jid)
                    bad = [f"{n}: {s}" for n, s in m.items() if "full dumps" in s]
                    if bad:
                        raise BenchError(f"pre-copy is off for the job: {bad}")
                    return len(m) == 3 and all("ready" in s for s in m.values())
                wait_until(ready, 300, f"a pre-dump on every node before checkpoint {i + 1}", 0.5)
                n0 = progress_lines(stdout)
                wait_until(lambda: progress_lines(stdout) >= n0 + 3, 60, "one more step", 0.1)
            else:
                time.sleep(max(0.0, prev_end + gap - mono()))
            sampler.mark()
            t0 = mono()
            p, wall = ckpt.ctl_json("checkpoint", jid, "--wait")
            t1 = mono()
            sampler.mark()
            e = json.loads(p.stdout.strip().splitlines()[-1])
            if e.get("state") not in (None, "committed"):
                raise BenchError(f"epoch not committed: {e}")
            ep = {"epoch": e.get("epoch"), "t0": t0, "t1": t1, "start": prev_end,
                  "frozen_ms": float(e["frozen_ms"]), "total_ms": float(e["total_ms"]),
                  "image_bytes": int(e["image_bytes"]), "wall_ms": wall * 1000.0,
                  "period": t1 - prev_end}
            res["epochs"].append(ep)
            log(f"{mode}: epoch {ep['epoch']}: frozen {ep['frozen_ms']:.0f} ms, total "
                f"{ep['total_ms']:.0f} ms, image {ep['image_bytes'] / MiB:.1f} MiB, "
                f"ckptctl {wall:.1f} s, period {ep['period']:.1f} s")
            prev_end = t1
        st = str(ckpt.status(jid).get("state", "?"))
        if not st.startswith("running"):
            raise BenchError(f"job {jid} is {st!r} after the measurements")
        res["pre_dumped"] = {}
        for nd in nodes:
            text = ANSI.sub("", read_text(os.path.join(tmp, f"agent-{nd.name}.log")))
            res["pre_dumped"][nd.name] = [l for l in text.splitlines() if "pre-dumped" in l]
        ckpt.cancel(jid, nodes)
        sampler.stop.set()
        sampler.join(timeout=30)
        errs = []
        for name in ["ckptd"] + [f"agent-{nd.name}" for nd in nodes]:
            text = ANSI.sub("", read_text(os.path.join(tmp, f"{name}.log")))
            errs += [f"{name}: {l.strip()[:300]}" for l in text.splitlines()
                     if " ERROR " in l or " WARN " in l]
        res["log_errors"] = errs
    except Exception as e:  # noqa: BLE001 - reported with the logs, the other mode still runs
        res["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, BenchError) else str(e)
        log(f"{mode} FAILED: {e}")
        for name in ["ckptd"] + [f"agent-{nd.name}" for nd in cluster.nodes]:
            for l in ANSI.sub("", read_text(os.path.join(tmp, f"{name}.log"))).splitlines()[-15:]:
                print(f"LOG {name}: {l[:400]}", flush=True)
    finally:
        teardown(ckpt, sampler, tmp, cluster, args.keep)
    res["sampler"] = sampler
    return res


# ---------------------------------------------------------------- analysis and report

def analyse(res):
    s = res["sampler"]
    local = s.series(lambda k: k[0] != "shared")
    by = {kind: s.series(lambda k, kind=kind: k[1] == kind) for kind in ("pre", "ckpt", "partner", "shared", "other")}
    shared = by["shared"]
    eps = res["epochs"][1:]  # epoch 1: warm-up
    out = {"epochs": []}
    for ep in eps:
        row = dict(ep)
        for w in WINDOWS:
            row[f"ck_local_{w}"] = peak(*local, w, ep["t0"], ep["t1"])
            row[f"ck_shared_{w}"] = peak(*shared, w, ep["t0"], ep["t1"])
        for kind, (ts, cs) in by.items():
            row[kind] = cum_at(ts, cs, ep["t1"]) - cum_at(ts, cs, ep["start"])
        row["local"] = row["pre"] + row["ckpt"] + row["partner"] + row["other"]
        row["pre_spans"] = {}
        for node in ("n1", "n2", "n3"):
            ts, cs = s.series(lambda k, node=node: k == (node, "pre"))
            row["pre_spans"][node] = growth_span(ts, cs, ep["start"], ep["t0"])
        out["epochs"].append(row)
    if eps:
        lo, hi = eps[0]["start"], eps[-1]["t1"]
        for w in WINDOWS:
            out[f"all_local_{w}"] = peak(*local, w, lo, hi)
            out[f"all_shared_{w}"] = peak(*shared, w, lo, hi)
            out[f"pre_local_{w}"] = peak(*by["pre"], w, lo, hi)
    ivals = [b - a for (a, _), (b, _) in zip(s.samples, s.samples[1:])]
    out["interval_ms"] = (statistics.median(ivals) * 1000 if ivals else 0, max(ivals) * 1000 if ivals else 0)
    out["scan_ms"] = (statistics.median(s.scan_s) * 1000 if s.scan_s else 0, max(s.scan_s) * 1000 if s.scan_s else 0)
    return out


def overlaps(spans):
    xs = sorted(v for v in spans.values() if v)
    return any(b[0] < a[1] for a, b in zip(xs, xs[1:]))


def med(rows, key):
    xs = [r[key] for r in rows]
    return statistics.median(xs) if xs else 0.0


def report(results, args):
    lines = []
    an = {r["mode"]: analyse(r) for r in results if r["epochs"]}
    for r in results:
        a = an.get(r["mode"])
        if not a:
            continue
        for row in a["epochs"]:
            st = row["start"]
            spans = " ".join(f"{n}=" + ("-" if not v else f"{v[0] - st:.1f}..{v[1] - st:.1f}s")
                             for n, v in row["pre_spans"].items())
            print(f"RUN mode={r['mode']} epoch={row['epoch']} period_s={row['period']:.1f} "
                  f"ckpt_ms={(row['t1'] - row['t0']) * 1000:.0f} frozen_ms={row['frozen_ms']:.0f} total_ms={row['total_ms']:.0f} "
                  f"image_bytes={row['image_bytes']} ckpt_bytes={row['ckpt']:.0f} pre_bytes={row['pre']:.0f} "
                  f"partner_bytes={row['partner']:.0f} shared_bytes={row['shared']:.0f} other_bytes={row['other']:.0f} "
                  + " ".join(f"peak_ckpt_{int(w * 1000)}ms_MiBps={row[f'ck_local_{w}'] / MiB:.1f}" for w in WINDOWS),
                  flush=True)
            print(f"PRE mode={r['mode']} epoch={row['epoch']} pre-dump writes (s after the previous commit; "
                  f"checkpoint at {row['t0'] - row['start']:.1f}s): {spans}"
                  f"{' OVERLAP' if overlaps(row['pre_spans']) else ''}", flush=True)
        for n, ls in r.get("pre_dumped", {}).items():
            for l in ls:
                m = re.search(r"link=(\d+).*bytes=(\d+).*ms=(\d+)", l)
                if m:
                    print(f"PRE mode={r['mode']} {n} agent: pre-dumped link={m.group(1)} bytes={m.group(2)} ms={m.group(3)}")

    def cell(mode, f):
        a = an.get(mode)
        return None if not a or not a["epochs"] else f(a)

    rows = [
        ("peak local write, 250 ms window, during checkpoint (MiB/s)", lambda a: med(a["epochs"], "ck_local_0.25") / MiB),
        ("peak local write, 1 s window, during checkpoint (MiB/s)", lambda a: med(a["epochs"], "ck_local_1.0") / MiB),
        ("peak local write, 250 ms window, overall incl. pre-dumps (MiB/s)", lambda a: a["all_local_0.25"] / MiB),
        ("peak local write, 1 s window, overall incl. pre-dumps (MiB/s)", lambda a: a["all_local_1.0"] / MiB),
        ("checkpoint bytes per epoch (MiB)", lambda a: med(a["epochs"], "ckpt") / MiB),
        ("pre-dump bytes per epoch (MiB)", lambda a: med(a["epochs"], "pre") / MiB),
        ("total local bytes per epoch (MiB)", lambda a: med(a["epochs"], "local") / MiB),
        ("image_bytes per epoch, as ckptctl reports (MiB)", lambda a: med(a["epochs"], "image_bytes") / MiB),
        ("frozen_ms", lambda a: med(a["epochs"], "frozen_ms")),
        ("checkpoint time, ckptctl start to commit (ms)", lambda a: statistics.median(e["t1"] - e["t0"] for e in a["epochs"]) * 1000),
        ("period between checkpoints (s)", lambda a: med(a["epochs"], "period")),
    ]
    if args.shared:
        rows[4:4] = [
            ("peak shared write, 1 s window, during checkpoint (MiB/s)", lambda a: med(a["epochs"], "ck_shared_1.0") / MiB),
            ("peak shared write, 1 s window, overall (MiB/s)", lambda a: a["all_shared_1.0"] / MiB),
        ]
        rows.append(("shared bytes per epoch (flush; MiB)", lambda a: med(a["epochs"], "shared") / MiB))
    lines.append(f"Median over the {args.k} measured epochs (epoch 1 of each mode is a warm-up); "
                 f"3 nodes x memwrite {args.mib} MiB, {args.pct} % rewritten per {args.sleep_ms} ms step; "
                 f"pre-copy: first_after {args.first_after}s, stagger {args.stagger}s.")
    lines.append("")
    lines.append("| quantity | none | precopy | precopy / none |")
    lines.append("|---|---|---|---|")
    for name, f in rows:
        a, b = cell("none", f), cell("precopy", f)
        fa = "–" if a is None else f"{a:,.1f}"
        fb = "–" if b is None else f"{b:,.1f}"
        rt = "–" if a in (None, 0) or b is None else f"{b / a:.2f}"
        lines.append(f"| {name} | {fa} | {fb} | {rt} |")
    lines.append("")
    for mode, a in an.items():
        lines.append(f"{mode}: sampler interval median {a['interval_ms'][0]:.0f} ms (max {a['interval_ms'][1]:.0f}), "
                     f"scan median {a['scan_ms'][0]:.0f} ms (max {a['scan_ms'][1]:.0f}); "
                     f"peak of pre-dump writes alone: {a['pre_local_0.25'] / MiB:.1f} MiB/s (250 ms), "
                     f"{a['pre_local_1.0'] / MiB:.1f} MiB/s (1 s)")
    for r in results:
        if r.get("error"):
            lines.append(f"{r['mode']}: ERROR: {r['error']}")
        errs = r.get("log_errors", [])
        if errs:
            lines.append(f"{r['mode']}: ckptd/agent logs had {len(errs)} WARN/ERROR lines, e.g.:")
            lines += [f"    {l}" for l in errs[:6]]
        if r.get("procs"):
            lines.append(f"{r['mode']}: processes per node {r['procs']}")
    for l in lines:
        print(f"REPORT {l}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="dir of ckptd, ckptctl, ckpt-agent, ckpt-rsh")
    ap.add_argument("--app", required=True, help="the memwrite binary")
    ap.add_argument("--criu", default="/opt/ckpt/criu/bin/criu")
    ap.add_argument("--mib", type=int, default=160, help="MiB per node (one memwrite per node)")
    ap.add_argument("--pct", type=int, default=2, help="%% of it rewritten per step")
    ap.add_argument("--sleep-ms", type=int, default=1000, help="per step")
    ap.add_argument("--k", type=int, default=3, help="measured checkpoints per mode (plus a warm-up)")
    ap.add_argument("--first-after", type=float, default=10.0, help="[precopy] first_after, s")
    ap.add_argument("--stagger", type=float, default=3.0, help="[precopy] stagger, s")
    ap.add_argument("--gap", type=float, default=0,
                    help="none mode: s from a commit to the next checkpoint (0: as in the precopy mode)")
    ap.add_argument("--every-ms", type=float, default=50, help="sampling interval")
    ap.add_argument("--keep-local", type=int, default=2)
    ap.add_argument("--shared", action="store_true", help="flush every epoch to a shared dir")
    ap.add_argument("--tmpfs", default="3g", help="size of the staging tmpfs")
    ap.add_argument("--work", default="/tmp/precopy_storage")
    ap.add_argument("--guest-setup", action="store_true",
                    help="in the test guest: mount the v1 freezer and the staging tmpfs")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    if args.guest_setup:
        guest_setup(args.work, args.tmpfs)
    require_root_and_freezer()
    os.makedirs(args.work, exist_ok=True)
    criu_v, mpich_v, mem = machine_info(args.criu)
    print(f"GUEST kernel {os.uname().release}, {os.cpu_count()} vCPUs, {mem} MiB, CRIU {criu_v}, MPICH {mpich_v}",
          flush=True)
    p = subprocess.run([args.criu, "check", "--feature", "mem_dirty_track"], capture_output=True, timeout=60)
    if p.returncode != 0:
        print("GUEST no dirty tracking here", flush=True)
        return 3
    stage = tempfile.mkdtemp(prefix="stage-", dir=args.work)
    bindir, app = stage_bins(stage, args.bin, args.app)
    t_start = mono()
    results = []
    pre = run_mode("precopy", args, bindir, app, args.work, 0)
    results.append(pre)
    # the none mode waits as long after each commit as the precopy mode did (for its pre-dumps)
    gap = args.gap or (statistics.median(e["t0"] - e["start"] for e in pre["epochs"][1:])
                       if len(pre["epochs"]) > 1 else 15.0)
    log(f"none mode: each checkpoint {gap:.1f} s after the previous commit")
    results.append(run_mode("none", args, bindir, app, args.work, gap))
    results.reverse()
    report(results, args)
    print(f"REPORT guest part took {(mono() - t_start) / 60:.1f} min", flush=True)
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
