#!/usr/bin/env bash
# verbs_checkpoint.sh — what checkpointing costs an unmodified MPI job over InfiniBand verbs
# against the same job over TCP: tests/apps/heat (Open MPI, 2 ranks, both in one
# scripts/testvm.sh guest) under ckptd with its embedded agent, over UCX rc_verbs on soft-RoCE
# (rxe0, `ckptctl run --rdma`, the agent preloads libckpt_verbs.so) or over UCX tcp (layer off),
# alternated verbs tcp tcp verbs per repetition in one guest boot; K checkpoints per job. The
# guest part is benches/guest/verbs_checkpoint.sh. Reports each checkpoint and the medians per
# mode: frozen time, total time, image bytes, CRIU dump time, and for verbs the layer's cycle
# (slowest drain and release, rebuild + reconnect after the thaw); ratio verbs/tcp of frozen.
#
#   benches/verbs_checkpoint.sh --no-build     one run (~20 min on a loaded host, boot included)
#   benches/verbs_checkpoint.sh --no-build --out benches/results/verbs-checkpoint-$(date +%F).txt
#
# Options: --reps R (1: times the modes run)  --k K (3: checkpoints per job)  --n N (128)
# --iters I (200000: the job outlives its checkpoints)  --sleep US (2000: per iteration)
# --modes "M ..." ("verbs tcp tcp verbs"; also verbs+pc and tcp+pc: with pre-copy, each
# checkpoint after a pre-dump; without +pc every checkpoint is a full dump)
# --ballast MIB (0: memory of each rank's own, rewritten PCT % before each checkpoint)
# --pct P (10)  --mem MIB (2048: guest memory)  --timeout S (2400)  --no-build  --out FILE
# --bin DIR (ckptd, ckptctl, ckpt-agent, libckpt_verbs.so; $REPO/target/release)
# --apps DIR (heat.openmpi; $REPO/target/apps): with --no-build, binaries another tree built.
# --tcp-extra "VAR=VALUE ..." more settings for the tcp jobs.
#
#   pre-copy for verbs and for tcp (~35 min):
#   benches/verbs_checkpoint.sh --no-build --modes "verbs verbs+pc tcp tcp+pc" --ballast 256 --mem 6144
# Needs root, QEMU and a prepared test VM (scripts/setup.sh --vm). The guest runs under QEMU
# TCG: absolute times are far from hardware; read the ratios.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPS=1 K=3 N=128 ITERS=200000 SLEEP=2000 TIMEOUT=2400 BUILD=1 OUT= TCP_EXTRA=
MODES="verbs tcp tcp verbs" BALLAST=0 PCT=10 MEM=2048
BIN=$REPO/target/release APPS=$REPO/target/apps
ARGS="$*"
while [ $# -gt 0 ]; do
    case "$1" in
        --reps) REPS=$2; shift ;;
        --k) K=$2; shift ;;
        --n) N=$2; shift ;;
        --iters) ITERS=$2; shift ;;
        --sleep) SLEEP=$2; shift ;;
        --timeout) TIMEOUT=$2; shift ;;
        --no-build) BUILD= ;;
        --out) OUT=$2; shift ;;
        --bin) BIN=$(cd "$2" && pwd); shift ;;
        --apps) APPS=$(cd "$2" && pwd); shift ;;
        --tcp-extra) TCP_EXTRA=$2; shift ;;
        --modes) MODES=$2; shift ;;
        --ballast) BALLAST=$2; shift ;;
        --pct) PCT=$2; shift ;;
        --mem) MEM=$2; shift ;;
        -h|--help) sed -n 2,32p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "verbs_checkpoint: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
NAME=verbs_checkpoint
. "$REPO/benches/vmbench.sh"
if [ -n "$BUILD" ]; then
    log "building ckptd, ckptctl, ckpt-agent, libckpt_verbs.so and heat (release)"
    (cd "$REPO" && cargo build --release -p ckptd -p ckptctl -p node-agent -p ckpt-verbs) >&2
    make -s -C "$REPO/tests/apps" OUT="$REPO/target/apps" "$REPO/target/apps/heat.openmpi" >&2
fi
APP=$APPS/heat.openmpi
for f in "$BIN/ckptd" "$BIN/ckptctl" "$BIN/ckpt-agent" "$BIN/libckpt_verbs.so" "$APP"; do
    [ -f "$f" ] || die "missing $f (drop --no-build)"
done

TMP=$(mktemp -d /tmp/verbs_checkpoint.XXXXXX)
MON=
trap '[ -z "$MON" ] || kill "$MON" 2>/dev/null || true; rm -rf "$TMP"' EXIT
printf 'export BIN=%q APP=%q N=%q ITERS=%q SLEEP=%q REPS=%q K=%q TCP_EXTRA=%q MODES=%q BALLAST=%q PCT=%q\nbash %q\n' \
    "$BIN" "$APP" "$N" "$ITERS" "$SLEEP" "$REPS" "$K" "$TCP_EXTRA" "$MODES" "$BALLAST" "$PCT" \
    "$REPO/benches/guest/verbs_checkpoint.sh" > "$TMP/guest.sh"

# Other QEMU guests (other engineers' test runs) share the 2 cores: count them once a second
# for the report. Modes alternate, so the ratios hold; absolute times suffer.
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
OTHERS=$(pgrep -xc qemu-system-x86 || true)
[ "$OTHERS" = 0 ] || log "warning: $OTHERS other QEMU guest(s) running; the numbers will be noisy"
( while sleep 1; do echo $(( $(pgrep -xc qemu-system-x86 || true) - 1 )); done > "$TMP/others" ) &
MON=$!
BEGIN=$SECONDS
log "booting the guest (modes $MODES, $REPS time(s), $K checkpoints per job)"
rc=0
"$REPO/scripts/testvm.sh" run "$TMP/guest.sh" name=vckbench mem="$MEM" timeout="$TIMEOUT" \
    > "$TMP/console" 2>&1 || rc=$?
WALL=$((SECONDS - BEGIN))
kill "$MON" 2>/dev/null || true; wait "$MON" 2>/dev/null || true; MON=
MAXOTHERS=$(sort -n "$TMP/others" | tail -n 1); MAXOTHERS=$(( ${MAXOTHERS:-0} > OTHERS ? ${MAXOTHERS:-0} : OTHERS ))
tr -d '\r' < "$TMP/console" > "$TMP/console.txt"
[ "$rc" = 0 ] || { tail -n 60 "$TMP/console.txt" >&2; die "guest run failed (exit $rc)"; }
grep -E "^(RUN|JOB) " "$TMP/console.txt" > "$TMP/runs" || die "no results: $(tail -n 20 "$TMP/console.txt")"

report() {
    echo "# checkpoint of heat.openmpi (2 ranks) over UCX verbs (rxe0, verbs layer) vs UCX tcp (one QEMU TCG guest)"
    echo "# $(date -u +%FT%TZ) $(git -C "$REPO" rev-parse --short HEAD) benches/verbs_checkpoint.sh $ARGS"
    echo "# binaries $BIN (ckptd built $(date -u -r "$BIN/ckptd" +%FT%TZ)), app $APP N=$N ITERS=$ITERS SLEEP=${SLEEP}us"
    echo "# modes $MODES, ballast ${BALLAST} MiB per rank rewritten ${PCT} % before each checkpoint, guest ${MEM} MiB"
    echo "# host: nproc $(nproc), load average before $LOAD, other QEMU guests during the run: at most $MAXOTHERS; guest wall ${WALL}s"
    grep -E '^GUEST ' "$TMP/console.txt" | sed 's/^/# /' || true
    [ -z "$TCP_EXTRA" ] || echo "# tcp mode extra settings: $TCP_EXTRA"
    cat "$TMP/runs"
    python3 - "$TMP/runs" <<'PY'
import sys, statistics
runs = []
for line in open(sys.argv[1]):
    if line.startswith("RUN "):
        runs.append(dict(kv.split("=", 1) for kv in line.split()[1:]))
modes = list(dict.fromkeys(r["mode"] for r in runs))
def med(mode, key):
    v = [float(r[key]) for r in runs if r["mode"] == mode and r.get(key, "-") != "-"]
    return (statistics.median(v), len(v)) if v else (None, 0)
keys = (("frozen_ms", "frozen (ms)"), ("total_ms", "total (ms)"), ("bytes", "image (MiB)"),
        ("dump_bytes", "written frozen (MiB)"), ("links", "pre-dumps under it"),
        ("dump_ms", "CRIU dump (ms)"), ("drain_us", "layer drain, slowest (ms)"),
        ("release_us", "layer release, slowest (ms)"), ("rebuild_ms", "rebuild + reconnect (ms)"))
print(f"{'median over checkpoints':28}" + "".join(f" {m:>10}" for m in modes))
for key, name in keys:
    cells = []
    for mode in modes:
        m, n = med(mode, key)
        if m is None:
            cells.append("-")
        elif key.endswith("bytes"):
            cells.append(f"{m / 2**20:.1f}")
        elif key.endswith("_us"):
            cells.append(f"{m / 1000:.1f}")
        else:
            cells.append(f"{m:.0f}")
    print(f"{name:28}" + "".join(f" {c:>10}" for c in cells))
print("checkpoints: " + ", ".join(f"{m} {len([r for r in runs if r['mode'] == m])}" for m in modes))
for a, b in (("verbs", "tcp"), ("verbs+pc", "tcp+pc"), ("verbs+pc", "verbs"), ("tcp+pc", "tcp")):
    for key, name in (("frozen_ms", "frozen"), ("bytes", "image"), ("total_ms", "total")):
        x, y = med(a, key)[0], med(b, key)[0]
        if x and y:
            print(f"{name} ratio {a}/{b} {x / y:.3f}")
PY
}
if [ -n "$OUT" ]; then report | tee "$OUT"; else report; fi
