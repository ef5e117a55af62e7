#!/usr/bin/env bash
# ibq_rxe.sh — ib-quiesce on real verbs: quiesce / rebuild / reconnect latency against the number
# of QPs and MRs per channel (1 … 256), and the cost of the Channel post/poll path against raw
# verbs (ratio, same run), on soft-RoCE (rxe0) in one scripts/testvm.sh guest.
#
# What runs: crates/ib-quiesce/examples/ibq_bench/ (see its header for the exact method), built
# in release on the host and started inside the guest, which sees the host's root file system
# read-only. Both ends of every connection are in that one process on rxe0 (loopback).
#
#   benches/ibq_rxe.sh                         full run (~1 min, guest boot included), report on stdout
#   benches/ibq_rxe.sh --out benches/results/ibq-rxe-$(date +%F).txt
#   benches/ibq_rxe.sh --quick                 sizes 1,4 and 2000 writes (a smoke test, ~30 s)
#
# Options: --sizes LIST (1,4,16,64,256)  --ops K (20000)  --reps R (3, post/poll repetitions)
# --noop K (1000000: writes per path of the host-side no-op-backend run, the layer's CPU cost)
# --timeout S (900, whole guest boot-run-poweroff)  --no-build  --out FILE  --keep-console FILE
# Needs root, QEMU and a prepared test VM (scripts/setup.sh --vm). No network is used: the guest
# has only QEMU's user-mode NIC, which rxe0 sits on. Every wait is bounded by --timeout; the
# guest (and QEMU) end with the script or are killed by testvm.sh's timeout.
#
# The guest runs under QEMU TCG (no KVM) on the host's cores: absolute times are far slower than
# hardware; read the ratio and the growth with n.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SIZES=1,4,16,64,256 OPS=20000 NOOP=1000000 REPS=3 TIMEOUT=900 BUILD=1 OUT= KEEP=
ARGS="$*"
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) SIZES=1,4 OPS=2000 NOOP=100000 ;;
        --sizes) SIZES=$2; shift ;;
        --ops) OPS=$2; shift ;;
        --noop) NOOP=$2; shift ;;
        --reps) REPS=$2; shift ;;
        --timeout) TIMEOUT=$2; shift ;;
        --no-build) BUILD= ;;
        --out) OUT=$2; shift ;;
        --keep-console) KEEP=$2; shift ;;
        -h|--help) sed -n 2,22p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "ibq_rxe: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done

log() { echo "ibq_rxe: $*" >&2; }
die() { log "$*"; exit 2; }

[ "$(id -u)" = 0 ] || die "needs root (QEMU guest with the host root shared)"
command -v qemu-system-x86_64 >/dev/null || die "needs qemu-system-x86_64 (scripts/setup.sh --vm)"
[ -f "${CKPT_VM_DIR:-/var/cache/ckpt-vm}/abi" ] || die "no test VM prepared (scripts/setup.sh --vm)"

if [ -n "$BUILD" ]; then
    log "building the example (release)"
    (cd "$REPO" && cargo build --release -p ib-quiesce --example ibq_bench) >&2
fi
BIN=$REPO/target/release/examples/ibq_bench
[ -x "$BIN" ] || die "$BIN is missing (drop --no-build)"

TMP=$(mktemp -d /tmp/ibq_rxe.XXXXXX)
MON=
trap '[ -z "$MON" ] || kill "$MON" 2>/dev/null || true; rm -rf "$TMP"' EXIT
cat > "$TMP/guest.sh" <<EOF
set -u
echo "GUEST kernel \$(uname -r), \$(nproc) vCPUs, \$(awk '/MemTotal/ {print int(\$2/1024)}' /proc/meminfo) MiB"
ibv_devinfo -d rxe0 -v 2>/dev/null | grep -E '^\s*(max_qp|max_mr|max_cq|max_cqe|max_qp_wr|state):' \\
    | sed 's/^\s*/GUEST rxe0 /' | tr -s '\t ' ' '
timeout $((TIMEOUT - 60)) "$BIN" --sizes "$SIZES" --ops "$OPS" --reps "$REPS"
rc=\$?
echo "GUEST ibq_bench exit \$rc"
exit \$rc
EOF

# The channel layer's own CPU cost, natively on the host (no device: a no-op verbs backend).
log "host: channel layer cost on a no-op backend ($NOOP writes per path × $REPS)"
timeout 300 "$BIN" --noop "$NOOP" --reps "$REPS" > "$TMP/noop" 2>&1 || log "the no-op run failed"

LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
START=$(date '+%F %H:%M')
BEGIN=$SECONDS
log "booting a guest (QEMU TCG; boot ≈ 20 s), sizes $SIZES, $OPS writes × $REPS"
# Other QEMU guests (other test runs) share the cores and distort every number: count them, once
# a second, for the report.
OTHERS=$(pgrep -xc qemu-system-x86 || true)
[ "$OTHERS" = 0 ] || log "warning: $OTHERS other QEMU guest(s) running; the numbers will be noisy"
( while sleep 1; do echo $(( $(pgrep -xc qemu-system-x86 || true) - 1 )); done > "$TMP/others" ) &
MON=$!
rc=0
"$REPO/scripts/testvm.sh" run "$TMP/guest.sh" name=ibqbench mem=2048 "timeout=$TIMEOUT" \
    > "$TMP/console" 2>&1 || rc=$?
WALL=$((SECONDS - BEGIN))
kill "$MON" 2>/dev/null || true; wait "$MON" 2>/dev/null || true; MON=
MAXOTHERS=$(sort -n "$TMP/others" | tail -1); MAXOTHERS=$(( ${MAXOTHERS:-0} > OTHERS ? ${MAXOTHERS:-0} : OTHERS ))
tr -d '\r' < "$TMP/console" > "$TMP/console.txt"
[ -z "$KEEP" ] || cp "$TMP/console.txt" "$KEEP"

{
    echo "## ib-quiesce on soft-RoCE: quiesce/rebuild latency and post/poll overhead, $START"
    echo
    echo "Command: \`benches/ibq_rxe.sh${ARGS:+ $ARGS}\` (git $(cd "$REPO" && git rev-parse --short HEAD 2>/dev/null || echo ?)$(cd "$REPO" && git diff --quiet HEAD -- crates/ib-quiesce 2>/dev/null || echo ', ib-quiesce with local changes'))"
    echo "Host: nproc $(nproc), $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) MiB RAM, kernel $(uname -r), $(qemu-system-x86_64 --version | head -1), load average before the run $LOAD; other QEMU guests running during the run: at most $MAXOTHERS."
    echo "Guest: scripts/testvm.sh run (QEMU TCG, no KVM), mem=2048, cpus=2; soft-RoCE rxe0 on virtio-net; both ends of every connection in one process on rxe0."
    grep -E '^GUEST ' "$TMP/console.txt" | sed 's/^GUEST /  /' || true
    echo
    echo "Method: crates/ib-quiesce/examples/ibq_bench/. Per n: channels A and B, each n MRs (4 KiB each; plus the channel's own control MR), one CQ, n RC QPs (16/16/1), QP i of A ↔ QP i of B, 2 receives per QP kept across every quiesce. Repeated R times: quiesce A ‖ B (two threads), rebuild A ‖ B, reconnect A ‖ B; each step counts the slower side; an untimed RDMA write per QP checks the reconnected pairs. In every repetition the same objects also go through raw verbs (Rdma, no channel): create, connect + post receives, release, both sides at once (alternately before and after the channel cycle). Post/poll: K signalled 64-byte RDMA writes per path and repetition, each polled to completion before the next, raw Rdma vs Channel, interleaved in 20 blocks of K/20 (ABBA order)."
    echo
    echo "Raw lines (REP: one repetition; BENCH: results):"
    echo
    echo '```'
    grep -E '^(BENCH|REP) ' "$TMP/console.txt" || echo "(none)"
    echo '```'
    echo
    echo "Host, no device (\`ibq_bench --noop $NOOP\`: the same post/poll loop on a no-op verbs backend, directly and through a Channel pair, interleaved; the Channel layer's own CPU cost in native ns):"
    echo
    echo '```'
    grep -E '^(BENCH|REP) ' "$TMP/noop" || cat "$TMP/noop"
    echo '```'
    echo
    echo "Tables (sweep: median (min) over the repetitions, ms; post/poll: ns per write):"
    echo
    TABLES=$(sed -n '/^--- tables$/,/^--- end$/p' "$TMP/console.txt" | sed '1d;$d')
    echo "${TABLES:-(none)}"
    echo
    echo "Guest status $rc; wall time $WALL s including boot and power-off."
} > "$TMP/report"

if [ "$rc" != 0 ]; then
    log "guest failed (status $rc); last console lines:"
    tail -n 40 "$TMP/console.txt" >&2
fi
cat "$TMP/report"
if [ -n "$OUT" ]; then
    mkdir -p "$(dirname "$OUT")"
    cp "$TMP/report" "$OUT"
    log "wrote $OUT"
fi
exit "$rc"
