#!/usr/bin/env bash
# verbs_layer.sh — the cost of libckpt_verbs.so to an unmodified MPI program: MPI ping-pong
# latency (8 B) and bandwidth (1 MiB) between two Open MPI ranks over UCX rc_verbs on soft-RoCE
# (rxe0, one scripts/testvm.sh guest, both ranks on it), the same binary with and without the
# layer preloaded, alternated A B B A per repetition in one guest boot; reports each run and the
# median ratio layer/plain.
#
#   benches/verbs_layer.sh                     full run (~3 min, guest boot included)
#   benches/verbs_layer.sh --out benches/results/verbs-layer-$(date +%F).txt
#
# With --intra-node, both sides run with the layer and compare how two ranks of one node talk:
# through the HCA's loopback (UCX_TLS=rc_verbs,ud_verbs,self, what --rdma gave before) or
# through UCX's shared memory (rc_verbs,ud_verbs,sm,self, what --rdma gives now).
#
# With --profile, after the runs, one more 8-byte run through the layer under `perf record`
# (cpu-clock samples: the guest has no hardware counters) reports where the time goes: the top
# symbols, and the layer's poll_cq by instruction. Under TCG samples gather at the first
# instruction of each translated block, so read them as "after this call or branch".
#
# Options: --reps R (3: ABBA blocks)  --lat-iters N (2000)  --bw-iters N (50)  --timeout S (900)
# --intra-node  --profile  --no-build  --out FILE  --bin DIR (libckpt_verbs.so; $REPO/target/release)
# --apps DIR (pingpong.openmpi; $REPO/target/apps): with --no-build, binaries another tree built.
# Needs root, QEMU and a prepared test VM (scripts/setup.sh --vm). The guest runs under QEMU
# TCG: absolute times are far from hardware; read the ratios.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPS=3 LAT=2000 BW=50 TIMEOUT=900 BUILD=1 OUT= A=plain B=layer PROFILE=
BIN=$REPO/target/release APPS=$REPO/target/apps
while [ $# -gt 0 ]; do
    case "$1" in
        --reps) REPS=$2; shift ;;
        --lat-iters) LAT=$2; shift ;;
        --bw-iters) BW=$2; shift ;;
        --timeout) TIMEOUT=$2; shift ;;
        --no-build) BUILD= ;;
        --intra-node) A=layer B=layer-sm ;;
        --profile) PROFILE=1 ;;
        --out) OUT=$2; shift ;;
        --bin) BIN=$(cd "$2" && pwd); shift ;;
        --apps) APPS=$(cd "$2" && pwd); shift ;;
        -h|--help) sed -n 2,24p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "verbs_layer: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
NAME=verbs_layer
. "$REPO/benches/vmbench.sh"
if [ -n "$BUILD" ]; then
    log "building libckpt_verbs.so and the ping-pong (release)"
    (cd "$REPO" && cargo build --release -p ckpt-verbs) >&2
    make -s -C "$REPO/tests/apps" OUT="$REPO/target/apps" "$REPO/target/apps/pingpong.openmpi" >&2
fi
LIB=$BIN/libckpt_verbs.so APP=$APPS/pingpong.openmpi
[ -f "$LIB" ] && [ -x "$APP" ] || die "missing $LIB or $APP (drop --no-build)"

TMP=$(mktemp -d /tmp/verbs_layer.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
cat > "$TMP/guest.sh" <<GUEST
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MCA="--mca pml ucx --mca pml_ucx_devices any --mca pml_ucx_tls any --mca btl ^openib,ofi --mca mtl ^ofi --mca osc ^ucx"
UCX="-x UCX_NET_DEVICES=rxe0:1 -x UCX_UD_VERBS_ETH_DGID_CHECK=n -x UCX_MODULES=^rdmacm"
one() { # plain|layer|layer-sm BYTES ITERS
    local pre="" tls=rc_verbs,ud_verbs,self
    case "\$1" in layer) pre="-x LD_PRELOAD=$LIB" ;; layer-sm) pre="-x LD_PRELOAD=$LIB" tls=rc_verbs,ud_verbs,sm,self ;; esac
    timeout 300 mpirun --oversubscribe -np 2 \$MCA \$UCX -x UCX_TLS=\$tls \$pre $APP \$2 \$3 2>&1 | sed -n "s/^pingpong /RUN \$1 /p"
}
for r in \$(seq $REPS); do
    for mode in $A $B $B $A; do one \$mode 8 $LAT; one \$mode 1048576 $BW; done
done
if [ -n "$PROFILE" ]; then
    cd /tmp
    perf record -q -F 2000 -e cpu-clock -o /tmp/perf.layer -- mpirun --oversubscribe -np 2 \$MCA \$UCX \
        -x UCX_TLS=rc_verbs,ud_verbs,self -x LD_PRELOAD=$LIB $APP 8 $LAT 2>&1 | sed -n "s/^pingpong /PROFILED /p"
    perf report -i /tmp/perf.layer --no-children --sort dso,symbol --stdio 2>/dev/null \
        | grep -v '^#' | grep -v '^\$' | head -n 25 | sed 's/^/PERF /'
    perf annotate -i /tmp/perf.layer --stdio -s ckpt_verbs::fastpath::poll_cq 2>/dev/null \
        | grep -E '^ +[0-9]+\.[0-9]+ :' | grep -v '^ *0\.00 :' | sort -rn | head -n 15 | sed 's/^/POLL_CQ /'
fi
GUEST
log "booting the guest ($REPS ABBA blocks)"
"$REPO/scripts/testvm.sh" run "$TMP/guest.sh" name=vlbench mem=2048 timeout="$TIMEOUT" > "$TMP/console" 2>&1 \
    || { tail -40 "$TMP/console" >&2; die "guest run failed"; }
tr -d '\r' < "$TMP/console" > "$TMP/console.txt"
grep "^RUN " "$TMP/console.txt" > "$TMP/runs" || die "no results: $(tail -20 "$TMP/console.txt")"
report() {
    echo "# $B vs $A: Open MPI ping-pong between two ranks of one QEMU TCG guest, UCX on rxe0 (layer-sm: shared memory)"
    echo "# $(date -u +%FT%TZ) $(git -C "$REPO" rev-parse --short HEAD) reps=$REPS (ABBA) lat-iters=$LAT bw-iters=$BW"
    echo "# layer $LIB ($(date -u -r "$LIB" +%FT%TZ)) app $APP"
    cat "$TMP/runs"
    grep -E '^(PROFILED|PERF|POLL_CQ) ' "$TMP/console.txt" | sed 's/ *- *- *$//' || true
    python3 - "$TMP/runs" "$A" "$B" <<'PY'
import sys, statistics
rows = [l.split() for l in open(sys.argv[1])]
a, b = sys.argv[2], sys.argv[3]
def vals(mode, size, key):
    return [float(r[r.index(key) + 1]) for r in rows if r[1] == mode and r[3] == size]
for size, key, name in (("8", "latency_us", "latency 8 B (us)"), ("1048576", "bandwidth_MBps", "bandwidth 1 MiB (MB/s)")):
    p, l = vals(a, size, key), vals(b, size, key)
    if not p or not l:
        print(f"{name}: missing runs"); continue
    mp, ml = statistics.median(p), statistics.median(l)
    ratio = ml / mp if key == "latency_us" else mp / ml
    print(f"{name}: {a} median {mp:.2f}, {b} median {ml:.2f}, cost ratio {b}/{a} {ratio:.3f}")
    # The best run of each mode: the guest's times spread over 2x from run to run (the
    # emulated vCPUs share 2 host cores with QEMU's own threads), and the best is the least
    # disturbed.
    bp, bl = (min(p), min(l)) if key == "latency_us" else (max(p), max(l))
    ratio = bl / bp if key == "latency_us" else bp / bl
    print(f"{name}: {a} best {bp:.2f}, {b} best {bl:.2f}, cost ratio {b}/{a} {ratio:.3f}")
PY
}
if [ -n "$OUT" ]; then report | tee "$OUT"; else report; fi
