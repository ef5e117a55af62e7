#!/usr/bin/env python3
"""End-to-end ckpt vs raw CRIU on the same 4-rank MPICH job.

What it measures
----------------
For each grid size N (the `heat N ITERS SLEEP_US` test program from tests/apps, 4 ranks under
`mpiexec.mpich`; N x N doubles in two buffers, so the job's resident memory is about
16*N^2 bytes plus ~35 MB of MPI runtime) it runs, one right after the other so that both see the
same machine state:

A. ckpt: a private `ckptd --standalone` (own socket, database, state/local dirs and a cgroup
   prefix unique to this run); `ckptctl run` starts the job; after it printed two progress lines,
   K times `ckptctl checkpoint --wait --json` (records `frozen_ms`, `total_ms`, `image_bytes`,
   `elapsed_ms` and the ckptctl wall time); then K times: SIGKILL every process of the job's
   freezer cgroup, wait until `ckptctl status` says "killed", time `ckptctl restart --json`
   (wall and `elapsed_ms`) and wait for the restored job to print a new progress line.

B. raw CRIU: the same job started the way ckpt starts it (setsid, private IPC namespace, a fresh
   freezer cgroup, stdin /dev/null, stdout/stderr to files, inherited descriptors closed); K times:
   FROZEN -> `criu dump --leave-running --freeze-cgroup ...` -> THAWED. The raw frozen time is from
   just before writing FROZEN until THAWED is read back, which is how ckpt defines its frozen time
   (freeze to end of thaw). Then K times: SIGKILL the tree, wait until the cgroup is empty and the
   PIDs are gone, truncate stdout/stderr back to their size at dump time, clear TIME_WAIT sockets
   on the job's ports (`ss -K`), and time `criu restore -d` run by a child-subreaper helper
   (which then reaps the restored tree); wait for a new progress line.

It prints markdown tables with median (min) over K of: frozen time ckpt vs raw (ratio,
difference, and the target ckpt <= 1.10 x raw + 20 ms), checkpoint total time, image bytes, and
restart time (ckptctl restart wall vs criu restore wall).

How to run (root, Debian 12, cgroup v1 freezer, CRIU >= 4.2, MPICH; binaries already built):

    benches/e2e_vs_criu.py --quick                       # smoke test: N=1000, K=2
    benches/e2e_vs_criu.py                               # N=1000,2650,5400 (~50/150/500 MB), K=3
    benches/e2e_vs_criu.py --repeats 5 --wait-idle 1200 \\
        --out benches/results/e2e_vs_criu-$(date +%F).md

Options: --sizes N1,N2,..  --repeats K  --quick  --out FILE  --bin-dir DIR (ckptd/ckptctl,
default target/release; copied to a temp dir first so a rebuild during the run does not matter)
--criu PATH  --sleep-us US  --interval S (seconds between the job's progress lines, sets ITERS)
--wait-idle S (first wait, bounded, until no cargo/rustc/heat.* processes run)  --keep (keep the
temp dir with logs and images)  --gate-min-mb MB (ckpt's `[criu] restore_gate_min_mb`: page data
from this size on is verified while CRIU restores). Standard library only. Every wait is bounded; every process the
benchmark starts is killed by PID and every cgroup it creates removed, also on errors.
"""

import argparse
import ctypes
import datetime
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# the shared helpers live next to this script (benches/benchutil.py)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import (  # noqa: E402
    foreign_busy, job_pss_bytes,
    FREEZER, REPO, BenchError, BusySampler, Ckptctl, cg_pids, comm, dir_bytes, emit, finished, fmt,
    keep_or_remove, kill_cgroup, log, machine_info, med, mm, mono, notes_section, pid_exists,
    progress_lines, ratio, read_text,
    require_root_and_freezer, record_checkpoint, remove_cgroup, run, set_freezer, stage,
    stop_proc, table_section, wait_first_lines, wait_idle, wait_until)
DEFAULT_SIZES = [1000, 2650, 5400]  # ~50, ~150, ~500 MB resident for 4 ranks
CRIU_COMMON = ["--ext-unix-sk", "--file-locks", "--tcp-established", "--network-lock", "nftables"]
PR_SET_CHILD_SUBREAPER = 36
OUR_PIDS = set()  # PIDs of this run's jobs (a restore brings back the same PIDs)


# ---------------------------------------------------------------- processes and cgroups

def pid_alive(pid):
    """True while /proc/<pid> exists and is not a zombie."""
    st = read_text(f"/proc/{pid}/stat")
    if not st:
        return False
    return st.rsplit(")", 1)[1].split()[0] != "Z"


def tcp_ports(pids):
    """Local TCP ports of the sockets the given processes hold."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in read_text(table).splitlines()[1:]:
            parts = line.split()
            if len(parts) > 9 and parts[9] in inodes:
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return sorted(p for p in ports if p)


def clear_time_wait(ports):
    """Destroys TIME_WAIT TCP sockets whose source or destination port is one of `ports`."""
    if not ports:
        return 0
    cleared = 0
    for i in range(0, len(ports), 40):
        chunk = ports[i:i + 40]
        flt = " or ".join(f"sport = :{p} or dport = :{p}" for p in chunk)
        p, _ = run(["ss", "-K", "-tan", "state", "time-wait", f"( {flt} )"], timeout=20, check=False)
        cleared += max(0, len(p.stdout.strip().splitlines()) - 1)
    return cleared


def wait_new_progress(path, timeout, what):
    """Waits until the file gets longer than it is now (a new progress line) or the job ends."""
    size0 = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        wait_until(lambda: (os.path.exists(path) and os.path.getsize(path) > size0), timeout,
                   f"{what}: a new progress line in {path}", interval=0.1)
        return True
    except BenchError as e:
        log(f"warning: {e}")
        return False



def dump_frozen(cg, dump, while_frozen=lambda: None):
    """Freezes cgroup `cg` (until the kernel reports it), runs the `criu dump` command `dump` (15
    minutes at most), calls `while_frozen()` once the dump is done, and thaws, also on errors.
    Returns the dump's process, the times before the freeze, frozen, dumped and thawed, and what
    `while_frozen` returned."""
    t0 = mono()
    set_freezer(cg, "FROZEN")
    t1 = mono()
    try:
        p = subprocess.run(dump, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=900)
        t2 = mono()
        got = while_frozen()
    finally:
        set_freezer(cg, "THAWED")
    t3 = mono()
    return p, (t0, t1, t2, t3), got


# ---------------------------------------------------------------- the restore helper

def restore_helper(argv):
    """Hidden mode: become a child subreaper, run `criu restore -d` with the criu process joined
    to the job's cgroup (as ckpt's shim does), write {"rc", "wall_ms"} to a result file, then reap
    the restored tree until it is gone."""
    criu, images, logname, cg, result = argv
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    procs = os.path.join(cg, "cgroup.procs")

    def join():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    cmd = [criu, "restore", "-d", "-D", images, "-o", logname] + CRIU_COMMON
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, preexec_fn=join, close_fds=True)
    wall = time.monotonic() - t0
    tmp = result + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rc": p.returncode, "wall_ms": wall * 1000.0,
                   "stderr": p.stderr.decode(errors="replace")[-2000:]}, f)
    os.rename(tmp, result)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue


# ---------------------------------------------------------------- A: ckpt

class Ckpt(Ckptctl):
    def __init__(self, tmp, bindir, cleanup, criu=None, gate_min_mb=None):
        super().__init__(bindir, os.path.join(tmp, "ckptd.sock"), tmp)
        self.criu = criu
        self.gate_min_mb = gate_min_mb
        self.tmp = tmp
        self.prefix = f"ckpt-bench-{os.getpid()}-"
        self.state_dir = os.path.join(tmp, "state")
        self.cleanup = cleanup
        self.proc = None

    def start(self):
        cfg = os.path.join(self.tmp, "ckptd.toml")
        # No cluster credential: an empty tls_dir of our own (never a host-wide /etc/ckpt/tls),
        # so this standalone ckptd opens no TCP port and its embedded agent is on a Unix socket.
        tls_dir = os.path.join(self.tmp, "tls")
        os.makedirs(tls_dir, mode=0o700, exist_ok=True)
        with open(cfg, "w") as f:
            f.write(f'listen = "127.0.0.1:0"\n'
                    f'socket = "{self.sock}"\n'
                    f'database = "{self.tmp}/ckptd.redb"\n'
                    f'tls_dir = "{tls_dir}"\n'
                    f'[agent]\n'
                    # older ckptd builds bind the embedded agent to [agent] listen (default
                    # 0.0.0.0:7601) instead of a free loopback port
                    f'listen = "127.0.0.1:0"\n'
                    # the benchmark runs as root, so its jobs do
                    f'allow_root_jobs = true\n'
                    f'state_dir = "{self.state_dir}"\n'
                    f'local_dir = "{self.tmp}/local"\n'
                    f'[agent.cgroup]\n'
                    f'prefix = "{self.prefix}"\n')
            if self.gate_min_mb is not None:
                f.write(f'[agent.criu]\nrestore_gate_min_mb = {self.gate_min_mb}\n')
        logf = open(os.path.join(self.tmp, "ckptd.log"), "ab")
        self.proc = subprocess.Popen([os.path.join(self.bindir, "ckptd"), "--standalone", "--config", cfg],
                                     stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                     close_fds=True, start_new_session=True, cwd=self.tmp)
        logf.close()
        self.cleanup.ckptd = self.proc

        def ready():
            if self.proc.poll() is not None:
                raise BenchError(f"ckptd exited with {self.proc.returncode}: "
                                 f"{read_text(os.path.join(self.tmp, 'ckptd.log'))[-1500:]}")
            if not os.path.exists(self.sock):
                return False
            p, _ = self.ctl("list", timeout=10, check=False)
            return p.returncode == 0
        wait_until(ready, 60, "ckptd to answer on its socket", 0.2)
        log(f"ckptd pid {self.proc.pid} ready")

    def stop(self):
        stop_proc(self.proc, "ckptd")

    def bench(self, n, iters, sleep_us, app, k, res):
        cmd = ["mpiexec.mpich", "-n", "4", app, str(n), str(iters), str(sleep_us)]
        p, _ = self.ctl("run", "--", *cmd, timeout=60)
        jid = p.stdout.strip().split()[-1]
        self.cleanup.ckpt_jobs.append(jid)
        cg = os.path.join(FREEZER, f"{self.prefix}{jid}")
        stdout = os.path.join(self.state_dir, "jobs", jid, "stdout")
        log(f"A ckpt: job {jid} started: {shlex.join(cmd)}")
        try:
            interval = wait_first_lines(stdout, 2, self.line_timeout, f"ckpt job {jid}")
            res["interval_s"] = interval
            pids = cg_pids(cg)
            OUR_PIDS.update(pids)
            res["pss"] = job_pss_bytes(pids)
            log(f"A ckpt: job {jid}: {len(pids)} processes, PSS {res['pss'] / 2**20:.1f} MiB, "
                f"progress every {interval:.1f} s")
            for i in range(k):
                if self.criu:
                    # Raw CRIU on this very process tree, right before ckpt's checkpoint: the
                    # fairest comparison (same processes, same memory, same machine state).
                    os.sync()
                    raw_dir = os.path.join(self.tmp, f"same-tree-raw-{i}")
                    os.mkdir(raw_dir)
                    dump = [self.criu, "dump", "-t", str(min(cg_pids(cg))), "-D", raw_dir, "-o", "dump.log",
                            "-v4", "--leave-running", "--freeze-cgroup", cg, "--link-remap",
                            "--ghost-limit", "256M"] + CRIU_COMMON
                    rp, (t0, t1, t2, t3), _ = dump_frozen(cg, dump)
                    if rp.returncode != 0:
                        raise BenchError(f"same-tree criu dump exit {rp.returncode}: {rp.stderr.decode()[-500:]}")
                    res["same_raw_frozen"].append((t3 - t0) * 1000.0)
                    res["same_raw_dump"].append((t2 - t1) * 1000.0)
                    shutil.rmtree(raw_dir, ignore_errors=True)
                    log(f"A ckpt: same-tree raw dump {i + 1}: frozen {(t3 - t0) * 1000:.1f} ms")
                    time.sleep(1.0)
                os.sync()
                p, wall = self.ctl_json("checkpoint", jid, "--wait")
                e = json.loads(p.stdout)
                record_checkpoint(res, e, wall)
                res["elapsed"].append(float(e["elapsed_ms"]))
                log(f"A ckpt: epoch {e['epoch']}: frozen {e['frozen_ms']} ms, total {e['total_ms']} ms, "
                    f"ckptctl {wall * 1000:.0f} ms, {int(e['image_bytes']) / 2**20:.1f} MiB")
                time.sleep(1.0)
            if finished(stdout):
                raise BenchError(f"ckpt job {jid} finished during the checkpoints; use a larger --interval")
            for i in range(k):
                kill_cgroup(cg, timeout=30)
                st = wait_until(lambda: (lambda s: s if str(s.get("state", "")).startswith(("killed", "exited")) else None)(self.status(jid)),
                                30, f"ckpt job {jid} to be reported killed", 0.1)
                if not st["state"].startswith("killed"):
                    res["notes"].append(f"after SIGKILL the job's state was {st['state']!r}")
                p, wall = self.ctl_json("restart", jid)
                e = json.loads(p.stdout)
                res["restart_wall"].append(wall * 1000.0)
                res["restart_elapsed"].append(float(e.get("elapsed_ms", 0)))
                log(f"A ckpt: restart {i + 1} from epoch {e.get('epoch')}: ckptctl {wall * 1000:.0f} ms, "
                    f"elapsed_ms {e.get('elapsed_ms')}")
                if not wait_new_progress(stdout, max(20.0, 3 * interval), f"restored ckpt job {jid}"):
                    res["notes"].append(f"ckpt restart {i + 1}: no new progress line after restore")
        finally:
            p, _ = self.ctl("cancel", jid, timeout=60, check=False)
            try:
                wait_until(lambda: not str(self.status(jid).get("state", "running")).startswith("running"),
                           30, f"ckpt job {jid} to stop after cancel", 0.2)
            except BenchError as e:
                log(f"warning: {e}")
            kill_cgroup(cg, timeout=30)


# ---------------------------------------------------------------- B: raw CRIU

class Raw:
    def __init__(self, tmp, criu, cleanup):
        self.tmp = tmp
        self.criu = criu
        self.cleanup = cleanup
        self.cg = os.path.join(FREEZER, f"ckpt-bench-raw-{os.getpid()}")

    def bench(self, n, iters, sleep_us, app, k, res):
        base = os.path.join(self.tmp, "raw", str(n))
        os.makedirs(base)
        stdout = os.path.join(base, "stdout")
        stderr = os.path.join(base, "stderr")
        os.mkdir(self.cg)
        self.cleanup.cgroups.append(self.cg)
        cmd = ["mpiexec.mpich", "-n", "4", app, str(n), str(iters), str(sleep_us)]
        fo = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        fe = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # setsid and unshare exec in place (the child is no process-group leader), so the PID of
        # this Popen is the PID of mpiexec, the root of the tree.
        root = subprocess.Popen(["setsid", "unshare", "--ipc", "sh", "-c",
                                 'echo $$ > "$1" && shift && exec "$@"', "sh",
                                 os.path.join(self.cg, "cgroup.procs"), *cmd],
                                stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, close_fds=True,
                                cwd=self.tmp, env=os.environ.copy())
        os.close(fo)
        os.close(fe)
        self.cleanup.popens.append(root)
        log(f"B raw: job pid {root.pid} started: {shlex.join(cmd)}")
        helper = None
        pids = []
        try:
            def started():
                if root.poll() is not None:
                    raise BenchError(f"raw job exited with {root.returncode}: {read_text(stderr)[-800:]}")
                return progress_lines(stdout) >= 1
            wait_until(started, self.line_timeout, "raw job: first progress line", 0.1)
            interval = wait_first_lines(stdout, 2, self.line_timeout, "raw job")
            res["interval_s"] = interval
            if not comm(root.pid).startswith("mpiexec"):
                raise BenchError(f"raw job root pid {root.pid} is {comm(root.pid)!r}, not mpiexec")
            pids = cg_pids(self.cg)
            OUR_PIDS.update(pids)
            res["pss"] = job_pss_bytes(pids)
            ports = tcp_ports(pids)
            log(f"B raw: {len(pids)} processes, PSS {res['pss'] / 2**20:.1f} MiB, TCP ports {ports}, "
                f"progress every {interval:.1f} s")
            images = sizes = None
            for i in range(k):
                images = os.path.join(base, f"dump-{i + 1}")
                os.mkdir(images)
                dump = [self.criu, "dump", "-t", str(root.pid), "-D", images, "-o", "dump.log", "-v4",
                        "--leave-running", "--freeze-cgroup", self.cg, "--link-remap",
                        "--ghost-limit", "256M"] + CRIU_COMMON
                os.sync()
                p, (t0, t1, t2, t3), sizes = dump_frozen(
                    self.cg, dump, lambda: {f: os.path.getsize(f) for f in (stdout, stderr)})
                if p.returncode != 0:
                    errs = [l for l in read_text(os.path.join(images, "dump.log")).splitlines() if "Error" in l]
                    raise BenchError(f"criu dump exit {p.returncode}: {' | '.join(errs[-4:]) or p.stderr.decode()[-500:]}")
                res["frozen"].append((t3 - t0) * 1000.0)
                res["dump"].append((t2 - t1) * 1000.0)
                res["bytes"].append(dir_bytes(images, skip=(".log", ".json")))
                log(f"B raw: dump {i + 1}: frozen {(t3 - t0) * 1000:.1f} ms (freeze {(t1 - t0) * 1000:.1f}, "
                    f"criu dump {(t2 - t1) * 1000:.1f}, thaw {(t3 - t2) * 1000:.1f}), "
                    f"{res['bytes'][-1] / 2**20:.1f} MiB")
                time.sleep(1.0)
            if finished(stdout):
                raise BenchError("raw job finished during the dumps; use a larger --interval")
            for i in range(k):
                kill_cgroup(self.cg, timeout=30, also=pids, reap=root.poll)
                if root.poll() is None:
                    try:
                        root.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        raise BenchError(f"raw root {root.pid} not reaped")
                if helper is not None:
                    try:
                        helper.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        raise BenchError(f"restore helper {helper.pid} did not exit after its tree died")
                wait_until(lambda: not any(pid_exists(p) for p in pids), 30, "old PIDs to vanish", 0.05)
                for f, sz in sizes.items():
                    os.truncate(f, sz)
                cleared = clear_time_wait(ports)
                helper, r = self.restore(images, i)
                if r["rc"] != 0 and "bind" in read_text(os.path.join(images, f"restore-{i + 1}.log")).lower():
                    res["notes"].append(f"raw restore {i + 1}: bind failed; retried after ss -K")
                    helper.wait(timeout=15)
                    clear_time_wait(ports)
                    helper, r = self.restore(images, i, retry=True)
                if r["rc"] != 0:
                    errs = [l for l in read_text(os.path.join(images, f"restore-{i + 1}.log")).splitlines() if "Error" in l]
                    raise BenchError(f"criu restore exit {r['rc']}: {' | '.join(errs[-4:]) or r['stderr'][-500:]}")
                res["restore"].append(r["wall_ms"])
                log(f"B raw: restore {i + 1}: criu restore {r['wall_ms']:.1f} ms "
                    f"({cleared} TIME_WAIT sockets cleared)")
                restored = cg_pids(self.cg)
                if sorted(restored) != sorted(pids):
                    res["notes"].append(f"raw restore {i + 1}: cgroup holds {restored}, dumped {pids}")
                if not wait_new_progress(stdout, max(20.0, 3 * interval), "restored raw job"):
                    res["notes"].append(f"raw restore {i + 1}: no new progress line after restore")
        finally:
            try:
                kill_cgroup(self.cg, timeout=30, also=pids, reap=root.poll)
            except BenchError as e:
                log(f"warning: {e}")
            stop_proc(root, "raw job root", term_timeout=5)
            if helper is not None:
                try:
                    helper.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    stop_proc(helper, "restore helper", term_timeout=5)
            remove_cgroup(self.cg)
            if self.cg in self.cleanup.cgroups:
                self.cleanup.cgroups.remove(self.cg)

    def restore(self, images, i, retry=False):
        result = os.path.join(images, f"restore-{i + 1}{'-retry' if retry else ''}.json")
        logname = f"restore-{i + 1}.log"
        helper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_restore-helper",
                                   self.criu, images, logname, self.cg, result],
                                  stdin=subprocess.DEVNULL, close_fds=True, cwd=self.tmp)
        self.cleanup.popens.append(helper)

        def done():
            if os.path.exists(result):
                return True
            if helper.poll() is not None:
                raise BenchError(f"restore helper exited with {helper.returncode} before reporting")
            return False
        wait_until(done, 900, "criu restore", 0.02)
        with open(result) as f:
            return helper, json.load(f)


# ---------------------------------------------------------------- cleanup, report, main

class Cleanup:
    def __init__(self):
        self.ckptd = None
        self.popens = []
        self.cgroups = []
        self.ckpt_jobs = []

    def run(self, ckpt, tmp):
        if ckpt is not None and self.ckptd is not None and self.ckptd.poll() is None:
            for jid in self.ckpt_jobs:
                ckpt.ctl("cancel", jid, timeout=30, check=False)
        prefix = f"ckpt-bench-{os.getpid()}-"
        for name in sorted(os.listdir(FREEZER)):
            if name.startswith(prefix):
                remove_cgroup(os.path.join(FREEZER, name))
        for cg in list(self.cgroups):
            remove_cgroup(cg)
        for p in self.popens:
            stop_proc(p, f"pid {p.pid}", term_timeout=5)
        if self.ckptd is not None:
            stop_proc(self.ckptd, "ckptd")
        # Shims of this run's ckptd (`ckptd shim <tmp>/state/...`) end with their job; stop any
        # that is left, by PID, recognised by this run's private state directory.
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != os.getpid():
                cmd = read_text(f"/proc/{d}/cmdline").replace("\0", " ")
                if " shim " in cmd and tmp in cmd:
                    try:
                        os.kill(int(d), signal.SIGKILL)
                        log(f"killed leftover shim {d}")
                    except OSError:
                        pass


def mib(xs):
    return "–" if not xs else f"{med(xs) / 2**20:,.1f}"


def pss_mib(a, b):
    """The job's PSS in MiB: ckpt's measurement `a`, else raw's `b`."""
    pss = a.get("pss") or b.get("pss")
    return fmt(pss / 2**20 if pss else None, 0)


def against_target(fa, fb, min_diff=""):
    """The columns comparing ckpt's frozen time `fa` with raw's `fb` (medians, ms): the
    difference (followed by `min_diff`), the target ckpt <= 1.10 x raw + 20 ms, and whether ckpt
    meets it."""
    target = None if fb is None else 1.10 * fb + 20
    meets = "–" if fa is None or target is None else ("yes" if fa <= target else "NO")
    diff = "–" if fa is None or fb is None else f"{fa - fb:+,.0f}{min_diff}"
    return f"{diff} | {fmt(target, 0)} | {meets}"


def render(results, k, header):
    out = [header, ""]
    out.append(f"Median (min) over K={k} per size, times in ms. Frozen time = freeze until thaw completed "
               f"(ckpt: `frozen_ms` of the epoch; raw: FROZEN written .. THAWED read back).")
    out += table_section(
        "Frozen time on the same process tree (target: ckpt ≤ 1.10 × raw + 20 ms, on medians)",
        ("N", "job PSS MiB", "ckpt frozen", "raw frozen (same tree)", "raw criu dump alone", "ratio ckpt/raw",
         "diff ckpt−raw", "target ms", "meets target"),
        intro=("Raw freeze + `criu dump` + thaw and `ckptctl checkpoint` alternate on one ckpt-launched job, "
               "so both see the same processes, memory and machine state.",))
    for n, a, b in results:
        fa, fs = med(a["frozen"]), med(a.get("same_raw_frozen", []))
        out.append(f"| {n} | {pss_mib(a, b)} | {mm(a['frozen'])} | {mm(a.get('same_raw_frozen', []), 1)} "
                   f"| {mm(a.get('same_raw_dump', []), 1)} | {ratio(fa, fs)} | {against_target(fa, fs)} |")
    out += table_section(
        "Frozen time, separate jobs (ckpt's job, then a raw-launched job)",
        ("N", "job PSS MiB", "ckpt frozen", "raw frozen", "ratio ckpt/raw", "diff ckpt−raw", "target ms",
         "meets target"))
    for n, a, b in results:
        fa, fb = med(a["frozen"]), med(b["frozen"])
        mina, minb = (min(a["frozen"]) if a["frozen"] else None), (min(b["frozen"]) if b["frozen"] else None)
        min_diff = "" if mina is None or minb is None else f" ({mina - minb:+,.0f})"
        out.append(f"| {n} | {pss_mib(a, b)} | {mm(a['frozen'])} | {mm(b['frozen'], 1)} "
                   f"| {ratio(fa, fb)} ({ratio(mina, minb)}) | {against_target(fa, fb, min_diff)} |")
    out += table_section(
        "Checkpoint total time and image size",
        ("N", "ckptctl checkpoint wall", "ckpt total_ms", "raw freeze+dump+thaw", "raw criu dump alone",
         "ratio ckptctl wall/raw", "ckpt image MiB", "raw image MiB"))
    for n, a, b in results:
        out.append(f"| {n} | {mm(a['ctl_wall'])} | {mm(a['total'])} | {mm(b['frozen'], 1)} | {mm(b['dump'], 1)} "
                   f"| {ratio(med(a['ctl_wall']), med(b['frozen']))} | {mib(a['bytes'])} | {mib(b['bytes'])} |")
    out += table_section(
        "Restart",
        ("N", "ckptctl restart wall", "ckpt restart elapsed_ms", "raw criu restore wall", "ratio ckptctl wall/raw",
         "diff"))
    for n, a, b in results:
        ra, rb = med(a["restart_wall"]), med(b["restore"])
        diff = "–" if ra is None or rb is None else f"{ra - rb:+,.0f}"
        out.append(f"| {n} | {mm(a['restart_wall'])} | {mm(a['restart_elapsed'])} | {mm(b['restore'], 1)} "
                   f"| {ratio(ra, rb)} | {diff} |")
    out += notes_section((f"N={n} {side}", r) for n, a, b in results for side, r in (("ckpt", a), ("raw", b)))
    return "\n".join(out) + "\n"


def machine_header(args_cmd, criu, sizes, iters_of, sleep_us):
    criu_v, mpich_v, mem = machine_info(criu)
    jobs = ", ".join(f"N={n}: heat {n} {iters_of(n)} {sleep_us}" for n in sizes)
    return (f"## ckpt vs raw CRIU, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Machine: nproc {os.cpu_count()}, {mem} MiB RAM, kernel {os.uname().release}, CRIU {criu_v}, "
            f"MPICH {mpich_v}; job: mpiexec.mpich -n 4 ({jobs})\n\n"
            f"Command: `{args_cmd}`")


def busy_processes(tmp=None):
    """Heavy processes not started by this run: builds and other MPI tests."""
    return foreign_busy(OUR_PIDS, tmp, (f"ckpt-bench-{os.getpid()}-", f"ckpt-bench-raw-{os.getpid()}"))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--_restore-helper":
        return restore_helper(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", help="comma-separated N values (default 1000,2650,5400)")
    ap.add_argument("--repeats", type=int, default=3, metavar="K")
    ap.add_argument("--quick", action="store_true", help="one small size, K=2 (smoke test)")
    ap.add_argument("--out", help="also write the markdown tables to this file")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    ap.add_argument("--criu", default="/opt/ckpt/criu/bin/criu")
    ap.add_argument("--sleep-us", type=int, default=20000)
    ap.add_argument("--interval", type=float, default=4.0,
                    help="minimum seconds between progress lines (ITERS = 20 * interval / sleep)")
    ap.add_argument("--wait-idle", type=float, default=0,
                    help="first wait up to this many seconds until no cargo/rustc/heat.* runs")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, images)")
    ap.add_argument("--gate-min-mb", type=int, metavar="MB",
                    help="ckpt's [criu] restore_gate_min_mb (default: the agent's)")
    args = ap.parse_args()

    require_root_and_freezer()
    sizes = [1000] if args.quick else ([int(x) for x in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES)
    k = 2 if args.quick else args.repeats
    per_report = math.ceil(args.interval / (args.sleep_us / 1e6))
    iters = 20 * per_report
    cmdline = shlex.join([sys.argv[0]] + sys.argv[1:])

    if args.wait_idle > 0:
        wait_idle(busy_processes, args.wait_idle, poll=30)

    tmp = tempfile.mkdtemp(prefix="ckpt-bench-")
    log(f"work dir {tmp}; sizes {sizes}, K={k}, heat N {iters} {args.sleep_us}")
    cleanup = Cleanup()
    ckpt = None
    results = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = mono()
    sampler = BusySampler(lambda: busy_processes(tmp))
    sampler.start()
    try:
        bindir, app = stage(tmp, args.bin_dir, "heat.mpich", skip_missing=True)
        header = machine_header(cmdline, args.criu, sizes, lambda n: iters, args.sleep_us)

        ckpt = Ckpt(tmp, bindir, cleanup, args.criu, args.gate_min_mb)
        ckpt.start()
        raw = Raw(tmp, args.criu, cleanup)
        line_timeout = max(120.0, 12 * args.interval)
        ckpt.line_timeout = raw.line_timeout = line_timeout
        for n in sizes:
            a = {"frozen": [], "total": [], "elapsed": [], "ctl_wall": [], "bytes": [],
                 "restart_wall": [], "restart_elapsed": [], "notes": [],
                 "same_raw_frozen": [], "same_raw_dump": []}
            b = {"frozen": [], "dump": [], "bytes": [], "restore": [], "notes": []}
            for side, obj, r in (("A ckpt", ckpt, a), ("B raw", raw, b)):
                log(f"=== N={n}: {side}")
                try:
                    obj.bench(n, iters, args.sleep_us, app, k, r)
                except BenchError as e:
                    r["error"] = str(e)
                    log(f"{side} N={n} FAILED: {e}")
            results.append((n, a, b))
            log(f"N={n} done after {mono() - t_start:.0f} s")
        took = mono() - t_start
        sampler.stop.set()
        sampler.join(timeout=30)
        table = render(results, k, header) + f"\nWall time of the whole run: {took / 60:.1f} min.\n"
        table += sampler.summary("\nNo cargo/rustc/heat.* processes other than this run's were seen during it "
                                 "(sampled every 5 s).\n")
        emit(table, args.out)
        failed = any(r.get("error") for _, a, b in results for r in (a, b))
        return 1 if failed else 0
    finally:
        sampler.stop.set()
        cleanup.run(ckpt, tmp)
        keep_or_remove(tmp, args.keep)


if __name__ == "__main__":
    sys.exit(main())
