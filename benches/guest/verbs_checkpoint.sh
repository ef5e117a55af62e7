#!/usr/bin/env bash
# Runs inside one soft-RoCE test guest for benches/verbs_checkpoint.sh: ckptd with its embedded
# agent, then the unmodified tests/apps/heat (Open MPI, 2 ranks in this guest) under ckpt, once
# per mode in the order verbs tcp tcp verbs, REPS times; each job checkpointed K times while it
# runs, then cancelled.
#   verbs: `ckptctl run --rdma` with UCX_TLS=rc_verbs,ud_verbs,self (both ranks are in this guest:
#          --rdma alone would connect them through shared memory), the agent preloads the layer
#   tcp:   UCX over TCP (UCX_TLS=tcp,self), the layer off (CKPT_VERBS_LAYER=off)
# Neither mode lets UCX use shared memory between the ranks (no sm transports in UCX_TLS).
# Prints one "RUN mode=M rep=R ckpt=I frozen_ms= total_ms= bytes= dump_ms= drain_us= release_us=
# rebuild_ms=" line per checkpoint ("-" where a mode has no such step) and one "JOB mode=M ..."
# line per job (rxe packets sent while it ran, established TCP connections of its ranks when
# it had started).
#
# Environment: BIN (ckptd, ckptctl), APP (heat.openmpi), N, ITERS, SLEEP (µs per iteration),
# REPS (ABBA blocks), K (checkpoints per job); TCP_EXTRA: more VAR=VALUE settings for tcp mode.
set -eu
: "${BIN:?}" "${APP:?}" "${N:?}" "${ITERS:?}" "${SLEEP:?}" "${REPS:?}" "${K:?}"
W=$(mktemp -d /tmp/verbsckpt.XXXXXX)
say() { echo "[guest] $*"; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI's pml ucx declines to run unless told any device and transport will do (its defaults
# name only mlx devices and RDMA transports): "PML ucx cannot be selected" over tcp otherwise.
TCP_ENV="CKPT_VERBS_LAYER=off UCX_TLS=tcp,self OMPI_MCA_pml=ucx OMPI_MCA_pml_ucx_devices=any \
 OMPI_MCA_pml_ucx_tls=any OMPI_MCA_btl=^openib,ofi OMPI_MCA_mtl=^ofi OMPI_MCA_osc=^ucx \
 UCX_MODULES=^rdmacm ${TCP_EXTRA:-}"
COUNTER=/sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts
echo "GUEST kernel $(uname -r), $(nproc) vCPUs, $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) MiB"

# Each mode once without ckpt, briefly: the transports work in this guest (a failure shows here
# with MPI's own words rather than as a job that makes no progress).
VERBS_ENV="UCX_TLS=rc_verbs,ud_verbs,self UCX_UD_VERBS_ETH_DGID_CHECK=n UCX_MODULES=^rdmacm \
 OMPI_MCA_pml=ucx OMPI_MCA_pml_ucx_devices=any OMPI_MCA_pml_ucx_tls=any OMPI_MCA_btl=^openib,ofi \
 OMPI_MCA_mtl=^ofi OMPI_MCA_osc=^ucx"
for mode in verbs tcp; do
    case $mode in verbs) set -- $VERBS_ENV ;; tcp) set -- $TCP_ENV ;; esac
    timeout 180 env "$@" mpirun --oversubscribe -np 2 "$APP" "$N" 100 > "$W/check-$mode" 2>&1 \
        || { say "$mode: heat without ckpt failed"; tail -n 40 "$W/check-$mode"; exit 3; }
    echo "GUEST $mode without ckpt: $(grep '^checksum' "$W/check-$mode")"
done

CKPTD_LOG_GREP="WARN|ERROR"
. "$(dirname "$0")/../../tests/guest/standalone.sh"
LOG=$W/ckptd.log

# FIELD of the last log line containing MESSAGE after line FROM of ckptd's log ("-" if none).
logged() { # FROM MESSAGE FIELD
    local v
    v=$(tail -n +"$(( $1 + 1 ))" "$LOG" | sed 's/\x1b\[[0-9;]*m//g' | grep -F "$2" \
        | grep -o "$3=[0-9]*" | tail -n 1 | cut -d= -f2)
    echo "${v:--}"
}

# One job of MODE (verbs|tcp) in block REP: started, K checkpoints, cancelled.
one() {
    local mode=$1 rep=$2 job out pkts
    pkts=$(cat $COUNTER)
    case $mode in
        verbs) job=$(UCX_TLS=rc_verbs,ud_verbs,self "$BIN/ckptctl" run --rdma --name heat-verbs -- \
                   mpirun --oversubscribe -np 2 "$APP" "$N" "$ITERS" "$SLEEP" 2> "$W/run.err") ;;
        tcp) job=$(env $TCP_ENV "$BIN/ckptctl" run --name heat-tcp -- \
                   mpirun --oversubscribe -np 2 "$APP" "$N" "$ITERS" "$SLEEP" 2> "$W/run.err") ;;
    esac || { cat "$W/run.err"; exit 3; }
    out=$W/state/jobs/$job/stdout
    progress() { grep -c '^iter ' "$out" 2>/dev/null || true; }
    wait_progress() { # at least N more progress lines than now, within 300 s, while ranks live
        local want=$(( $(progress) + $1 )) end=$(( SECONDS + 300 ))
        for _ in $(seq 3000); do
            [ "$(progress)" -ge "$want" ] && return 0
            [ "$SECONDS" -lt "$end" ] && pgrep -f "$APP" > /dev/null || break
            sleep 0.1
        done
        say "$mode job $job: no progress"; tail -n 20 "$out"; tail -n 40 "${out%stdout}stderr"
        "$BIN/ckptctl" status "$job" || true
        exit 4
    }
    wait_progress 2
    local tcp_conns
    tcp_conns=$(ss -tnpH state established 2>/dev/null | grep -c '"heat' || true)
    for i in $(seq "$K"); do
        local from text frozen rebuild
        from=$(wc -l < "$LOG")
        "$BIN/ckptctl" checkpoint "$job" --wait > "$W/ckpt.out" 2>&1 || { cat "$W/ckpt.out"; exit 6; }
        text=$(tr -d '\r' < "$W/ckpt.out")
        # (No rebuild line without channels: grep's "no match" is not an error here.)
        frozen=$(grep -o 'resumed after [0-9]* ms frozen' <<< "$text" | grep -o '[0-9]*' | head -n 1 || true)
        rebuild=$(grep -o 'rebuilt and reconnected: .* in [0-9]* ms' <<< "$text" | grep -o '[0-9]* ms$' \
            | grep -o '[0-9]*' || true)
        "$BIN/ckptctl" --json epochs "$job" > "$W/epochs.json"
        # total_ms and image bytes of the newest epoch (the one just committed).
        # (A here-string: the guest has no /dev/fd for process substitution.)
        read -r total bytes <<< "$(python3 -c '
import json, sys
e = max(json.load(open(sys.argv[1])), key=lambda e: e["epoch"])
print(e["total_ms"], e["image_bytes"])' "$W/epochs.json")"
        echo "RUN mode=$mode rep=$rep ckpt=$i frozen_ms=${frozen:--} total_ms=$total bytes=$bytes" \
            "dump_ms=$(logged "$from" dumped engine_dump_ms)" \
            "drain_us=$(logged "$from" 'ib-quiesce channels quiesced' slowest_us)" \
            "release_us=$(logged "$from" 'ib-quiesce verbs layers released' slowest_us)" \
            "rebuild_ms=${rebuild:--}"
        wait_progress 1
    done
    grep -q '^checksum' "$out" && { say "$mode job $job finished before its cancel; raise ITERS"; exit 5; }
    echo "JOB mode=$mode rep=$rep job=$job iters=$(progress) rxe_sent_pkts=$(( $(cat $COUNTER) - pkts )) rank_tcp_conns=$tcp_conns"
    "$BIN/ckptctl" cancel "$job" > /dev/null
    for _ in $(seq 300); do pgrep -f "$APP" > /dev/null || break; sleep 0.1; done
    if pgrep -f "$APP" > /dev/null; then say "job $job: ranks still alive 30 s after cancel"; exit 7; fi
    # The guest's file systems are in its RAM: the next job needs the room of this one's images.
    say "$mode job $job: $(du -sm "$W/local/$job" | cut -f1) MiB staged, removed"
    rm -rf "${W:?}/local/$job"
}

for r in $(seq "$REPS"); do
    for mode in verbs tcp tcp verbs; do
        say "block $r: $mode"
        one "$mode" "$r"
    done
done
say "done"
