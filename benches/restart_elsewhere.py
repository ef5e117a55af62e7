#!/usr/bin/env python3
"""Restart on the same nodes vs restart with 1, 2 or 3 parts moved to other nodes, and the time
from `ckptctl drain NODE --migrate` until the job runs again, on one sandboxed MPICH job.

What it measures
----------------
Test hosts are made as multinode_vs_criu.py makes them (its Cluster, which follows
tests/src/netns.rs): a private bridge `ckbB<tag>` (address 10.250.<pid % 250>.254/24, no uplink),
and per host i = 1..6 a network namespace `ckptB<tag>n<i>` with a veth (10.250.<pid % 250>.<i>/24)
and a persistent UTS namespace bound at /run/ckpt-uts/<ns> (host name <ns>). One `ckptd` (not
--standalone) listens on the bridge address; one `ckpt-agent` per host runs inside the host's
namespaces (`nsenter --net --uts`), with its own state/local dirs and the cgroup prefix
`ckptB<tag>-<node>-`, all with one `shared_dir` (<tmp>/shared, a plain directory standing in for
the NFS mount) and `[job_network] interface = "eth0"`. Mutual TLS as a site sets it up: a cluster
CA in the temp dir (`ckptd ca init`), and `ckptd ca issue NODE | ckpt-agent enroll -` before each
agent starts. The jobs run as root (`allow_root_jobs`). ckptd.toml has, as in the e2e tests'
`three_and_a_spare` (tests/e2e/multi_node.rs):

    node_timeout = "2s"
    [spares]
    nodes = ["n4", "n5", "n6"]
    [job_network]
    addresses = "10.250.<pid % 250>.150-10.250.<pid % 250>.199"
    prefix = 24

so every part of the job runs in a sandbox (its own PID/IPC/UTS/mount namespaces and a network
namespace /run/netns/ckpt-<node>-<job> with a job address), which is what lets a part move.

Node names: hosts 1..6 are called n1..n6 in this text and in the report. By default their agents
are registered as `b<tag>n1`..`b<tag>n6` (tag = pid % 100000), because a sandbox's network
namespace is named after node and job only (/run/netns/ckpt-<node>-<job>, machine-wide): the
e2e tests name their nodes n1..n4 and their first job 1, so a benchmark using the same names could
remove or collide with a test's sandbox on the same machine. `--node-prefix n` gives exactly
n1..n6 (only when no test runs).

One job: `ckptctl run --node n1 -- mpiexec.mpich -hosts <host names of n1,n2,n3> -n 6 heat SIZE
ITERS SLEEP_US` (2 ranks per host; mpiexec reaches the others through ckpt-rsh; host names are
the hosts' UTS names, which the sandboxes keep). Once it prints its first progress line it is
checkpointed once, `ckptctl checkpoint ID --kill --wait --json` (epoch E, the job stopped), and
the script waits until `ckptctl epochs ID --json` shows E "durable" (complete in shared storage).
Then, K times, interleaved, always from that same epoch E:

  same     `ckptctl --json restart ID --epoch E`                      (n1, n2, n3)
  1 moved  `... --map n3=n4`                                           (n1, n2, n4)
  2 moved  `... --map n2=n5 --map n3=n4`                               (n1, n5, n4)
  3 moved  `... --nodes n6,n5,n4` (the epoch's nodes n1,n2,n3 in the   (n6, n5, n4)
           order `ckptctl epochs` lists them, mapped n1->n6, n2->n5, n3->n4)

A part always moves to the same spare, so n4 restores n3's images in every moved row. A moved part
fetches its images (from the partner copy the next node of the epoch keeps, or from shared
storage) and the spare installs them in its staging, where a later restart would find them as a
local copy: unless --keep-fetched, the script deletes these copies from the spares
(<spare>/local/<job>/<E>/<node>; the spares are in no epoch, so they hold nothing else) after each
moved restart, so that every move fetches. Which copy each moved part came from is read from the
agents' logs ("fetching the partner copy" / "fetching the shared copy") and shown. After each
restart the script checks (bounded) that `ckptctl status ID --json` says "running" with every part
running on the expected nodes (and `moved_from` set for the moved ones), and records ckptctl's own
`elapsed_ms` (from its --json result: request to "running again", i.e. verify + restore on every
node, then release) and the wall time of the ckptctl call. Then the job is stopped again without a
new epoch, as tests/src/lib.rs `kill_job_on` does: every process in the job's freezer cgroup
`<prefix><node>-<job>` on each of the six hosts is SIGKILLed by PID (mpiexec first) until the
cgroups are empty; the script waits until ckptd shows the job inactive ("killed (signal 9)") and
until the agents have removed the parts' sandbox namespaces (/run/netns/ckpt-<node>-<job>), since
the next restart gives the same job addresses (and MACs) to fresh sandboxes.

Drain: after the K rounds the job is restarted once more on n1, n2, n3, and `ckptctl drain n2
--migrate` is timed (wall time of the call, which returns when the job runs again; the script
then checks that it runs with n2's part on n4). Its progress lines on stderr (`[  t s] job J epoch
E PHASE: MESSAGE`, 0.1 s resolution) split it into: checkpoint (until the first line after the
checkpoint phases), copy wait (ckptd waits until another node holds a copy of n2's images of the
new epoch: its partner copy or the shared one, which the spare restores from), and restart
(first `restore` line .. `running again`).

It prints a markdown table: per row median (min) over K of ckptctl elapsed_ms and of the ckptctl
wall time, each with its ratio to the same-nodes median, and where the moved parts' images came
from; then the drain line. All hosts share one
machine (typically 2 cores), its disk and /run/ckpt/restore.lock (restores on one machine
are serialized, also against other runs' agents), so the rows show what moving costs relative to a
restart in place (fetching and verifying the images from shared storage instead of local
staging, a fresh sandbox on another host), not multi-node restart scaling.

How to run (root, Debian 12, cgroup v1 freezer, CRIU >= 4.2, MPICH, iproute2, nsenter, unshare,
nft; binaries already built, target/apps/heat.mpich built):

    benches/restart_elsewhere.py --quick --keep            # smoke test: K=1, small grid
    benches/restart_elsewhere.py                           # K=3, grid 1500
    benches/restart_elsewhere.py --wait-idle 1200 \\
        --out benches/results/restart_elsewhere-$(date +%F).md

Options: --repeats K (default 3; 0: only the drain)  --size GRID (default 1500)  --quick (K=1, grid 600, 300 s job)
--sleep-us US (default 20000)  --job-seconds S (nominal run time of the job, sets ITERS; default
600: restarts resume from E, so it only has to outlast one round and the drain)  --gap S (pause
after a restart before the job is killed, default 2)  --keep-fetched (keep the copies fetched
onto the spares: later repeats restore moved parts from them)  --node-prefix P (agent node names
P1..P6; default b<tag>n)  --out FILE  --json FILE (every sample)  --bin-dir DIR (ckptd, ckptctl,
ckpt-agent, ckpt-rsh, ckpt-init; default target/release; copied to the temp dir first)  --app PATH
(heat.mpich, default target/apps/heat.mpich, also copied)  --criu PATH  --wait-idle S (first
wait, bounded, polling every 10 s, until no cargo/rustc/single_node-/multi_node-/.ci/run/heat.*
processes run)  --keep (keep the temp dir with logs). Standard library only. Every wait is
bounded; every process the benchmark starts is stopped by PID, and every cgroup, namespace
(including leftover sandbox namespaces of its own nodes), link and UTS bind mount it creates is
removed, also on errors and Ctrl-C.
"""

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time

# the shared helpers live next to this script (benches/benchutil.py), the test hosts, ckptd and
# agent set-up in multinode_vs_criu.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import (  # noqa: E402
    REPO, BenchError, BusySampler, cg_pids, comm, emit, finished, kill_cgroup,
    log, machine_info, med, mm, mono, notes_section, progress_lines, ratio, read_text,
    require_root_and_freezer, run, table_head, wait_idle, wait_until)
from multinode_vs_criu import (  # noqa: E402
    ANSI, SUBNET, TAG, Ckpt, Cluster, busy_processes, default_criu, report_tail, stage_bins,
    stop_on_signals, teardown)

NETNS_DIR = "/run/netns"
HOSTS = 6
SPARES = (4, 5, 6)
# row label, moves as (host of the epoch -> host it restarts on); "nodes" = name every node
MODES = [
    ("same nodes", {}, "plain"),
    ("1 moved", {3: 4}, "map"),
    ("2 moved", {2: 5, 3: 4}, "map"),
    ("3 moved", {1: 6, 2: 5, 3: 4}, "nodes"),
]
PROGRESS = re.compile(r"^\[\s*([0-9.]+)s\] job (\d+) epoch (\d+) ([^:]+): (.*)$")
INACTIVE = ("killed", "exited", "stopped", "lost", "cancelled")
FETCH = re.compile(r"fetching the (partner|shared) copy")


# ---------------------------------------------------------------- ckptd and agents

class SandboxCkpt(Ckpt):
    """multinode_vs_criu's ckptd + agents, with a job network, spares, a node timeout and one
    shared_dir for every agent."""

    def __init__(self, tmp, bindir, criu, cluster, spares):
        super().__init__(tmp, bindir, criu, cluster, tls=True, shared=True)
        self.spares = spares

    def write_ckptd_config(self):
        super().write_ckptd_config()  # top-level keys only: ours follow them, then the tables
        spares = ", ".join(f'"{s}"' for s in self.spares)
        with open(self.cfg, "a") as f:
            f.write('node_timeout = "2s"\n'
                    f'[spares]\nnodes = [{spares}]\n'
                    f'[job_network]\naddresses = "{SUBNET}.150-{SUBNET}.199"\nprefix = 24\n')

    def write_agent_config(self, node):
        acfg = super().write_agent_config(node)
        with open(acfg, "a") as f:  # after the base's tables
            f.write('[job_network]\ninterface = "eth0"\n')
        return acfg

    def epochs(self, jid):
        p, _ = self.ctl("--json", "epochs", jid, timeout=30, check=False)
        if p.returncode != 0:
            return []
        try:
            return json.loads(p.stdout)
        except ValueError:
            return []


# ---------------------------------------------------------------- the job

def sandbox_netns(names, jid=None):
    """Sandbox network namespaces (/run/netns/ckpt-<node>-<job>) of these nodes (of job `jid`,
    or of any job)."""
    try:
        entries = os.listdir(NETNS_DIR)
    except OSError:
        return []
    out = []
    for e in entries:
        for n in names:
            rest = e[len(f"ckpt-{n}-"):] if e.startswith(f"ckpt-{n}-") else None
            if rest is not None and rest.isdigit() and (jid is None or rest == str(jid)):
                out.append(e)
    return sorted(out)


def remove_sandbox_netns(names):
    """Cleanup: removes sandbox namespaces of this run's nodes that the agents left behind (as
    the agent itself removes them: `ip netns del`, else unmount and unlink)."""
    for e in sandbox_netns(names):
        log(f"removing leftover sandbox namespace {e}")
        run(["ip", "-n", e, "link", "del", "eth0"], timeout=30, check=False)
        p, _ = run(["ip", "netns", "del", e], timeout=30, check=False)
        if p.returncode != 0:
            path = os.path.join(NETNS_DIR, e)
            run(["umount", "-l", path], timeout=30, check=False)
            try:
                os.remove(path)
            except OSError:
                pass


def parts(st):
    """{node: part} of a status."""
    return {n.get("node"): n for n in st.get("nodes") or []}


def wait_running(ckpt, cluster, jid, expect, timeout=30.0):
    """Waits until the job runs with a running part on exactly the nodes `expect` ({node:
    moved_from or ""}); returns the status. A BenchError names what differs, and where the job's
    cgroups hold processes (what runs, whatever ckptd's record says)."""
    last = {}

    def ok():
        st = ckpt.status(jid)
        last["st"] = st
        if str(st.get("state")) != "running":
            return None
        ps = parts(st)
        if set(ps) != set(expect):
            return None
        for n, frm in expect.items():
            if ps[n].get("state") != "running" or (ps[n].get("moved_from") or "") != frm:
                return None
        return st
    try:
        return wait_until(ok, timeout, f"job {jid} running on {sorted(expect)}", 0.2)
    except BenchError as e:
        st = last.get("st", {})
        got = {n: (p.get("state"), p.get("moved_from")) for n, p in parts(st).items()}
        procs = {n.name: len(cg_pids(n.cgroup(jid))) for n in cluster.nodes if cg_pids(n.cgroup(jid))}
        raise BenchError(f"{e}: ckptd says state {st.get('state')!r}, parts (state, moved_from) {got}; "
                         f"processes in the job's cgroups per node: {procs}")


def stop_job(ckpt, cluster, jid, timeout=90.0):
    """SIGKILLs the job's processes on every host by PID from its cgroups (tests/src/lib.rs
    kill_job_on), then waits until ckptd shows the job inactive and its sandboxes are gone."""
    # the node running mpiexec first (and, in its cgroup, mpiexec first), so that the job ends
    # as "killed (signal 9)" rather than by mpiexec's exit after losing a proxy
    launcher_first = sorted(cluster.nodes, key=lambda n: not any(
        comm(p).startswith("mpiexec") for p in cg_pids(n.cgroup(jid))))
    for node in launcher_first:
        kill_cgroup(node.cgroup(jid), timeout=60)
    names = [n.name for n in cluster.nodes]

    def stopped():
        st = str(ckpt.status(jid).get("state", ""))
        return st if st.startswith(INACTIVE) else None
    st = wait_until(stopped, timeout, f"job {jid} to be inactive after SIGKILL", 0.2)
    wait_until(lambda: not sandbox_netns(names, jid), timeout,
               f"the agents to remove job {jid}'s sandboxes ({', '.join(sandbox_netns(names, jid))})", 0.2)
    left = {n.name: cg_pids(n.cgroup(jid)) for n in cluster.nodes if cg_pids(n.cgroup(jid))}
    if left:
        raise BenchError(f"job {jid}: processes back in its cgroups after the kill: {left}")
    return st


def restart_flags(mode, moves, epoch_nodes, host):
    """ckptctl restart options for a row: `host(i)` is the node name of host i."""
    if mode == "plain":
        return []
    if mode == "map":
        return [a for src, dst in sorted(moves.items()) for a in ("--map", f"{host(src)}={host(dst)}")]
    by_name = {host(src): host(dst) for src, dst in moves.items()}
    return ["--nodes", ",".join(by_name[n] for n in epoch_nodes)]


def expected(moves, host):
    """{node: moved_from} after a restart with `moves` from an epoch on hosts 1, 2, 3."""
    return {host(moves.get(i, i)): (host(i) if i in moves else "") for i in (1, 2, 3)}


def agent_logs(ckpt, cluster):
    return {n.name: os.path.join(ckpt.tmp, f"agent-{n.name}.log") for n in cluster.nodes}


def log_sizes(ckpt, cluster):
    out = {}
    for name, path in agent_logs(ckpt, cluster).items():
        try:
            out[name] = os.path.getsize(path)
        except OSError:
            out[name] = 0
    return out


def restore_sources(ckpt, cluster, since, nodes):
    """{node: where its part's images came from}, for `nodes`, from what their agents logged
    after the offsets `since`: "partner" or "shared" (the last copy fetched; crates/node-agent
    copies.rs logs each fetch), else "local"."""
    out = {}
    for name, path in agent_logs(ckpt, cluster).items():
        if name not in nodes:
            continue
        try:
            with open(path, "rb") as f:
                f.seek(since.get(name, 0))
                text = ANSI.sub("", f.read().decode(errors="replace"))
        except OSError:
            text = ""
        found = FETCH.findall(text)
        out[name] = found[-1] if found else "local"
    return out


def fetched_copies(cluster, jid, epoch):
    """Copies of n1..n3's images of `epoch` that a restore fetched onto the spares n4..n6 (and
    installed in their staging, <local_dir>/<job>/<epoch>/<node>): the spares are in no epoch,
    so they keep no partner copies, only these."""
    out = []
    for t in SPARES:
        for s in (1, 2, 3):
            d = os.path.join(cluster.nodes[t - 1].dir, "local", str(jid), str(epoch), cluster.nodes[s - 1].name)
            if os.path.isdir(d):
                out.append(d)
    return out


def one_restart(ckpt, cluster, jid, epoch, flags, expect):
    p, wall = ckpt.ctl_json("restart", jid, "--epoch", str(epoch), *flags)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if "elapsed_ms" not in r:
        raise BenchError(f"ckptctl restart gave no elapsed_ms: {p.stdout.strip()[-400:]}")
    if r.get("epoch") not in (None, epoch):
        raise BenchError(f"restarted from epoch {r.get('epoch')}, not {epoch}: {r}")
    t = mono()
    wait_running(ckpt, cluster, jid, expect)
    return float(r["elapsed_ms"]), wall * 1000.0, (mono() - t) * 1000.0


def parse_drain(stderr):
    """(checkpoint s, flush wait s, restart s, ckptd's total s) from drain's progress lines."""
    lines = []
    for l in stderr.splitlines():
        m = PROGRESS.match(l.strip())
        if m:
            lines.append((float(m.group(1)), m.group(4).strip(), m.group(5)))
    ck = [t for t, ph, msg in lines if ph not in ("drain", "restore")]
    after_ck = [t for t, ph, msg in lines if ck and t >= ck[-1] and ph in ("drain", "restore")
                and not msg.startswith("checkpointing")]
    rs = [t for t, ph, msg in lines if ph == "restore"]
    done = [t for t, ph, msg in lines if ph == "restore" and msg.startswith("running again")]
    if not ck or not rs or not done or not after_ck:
        return None
    t_ck = after_ck[0]
    return t_ck, rs[0] - t_ck, done[-1] - rs[0], done[-1]


def bench(ckpt, cluster, args, iters, app, k, res):
    host = lambda i: cluster.nodes[i - 1].name  # noqa: E731
    hosts = ",".join(nd.netns for nd in cluster.nodes[:3])
    cmd = ["mpiexec.mpich", "-hosts", hosts, "-n", "6", app, str(args.size), str(iters),
           str(args.sleep_us)]
    p, _ = ckpt.ctl("run", "--name", "heat", "--node", host(1), "--", *cmd, timeout=60)
    jid = p.stdout.strip().split()[-1]
    ckpt.jobs.append(jid)
    res["job"] = jid
    n1 = cluster.nodes[0]
    stdout = os.path.join(n1.dir, "state", "jobs", jid, "stdout")
    stderr = os.path.join(n1.dir, "state", "jobs", jid, "stderr")
    log(f"job {jid}: {shlex.join(cmd)}")
    try:
        def first_line():
            st = ckpt.status(jid).get("state", "")
            if st and not str(st).startswith(("running", "starting")):
                raise BenchError(f"job {jid} is {st!r} before its first progress line: "
                                 f"{read_text(stderr)[-800:]}")
            return progress_lines(stdout) >= 1
        wait_until(first_line, max(120.0, args.job_seconds / 20 * 4), f"job {jid}: first progress line", 0.2)
        st = wait_running(ckpt, cluster, jid, expected({}, host))
        ranks = {n: len(pt.get("ranks") or []) for n, pt in parts(st).items()}
        addrs = {n: pt.get("address") for n, pt in parts(st).items()}
        log(f"job {jid} computing; ranks per node {ranks}, job addresses {addrs}")
        if sorted(ranks.values()) != [2, 2, 2]:
            res["notes"].append(f"ranks per node {ranks} (expected 2 each)")

        # the one epoch every restart starts from
        p, wall = ckpt.ctl_json("checkpoint", jid, "--kill", "--wait")
        e = json.loads(p.stdout.strip().splitlines()[-1])
        if e.get("state") not in (None, "committed"):
            raise BenchError(f"epoch not committed: {e}")
        epoch = int(e["epoch"])
        res["epoch"] = {k2: e.get(k2) for k2 in ("epoch", "frozen_ms", "total_ms", "image_bytes", "image_files")}
        log(f"epoch {epoch}: frozen {e.get('frozen_ms')} ms, total {e.get('total_ms')} ms, "
            f"{int(e.get('image_bytes') or 0) / 2**20:.1f} MiB; job stopped")

        def durable():
            for x in ckpt.epochs(jid):
                if int(x.get("epoch", -1)) == epoch:
                    if x.get("storage") == "flush-failed":
                        raise BenchError(f"epoch {epoch} flush failed: {x.get('flush_detail') or x.get('reason')}")
                    return x if x.get("storage") == "durable" else None
            return None
        t = mono()
        ex = wait_until(durable, 600, f"epoch {epoch} to be durable", 0.2)
        epoch_nodes = list(ex.get("nodes") or [])
        res["epoch"]["durable_after_ms"] = (mono() - t) * 1000.0
        res["epoch"]["nodes"] = epoch_nodes
        log(f"epoch {epoch} durable ({res['epoch']['durable_after_ms']:.0f} ms after commit); nodes {epoch_nodes}")
        if sorted(epoch_nodes) != sorted(host(i) for i in (1, 2, 3)):
            raise BenchError(f"epoch {epoch} has nodes {epoch_nodes}, expected {[host(i) for i in (1, 2, 3)]}")
        st = stop_job(ckpt, cluster, jid)  # --kill stopped it; this waits for the sandboxes
        log(f"job {jid} is {st!r}, sandboxes gone")

        for i in range(k):
            for label, moves, mode in MODES:
                flags = restart_flags(mode, moves, epoch_nodes, host)
                expect = expected(moves, host)
                time.sleep(args.gap)
                since = log_sizes(ckpt, cluster)
                elapsed, wall, confirm = one_restart(ckpt, cluster, jid, epoch, flags, expect)
                src = restore_sources(ckpt, cluster, since, [n for n, frm in expect.items() if frm])
                r = res["rows"][label]
                r["elapsed"].append(elapsed)
                r["wall"].append(wall)
                r["confirm"].append(confirm)
                r["sources"].append(src)
                r["flags"] = flags
                log(f"{label} {i + 1}/{k} ({' '.join(flags) or 'no flags'}): restart {elapsed:.0f} ms "
                    f"(ckptctl {wall:.0f} ms); running on {sorted(expect)}"
                    + (f"; moved parts' images from {src}" if src else ""))
                time.sleep(args.gap)
                st = stop_job(ckpt, cluster, jid)
                log(f"job {jid} {st}")
                if not args.keep_fetched:
                    # so that every moved restart fetches the images, as a real move does
                    for d in fetched_copies(cluster, jid, epoch):
                        shutil.rmtree(d)

        # drain: restart in place, then `ckptctl drain n2 --migrate`
        time.sleep(args.gap)
        elapsed, wall, _ = one_restart(ckpt, cluster, jid, epoch, [], expected({}, host))
        res["pre_drain_restart"] = elapsed
        log(f"restarted on {[host(i) for i in (1, 2, 3)]} for the drain ({elapsed:.0f} ms)")
        time.sleep(max(args.gap, 2.0))
        since = log_sizes(ckpt, cluster)
        t0 = mono()
        p, _ = ckpt.ctl("drain", host(2), "--migrate", timeout=900, check=False)
        wall = mono() - t0
        if p.returncode != 0:
            raise BenchError(f"ckptctl drain {host(2)} --migrate (exit {p.returncode}): "
                             f"{(p.stderr.strip() + ' | ' + p.stdout.strip())[-1200:]}")
        st = wait_running(ckpt, cluster, jid, {host(1): "", host(4): host(2), host(3): ""})
        running = (mono() - t0) * 1000.0
        with open(os.path.join(ckpt.tmp, "drain.stderr"), "w") as f:
            f.write(p.stderr)
        res["drain"] = {"wall": wall * 1000.0, "to_running": running, "stdout": p.stdout.strip(),
                        "source": restore_sources(ckpt, cluster, since, [host(4)]).get(host(4))}
        split = parse_drain(p.stderr)
        if split:
            res["drain"].update(checkpoint=split[0] * 1000.0, flush_wait=split[1] * 1000.0,
                                restart=split[2] * 1000.0, ckptd_total=split[3] * 1000.0)
        else:
            res["notes"].append("could not split drain's progress lines (see drain.stderr with --keep)")
        log(f"drain {host(2)} --migrate: {wall * 1000:.0f} ms to return, {running:.0f} ms until "
            f"status shows it running; {p.stdout.strip()}")
        if finished(stdout) or finished(os.path.join(n1.dir, "state", "jobs", jid, "stdout")):
            res["notes"].append("the job printed its result during the run: use a larger --job-seconds")
    finally:
        ckpt.cancel(jid, cluster.nodes)


# ---------------------------------------------------------------- report

def render(res, k, header, host, keep_fetched):
    out = [header, ""]
    out.append(f"Median (min) over K={k}, times in ms, every restart from the same epoch of the same "
               "job, the rows interleaved. `elapsed_ms` = ckptctl's own (--json) time from the "
               "request to \"running again\" (verify + restore every part held, then release); "
               "ckptctl wall = the whole `ckptctl restart` call. Ratios are to the same-nodes median. "
               "Images from: where each moved part's images came from, per the agents' logs (partner = "
               "the copy the next node of the epoch keeps, shared = shared storage, local = already in "
               "the spare's staging), counted over all moved parts and repeats"
               + ("" if keep_fetched else "; the copies a restore fetched onto a spare are deleted "
                  "before the next restart, so every move fetches") + ".")
    out.append("")
    out += table_head("restart", "options", "restart elapsed_ms", "ratio", "ckptctl wall",
                      "ratio (wall)", "moved parts' images from")
    base = res["rows"]["same nodes"]
    be, bw = med(base["elapsed"]), med(base["wall"])
    for label, moves, mode in MODES:
        r = res["rows"][label]
        opts = " ".join(r.get("flags") or []) or "–"
        for name in sorted({n.name for n in host.nodes}, key=len, reverse=True):
            opts = opts.replace(name, f"n{host.index[name]}")
        counts = {}
        for src in r["sources"]:
            for v in src.values():
                counts[v] = counts.get(v, 0) + 1
        srcs = ", ".join(f"{v} ×{c}" for v, c in sorted(counts.items())) or "–"
        out.append(f"| {label} | `{opts}` | {mm(r['elapsed'])} | {ratio(med(r['elapsed']), be)} "
                   f"| {mm(r['wall'])} | {ratio(med(r['wall']), bw)} | {srcs} |")
    d = res.get("drain")
    out.append("")
    if d:
        line = (f"Drain: `ckptctl drain n2 --migrate` → running again (n2's part on n4): "
                f"**{d['wall']:,.0f} ms** (until `ckptctl status` confirmed it: {d['to_running']:,.0f} ms)")
        if "checkpoint" in d:
            line += (f"; from its progress lines (0.1 s resolution): checkpoint {d['checkpoint']:,.0f} ms, "
                     f"wait for a copy of n2's images on another node {d['flush_wait']:,.0f} ms, "
                     f"restart {d['restart']:,.0f} ms")
        if d.get("source"):
            line += f"; n4 got n2's images from its {d['source']} copy"
        out.append(line + ".")
    else:
        out.append("Drain: not measured.")
    out += notes_section([("run", res)])
    return "\n".join(out) + "\n"


class Names:
    """Maps node names back to host numbers for the report."""

    def __init__(self, cluster):
        self.nodes = cluster.nodes
        self.index = {n.name: n.i for n in cluster.nodes}


def machine_header(cmdline, criu, size, iters, sleep_us, prefix, epoch):
    criu_v, mpich_v, mem = machine_info(criu)
    ncpu = os.cpu_count()
    ep = ""
    if epoch:
        ep = (f" The epoch: {int(epoch.get('image_bytes') or 0) / 2**20:,.1f} MiB in "
              f"{epoch.get('image_files')} files, frozen {epoch.get('frozen_ms')} ms, total "
              f"{epoch.get('total_ms')} ms, durable {epoch.get('durable_after_ms', 0):,.0f} ms after commit.")
    return (f"## Restart in place vs on other nodes, and drain --migrate, "
            f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Machine: nproc {ncpu}, {mem} MiB RAM, kernel {os.uname().release}, CRIU {criu_v}, MPICH {mpich_v}. "
            f"Job: `mpiexec.mpich -hosts <host names of n1,n2,n3> -n 6 heat {size} {iters} {sleep_us}` "
            f"(2 ranks per node, sandboxed: job network, spares n4,n5,n6, shared_dir on the local disk), "
            f"started with `ckptctl run --node n1`; node names in ckptd are `{prefix}1`..`{prefix}6`.{ep}\n\n"
            f"Note: all nodes are namespaces on this one {ncpu}-core machine sharing its disk; restores on "
            f"one machine are serialized by /run/ckpt/restore.lock, and \"shared storage\" is a "
            f"directory on the same disk as local staging.\n\n"
            f"Command: `{cmdline}`")


def write_json(path, res, k, cmdline, prefix):
    doc = {"command": cmdline, "repeats": k, "node_prefix": prefix, **res}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    log(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, metavar="K")
    ap.add_argument("--size", type=int, default=None, help="heat grid size N (default 1500; 600 with --quick)")
    ap.add_argument("--quick", action="store_true", help="K=1, grid 600, 300 s job (smoke test)")
    ap.add_argument("--out", help="also write the markdown table to this file")
    ap.add_argument("--json", metavar="FILE", help="also write every sample as JSON")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    ap.add_argument("--app", default=os.path.join(REPO, "target", "apps", "heat.mpich"))
    ap.add_argument("--criu", default=default_criu())
    ap.add_argument("--sleep-us", type=int, default=20000)
    ap.add_argument("--job-seconds", type=float, default=None,
                    help="nominal run time of the job (sets ITERS; default 600, 300 with --quick)")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between steps")
    ap.add_argument("--keep-fetched", action="store_true",
                    help="keep the images a moved restart fetched onto a spare (later repeats then "
                         "restore from there, as from a local copy)")
    ap.add_argument("--node-prefix", default=f"b{TAG}n",
                    help="agents' node names are PREFIX1..PREFIX6 (default b<pid%%100000>n)")
    ap.add_argument("--wait-idle", type=float, default=0,
                    help="first wait up to this many seconds (polling every 10 s) until no "
                         "cargo/rustc/single_node-/multi_node-/.ci/run/heat.* processes run")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args()

    require_root_and_freezer()
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,20}", args.node_prefix):
        sys.exit("--node-prefix: a letter, then at most 20 letters or digits")
    k = 1 if args.quick else args.repeats
    if k < 0:
        sys.exit("--repeats: 0 (only the drain) or more")
    if args.size is None:
        args.size = 600 if args.quick else 1500
    if args.job_seconds is None:
        args.job_seconds = 300.0 if args.quick else 600.0
    iters = 20 * max(1, round(args.job_seconds / 20 / (args.sleep_us / 1e6)))
    cmdline = shlex.join([sys.argv[0]] + sys.argv[1:])

    if args.wait_idle > 0:
        wait_idle(busy_processes, args.wait_idle, poll=10)

    tmp = tempfile.mkdtemp(prefix="ckpt-bench-re-")
    log(f"work dir {tmp}; K={k}, heat {args.size} {iters} {args.sleep_us}, nodes {args.node_prefix}1..6")
    cluster = Cluster(HOSTS)
    names = [f"{args.node_prefix}{i}" for i in range(1, HOSTS + 1)]
    ckpt = None
    res = {"rows": {label: {"elapsed": [], "wall": [], "confirm": [], "sources": []} for label, _, _ in MODES},
           "notes": []}
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
        ckpt = SandboxCkpt(tmp, bindir, args.criu, cluster, names[SPARES[0] - 1:])
        ckpt.start()
        try:
            bench(ckpt, cluster, args, iters, app, k, res)
        except BenchError as e:
            res["error"] = str(e)
            log(f"FAILED: {e}")
        took = mono() - t_start
        sampler.stop.set()
        sampler.join(timeout=30)
        header = machine_header(cmdline, args.criu, args.size, iters, args.sleep_us, args.node_prefix,
                                res.get("epoch"))
        table = report_tail(render(res, k, header, Names(cluster), args.keep_fetched), tmp, cluster,
                            sampler, took)
        emit(table, args.out)
        if args.json:
            write_json(args.json, res, k, cmdline, args.node_prefix)
        return 1 if res.get("error") else 0
    except BenchError as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        teardown(ckpt, sampler, tmp, cluster, args.keep, lambda: remove_sandbox_netns(names))


if __name__ == "__main__":
    sys.exit(main())
