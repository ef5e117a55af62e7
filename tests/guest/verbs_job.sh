#!/usr/bin/env bash
# Runs inside one soft-RoCE test guest (scripts/testvm.sh): ckptd and its agent, then the
# unmodified tests/apps/heat (Open MPI, 2 ranks) over UCX's verbs transports with
# libckpt_verbs.so preloaded, under ckpt: checkpointed twice under traffic, one more checkpoint
# whose dump fails after the quiesce (failpoint; the job must go on over verbs), then every
# process SIGKILLed and the job restarted. Prints "RESULT ..." lines for the e2e test.
#
# Environment: BIN (release binaries), LIB (libckpt_verbs.so), APP (heat.openmpi), N, ITERS,
# SLEEP (microseconds per iteration). The checksum of an uninterrupted run comes from the host
# (heat's result does not depend on the transport), which runs it far faster.
set -eu
: "${BIN:?}" "${LIB:?}" "${APP:?}" "${N:?}" "${ITERS:?}" "${SLEEP:?}"
W=$(mktemp -d /tmp/verbsjob.XXXXXX)
say() { echo "[guest] $*"; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI over UCX on rxe, verbs transports only (docs/infiniband.md says why each is there).
WITH_RDMACM="mpirun --oversubscribe -np 2 --mca pml ucx --mca pml_ucx_devices any \
 --mca pml_ucx_tls any --mca btl ^openib,ofi --mca mtl ^ofi --mca osc ^ucx \
 -x UCX_TLS=rc_verbs,ud_verbs,self -x UCX_NET_DEVICES=rxe0:1 -x UCX_UD_VERBS_ETH_DGID_CHECK=n"
MPIRUN="$WITH_RDMACM -x UCX_MODULES=^rdmacm"
COUNTER=/sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts

CKPTD_LOG_GREP="WARN|ERROR|channel|layer|rebuil"
. "$(dirname "$0")/standalone.sh"

say "a job whose UCX holds the RDMA connection manager is refused, and runs on"
JOB=$("$BIN/ckptctl" run --name heat-rdmacm -- $WITH_RDMACM -x LD_PRELOAD="$LIB" -x CKPT_IBQ_SOCKET \
    "$APP" "$N" "$ITERS" 500)
OUT=$W/state/jobs/$JOB/stdout
for _ in $(seq 300); do grep -q '^iter ' "$OUT" 2>/dev/null && break; sleep 0.1; done
if "$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/rdmacm.out" 2>&1; then
    say "a job holding rdma_cm was checkpointed"; cat "$W/rdmacm.out"; exit 9
fi
echo "RESULT rdmacm refused: $(grep -m1 'rdma_cm' "$W/rdmacm.out" || cat "$W/rdmacm.out")"
for _ in $(seq 600); do grep -q '^checksum' "$OUT" && break; sleep 0.1; done
echo "RESULT rdmacm job $(grep '^checksum' "$OUT" || echo 'no checksum')"

mkdir -m 700 "$W/status"
JOB=$("$BIN/ckptctl" run --name heat-verbs -- $MPIRUN -x LD_PRELOAD="$LIB" \
    -x CKPT_IBQ_SOCKET -x CKPT_VERBS_STATUS="$W/status" "$APP" "$N" "$ITERS" "$SLEEP")
OUT=$W/state/jobs/$JOB/stdout
say "job $JOB started"
progress() { grep -c '^iter ' "$OUT" 2>/dev/null || true; }
wait_progress() { # at least N more progress lines than now, within 90 s
    local want=$(( $(progress) + $1 ))
    for _ in $(seq 900); do [ "$(progress)" -ge "$want" ] && return 0; sleep 0.1; done
    say "no progress"; tail -n 20 "$OUT"; tail -n 40 "${OUT%stdout}stderr"
    for p in $(pgrep -f "$APP"); do say "pid $p: $(cat /proc/$p/wchan) $(grep State /proc/$p/status)"; done
    exit 4
}
wait_progress 1
before=$(cat $COUNTER)
for i in 1 2; do
    "$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/ckpt$i.out" 2>&1 || { cat "$W/ckpt$i.out"; exit 7; }
    echo "RESULT checkpoint $i ok"
    grep -m1 -o '[0-9]* verbs layer(s) drained.*' "$W/ckpt$i.out" | sed 's/^/RESULT /' || true
    wait_progress 1
done
echo "local-checkpoint=error" > "$W/failpoints"
if "$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/abort.out" 2>&1; then
    say "the checkpoint with a failing dump succeeded"; cat "$W/abort.out"; exit 6
fi
rm -f "$W/failpoints"
echo "RESULT aborted checkpoint: $(grep -m1 -i 'fail' "$W/abort.out")"
wait_progress 1
echo "RESULT after the abort the job goes on"
echo "RESULT sent_pkts $(( $(cat $COUNTER) - before ))"
grep -q '^checksum' "$OUT" && { say "the job finished before the kill; raise ITERS"; exit 5; }
for f in "$W"/status/*.json; do echo "RESULT running status $(cat "$f")"; done

say "SIGKILL every process of job $JOB"
CG=$(awk -F: '$2=="" || $2 ~ /freezer/ {print $3}' /proc/"$(pgrep -f "$APP" | head -1)"/cgroup | head -1)
for p in $(cat /sys/fs/cgroup"$CG"/cgroup.procs); do kill -9 "$p" 2>/dev/null || true; done
for _ in $(seq 100); do "$BIN/ckptctl" status "$JOB" | head -1 | grep -q killed && break; sleep 0.1; done
"$BIN/ckptctl" status "$JOB" | head -1
rm -f "$W"/status/*.json
"$BIN/ckptctl" restart "$JOB" > "$W/restart.out" 2>&1 || { cat "$W/restart.out"; exit 8; }
echo "RESULT restarted"
for _ in $(seq 1800); do grep -q '^checksum' "$OUT" && break; sleep 0.1; done
"$BIN/ckptctl" status "$JOB" | head -1
echo "RESULT restarted $(grep '^checksum' "$OUT" || echo 'no checksum')"
for _ in $(seq 100); do [ "$(ls "$W"/status/*.json 2>/dev/null | wc -l)" -ge 2 ] && break; sleep 0.1; done
for f in "$W"/status/*.json; do echo "RESULT final status $(cat "$f")"; done
