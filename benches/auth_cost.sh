#!/usr/bin/env bash
# Cost of authentication (mutual TLS between ckptd and the agents, authorization on every RPC),
# before vs after, measured in one run on the same machine.
#
# "Before" is commit a2ee541, the last commit without TLS; "after" is this checkout's HEAD (built
# from the working tree: uncommitted changes to crates/, proto/ or benches/ are recorded in
# build.txt and warned about). The script
#   1. creates a git worktree of a2ee541 in a temp dir (removed on exit) and builds it with
#      `cargo build --release` and `cargo bench --no-run` into its own CARGO_TARGET_DIR
#      (target/auth-cost-a2ee541, kept: a later run rebuilds only the workspace crates); builds
#      HEAD the same way into ./target; copies both sets of binaries into the temp dir, so that a
#      rebuild during the run changes nothing;
#   2. alternates before and after, R rounds (order ABBA: before first in odd rounds, after first
#      in even ones), for
#      a. the criterion coordination bench (`cargo bench -p ckpt-benches --bench coordination`,
#         run as the executable that command builds, filtered to 16, 256 and 1024 agents): one
#         checkpoint round of the real coordinator over N no-op agents on loopback. Before: plain
#         gRPC; after: TLS with client certificates, authorization on every call;
#      b. benches/multinode_vs_criu.py --nodes 2: the 4-rank heat job on 2 namespace nodes, K
#         `ckptctl checkpoint --wait` interleaved with raw CRIU dumps of the same job (the raw
#         frozen time is a control: it should not change). Before: --no-tls (old-style configs,
#         no CA); after: CA, enrolled agents;
#   3. writes every raw output to benches/results/auth_cost-<date>/ and prints a table (also in
#      summary.md there): medians and after/before ratios for the round at 16/256/1024 agents
#      and for the 4-rank job's checkpoint (frozen_ms, total_ms, ckptctl wall).
#
# Usage (root; what benches/multinode_vs_criu.py needs: Debian 12, cgroup v1 freezer, CRIU >= 4.2,
# MPICH, iproute2, nsenter; cargo):
#     benches/auth_cost.sh [--rounds R (3)] [--repeats K (6)] [--out DIR] [--criu PATH]
#                          [--wait-idle S (0: first wait at most S s until no cargo/rustc/test runs)]
#     benches/auth_cost.sh --summarize DIR      # only the table, from the raw outputs in DIR
#
# Duration on 2 cores with the defaults: ~10 min of measurements (each coordination run ~45 s,
# each multinode run ~45 s, 2 x 2 x R of them), plus the builds: ~10-15 min the first time
# (a2ee541 from scratch), ~3-5 min on later runs; under ~25 min in all. Nothing else heavy should
# run meanwhile (builds, the test suite): the multinode runs flag what they see in their .md files.
set -euo pipefail

BEFORE_REV=a2ee541
NS_LIST="16 256 1024"
ROUNDS=3
REPEATS=6
OUT=""
CRIU=()
WAIT_IDLE=0
SUMMARIZE=""

cd "$(dirname "$0")/.."
REPO=$PWD

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --rounds) ROUNDS=$2; shift 2 ;;
        --repeats) REPEATS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --criu) CRIU=(--criu "$2"); shift 2 ;;
        --wait-idle) WAIT_IDLE=$2; shift 2 ;;
        --summarize) SUMMARIZE=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument: $1" >&2; usage 2 ;;
    esac
done

# The table: medians before/after and their ratio, from the raw outputs in $1.
summarize() {
    python3 - "$1" "$NS_LIST" <<'PY'
import glob, json, os, re, statistics, sys

out, ns = sys.argv[1], [int(n) for n in sys.argv[2].split()]
med = lambda xs: statistics.median(xs) if xs else None
meta = {}
for line in open(os.path.join(out, "build.txt")) if os.path.exists(os.path.join(out, "build.txt")) else []:
    k, _, v = line.partition(": ")
    meta[k] = v.strip()

# criterion --output-format bencher: "test coordination_round/16 ... bench:   7,123,456 ns/iter (+/- 12,345)"
BENCH = re.compile(r"test coordination_round/(\d+) \.\.\. bench:\s+([\d,]+) ns/iter")
coord = {s: {n: [] for n in ns} for s in ("before", "after")}
pairs = {n: {} for n in ns}  # round -> {side: ms}, for the per-round ratios
for path in sorted(glob.glob(os.path.join(out, "coordination-*-r*.txt"))):
    side, rnd = re.search(r"coordination-(before|after)-r(\d+)\.txt$", path).groups()
    for m in BENCH.finditer(open(path).read()):
        n, ms = int(m.group(1)), int(m.group(2).replace(",", "")) / 1e6
        if n in coord[side]:
            coord[side][n].append(ms)
            pairs[n].setdefault(rnd, {})[side] = ms

job = {s: {"frozen": [], "total": [], "ctl_wall": [], "raw_frozen": []} for s in ("before", "after")}
for path in sorted(glob.glob(os.path.join(out, "multinode-*-r*.json"))):
    side = re.search(r"multinode-(before|after)-r\d+\.json$", path).group(1)
    r = json.load(open(path))["nodes"].get("2", {})
    for key in job[side]:
        job[side][key] += [float(x) for x in r.get(key, [])]

def cell(v, nd=1):
    return "–" if v is None else f"{v:,.{nd}f}"

def ratio(a, b):
    return "–" if a is None or not b else f"{a / b:.3f}"

rows = []
for n in ns:
    b, a = med(coord["before"][n]), med(coord["after"][n])
    per = sorted(p["after"] / p["before"] for p in pairs[n].values() if "after" in p and "before" in p)
    spread = f"{per[0]:.3f}–{per[-1]:.3f}" if per else "–"
    rows.append(f"| coordination round, {n} agents (ms) | {cell(b)} | {cell(a)} | **{ratio(a, b)}** "
                f"| {spread} | {len(coord['before'][n])}/{len(coord['after'][n])} runs |")
for key, what in (("frozen", "4-rank job checkpoint: frozen_ms"), ("total", "4-rank job checkpoint: total_ms"),
                  ("ctl_wall", "4-rank job checkpoint: ckptctl wall (ms)"),
                  ("raw_frozen", "control: raw CRIU frozen, same job (ms)")):
    b, a = med(job["before"][key]), med(job["after"][key])
    rng = lambda xs: f"{min(xs):,.0f}–{max(xs):,.0f}" if xs else "–"
    rows.append(f"| {what} | {cell(b, 0)} | {cell(a, 0)} | **{ratio(a, b)}** "
                f"| {rng(job['before'][key])} / {rng(job['after'][key])} "
                f"| {len(job['before'][key])}/{len(job['after'][key])} samples |")
print(f"## Cost of authentication: {meta.get('before', 'a2ee541')} (no TLS) vs {meta.get('after', 'HEAD')} (mutual TLS)\n")
print(f"{meta.get('machine', '')}  Rounds: {meta.get('rounds', '?')} (ABBA order), K={meta.get('repeats', '?')} "
      "checkpoints per multinode run. Coordination: criterion's median per run, median over runs; "
      "spread = lowest–highest after/before ratio of the runs of one round. 4-rank job: median over "
      "all samples of all runs (spread = min–max before / after).\n")
print("| measurement | before | after | after/before | spread | n (before/after) |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
if meta.get("dirty"):
    print(f"\nWARNING: HEAD was built with uncommitted changes: {meta['dirty']}")
fails = os.path.join(out, "failures.txt")
if os.path.exists(fails) and open(fails).read().strip():
    print("\nFailed runs (see their logs):\n\n" + "".join(f"    {l}" for l in open(fails)))
PY
}

if [[ -n $SUMMARIZE ]]; then
    summarize "$SUMMARIZE"
    exit 0
fi

[[ $(id -u) -eq 0 ]] || { echo "must run as root (benches/multinode_vs_criu.py: CRIU, cgroups, namespaces)" >&2; exit 2; }
[[ $ROUNDS =~ ^[1-9][0-9]*$ && $REPEATS =~ ^[1-9][0-9]*$ ]] || { echo "--rounds and --repeats: positive integers" >&2; exit 2; }
export PATH="$HOME/.cargo/bin:$PATH"
git -C "$REPO" rev-parse --verify -q "$BEFORE_REV^{commit}" >/dev/null \
    || { echo "commit $BEFORE_REV is not in this repository" >&2; exit 2; }
if [[ -z $OUT ]]; then
    OUT=$REPO/benches/results/auth_cost-$(date +%F)
    [[ -e $OUT ]] && OUT=$OUT-$(date +%H%M)
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

WORK=$(mktemp -d /tmp/ckpt-auth-cost.XXXXXX)
cleanup() {
    if [[ -d $WORK/before ]]; then
        git -C "$REPO" worktree remove --force "$WORK/before" || true
    fi
    git -C "$REPO" worktree prune || true
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- build

# The coordination bench executable `cargo bench --no-run` builds (in the current directory).
bench_exe() {
    cargo bench --locked -p ckpt-benches --bench coordination --no-run --message-format=json \
        | python3 -c 'import json, sys
exe = [m["executable"] for m in map(json.loads, sys.stdin)
       if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "coordination" and m.get("executable")]
print(exe[-1] if exe else "")'
}

# Builds the checkout in $1 with CARGO_TARGET_DIR $2 and copies its binaries to $3.
build() {
    local src=$1 target=$2 bin=$3 exe
    log "building $src (CARGO_TARGET_DIR $target)"
    (cd "$src" && CARGO_TARGET_DIR=$target cargo build --release --locked --workspace) >>"$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log" >&2; exit 1; }
    exe=$(cd "$src" && CARGO_TARGET_DIR=$target bench_exe 2>>"$OUT/build.log") || true
    [[ -x $exe ]] || { tail -30 "$OUT/build.log" >&2; echo "no coordination bench executable" >&2; exit 1; }
    mkdir -p "$bin"
    for b in ckptd ckptctl ckpt-agent ckpt-rsh; do
        cp -p "$target/release/$b" "$bin/"
    done
    cp -p "$exe" "$bin/coordination"
}

BEFORE_TARGET=$REPO/target/auth-cost-$BEFORE_REV
git -C "$REPO" worktree add --detach "$WORK/before" "$BEFORE_REV" >>"$OUT/build.log" 2>&1
build "$WORK/before" "$BEFORE_TARGET" "$WORK/bin-before"
build "$REPO" "${CARGO_TARGET_DIR:-$REPO/target}" "$WORK/bin-after"
make -s -C "$REPO/tests/apps" OUT="$WORK/apps" "$WORK/apps/heat.mpich" >>"$OUT/build.log" 2>&1

DIRTY=$(git -C "$REPO" status --porcelain -- crates proto benches Cargo.toml Cargo.lock | grep -v '^??' | awk '{print $2}' | tr '\n' ' ' || true)
{
    echo "before: $(git -C "$REPO" rev-parse --short=12 "$BEFORE_REV")"
    echo "after: $(git -C "$REPO" rev-parse --short=12 HEAD)"
    echo "dirty: $DIRTY"
    echo "machine: nproc $(nproc), kernel $(uname -r), $(date '+%F %H:%M')."
    echo "rounds: $ROUNDS"
    echo "repeats: $REPEATS"
} >"$OUT/build.txt"
[[ -z $DIRTY ]] || log "WARNING: HEAD built with uncommitted changes in: $DIRTY"

# ---------------------------------------------------------------- measure

busy() {  # heavy processes that would disturb the measurement (builds, test binaries, CI)
    ps -eo pid=,comm= | awk '$2 ~ /^(cargo|rustc)$|^single_node-|^multi_node-/ {print $1 "/" $2}' | tr '\n' ' '
}
if [[ $WAIT_IDLE -gt 0 ]]; then
    deadline=$((SECONDS + WAIT_IDLE))
    while [[ -n $(busy) && $SECONDS -lt $deadline ]]; do
        log "waiting for other work to finish: $(busy)"
        sleep 10
    done
fi

FILTER="^coordination_round/($(tr ' ' '|' <<<"$NS_LIST"))\$"
coordination() {  # side round
    local f=$OUT/coordination-$1-r$2 rc=0
    log "coordination bench, $1, round $2"
    echo "busy at start: $(busy); load $(cut -d' ' -f1-3 /proc/loadavg)" >"$f.log"
    (cd "$WORK" && CRITERION_HOME=$WORK/criterion-$1 "$WORK/bin-$1/coordination" --bench --noplot \
        --output-format bencher "$FILTER" >"$f.txt" 2>>"$f.log") || rc=$?
    [[ $rc -eq 0 ]] || echo "coordination-$1-r$2 (exit $rc, see $f.log)" >>"$OUT/failures.txt"
}
multinode() {  # side round
    local f=$OUT/multinode-$1-r$2 tls=() rc=0
    if [[ $1 == before ]]; then tls=(--no-tls); fi  # the binaries predate authentication
    log "multinode_vs_criu.py --nodes 2, $1, round $2"
    python3 "$REPO/benches/multinode_vs_criu.py" --nodes 2 --repeats "$REPEATS" \
        --bin-dir "$WORK/bin-$1" --app "$WORK/apps/heat.mpich" "${CRIU[@]}" "${tls[@]}" \
        --out "$f.md" --json "$f.json" >/dev/null 2>"$f.log" || rc=$?
    [[ $rc -eq 0 ]] || echo "multinode-$1-r$2 (exit $rc, see $f.log)" >>"$OUT/failures.txt"
}

t0=$SECONDS
for r in $(seq "$ROUNDS"); do
    if (( r % 2 )); then order="before after"; else order="after before"; fi
    for side in $order; do coordination "$side" "$r"; done
    for side in $order; do multinode "$side" "$r"; done
    log "round $r of $ROUNDS done ($(( (SECONDS - t0) / 60 )) min so far)"
done

summarize "$OUT" | tee "$OUT/summary.md"
log "raw outputs and summary.md in $OUT"
