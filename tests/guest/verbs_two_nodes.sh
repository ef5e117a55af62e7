#!/usr/bin/env bash
# Runs inside one of two soft-RoCE test guests joined by a wire (tests/guest/two_nodes.sh sets
# up ckptd on a and an agent on each). The unmodified tests/apps/heat, one rank per guest, runs
# under ckpt over UCX's verbs transports, first with Open MPI, then with MPICH, each started by
# `ckptctl run --rdma` (the agents preload the verbs layer; mpiexec reaches b through
# ckpt-rsh): checkpointed twice under traffic, every process on both guests SIGKILLed, the job
# restarted on the same nodes. Prints "RESULT ..." lines for the e2e test.
#
# Environment: ROLE (a|b), BIN, OMPI_APP, MPICH_APP, N, ITERS, SLEEP (µs per iteration);
# MPIS (default "ompi mpich"): which of the two to run.
set -eu
: "${ROLE:?}" "${BIN:?}" "${OMPI_APP:?}" "${MPICH_APP:?}" "${N:?}" "${ITERS:?}" "${SLEEP:?}"
MPIS=${MPIS:-ompi mpich}
CGPREFIX=verbs2-
. "$(dirname "$0")/two_nodes.sh"
COUNTER=/sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts
if [ "$ROLE" = b ]; then
    before=$(cat $COUNTER)
    serve_kills "$MPIS" "layer|channel|rebuil|restor|WARN|ERROR"
    echo "RESULT b sent_pkts $(( $(cat $COUNTER) - before ))"
    exit 0
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
UCX="UCX_TLS=rc_verbs,ud_verbs,self UCX_UD_VERBS_ETH_DGID_CHECK=n UCX_MODULES=^rdmacm"
HOSTS=192.168.98.1,192.168.98.2

# One job: MPI (ompi|mpich), then the command that runs it under ckpt.
one_job() {
    local mpi=$1 k=$1; shift
    say "$mpi: reference, an uninterrupted run of both ranks in this guest, without ckpt"
    case $mpi in
        ompi) timeout 300 env $UCX mpirun.openmpi --oversubscribe -np 2 --mca pml ucx \
                --mca pml_ucx_devices any --mca pml_ucx_tls any --mca btl ^openib,ofi \
                --mca mtl ^ofi --mca osc ^ucx "$OMPI_APP" "$N" "$ITERS" > "$W/$mpi.ref" 2>&1 ;;
        mpich) timeout 300 env $UCX mpiexec.mpich -n 2 "$MPICH_APP" "$N" "$ITERS" > "$W/$mpi.ref" 2>&1 ;;
    esac || { cat "$W/$mpi.ref"; exit 3; }
    echo "RESULT $mpi reference $(grep '^checksum' "$W/$mpi.ref")"

    mkdir -m 700 "$S/status-$mpi"
    local job
    job=$(CKPT_VERBS_STATUS=$S/status-$mpi "$BIN/ckptctl" run --rdma --name "heat-$mpi" -- "$@" 2> "$W/$mpi.run")
    cat "$W/$mpi.run"
    echo "RESULT $mpi run $(grep -m1 -o -- '--rdma set.*' "$W/$mpi.run" || echo 'no --rdma settings')"
    local out=$W/state/jobs/$job/stdout
    say "$mpi: job $job started"
    progress() { grep -c '^iter ' "$out" 2>/dev/null || true; }
    wait_progress() { # at least N more progress lines than now, within 120 s
        local want=$(( $(progress) + $1 ))
        for _ in $(seq 1200); do [ "$(progress)" -ge "$want" ] && return 0; sleep 0.1; done
        say "no progress"; tail -n 20 "$out"; tail -n 40 "${out%stdout}stderr"
        "$BIN/ckptctl" status "$job"
        exit 4
    }
    wait_progress 1
    local before; before=$(cat $COUNTER)
    for i in 1 2; do
        "$BIN/ckptctl" checkpoint "$job" --wait > "$W/$mpi.ckpt$i" 2>&1 || { cat "$W/$mpi.ckpt$i"; exit 6; }
        echo "RESULT $mpi checkpoint $i ok $(grep -m1 -o '[0-9]* verbs layer(s) drained' "$W/$mpi.ckpt$i" || true)"
        grep -E 'frozen|rebuilt' "$W/$mpi.ckpt$i" | sed "s/^/RESULT $mpi ckpt$i /" || true
        wait_progress 1
    done
    echo "RESULT $mpi a sent_pkts $(( $(cat $COUNTER) - before ))"
    grep -q '^checksum' "$out" && { say "$mpi: the job finished before the kill; raise ITERS"; exit 5; }
    for f in "$S/status-$mpi"/*.json; do echo "RESULT $mpi running status $(cat "$f")"; done
    rm -f "$S/status-$mpi"/*.json

    say "$mpi: SIGKILL every process of job $job on both guests"
    touch "$S/kill-$k"
    kill_job
    wait_file "$S/killed-$k" 120
    for _ in $(seq 300); do "$BIN/ckptctl" status "$job" | head -1 | grep -qE 'killed|failed|exited|lost' && break; sleep 0.1; done
    "$BIN/ckptctl" status "$job" | head -1
    "$BIN/ckptctl" restart "$job" > "$W/$mpi.restart" 2>&1 || { cat "$W/$mpi.restart"; exit 8; }
    echo "RESULT $mpi restarted"
    for _ in $(seq 3000); do grep -q '^checksum' "$out" && break; sleep 0.1; done
    "$BIN/ckptctl" status "$job" | head -1
    echo "RESULT $mpi restarted $(grep '^checksum' "$out" || echo 'no checksum')"
    for _ in $(seq 100); do [ "$(ls "$S/status-$mpi"/*.json 2>/dev/null | wc -l)" -ge 2 ] && break; sleep 0.1; done
    for f in "$S/status-$mpi"/*.json; do echo "RESULT $mpi final status $(cat "$f")"; done
}

for mpi in $MPIS; do
    case $mpi in
        ompi) one_job ompi mpirun.openmpi -np 2 -host "192.168.98.1:1,192.168.98.2:1" \
                -x CKPT_VERBS_STATUS "$OMPI_APP" "$N" "$ITERS" "$SLEEP" ;;
        mpich) one_job mpich mpiexec.mpich -n 2 -hosts "$HOSTS" "$MPICH_APP" "$N" "$ITERS" "$SLEEP" ;;
    esac
done
touch "$S/done"
echo "--- ckptd log"; grep -E "layer|channel|rebuil|restor|WARN|ERROR" "$W/ckptd.log" | tail -n 40
echo "--- agent log (a)"; grep -E "layer|channel|rebuil|restor|WARN|ERROR" "$W/agent.log" | tail -n 40
