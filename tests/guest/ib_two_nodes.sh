#!/usr/bin/env bash
# Runs inside one of two soft-RoCE test guests joined by a wire (scripts/testvm.sh), one rank of
# tests/apps/rdma_halo on each: guest "a" (192.168.98.1) runs ckptd and an agent and drives the
# job, guest "b" (192.168.98.2) runs an agent. They meet through files in /share (a host
# directory both mount). The job is checkpointed under traffic, every process on both nodes is
# SIGKILLed, and the job is restarted on the same nodes, where guest b's soft-RoCE device is
# gone by then: a new one with another name and another GID (b's interface got a new MAC, from
# which RoCE's GID 0 is derived) stands in its place, as on a node a part moved to; prints
# "RESULT ..." lines.
#
# Environment: ROLE (a|b), BIN, APP, ITERS, WORDS.
set -eu
: "${ROLE:?}" "${BIN:?}" "${APP:?}" "${ITERS:?}" "${WORDS:?}"
CGPREFIX=ib2-
. "$(dirname "$0")/two_nodes.sh"
if [ "$ROLE" = b ]; then
    gid() { cat "/sys/class/infiniband/$1/ports/1/gids/0"; }
    after_kill() { # rxe0 replaced by rxe_moved, with another GID
        local old
        old=$(gid rxe0)
        rdma link delete rxe0
        echo 1 > /proc/sys/net/ipv4/conf/eth0/arp_notify
        ip link set eth0 down
        ip link set eth0 address 52:54:00:00:98:22
        ip link set eth0 up
        rdma link add rxe_moved type rxe netdev eth0
        for _ in $(seq 100); do ibv_devinfo -d rxe_moved 2>/dev/null | grep -q PORT_ACTIVE && break; sleep 0.1; done
        for _ in $(seq 100); do busybox ping -c1 -W1 192.168.98.1 > /dev/null 2>&1 && break; done
        echo "RESULT device rxe0 gid $old -> $(ls /sys/class/infiniband | tr '\n' ' ')gid $(gid rxe_moved)"
    }
    serve_kills 1 "channel|restor|WARN|ERROR"
    exit 0
fi

say "reference run: rank 1 on this guest against rank 0 on this guest"
"$APP" 0 127.0.0.1 7201 "$ITERS" "$WORDS" > "$W/ref0" 2>&1 &
R0=$!
"$APP" 1 127.0.0.1 7201 "$ITERS" "$WORDS" > "$W/ref1" 2>&1
wait "$R0"
for r in 0 1; do echo "RESULT reference rank $r $(awk '/ done / {print $7}' "$W/ref$r")"; done

JOB=$("$BIN/ckptctl" run --name halo2 -- bash -c \
    "$APP 0 0.0.0.0 7202 $ITERS $WORDS & \"\$CKPT_RSH\" gb $APP 1 192.168.98.1 7202 $ITERS $WORDS; wait")
OUT=$W/state/jobs/$JOB/stdout
say "job $JOB started"
progress() { grep -c ' iter ' "$OUT" 2>/dev/null || true; }
wait_progress() {
    local want=$(( $(progress) + $1 ))
    for _ in $(seq 900); do [ "$(progress)" -ge "$want" ] && return 0; sleep 0.1; done
    say "no progress"; tail -n 20 "$OUT"; tail -n 20 "${OUT%stdout}stderr"; exit 4
}
wait_progress 2
"$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/checkpoint.out" 2>&1 || { cat "$W/checkpoint.out"; exit 7; }
cat "$W/checkpoint.out"
echo "RESULT checkpoint ok"
echo "RESULT rebuild $(grep -m1 -o 'ib-quiesce channel(s) rebuilt.*' "$W/checkpoint.out")"
wait_progress 2
grep -q ' done ' "$OUT" && { say "the job finished before the kill; raise ITERS"; exit 5; }
touch "$S/kill-1"
kill_job
wait_file "$S/killed-1" 120
for _ in $(seq 300); do "$BIN/ckptctl" status "$JOB" | head -1 | grep -qE 'killed|failed|exited' && break; sleep 0.1; done
"$BIN/ckptctl" status "$JOB" | head -1
"$BIN/ckptctl" restart "$JOB"
for _ in $(seq 1800); do [ "$(grep -c ' done ' "$OUT")" -ge 2 ] && break; sleep 0.1; done
"$BIN/ckptctl" status "$JOB" | head -1
grep -E ' (start|done) ' "$OUT" | sed 's/^/RESULT line /'
for r in 0 1; do
    echo "RESULT restarted rank $r $(awk -v r="$r" '$1=="rank" && $2==r && $3=="done" {c=$7} END {print c}' "$OUT")"
done
touch "$S/done"
echo "--- ckptd log"; grep -E "channel|rebuil|restor|WARN|ERROR" "$W/ckptd.log" | tail -n 30
