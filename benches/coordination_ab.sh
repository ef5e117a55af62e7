#!/usr/bin/env bash
# Coordination cost of one checkpoint round, before vs after the epoch streams, in one run; then
# the relay tree simulated to 16,384 nodes with the per-message cost measured in that run.
#
# "Before" is commit e615049 (five unary calls per agent per round, a registry fsync per phase);
# "after" is this checkout's HEAD, built from the working tree. The script
#   1. builds the criterion coordination bench of e615049 in a temporary git worktree, into its
#      own CARGO_TARGET_DIR (target/coord-e615049, kept: a later run rebuilds only the workspace
#      crates), and HEAD's coordination and relay_tree benches into ./target; copies the
#      executables into a temporary directory (removed on exit) so that a rebuild during the run
#      changes nothing;
#   2. alternates before and after R rounds (ABBA: before first in odd rounds), each a run of the
#      coordination bench at 16, 256 and 1024 agents (the real coordinator, redb registry and
#      TLS gRPC over loopback, against N no-op agents in a child process on the same 2 cores);
#   3. derives the cost of one message end (encode or decode, TLS, syscall) from the after
#      medians: both processes share the machine's C cores, and each agent adds four message ends
#      per barrier and four barriers per round, so
#          per_message = C x (t(1024) - t(16)) / ((1024 - 16) x 4 x 4);
#      and runs benches/criterion/relay_tree.rs with it (virtual time: the real relay and barrier
#      code over simulated nodes with one CPU each);
#   4. writes the raw outputs and summary.md to benches/results/coordination-<date>/.
#
# Usage: benches/coordination_ab.sh [--rounds R (3)] [--out DIR] [--hop-us H (20)]
# Duration on 2 cores: builds ~5-10 min the first time; each bench run ~40 s; ~5 min for R=3.
# Nothing else heavy should run meanwhile.
set -euo pipefail

BEFORE_REV=e615049
ROUNDS=3
OUT=""
HOP_US=20

cd "$(dirname "$0")/.."
REPO=$PWD

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --rounds) ROUNDS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --hop-us) HOP_US=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument: $1" >&2; usage 2 ;;
    esac
done
OUT=${OUT:-$REPO/benches/results/coordination-$(date +%F)}
mkdir -p "$OUT"

# The executable `cargo bench --no-run` built for bench $1 (JSON messages on stdout).
bench_exe() {
    python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])' "$1"
}

WT=$(mktemp -d)
BIN=$WT/bin
mkdir -p "$BIN"
cleanup() { git -C "$REPO" worktree remove --force "$WT/before" 2>/dev/null || true; rm -rf "$WT"; }
trap cleanup EXIT

log "building $BEFORE_REV (worktree, target/coord-$BEFORE_REV)"
git -C "$REPO" worktree add --detach -q "$WT/before" "$BEFORE_REV"
(cd "$WT/before" && CARGO_TARGET_DIR=$REPO/target/coord-$BEFORE_REV \
    cargo bench --locked -p ckpt-benches --bench coordination --no-run --message-format json 2>/dev/null) \
    | bench_exe coordination | tail -1 | xargs -I{} cp {} "$BIN/coordination-before"
log "building HEAD"
cargo bench --locked -p ckpt-benches --bench coordination --bench relay_tree --no-run --message-format json 2>/dev/null \
    > "$WT/after.json"
bench_exe coordination < "$WT/after.json" | tail -1 | xargs -I{} cp {} "$BIN/coordination-after"
bench_exe relay_tree < "$WT/after.json" | tail -1 | xargs -I{} cp {} "$BIN/relay_tree"
{
    echo "before: $BEFORE_REV"
    echo "after: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates proto benches || echo ' (with uncommitted changes)')"
    echo "cores: $(nproc)"
    echo "date: $(date -Is)"
} > "$OUT/build.txt"

run() { # $1 before|after, $2 round
    log "round $2: $1"
    "$BIN/coordination-$1" --bench --output-format bencher 'coordination_round/(16|256|1024)$' \
        > "$OUT/$1-$2.txt" 2>&1
}
for r in $(seq 1 "$ROUNDS"); do
    if (( r % 2 )); then run before "$r"; run after "$r"; else run after "$r"; run before "$r"; fi
done

python3 - "$OUT" "$(nproc)" "$HOP_US" "$BIN" <<'PY' > "$OUT/summary.md"
import glob, os, re, statistics, subprocess, sys
out, cores, hop, bindir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
BENCH = re.compile(r"test coordination_round/(\d+) \.\.\. bench:\s+([\d,]+) ns/iter")
t = {"before": {}, "after": {}}
for side in t:
    for f in sorted(glob.glob(os.path.join(out, f"{side}-*.txt"))):
        for m in BENCH.finditer(open(f).read()):
            t[side].setdefault(int(m[1]), []).append(int(m[2].replace(",", "")) / 1e6)
med = {s: {n: statistics.median(v) for n, v in t[s].items()} for s in t}
print(open(os.path.join(out, "build.txt")).read())
print("| agents | before | after | after/before | runs |")
print("|---|---|---|---|---|")
for n in sorted(med["after"]):
    b, a = med["before"].get(n), med["after"][n]
    print(f"| {n} | {b:.1f} ms | {a:.1f} ms | {a / b:.2f} | {len(t['after'][n])} |")
per = cores * (med["after"][1024] - med["after"][16]) * 1e3 / ((1024 - 16) * 16)
print(f"\nper message end (derived from the after medians): {per:.1f} us\n")
sim = subprocess.run([os.path.join(bindir, "relay_tree"), "--per-message-us", f"{per:.2f}",
                      "--hop-us", hop], capture_output=True, text=True, check=True).stdout
open(os.path.join(out, "relay_tree.txt"), "w").write(sim)
print(sim)
PY
cat "$OUT/summary.md"
