#!/usr/bin/env python3
"""ckpt+CRIU vs ckpt+DMTCP vs raw DMTCP on the same 4-rank MPICH job.

What it measures
----------------
For each grid size N (the `heat N ITERS SLEEP_US` test program, `target/apps/heat.mpich`, 4 ranks
under `mpiexec.mpich`; N x N doubles in two buffers, so the job's resident memory is about
16*N^2 bytes plus ~35 MB of MPI runtime) it runs three sides one right after the other, so that
all see the same machine state. Every side's job gets the environment ckpt gives DMTCP jobs,
`UCX_TLS=^sysv,cma UCX_MEM_EVENTS=no HWLOC_COMPONENTS=-linuxio`, the CRIU side's too, so that the
job is the same everywhere (without SysV and CMA transports UCX moves the ranks' messages through
its other shared-memory transports; this also applies to the CRIU numbers here).

A. ckpt+CRIU: a private `ckptd --standalone` (benchutil.Daemon: own socket, database, state and
   local dirs, a cgroup prefix unique to this run, no flush, no TCP port); `ckptctl run` starts
   the job; after three progress lines, K times: wait for a new progress line, then
   `ckptctl --json checkpoint --wait` (records `frozen_ms`, `total_ms`, `image_bytes` and the
   ckptctl wall time); then K times: SIGKILL every process of the job's freezer cgroup, wait until
   `ckptctl status` says "killed", time `ckptctl restart --json` until the restored job prints a
   new progress line.

B. ckpt+DMTCP: the same with `ckptctl run --engine dmtcp` (the agent finds DMTCP itself). Right
   after the launch DMTCP refuses a checkpoint for a while ("not every process of the job runs
   under DMTCP yet"): the first checkpoint is retried every 0.5 s for up to 120 s. The frozen time
   is the epoch's `frozen_ms`, i.e. the time DMTCP took (ckpt does not freeze a DMTCP job; DMTCP
   suspends it from the checkpoint request until its restart script is written).

C. raw DMTCP: `dmtcp_launch --new-coordinator --coord-port 0 --port-file F --no-gzip --ckptdir D
   --tmpdir T --quiet <job>` (ckpt's own DMTCP command line, plus a temp dir of this run), started
   in a freezer cgroup of its own (only to find and kill every process, the coordinator included,
   by PID from cgroup.procs; never frozen) in a new session, stdin /dev/null, stdout/stderr to
   files. After three progress lines and `dmtcp_command -s` saying `RUNNING=yes`, K times: wait for
   a new progress line, delete the previous images and restart scripts in D, send
   `dmtcp_command -c` and wait until `dmtcp_restart_script*.sh` appears in D (DMTCP 4.2's
   `dmtcp_command -bc` returns before the checkpoint ends). The processes are suspended all that
   time, so it is both raw DMTCP's frozen time and its checkpoint-to-commit time. Then K times:
   SIGKILL every process of the cgroup (job and coordinator), wait until they are gone, and time
   `dmtcp_restart --new-coordinator --coord-port 0 --port-file F2 D/ckpt_*.dmtcp` (in the same
   cgroup) until a new progress line appears; `dmtcp_command -s` is polled meanwhile for the time
   until `RUNNING=yes`.

Each side's last checkpoint is requested right after a progress line, so a restored job needs
about one progress interval of computing before its next line; the report also shows restart
times less that remaining compute (the job's progress interval, measured over its first three
lines, minus the time from the line to the checkpoint request): an estimate of the restart cost.

It prints markdown tables with median (min) over K of: frozen time (ckpt+CRIU, ckpt+DMTCP, raw
DMTCP; the ratios raw DMTCP / ckpt+CRIU, target >= 3, and ckpt+DMTCP / raw DMTCP), checkpoint to
commit time, image sizes, and restart times with their ratios.

How to run (root, Debian 12, cgroup v1 freezer, CRIU, DMTCP 4.2 in /opt/dmtcp, MPICH; the
binaries and target/apps/heat.mpich already built):

    benches/dmtcp_vs_criu.py --quick                     # smoke test: N=1000, K=2
    benches/dmtcp_vs_criu.py                             # N=1000,2650,5400 (~50/150/500 MB), K=3
    benches/dmtcp_vs_criu.py --repeats 5 --wait-idle 1200 \\
        --out benches/results/dmtcp_vs_criu-$(date +%F).md

Options: --sizes N1,N2,..  --repeats K  --quick  --out FILE  --bin-dir DIR (ckptd/ckptctl,
default target/release; copied to a temp dir first, with the test program, so a rebuild during
the run does not matter)  --app PATH (default target/apps/heat.mpich)  --dmtcp-bin DIR (raw
DMTCP's tools, default /opt/dmtcp/bin; ckpt's agent finds its DMTCP itself)  --criu PATH (only
for the version in the header)  --sleep-us US  --interval S (seconds between the job's progress
lines, sets ITERS)  --wait-idle S (first wait, bounded, until no cargo/rustc/heat.* processes
run)  --keep (keep the temp dir with logs and images). Standard library only. Every wait is
bounded; every process the benchmark starts is killed by PID (a job's processes by the PIDs in
its cgroup's cgroup.procs) and every cgroup and temp dir it creates removed, also on errors. All
traffic stays on this machine (DMTCP's coordinators are asked on 127.0.0.1).
"""

import argparse
import glob
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
    FREEZER, REPO, BenchError, BusySampler, Daemon, cg_pids, emit, finished, fmt, keep_or_remove,
    kill_cgroup, log, machine_info, med, mm, mono, notes_section, progress_lines, ratio, read_text,
    record_checkpoint, remove_cgroup, require_root_and_freezer, run, stop_proc, table_section,
    wait_idle, wait_until)

DEFAULT_SIZES = [1000, 2650, 5400]  # ~50, ~150, ~500 MB resident for 4 ranks
# What ckpt gives a DMTCP job (crates/node-agent/src/engine/dmtcp.rs JOB_ENV); every side here.
JOB_ENV = {"UCX_TLS": "^sysv,cma", "UCX_MEM_EVENTS": "no", "HWLOC_COMPONENTS": "-linuxio"}
REFUSED = "not every process of the job runs under DMTCP yet"
FIRST_CHECKPOINT_LIMIT = 120.0  # seconds DMTCP may refuse the first checkpoint of a job
RESTART_SCRIPT = "dmtcp_restart_script"
RAW_CG = os.path.join(FREEZER, f"ckpt-bench-dmtcp-raw-{os.getpid()}")
OUR_PIDS = set()  # PIDs of this run's jobs
SIDES = (("criu", "ckpt+CRIU"), ("dmtcp", "ckpt+DMTCP"), ("raw", "raw DMTCP"))


def job_env():
    """This process's environment with the DMTCP job settings, without DMTCP_* variables (a
    DMTCP_COORD_HOST or _PORT of the caller must not redirect the raw side's coordinator)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMTCP_")}
    env.update(JOB_ENV)
    return env


def job_cmd(app, n, iters, sleep_us):
    return ["mpiexec.mpich", "-n", "4", app, str(n), str(iters), str(sleep_us)]


def new_result():
    return {"frozen": [], "total": [], "ctl_wall": [], "bytes": [], "restart_progress": [],
            "restart_est": [], "restart_cmd": [], "restart_elapsed": [], "notes": []}


# ---------------------------------------------------------------- progress lines

class Lines:
    """Watches a job's stdout for a progress line newer than the ones there now. A file that
    shrinks (stdout put back to its size at checkpoint time) lowers the baseline."""

    def __init__(self, path):
        self.path = path
        self.base = progress_lines(path)

    def new(self):
        n = progress_lines(self.path)
        if n < self.base:
            self.base = n
        return n > self.base


def wait_next_line(path, timeout, what, alive=lambda: None):
    """Waits (polling every 20 ms) for a new progress line; returns the time it was seen."""
    w = Lines(path)

    def seen():
        alive()
        return w.new()
    wait_until(seen, timeout, f"{what}: a new progress line in {path}", 0.02)
    return mono()


def first_lines(path, timeout, what, alive=lambda: None):
    """Waits for three progress lines; returns the seconds between two lines (the mean gap of
    the first three, polled every 20 ms)."""
    def lines(n):
        def enough():
            alive()
            return progress_lines(path) >= n
        return enough
    wait_until(lines(1), timeout, f"{what}: first progress line in {path}", 0.02)
    t1 = mono()
    wait_until(lines(3), timeout, f"{what}: 3 progress lines in {path}", 0.02)
    interval = (mono() - t1) / 2
    if finished(path):
        raise BenchError(f"{what}: the job already finished; use a larger --interval")
    return interval


def est_restart(res, took):
    """`took` (s, restart request to new line) less the compute the restored job needed before
    that line, in ms."""
    return (took - max(0.0, res["interval_s"] - res["line_offset"])) * 1000.0


# ---------------------------------------------------------------- A, B: ckpt with CRIU or DMTCP

def bench_ckpt(d, engine, label, n, iters, sleep_us, app, k, res, line_timeout, cleanup):
    cmd = job_cmd(app, n, iters, sleep_us)
    more = ["--engine", "dmtcp"] if engine == "dmtcp" else []
    p, _ = run([os.path.join(d.bindir, "ckptctl"), "--socket", d.sock, "run", *more, "--", *cmd],
               timeout=60, cwd=d.dir, env=job_env())
    jid = p.stdout.strip().split()[-1]
    cleanup.ckpt_jobs.append(jid)
    cg = os.path.join(FREEZER, f"{d.prefix}{jid}")
    stdout = os.path.join(d.dir, "state", "jobs", jid, "stdout")
    log(f"{label}: job {jid} started: {shlex.join(cmd)}")
    try:
        try:
            interval = first_lines(stdout, line_timeout, f"{label} job {jid}")
        except BenchError as e:
            raise BenchError(f"{e} (job state {d.status(jid).get('state')!r}; "
                             f"stderr: {read_text(os.path.join(os.path.dirname(stdout), 'stderr'))[-600:]!r})")
        res["interval_s"] = interval
        st = d.status(jid)
        if st.get("engine", engine) != engine:
            res["notes"].append(f"ckptctl status says engine {st.get('engine')!r}, not {engine!r}")
        pids = cg_pids(cg)
        OUR_PIDS.update(pids)
        res["pss"] = job_pss_bytes(pids)
        log(f"{label}: job {jid}: {len(pids)} processes, PSS {res['pss'] / 2**20:.1f} MiB, "
            f"progress every {interval:.2f} s")
        for i in range(k):
            os.sync()
            t_line = wait_next_line(stdout, line_timeout, f"{label} job {jid}")
            first_try, refusals = mono(), 0
            while True:
                t0 = mono()
                p, wall = d.ctl("--json", "checkpoint", jid, "--wait", timeout=900, check=False)
                if p.returncode == 0:
                    break
                if (engine == "dmtcp" and REFUSED in p.stderr
                        and mono() - first_try < FIRST_CHECKPOINT_LIMIT):
                    refusals += 1
                    time.sleep(0.5)
                    continue
                raise BenchError(f"ckptctl checkpoint {jid} (exit {p.returncode}): {p.stderr.strip()[-800:]}")
            if refusals:
                res["notes"].append(f"checkpoint {i + 1}: DMTCP refused {refusals} time(s) "
                                    f"(\"{REFUSED}\"), accepted after {t0 - first_try:.1f} s")
            e = json.loads(p.stdout)
            record_checkpoint(res, e, wall)
            res["line_offset"] = t0 - t_line
            log(f"{label}: epoch {e['epoch']}: frozen {e['frozen_ms']} ms, total {e['total_ms']} ms, "
                f"ckptctl {wall * 1000:.0f} ms, {int(e['image_bytes']) / 2**20:.1f} MiB")
        if finished(stdout):
            raise BenchError(f"{label} job {jid} finished during the checkpoints; use a larger --interval")
        for i in range(k):
            kill_cgroup(cg, timeout=30)
            st = wait_until(lambda: (lambda s: s if str(s.get("state", "")).startswith(("killed", "exited")) else None)(d.status(jid)),
                            30, f"{label} job {jid} to be reported killed", 0.1)
            if not st["state"].startswith("killed"):
                res["notes"].append(f"after SIGKILL the job's state was {st['state']!r}")
            watch = Lines(stdout)
            t0 = mono()
            p, wall = d.ctl_json("restart", jid)
            e = json.loads(p.stdout)
            wait_until(watch.new, max(60.0, 5 * interval),
                       f"restored {label} job {jid}: a new progress line in {stdout}", 0.02)
            took = mono() - t0
            res["restart_cmd"].append(wall * 1000.0)
            res["restart_elapsed"].append(float(e.get("elapsed_ms", 0)))
            res["restart_progress"].append(took * 1000.0)
            res["restart_est"].append(est_restart(res, took))
            log(f"{label}: restart {i + 1} from epoch {e.get('epoch')}: ckptctl {wall * 1000:.0f} ms, "
                f"new progress line after {took * 1000:.0f} ms")
    finally:
        d.ctl("cancel", jid, timeout=60, check=False)
        try:
            wait_until(lambda: not str(d.status(jid).get("state", "running")).startswith("running"),
                       30, f"{label} job {jid} to stop after cancel", 0.2)
        except BenchError as e:
            log(f"warning: {e}")
        kill_cgroup(cg, timeout=30)


# ---------------------------------------------------------------- C: raw DMTCP

class RawDmtcp:
    def __init__(self, tmp, dmtcp_bin, cleanup):
        self.tmp = tmp
        self.bin = dmtcp_bin
        self.cleanup = cleanup
        self.procs = []

    def tool(self, name):
        return os.path.join(self.bin, name)

    def command(self, port, *args, timeout=30, check=True):
        return run([self.tool("dmtcp_command"), "--coord-host", "127.0.0.1", "--coord-port", str(port), *args],
                   timeout=timeout, check=check, env=job_env())[0]

    def running(self, port):
        """True when the coordinator on `port` says every process of the job runs."""
        p = self.command(port, "-s", timeout=10, check=False)
        return p.returncode == 0 and any(l.strip() == "RUNNING=yes" for l in p.stdout.splitlines())

    def start(self, argv, stdout, stderr, cwd):
        """Starts `argv` in a new session, joined to RAW_CG before it execs; its Popen."""
        fo = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        fe = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            p = subprocess.Popen(["sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh",
                                  os.path.join(RAW_CG, "cgroup.procs"), *argv],
                                 stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, close_fds=True,
                                 start_new_session=True, cwd=cwd, env=job_env())
        finally:
            os.close(fo)
            os.close(fe)
        self.procs.append(p)
        self.cleanup.popens.append(p)
        return p

    def reap(self):
        for p in self.procs:
            p.poll()

    def kill_all(self):
        kill_cgroup(RAW_CG, timeout=30, reap=self.reap)
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    raise BenchError(f"raw DMTCP process {p.pid} not reaped after SIGKILL")

    def bench(self, n, iters, sleep_us, app, k, res, line_timeout):
        base = os.path.join(self.tmp, "raw-dmtcp", str(n))
        ckdir, dtmp = os.path.join(base, "ckpt"), os.path.join(base, "dmtcp-tmp")
        os.makedirs(ckdir)
        os.makedirs(dtmp)
        stdout, stderr = os.path.join(base, "stdout"), os.path.join(base, "stderr")
        port_file = os.path.join(base, "launch.port")
        os.mkdir(RAW_CG)
        self.cleanup.cgroups.append(RAW_CG)
        self.procs = []
        cmd = job_cmd(app, n, iters, sleep_us)
        try:
            root = self.start([self.tool("dmtcp_launch"), "--new-coordinator", "--coord-port", "0",
                               "--port-file", port_file, "--no-gzip", "--ckptdir", ckdir,
                               "--tmpdir", dtmp, "--quiet", *cmd], stdout, stderr, base)
            log(f"raw DMTCP: dmtcp_launch pid {root.pid}: {shlex.join(cmd)}")
            cur = root

            def alive():
                if cur.poll() is not None:
                    raise BenchError(f"raw DMTCP job exited with {cur.returncode}: {read_text(stderr)[-800:]}")
            interval = first_lines(stdout, line_timeout, "raw DMTCP job", alive)
            res["interval_s"] = interval
            port = self.port(port_file, alive)
            wait_until(lambda: alive() or self.running(port), 120,
                       f"raw DMTCP coordinator (port {port}) to say RUNNING=yes", 0.5)
            pids = cg_pids(RAW_CG)
            OUR_PIDS.update(pids)
            res["pss"] = job_pss_bytes(pids)
            log(f"raw DMTCP: coordinator port {port}, {len(pids)} processes (coordinator included), "
                f"PSS {res['pss'] / 2**20:.1f} MiB, progress every {interval:.2f} s")
            for i in range(k):
                for name in os.listdir(ckdir):
                    if name.startswith((RESTART_SCRIPT, "ckpt_")):
                        os.unlink(os.path.join(ckdir, name))
                os.sync()
                t_line = wait_next_line(stdout, line_timeout, "raw DMTCP job", alive)
                t0 = mono()
                self.command(port, "-c")
                wait_until(lambda: alive() or any(x.startswith(RESTART_SCRIPT) for x in os.listdir(ckdir)),
                           900, f"{RESTART_SCRIPT}*.sh in {ckdir}", 0.01)
                t1 = mono()
                images = self.images(ckdir)
                if not images:
                    raise BenchError(f"DMTCP wrote a restart script but no ckpt_*.dmtcp in {ckdir}")
                nbytes = sum(os.path.getsize(f) for f in images)
                res["frozen"].append((t1 - t0) * 1000.0)
                res["bytes"].append(nbytes)
                res["line_offset"] = t0 - t_line
                log(f"raw DMTCP: checkpoint {i + 1}: {(t1 - t0) * 1000:.0f} ms from dmtcp_command -c "
                    f"to the restart script, {len(images)} images, {nbytes / 2**20:.1f} MiB")
            if finished(stdout):
                raise BenchError("raw DMTCP job finished during the checkpoints; use a larger --interval")
            images = self.images(ckdir)
            for i in range(k):
                self.kill_all()
                port_file2 = os.path.join(base, f"restart-{i + 1}.port")
                watch = Lines(stdout)
                t0 = mono()
                cur = self.start([self.tool("dmtcp_restart"), "--new-coordinator", "--coord-port", "0",
                                  "--port-file", port_file2, "--tmpdir", dtmp, "--quiet", *images],
                                 stdout, stderr, base)
                t_run = t_new = None
                last_status = 0.0
                deadline = mono() + max(60.0, 5 * interval)
                while t_new is None:
                    if watch.new():
                        t_new = mono()
                        break
                    if cur.poll() not in (None, 0):
                        raise BenchError(f"dmtcp_restart exited with {cur.returncode}: {read_text(stderr)[-800:]}")
                    if mono() > deadline:
                        raise BenchError(f"restored raw DMTCP job: no new progress line in {stdout} after "
                                         f"{deadline - t0:.0f} s; stderr: {read_text(stderr)[-600:]!r}")
                    if t_run is None and mono() - last_status >= 0.1:
                        p2 = self.read_port(port_file2)
                        if p2 and self.running(p2):
                            t_run = mono()
                        last_status = mono()
                    time.sleep(0.02)
                if t_run is None:
                    p2 = self.read_port(port_file2)
                    if p2 and self.running(p2):
                        t_run = t_new  # running by the time its line came
                took = t_new - t0
                res["restart_progress"].append(took * 1000.0)
                res["restart_est"].append(est_restart(res, took))
                if t_run is not None:
                    res["restart_cmd"].append((t_run - t0) * 1000.0)
                else:
                    res["notes"].append(f"restart {i + 1}: the new coordinator never said RUNNING=yes")
                log(f"raw DMTCP: restart {i + 1}: RUNNING=yes after "
                    f"{'–' if t_run is None else f'{(t_run - t0) * 1000:.0f} ms'}, "
                    f"new progress line after {took * 1000:.0f} ms")
        finally:
            try:
                self.kill_all()
            except BenchError as e:
                log(f"warning: {e}")
            for p in self.procs:
                stop_proc(p, "raw DMTCP process", term_timeout=5)
            remove_cgroup(RAW_CG)
            if RAW_CG in self.cleanup.cgroups:
                self.cleanup.cgroups.remove(RAW_CG)

    @staticmethod
    def images(ckdir):
        return sorted(os.path.join(ckdir, x) for x in os.listdir(ckdir)
                      if x.startswith("ckpt_") and x.endswith(".dmtcp"))

    @staticmethod
    def read_port(path):
        try:
            return int(read_text(path).strip())
        except ValueError:
            return None

    def port(self, path, alive):
        return wait_until(lambda: alive() or self.read_port(path), 60, f"the coordinator's port in {path}", 0.1)


# ---------------------------------------------------------------- cleanup, report, main

class Cleanup:
    def __init__(self):
        self.daemon = None
        self.popens = []
        self.cgroups = []
        self.ckpt_jobs = []

    def run(self, tmp):
        d = self.daemon
        if d is not None and d.proc.poll() is None:
            for jid in self.ckpt_jobs:
                d.ctl("cancel", jid, timeout=30, check=False)
        for cg in list(self.cgroups):
            remove_cgroup(cg)
        for p in self.popens:
            stop_proc(p, f"pid {p.pid}", term_timeout=5)
        if d is not None:
            d.stop(None)  # stops ckptd, removes the cgroups with its prefix
        # What is left of this run (a ckptd that never answered, shims `ckptd shim <tmp>/...`
        # that outlived their job): stopped by PID, recognised by this run's private temp dir.
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                cmd = read_text(f"/proc/{pid}/cmdline").replace("\0", " ")
                if tmp in cmd:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                        log(f"killed leftover process {pid}: {cmd[:120]}")
                    except OSError:
                        pass


def mins(xs):
    return min(xs) if xs else None


def ratios(a, b):
    """a / b on the medians, and (on the minimums)."""
    return f"{ratio(med(a), med(b))} ({ratio(mins(a), mins(b))})"


def size_cell(xs):
    return "–" if not xs else f"{fmt(med(xs))} ({med(xs) / 2**20:,.1f} MiB)"


def render(results, k, header):
    out = [header, ""]
    out.append(f"Median (min) over K={k} per size, times in ms; ratios on the medians (on the minimums). "
               "Each side runs a job of its own, one after the other.")
    out += table_section(
        "Frozen time (target: raw DMTCP ÷ ckpt+CRIU ≥ 3, on medians)",
        ("N", "job PSS MiB (CRIU / DMTCP / raw)", "ckpt+CRIU", "ckpt+DMTCP", "raw DMTCP",
         "raw DMTCP ÷ ckpt+CRIU", "≥ 3×", "ckpt+DMTCP ÷ raw DMTCP"),
        intro=("ckpt+CRIU: the epoch's `frozen_ms` (freeze until thaw completed). ckpt+DMTCP: the epoch's "
               "`frozen_ms` (the time DMTCP took: `dmtcp_command -c` until its restart script). Raw DMTCP: "
               "`dmtcp_command -c` sent until `dmtcp_restart_script*.sh` appeared (the job is suspended all "
               "that time).",))
    for n, r in results:
        a, b, c = r["criu"], r["dmtcp"], r["raw"]
        pss = " / ".join(fmt(x["pss"] / 2**20 if x.get("pss") else None) for x in (a, b, c))
        fc, fa = med(c["frozen"]), med(a["frozen"])
        meets = "–" if fc is None or not fa else ("yes" if fc / fa >= 3 else "NO")
        out.append(f"| {n} | {pss} | {mm(a['frozen'])} | {mm(b['frozen'])} | {mm(c['frozen'])} "
                   f"| {ratios(c['frozen'], a['frozen'])} | {meets} | {ratios(b['frozen'], c['frozen'])} |")
    out += table_section(
        "Checkpoint to commit",
        ("N", "ckpt+CRIU total_ms", "ckpt+DMTCP total_ms", "raw DMTCP (-c → restart script)",
         "raw DMTCP ÷ ckpt+CRIU", "ckpt+DMTCP ÷ raw DMTCP", "ckptctl wall CRIU", "ckptctl wall DMTCP"),
        intro=("ckpt: the epoch's `total_ms` (request until committed); ckptctl wall: `ckptctl checkpoint "
               "--wait` from start to exit. Raw DMTCP has no commit: its checkpoint ends with the restart "
               "script.",))
    for n, r in results:
        a, b, c = r["criu"], r["dmtcp"], r["raw"]
        out.append(f"| {n} | {mm(a['total'])} | {mm(b['total'])} | {mm(c['frozen'])} "
                   f"| {ratios(c['frozen'], a['total'])} | {ratios(b['total'], c['frozen'])} "
                   f"| {mm(a['ctl_wall'])} | {mm(b['ctl_wall'])} |")
    out += table_section(
        "Image size (bytes, median)",
        ("N", "ckpt+CRIU", "ckpt+DMTCP", "raw DMTCP", "ckpt+DMTCP ÷ raw DMTCP", "ckpt+DMTCP ÷ ckpt+CRIU"),
        intro=("ckpt: the epoch's `image_bytes`; raw DMTCP: the `ckpt_*.dmtcp` files (uncompressed, "
               "`--no-gzip` as ckpt runs DMTCP).",))
    for n, r in results:
        a, b, c = r["criu"], r["dmtcp"], r["raw"]
        out.append(f"| {n} | {size_cell(a['bytes'])} | {size_cell(b['bytes'])} | {size_cell(c['bytes'])} "
                   f"| {ratio(med(b['bytes']), med(c['bytes']))} | {ratio(med(b['bytes']), med(a['bytes']))} |")
    out += table_section(
        "Restart: request until the restored job's first new progress line",
        ("N", "progress interval s (CRIU / DMTCP / raw)", "ckpt+CRIU", "ckpt+DMTCP", "raw DMTCP",
         "raw DMTCP ÷ ckpt+CRIU", "ckpt+DMTCP ÷ raw DMTCP"),
        intro=("After SIGKILL of every process of the job: ckpt: `ckptctl restart` started; raw: "
               "`dmtcp_restart` started. Each side's last checkpoint was requested right after a progress "
               "line, so this includes about one progress interval of computing.",))
    for n, r in results:
        a, b, c = r["criu"], r["dmtcp"], r["raw"]
        iv = " / ".join(fmt(x.get("interval_s"), 2) for x in (a, b, c))
        out.append(f"| {n} | {iv} | {mm(a['restart_progress'])} | {mm(b['restart_progress'])} "
                   f"| {mm(c['restart_progress'])} | {ratios(c['restart_progress'], a['restart_progress'])} "
                   f"| {ratios(b['restart_progress'], c['restart_progress'])} |")
    out += table_section(
        "Restart: command time and estimated restart cost",
        ("N", "ckptctl restart CRIU", "ckptctl restart DMTCP", "raw dmtcp_restart → RUNNING=yes",
         "est. ckpt+CRIU", "est. ckpt+DMTCP", "est. raw DMTCP", "est. raw ÷ ckpt+CRIU",
         "est. ckpt+DMTCP ÷ raw"),
        intro=("ckptctl restart: its wall time (with DMTCP it returns once `dmtcp_restart` is started, "
               "before the processes are restored, so only the other columns compare). Raw: "
               "`dmtcp_restart` started until `dmtcp_command -s` on its new coordinator said "
               "`RUNNING=yes` (polled every 0.1 s). est.: the time to the new progress line less the "
               "compute the restored job still needed for it (progress interval − time from the line to "
               "the checkpoint request); approximate (± the interval's jitter).",))
    for n, r in results:
        a, b, c = r["criu"], r["dmtcp"], r["raw"]
        out.append(f"| {n} | {mm(a['restart_cmd'])} | {mm(b['restart_cmd'])} | {mm(c['restart_cmd'])} "
                   f"| {mm(a['restart_est'])} | {mm(b['restart_est'])} | {mm(c['restart_est'])} "
                   f"| {ratios(c['restart_est'], a['restart_est'])} | {ratios(b['restart_est'], c['restart_est'])} |")
    out += notes_section((f"N={n} {label}", r[side]) for n, r in results for side, label in SIDES)
    return "\n".join(out) + "\n"


def machine_header(args_cmd, criu, dmtcp_bin, sizes, iters, sleep_us):
    criu_v, mpich_v, mem = machine_info(criu)
    dv = run([os.path.join(dmtcp_bin, "dmtcp_launch"), "--version"], timeout=20, check=False)[0].stdout
    dmtcp_v = next((l.split()[-1] for l in dv.splitlines() if "DMTCP" in l), "?")
    jobs = ", ".join(f"N={n}: heat {n} {iters} {sleep_us}" for n in sizes)
    env = " ".join(f"{k}={v}" for k, v in JOB_ENV.items())
    return (f"## ckpt+CRIU vs ckpt+DMTCP vs raw DMTCP, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Machine: nproc {os.cpu_count()}, {mem} MiB RAM, kernel {os.uname().release}, CRIU {criu_v}, "
            f"DMTCP {dmtcp_v}, MPICH {mpich_v}; job: mpiexec.mpich -n 4 ({jobs}), environment `{env}` on "
            f"every side (the CRIU side too, so that the job is the same)\n\n"
            f"Command: `{args_cmd}`")


def busy_processes(tmp=None, prefix=None):
    """Heavy processes not started by this run: builds and other MPI tests."""
    return foreign_busy(OUR_PIDS, tmp, (prefix, os.path.basename(RAW_CG)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", help="comma-separated N values (default 1000,2650,5400)")
    ap.add_argument("--repeats", type=int, default=3, metavar="K")
    ap.add_argument("--quick", action="store_true", help="one small size, K=2 (smoke test)")
    ap.add_argument("--out", help="also write the markdown tables to this file")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    ap.add_argument("--app", default=os.path.join(REPO, "target", "apps", "heat.mpich"),
                    help="the MPICH build of tests/apps/heat.c")
    ap.add_argument("--dmtcp-bin", default="/opt/dmtcp/bin", metavar="DIR",
                    help="raw DMTCP's dmtcp_launch/_command/_restart (ckpt's agent finds DMTCP itself)")
    ap.add_argument("--criu", default="/opt/ckpt/criu/bin/criu", help="only for the version in the header")
    ap.add_argument("--sleep-us", type=int, default=20000)
    ap.add_argument("--interval", type=float, default=2.0,
                    help="minimum seconds between progress lines (ITERS = 20 * interval / sleep)")
    ap.add_argument("--wait-idle", type=float, default=0,
                    help="first wait up to this many seconds until no cargo/rustc/heat.* runs")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, images)")
    args = ap.parse_args()

    require_root_and_freezer()
    for tool in ("dmtcp_launch", "dmtcp_command", "dmtcp_restart", "dmtcp_coordinator"):
        if not os.access(os.path.join(args.dmtcp_bin, tool), os.X_OK):
            sys.exit(f"no {tool} in {args.dmtcp_bin} (--dmtcp-bin)")
    if not os.access(args.app, os.X_OK):
        sys.exit(f"no test program {args.app} (make -C tests/apps OUT=target/apps ...; or --app)")
    sizes = [1000] if args.quick else ([int(x) for x in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES)
    k = 2 if args.quick else args.repeats
    iters = 20 * math.ceil(args.interval / (args.sleep_us / 1e6))
    cmdline = shlex.join([sys.argv[0]] + sys.argv[1:])

    if args.wait_idle > 0:
        wait_idle(busy_processes, args.wait_idle, poll=30)

    tmp = tempfile.mkdtemp(prefix="ckpt-bench-dmtcp-")
    log(f"work dir {tmp}; sizes {sizes}, K={k}, heat N {iters} {args.sleep_us}")
    cleanup = Cleanup()
    results = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = mono()
    prefix = [None]
    sampler = BusySampler(lambda: busy_processes(tmp, prefix[0]))
    sampler.start()
    try:
        # Copies, so that a rebuild during the run does not matter.
        bindir = os.path.join(tmp, "bin")
        os.mkdir(bindir)
        for b in ("ckptd", "ckptctl", "ckpt-agent"):
            if os.path.exists(os.path.join(args.bin_dir, b)):
                shutil.copy2(os.path.join(args.bin_dir, b), os.path.join(bindir, b))
        os.mkdir(os.path.join(tmp, "apps"))
        app = os.path.join(tmp, "apps", os.path.basename(args.app))
        shutil.copy2(args.app, app)
        header = machine_header(cmdline, args.criu, args.dmtcp_bin, sizes, iters, args.sleep_us)

        d = cleanup.daemon = Daemon(tmp, bindir, "no flush", None, 100)
        prefix[0] = d.prefix
        log(f"ckptd pid {d.proc.pid} ready in {d.dir}")
        raw = RawDmtcp(tmp, args.dmtcp_bin, cleanup)
        line_timeout = max(120.0, 12 * args.interval)
        for n in sizes:
            r = {side: new_result() for side, _ in SIDES}
            for side, label in SIDES:
                log(f"=== N={n}: {label}")
                try:
                    if side == "raw":
                        raw.bench(n, iters, args.sleep_us, app, k, r[side], line_timeout)
                    else:
                        bench_ckpt(d, side, label, n, iters, args.sleep_us, app, k, r[side], line_timeout, cleanup)
                except BenchError as e:
                    err = str(e)
                    if side != "raw":
                        # What the job said, for a restart that made no progress.
                        tails = [read_text(f)[-400:] for f in sorted(
                            glob.glob(os.path.join(d.dir, "state", "jobs", "*", "stderr")),
                            key=os.path.getmtime)[-1:]]
                        err += f" (newest job stderr: {tails[0]!r})" if tails else ""
                    r[side]["error"] = err
                    log(f"{label} N={n} FAILED: {err}")
            results.append((n, r))
            log(f"N={n} done after {mono() - t_start:.0f} s")
        took = mono() - t_start
        sampler.stop.set()
        sampler.join(timeout=30)
        table = render(results, k, header) + f"\nWall time of the whole run: {took / 60:.1f} min.\n"
        table += sampler.summary("\nNo cargo/rustc/heat.* processes other than this run's were seen during it "
                                 "(sampled every 5 s).\n")
        emit(table, args.out)
        failed = any(x.get("error") for _, r in results for x in r.values())
        return 1 if failed else 0
    finally:
        sampler.stop.set()
        cleanup.run(tmp)
        keep_or_remove(tmp, args.keep)


if __name__ == "__main__":
    sys.exit(main())
