#!/usr/bin/env bash
# Runs inside one soft-RoCE test guest for benches/verbs_checkpoint.sh: ckptd with its embedded
# agent, then the unmodified tests/apps/heat (Open MPI, 2 ranks in this guest) under ckpt, once
# per mode of MODES in order (default "verbs tcp tcp verbs"); each job checkpointed K times while
# it runs, then cancelled.
#   verbs: `ckptctl run --rdma` with UCX_TLS=rc_verbs,ud_verbs,self (both ranks are in this guest:
#          --rdma alone would connect them through shared memory), the agent preloads the layer
#   tcp:   UCX over TCP (UCX_TLS=tcp,self), the layer off (CKPT_VERBS_LAYER=off)
#   verbs+pc, tcp+pc: the same with pre-copy: each checkpoint waits until a pre-dump of the job
#          is ready (one after each start or checkpoint, none more). Without "+pc" the agent's
#          pre-copy is off: every checkpoint is a full dump. ckptd restarts when that changes.
# Neither transport lets UCX use shared memory between the ranks (no sm transports in UCX_TLS).
# With BALLAST=M each rank also holds M MiB and, before each checkpoint (after the pre-dump in
# "+pc" modes), rewrites PCT % of it once (heat's HEAT_BALLAST_MIB, SIGUSR1).
# Prints one "RUN mode=M rep=R ckpt=I frozen_ms= total_ms= bytes= dump_bytes= links= dump_ms=
# drain_us= release_us= rebuild_ms=" line per checkpoint ("-" where a mode has no such step;
# dump_bytes: page images written while frozen, links: pre-dumps under the dump) and one
# "JOB mode=M ..." line per job (rxe packets sent while it ran, established TCP connections of
# its ranks when it had started).
#
# Environment: BIN (ckptd, ckptctl), APP (heat.openmpi), N, ITERS, SLEEP (µs per iteration),
# REPS (times MODES is run), K (checkpoints per job), MODES, BALLAST (MiB per rank, 0), PCT (10);
# TCP_EXTRA: more VAR=VALUE settings for tcp mode.
set -eu
: "${BIN:?}" "${APP:?}" "${N:?}" "${ITERS:?}" "${SLEEP:?}" "${REPS:?}" "${K:?}"
MODES=${MODES:-verbs tcp tcp verbs} BALLAST=${BALLAST:-0} PCT=${PCT:-10}
W=$(mktemp -d /tmp/verbsckpt.XXXXXX)
# Staging and the job's files in a RAM file system of its own, three quarters of the guest's
# memory (the root's overlay has far less room than the images of a job with ballast).
mount -t tmpfs -o size=75% verbsckpt "$W"
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
cp "$W/ckptd.toml" "$W/ckptd.base.toml"
PRECOPY=default
# Restarts ckptd with its agent's pre-copy on or off ($1), one epoch kept locally; the database
# and work directories carry over.
ckptd_with_precopy() {
    [ "$PRECOPY" = "$1" ] && return 0
    kill "$CKPTD"; wait "$CKPTD" 2>/dev/null || true
    local pc='enabled = false'
    [ "$1" = on ] && pc='first_after = "1s"
check_every = "200ms"
min_interval = "1h"'
    { cat "$W/ckptd.base.toml"; printf '[agent.precopy]\n%s\n[retention]\nkeep_local = 1\n' "$pc"; } \
        > "$W/ckptd.toml"
    "$BIN/ckptd" --standalone --config "$W/ckptd.toml" >> "$LOG" 2>&1 &
    CKPTD=$! PRECOPY=$1
    for _ in $(seq 200); do "$BIN/ckptctl" list > /dev/null 2>&1 && return 0; sleep 0.1; done
    say "ckptd did not start"; tail -n 20 "$LOG"; exit 3
}
page_bytes() { find "$@" -maxdepth 1 -name 'pages-*.img' -printf '%s\n' | awk '{s += $1} END {print s + 0}'; }

# FIELD of the last log line containing MESSAGE after line FROM of ckptd's log ("-" if none).
logged() { # FROM MESSAGE FIELD
    local v
    v=$(tail -n +"$(( $1 + 1 ))" "$LOG" | sed 's/\x1b\[[0-9;]*m//g' | grep -F "$2" \
        | grep -o "$3=[0-9]*" | tail -n 1 | cut -d= -f2)
    echo "${v:--}"
}

# Waits until job $1 has a pre-dump ready (at most 300 s).
predumped() {
    for _ in $(seq 1000); do
        "$BIN/ckptctl" status "$1" > "$W/status" 2>&1 || true
        grep -q 'pre-dump.*ready' "$W/status" && return 0
        sleep 0.2
    done
    say "job $1: no pre-dump ready"; cat "$W/status"; exit 4
}

# One job of MODE (verbs|tcp, +pc) in block REP: started, K checkpoints, cancelled.
one() {
    local mode=$1 rep=$2 job out pkts
    case $mode in *+pc) ckptd_with_precopy on ;; *) ckptd_with_precopy off ;; esac
    pkts=$(cat $COUNTER)
    export HEAT_BALLAST_MIB=$BALLAST HEAT_BALLAST_PCT=$PCT
    case ${mode%+pc} in
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
    if [ "$PRECOPY" = on ]; then
        # A warm-up checkpoint, not reported: the first pre-dump may have caught the ranks
        # still starting, before they wrote their memory; the next comes after this epoch.
        predumped "$job"
        "$BIN/ckptctl" checkpoint "$job" --wait > "$W/ckpt.out" 2>&1 || { cat "$W/ckpt.out"; exit 6; }
    fi
    local tcp_conns
    tcp_conns=$(ss -tnpH state established 2>/dev/null | grep -c '"heat' || true)
    for i in $(seq "$K"); do
        local from text frozen rebuild links=0 d
        [ "$PRECOPY" = on ] && predumped "$job"
        if [ "$BALLAST" -gt 0 ]; then
            # One rewrite by each rank, then the checkpoint.
            local want=$(( $(grep -c '^ballast .* rewritten' "${out%stdout}stderr" || true) + 2 ))
            pkill -USR1 -x "$(basename "$APP")"
            for _ in $(seq 3000); do
                [ "$(grep -c '^ballast .* rewritten' "${out%stdout}stderr" || true)" -ge "$want" ] && break
                sleep 0.1
            done
        fi
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
        d=$(ls -d "$W"/local/"$job"/*/*/images | sort -V | tail -n 1)
        links=$(ls -d "$d"/../pre/*/ 2> /dev/null | wc -l)
        echo "RUN mode=$mode rep=$rep ckpt=$i frozen_ms=${frozen:--} total_ms=$total bytes=$bytes" \
            "dump_bytes=$(page_bytes "$d") links=$links" \
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
    for mode in $MODES; do
        say "block $r: $mode"
        one "$mode" "$r"
    done
done
say "done"
