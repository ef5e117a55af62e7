#!/usr/bin/env bash
# Runs inside one of two soft-RoCE test guests joined by a wire (scripts/testvm.sh), one rank of
# tests/apps/rdma_halo on each: guest "a" (192.168.98.1) runs ckptd and an agent and drives the
# job, guest "b" (192.168.98.2) runs an agent. They meet through files in /share (a host
# directory both mount). The job is checkpointed under traffic, every process on both nodes is
# SIGKILLed, and the job is restarted on the same nodes; prints "RESULT ..." lines.
#
# Environment: ROLE (a|b), BIN, APP, ITERS, WORDS.
set -eu
: "${ROLE:?}" "${BIN:?}" "${APP:?}" "${ITERS:?}" "${WORDS:?}"
W=$(mktemp -d /tmp/ib2.XXXXXX)
S=/share
say() { echo "[guest $ROLE $(date +%T)] $*"; }
wait_file() { # FILE SECONDS
    for _ in $(seq $(( $2 * 10 ))); do [ -e "$1" ] && return 0; sleep 0.1; done
    say "timed out waiting for $1"; exit 7
}
IP=192.168.98.1; [ "$ROLE" = b ] && IP=192.168.98.2
for _ in $(seq 100); do busybox ping -c1 -W1 192.168.98.$([ "$ROLE" = a ] && echo 2 || echo 1) > /dev/null 2>&1 && break; done

cat > "$W/agent.toml" <<TOML
node_name = "g$ROLE"
listen = "$IP:7601"
coordinator = "192.168.98.1:7600"
state_dir = "$W/state"
local_dir = "$W/local"
heartbeat_interval = "200ms"
tls_dir = "$W/tls"
allow_root_jobs = true
[cgroup]
prefix = "ib2-"
TOML

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

if [ "$ROLE" = a ]; then
    cat > "$W/ckptd.toml" <<TOML
listen = "0.0.0.0:7600"
socket = "$W/ckptd.sock"
database = "$W/ckptd.redb"
tls_dir = "$W/ca"
TOML
    # The cluster CA on the head node, and a credential for each node, as a site sets them up
    # (the bundle of b travels through the shared directory instead of ssh).
    "$BIN/ckptd" --config "$W/ckptd.toml" ca init
    "$BIN/ckptd" --config "$W/ckptd.toml" ca issue gb --out "$S/gb.bundle.tmp"
    mv "$S/gb.bundle.tmp" "$S/gb.bundle"
    "$BIN/ckptd" --config "$W/ckptd.toml" ca issue ga | "$BIN/ckpt-agent" --config "$W/agent.toml" enroll -
    "$BIN/ckptd" --config "$W/ckptd.toml" > "$W/ckptd.log" 2>&1 &
    PIDS+=($!)
fi
if [ "$ROLE" = b ]; then
    wait_file "$S/gb.bundle" 300
    "$BIN/ckpt-agent" --config "$W/agent.toml" enroll "$S/gb.bundle"
    rm -f "$S/gb.bundle"
fi
"$BIN/ckpt-agent" --config "$W/agent.toml" > "$W/agent.log" 2>&1 &
PIDS+=($!)

kill_job() { # every process of the job on this node, as a node crash would
    for d in /sys/fs/cgroup/ib2-*; do
        [ -d "$d" ] && for p in $(cat "$d/cgroup.procs"); do kill -9 "$p" 2>/dev/null || true; done
    done
}

if [ "$ROLE" = b ]; then
    touch "$S/b-up"
    wait_file "$S/kill" 600
    kill_job
    touch "$S/b-killed"
    wait_file "$S/done" 600
    echo "--- agent log (b)"; grep -E "channel|restor|WARN|ERROR" "$W/agent.log" | tail -n 30
    exit 0
fi

export CKPT_SOCKET=$W/ckptd.sock
wait_file "$S/b-up" 300
for _ in $(seq 300); do "$BIN/ckptctl" list > /dev/null 2>&1 && break; sleep 0.1; done
for _ in $(seq 300); do grep -q 'agent registered node="gb"' "$W/ckptd.log" && grep -q 'agent registered node="ga"' "$W/ckptd.log" && break; sleep 0.1; done

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
touch "$S/kill"
kill_job
wait_file "$S/b-killed" 120
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
