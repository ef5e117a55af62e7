"""Helpers shared by the ckpt-vs-raw-CRIU benchmark scripts (e2e_vs_criu.py, multinode_vs_criu.py).

Not a benchmark itself: bounded waits and subprocess runs, /proc and cgroup v1 freezer access,
stopping the processes a benchmark started, image and progress-file inspection, the number
formatting of the markdown tables, and the bounded watch for other heavy processes (builds,
tests) that would disturb a measurement. Standard library only; the scripts import it from
their own directory.
"""

import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time


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


# ---------------------------------------------------------------- other heavy processes

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
