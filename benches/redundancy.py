#!/usr/bin/env python3
"""Erasure-coded redundancy against partner copies and shared storage, in one run: bytes stored
per image byte, how long an epoch is unprotected, the restart of a job whose node was lost, and
the job's slowdown while its nodes encode.

What it measures
----------------
Test hosts as restart_elsewhere.py makes them (multinode_vs_criu.py's Cluster: a private bridge,
a network and UTS namespace per host, mutual TLS, one ckptd, one agent per host, one shared_dir
on the local disk standing in for the parallel file system, job sandboxes on a job network).
Eleven hosts: n1..n10 run jobs, n11 is the spare. ckptd.toml: `node_timeout = "10s"`,
`[spares] nodes = ["n11"]`, `[job_network]`; every job names its scheme with `ckptctl run
--redundancy SCHEME` (the per-job override of `[redundancy] scheme`).

The job: `mpiexec.mpich -hosts <n1..nN> -n N heat 256 ITERS SLEEP_US`, one rank per node, each
rank holding `HEAT_BALLAST_MIB` = SIZE MiB of pseudo-random bytes (`HEAT_BALLAST_RANDOM=1`: no
deduplication or compression shrinks them, as an application's data). N is the scheme's group
(or two groups of four for `xor:4`, eight nodes for `partner` and `none`), so that the group is
what the scheme names: partner 8, xor:4 8, xor:8 8, rs:4+2 6, rs:8+2 10, none 8.

A. For each SIZE (MiB per node; default 50, 150, 500) and scheme: the job is started, checkpointed
   once with `ckptctl --json checkpoint ID --kill --wait` (epoch E, the job stopped), and then:

   protected after  seconds from the checkpoint's return until `ckptctl epochs` shows E's
                    redundancy in place (`partner_copy`, or `encoded` = the scheme; for `none`
                    until it is durable in shared storage), polled every 0.1 s.
   stored           bytes in every host's staging for E (<local>/<job>/<E>: each node's images,
                    the partner copies, the parity), CRIU's logs excluded, over the epoch's
                    `image_bytes`, after E is also durable. `none` shows what staging adds by
                    itself. With equal streams the ideal is 2 for partner, G/(G-1) for xor:G and
                    (K+M)/K for rs:K+M; the launcher's node holds mpiexec as well, so its
                    stream is longer and the row holding it pads the others.
   parity           `parity_bytes` of `ckptctl epochs --json` (checked against the files).

   Restart with a node lost, for partner, xor:8 and none (8 nodes each): n3's images of E are
   deleted from its staging, and `ckptctl --json restart ID --epoch E --map n3=n11` restarts the
   job with n3's part on the spare. The spare gets n3's images from the partner copy, rebuilds them
   from the other seven members' images and their parity, or fetches them from shared storage
   (none): which one is read from n11's agent log and shown. Reported: ckptctl's `elapsed_ms`
   (request to "running again": every node verifies and restores) and the restart's `fetch_ms`
   (as `ckptctl epochs --json` records it: getting the images to the nodes). Repeated K times
   (--repeats, default 1), each after stopping the job by PID and deleting what the spare
   fetched, so that every repeat fetches again. Restores on one machine are serialized
   (/run/ckpt/restore.lock), so `elapsed_ms` holds eight restores one after another; the
   difference between the rows is the moved part's fetch.

B. Slowdown while encoding: the same job on 8 nodes (--slow-size MiB per rank, default 150) runs
   compute-bound (`heat 1024 ITERS 0`; ITERS calibrated first, from a run of 2000 iterations
   timed from its first progress line to its result, so that a run computes about
   --slow-seconds, default 150) to its end with `--every 30s` (--slow-every) under `none`, `xor:8`
   and `none` again. Wall time: from `ckptctl run` until the checksum appears in its stdout
   (polled every 50 ms); a run not exited 10 s after its result is cancelled (MPICH may hang in
   MPI_Finalize). --slow-schemes runs others between the two `none` runs (e.g. xor:8,partner).
   overhead % = (wall - mean of the two `none` walls) / that mean * 100; per
   checkpoint-minute = overhead % / (checkpoints / run minutes); the issue's budget is <= 1 %.
   The two `none` runs' spread is the noise floor. Every run flushes to shared storage the same
   way, so the difference is the encoding (and its grants and reads between nodes).

All hosts are namespaces on this one machine (2 cores here): every node's dump, encode, copy and
flush share its cores and disk, so absolute times are not a cluster's; the rows compare schemes
on the same machine in one run.

How to run (root, Debian 12, cgroup v1 freezer, CRIU >= 4.2, MPICH, iproute2, nsenter, unshare,
nft; binaries built, target/apps/heat.mpich built):

    benches/redundancy.py --quick                      # smoke test: 50 MiB, two schemes, no B
    benches/redundancy.py --out benches/results/redundancy-$(date +%F).md --json FILE

Options: --sizes MIB,..  --schemes S,..  (of partner, xor:4, xor:8, rs:4+2, rs:8+2, none)
--repeats K  --no-slowdown  --only-slowdown  --slow-schemes S,..  --slow-size MIB  --slow-seconds S  --slow-every INTERVAL  --quick
--bin-dir DIR  --app PATH  --criu PATH  --node-prefix P  --wait-idle S  --keep  --out FILE
--json FILE. Standard library only. Every wait is bounded; every process the benchmark starts
is stopped by PID, and every cgroup, namespace, link and mount it creates is removed, also on
errors and Ctrl-C.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import (  # noqa: E402
    REPO, BenchError, BusySampler, emit, dir_bytes, fmt, log, machine_info, med, mono, read_text,
    require_root_and_freezer, run, table_head, wait_idle, wait_until)
from multinode_vs_criu import (  # noqa: E402
    ANSI, SUBNET, TAG, Ckpt, Cluster, busy_processes, default_criu, report_tail, stage_bins,
    stop_on_signals, teardown)
from restart_elsewhere import (  # noqa: E402
    parts, remove_sandbox_netns, sandbox_netns, stop_job, wait_running)

HOSTS = 11
SPARE = 11
LOST = 3
# scheme -> job nodes (its group, or two groups of four for xor:4)
NODES = {"partner": 8, "xor:4": 8, "xor:8": 8, "rs:4+2": 6, "rs:8+2": 10, "none": 8}
IDEAL = {"partner": 2.0, "xor:4": 4 / 3, "xor:8": 8 / 7, "rs:4+2": 6 / 4, "rs:8+2": 10 / 8, "none": 1.0}
RESTART_SCHEMES = ("partner", "xor:8", "none")
SOURCES = [("partner", "fetching the partner copy"),
           ("parity", "rebuilding the images from the other members of the group"),
           ("shared", "fetching the shared copy")]


class RedundancyCkpt(Ckpt):
    """ckptd with one spare, a job network and a node timeout long enough for ten dumps of
    500 MiB sharing two cores; one shared_dir for every agent."""

    def __init__(self, tmp, bindir, criu, cluster, spare):
        super().__init__(tmp, bindir, criu, cluster, tls=True, shared=True)
        self.spare = spare

    def write_ckptd_config(self):
        super().write_ckptd_config()
        with open(self.cfg, "a") as f:
            f.write('node_timeout = "10s"\n'
                    f'[spares]\nnodes = ["{self.spare}"]\n'
                    f'[job_network]\naddresses = "{SUBNET}.150-{SUBNET}.199"\nprefix = 24\n')

    def write_agent_config(self, node):
        acfg = super().write_agent_config(node)
        with open(acfg, "a") as f:
            f.write('[job_network]\ninterface = "eth0"\n')
        return acfg

    def epoch(self, jid, epoch):
        p, _ = self.ctl("--json", "epochs", jid, timeout=30, check=False)
        if p.returncode != 0:
            return {}
        try:
            return next((e for e in json.loads(p.stdout) if int(e.get("epoch", -1)) == epoch), {})
        except ValueError:
            return {}


def start_job(ckpt, cluster, n, scheme, size, iters, sleep_us, app, grid=256, every=None):
    """The job on hosts 1..n under `scheme`; its id once its first progress line is out (the
    ballast is written before the first iteration)."""
    hosts = ",".join(nd.netns for nd in cluster.nodes[:n])
    cmd = ["mpiexec.mpich", "-hosts", hosts, "-n", str(n), app, str(grid), str(iters), str(sleep_us)]
    more = ["--every", every] if every else []
    env = dict(os.environ, HEAT_BALLAST_MIB=str(size), HEAT_BALLAST_RANDOM="1")
    p, _ = run([os.path.join(ckpt.bindir, "ckptctl"), "--socket", ckpt.sock, "run", "--name",
                f"red-{scheme.replace(':', '').replace('+', 'p')}", "--node", cluster.nodes[0].name,
                "--redundancy", scheme, *more, "--", *cmd], timeout=60, cwd=ckpt.tmp, env=env)
    jid = p.stdout.strip().split()[-1]
    ckpt.jobs.append(jid)
    return jid


def job_file(cluster, jid, name):
    return os.path.join(cluster.nodes[0].dir, "state", "jobs", jid, name)


def wait_progress(ckpt, cluster, jid, timeout=300.0):
    def first():
        st = str(ckpt.status(jid).get("state", ""))
        if st and not st.startswith(("running", "starting")):
            raise BenchError(f"job {jid} is {st!r} before its first progress line: "
                             f"{read_text(job_file(cluster, jid, 'stderr'))[-800:]}")
        return "iter " in read_text(job_file(cluster, jid, "stdout"))
    wait_until(first, timeout, f"job {jid}: first progress line", 0.2)


def forget(ckpt, cluster, jid):
    """The job's images everywhere, once it is over (else the disk fills)."""
    for node in cluster.nodes:
        shutil.rmtree(os.path.join(node.dir, "local", jid), ignore_errors=True)
    shutil.rmtree(os.path.join(ckpt.shared, jid), ignore_errors=True)
    if jid in ckpt.jobs:
        ckpt.jobs.remove(jid)


def log_offsets(ckpt, cluster):
    out = {}
    for n in cluster.nodes:
        try:
            out[n.name] = os.path.getsize(os.path.join(ckpt.tmp, f"agent-{n.name}.log"))
        except OSError:
            out[n.name] = 0
    return out


def source_on(ckpt, node, since):
    with open(os.path.join(ckpt.tmp, f"agent-{node.name}.log"), "rb") as f:
        f.seek(since.get(node.name, 0))
        text = ANSI.sub("", f.read().decode(errors="replace"))
    found = [(text.rfind(pat), label) for label, pat in SOURCES if pat in text]
    return max(found)[1] if found else "local"


def cell(ckpt, cluster, args, app, size, scheme, res):
    """Part A for one size and scheme."""
    n = NODES[scheme]
    row = {"size_mib": size, "scheme": scheme, "nodes": n, "restarts": []}
    res["cells"].append(row)
    jid = start_job(ckpt, cluster, n, scheme, size, args.iters, args.sleep_us, app)
    row["job"] = jid
    log(f"{scheme}, {size} MiB per node: job {jid} on {n} nodes")
    try:
        wait_progress(ckpt, cluster, jid)
        p, wall = ckpt.ctl_json("checkpoint", jid, "--kill", "--wait")
        t0 = mono()
        e = json.loads(p.stdout.strip().splitlines()[-1])
        epoch = int(e["epoch"])
        row.update(epoch=epoch, frozen_ms=e.get("frozen_ms"), image_bytes=int(e.get("image_bytes") or 0),
                   checkpoint_wall_ms=wall * 1000.0)

        def protected():
            x = ckpt.epoch(jid, epoch)
            if x.get("storage") == "flush-failed":
                raise BenchError(f"epoch {epoch} flush failed: {x.get('flush_detail')}")
            if scheme == "partner":
                return x.get("partner_copy") is True
            if scheme == "none":
                return x.get("storage") == "durable"
            return x.get("encoded") == scheme
        wait_until(protected, 900, f"job {jid} epoch {epoch} protected under {scheme}", 0.1)
        row["protected_s"] = mono() - t0
        x = wait_until(lambda: (lambda x: x if x.get("storage") == "durable" else None)(
            ckpt.epoch(jid, epoch)), 900, f"job {jid} epoch {epoch} durable", 0.2)
        staged = sum(dir_bytes(os.path.join(node.dir, "local", jid, str(epoch))) for node in cluster.nodes)
        parity_files = sum(dir_bytes(os.path.join(node.dir, "local", jid, str(epoch), "parity"))
                           for node in cluster.nodes)
        row.update(staged_bytes=staged, parity_bytes=int(x.get("parity_bytes") or 0),
                   parity_file_bytes=parity_files,
                   stored_ratio=staged / row["image_bytes"] if row["image_bytes"] else None)
        log(f"  epoch {epoch}: {row['image_bytes'] / 2**20:.1f} MiB of images, protected after "
            f"{row['protected_s']:.1f} s, {row['stored_ratio']:.3f} stored per image byte, "
            f"parity {row['parity_bytes'] / 2**20:.1f} MiB")
        if row["parity_bytes"] != parity_files:
            res["notes"].append(f"{scheme} {size} MiB: parity_bytes {row['parity_bytes']} but the "
                                f"parity files hold {parity_files}")
        stop_job(ckpt, cluster, jid)
        if scheme in RESTART_SCHEMES and not args.no_restart:
            lost = cluster.nodes[LOST - 1]
            spare = cluster.nodes[SPARE - 1]
            shutil.rmtree(os.path.join(lost.dir, "local", jid, str(epoch), lost.name))
            expect = {nd.name: "" for nd in cluster.nodes[:n] if nd is not lost}
            expect[spare.name] = lost.name
            for _ in range(args.repeats):
                time.sleep(args.gap)
                since = log_offsets(ckpt, cluster)
                p, wall = ckpt.ctl_json("restart", jid, "--epoch", str(epoch), "--map",
                                        f"{lost.name}={spare.name}")
                r = json.loads(p.stdout.strip().splitlines()[-1])
                wait_running(ckpt, cluster, jid, expect, timeout=120)
                rec = (ckpt.epoch(jid, epoch).get("restarts") or [{}])[-1]
                got = {"elapsed_ms": float(r["elapsed_ms"]), "wall_ms": wall * 1000.0,
                       "fetch_ms": rec.get("fetch_ms"), "restore_ms": rec.get("restore_ms"),
                       "source": source_on(ckpt, spare, since)}
                row["restarts"].append(got)
                log(f"  restart with {lost.name}'s part on {spare.name}: {got}")
                stop_job(ckpt, cluster, jid)
                shutil.rmtree(os.path.join(spare.dir, "local", jid), ignore_errors=True)
    except BenchError as e:
        row["error"] = str(e)
        res["notes"].append(f"{scheme} {size} MiB: {e}")
        log(f"  FAILED: {e}")
    finally:
        ckpt.cancel(jid, cluster.nodes)
        forget(ckpt, cluster, jid)


def timed_run(ckpt, cluster, args, app, scheme, iters, every):
    """Part B: one run to its end; (wall s, committed epochs, encoded epochs)."""
    t0 = mono()
    jid = start_job(ckpt, cluster, 8, scheme, args.slow_size, iters, 0, app, grid=1024, every=every)
    out = job_file(cluster, jid, "stdout")
    first = {}
    try:
        def result():
            text = read_text(out)
            if "iter " in text:
                first.setdefault("t", mono())
            if "checksum" in text:
                return True
            st = str(ckpt.status(jid).get("state", "running"))
            if st.startswith(("exited", "killed", "lost", "cancelled")):
                raise BenchError(f"job {jid} is {st!r} without a result: "
                                 f"{read_text(job_file(cluster, jid, 'stderr'))[-600:]}")
            return False
        wait_until(result, max(600.0, args.slow_seconds * 4), f"job {jid}'s result", 0.05)
        wall = mono() - t0
        # the iterations after the first progress line (ITERS/20 in), without the start
        steady = (mono() - first["t"]) / (iters - iters // 20) if "t" in first else None
        try:
            wait_until(lambda: not str(ckpt.status(jid).get("state", "")).startswith("running"), 10,
                       f"job {jid} to exit", 0.2)
        except BenchError:
            log(f"job {jid} printed its result but did not exit within 10 s; cancelling it")
        p, _ = ckpt.ctl("--json", "epochs", jid, timeout=30, check=False)
        eps = json.loads(p.stdout) if p.returncode == 0 else []
        committed = [x for x in eps if x.get("state") == "committed"]
        encoded = [x for x in committed if x.get("encoded")]
        return wall, len(committed), len(encoded), steady
    finally:
        ckpt.cancel(jid, cluster.nodes)
        forget(ckpt, cluster, jid)


def slowdown(ckpt, cluster, args, app, res):
    log("B: calibrating the compute-bound job (2000 iterations, no checkpoints)")
    wall, _, _, per_iter = timed_run(ckpt, cluster, args, app, "none", 2000, None)
    if not per_iter:
        raise BenchError("calibration: no progress line before the result")
    iters = max(2000, int(args.slow_seconds / per_iter))
    res["slow"] = {"calibration_wall_s": wall, "iter_ms": per_iter * 1000, "iters": iters, "runs": []}
    log(f"B: {per_iter * 1000:.2f} ms per iteration; {iters} iterations per run")
    for scheme in ["none", *args.slow_schemes.split(","), "none"]:
        w, c, enc, _ = timed_run(ckpt, cluster, args, app, scheme, iters, args.slow_every)
        res["slow"]["runs"].append({"scheme": scheme, "wall_s": w, "checkpoints": c, "encoded": enc})
        log(f"B: {scheme}: {w:.1f} s, {c} checkpoints ({enc} encoded)")


# ---------------------------------------------------------------- report

def render_storage(sizes, schemes, at):
    """Part A's tables."""
    lines = ["### Stored per image byte (A)", "",
              "Bytes in every node's staging for the epoch (images, partner copies, parity) over the "
              "epoch's image bytes, after it is durable; ideal with equal streams in the last column.", ""]
    lines += table_head("scheme", "nodes", *[f"{z} MiB/node" for z in sizes], "ideal")
    for s in schemes:
        vals = []
        for z in sizes:
            c = at(s, z)
            vals.append("–" if not c or c.get("stored_ratio") is None else
                        f"{c['stored_ratio']:.3f} ({c['image_bytes'] / 2**20:,.0f} MiB)")
        lines.append(f"| `{s}` | {NODES[s]} | " + " | ".join(vals) + f" | {IDEAL[s]:.3f} |")
    lines += ["", "### Unprotected after the checkpoint (A)", "",
              "Seconds from `checkpoint --kill --wait` returning until the epoch's redundancy is in "
              "place (`none`: durable in shared storage).", ""]
    lines += table_head("scheme", *[f"{z} MiB/node" for z in sizes])
    for s in schemes:
        vals = [fmt((at(s, z) or {}).get("protected_s"), 1) for z in sizes]
        lines.append(f"| `{s}` | " + " | ".join(vals) + " |")
    lines += ["", f"### Restart with n{LOST} lost, its part on the spare (A)", "",
              "ckptctl's `elapsed_ms` (fetch_ms), median over the repeats; where the spare got the "
              "images, from its agent's log.", ""]
    lines += table_head("scheme", *[f"{z} MiB/node" for z in sizes], "source")
    for s in RESTART_SCHEMES:
        vals, srcs = [], set()
        for z in sizes:
            r = (at(s, z) or {}).get("restarts") or []
            srcs |= {x["source"] for x in r}
            el = med([x["elapsed_ms"] for x in r])
            fe = med([x["fetch_ms"] for x in r if x.get("fetch_ms") is not None])
            vals.append("–" if el is None else f"{el:,.0f} ({fmt(fe)})")
        if any(v != "–" for v in vals):
            lines.append(f"| `{s}` | " + " | ".join(vals) + f" | {', '.join(sorted(srcs))} |")
    return lines


def render(res, args, header):
    lines = [header, ""]
    cells = res["cells"]
    sizes = sorted({c["size_mib"] for c in cells})
    schemes = [s for s in NODES if any(c["scheme"] == s for c in cells)]

    def at(s, z):
        return next((c for c in cells if c["scheme"] == s and c["size_mib"] == z), None)
    if cells:
        lines += render_storage(sizes, schemes, at)
    slow = res.get("slow")
    if slow and len(slow.get("runs", [])) >= 3:
        runs = slow["runs"]
        base = (runs[0]["wall_s"] + runs[-1]["wall_s"]) / 2
        noise = abs(runs[0]["wall_s"] - runs[-1]["wall_s"]) / base * 100
        lines += ["", "### Slowdown while encoding (B)", "",
                  f"8 nodes, {args.slow_size} MiB per rank, `heat 1024 {slow['iters']} 0`, "
                  f"`--every {args.slow_every}`; the two `none` runs differ by {noise:.2f} % "
                  "(the noise floor).", ""]
        lines += table_head("run", "wall s", "checkpoints (encoded)", "overhead vs mean of none",
                            "per checkpoint-minute")
        for i, r in enumerate(runs):
            ov = (r["wall_s"] - base) / base * 100
            per_min = r["checkpoints"] / (r["wall_s"] / 60) if r["checkpoints"] else None
            lines.append(f"| {i + 1}. `{r['scheme']}` | {r['wall_s']:.1f} | {r['checkpoints']} ({r['encoded']}) "
                         f"| {ov:+.2f} % | {'–' if not per_min else f'{ov / per_min:+.2f} %'} |")
    if res["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def machine_header(cmdline, criu, args):
    criu_v, mpich_v, mem = machine_info(criu)
    return (f"## Redundancy schemes side by side, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Machine: nproc {os.cpu_count()}, {mem} MiB RAM, kernel {os.uname().release}, CRIU {criu_v}, "
            f"MPICH {mpich_v}. Eleven test hosts (n1..n10 for jobs, n11 the spare), one rank per node, "
            f"`HEAT_BALLAST_RANDOM=1`; shared storage is a directory on the same disk.\n\n"
            f"Command: `{cmdline}`")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="50,150,500", help="MiB per node (default 50,150,500)")
    ap.add_argument("--schemes", default=",".join(NODES), help="of " + ", ".join(NODES))
    ap.add_argument("--repeats", type=int, default=1, metavar="K", help="restarts per cell (default 1)")
    ap.add_argument("--no-restart", action="store_true", help="skip the restarts of part A")
    ap.add_argument("--no-slowdown", action="store_true", help="skip part B")
    ap.add_argument("--only-slowdown", action="store_true", help="skip part A")
    ap.add_argument("--slow-size", type=int, default=150, help="part B: MiB per rank (default 150)")
    ap.add_argument("--slow-seconds", type=float, default=150.0, help="part B: run length (default 150)")
    ap.add_argument("--slow-every", default="30s", help="part B: checkpoint interval (default 30s)")
    ap.add_argument("--slow-schemes", default="xor:8",
                    help="part B: the schemes run between the two `none` runs (default xor:8)")
    ap.add_argument("--quick", action="store_true", help="50 MiB, partner and xor:8, no part B")
    ap.add_argument("--sleep-us", type=int, default=20000, help="part A's heat sleep per iteration")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds before each restart")
    ap.add_argument("--out", help="also write the markdown report to this file")
    ap.add_argument("--json", metavar="FILE", help="also write every sample as JSON")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    ap.add_argument("--app", default=os.path.join(REPO, "target", "apps", "heat.mpich"))
    ap.add_argument("--criu", default=default_criu())
    ap.add_argument("--node-prefix", default=f"r{TAG}n",
                    help="agents' node names PREFIX1..PREFIX11 (default r<pid%%100000>n)")
    ap.add_argument("--wait-idle", type=float, default=0,
                    help="first wait up to this many seconds until no build or test runs")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args()

    require_root_and_freezer()
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,20}", args.node_prefix):
        sys.exit("--node-prefix: a letter, then at most 20 letters or digits")
    if args.quick:
        args.sizes, args.schemes, args.no_slowdown = "50", "partner,xor:8", True
    sizes = [int(z) for z in args.sizes.split(",") if z]
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in NODES]
    if bad or not sizes or min(sizes) < 1 or args.repeats < 0:
        sys.exit(f"--schemes: of {', '.join(NODES)} (not {bad}); --sizes: MiB > 0; --repeats >= 0")
    # part A's jobs print their first progress line after ITERS/20 iterations (4 s at 20 ms) and
    # are stopped by their checkpoint long before their end (80 s)
    args.iters = 4000
    cmdline = shlex.join([sys.argv[0]] + sys.argv[1:])
    if args.wait_idle > 0:
        wait_idle(busy_processes, args.wait_idle, poll=10)

    tmp = tempfile.mkdtemp(prefix="ckpt-bench-red-")
    log(f"work dir {tmp}; sizes {sizes} MiB per node, schemes {schemes}")
    cluster = Cluster(HOSTS)
    names = [f"{args.node_prefix}{i}" for i in range(1, HOSTS + 1)]
    ckpt = None
    res = {"cells": [], "notes": [], "command": cmdline}
    stop_on_signals()
    t_start = mono()
    sampler = BusySampler(busy_processes)
    sampler.start()
    try:
        if sandbox_netns(names):
            raise BenchError(f"sandbox namespaces of these node names exist already: {sandbox_netns(names)}")
        bindir, app = stage_bins(tmp, args.bin_dir, args.app, extra=("ckpt-init",))
        cluster.create()
        for node, name in zip(cluster.nodes, names):
            node.name = name
        ckpt = RedundancyCkpt(tmp, bindir, args.criu, cluster, names[SPARE - 1])
        ckpt.start()
        try:
            for size in ([] if args.only_slowdown else sizes):
                for scheme in schemes:
                    cell(ckpt, cluster, args, app, size, scheme, res)
            if not args.no_slowdown:
                slowdown(ckpt, cluster, args, app, res)
        except BenchError as e:
            res["error"] = str(e)
            res["notes"].append(f"stopped: {e}")
            log(f"FAILED: {e}")
        took = mono() - t_start
        sampler.stop.set()
        sampler.join(timeout=30)
        table = report_tail(render(res, args, machine_header(cmdline, args.criu, args)), tmp, cluster,
                            sampler, took)
        emit(table, args.out)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 1 if res.get("error") or any(c.get("error") for c in res["cells"]) else 0
    except BenchError as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        teardown(ckpt, sampler, tmp, cluster, args.keep, lambda: remove_sandbox_netns(names))


if __name__ == "__main__":
    sys.exit(main())
