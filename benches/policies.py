#!/usr/bin/env python3
"""How good `ckptctl estimate` is, and what periodic checkpoints (`--every 60s`, `--every auto`)
cost a running MPICH job (issue 16).

What it measures
----------------
Test hosts are made as multinode_vs_criu.py makes them (its Cluster, which follows
tests/src/netns.rs): a private bridge `ckbB<tag>` (10.250.<pid % 250>.254/24, no uplink) and per
host i = 1..K a network namespace `ckptB<tag>n<i>` with a veth (10.250.<pid % 250>.<i>/24) and a
persistent UTS namespace bound at /run/ckpt-uts/<ns>. One `ckptd` (not --standalone) listens on
the bridge address; one `ckpt-agent` per host runs inside the host's namespaces (`nsenter --net
--uts`), with mutual TLS set up as a site does it (`ckptd ca init`, then `ckptd ca issue n<i> |
ckpt-agent enroll -` before each agent starts) and `allow_root_jobs` (multinode_vs_criu's Ckpt).
On top of that every agent has one `shared_dir` (<tmp>/shared: a plain directory on the same disk
as the local staging, standing in for the NFS mount), so every epoch is flushed (ckptd's default
`flush.every = 1`) and has a time to durable; partner copies are on (the default), and ckptd.toml
sets `[policy] auto_first` (--auto-first, default 60s instead of the product's 10 min, so that
`--every auto` takes its first, measuring checkpoint within the run); everything else is default.

A. Estimate vs actual. For each node count k (--nodes, default 1,2,3,4) and each size (--sizes,
   default 50,150,400: resident MB per node aimed at), one job:

       ckptctl run --node n1 -- mpiexec.mpich -hosts <ip1,..,ipk> -n 2k heat G 10000000 SLEEP_US

   (2 ranks per host; G is chosen so that the grid, 16 G^2 bytes over k hosts, plus an assumed
   --mpi-overhead-mb per host hits the size; the resident memory per node actually used is the
   one `ckptctl estimate` reports). Once the ranks hold their whole grid (the sum of VmRSS of the
   `heat*` processes in the job's cgroups reaches 98 % of 16 G^2 bytes), the script takes 3
   checkpoints (`ckptctl checkpoint ID --wait --json`), each followed by a bounded wait until
   `ckptctl epochs ID --json` shows it "durable" (so that no flush overlaps the next epoch), then
   asks `ckptctl estimate ID --json` (3 committed epochs of its own: the estimate is fitted on
   this job only; all at one size, so the fit is proportional: time per byte of the three,
   weighted towards the latest, times the resident bytes now), then takes a 4th checkpoint the same way and compares:

       frozen   predicted.frozen_ms  vs the epoch's frozen_ms
       commit   predicted.commit_ms  vs finished_unix_ms - started_unix_ms (what the model fits;
                                        ckptctl's total_ms is shown beside it)
       durable  predicted.durable_ms vs the epoch's durable_ms (from its start until durable:
                                        partner copies, flush; what the model fits), and beside
                                        it the observed wall time from the `checkpoint` call
                                        until the script saw "durable" (0.1 s polling)

   error % = (predicted - actual) / actual * 100. The job is then cancelled (its processes
   SIGKILLed by PID from its cgroups) and its images (<shared>/<job>, <node>/local/<job>) deleted.
   With --reduced only k = 1..4 at the middle size and the three sizes at k = 2 are run.

B. Overhead of periodic checkpoints. On one host (--overhead-nodes, default 1: 2 ranks) the same
   job `heat G ITERS 0` (--overhead-size G, default 3000; no sleep, so the ranks compute all the
   time and a frozen second is a lost second) runs to its end three times: without a policy, with
   `--every 60s` (--every), and with `--every auto`. ITERS is calibrated first so that a run takes
   about --overhead-seconds (default 240): the same command is run directly (mpiexec on this
   machine, not under ckpt) and timed between its progress lines. Wall time = from just before
   `ckptctl run` until the "checksum" line appears in the job's stdout (polled every 50 ms);
   the job is cancelled if it has not exited 10 s after that (MPICH may hang in MPI_Finalize).
   `ckptctl status ID --json` (which carries what `ckptctl policy ID --json` shows) is asked
   every 15 s in every run (in each, so that it costs all runs the same); the report shows the
   last interval and reason seen while the job ran. Counted: the job's committed
   epochs (`ckptctl epochs`). Derived:

       overhead %            = (wall - wall without policy) / wall without policy * 100
       cost per checkpoint   = (wall - wall without policy) / checkpoints (seconds)
       overhead % per checkpoint-minute
                             = overhead % / (checkpoints / run minutes), i.e. the overhead
                               normalised to one checkpoint per minute of run; the issue's
                               target is <= 1 %.

   With --baseline-runs 2 the run without policy is repeated at the end, and the spread of the
   two baselines is reported as the noise floor (the overhead is then against their mean).

All hosts share this one machine (typically 2 cores) and its disk, so a checkpoint of k hosts is k
parallel dumps, k flushes and k partner copies on the same cores and disk.

How to run (root, Debian 12, cgroup v1 freezer, CRIU >= 4.2, MPICH, iproute2, nsenter, unshare;
binaries already built, target/apps/heat.mpich built):

    benches/policies.py --quick                       # smoke test: k=1,2, small sizes, 60 s runs
    benches/policies.py --bin-dir /tmp/benchbin --out benches/results/policies-$(date +%F).md

Options: --nodes 1,2,..  --sizes MB,..  --reduced  --est-sleep-us US (default 20000)
--mpi-overhead-mb MB (default 42)  --overhead-size G  --overhead-seconds S  --overhead-nodes K
--every INTERVAL  --auto-first DURATION  --baseline-runs 1|2  --skip-estimate  --skip-overhead
--quick  --out FILE  --json FILE (every sample)  --bin-dir DIR (ckptd, ckptctl, ckpt-agent,
ckpt-rsh; default target/release; copied to the temp dir first)  --app PATH (heat.mpich, default
target/apps/heat.mpich, also copied)  --criu PATH  --gap S  --wait-idle S  --keep (keep the temp
dir with logs). Standard library only. Every wait is bounded; every process the benchmark starts
is stopped by PID, and every cgroup, namespace, link and UTS bind mount it creates is removed,
also on errors and Ctrl-C.
"""

import argparse
import datetime
import json
import math
import os
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# the shared helpers live next to this script (benches/benchutil.py), the test hosts, ckptd and
# agent set-up in multinode_vs_criu.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import (  # noqa: E402
    REPO, BenchError, BusySampler, cg_pids, comm, emit, finished, log, machine_info, mono,
    notes_section, read_text, require_root_and_freezer, table_head, wait_idle, wait_until)
from multinode_vs_criu import (  # noqa: E402
    Ckpt, Cluster, busy_processes, default_criu, report_tail, stage_bins, stop_on_signals,
    teardown)

BIG_ITERS = 10_000_000  # part A: the job runs until it is cancelled


# ---------------------------------------------------------------- ckptd and agents

class PolicyCkpt(Ckpt):
    """multinode_vs_criu's ckptd + agents, with one shared_dir for every agent and
    `[policy] auto_first`."""

    def __init__(self, tmp, bindir, criu, cluster, auto_first):
        super().__init__(tmp, bindir, criu, cluster, tls=True, shared=True)
        self.auto_first = auto_first

    def write_ckptd_config(self):
        super().write_ckptd_config()  # top-level keys only: the table follows them
        with open(self.cfg, "a") as f:
            f.write(f'[policy]\nauto_first = "{self.auto_first}"\n')

    def jctl(self, verb, jid, *more, timeout=60):
        p, _ = self.ctl("--json", verb, jid, *more, timeout=timeout, check=False)
        if p.returncode != 0:
            raise BenchError(f"ckptctl {verb} {jid} (exit {p.returncode}): {p.stderr.strip()[-600:]}")
        return json.loads(p.stdout)

    def epoch(self, jid, n):
        for e in self.jctl("epochs", jid):
            if int(e.get("epoch", -1)) == n:
                return e
        return None

    def drop_images(self, jid):
        """Deletes a cancelled job's images (shared copy, local staging and partner copies)."""
        shutil.rmtree(os.path.join(self.shared, str(jid)), ignore_errors=True)
        for node in self.cluster.nodes:
            if node.dir:
                shutil.rmtree(os.path.join(node.dir, "local", str(jid)), ignore_errors=True)


def job_files(cluster, jid):
    d = os.path.join(cluster.nodes[0].dir, "state", "jobs", str(jid))
    return os.path.join(d, "stdout"), os.path.join(d, "stderr")


def start_job(ckpt, cluster, k, argv, extra=()):
    hosts = ",".join(nd.ip for nd in cluster.nodes[:k])
    cmd = ["mpiexec.mpich", "-hosts", hosts, "-n", str(2 * k), *argv]
    p, _ = ckpt.ctl("run", "--name", "heat", "--node", cluster.nodes[0].name, *extra, "--", *cmd,
                    timeout=60)
    jid = p.stdout.strip().split()[-1]
    ckpt.jobs.append(jid)
    return jid, cmd


def heat_rss(cluster, k, jid):
    """Bytes resident in the heat ranks of the job (VmRSS over its cgroups on the k hosts)."""
    total = 0
    for nd in cluster.nodes[:k]:
        for pid in cg_pids(nd.cgroup(jid)):
            if comm(pid).startswith("heat"):
                for line in read_text(f"/proc/{pid}/status").splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
    return total


def wait_durable(ckpt, jid, n, timeout=900):
    def durable():
        e = ckpt.epoch(jid, n)
        if e is None:
            return None
        if e.get("storage") == "flush-failed":
            raise BenchError(f"epoch {n} flush failed: {e.get('flush_detail') or e.get('reason')}")
        return e if e.get("storage") == "durable" else None
    return wait_until(durable, timeout, f"job {jid} epoch {n} to be durable", 0.1)


def checkpoint(ckpt, jid):
    """One `checkpoint --wait`, then the wait until durable: (epoch record, seconds from the
    call until durable was seen)."""
    t0 = mono()
    p, _ = ckpt.ctl_json("checkpoint", jid, "--wait")
    e = json.loads(p.stdout.strip().splitlines()[-1])
    if e.get("state") not in (None, "committed"):
        raise BenchError(f"epoch not committed: {e}")
    n = int(e["epoch"])
    rec = wait_durable(ckpt, jid, n)
    return rec, mono() - t0


def actual(rec, observed_s):
    commit = float(rec["finished_unix_ms"]) - float(rec["started_unix_ms"])
    durable = float(rec.get("durable_ms") or 0) or commit + float(rec.get("flush_ms") or 0)
    return {"epoch": rec["epoch"], "frozen": float(rec["frozen_ms"]), "commit": commit,
            "total": float(rec["total_ms"]), "durable": durable,
            "durable_observed": observed_s * 1000.0, "image_bytes": int(rec["image_bytes"]),
            "flush_ms": float(rec.get("flush_ms") or 0), "trigger": rec.get("trigger")}


# ---------------------------------------------------------------- part A

def grid_for(mb, k, overhead_mb):
    app = max(4.0, mb - overhead_mb) * 1e6 * k
    return max(100, int(math.sqrt(app / 16.0)) // 10 * 10)


def bench_estimate(ckpt, cluster, k, mb, args, app):
    g = grid_for(mb, k, args.mpi_overhead_mb)
    res = {"k": k, "target_mb": mb, "grid": g, "train": [], "notes": []}
    jid, cmd = start_job(ckpt, cluster, k, [app, str(g), str(BIG_ITERS), str(args.est_sleep_us)])
    res["job"] = jid
    stdout, stderr = job_files(cluster, jid)
    log(f"k={k} size {mb} MB: job {jid}: {shlex.join(cmd)}")
    try:
        need = 0.98 * 16.0 * g * g

        def ready():
            st = str(ckpt.status(jid).get("state", ""))
            if st and not st.startswith(("running", "starting")):
                raise BenchError(f"job {jid} is {st!r}: {read_text(stderr)[-800:]}")
            return heat_rss(cluster, k, jid) >= need
        wait_until(ready, 300, f"job {jid}: ranks holding their grid ({need / 2**20:.0f} MiB)", 0.2)
        time.sleep(args.gap)
        for i in range(3):
            rec, obs = checkpoint(ckpt, jid)
            a = actual(rec, obs)
            res["train"].append(a)
            log(f"k={k} {mb} MB: epoch {a['epoch']}: frozen {a['frozen']:.0f} ms, commit {a['commit']:.0f} ms, "
                f"durable {a['durable']:.0f} ms (seen after {a['durable_observed']:.0f} ms), "
                f"{a['image_bytes'] / 2**20:.1f} MiB")
            time.sleep(args.gap)
        est = ckpt.jctl("estimate", jid)
        if not est.get("known"):
            raise BenchError(f"estimate not known after 3 epochs: {est}")
        res["estimate"] = est
        pr = est["predicted"]
        log(f"k={k} {mb} MB: estimate ({est.get('basis')}), resident {est['resident_per_node_bytes'] / 2**20:.1f} "
            f"MiB/node: frozen {pr['frozen_ms']} commit {pr['commit_ms']} durable {pr.get('durable_ms')} ms")
        rec, obs = checkpoint(ckpt, jid)
        res["actual"] = actual(rec, obs)
        a = res["actual"]
        log(f"k={k} {mb} MB: epoch {a['epoch']} (checked): frozen {a['frozen']:.0f} ms, commit {a['commit']:.0f} ms, "
            f"durable {a['durable']:.0f} ms (seen after {a['durable_observed']:.0f} ms)")
        st = str(ckpt.status(jid).get("state", "?"))
        if finished(stdout) or not st.startswith("running"):
            res["notes"].append(f"job no longer running after the measurement (state {st!r})")
    finally:
        ckpt.cancel(jid, cluster.nodes[:k])
        ckpt.drop_images(jid)
    return res


# ---------------------------------------------------------------- part B

def calibrate(app, grid, seconds, tmp):
    """Iterations of `mpiexec.mpich -n 2 heat GRID ITERS 0` (run directly, not under ckpt) that
    take about `seconds`: (iters, seconds per iteration)."""
    iters = 200
    while True:
        span, per = run_direct(app, grid, iters, tmp)
        log(f"calibration: {iters} iterations, {span:.2f} s between first and last progress line "
            f"({per * 1000:.2f} ms/iteration)")
        if span >= 8.0 or iters >= 10**7:
            break
        iters = int(iters * max(2.0, 10.0 / max(span, 0.1)))
        iters = 20 * math.ceil(iters / 20)
    total = 20 * max(1, round(seconds / per / 20))
    return total, per


def run_direct(app, grid, iters, tmp):
    cmd = ["mpiexec.mpich", "-n", "2", app, str(grid), str(iters), "0"]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         start_new_session=True, cwd=tmp)
    marks = []
    buf = b""
    deadline = mono() + 300
    try:
        while mono() < deadline:
            r, _, _ = select.select([p.stdout], [], [], 0.5)
            if not r:
                if p.poll() is not None:
                    break
                continue
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                s = line.decode(errors="replace")
                if s.startswith("iter "):
                    marks.append((mono(), int(s.split()[1].split("/")[0])))
                if s.startswith("checksum"):
                    raise StopIteration
        raise BenchError(f"calibration run did not print its checksum: {shlex.join(cmd)}")
    except StopIteration:
        pass
    finally:
        if p.poll() is None:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # the process group of the mpiexec we started
                p.wait(timeout=10)
        p.stdout.close()
    if len(marks) < 3:
        raise BenchError(f"calibration: only {len(marks)} progress lines")
    (t0, i0), (t1, i1) = marks[0], marks[-1]
    return t1 - t0, (t1 - t0) / (i1 - i0)


def bench_overhead(ckpt, cluster, label, flags, args, app, iters):
    k = args.overhead_nodes
    res = {"label": label, "flags": flags, "notes": []}
    t0 = mono()
    jid, cmd = start_job(ckpt, cluster, k, [app, str(args.overhead_size), str(iters), "0"], flags)
    res["job"] = jid
    stdout, stderr = job_files(cluster, jid)
    log(f"overhead {label}: job {jid}: {shlex.join(cmd)} {' '.join(flags)}")
    try:
        limit = 3 * args.overhead_seconds + 120
        next_policy = mono() + 15
        pol = None
        marks = []  # (unix ms, iteration) of each progress line, as first seen
        seen = 0

        def done():
            nonlocal next_policy, pol, seen
            text = read_text(stdout)
            lines = text[:text.rfind("\n") + 1].splitlines()
            for line in lines[seen:]:
                if line.startswith("iter "):
                    marks.append((time.time() * 1000.0, int(line.split()[1].split("/")[0])))
            seen = len(lines)
            if "checksum" in text:
                return True
            if mono() >= next_policy:
                next_policy += 15
                j = ckpt.status(jid)  # same as `ckptctl policy JOB --json` without options
                st = str(j.get("state", ""))
                if st and not st.startswith(("running", "starting")):
                    raise BenchError(f"job {jid} is {st!r} before its checksum: {read_text(stderr)[-800:]}")
                if (j.get("policy") or {}).get("interval_s"):
                    pol = j["policy"]
            return False
        wait_until(done, limit, f"job {jid}: checksum line", 0.05)
        res["wall"] = mono() - t0
        p = ckpt.jctl("policy", jid)
        # once the job has ended its policy shows no interval: keep the last one seen running
        res["policy"] = pol or p.get("policy")
        try:
            wait_until(lambda: not str(ckpt.status(jid).get("state", "running")).startswith("running"),
                       10, f"job {jid} to exit after its checksum", 0.2)
        except BenchError:
            res["notes"].append("did not exit within 10 s of its checksum (MPI_Finalize); cancelled")
        eps = ckpt.jctl("epochs", jid)
        res["epochs"] = [{"epoch": e["epoch"], "state": e.get("state"), "trigger": e.get("trigger"),
                          "frozen": e.get("frozen_ms"), "total": e.get("total_ms"),
                          "storage": e.get("storage"), "flush_ms": e.get("flush_ms"),
                          "durable_ms": e.get("durable_ms"),
                          "started_unix_ms": e.get("started_unix_ms")} for e in eps]
        res["marks"] = marks
        res["within"] = within_run(marks, res["epochs"])
        log(f"overhead {label}: {res['wall']:.1f} s, {len(eps)} epochs "
            f"({', '.join(str(e.get('frozen_ms')) + ' ms' for e in eps)}); policy {res['policy']}")
    finally:
        ckpt.cancel(jid, cluster.nodes[:k])
        ckpt.drop_images(jid)
    return res


def within_run(marks, epochs):
    """What checkpoints cost inside one run, free of the drift between runs: the job's time per
    iteration between consecutive progress lines, the median of the intervals that saw no
    epoch start, and the time the intervals in which an epoch started took beyond that median
    (summed, then per checkpoint). Also the medians before the first and after the last epoch,
    which show a slowdown that outlasts the checkpoints."""
    iv = [(a[0], b[0], (b[0] - a[0]) / (b[1] - a[1]), b[1] - a[1])
          for a, b in zip(marks, marks[1:]) if b[1] > a[1]]
    starts = [float(e["started_unix_ms"]) for e in epochs if e.get("started_unix_ms")]
    if len(iv) < 3:
        return None
    hit = [any(t0 <= s < t1 for s in starts) for t0, t1, _, _ in iv]
    quiet = [per for (_, _, per, _), h in zip(iv, hit) if not h]
    if not quiet:
        return None
    med = statistics.median(quiet)
    excess = sum((t1 - t0) - med * n for (t0, t1, _, n), h in zip(iv, hit) if h)
    before = [per for t0, t1, per, _ in iv if not starts or t1 <= min(starts)]
    after = [per for t0, t1, per, _ in iv if starts and t0 >= max(starts)]
    return {"median_ms_per_iter": med, "excess_ms": excess, "intervals": len(iv),
            "hit": sum(hit), "checkpoints": len(starts),
            "per_checkpoint_ms": excess / len(starts) if starts else None,
            "before_ms_per_iter": statistics.median(before) if before else None,
            "after_ms_per_iter": statistics.median(after) if after else None}


# ---------------------------------------------------------------- report

def err(p, a):
    return None if p is None or not a else (float(p) - a) / a * 100.0


def fe(v):
    return "–" if v is None else f"{v:+.0f} %"


def fms(v):
    return "–" if v is None else f"{float(v):,.0f}"


def render_estimates(rows):
    out = ["", "### A. `ckptctl estimate` vs the next checkpoint", "",
           "Per row one job: 3 checkpoints (each waited durable), then `ckptctl estimate`, then the "
           "4th checkpoint, whose times are the \"actual\" ones. ms; error = (predicted − actual) / "
           "actual. commit = finished − started of the epoch (what the model fits; ckptctl's "
           "`total_ms` in brackets); durable = the epoch's `durable_ms`, from its start until durable, "
           "partner copies included (what the model fits; in brackets "
           "the wall time from the `checkpoint` call until the script saw \"durable\", 0.1 s polling). "
           "Epochs 1–3 = the times the estimate was fitted on.", ""]
    out += table_head("nodes", "grid", "resident MiB/node", "image MiB", "frozen 1–3",
                      "frozen pred", "frozen actual", "err", "commit 1–3", "commit pred",
                      "commit actual (total_ms)", "err", "durable 1–3", "durable pred",
                      "durable actual (seen)", "err")
    for r in rows:
        if "actual" not in r:
            out.append(f"| {r['k']} | {r['grid']} | – | – | – | – | – | – | – | – | – | – | – | – | – | "
                       f"{'ERROR' if r.get('error') else '–'} |")
            continue
        e, a, tr = r["estimate"], r["actual"], r["train"]
        p = e["predicted"]
        three = lambda key: " / ".join(fms(t[key]) for t in tr)  # noqa: E731
        out.append(
            f"| {r['k']} | {r['grid']} | {e['resident_per_node_bytes'] / 2**20:,.1f} | {a['image_bytes'] / 2**20:,.1f} "
            f"| {three('frozen')} | {fms(p['frozen_ms'])} | {fms(a['frozen'])} | {fe(err(p['frozen_ms'], a['frozen']))} "
            f"| {three('commit')} | {fms(p['commit_ms'])} | {fms(a['commit'])} ({fms(a['total'])}) "
            f"| {fe(err(p['commit_ms'], a['commit']))} "
            f"| {three('durable')} | {fms(p.get('durable_ms'))} | {fms(a['durable'])} ({fms(a['durable_observed'])}) "
            f"| {fe(err(p.get('durable_ms'), a['durable']))} |")
    errs = {key: [abs(err(r["estimate"]["predicted"][pk], r["actual"][key])) for r in rows
                  if "actual" in r and r["estimate"]["predicted"].get(pk) is not None]
            for key, pk in (("frozen", "frozen_ms"), ("commit", "commit_ms"), ("durable", "durable_ms"))}
    out.append("")
    out.append("Absolute error over the rows, median (max): " + ", ".join(
        f"{key} {statistics.median(v):.0f} % ({max(v):.0f} %)" for key, v in errs.items() if v) + ".")
    bases = sorted({r["estimate"].get("basis", "") for r in rows if "estimate" in r})
    out.append("Basis of every estimate: " + "; ".join(f"\"{b}\"" for b in bases) + ".")
    return out


def render_overhead(runs, args, iters, per_iter):
    base = [r for r in runs if not r["flags"] and "wall" in r]
    out = ["", "### B. Runtime overhead of periodic checkpoints", "",
           f"`heat {args.overhead_size} {iters} 0` on {args.overhead_nodes} host(s) "
           f"({2 * args.overhead_nodes} ranks), run to its checksum line; ITERS calibrated to "
           f"~{args.overhead_seconds:.0f} s ({per_iter * 1000:.2f} ms/iteration measured directly). "
           "overhead = (wall − wall without policy) / wall without policy; cost per checkpoint = "
           "the extra wall time / checkpoints; overhead per checkpoint-minute = overhead % / "
           "(checkpoints / run minutes), i.e. normalised to one checkpoint per minute (target ≤ 1 %). "
           "frozen = `frozen_ms` of the run's epochs, mean (max).", ""]
    if not base:
        return out + ["No run without policy completed: no overhead to report."]
    bw = statistics.mean(r["wall"] for r in base)
    out.append(f"Direct run (calibration, not under ckpt): {per_iter * 1000:.2f} ms/iteration, i.e. "
               f"{iters * per_iter:.1f} s for {iters} iterations; under ckpt without policy: "
               f"{bw / iters * 1000:.2f} ms/iteration ({bw:.1f} s, including start-up).")
    out.append("")
    if len(base) > 1:
        ws = [r["wall"] for r in base]
        out.append(f"Runs without policy: {', '.join(f'{w:.2f} s' for w in ws)} (spread "
                   f"{(max(ws) - min(ws)) / bw * 100:.2f} % of their mean {bw:.2f} s: the noise floor).")
        out.append("")
    out += table_head("run", "options", "interval (why)", "wall s", "overhead", "checkpoints (trigger)",
                      "frozen ms", "cost per checkpoint s", "overhead % per checkpoint-minute")
    for r in runs:
        if "wall" not in r:
            out.append(f"| {r['label']} | `{' '.join(r['flags']) or '–'}` | – | – | – | – | – | – | ERROR |")
            continue
        pol = r.get("policy") or {}
        iv = "–" if not pol else f"{pol.get('interval_s')} s" + (f" ({pol.get('why')})" if pol.get("why") else "")
        eps = [e for e in r["epochs"] if e.get("state") == "committed" or e.get("frozen")]
        n = len(eps)
        trig = {}
        for e in eps:
            trig[e.get("trigger")] = trig.get(e.get("trigger"), 0) + 1
        frozen = [float(e["frozen"]) for e in eps if e.get("frozen") is not None]
        fr = "–" if not frozen else f"{statistics.mean(frozen):,.0f} ({max(frozen):,.0f})"
        if r["flags"]:
            ov = (r["wall"] - bw) / bw * 100.0
            cost = f"{(r['wall'] - bw) / n:.2f}" if n else "–"
            per_min = f"{ov / (n / (r['wall'] / 60.0)):+.2f} %" if n else "–"
            ovs = f"{ov:+.2f} %"
        else:
            ovs, cost, per_min = "(baseline)", "–", "–"
        out.append(f"| {r['label']} | `{' '.join(r['flags']) or '–'}` | {iv} | {r['wall']:.2f} | {ovs} "
                   f"| {n} ({', '.join(f'{t} {c}' for t, c in trig.items()) or '–'}) | {fr} | {cost} | {per_min} |")
    out += ["", "Within each run (free of the drift between runs): the job prints a progress line every "
            "1/20 of its iterations; per interval, ms per iteration. quiet = median over the intervals "
            "in which no epoch started; extra = what the intervals in which an epoch started took beyond "
            "quiet (per checkpoint); before / after = median before the first epoch started and after "
            "the last one; overhead per checkpoint-minute = extra per checkpoint / 60 s.", ""]
    out += table_head("run", "intervals (with an epoch)", "quiet ms/iter", "extra per checkpoint s",
                      "before / after ms/iter", "overhead % per checkpoint-minute")
    for r in runs:
        w = r.get("within")
        if not w:
            continue
        pc = w["per_checkpoint_ms"]
        ba = " / ".join("–" if v is None else f"{v:.2f}" for v in (w["before_ms_per_iter"], w["after_ms_per_iter"]))
        out.append(f"| {r['label']} | {w['intervals']} ({w['hit']}) | {w['median_ms_per_iter']:.2f} "
                   f"| {'–' if pc is None else f'{pc / 1000:.2f}'} | {ba} "
                   f"| {'–' if pc is None else f'{pc / 600:+.2f} %'} |")
    return out


def machine_header(cmdline, criu, args):
    criu_v, mpich_v, mem = machine_info(criu)
    ncpu = os.cpu_count()
    return (f"## Estimates and periodic checkpoints, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Machine: nproc {ncpu}, {mem} MiB RAM, kernel {os.uname().release}, CRIU {criu_v}, MPICH {mpich_v}. "
            f"ckptd + one agent per test host (network/UTS namespaces on this machine, mutual TLS), every "
            f"agent with `shared_dir` = a directory on the same disk (every epoch flushed), partner copies on, "
            f"`[policy] auto_first = \"{args.auto_first}\"`, other settings default. Jobs: "
            f"`mpiexec.mpich -hosts <host IPs> -n 2k heat G ITERS SLEEP_US` (2 ranks per host), started "
            f"with `ckptctl run --node n1`.\n\n"
            f"Note: all hosts share this {ncpu}-core machine and its disk: a checkpoint of k hosts is k "
            f"dumps, k flushes and k partner copies on the same cores and disk.\n\n"
            f"Command: `{cmdline}`")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--nodes", default="1,2,3,4", help="node counts for part A (default 1,2,3,4)")
    ap.add_argument("--sizes", default="50,150,400",
                    help="resident MB per node aimed at, part A (default 50,150,400)")
    ap.add_argument("--reduced", action="store_true",
                    help="part A: all node counts at the middle size, all sizes at k=2 only")
    ap.add_argument("--est-sleep-us", type=int, default=20000, help="part A: heat's SLEEP_US")
    ap.add_argument("--mpi-overhead-mb", type=float, default=42.0,
                    help="resident MB per host besides the grid (MPICH, 2 ranks), for choosing G")
    ap.add_argument("--overhead-size", type=int, default=3000, help="part B: heat grid G")
    ap.add_argument("--overhead-seconds", type=float, default=240.0, help="part B: nominal run time")
    ap.add_argument("--overhead-nodes", type=int, default=1, help="part B: test hosts (2 ranks each)")
    ap.add_argument("--every", default="60s", help="part B: the fixed interval (default 60s)")
    ap.add_argument("--auto-first", default="60s",
                    help="ckptd.toml policy.auto_first (default 60s; the product's default is 10m)")
    ap.add_argument("--baseline-runs", type=int, default=1, choices=(1, 2),
                    help="part B: 2 repeats the run without policy at the end (noise floor)")
    ap.add_argument("--skip-estimate", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--quick", action="store_true", help="k=1,2, sizes 50,100, 60 s runs (smoke test)")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between checkpoints (part A)")
    ap.add_argument("--out", help="also write the markdown report to this file")
    ap.add_argument("--json", metavar="FILE", help="also write every sample as JSON")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    ap.add_argument("--app", default=os.path.join(REPO, "target", "apps", "heat.mpich"))
    ap.add_argument("--criu", default=default_criu())
    ap.add_argument("--wait-idle", type=float, default=0,
                    help="first wait up to this many seconds (polling every 10 s) until no "
                         "cargo/rustc/single_node-/multi_node-/.ci/run/heat.* processes run")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args()

    require_root_and_freezer()
    ks = [int(x) for x in args.nodes.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.quick:
        ks, sizes, args.overhead_seconds, args.overhead_size = [1, 2], [50, 100], 60.0, 1500
    if args.reduced:
        mid = sizes[len(sizes) // 2]
        combos = [(k, mid) for k in ks] + [(2, s) for s in sizes if s != mid]
    else:
        combos = [(k, s) for k in ks for s in sizes]
    hosts = max(([k for k, _ in combos] if not args.skip_estimate else [])
                + ([args.overhead_nodes] if not args.skip_overhead else []) or [1])
    cmdline = shlex.join([sys.argv[0]] + sys.argv[1:])

    tmp = tempfile.mkdtemp(prefix="ckpt-bench-pol-")

    def busy():
        # this run's calibration job runs outside any job cgroup: recognise it by the temp dir
        return [b for b in busy_processes()
                if tmp not in read_text(f"/proc/{b.split()[0]}/cmdline").replace("\0", " ")]

    if args.wait_idle > 0:
        wait_idle(busy, args.wait_idle, poll=10)
    log(f"work dir {tmp}; part A {combos if not args.skip_estimate else 'skipped'}, part B "
        f"{'skipped' if args.skip_overhead else f'heat {args.overhead_size}, ~{args.overhead_seconds:.0f} s'}")
    cluster = Cluster(hosts)
    ckpt = None
    doc = {"command": cmdline, "estimates": [], "overhead": [], "notes": []}
    stop_on_signals()
    t_start = mono()
    sampler = BusySampler(busy)
    sampler.start()
    try:
        bindir, app = stage_bins(tmp, args.bin_dir, args.app)
        header = machine_header(cmdline, args.criu, args)

        cluster.create()
        ckpt = PolicyCkpt(tmp, bindir, args.criu, cluster, args.auto_first)
        ckpt.start()
        iters, per_iter = None, None
        if not args.skip_overhead:
            iters, per_iter = calibrate(app, args.overhead_size, args.overhead_seconds, tmp)
            doc["overhead_iters"], doc["per_iteration_s"] = iters, per_iter
            modes = [("no policy", []), (f"every {args.every}", ["--every", args.every]),
                     ("auto", ["--every", "auto"])]
            if args.baseline_runs == 2:
                modes.append(("no policy (again)", []))
            for label, flags in modes:
                try:
                    doc["overhead"].append(bench_overhead(ckpt, cluster, label, flags, args, app, iters))
                except BenchError as e:
                    log(f"overhead {label} FAILED: {e}")
                    doc["overhead"].append({"label": label, "flags": flags, "error": str(e), "notes": []})
                log(f"({mono() - t_start:.0f} s so far)")
        if not args.skip_estimate:
            for k, mb in combos:
                try:
                    doc["estimates"].append(bench_estimate(ckpt, cluster, k, mb, args, app))
                except BenchError as e:
                    log(f"k={k} {mb} MB FAILED: {e}")
                    doc["estimates"].append({"k": k, "target_mb": mb, "grid": grid_for(mb, k, args.mpi_overhead_mb),
                                             "error": str(e), "notes": []})
                log(f"k={k} {mb} MB done ({mono() - t_start:.0f} s so far)")
        took = mono() - t_start
        sampler.stop.set()
        sampler.join(timeout=30)
        out = [header]
        if doc["estimates"]:
            out += render_estimates(doc["estimates"])
        if doc["overhead"]:
            out += render_overhead(doc["overhead"], args, iters, per_iter)
        out += notes_section([(f"A k={r['k']} {r['target_mb']} MB", r) for r in doc["estimates"]]
                             + [(f"B {r['label']}", r) for r in doc["overhead"]])
        table = report_tail("\n".join(out) + "\n", tmp, cluster, sampler, took)
        emit(table, args.out)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
            log(f"wrote {args.json}")
        failed = any(r.get("error") for r in doc["estimates"] + doc["overhead"])
        return 1 if failed else 0
    except BenchError as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        teardown(ckpt, sampler, tmp, cluster, args.keep)


if __name__ == "__main__":
    sys.exit(main())
