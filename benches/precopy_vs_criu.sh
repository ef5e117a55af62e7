#!/usr/bin/env bash
# precopy_vs_criu.sh — how long a checkpoint with pre-copy freezes a job, against a raw full
# `criu dump` of the same job: tests/apps/memwrite holding MIB MiB (512) and rewriting P % of it
# per step (P = 1, 10, 50), in one scripts/testvm.sh guest (whose kernel tracks written pages;
# this host's does not). Per P: K raw dumps (freeze, dump, thaw), then K ckpt checkpoints, each
# after a pre-dump and one rewrite step; reports each dump, the medians, and the ratio ckpt/criu
# of frozen time and of bytes written while frozen. The guest part is
# benches/guest/precopy_vs_criu.sh.
#
#   benches/precopy_vs_criu.sh --no-build     one run (~15 min, boot included)
#   benches/precopy_vs_criu.sh --no-build --out benches/results/precopy-$(date +%F).txt
#
# Options: --mib MIB (512)  --pcts "P ..." ("1 10 50")  --k K (3)  --mem MIB (6144: guest memory;
# staging is a 4 GiB tmpfs in it)  --timeout S (2400)  --no-build  --out FILE
# --bin DIR (ckptd, ckptctl, ckpt-agent; $REPO/target/release)
# --apps DIR (memwrite; $REPO/target/apps): with --no-build, binaries another tree built.
# Needs root, QEMU and a prepared test VM (scripts/setup.sh --vm). The guest runs under QEMU
# TCG: absolute times are far from hardware; read the ratios.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MIB=512 PCTS="1 10 50" K=3 MEM=6144 TIMEOUT=2400 BUILD=1 OUT=
BIN=$REPO/target/release APPS=$REPO/target/apps
ARGS="$*"
while [ $# -gt 0 ]; do
    case "$1" in
        --mib) MIB=$2; shift ;;
        --pcts) PCTS=$2; shift ;;
        --k) K=$2; shift ;;
        --mem) MEM=$2; shift ;;
        --timeout) TIMEOUT=$2; shift ;;
        --no-build) BUILD= ;;
        --out) OUT=$2; shift ;;
        --bin) BIN=$(cd "$2" && pwd); shift ;;
        --apps) APPS=$(cd "$2" && pwd); shift ;;
        -h|--help) sed -n 2,20p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "precopy_vs_criu: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
NAME=precopy_vs_criu
. "$REPO/benches/vmbench.sh"
prepare_memwrite_bench "$BIN/ckptd" "$BIN/ckptctl" "$BIN/ckpt-agent" "$APPS/memwrite"

TMP=$(mktemp -d /tmp/precopy_vs_criu.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
printf 'export BIN=%q MEMWRITE=%q CRIU=%q MIB=%q PCTS=%q K=%q\nbash %q\n' \
    "$BIN" "$APPS/memwrite" "$CRIU" "$MIB" "$PCTS" "$K" \
    "$REPO/benches/guest/precopy_vs_criu.sh" > "$TMP/guest.sh"
run_guest pcbench "$MIB MiB, rewriting ${PCTS// /, } % per step, $K dumps each"

report() {
    report_head
    echo
    grep '^RUN' "$TMP/console.txt"
    echo
    awk '
        /^RUN/ {
            for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
            k = f["mode"] " " f["pct"]
            n[k]++; fr[k, n[k]] = f["frozen_ms"]; by[k, n[k]] = f["dump_bytes"]
            pcts[f["pct"]] = 1
        }
        function median(a, k, m,   i, j, t, v) {
            for (i = 1; i <= m; i++) v[i] = a[k, i]
            for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (v[j] + 0 < v[i] + 0) { t = v[i]; v[i] = v[j]; v[j] = t }
            return (m % 2) ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2
        }
        END {
            printf "%-6s %14s %14s %8s %16s %16s %8s\n", "pct", "criu frozen", "ckpt frozen", "ratio", "criu MiB frozen", "ckpt MiB frozen", "ratio"
            for (p in pcts) {
                c = "criu " p; q = "ckpt " p
                if (!n[c] || !n[q]) continue
                cf = median(fr, c, n[c]); qf = median(fr, q, n[q])
                cb = median(by, c, n[c]) / 1048576; qb = median(by, q, n[q]) / 1048576
                printf "%-6s %11d ms %11d ms %8.2f %16.1f %16.1f %8.2f\n", p "%", cf, qf, qf / cf, cb, qb, qb / cb
            }
        }' "$TMP/console.txt" | { read -r h; echo "$h"; sort -n; }
}
if [ -n "$OUT" ]; then report | tee "$OUT"; else report; fi
