#!/usr/bin/env bash
# precopy_storage.sh — peak write bandwidth to storage during the checkpoints of a 3-node job,
# without pre-copy and with staggered pre-copy (issue 17: target, peak halved), and the bytes
# each epoch writes (checkpoint vs pre-dumps), in one scripts/testvm.sh guest (whose kernel
# tracks written pages; this host's does not). Three test nodes (network + UTS namespaces, an
# agent each, one ckptd; set up by benches/multinode_vs_criu.py) run one job, mpiexec.mpich
# with one tests/apps/memwrite of MIB MiB per node rewriting PCT % per step; per mode (precopy,
# then none at the same period) a warm-up and K checkpoints, while a thread samples the bytes
# under every node's staging (pre-dumps included) every 50 ms. Reports per epoch and a table
# of both modes with the ratio precopy/none. The guest part is benches/guest/precopy_storage.py.
#
#   benches/precopy_storage.sh --no-build     one run (~10 min, boot included)
#   benches/precopy_storage.sh --no-build --out benches/results/precopy_storage-$(date +%F).txt
#
# Options: --mib MIB (160: per node)  --pct P (2: % rewritten per step)  --k K (3)
# --sleep MS (1000: per step)  --first-after S (10)  --stagger S (3): [precopy] of the agents
# (the first pre-dump comes first_after + k * stagger after part k's checkpoint ended)
# --shared (also flush every epoch to a shared dir, reported apart)  --mem MIB (5120: guest
# memory; staging is a 3 GiB tmpfs in it)  --timeout S (2400)  --no-build  --out FILE
# --bin DIR (ckptd, ckptctl, ckpt-agent, ckpt-rsh; $REPO/target/release)
# --apps DIR (memwrite; $REPO/target/apps): with --no-build, binaries another tree built.
# Needs root, QEMU and a prepared test VM (scripts/setup.sh --vm). The guest runs under QEMU
# TCG: absolute bandwidths are far from hardware; read the ratios.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MIB=160 PCT=2 K=3 SLEEP=1000 FIRST=10 STAGGER=3 SHARED= MEM=5120 TIMEOUT=2400 BUILD=1 OUT=
BIN=$REPO/target/release APPS=$REPO/target/apps
ARGS="$*"
while [ $# -gt 0 ]; do
    case "$1" in
        --mib) MIB=$2; shift ;;
        --pct) PCT=$2; shift ;;
        --k) K=$2; shift ;;
        --sleep) SLEEP=$2; shift ;;
        --first-after) FIRST=$2; shift ;;
        --stagger) STAGGER=$2; shift ;;
        --shared) SHARED=--shared ;;
        --mem) MEM=$2; shift ;;
        --timeout) TIMEOUT=$2; shift ;;
        --no-build) BUILD= ;;
        --out) OUT=$2; shift ;;
        --bin) BIN=$(cd "$2" && pwd); shift ;;
        --apps) APPS=$(cd "$2" && pwd); shift ;;
        -h|--help) sed -n 2,23p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "precopy_storage: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
NAME=precopy_storage
. "$REPO/benches/vmbench.sh"
prepare_memwrite_bench "$BIN/ckptd" "$BIN/ckptctl" "$BIN/ckpt-agent" "$BIN/ckpt-rsh" "$APPS/memwrite"

TMP=$(mktemp -d /tmp/precopy_storage.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
printf 'exec python3 %q --guest-setup --bin %q --app %q --criu %q --mib %q --pct %q --k %q --sleep-ms %q --first-after %q --stagger %q %s\n' \
    "$REPO/benches/guest/precopy_storage.py" "$BIN" "$APPS/memwrite" "$CRIU" "$MIB" "$PCT" "$K" \
    "$SLEEP" "$FIRST" "$STAGGER" "$SHARED" > "$TMP/guest.sh"
run_guest psbench "3 nodes x $MIB MiB, $PCT % per step, $K checkpoints per mode"

report() {
    report_head
    echo
    grep -E '^(RUN|PRE)' "$TMP/console.txt"
    echo
    grep '^REPORT' "$TMP/console.txt" | sed 's/^REPORT \{0,1\}//'
}
if [ -n "$OUT" ]; then report | tee "$OUT"; else report; fi
