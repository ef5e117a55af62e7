#!/usr/bin/env bash
# Runs inside a soft-RoCE test guest (scripts/testvm.sh): ckptd and its agent, then the 2-rank
# RDMA program tests/apps/rdma_halo under ckpt, checkpointed under traffic, killed and
# restarted; prints the lines the e2e test asserts on ("RESULT ...").
#
# Environment: BIN (release binaries), APP (rdma_halo), ITERS, WORDS,
# CHECKPOINTS (continue-checkpoints before the kill, default 1),
# ABORT (1: then one more checkpoint whose dump fails after the quiesce, through a failpoint;
# the epoch aborts, the channels are rebuilt and the job must go on),
# ENGINE (the snapshot engine, `ckptctl run --engine`; default criu).
set -eu
: "${BIN:?}" "${APP:?}" "${ITERS:?}" "${WORDS:?}"
CHECKPOINTS=${CHECKPOINTS:-1} ABORT=${ABORT:-0} ENGINE=${ENGINE:-criu}
W=$(mktemp -d /tmp/ibjob.XXXXXX)
say() { echo "[guest] $*"; }

say "reference: an uninterrupted run"
"$APP" 0 127.0.0.1 7101 "$ITERS" "$WORDS" > "$W/ref0" 2>&1 &
R0=$!
"$APP" 1 127.0.0.1 7101 "$ITERS" "$WORDS" > "$W/ref1" 2>&1 || { cat "$W/ref1"; exit 3; }
wait "$R0" || { cat "$W/ref0"; exit 3; }
for r in 0 1; do
    echo "RESULT reference rank $r $(awk '/ done / {print $7}' "$W/ref$r")"
done

. "$(dirname "$0")/standalone.sh"

JOB=$("$BIN/ckptctl" run --engine "$ENGINE" --name halo -- bash -c \
    "$APP 0 127.0.0.1 7102 $ITERS $WORDS & $APP 1 127.0.0.1 7102 $ITERS $WORDS; wait")
OUT=$W/state/jobs/$JOB/stdout
say "job $JOB started"
echo "RESULT engine $("$BIN/ckptctl" status "$JOB" --json | tr -d ' \n' | grep -o '"engine":"[a-z]*"')"
progress() { grep -c ' iter ' "$OUT" 2>/dev/null || true; }
wait_progress() { # at least N more progress lines than now, within 60 s
    local want=$(( $(progress) + $1 ))
    for _ in $(seq 600); do [ "$(progress)" -ge "$want" ] && return 0; sleep 0.1; done
    say "no progress"; tail -n 20 "$OUT"; tail -n 20 "${OUT%stdout}stderr"
    for p in $(pgrep rdma_halo); do say "pid $p: $(cat /proc/$p/wchan) $(grep State /proc/$p/status)"; done
    exit 4
}
wait_progress 2
checkpoint() { # one committed checkpoint; DMTCP refuses one until every process runs under it
    for _ in $(seq 120); do
        "$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/ckpt.out" 2>&1 && { cat "$W/ckpt.out"; return 0; }
        grep -q "not every process of the job runs under DMTCP yet" "$W/ckpt.out" || break
        sleep 0.5
    done
    cat "$W/ckpt.out"; return 1
}
for i in $(seq "$CHECKPOINTS"); do
    checkpoint
    echo "RESULT checkpoint $i ok"
    wait_progress 2
done
if [ "$ABORT" = 1 ]; then
    echo "local-checkpoint=error" > "$W/failpoints"
    if "$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/abort.out" 2>&1; then
        say "the checkpoint with a failing dump succeeded"; cat "$W/abort.out"; exit 6
    fi
    rm -f "$W/failpoints"
    echo "RESULT aborted checkpoint: $(grep -m1 -i 'abort\|fail' "$W/abort.out")"
    wait_progress 2
    echo "RESULT after the abort the job goes on"
    grep -q "rebuilt after the abort" "$W/ckptd.log" && echo "RESULT channels rebuilt after the abort"
fi
grep -q ' done ' "$OUT" && { say "the job finished before the kill; raise ITERS"; exit 5; }
say "SIGKILL every process of job $JOB"
CG=$(awk -F: '$2=="" || $2 ~ /freezer/ {print $3}' /proc/"$(pgrep -f "rdma_halo 0 127.0.0.1 7102" | head -1)"/cgroup | head -1)
for p in $(cat /sys/fs/cgroup"$CG"/cgroup.procs); do kill -9 "$p" 2>/dev/null || true; done
for _ in $(seq 100); do "$BIN/ckptctl" status "$JOB" | head -1 | grep -q killed && break; sleep 0.1; done
"$BIN/ckptctl" status "$JOB" | head -1
"$BIN/ckptctl" restart "$JOB"
wait_progress 1
for _ in $(seq 1200); do grep -q ' done ' "$OUT" && [ "$(grep -c ' done ' "$OUT")" -ge 2 ] && break; sleep 0.1; done
"$BIN/ckptctl" status "$JOB" | head -1
grep -E ' (start|done) ' "$OUT" | sed 's/^/RESULT line /'
for r in 0 1; do
    echo "RESULT restarted rank $r $(awk -v r="$r" '$1=="rank" && $2==r && $3=="done" {c=$7} END {print c}' "$OUT")"
done
