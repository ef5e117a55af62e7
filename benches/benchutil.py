"""Helpers shared by the benchmark scripts (e2e_vs_criu.py, multinode_vs_criu.py,
flush_frozen.py, dedup_ratio.py).

Not a benchmark itself: bounded waits and subprocess runs, /proc and cgroup v1 freezer access,
killing a job's cgroup, stopping the processes a benchmark started, ckptctl against one ckptd,
the private standalone ckptd of the storage benchmarks, image and progress-file inspection, the
number formatting and the notes of the markdown reports, and the bounded watch for other heavy
processes (builds, tests) that would disturb a measurement. Standard library only; the scripts
import it from their own directory.
"""

import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

FREEZER = "/sys/fs/cgroup/freezer"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BenchError(Exception):
    pass


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mono():
    return time.monotonic()


def wait_until(pred, timeout, what, interval=0.05):
    """Polls pred() until it returns a true value; raises BenchError after timeout seconds."""
    deadline = mono() + timeout
    while True:
        v = pred()
        if v:
            return v
        if mono() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def run(cmd, timeout, check=True, **kw):
    t0 = mono()
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise BenchError(f"timed out after {timeout} s: {shlex.join(cmd)}")
    wall = mono() - t0
    if check and p.returncode != 0:
        raise BenchError(f"exit {p.returncode}: {shlex.join(cmd)}: {(p.stderr or p.stdout).strip()[-800:]}")
    return p, wall


# ---------------------------------------------------------------- processes and cgroups

def read_text(path, default=""):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


def cg_pids(cg):
    return [int(x) for x in read_text(os.path.join(cg, "cgroup.procs")).split()]


def pid_exists(pid):
    return os.path.exists(f"/proc/{pid}")


def comm(pid):
    return read_text(f"/proc/{pid}/comm").strip()


def freezer_state(cg):
    return read_text(os.path.join(cg, "freezer.state")).strip()


def set_freezer(cg, state, timeout=30.0):
    """Writes FROZEN/THAWED and waits (100 us .. 5 ms backoff) until the kernel reports it."""
    with open(os.path.join(cg, "freezer.state"), "w") as f:
        f.write(state)
    deadline = mono() + timeout
    pause = 100e-6
    while True:
        s = freezer_state(cg)
        if s == state:
            return
        if mono() > deadline:
            raise BenchError(f"{cg}: still {s} after {timeout} s waiting for {state}")
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def force_thaw(cg):
    """Writes THAWED to cgroup `cg`'s freezer without waiting and without failing: the last
    resort, so that a job is never left frozen."""
    try:
        with open(os.path.join(cg, "freezer.state"), "w") as f:
            f.write("THAWED")
    except OSError:
        pass


def kill_cgroup(cg, timeout=30.0, also=(), reap=None, mpiexec_first=True):
    """Thaws cgroup `cg` and SIGKILLs its processes (by PID, read from the cgroup; mpiexec first
    unless `mpiexec_first` is false) until it is empty and the killed PIDs (and `also`, which are
    only waited for, never signalled) have vanished from /proc; `reap` is called on every round
    (to collect our own child). Bounded."""
    if not os.path.isdir(cg):
        return
    if freezer_state(cg) != "THAWED":
        force_thaw(cg)
    seen = set(also)
    deadline = mono() + timeout
    while True:
        pids = cg_pids(cg)
        seen.update(pids)
        if mpiexec_first:
            # so that the job's state is "killed (signal 9)" and not an exit of mpiexec
            pids = sorted(pids, key=lambda p: (not comm(p).startswith("mpiexec"), p))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if reap is not None:
            reap()
        if not pids and not any(pid_exists(p) for p in seen):
            return
        if mono() > deadline:
            left = [p for p in seen if pid_exists(p)]
            raise BenchError(f"{cg}: processes {cg_pids(cg)} / {left} still present after {timeout} s")
        time.sleep(0.02)


def remove_cgroup(cg):
    """Kills what is left in cgroup `cg` and removes it; a failure is only a warning."""
    if not os.path.isdir(cg):
        return
    try:
        kill_cgroup(cg, timeout=20)
    except BenchError as e:
        log(f"warning: {e}")
    for _ in range(100):
        try:
            os.rmdir(cg)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    log(f"warning: could not remove cgroup {cg}")


def stop_proc(p, name, term_timeout=15.0):
    """Stops one process we started (a subprocess.Popen) by its PID: SIGTERM, then SIGKILL."""
    if p is None or p.poll() is not None:
        return
    try:
        os.kill(p.pid, signal.SIGTERM)
        p.wait(timeout=term_timeout)
    except subprocess.TimeoutExpired:
        log(f"{name} (pid {p.pid}) ignored SIGTERM; SIGKILL")
        os.kill(p.pid, signal.SIGKILL)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log(f"warning: {name} (pid {p.pid}) did not die")
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- images and job output

def dir_bytes(path, skip=(".log",)):
    """Bytes of the image files in `path`; files whose name ends with one of `skip` (by default
    CRIU's log) are excluded."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            if f.endswith(skip):
                continue
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def progress_lines(path):
    return sum(1 for line in read_text(path).splitlines() if line.startswith("iter "))


def finished(path):
    return "checksum" in read_text(path)


def wait_first_lines(path, n, timeout, what):
    """Waits for n progress lines; returns the seconds between the first two (progress interval)."""
    wait_until(lambda: progress_lines(path) >= 1, timeout, f"{what}: first progress line in {path}", 0.1)
    t1 = mono()
    wait_until(lambda: progress_lines(path) >= n, timeout, f"{what}: {n} progress lines in {path}", 0.1)
    interval = (mono() - t1) / max(1, n - 1)
    if finished(path):
        raise BenchError(f"{what}: the job already finished; use a larger --interval")
    return interval


# ---------------------------------------------------------------- ckptd and ckptctl

class Ckptctl:
    """ckptctl against the ckptd on socket `sock`, run in `cwd`; `timeout` bounds a call that
    names no bound of its own."""

    def __init__(self, bindir, sock, cwd, timeout=600):
        self.bindir = bindir
        self.sock = sock
        self.cwd = cwd
        self.ctl_timeout = timeout

    def ctl(self, *args, timeout=None, check=True):
        return run([os.path.join(self.bindir, "ckptctl"), "--socket", self.sock, *args],
                   timeout=self.ctl_timeout if timeout is None else timeout, check=check, cwd=self.cwd)

    def ctl_json(self, verb, jid, *more):
        """`ckptctl --json VERB JID MORE...`, bounded to 15 minutes: (the process, its wall time
        in seconds); a failure is a BenchError with the exit code and the end of stderr."""
        p, wall = self.ctl("--json", verb, jid, *more, timeout=900, check=False)
        if p.returncode != 0:
            raise BenchError(f"ckptctl {verb} {jid} (exit {p.returncode}): {p.stderr.strip()[-800:]}")
        return p, wall

    def status(self, jid):
        """`ckptctl --json status JID` as a dict; {} if ckptctl fails."""
        p, _ = self.ctl("--json", "status", jid, timeout=30, check=False)
        if p.returncode != 0:
            return {}
        try:
            return json.loads(p.stdout)
        except ValueError:
            return {}


def record_checkpoint(res, e, wall=None):
    """Files a checkpoint's `frozen_ms`, `total_ms` and `image_bytes` (ckptctl's JSON `e`) under
    res["frozen"], res["total"] and res["bytes"], and ckptctl's wall time `wall` (seconds), if
    given, under res["ctl_wall"] in ms."""
    res["frozen"].append(float(e["frozen_ms"]))
    res["total"].append(float(e["total_ms"]))
    if wall is not None:
        res["ctl_wall"].append(wall * 1000.0)
    res["bytes"].append(int(e["image_bytes"]))


def common_args(ap):
    """Options every storage benchmark script takes."""
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    ap.add_argument("--criu", default="/opt/ckpt/criu/bin/criu")
    ap.add_argument("--keep", action="store_true")


def stage(tmp, bin_dir, app, skip_missing=False):
    """Copies the daemons into tmp (a rebuild during the run does not matter; with
    `skip_missing`, one not built is left out) and builds the test program `app` from tests/apps
    there; returns (bindir, path of the program)."""
    bindir = os.path.join(tmp, "bin")
    os.mkdir(bindir)
    for b in ("ckptd", "ckptctl", "ckpt-agent"):
        src = os.path.join(bin_dir, b)
        if skip_missing and not os.path.exists(src):
            continue
        shutil.copy2(src, os.path.join(bindir, b))
    appdir = os.path.join(tmp, "apps")
    run(["make", "-s", "-C", os.path.join(REPO, "tests", "apps"), f"OUT={appdir}",
         os.path.join(appdir, app)], timeout=300)
    return bindir, os.path.join(appdir, app)


class Daemon(Ckptctl):
    """The storage benchmarks' private `ckptd --standalone` in a directory of its own under
    tmp, flushing every epoch to `shared` in mode "flush" (at most `bw` MB/s, chunks stored as
    `compress` says), never otherwise."""

    def __init__(self, tmp, bindir, mode, shared, bw, compress="none"):
        self.dir = os.path.join(tmp, f"{mode.replace(' ', '-')}-{int(mono() * 1000)}")
        os.makedirs(self.dir)
        super().__init__(bindir, os.path.join(self.dir, "ckptd.sock"), self.dir, timeout=900)
        self.prefix = f"ckpt-fbench-{os.getpid()}-"
        flush = mode == "flush"
        # An empty tls_dir of our own (no cluster credential, never a host-wide /etc/ckpt/tls):
        # this standalone ckptd opens no TCP port. The benchmark runs as root, so its jobs do.
        tls_dir = os.path.join(self.dir, "tls")
        os.mkdir(tls_dir, mode=0o700)
        with open(os.path.join(self.dir, "ckptd.toml"), "w") as f:
            f.write(f'listen = "127.0.0.1:0"\nsocket = "{self.sock}"\n'
                    f'database = "{self.dir}/ckptd.redb"\n'
                    f'tls_dir = "{tls_dir}"\n'
                    f'[retention]\nkeep_local = 2\n'
                    f'[flush]\nevery = {1 if flush else 0}\n'
                    f'[agent]\nlisten = "127.0.0.1:0"\nstate_dir = "{self.dir}/state"\n'
                    f'local_dir = "{self.dir}/local"\nallow_root_jobs = true\n'
                    + (f'shared_dir = "{shared}"\n' if flush else "")
                    + f'[agent.flush]\nbandwidth_mb = {bw}\ncompress = "{compress}"\n'
                    f'[agent.cgroup]\nprefix = "{self.prefix}"\n')
        logf = open(os.path.join(self.dir, "ckptd.log"), "ab")
        self.proc = subprocess.Popen(
            [os.path.join(bindir, "ckptd"), "--standalone", "--config",
             os.path.join(self.dir, "ckptd.toml")],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, close_fds=True,
            start_new_session=True, cwd=self.dir)
        logf.close()

        def ready():
            if self.proc.poll() is not None:
                raise BenchError(f"ckptd exited: {read_text(os.path.join(self.dir, 'ckptd.log'))[-1500:]}")
            return os.path.exists(self.sock) and self.ctl("list", check=False)[0].returncode == 0
        wait_until(ready, 60, "ckptd to answer", 0.2)

    def epochs(self, jid):
        return json.loads(self.ctl("--json", "epochs", jid)[0].stdout)

    def wait_durable(self, jid, n, limit, interval=0.2):
        """Waits up to `limit` s until epoch `n` of `jid` is durable (or shared-only) and
        returns its `ckptctl epochs` entry; a failed flush is a BenchError."""
        def durable():
            es = {x["epoch"]: x for x in self.epochs(jid)}
            if es[n]["storage"] == "flush-failed":
                raise BenchError(f"flush of epoch {n} failed: {es[n]}")
            return es[n] if es[n]["storage"] in ("durable", "shared-only") else None
        return wait_until(durable, limit, f"epoch {n} to be durable", interval)

    def stop(self, jid):
        if jid:
            self.ctl("cancel", jid, timeout=60, check=False)
            kill_cgroup(os.path.join(FREEZER, f"{self.prefix}{jid}"), timeout=30)
        stop_proc(self.proc, "ckptd")
        for name in sorted(os.listdir(FREEZER)):
            if name.startswith(self.prefix):
                remove_cgroup(os.path.join(FREEZER, name))


# ---------------------------------------------------------------- report

def machine_info(criu):
    """(CRIU version, MPICH version, MiB of RAM) for the header of a report."""
    criu_v = run([criu, "--version"], timeout=20, check=False)[0].stdout.split("\n")[0].replace("Version:", "").strip()
    mpich_v = run(["mpichversion"], timeout=20, check=False)[0].stdout
    mpich_v = next((l.split(":", 1)[1].strip() for l in mpich_v.splitlines() if l.startswith("MPICH Version")), "?")
    mem = next((int(l.split()[1]) // 1024 for l in read_text("/proc/meminfo").splitlines() if l.startswith("MemTotal")), 0)
    return criu_v, mpich_v, mem


def emit(table, out=None):
    """Prints the report to stdout and, if `out` is given, also writes it to that file."""
    print(table)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(table)
        log(f"wrote {out}")


def med(xs):
    return statistics.median(xs) if xs else None


def fmt(v, nd=0):
    return "–" if v is None else f"{v:,.{nd}f}"


def mm(xs, nd=0):
    return "–" if not xs else f"{fmt(med(xs), nd)} ({fmt(min(xs), nd)})"


def ratio(a, b, nd=2):
    return "–" if a is None or b in (None, 0) else f"{a / b:.{nd}f}"


def table_head(*columns):
    """The header and separator rows of a markdown table with these column titles."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def table_section(title, columns, intro=()):
    """The lines that open a report section holding one table: a blank line, "### title", a
    blank line, the `intro` lines followed by a blank line (if any), and the table's head."""
    return ["", f"### {title}", ""] + (list(intro) + [""] if intro else []) + table_head(*columns)


def notes_section(labelled):
    """The report's closing "### Notes" lines for (label, result) pairs: every result's notes,
    then its error; no lines if there are neither."""
    notes = []
    for label, r in labelled:
        for note in r["notes"]:
            notes.append(f"- {label}: {note}")
        if r.get("error"):
            notes.append(f"- {label}: ERROR: {r['error']}")
    return ["", "### Notes", ""] + notes if notes else []


def keep_or_remove(tmp, keep):
    """The end of a run: keeps the temp dir `tmp` (and says so) when asked to, else removes it."""
    if keep:
        log(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- other heavy processes

def job_pss_bytes(pids):
    """Proportional set size of the processes `pids`, in bytes."""
    total = 0
    for pid in pids:
        for line in read_text(f"/proc/{pid}/smaps_rollup").splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
    return total


def foreign_busy(our_pids, tmp=None, our_cgroups=()):
    """Heavy processes not started by this run (`ps -eo pid,comm`): builds and other MPI tests.
    Ours: a PID in `our_pids`, a command line naming the run's `tmp`, or a cgroup path holding
    one of `our_cgroups` (a job mid-restore, whose command line is not restored yet)."""
    names = {"cargo", "rustc", "heat.mpich", "heat.openmpi"}
    p, _ = run(["ps", "-eo", "pid,comm"], timeout=20)
    busy = []
    for line in p.stdout.splitlines()[1:]:
        parts = line.split(None, 1)
        if len(parts) != 2 or parts[1].strip() not in names:
            continue
        if int(parts[0]) in our_pids or (tmp and tmp in read_text(f"/proc/{parts[0]}/cmdline")):
            continue
        cgs = read_text(f"/proc/{parts[0]}/cgroup")
        if any(c and c in cgs for c in our_cgroups):
            continue
        busy.append(f"{parts[0]} {parts[1].strip()}")
    return busy


def wait_idle(busy_processes, limit, poll):
    """Waits, at most `limit` seconds and checking every `poll` seconds, until busy_processes()
    returns an empty list; then (or when the time is up) returns."""
    deadline = mono() + limit
    while True:
        busy = busy_processes()
        if not busy:
            return
        if mono() > deadline:
            log(f"still busy after {limit:.0f} s ({', '.join(busy[:6])}); running anyway")
            return
        log(f"waiting for other work to finish: {', '.join(busy[:6])}")
        time.sleep(poll)


class BusySampler(threading.Thread):
    """Samples busy_processes() every few seconds during the run, to flag disturbed results."""

    def __init__(self, busy_processes, every=5.0):
        super().__init__(daemon=True)
        self.busy_processes, self.every, self.seen = busy_processes, every, {}
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                for b in self.busy_processes():
                    self.seen.setdefault(b, time.strftime("%H:%M:%S"))
            except BenchError:
                pass
            self.stop.wait(self.every)

    def summary(self, none_seen):
        """The report's paragraph on other heavy processes: a warning naming the first 20 seen
        (with the time each was first seen), or `none_seen` if there were none."""
        if not self.seen:
            return none_seen
        return ("\nWARNING: other heavy processes ran during the measurements (first seen): "
                + ", ".join(f"{b} at {t}" for b, t in sorted(self.seen.items(), key=lambda x: x[1])[:20])
                + "\n")


def require_root_and_freezer():
    """Exits with a message unless this runs as root on a host with the cgroup v1 freezer (CRIU,
    cgroups and namespaces need both)."""
    if os.geteuid() != 0:
        sys.exit("must run as root (CRIU, cgroups, namespaces)")
    if not os.path.isdir(FREEZER):
        sys.exit(f"no cgroup v1 freezer at {FREEZER}")
