#!/usr/bin/env python3
"""Multi-node ckpt vs raw parallel CRIU on the same MPICH job, for 1, 2, 3 and 4 nodes.

What it measures
----------------
Test nodes are made the way the project's tests make them (tests/src/netns.rs): a private bridge
`ckbB<tag>` (address 10.250.<pid % 250>.254/24, no uplink), and per node i a network namespace
`ckptB<tag>n<i>` with a veth (10.250.<pid % 250>.<i>/24) and a persistent UTS namespace bound at
/run/ckpt-uts/<ns> (host name <ns>). One `ckptd` (not --standalone) listens on the bridge address;
one `ckpt-agent` per node runs inside the node's namespaces (`nsenter --net --uts`, never
`ip netns exec`), with its own state/local dirs and the cgroup prefix `ckptB<tag>-n<i>-`.
ckptd and the agents authenticate each other with mutual TLS, set up as a site does it: a cluster
CA in the temp dir (`ckptd ca init`), and before each agent starts, `ckptd ca issue n<i> |
ckpt-agent enroll -` into that agent's own `tls_dir`. The jobs run as root (`allow_root_jobs`).
With --no-tls (binaries that predate authentication, e.g. commit a2ee541) none of this is done
and the configs have neither key.

For each node count N it starts one job, `ckptctl run --node n1 -- mpiexec.mpich -hosts
<ip1,..,ipN> -n 2N heat SIZE ITERS SLEEP_US` (2 ranks per node; mpiexec reaches the other nodes
through ckpt-rsh), waits for its first progress line and then, K times, interleaved on that same
running job (so both see the same process trees):

B. raw CRIU: on every node in parallel (one thread per node) write FROZEN to the job's freezer
   cgroup and wait until it reads FROZEN; once ALL nodes are frozen, run on every node in parallel
   `nsenter --net --uts -- criu dump -t <root of the node's tree> --leave-running --freeze-cgroup
   <cg> ...` with the flags ckpt's agent uses (crates/node-agent/src/engine/criu.rs: -v4
   --link-remap --ghost-limit 256M --ext-unix-sk --file-locks --tcp-established --network-lock
   nftables); when all dumps are done, thaw every node in parallel. Raw frozen time = from just
   before the first FROZEN write until the last THAWED is read back (the same span is the raw
   checkpoint time: raw CRIU has no sealing step). Also reported: "dump only" (the slowest node's
   criu wall time) and the per-node frozen span (max over nodes of that node's FROZEN write ..
   THAWED read), which is how ckpt defines `frozen_ms`. The root of a node's tree is the one
   process of the node's cgroup whose parent is not in the cgroup (mpiexec on n1, `sh` on the
   others). The raw images are deleted after each measurement.

A. ckpt: `ckptctl checkpoint ID --wait --json` -> `frozen_ms` (max over nodes of first freeze ..
   last thaw), `total_ms` (whole epoch incl. sealing: digest + fsync), `image_bytes`, and the
   ckptctl wall time.

It prints a markdown table with median (min) over K per node count. All nodes share one machine
(nproc is printed; typically 2 cores), so N nodes means N times the dump work on the same cores:
the numbers show the coordination overhead of ckpt relative to raw CRIU, not multi-node scaling.

How to run (root, Debian 12, cgroup v1 freezer, CRIU >= 4.2, MPICH, iproute2, nsenter, unshare;
binaries already built):

    benches/multinode_vs_criu.py --quick                  # smoke test: N = 1,2 nodes, K=2
    benches/multinode_vs_criu.py                          # N = 1,2,3,4 nodes, K=5
    benches/multinode_vs_criu.py --wait-idle 1200 \\
        --out benches/results/multinode_vs_criu-$(date +%F).md

Options: --nodes 1,2,..  --size GRID (default 1500)  --repeats K  --quick  --out FILE
--bin-dir DIR (ckptd/ckptctl/ckpt-agent/ckpt-rsh, default target/release; copied to a temp dir
first so a rebuild during the run does not matter)  --app PATH (heat.mpich, default
target/apps/heat.mpich, also copied)  --criu PATH  --sleep-us US  --job-seconds S (nominal run time
of each job; sets ITERS)  --gap S (pause between measurements)  --wait-idle S (first wait, bounded,
polling every 10 s, until no cargo/rustc/single_node-/multi_node-/.ci/run/heat.* processes run)
--no-tls (the binaries predate authentication: no CA, no enrollment, old-style configs)
--json FILE (also write every sample as JSON)  --keep (keep the temp dir with logs). Standard
library only. Every wait is bounded; every process the benchmark starts is stopped by PID, and
every cgroup, namespace, link and UTS bind mount it creates is removed, also on errors and Ctrl-C.
"""

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# the shared helpers live next to this script (benches/benchutil.py)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import (  # noqa: E402
    FREEZER, REPO, BenchError, BusySampler, Ckptctl, cg_pids, comm, dir_bytes, emit, finished,
    force_thaw, keep_or_remove, kill_cgroup, log, machine_info, med, mm, mono, notes_section,
    progress_lines, ratio, read_text,
    require_root_and_freezer, record_checkpoint, run, set_freezer, stop_proc, table_head,
    wait_idle, wait_until)
UTS_DIR = "/run/ckpt-uts"
TAG = os.getpid() % 100000
SUBNET = f"10.250.{os.getpid() % 250}"
CG_PREFIX = f"ckptB{TAG}-"  # every job cgroup of this run starts with it
ANSI = re.compile(r"\x1b\[[0-9;]*m")
CRIU_FLAGS = ["-v4", "--leave-running", "--link-remap", "--ghost-limit", "256M",
              "--ext-unix-sk", "--file-locks", "--tcp-established", "--network-lock", "nftables"]


# ---------------------------------------------------------------- processes and cgroups

def ppid(pid):
    st = read_text(f"/proc/{pid}/stat")
    return int(st.rsplit(")", 1)[1].split()[1]) if st else 0


def sweep(tmp, timeout=60.0):
    """Final cleanup after ckptd and the agents are stopped: SIGKILLs, by PID, every process left
    in this run's job cgroups (prefix CG_PREFIX) and every process whose command line names this
    run's private temp dir (shims, a job caught mid-launch), then removes the cgroups. Repeats
    until nothing is left (a shim may move a child into a cgroup after a first pass). Bounded."""
    deadline = mono() + timeout
    while True:
        left = []
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != os.getpid():
                if tmp in read_text(f"/proc/{d}/cmdline").replace("\0", " "):
                    left.append(int(d))
                    try:
                        os.kill(int(d), signal.SIGKILL)
                    except OSError:
                        pass
        cgs = [os.path.join(FREEZER, c) for c in os.listdir(FREEZER) if c.startswith(CG_PREFIX)]
        for cg in cgs:
            try:
                kill_cgroup(cg, timeout=5, mpiexec_first=False)
                os.rmdir(cg)
            except (BenchError, OSError):
                pass
        cgs = [c for c in cgs if os.path.isdir(c)]
        if not cgs and not left:
            return
        if mono() > deadline:
            log(f"warning: cleanup gave up after {timeout:.0f} s: cgroups {cgs}, processes {left}")
            return
        if left:
            log(f"killed leftover processes {left}")
        time.sleep(0.2)


def parallel(fn, items, timeout):
    """Runs fn(item) for every item in its own thread; returns the results in order, or raises
    the first error (after all threads ended or the bounded join gave up)."""
    results = [None] * len(items)
    errors = [None] * len(items)

    def body(i, item):
        try:
            results[i] = fn(item)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i, it), daemon=True) for i, it in enumerate(items)]
    for t in threads:
        t.start()
    deadline = mono() + timeout
    for t in threads:
        t.join(max(0.0, deadline - mono()))
    if any(t.is_alive() for t in threads):
        raise BenchError(f"parallel step did not finish within {timeout:.0f} s")
    for e in errors:
        if e is not None:
            raise e if isinstance(e, BenchError) else BenchError(f"{type(e).__name__}: {e}")
    return results


# ---------------------------------------------------------------- test nodes

class Node:
    def __init__(self, i):
        self.i = i
        self.name = f"n{i}"
        self.netns = f"ckptB{TAG}n{i}"
        self.ip = f"{SUBNET}.{i}"
        self.veth = f"ckvB{TAG}n{i}"
        self.peer = f"ckpB{TAG}n{i}"
        self.uts = os.path.join(UTS_DIR, self.netns)
        self.agent = None
        self.dir = None

    def nsenter(self):
        return ["nsenter", f"--net=/run/netns/{self.netns}", f"--uts={self.uts}", "--"]

    def cgroup(self, jid):
        return os.path.join(FREEZER, f"{CG_PREFIX}{self.name}-{jid}")


class Cluster:
    """A bridge and N nodes (network + UTS namespaces), as tests/src/netns.rs makes them."""

    def __init__(self, n):
        self.bridge = f"ckbB{TAG}"
        self.host_ip = f"{SUBNET}.254"
        self.nodes = []
        self.bridge_made = False
        self.n = n

    def create(self):
        if os.path.exists(f"/sys/class/net/{self.bridge}"):
            raise BenchError(f"link {self.bridge} already exists (another run with the same tag?)")
        for line in run(["ip", "-o", "-4", "addr", "show"], timeout=20)[0].stdout.splitlines():
            if f" {SUBNET}." in line:
                raise BenchError(f"subnet {SUBNET}.0/24 is already in use: {line.strip()}")
        ip = lambda *a: run(["ip", *a], timeout=30)  # noqa: E731
        ip("link", "add", self.bridge, "type", "bridge")
        self.bridge_made = True
        ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        os.makedirs(UTS_DIR, exist_ok=True)
        for i in range(1, self.n + 1):
            node = Node(i)
            ip("netns", "add", node.netns)
            self.nodes.append(node)
            ip("link", "add", node.veth, "type", "veth", "peer", "name", node.peer)
            ip("link", "set", node.peer, "netns", node.netns)
            ip("link", "set", node.veth, "master", self.bridge, "up")
            ip("-n", node.netns, "link", "set", node.peer, "name", "eth0")
            ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
            ip("-n", node.netns, "link", "set", "eth0", "up")
            ip("-n", node.netns, "link", "set", "lo", "up")
            open(node.uts, "a").close()
            run(["unshare", f"--uts={node.uts}", "hostname", node.netns], timeout=30)
        log(f"created {self.n} test nodes on bridge {self.bridge} ({SUBNET}.0/24)")

    def destroy(self):
        for node in self.nodes:
            run(["ip", "netns", "del", node.netns], timeout=30, check=False)
            run(["ip", "link", "del", node.veth], timeout=30, check=False)
            run(["umount", node.uts], timeout=30, check=False)
            try:
                os.remove(node.uts)
            except OSError:
                pass
        if self.bridge_made:
            run(["ip", "link", "del", self.bridge], timeout=30, check=False)
        self.nodes = []


def free_port(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((addr, 0))
        return s.getsockname()[1]
    finally:
        s.close()


# ---------------------------------------------------------------- ckptd and agents

class Ckpt(Ckptctl):
    def __init__(self, tmp, bindir, criu, cluster, tls=True, shared=False):
        super().__init__(bindir, os.path.join(tmp, "ckptd.sock"), tmp)
        self.tmp = tmp
        self.criu = criu
        self.cluster = cluster
        self.tls = tls  # False: binaries that predate authentication (no CA, old-style configs)
        # shared: one <tmp>/shared as every agent's shared_dir (a directory on the same disk,
        # standing in for the NFS mount)
        self.shared = os.path.join(tmp, "shared") if shared else None
        if self.shared:
            os.makedirs(self.shared)
        self.cfg = os.path.join(tmp, "ckptd.toml")
        self.log = os.path.join(tmp, "ckptd.log")
        self.proc = None
        self.jobs = []

    def run_job(self, name, node, cmd):
        """`ckptctl run --name NAME --node NODE -- CMD`; the job id (the job is cancelled at
        teardown)."""
        p, _ = self.ctl("run", "--name", name, "--node", node, "--", *cmd, timeout=60)
        jid = p.stdout.strip().split()[-1]
        self.jobs.append(jid)
        return jid

    def write_ckptd_config(self):
        """ckptd.toml; with TLS, the cluster CA and ckptd's credential live in <tmp>/ca."""
        with open(self.cfg, "w") as f:
            f.write(f'listen = "{self.coord}"\n'
                    f'socket = "{self.sock}"\n'
                    f'database = "{self.tmp}/ckptd.redb"\n'
                    + (f'tls_dir = "{self.tmp}/ca"\n' if self.tls else ""))

    def write_agent_config(self, node):
        """The agent.toml of `node`; with TLS, its credential lives in its own <node dir>/tls."""
        acfg = os.path.join(node.dir, "agent.toml")
        with open(acfg, "w") as f:
            f.write(f'node_name = "{node.name}"\n'
                    f'listen = "{node.ip}:7601"\n'
                    f'coordinator = "{self.coord}"\n'
                    f'state_dir = "{node.dir}/state"\n'
                    f'local_dir = "{node.dir}/local"\n'
                    f'heartbeat_interval = "200ms"\n'
                    + (f'tls_dir = "{node.dir}/tls"\n'
                       # the benchmark runs as root, so its jobs do
                       'allow_root_jobs = true\n' if self.tls else "")
                    + (f'shared_dir = "{self.shared}"\n' if self.shared else "")
                    + f'[criu]\npath = "{self.criu}"\n'
                    f'[cgroup]\nprefix = "{CG_PREFIX}{node.name}-"\n')
        return acfg

    def ca_init(self):
        """Creates the cluster CA and ckptd's credential, as a site does: `ckptd ca init`."""
        run([os.path.join(self.bindir, "ckptd"), "--config", self.cfg, "ca", "init"], timeout=60,
            cwd=self.tmp)

    def enroll(self, node, acfg):
        """Installs `node`'s credential, as an admin does: `ckptd ca issue NODE | ckpt-agent
        enroll -` (the bundle, which holds the node's private key, stays in memory)."""
        bundle, _ = run([os.path.join(self.bindir, "ckptd"), "--config", self.cfg, "ca", "issue",
                         node.name], timeout=60, cwd=self.tmp)
        cmd = [os.path.join(self.bindir, "ckpt-agent"), "--config", acfg, "enroll", "-"]
        try:
            p = subprocess.run(cmd, input=bundle.stdout, capture_output=True, text=True, timeout=60,
                               cwd=self.tmp)
        except subprocess.TimeoutExpired:
            raise BenchError(f"timed out after 60 s: {shlex.join(cmd)}")
        if p.returncode != 0:
            raise BenchError(f"enroll {node.name}: exit {p.returncode}: "
                             f"{(p.stderr or p.stdout).strip()[-800:]}")

    def start(self):
        port = free_port(self.cluster.host_ip)
        self.coord = f"{self.cluster.host_ip}:{port}"
        self.write_ckptd_config()
        if self.tls:
            self.ca_init()
        env = dict(os.environ, CKPT_LOG="info")
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen([os.path.join(self.bindir, "ckptd"), "--config", self.cfg],
                                         stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
                                         close_fds=True, start_new_session=True, cwd=self.tmp)
        log(f"ckptd pid {self.proc.pid} on {self.coord}")
        for node in self.cluster.nodes:
            node.dir = os.path.join(self.tmp, node.name)
            os.makedirs(node.dir)
            acfg = self.write_agent_config(node)
            if self.tls:
                self.enroll(node, acfg)
            with open(os.path.join(self.tmp, f"agent-{node.name}.log"), "ab") as logf:
                # nsenter (no --fork, no PID namespace) execs the agent: the PID is the agent's
                node.agent = subprocess.Popen(node.nsenter() + [os.path.join(self.bindir, "ckpt-agent"),
                                                                "--config", acfg],
                                              stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                              env=env, close_fds=True, start_new_session=True,
                                              cwd=self.tmp)
        n = len(self.cluster.nodes)

        def ready():
            if self.proc.poll() is not None:
                raise BenchError(f"ckptd exited with {self.proc.returncode}: {read_text(self.log)[-1500:]}")
            for node in self.cluster.nodes:
                if node.agent.poll() is not None:
                    raise BenchError(f"agent {node.name} exited with {node.agent.returncode}: "
                                     f"{read_text(os.path.join(self.tmp, f'agent-{node.name}.log'))[-1500:]}")
            if not os.path.exists(self.sock) or read_text(self.log).count("agent registered") < n:
                return False
            return self.ctl("list", timeout=10, check=False)[0].returncode == 0
        wait_until(ready, 60, f"ckptd to answer and {n} agents to register", 0.2)
        log(f"ckptd ready, {n} agents registered")

    def cancel(self, jid, nodes):
        self.ctl("cancel", jid, timeout=60, check=False)
        try:
            st = wait_until(lambda: (lambda s: None if s.startswith("running") else s)(
                str(self.status(jid).get("state", "running"))), 30, f"job {jid} to stop after cancel", 0.2)
            log(f"job {jid} cancelled; its state is now {st!r}")
        except BenchError as e:
            log(f"warning: {e}")
        for node in nodes:
            try:
                kill_cgroup(node.cgroup(jid), timeout=30, mpiexec_first=False)
            except BenchError as e:
                log(f"warning: {e}")
        if jid in self.jobs:
            self.jobs.remove(jid)

    def stop(self):
        for jid in list(self.jobs):
            if self.proc is not None and self.proc.poll() is None:
                self.ctl("cancel", jid, timeout=30, check=False)
        for node in self.cluster.nodes:
            stop_proc(node.agent, f"agent {node.name}")
        stop_proc(self.proc, "ckptd")


# ---------------------------------------------------------------- one node count

def tree_root(cg):
    """The process of cgroup `cg` whose parent is not in it; exactly one is expected."""
    pids = set(cg_pids(cg))
    roots = sorted(p for p in pids if ppid(p) not in pids)
    if len(roots) != 1:
        raise BenchError(f"{cg}: expected one tree root, found {[(p, comm(p)) for p in roots]}")
    return roots[0]


def raw_dump(nodes, jid, criu, base, i):
    """Freeze all nodes in parallel, dump all in parallel once all are frozen, thaw all."""
    cgs = [n.cgroup(jid) for n in nodes]
    roots = [tree_root(cg) for cg in cgs]
    dirs = [os.path.join(base, f"raw-{n.name}-{i}") for n in nodes]
    for d in dirs:
        os.makedirs(d)
    spans = {}

    def freeze(k):
        spans[k] = [mono(), None]
        set_freezer(cgs[k], "FROZEN")

    def dump(k):
        cmd = nodes[k].nsenter() + [criu, "dump", "-t", str(roots[k]), "-D", dirs[k], "-o", "dump.log",
                                    "--freeze-cgroup", cgs[k]] + CRIU_FLAGS
        t = mono()
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=900)
        wall = mono() - t
        if p.returncode != 0:
            errs = [l for l in read_text(os.path.join(dirs[k], "dump.log")).splitlines() if "Error" in l]
            raise BenchError(f"{nodes[k].name}: criu dump exit {p.returncode}: "
                             f"{' | '.join(errs[-4:]) or p.stderr.decode(errors='replace')[-500:]}")
        return wall

    def thaw(k):
        set_freezer(cgs[k], "THAWED")
        spans[k][1] = mono()

    idx = list(range(len(nodes)))
    os.sync()
    t0 = mono()
    try:
        parallel(freeze, idx, 60)
        walls = parallel(dump, idx, 960)
    finally:
        try:
            parallel(thaw, idx, 60)
        except BenchError as e:
            log(f"warning: thaw: {e}")
            for cg in cgs:  # last resort, so that the job is never left frozen
                force_thaw(cg)
            raise
    t1 = mono()
    nbytes = sum(dir_bytes(d) for d in dirs)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    return {"frozen": (t1 - t0) * 1000.0, "dump": max(walls) * 1000.0,
            "node_frozen": max(b - a for a, b in spans.values()) * 1000.0, "bytes": nbytes}


def bench_nodes(ckpt, cluster, n, args, iters, app, k, res):
    nodes = cluster.nodes[:n]
    hosts = ",".join(nd.ip for nd in nodes)
    cmd = ["mpiexec.mpich", "-hosts", hosts, "-n", str(2 * n), app, str(args.size), str(iters),
           str(args.sleep_us)]
    jid = ckpt.run_job("heat", "n1", cmd)
    stdout = os.path.join(nodes[0].dir, "state", "jobs", jid, "stdout")
    stderr = os.path.join(nodes[0].dir, "state", "jobs", jid, "stderr")
    log(f"N={n}: job {jid}: {shlex.join(cmd)}")
    base = os.path.join(ckpt.tmp, f"raw-{n}")
    os.makedirs(base)
    try:
        def first_line():
            st = ckpt.status(jid).get("state", "")
            if st and not str(st).startswith("running"):
                raise BenchError(f"job {jid} is {st!r} before its first progress line: "
                                 f"{read_text(stderr)[-800:]}")
            return progress_lines(stdout) >= 1
        wait_until(first_line, max(120.0, args.job_seconds / 20 * 4), f"job {jid}: first progress line", 0.2)
        counts = {}
        for nd in nodes:
            cg = nd.cgroup(jid)
            wait_until(lambda: len(cg_pids(cg)) >= 3, 30, f"job {jid}: processes in {cg}", 0.1)
            counts[nd.name] = (len(cg_pids(cg)), comm(tree_root(cg)))
        res["procs"] = sum(c for c, _ in counts.values())
        log(f"N={n}: job {jid} computing; processes (count, root) per node: {counts}")
        for i in range(k):
            r = raw_dump(nodes, jid, args.criu, base, i)
            for key in ("frozen", "dump", "node_frozen", "bytes"):
                res["raw_" + key].append(r[key])
            log(f"N={n} raw {i + 1}/{k}: frozen {r['frozen']:.1f} ms (per node max {r['node_frozen']:.1f}), "
                f"slowest dump {r['dump']:.1f} ms, {r['bytes'] / 2**20:.1f} MiB")
            time.sleep(args.gap)
            os.sync()
            p, wall = ckpt.ctl_json("checkpoint", jid, "--wait")
            e = json.loads(p.stdout.strip().splitlines()[-1])
            if e.get("state") not in (None, "committed"):
                raise BenchError(f"epoch not committed: {e}")
            record_checkpoint(res, e, wall)
            log(f"N={n} ckpt {i + 1}/{k}: epoch {e.get('epoch')}: frozen {e['frozen_ms']} ms, total "
                f"{e['total_ms']} ms, ckptctl {wall * 1000:.0f} ms, {int(e['image_bytes']) / 2**20:.1f} MiB")
            if i + 1 < k:
                time.sleep(args.gap)
        st = str(ckpt.status(jid).get("state", "?"))
        if finished(stdout) or not st.startswith("running"):
            raise BenchError(f"job {jid} is no longer computing after the measurements (state {st!r}, "
                             f"finished {finished(stdout)}); use a larger --job-seconds")
        after = {nd.name: len(cg_pids(nd.cgroup(jid))) for nd in nodes}
        if any(after[x] != counts[x][0] for x in after):
            res["notes"].append(f"process counts changed during the run: {counts} -> {after}")
    finally:
        ckpt.cancel(jid, nodes)
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- report

def render(results, k, header):
    out = [header, ""]
    out.append(f"Median (min) over K={k} per node count, times in ms, all on the same running job per "
               "row (raw and ckpt alternate). ckpt frozen = `frozen_ms` (max over nodes of first freeze .. "
               "last thaw); raw frozen = first FROZEN write .. last THAWED read back over all nodes "
               "(also raw's checkpoint time: raw CRIU has no sealing); raw per-node = max over nodes of "
               "that node's FROZEN write .. THAWED read (ckpt's definition); raw dump only = slowest "
               "node's `criu dump` wall time; ckpt total = `total_ms` of the epoch (incl. sealing: "
               "digest + fsync).")
    out.append("")
    out += table_head("nodes", "ranks", "image MiB ckpt (raw)", "ckpt frozen", "raw frozen", "raw frozen per-node",
                      "ratio ckpt/raw frozen", "raw dump only", "ckpt total", "raw total", "ratio ckpt/raw total",
                      "ckptctl wall")
    for n, r in results:
        fa, fb = med(r["frozen"]), med(r["raw_frozen"])
        ta = med(r["total"])
        img = "–" if not r["bytes"] else f"{med(r['bytes']) / 2**20:,.1f}"
        img += "" if not r["raw_bytes"] else f" ({med(r['raw_bytes']) / 2**20:,.1f})"
        out.append(f"| {n} | {2 * n} | {img} | {mm(r['frozen'])} | {mm(r['raw_frozen'], 1)} "
                   f"| {mm(r['raw_node_frozen'], 1)} | {ratio(fa, fb)} | {mm(r['raw_dump'], 1)} "
                   f"| {mm(r['total'])} | {mm(r['raw_frozen'], 1)} | {ratio(ta, fb)} | {mm(r['ctl_wall'])} |")
    out += notes_section((f"{n} node(s)", r) for n, r in results)
    return "\n".join(out) + "\n"


def machine_header(cmdline, criu, size, iters, sleep_us):
    criu_v, mpich_v, mem = machine_info(criu)
    ncpu = os.cpu_count()
    return (f"## ckpt vs raw parallel CRIU on 1..N nodes, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Machine: nproc {ncpu}, {mem} MiB RAM, kernel {os.uname().release}, CRIU {criu_v}, MPICH {mpich_v}. "
            f"Job: `mpiexec.mpich -hosts <node IPs> -n 2N heat {size} {iters} {sleep_us}` (2 ranks per node), "
            f"started with `ckptctl run --node n1`.\n\n"
            f"Note: all nodes are network/UTS namespaces on this one {ncpu}-core machine, sharing its "
            f"cores, memory and disk, so N nodes means N times the dump work (N parallel `criu dump`s) "
            f"on the same {ncpu} cores; the rows show ckpt's coordination overhead against raw CRIU on "
            f"identical trees, not how either scales on real separate nodes.\n\n"
            f"Command: `{cmdline}`")


def busy_processes():
    """Heavy processes not started by this run: builds, test binaries, CI scripts, other MPI jobs."""
    p, _ = run(["ps", "-eo", "pid=,comm=,args="], timeout=20)
    busy = []
    for line in p.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 2:
            continue
        pid, name, args = int(parts[0]), parts[1], (parts[2] if len(parts) > 2 else "")
        if pid == os.getpid():
            continue
        hit = (name in ("cargo", "rustc") or name.startswith(("single_node-", "multi_node-", "heat."))
               or ".ci/run" in args)
        if not hit:
            continue
        if CG_PREFIX in read_text(f"/proc/{pid}/cgroup"):
            continue  # one of this run's jobs
        busy.append(f"{pid} {name}")
    return busy


def write_json(path, results, k, cmdline, tls):
    """Every sample of the run, per node count (the lists `render` takes medians of)."""
    doc = {"command": cmdline, "tls": tls, "repeats": k,
           "nodes": {str(n): dict(r, ranks=2 * n) for n, r in results}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    log(f"wrote {path}")


def default_criu():
    path = read_text("/etc/ckpt/criu-path").strip()
    return path if path else "/opt/ckpt/criu/bin/criu"




def stop_on_signals():
    """TERM, INT and HUP end the run through the callers' `finally` (clean-up by PID), also
    when started in the background."""
    stop_signal = lambda *_: sys.exit(143)  # noqa: E731 - unwinds through the finally
    signal.signal(signal.SIGTERM, stop_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, stop_signal)


def stage_bins(tmp, bin_dir, app, extra=()):
    """Copies ckptd, ckptctl, ckpt-agent, ckpt-rsh (and the binaries `extra`) and the built test
    program `app` into tmp (a rebuild during the run does not matter); returns (bindir, path of
    the program)."""
    bindir = os.path.join(tmp, "bin")
    os.mkdir(bindir)
    for b in ("ckptd", "ckptctl", "ckpt-agent", "ckpt-rsh", *extra):
        src = os.path.join(bin_dir, b)
        if not os.path.exists(src):
            raise BenchError(f"missing {src} (build the release binaries first)")
        shutil.copy2(src, os.path.join(bindir, b))
    staged = os.path.join(tmp, os.path.basename(app))
    shutil.copy2(app, staged)
    return bindir, staged


def teardown(ckpt, sampler, tmp, cluster, keep, also=lambda: None):
    """Stops the daemons and the sampler, removes every job cgroup and the test hosts (`also`
    runs before the hosts go), and keeps or removes the temp dir; a second Ctrl-C does not
    interrupt it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sampler.stop.set()
    if ckpt is not None:
        ckpt.stop()
    sweep(tmp)
    also()
    cluster.destroy()
    keep_or_remove(tmp, keep)

def report_tail(table, tmp, cluster, sampler, took):
    """The table with the run's wall time, the WARN/ERROR lines of ckptd's and the agents' logs,
    and what else ran on the machine meanwhile."""
    table += f"\nWall time of the whole run: {took / 60:.1f} min.\n"
    errs = []
    for name in ["ckptd"] + [f"agent-{node.name}" for node in cluster.nodes]:
        text = ANSI.sub("", read_text(os.path.join(tmp, f"{name}.log")))
        errs += [f"{name}: {l.strip()}" for l in text.splitlines() if " ERROR " in l or " WARN " in l]
    if errs:
        table += f"\nckptd/agent logs had {len(errs)} WARN/ERROR lines, e.g.:\n\n" + \
                 "\n".join(f"    {l[:300]}" for l in errs[:8]) + "\n"
    return table + sampler.summary("\nNo cargo/rustc/test-binary/.ci/heat processes other than this run's "
                                   "were seen during it (sampled every 5 s).\n")

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", help="comma-separated node counts (default 1,2,3,4)")
    ap.add_argument("--size", type=int, default=1500, help="heat grid size N (default 1500)")
    ap.add_argument("--repeats", type=int, default=5, metavar="K")
    ap.add_argument("--quick", action="store_true", help="nodes 1,2 and K=2 (smoke test)")
    ap.add_argument("--out", help="also write the markdown table to this file")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    ap.add_argument("--app", default=os.path.join(REPO, "target", "apps", "heat.mpich"))
    ap.add_argument("--criu", default=default_criu())
    ap.add_argument("--sleep-us", type=int, default=20000)
    ap.add_argument("--job-seconds", type=float, default=None,
                    help="nominal run time of each job (sets ITERS; default 60 + 50 s per repeat)")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between measurements")
    ap.add_argument("--wait-idle", type=float, default=0,
                    help="first wait up to this many seconds (polling every 10 s) until no "
                         "cargo/rustc/single_node-/multi_node-/.ci/run/heat.* processes run")
    ap.add_argument("--no-tls", action="store_true",
                    help="the binaries predate authentication (e.g. commit a2ee541): no cluster CA, "
                         "no enrollment, configs without tls_dir/allow_root_jobs")
    ap.add_argument("--json", metavar="FILE", help="also write every sample (ms, bytes) as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args()

    require_root_and_freezer()
    node_counts = [1, 2] if args.quick else ([int(x) for x in args.nodes.split(",")] if args.nodes else [1, 2, 3, 4])
    if not node_counts or min(node_counts) < 1 or max(node_counts) > 200:
        sys.exit("--nodes: counts between 1 and 200")
    k = 2 if args.quick else args.repeats
    if args.job_seconds is None:
        args.job_seconds = 60.0 + 50.0 * k
    iters = 20 * max(1, round(args.job_seconds / 20 / (args.sleep_us / 1e6)))
    cmdline = shlex.join([sys.argv[0]] + sys.argv[1:])

    if args.wait_idle > 0:
        wait_idle(busy_processes, args.wait_idle, poll=10)

    tmp = tempfile.mkdtemp(prefix="ckpt-bench-mn-")
    log(f"work dir {tmp}; nodes {node_counts}, K={k}, heat {args.size} {iters} {args.sleep_us}")
    cluster = Cluster(max(node_counts))
    ckpt = None
    results = []
    stop_on_signals()
    t_start = mono()
    sampler = BusySampler(busy_processes)
    sampler.start()
    try:
        bindir, app = stage_bins(tmp, args.bin_dir, args.app)
        header = machine_header(cmdline, args.criu, args.size, iters, args.sleep_us)

        cluster.create()
        ckpt = Ckpt(tmp, bindir, args.criu, cluster, tls=not args.no_tls)
        ckpt.start()
        for n in node_counts:
            r = {"frozen": [], "total": [], "ctl_wall": [], "bytes": [], "raw_frozen": [], "raw_dump": [],
                 "raw_node_frozen": [], "raw_bytes": [], "notes": []}
            log(f"=== {n} node(s), {2 * n} ranks")
            t_n = mono()
            try:
                bench_nodes(ckpt, cluster, n, args, iters, app, k, r)
            except BenchError as e:
                r["error"] = str(e)
                log(f"{n} node(s) FAILED: {e}")
            results.append((n, r))
            log(f"{n} node(s) done in {mono() - t_n:.0f} s ({mono() - t_start:.0f} s so far)")
        took = mono() - t_start
        sampler.stop.set()
        sampler.join(timeout=30)
        table = report_tail(render(results, k, header), tmp, cluster, sampler, took)
        emit(table, args.out)
        if args.json:
            write_json(args.json, results, k, cmdline, not args.no_tls)
        return 1 if any(r.get("error") for _, r in results) else 0
    except BenchError as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        teardown(ckpt, sampler, tmp, cluster, args.keep)


if __name__ == "__main__":
    sys.exit(main())
