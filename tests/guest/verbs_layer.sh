#!/usr/bin/env bash
# Runs inside one soft-RoCE test guest (scripts/testvm.sh): the unmodified tests/apps/heat
# (Open MPI, 2 ranks) over UCX restricted to the verbs transports, first as it is, then with
# libckpt_verbs.so preloaded. Prints "RESULT ..." lines: each run's checksum, the packets rxe
# sent during the layer's run, and each rank's status report from the layer.
#
# Environment: LIB (libckpt_verbs.so), APP (heat.openmpi), N, ITERS.
set -eu
: "${LIB:?}" "${APP:?}" "${N:?}" "${ITERS:?}"
W=$(mktemp -d /tmp/verbs.XXXXXX)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI over UCX on rxe, verbs transports only (no TCP, no shared memory): see
# docs/infiniband.md for why each setting is there.
MCA=(--mca pml ucx --mca pml_ucx_devices any --mca pml_ucx_tls any
     --mca btl ^openib,ofi --mca mtl ^ofi --mca osc ^ucx)
UCX=(-x UCX_TLS=rc_verbs,ud_verbs,self -x UCX_NET_DEVICES=rxe0:1
     -x UCX_UD_VERBS_ETH_DGID_CHECK=n -x UCX_MODULES=^rdmacm)
COUNTER=/sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts
run() { # LABEL [mpirun args...]
    local label=$1; shift
    timeout 300 mpirun --oversubscribe -np 2 "${MCA[@]}" "${UCX[@]}" "$@" "$APP" "$N" "$ITERS" \
        > "$W/$label.out" 2>&1 || { echo "--- $label run failed"; cat "$W/$label.out"; exit 3; }
    echo "RESULT $label $(grep '^checksum' "$W/$label.out")"
}
run plain
mkdir -p "$W/status"
before=$(cat $COUNTER)
run layer -x LD_PRELOAD="$LIB" -x CKPT_VERBS_STATUS="$W/status"
echo "RESULT sent_pkts $(( $(cat $COUNTER) - before ))"
for f in "$W"/status/*.json; do echo "RESULT status $(cat "$f")"; done
