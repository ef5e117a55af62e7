#!/usr/bin/env python3
"""Recovery from a lost node (by itself, on the spare) vs a restart by hand in place, 3-node job.

The time from a node's loss until the job runs again with that node's part on the spare (ckptd
restarting it by itself), split into detection, placement, image fetch, restore and release,
next to the same job restarted by hand on its own nodes, at 50, 150 and 500 MiB per node.

What it measures
----------------
Test hosts, ckptd and agents are made exactly as restart_elsewhere.py makes them (its
SandboxCkpt, on multinode_vs_criu.py's Cluster), with 4 hosts instead of 6: a private bridge,
per host a network + UTS namespace, one `ckptd` on the bridge address, one `ckpt-agent` per host
inside its namespaces, mutual TLS (cluster CA, `ckptd ca issue | ckpt-agent enroll -`), one
`shared_dir` for all, `allow_root_jobs`, and in ckptd.toml

    node_timeout = "2s"
    [spares]
    nodes = ["n4"]
    [job_network]
    addresses = "10.250.<pid % 250>.150-10.250.<pid % 250>.199"
    prefix = 24

so every part of a job runs in a sandbox (/run/netns/ckpt-<node>-<job>) and can move. As in
restart_elsewhere.py the agents are registered as `b<tag>n1`..`b<tag>n4` (tag = pid % 100000) so
that the sandboxes' machine-wide names never meet the e2e tests' (nodes n1..n4, job 1);
`--node-prefix n` gives n1..n4. The report calls them n1..n4 whatever their names.

The job: `ckptctl run --on-failure restart:3 --node n1 -- mpiexec.mpich -hosts <host names of
n1,n2,n3> -n 6 heat GRID ITERS SLEEP_US` (2 ranks per host). heat holds two GRID x GRID grids of
doubles split by rows over the ranks, so a host's part holds about 16 GRID^2 / 3 bytes plus MPI's
own: GRID is chosen for each size (--sizes, MiB per node: 50, 150, 500) from that and the
per-node overhead measured on the previous job (18 MiB assumed before the first). The script
waits until every host's part holds its share (proportional set size of the processes in the
part's cgroup, from /proc/PID/smaps_rollup, at least 90 % of the grid's share), and reports what
it measured per node. ITERS is large (--job-seconds of sleeps, nominal): the job never ends by
itself during a round.

Per size, K times (--repeats, default 2), on a fresh job each time (so that ckptd's recovery
backoff never applies), interleaved:

1. In place, by hand: `ckptctl --json checkpoint ID --kill --wait` (epoch E1); wait (bounded)
   until `ckptctl --json epochs ID` shows E1 durable (in shared storage) and its partner copies
   complete, and until the agents removed the job's sandboxes; then `ckptctl --json restart ID
   --epoch E1` on the same nodes. Recorded: ckptctl's `elapsed_ms` (request to "running again":
   verify + restore every part held, then release) and the wall time of the call; then the
   script checks that the job runs with its parts on n1, n2, n3.

2. Lost node, by itself: `ckptctl --json checkpoint ID --wait` (epoch E2, the job runs on); wait
   (bounded) until E2 shows `partner_copy: true` and is durable (so no flush is left to compete
   with the recovery). Then n3 is destroyed the way the e2e tests destroy a node
   (tests/e2e/multi_node.rs, the recovery matrix's "Destroyed"): T0 = the wall clock (ms since
   the Unix epoch) just before its agent is SIGKILLed by PID; every process in the job's cgroup
   on n3 SIGKILLed by PID; n3's sandbox job interface and namespace deleted (`ip -n
   ckpt-<n3>-<job> link del eth0; ip netns del ckpt-<n3>-<job>`); n3's staging of the job
   (<n3>/local/<job>: its images and the partner copies it kept) deleted. The script then polls
   `ckptctl --json status ID` every 100 ms (bounded, 180 s) until the job runs again with parts on
   n1, n2 and n4 (n4's `moved_from` n3) and its last entry of `recoveries` says "running again".
   From that entry (ms since the Unix epoch, set by ckptd; ckptd and the script share this
   machine's clock):

       detection  = noticed_unix_ms - T0                 (n3 silent until declared lost)
       placement  = at_unix_ms - noticed_unix_ms          (lost -> restart begun, spare chosen)
       image fetch = fetch_ms                             (slowest node: find, fetch, verify)
       restore    = (restored_unix_ms - at_unix_ms) - fetch_ms   (the rest, until all held)
       release    = running_unix_ms - restored_unix_ms    (released: running again)
       total      = running_unix_ms - T0

   A field missing or 0 (binaries that predate it) shows as "n/a"; two fall-backs, each named in
   the notes when used: `noticed_unix_ms` from the status's `lost` entry as seen while polling,
   and the total from the first poll that saw the job running again. Where n4 got n3's images
   (partner copy, shared copy) is read from n4's agent log. Then n3 is brought back (its agent
   started again, bounded wait until `ckptctl --json nodes` shows it up), the job is cancelled,
   its processes killed by PID from its cgroups, the script waits until its sandboxes are gone,
   and its images (every host's staging of it and its shared copy) are deleted, to keep the disk
   from filling over the run.

The report: per size, a row with the measured MiB per node (n1/n2/n3: n1's part also holds
mpiexec), the in-place restart (ckptctl elapsed_ms and wall, median (min–max)), the recovery
total and each split (medians), and the goal check of the issue: total <= node_timeout + 1.5 x
in-place (medians, in-place = ckptctl's elapsed_ms), "met" or "not met"; then every repeat's
samples per size. All four hosts share one machine (typically 2 cores) and its disk, and restores
on it are serialized by /run/ckpt/restore.lock; "shared storage" is a directory on the same
disk, so image fetches are local copies through the agents' transfer path, not a network.

How to run (root, Debian 12, cgroup v1 freezer, CRIU >= 4.2, MPICH, iproute2, nsenter, unshare,
nft; binaries already built, target/apps/heat.mpich built):

    benches/recovery.py --quick --keep                   # smoke test: 50 MiB/node, K=1
    benches/recovery.py                                  # 50, 150, 500 MiB/node, K=2
    benches/recovery.py --wait-idle 1200 \\
        --out benches/results/recovery-$(date +%F).md --json benches/results/recovery-$(date +%F).json

Options: --sizes MIB,MIB,.. (MiB per node, default 50,150,500)  --repeats K (default 2)  --quick
(50 MiB/node, K=1)  --sleep-us US (heat's sleep per iteration, default 50000)  --job-seconds S
(nominal run time, sets ITERS; default 3600)  --gap S (pause between steps, default 2)
--node-prefix P (agent node names P1..P4; default b<tag>n)  --out FILE  --json FILE (every
sample)  --bin-dir DIR (ckptd, ckptctl, ckpt-agent, ckpt-rsh, ckpt-init; default target/release;
copied to the temp dir first)  --app PATH (heat.mpich, default target/apps/heat.mpich, also
copied)  --criu PATH  --wait-idle S (first wait, bounded, polling every 10 s, until no
cargo/rustc/single_node-/multi_node-/.ci/run/heat.* processes run)  --keep (keep the temp dir
with logs). Standard library only. Every wait is bounded; every process the benchmark starts is
stopped by PID, and every cgroup, namespace (including leftover sandbox namespaces of its own
nodes), link and UTS bind mount it creates is removed, also on errors and Ctrl-C.
"""

import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# the shared helpers live next to this script (benches/benchutil.py), the test hosts in
# multinode_vs_criu.py, the sandboxed ckptd + agents and the job helpers in restart_elsewhere.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import (  # noqa: E402
    REPO, BenchError, BusySampler, cg_pids, emit, finished, fmt, job_pss_bytes, kill_cgroup, log,
    machine_info, med, mono, notes_section, read_text, require_root_and_freezer, run, table_head,
    wait_idle, wait_until)
from multinode_vs_criu import (  # noqa: E402
    TAG, Cluster, busy_processes, default_criu, report_tail, stage_bins, stop_on_signals,
    teardown)
from restart_elsewhere import (  # noqa: E402
    SandboxCkpt, log_sizes, one_restart, parts, remove_sandbox_netns, restore_sources,
    sandbox_netns, stop_job, wait_running)

HOSTS = 4
SPARE = 4      # n4, the only spare
LOST = 3       # n3 is destroyed; it runs ranks only (mpiexec runs on n1)
SIZES = [50, 150, 500]
OVERHEAD_GUESS = 18.0  # MiB per node besides the grids (MPI, libraries), until a job has been measured
POLL = 0.1
RECOVERY_LIMIT = 180.0
SPLITS = ("detection", "placement", "fetch", "restore", "release", "total")


# ---------------------------------------------------------------- ckptd and agents

class RecoveryCkpt(SandboxCkpt):
    """restart_elsewhere's sandboxed ckptd + agents, with an agent that can be killed and started
    again on its host (same config, same credential, same state and staging directories)."""

    def start_agent(self, node):
        """Starts `node`'s agent again as Ckpt.start does (nsenter execs it: the PID is the
        agent's) and waits (bounded) until ckptd shows the node up."""
        acfg = os.path.join(node.dir, "agent.toml")
        env = dict(os.environ, CKPT_LOG="info")
        with open(os.path.join(self.tmp, f"agent-{node.name}.log"), "ab") as logf:
            node.agent = subprocess.Popen(node.nsenter() + [os.path.join(self.bindir, "ckpt-agent"),
                                                            "--config", acfg],
                                          stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
                                          close_fds=True, start_new_session=True, cwd=self.tmp)

        def up():
            if node.agent.poll() is not None:
                raise BenchError(f"agent {node.name} exited with {node.agent.returncode}: "
                                 f"{read_text(os.path.join(self.tmp, f'agent-{node.name}.log'))[-1500:]}")
            return self.node_state(node.name) == "up"
        wait_until(up, 60, f"agent {node.name} to be up again", 0.2)
        log(f"agent {node.name} back (pid {node.agent.pid})")

    def kill_agent(self, node):
        """SIGKILLs `node`'s agent by PID and reaps it."""
        if node.agent is None or node.agent.poll() is not None:
            return
        os.kill(node.agent.pid, signal.SIGKILL)
        try:
            node.agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise BenchError(f"agent {node.name} (pid {node.agent.pid}) did not die after SIGKILL")

    def nodes(self):
        """`ckptctl --json nodes` as a dict ({} if it fails)."""
        p, _ = self.ctl("--json", "nodes", timeout=30, check=False)
        try:
            return json.loads(p.stdout) if p.returncode == 0 else {}
        except ValueError:
            return {}

    def node_state(self, name):
        for n in self.nodes().get("nodes") or []:
            if n.get("name") == name:
                return n.get("state")
        return None


# ---------------------------------------------------------------- the job

def grid_for(mib, overhead):
    """The heat grid N whose two N x N grids put about `mib` MiB (with `overhead` MiB of the
    rest) on each of the 3 hosts: 16 N^2 / 3 bytes of grid per host."""
    return max(200, int(math.sqrt(max(1.0, mib - overhead) * 2**20 * 3 / 16)))


def grid_share(n):
    """Bytes of grid on each host (2 of 6 ranks, each (rows + 2 halos) x N doubles, twice)."""
    return 2 * 2 * (n // 6 + 1 + 2) * n * 8


def part_pss(cluster, jid, hosts):
    """{host number: PSS of the processes in the job's cgroup there, bytes}."""
    return {i: job_pss_bytes(cg_pids(cluster.nodes[i - 1].cgroup(jid))) for i in hosts}


def wait_epoch(ckpt, jid, epoch, what, limit=900.0):
    """Waits until `epoch` of `jid` is durable and has its partner copies; returns its entry."""
    def ok():
        for x in ckpt.epochs(jid):
            if int(x.get("epoch", -1)) == epoch:
                if x.get("storage") == "flush-failed":
                    raise BenchError(f"epoch {epoch} flush failed: {x.get('flush_detail') or x.get('reason')}")
                return x if x.get("storage") == "durable" and x.get("partner_copy") is True else None
        return None
    t = mono()
    x = wait_until(ok, limit, f"{what}: epoch {epoch} durable with partner copies", 0.1)
    return x, (mono() - t) * 1000.0


def checkpoint(ckpt, jid, *flags):
    p, wall = ckpt.ctl_json("checkpoint", jid, "--wait", *flags)
    e = json.loads(p.stdout.strip().splitlines()[-1])
    if e.get("state") not in (None, "committed"):
        raise BenchError(f"epoch not committed: {e}")
    return e, wall * 1000.0


def launch(ckpt, cluster, args, app, grid, iters, host):
    """`ckptctl run --on-failure restart:3 --node n1 -- mpiexec ...`; the job id."""
    hosts = ",".join(nd.netns for nd in cluster.nodes[:3])
    cmd = ["mpiexec.mpich", "-hosts", hosts, "-n", "6", app, str(grid), str(iters), str(args.sleep_us)]
    p, _ = ckpt.ctl("run", "--name", "heat", "--on-failure", "restart:3", "--node", host(1), "--",
                    *cmd, timeout=60)
    jid = p.stdout.strip().split()[-1]
    ckpt.jobs.append(jid)
    log(f"job {jid}: {shlex.join(cmd)}")
    return jid


def wait_filled(ckpt, cluster, jid, grid, host):
    """Waits until the job runs on n1..n3 and every part holds its share of the grids; returns
    {host number: PSS bytes}."""
    stderr = os.path.join(cluster.nodes[0].dir, "state", "jobs", jid, "stderr")
    wait_running(ckpt, cluster, jid, {host(i): "" for i in (1, 2, 3)}, timeout=120)
    want = 0.9 * grid_share(grid)

    def filled():
        st = str(ckpt.status(jid).get("state", ""))
        if st and not st.startswith(("running", "starting")):
            raise BenchError(f"job {jid} is {st!r} before it filled its grids: {read_text(stderr)[-800:]}")
        pss = part_pss(cluster, jid, (1, 2, 3))
        return pss if min(pss.values()) >= want else None
    wait_until(filled, 600, f"job {jid}: every part to hold {want / 2**20:.0f} MiB", 0.5)
    time.sleep(1.0)
    pss = part_pss(cluster, jid, (1, 2, 3))
    log(f"job {jid} computing; PSS per node (MiB) "
        f"{ {f'n{i}': round(b / 2**20, 1) for i, b in pss.items()} }")
    return pss


def destroy_node(ckpt, cluster, jid, i):
    """Node i lost for good, as the e2e tests' "Destroyed": agent SIGKILLed, the job's
    processes there SIGKILLed, its sandbox's job interface and namespace deleted, its staging
    of the job deleted. Returns T0, the wall clock (ms since the Unix epoch) at the kill."""
    node = cluster.nodes[i - 1]
    t0 = time.time() * 1000.0
    ckpt.kill_agent(node)
    kill_cgroup(node.cgroup(jid), timeout=30)
    ns = f"ckpt-{node.name}-{jid}"
    run(["ip", "-n", ns, "link", "del", "eth0"], timeout=30, check=False)
    run(["ip", "netns", "del", ns], timeout=30, check=False)
    shutil.rmtree(os.path.join(node.dir, "local", str(jid)), ignore_errors=True)
    log(f"n{i} ({node.name}) destroyed at T0 = {t0:.0f}")
    return t0


def wait_recovered(ckpt, jid, expect, t0):
    """Polls status every 100 ms (bounded) until the job runs on `expect` ({node: moved_from})
    and its last recovery says "running again"; returns (status, what polling saw)."""
    seen = {"lost_noticed": None, "polled_lost": None, "polled_running": None}
    deadline = mono() + RECOVERY_LIMIT
    last = {}
    while True:
        st = ckpt.status(jid)
        now = time.time() * 1000.0
        last = st or last
        state = str(st.get("state", ""))
        lost = st.get("lost") or {}
        if lost.get("noticed_unix_ms"):
            seen["lost_noticed"] = int(lost["noticed_unix_ms"])
        if state == "lost" and seen["polled_lost"] is None:
            seen["polled_lost"] = now
        recs = st.get("recoveries") or []
        rec = recs[-1] if recs else {}
        outcome = str(rec.get("outcome", ""))
        if outcome.startswith("failed"):
            raise BenchError(f"job {jid}: the restart by itself failed: {outcome}")
        ps = parts(st)
        on = (state == "running" and set(ps) == set(expect)
              and all(ps[n].get("state") == "running" and (ps[n].get("moved_from") or "") == frm
                      for n, frm in expect.items()))
        if on and seen["polled_running"] is None:
            seen["polled_running"] = now
        # a record that has running_unix_ms gets it with the outcome; allow it 5 s to follow
        complete = "running_unix_ms" not in rec or bool(rec.get("running_unix_ms")) \
            or now - seen["polled_running"] > 5000.0 if on else False
        if on and outcome.startswith("running again") and complete:
            return st, seen
        if mono() > deadline:
            got = {n: (p.get("state"), p.get("moved_from")) for n, p in parts(last).items()}
            raise BenchError(f"job {jid} not running again on {sorted(expect)} within {RECOVERY_LIMIT:.0f} s "
                             f"after the loss: state {last.get('state')!r}, parts {got}, recoveries "
                             f"{last.get('recoveries')}, note {last.get('recovery_note')!r}")
        time.sleep(POLL)


def split(rec, t0, seen, notes):
    """The splits (ms, None where unknown) of one recovery record."""
    def f(key):
        v = rec.get(key)
        return int(v) if isinstance(v, (int, float)) and v > 0 else None
    noticed, at = f("noticed_unix_ms"), f("at_unix_ms")
    restored, running, fetch = f("restored_unix_ms"), f("running_unix_ms"), f("fetch_ms")
    if noticed is None and seen.get("lost_noticed"):
        noticed = seen["lost_noticed"]
        notes.add("detection (and placement) from the noticed_unix_ms of status's `lost` entry seen "
                  "while polling: the recovery record has none")
    out = dict.fromkeys(SPLITS)
    if noticed:
        out["detection"] = noticed - t0
    if noticed and at:
        out["placement"] = at - noticed
    out["fetch"] = fetch
    if restored and at and fetch is not None:
        out["restore"] = (restored - at) - fetch
    if running and restored:
        out["release"] = running - restored
    if running:
        out["total"] = running - t0
    elif seen.get("polled_running"):
        out["total"] = seen["polled_running"] - t0
        notes.add("total from the first status poll (every 100 ms) that saw the job running again: "
                  "the recovery record has no running_unix_ms")
    return out


def forget_job(ckpt, cluster, jid):
    """Cancels the job, kills what is left of it by PID, waits until its sandboxes are gone and
    deletes its images everywhere (staging of every host, the shared copy)."""
    ckpt.cancel(jid, cluster.nodes)
    names = [n.name for n in cluster.nodes]
    wait_until(lambda: not sandbox_netns(names, jid), 90,
               f"the agents to remove job {jid}'s sandboxes ({', '.join(sandbox_netns(names, jid))})", 0.2)
    for node in cluster.nodes:
        shutil.rmtree(os.path.join(node.dir, "local", str(jid)), ignore_errors=True)
    shutil.rmtree(os.path.join(ckpt.shared, str(jid)), ignore_errors=True)


def one_repeat(ckpt, cluster, args, app, grid, iters, host, r, notes):
    """One in-place restart by hand and one lost node, on a fresh job; fills `r`."""
    same = {host(i): "" for i in (1, 2, 3)}
    moved = {host(1): "", host(2): "", host(SPARE): host(LOST)}
    jid = launch(ckpt, cluster, args, app, grid, iters, host)
    r["job"] = jid
    lost_node = cluster.nodes[LOST - 1]
    try:
        pss = wait_filled(ckpt, cluster, jid, grid, host)
        r["pss"] = {f"n{i}": b for i, b in pss.items()}
        # 1. in place, by hand
        time.sleep(args.gap)
        e, wall = checkpoint(ckpt, jid, "--kill")
        e1 = int(e["epoch"])
        _, copied = wait_epoch(ckpt, jid, e1, "in place")
        stop_job(ckpt, cluster, jid)  # --kill stopped it; this waits for the sandboxes to go
        r["inplace_epoch"] = {"epoch": e1, "image_bytes": e.get("image_bytes"), "total_ms": e.get("total_ms"),
                              "ckptctl_ms": wall, "copied_after_ms": copied}
        time.sleep(args.gap)
        elapsed, wall, _ = one_restart(ckpt, cluster, jid, e1, [], same)
        r["inplace_elapsed"], r["inplace_wall"] = elapsed, wall
        log(f"in place: epoch {e1} ({int(e.get('image_bytes') or 0) / 2**20:.0f} MiB) restarted on n1..n3 "
            f"in {elapsed:.0f} ms (ckptctl {wall:.0f} ms)")

        # 2. n3 lost, the job restarts by itself with n3's part on n4
        time.sleep(args.gap)
        e, wall = checkpoint(ckpt, jid)
        e2 = int(e["epoch"])
        _, copied = wait_epoch(ckpt, jid, e2, "before the loss")
        r["lost_epoch"] = {"epoch": e2, "image_bytes": e.get("image_bytes"), "total_ms": e.get("total_ms"),
                           "ckptctl_ms": wall, "copied_after_ms": copied}
        time.sleep(args.gap)
        since = log_sizes(ckpt, cluster)
        t0 = destroy_node(ckpt, cluster, jid, LOST)
        st, seen = wait_recovered(ckpt, jid, moved, t0)
        rec = (st.get("recoveries") or [{}])[-1]
        r["t0_unix_ms"], r["recovery"], r["polled"] = t0, rec, seen
        r["splits"] = split(rec, t0, seen, notes)
        r["source"] = restore_sources(ckpt, cluster, since, [host(SPARE)]).get(host(SPARE))
        if rec.get("moves") not in (None, [f"{host(LOST)}={host(SPARE)}"]):
            notes.add(f"job {jid}: recovery moves {rec.get('moves')} (expected n3=n4)")
        if rec.get("epoch") not in (None, e2):
            notes.add(f"job {jid}: recovered from epoch {rec.get('epoch')}, not the latest ({e2})")
        log(f"lost n3: running again on n1, n2, n4 from epoch {rec.get('epoch')}; "
            + ", ".join(f"{k} {fmt(v)}" for k, v in r["splits"].items())
            + f" ms; n4's images from its {r['source']} copy; trigger {rec.get('trigger')!r}")
        if finished(os.path.join(cluster.nodes[0].dir, "state", "jobs", jid, "stdout")):
            notes.add("a job printed its result during a round: use a larger --job-seconds")
    finally:
        # n3 back for the next round, whatever happened; then the job goes
        try:
            if lost_node.agent is None or lost_node.agent.poll() is not None:
                ckpt.start_agent(lost_node)
        finally:
            forget_job(ckpt, cluster, jid)


def bench_size(ckpt, cluster, args, app, iters, k, mib, est, res):
    host = lambda i: cluster.nodes[i - 1].name  # noqa: E731
    grid = grid_for(mib, est["overhead"])
    res["grid"] = grid
    log(f"=== {mib} MiB per node: grid {grid} (overhead estimate {est['overhead']:.1f} MiB/node)")
    notes = set()
    try:
        for i in range(k):
            r = {}
            res["repeats"].append(r)
            log(f"--- {mib} MiB/node, repeat {i + 1}/{k}")
            try:
                one_repeat(ckpt, cluster, args, app, grid, iters, host, r, notes)
            finally:
                if r.get("pss"):
                    mean = sum(r["pss"].values()) / len(r["pss"]) / 2**20
                    est["overhead"] = min(max(0.0, mean - grid_share(grid) / 2**20), mib / 2)
    finally:
        res["notes"] += sorted(notes)


# ---------------------------------------------------------------- report

def vals(res, key, sub=None):
    out = []
    for r in res["repeats"]:
        v = r.get(key) if sub is None else (r.get(key) or {}).get(sub)
        if v is not None:
            out.append(float(v))
    return out


def mmr(xs):
    """median (min–max), or n/a."""
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return fmt(xs[0])
    return f"{fmt(med(xs))} ({fmt(min(xs))}–{fmt(max(xs))})"


def medn(xs):
    return fmt(med(xs)) if xs else "n/a"


def mib_per_node(res):
    """"n1 / n2 / n3" medians of the measured PSS, MiB."""
    cols = []
    for n in ("n1", "n2", "n3"):
        xs = [r["pss"][n] / 2**20 for r in res["repeats"] if r.get("pss")]
        cols.append(f"{med(xs):,.0f}" if xs else "?")
    return " / ".join(cols)


def goal(res, timeout_ms):
    tot, inp = vals(res, "splits", "total"), vals(res, "inplace_elapsed")
    if not tot or not inp:
        return "n/a"
    limit = timeout_ms + 1.5 * med(inp)
    verdict = "met" if med(tot) <= limit else "not met"
    return f"{fmt(med(tot))} ≤ {fmt(timeout_ms)} + 1.5 × {fmt(med(inp))} = {fmt(limit)}: **{verdict}**"


def sources(res):
    counts = {}
    for r in res["repeats"]:
        if r.get("source"):
            counts[r["source"]] = counts.get(r["source"], 0) + 1
    return ", ".join(f"{v} ×{c}" for v, c in sorted(counts.items())) or "–"


def render(results, k, header, timeout_ms, names):
    """The report; agent node names `names` (host 1..4) are written n1..n4."""
    def short(text):
        for i, name in sorted(enumerate(names, 1), key=lambda x: len(x[1]), reverse=True):
            text = re.sub(rf"\b{re.escape(name)}\b", f"n{i}", text)
        return text
    out = [header, ""]
    out.append(f"Medians over K={k} (min–max where K > 1), ms. In place = `ckptctl restart` on the "
               "same nodes after `checkpoint --kill` (ckptctl's own `elapsed_ms`: request to \"running "
               "again\"; wall = the whole call). Lost n3 = n3's agent and processes SIGKILLed, its "
               "sandbox and staging deleted, at T0; ckptd restarts the job by itself (`--on-failure "
               "restart:3`) with n3's part on the spare n4. Splits from the job's recovery record: "
               "detection = noticed − T0, placement = restart begun − noticed, image fetch = fetch_ms "
               "(slowest node), restore = (all restored − begun) − fetch, release = running − "
               "restored, total = running − T0. MiB/node: PSS of each part's processes (n1 also runs "
               "mpiexec). Goal (the issue): total ≤ node_timeout + 1.5 × in place.")
    out.append("")
    out += table_head("MiB/node (target)", "MiB/node measured n1 / n2 / n3", "grid",
                      "in place elapsed_ms", "in place wall", "recovery total", "detection",
                      "placement", "image fetch", "restore", "release", "n4's images from",
                      "goal: total ≤ timeout + 1.5 × in place")
    for mib, res in results:
        out.append(f"| {mib} | {mib_per_node(res)} | {res.get('grid', '?')} | {mmr(vals(res, 'inplace_elapsed'))} "
                   f"| {mmr(vals(res, 'inplace_wall'))} | {mmr(vals(res, 'splits', 'total'))} "
                   + " ".join(f"| {medn(vals(res, 'splits', s))}" for s in SPLITS[:-1])
                   + f" | {sources(res)} | {goal(res, timeout_ms)} |")
    for mib, res in results:
        out += ["", f"### {mib} MiB per node: every repeat", ""]
        out += table_head("repeat", "job", "epochs (in place / lost), MiB of images", "in place elapsed_ms",
                          "in place wall", "detection", "placement", "image fetch", "restore",
                          "release", "total", "recovery record")
        for i, r in enumerate(res["repeats"], 1):
            ep = []
            for key in ("inplace_epoch", "lost_epoch"):
                e = r.get(key) or {}
                ep.append(f"{e.get('epoch', '?')} ({int(e.get('image_bytes') or 0) / 2**20:,.0f})" if e else "–")
            s = r.get("splits") or dict.fromkeys(SPLITS)
            rec = r.get("recovery") or {}
            what = (f"{rec.get('trigger', '?')}; epoch {rec.get('epoch', '?')}; moves "
                    f"{','.join(rec.get('moves') or []) or '?'}; {rec.get('outcome', '?')}") if rec else "–"
            out.append(f"| {i} | {r.get('job', '?')} | {' / '.join(ep)} | {fmt(r.get('inplace_elapsed'))} "
                       f"| {fmt(r.get('inplace_wall'))} | "
                       + " | ".join("n/a" if s.get(x) is None else fmt(s[x]) for x in SPLITS)
                       + f" | {short(what)} |")
    out += notes_section((f"{mib} MiB/node", res) for mib, res in results)
    return "\n".join(out) + "\n"


def machine_header(cmdline, criu, iters, sleep_us, prefix, timeout_ms):
    criu_v, mpich_v, mem = machine_info(criu)
    ncpu = os.cpu_count()
    return (f"## Recovery from a lost node vs a restart in place, "
            f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Machine: nproc {ncpu}, {mem} MiB RAM, kernel {os.uname().release}, CRIU {criu_v}, MPICH {mpich_v}. "
            f"Job: `ckptctl run --on-failure restart:3 --node n1 -- mpiexec.mpich -hosts <host names of "
            f"n1,n2,n3> -n 6 heat GRID {iters} {sleep_us}` (2 ranks per node, sandboxed: job network, "
            f"spare n4, node_timeout {timeout_ms / 1000:g} s, shared_dir on the local disk, TLS); node "
            f"names in ckptd are `{prefix}1`..`{prefix}4`.\n\n"
            f"Note: all nodes are namespaces on this one {ncpu}-core machine sharing its disk; restores on "
            f"one machine are serialized by /run/ckpt/restore.lock, and \"shared storage\" and the "
            f"partner copies are directories on the same disk as local staging.\n\n"
            f"Command: `{cmdline}`")


def write_json(path, results, k, cmdline, prefix, timeout_ms):
    doc = {"command": cmdline, "repeats": k, "node_prefix": prefix, "node_timeout_ms": timeout_ms,
           "sizes": {str(mib): res for mib, res in results}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    log(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", help="MiB per node, comma-separated (default 50,150,500; 50 with --quick)")
    ap.add_argument("--repeats", type=int, default=2, metavar="K")
    ap.add_argument("--quick", action="store_true", help="50 MiB per node, K=1 (smoke test)")
    ap.add_argument("--out", help="also write the markdown report to this file")
    ap.add_argument("--json", metavar="FILE", help="also write every sample as JSON")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    ap.add_argument("--app", default=os.path.join(REPO, "target", "apps", "heat.mpich"))
    ap.add_argument("--criu", default=default_criu())
    ap.add_argument("--sleep-us", type=int, default=50000, help="heat's sleep per iteration (default 50000)")
    ap.add_argument("--job-seconds", type=float, default=3600.0,
                    help="nominal run time of each job, sets ITERS (default 3600; a job lives one round)")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between steps")
    ap.add_argument("--node-prefix", default=f"b{TAG}n",
                    help="agents' node names are PREFIX1..PREFIX4 (default b<pid%%100000>n)")
    ap.add_argument("--wait-idle", type=float, default=0,
                    help="first wait up to this many seconds (polling every 10 s) until no "
                         "cargo/rustc/single_node-/multi_node-/.ci/run/heat.* processes run")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args()

    require_root_and_freezer()
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,20}", args.node_prefix):
        sys.exit("--node-prefix: a letter, then at most 20 letters or digits")
    try:
        sizes = [50] if args.quick else ([int(x) for x in args.sizes.split(",")] if args.sizes else SIZES)
    except ValueError:
        sys.exit("--sizes: whole MiB per node, comma-separated")
    if not sizes or min(sizes) < 20 or max(sizes) > 4096:
        sys.exit("--sizes: between 20 and 4096 MiB per node")
    k = 1 if args.quick else args.repeats
    if k < 1:
        sys.exit("--repeats: 1 or more")
    iters = 20 * max(1, round(args.job_seconds / 20 / (args.sleep_us / 1e6)))
    cmdline = shlex.join([sys.argv[0]] + sys.argv[1:])

    if args.wait_idle > 0:
        wait_idle(busy_processes, args.wait_idle, poll=10)

    tmp = tempfile.mkdtemp(prefix="ckpt-bench-rec-")
    log(f"work dir {tmp}; sizes {sizes} MiB/node, K={k}, ITERS {iters}, sleep {args.sleep_us} us, "
        f"nodes {args.node_prefix}1..{HOSTS}")
    cluster = Cluster(HOSTS)
    names = [f"{args.node_prefix}{i}" for i in range(1, HOSTS + 1)]
    ckpt = None
    results = []
    stop_on_signals()
    t_start = mono()
    sampler = BusySampler(busy_processes)
    sampler.start()
    try:
        if sandbox_netns(names):
            raise BenchError(f"sandbox namespaces of these node names exist already: "
                             f"{sandbox_netns(names)}; use another --node-prefix")
        bindir, app = stage_bins(tmp, args.bin_dir, args.app, extra=("ckpt-init",))
        cluster.create()
        for node, name in zip(cluster.nodes, names):
            node.name = name  # the agent's node name (and its cgroup prefix); netns/host name stay
        ckpt = RecoveryCkpt(tmp, bindir, args.criu, cluster, [names[SPARE - 1]])
        ckpt.start()
        timeout_ms = float(ckpt.nodes().get("node_timeout_ms") or 2000)
        est = {"overhead": OVERHEAD_GUESS}
        for mib in sizes:
            res = {"repeats": [], "notes": []}
            results.append((mib, res))
            t_n = mono()
            try:
                bench_size(ckpt, cluster, args, app, iters, k, mib, est, res)
            except BenchError as e:
                res["error"] = str(e)
                log(f"{mib} MiB/node FAILED: {e}")
            log(f"{mib} MiB/node done in {mono() - t_n:.0f} s ({mono() - t_start:.0f} s so far)")
        took = mono() - t_start
        sampler.stop.set()
        sampler.join(timeout=30)
        header = machine_header(cmdline, args.criu, iters, args.sleep_us, args.node_prefix, timeout_ms)
        report = report_tail(render(results, k, header, timeout_ms, names), tmp, cluster, sampler, took)
        emit(report, args.out)
        if args.json:
            write_json(args.json, results, k, cmdline, args.node_prefix, timeout_ms)
        return 1 if any(r.get("error") for _, r in results) else 0
    except BenchError as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        teardown(ckpt, sampler, tmp, cluster, args.keep, lambda: remove_sandbox_netns(names))


if __name__ == "__main__":
    sys.exit(main())
