#!/usr/bin/env bash
# Runs inside one of three soft-RoCE test guests on one segment (tests/guest/two_nodes.sh sets
# up ckptd on a, an agent on each, and a job network, so jobs run in sandboxes; c is ckptd's
# spare). The unmodified tests/apps/heat under MPICH, 4 ranks, 2 on each of a and b, started by
# `ckptctl run --rdma`: UCX talks over its shared-memory transports between the ranks of a guest
# and over verbs (the layer preloaded by the agents) between guests. Checkpointed under traffic,
# then once more with `--kill` (as a node reclaim would stop it), then restarted with the parts
# swapped (`--map ga=gb --map gb=ga`): each part restores on the other guest, behind new GIDs,
# QPNs and rkeys. The parts are pre-dumped before the first checkpoint (pre-copy, through the
# agents' CRIU plugin). Prints "RESULT ..." lines for the e2e test.
#
# The launcher's node is named by its host name (Hydra starts its own proxy for it, and ckpt-rsh
# the other). Block placement (ranks 0 and 1 on a, 2 and 3 on b): heat's halo between 0-1 and 2-3 goes
# through shared memory, between 1-2 over verbs.
#
# Then tests/apps/verbs_newqp: two processes of one job that make new QPs after each of two
# restarts, each on a device that hands out again numbers the first QPs hold as virtual ones;
# no message may reach another QP than the one it was sent to. The first restart moves the job
# from a to b (`--map`); then guest b powers off, as a node that fails, and ckptd restarts the
# job by itself (`--on-failure`) on the spare c.
#
# Environment: ROLE (a|b|c), BIN, APP (heat.mpich), NEWQP (verbs_newqp), N, ITERS, SLEEP (µs per
# iteration); REF, heat's checksum uninterrupted (on another, the guests report what they did).
set -eu
: "${ROLE:?}" "${BIN:?}" "${APP:?}" "${NEWQP:?}" "${N:?}" "${ITERS:?}" "${SLEEP:?}"
CGPREFIX=verbsmv-
JOBNET=192.168.98.50-192.168.98.59
GUESTS=3 SPARES=gc
. "$(dirname "$0")/two_nodes.sh"
COUNTER=/sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts
STATUS=$S/status
LOGS="layer|channel|rebuil|restor|moved|WARN|ERROR"
if [ "$ROLE" = b ]; then
    before=$(cat $COUNTER)
    # The launcher's part prints the checksum; after the swap it runs here: its output is
    # handed to a through the shared directory.
    (
        for _ in $(seq 9000); do
            [ -e "$S/done" ] || [ -e "$S/lose-b" ] && break
            c=$(cat "$W"/state/jobs/*/stdout 2>/dev/null | grep -m1 '^checksum' || true)
            if [ -n "$c" ]; then
                cat "$W"/state/jobs/*/stdout > "$S/b-stdout" 2>/dev/null || true
                echo "$c" > "$S/b-checksum.tmp" && mv "$S/b-checksum.tmp" "$S/b-checksum"; break
            fi
            sleep 0.2
        done
    ) &
    serve_kills "" "$LOGS" lose-b
    # heat ended with another checksum than an uninterrupted run: all this agent said of it.
    [ -e "$S/mismatch" ] && { echo "--- agent log (b), job 1"; grep -E 'job=1[^0-9]|job 1[^0-9]' "$W/agent.log" | tail -n 150; }
    echo "RESULT b sent_pkts $(( $(cat $COUNTER) - before ))"
    fail_node
fi
if [ "$ROLE" = c ]; then
    serve_kills "" "$LOGS"
    exit 0
fi

field() { awk -v k="$2" '{for (i = 1; i < NF; i++) if ($i == k) print $(i + 1)}' "$1" 2>/dev/null || true; }
NQ=$S/newqp
wait_movable() { # JOB CKPT-OUTPUT: the epoch it committed has a copy off its nodes (partner, shared)
    local epoch
    epoch=$(grep -o 'epoch [0-9]* committed' "$2" | head -1 | awk '{print $2}')
    for _ in $(seq 1500); do
        "$BIN/ckptctl" --json epochs "$1" | python3 -c "import json, sys
v = json.load(sys.stdin); v = v.get('epochs', v) if isinstance(v, dict) else v
sys.exit(0 if any(e['epoch'] == $epoch and (e['shared_copy'] or e['partner_copy']) for e in v) else 1)" 2>/dev/null && return 0
        sleep 0.2
    done
    say "epoch $epoch of job $1 has no copy to move from"; "$BIN/ckptctl" epochs "$1"; exit 13
}
newqp_wait() { # PEERS: both processes know PEERS QPs of the other and got 10 more messages
    local p0 q0
    p0=$(field "$NQ/p.status" ok); q0=$(field "$NQ/q.status" ok)
    for _ in $(seq 1500); do
        if [ "$(field "$NQ/p.status" peers)" = "$1" ] && [ "$(field "$NQ/q.status" peers)" = "$1" ] &&
           [ "$(field "$NQ/p.status" ok)" -ge $(( ${p0:-0} + 10 )) ] 2>/dev/null &&
           [ "$(field "$NQ/q.status" ok)" -ge $(( ${q0:-0} + 10 )) ] 2>/dev/null; then
            return 0
        fi
        sleep 0.2
    done
    say "newqp: no traffic over $1 QPs"; cat "$NQ"/*.status; "$BIN/ckptctl" status "$NJOB"
    exit 10
}
newqp_move() { # FROM TO: checkpoint --kill (a stop asked for: no restart by itself), restart on TO
    say "newqp: checkpoint --kill"
    "$BIN/ckptctl" checkpoint "$NJOB" --kill > "$W/nq.ckpt" 2>&1 || { cat "$W/nq.ckpt"; exit 11; }
    say "newqp: committed and stopped; waiting for a copy off the node"
    wait_movable "$NJOB" "$W/nq.ckpt"
    say "newqp: restart on $2"
    "$BIN/ckptctl" restart "$NJOB" --map "$1=$2" > "$W/nq.restart" 2>&1 || { cat "$W/nq.restart"; exit 12; }
    echo "RESULT newqp restart $1 to $2 $(grep -o 'moving.*' "$W/nq.restart" | head -1)"
}
mkdir -m 700 "$STATUS"
# Shallower receive queues than UCX's 4095-deep default: the registered receive buffers are
# most of a rank's images (docs/infiniband.md, "Image size"), and this keeps the test's
# checkpoints, copies and restores short under emulation.
export UCX_RC_VERBS_RX_QUEUE_LEN=256 UCX_UD_VERBS_RX_QUEUE_LEN=256
JOB=$(CKPT_VERBS_STATUS=$STATUS "$BIN/ckptctl" run --rdma --name heat-move -- \
    mpiexec.mpich -n 4 -hosts "$(hostname):2,gb:2" "$APP" "$N" "$ITERS" "$SLEEP" 2> "$W/run.err")
cat "$W/run.err"
echo "RESULT run $(grep -m1 -o -- '--rdma set.*' "$W/run.err" || echo 'no --rdma settings')"
OUT=$W/state/jobs/$JOB/stdout
say "daemons up; job $JOB started"
progress() { grep -c '^iter ' "$OUT" 2>/dev/null || true; }
wait_progress() { # at least N more progress lines than now, within 120 s
    local want=$(( $(progress) + $1 ))
    for _ in $(seq 1200); do [ "$(progress)" -ge "$want" ] && return 0; sleep 0.1; done
    say "no progress"; tail -n 20 "$OUT"; tail -n 40 "${OUT%stdout}stderr"
    "$BIN/ckptctl" status "$JOB"
    exit 4
}
wait_progress 1
# Pre-copy is on (the agents' default): each part is pre-dumped while it runs, its device
# mappings passed over by the agent's CRIU plugin, before the first checkpoint.
for _ in $(seq 900); do
    "$BIN/ckptctl" status "$JOB" > "$W/status.before"
    [ "$(grep -c 'pre-dump.* ready' "$W/status.before")" -ge 2 ] && break
    sleep 0.2
done
sed 's/^/RESULT status before /' "$W/status.before"
echo "RESULT predumps ready $(grep -c 'pre-dump.* ready' "$W/status.before")"
before=$(cat $COUNTER)
# The second checkpoint stops the job (`--kill`): it cannot finish before the move, so it need
# run no longer than to here, and its restart runs only the rest.
for i in 1 2; do
    how=--wait; [ $i = 2 ] && how=--kill
    "$BIN/ckptctl" checkpoint "$JOB" $how > "$W/ckpt$i" 2>&1 || {
        cat "$W/ckpt$i"; echo "--- the job's stderr"; tail -n 20 "${OUT%stdout}stderr"; exit 6; }
    echo "RESULT checkpoint $i ok $(grep -m1 -o '[0-9]* verbs layer(s) drained' "$W/ckpt$i" || true)"
    grep -E 'frozen|rebuilt' "$W/ckpt$i" | sed "s/^/RESULT ckpt$i /" || true
    [ $i = 2 ] && break
    wait_progress 1
    # UCX's shared memory between the two ranks here: its segments mapped in each rank.
    for p in $(pgrep -f "^$APP"); do
        echo "RESULT a shm maps $(grep -cE 'ucx_shm_posix|/SYSV' /proc/$p/maps || true)"
    done
done
echo "RESULT a sent_pkts $(( $(cat $COUNTER) - before ))"
echo "RESULT heat stopped at $(grep '^iter ' "$OUT" | tail -n 1)"
grep -q '^checksum' "$OUT" && { say "the job finished before its second checkpoint; raise ITERS"; exit 5; }
for _ in $(seq 300); do "$BIN/ckptctl" status "$JOB" | head -1 | grep -qE 'stopped|failed|exited|lost' && break; sleep 0.1; done
"$BIN/ckptctl" status "$JOB" | head -1
[ -z "$(pgrep -f "^$APP")" ] || { say "processes of the job outlived checkpoint --kill"; exit 5; }
# Frozen time and image size of each checkpoint (docs/performance.md).
"$BIN/ckptctl" epochs "$JOB" | sed 's/^/RESULT epochs /'
say "heat: stopped at its second checkpoint; waiting for a copy off the nodes"
wait_movable "$JOB" "$W/ckpt2"
for f in "$STATUS"/*.json; do echo "RESULT running status $(cat "$f")"; done
rm -f "$STATUS"/*.json
say "restart with the parts swapped"
"$BIN/ckptctl" restart "$JOB" --map ga=gb --map gb=ga > "$W/restart" 2>&1 || { cat "$W/restart"; "$BIN/ckptctl" status "$JOB"; exit 8; }
sed 's/^/RESULT restart /' "$W/restart"
"$BIN/ckptctl" status "$JOB" | sed 's/^/RESULT status after /'
for _ in $(seq 3000); do [ -e "$S/b-checksum" ] && break; sleep 0.1; done
"$BIN/ckptctl" status "$JOB" | head -1
echo "RESULT restarted $(cat "$S/b-checksum" 2>/dev/null || echo 'no checksum')"
if [ -n "${REF:-}" ] && [ "$(cat "$S/b-checksum" 2>/dev/null)" != "checksum $REF" ]; then
    # Not the answer of an uninterrupted run: what each step did, for the failure report.
    touch "$S/mismatch"
    say "heat's checksum is not $REF; its output after the restart, and what ckptd and the agents did"
    cat "$S/b-stdout" 2>/dev/null
    "$BIN/ckptctl" --json epochs "$JOB"
    echo "--- ckptd log, job $JOB"; grep -E "job=$JOB[^0-9]|job $JOB[^0-9]" "$W/ckptd.log" | tail -n 80
    echo "--- agent log (a), job $JOB"; grep -E "job=$JOB[^0-9]|job $JOB[^0-9]" "$W/agent.log" | tail -n 150
fi
for _ in $(seq 100); do [ "$(ls "$STATUS"/*.json 2>/dev/null | wc -l)" -ge 4 ] && break; sleep 0.1; done
for f in "$STATUS"/*.json; do echo "RESULT final status $(cat "$f")"; done
# Ended before newqp moves onto its nodes (a node runs one part of a job at a time).
for _ in $(seq 200); do "$BIN/ckptctl" status "$JOB" | head -1 | grep -q running || break; sleep 0.1; done
if "$BIN/ckptctl" status "$JOB" | head -1 | grep -q running; then
    say "heat printed its result but did not exit; cancelling it"
    "$BIN/ckptctl" cancel "$JOB" > /dev/null
fi
# Two processes of one job (tests/apps/verbs_newqp) that make QPs after each restart: moved
# to b, then b lost and the job restarted on the spare c by ckptd itself; no message may reach
# another QP than the one it was sent to.
mkdir -p "$NQ" && mkdir -m 700 "$S/status-newqp"
say "newqp: start"
NJOB=$(CKPT_VERBS_STATUS=$S/status-newqp "$BIN/ckptctl" run --rdma --on-failure restart:2 --name newqp -- \
    sh -c "$NEWQP $NQ p q & $NEWQP $NQ q p & wait")
newqp_wait 1
newqp_move ga gb
newqp_wait 1
touch "$NQ/more-1"
newqp_wait 9
say "newqp: checkpoint"
"$BIN/ckptctl" checkpoint "$NJOB" --wait > "$W/nq.ckpt" 2>&1 || { cat "$W/nq.ckpt"; exit 11; }
wait_movable "$NJOB" "$W/nq.ckpt"
say "newqp: guest b powers off; ckptd restarts the job on the spare by itself"
touch "$S/lose-b"
for _ in $(seq 1800); do
    "$BIN/ckptctl" --json status "$NJOB" > "$W/nq.status" 2>/dev/null || true
    python3 -c "import json, sys
r = json.load(open(sys.argv[1])).get('recoveries') or [{}]
sys.exit(0 if r[-1].get('outcome', '').startswith(('running again', 'failed')) else 1)" "$W/nq.status" 2>/dev/null && break
    sleep 0.2
done
echo "RESULT newqp recovery $(python3 -c "import json, sys
print(json.dumps((json.load(open(sys.argv[1])).get('recoveries') or [None])[-1]))" "$W/nq.status")"
newqp_wait 9
touch "$NQ/more-2"
newqp_wait 17
# One more checkpoint: its rebuild writes the layers' status with every QP.
"$BIN/ckptctl" checkpoint "$NJOB" --wait > "$W/nq.ckpt" 2>&1 || { cat "$W/nq.ckpt"; exit 11; }
newqp_wait 17
say "newqp: done"
for n in p q; do echo "RESULT newqp $n $(cat "$NQ/$n.status")"; done
"$BIN/ckptctl" cancel "$NJOB" > /dev/null
for _ in $(seq 100); do [ "$(ls "$S/status-newqp"/*.json 2>/dev/null | wc -l)" -ge 2 ] && break; sleep 0.1; done
for f in "$S/status-newqp"/*.json; do echo "RESULT newqp layer $(cat "$f")"; done

touch "$S/done"
echo "--- ckptd log"; grep -E "layer|channel|rebuil|restor|moved|moving|WARN|ERROR" "$W/ckptd.log" | tail -n 40
echo "--- agent log (a)"; grep -E "$LOGS" "$W/agent.log" | tail -n 40
