#!/usr/bin/env bash
# Runs inside one soft-RoCE test guest (scripts/testvm.sh): ckptd and its agent, then plain
# verbs programs (no MPI, no UCX) with libckpt_verbs.so preloaded.
#
# tests/apps/verbs_refusals once per mode: "none" (only what the layer takes through a
# checkpoint: the control case, checkpointed), "fd" (the program also opens the device file
# itself) and "mcast" (it attaches its UD QP to a multicast group through the layer). For the
# last two a checkpoint must fail at initial sync naming the process and the descriptor or the
# feature. Each time the program must keep printing afterwards. Then "event" (an asynchronous
# event the program got and had not acknowledged when it was checkpointed): checkpointed, the
# program acknowledges the event, and a second checkpoint works.
#
# Then tests/apps/verbs_wr, which posts with rdma-core's newer calls (ibv_create_qp_ex,
# ibv_wr_*): checkpointed under traffic, checkpointed with --kill, restarted, checkpointed
# again; every tick's RDMA write, read, atomic and send must check out throughout.
# Prints "RESULT ..." lines for the e2e test.
#
# Environment: BIN (release binaries), LIB (libckpt_verbs.so), APP (verbs_refusals),
# WR (verbs_wr).
set -eu
: "${BIN:?}" "${LIB:?}" "${APP:?}" "${WR:?}"
W=$(mktemp -d /tmp/verbsrefusals.XXXXXX)
say() { echo "[guest] $*"; }

say "without ckpt: the layer passes the multicast attach to rxe"
timeout 60 env LD_PRELOAD="$LIB" "$APP" mcast 1 > "$W/plain.out" 2>&1 || { cat "$W/plain.out"; exit 3; }
echo "RESULT plain $(grep -m1 '^ready' "$W/plain.out")"

CKPTD_LOG_GREP="WARN|ERROR|channel|layer|refus"
. "$(dirname "$0")/standalone.sh"

ticks() { grep -c '^tick ' "$1" 2>/dev/null || true; }
registered=0
# The layer says hello when the program opens the device; a check needs it registered.
one_more_registered() {
    registered=$((registered + 1))
    for _ in $(seq 100); do
        [ "$(grep -c 'ib-quiesce channel registered' "$W/ckptd.log")" -ge $registered ] && return 0
        sleep 0.1
    done
}
for mode in none fd mcast; do
    JOB=$("$BIN/ckptctl" run --name "refuse-$mode" -- env LD_PRELOAD="$LIB" "$APP" "$mode" 300)
    OUT=$W/state/jobs/$JOB/stdout
    say "$mode: job $JOB started"
    for _ in $(seq 300); do [ "$(ticks "$OUT")" -gt 0 ] && break; sleep 0.1; done
    [ "$(ticks "$OUT")" -gt 0 ] || { say "$mode: no tick"; cat "$OUT" "${OUT%stdout}stderr"; exit 4; }
    echo "RESULT $mode $(grep -m1 '^ready' "$OUT")"
    one_more_registered
    if "$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/$mode.ckpt" 2>&1; then
        echo "RESULT $mode checkpointed"
        [ "$mode" = none ] || { cat "$W/$mode.ckpt"; exit 5; }
    else
        echo "RESULT $mode refused: $(grep -m1 'process [0-9]* (' "$W/$mode.ckpt" || cat "$W/$mode.ckpt")"
        [ "$mode" != none ] || { cat "$W/$mode.ckpt"; exit 6; }
    fi
    before=$(ticks "$OUT")
    sleep 2
    after=$(ticks "$OUT")
    echo "RESULT $mode runs on: $((after - before)) ticks in 2 s"
    "$BIN/ckptctl" status "$JOB" | head -1
    "$BIN/ckptctl" cancel "$JOB" > /dev/null 2>&1 || true
done

# An asynchronous event got and not acknowledged: the device's destroy of the SRQ waits for the
# acknowledgement, so the layer gives it at the release; the program's own, after the restore of
# its objects, must not reach the new SRQ (one too many would make its next destroy wait
# forever: the second checkpoint).
mkdir -m 700 "$W/event-status"
JOB=$("$BIN/ckptctl" run --name refuse-event -- env LD_PRELOAD="$LIB" VERBS_REFUSALS_ACK="$W/ack" \
    CKPT_VERBS_STATUS="$W/event-status" "$APP" event 300)
OUT=$W/state/jobs/$JOB/stdout
say "event: job $JOB started"
for _ in $(seq 300); do grep -q '^event srq limit reached' "$OUT" 2>/dev/null && break; sleep 0.1; done
grep -q '^event srq limit reached' "$OUT" || { say "event: none came"; cat "$OUT" "${OUT%stdout}stderr"; exit 4; }
echo "RESULT event $(grep -m1 '^ready' "$OUT"): $(grep -m1 '^event' "$OUT")"
one_more_registered
for round in 1 2; do
    if timeout 120 "$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/event$round.ckpt" 2>&1; then
        echo "RESULT event checkpoint $round ok"
    else
        echo "RESULT event checkpoint $round failed: $(head -c 300 "$W/event$round.ckpt" | tr '\n' ' ')"
        "$BIN/ckptctl" status "$JOB"; tail -n 20 "${OUT%stdout}stderr"; exit 6
    fi
    if [ $round = 1 ]; then
        touch "$W/ack"
        for _ in $(seq 100); do grep -q '^event acknowledged' "$OUT" && break; sleep 0.1; done
        echo "RESULT event $(grep -m1 '^event ack' "$OUT" || echo 'not acknowledged')"
    fi
done
before=$(ticks "$OUT")
sleep 2
echo "RESULT event runs on: $(( $(ticks "$OUT") - before )) ticks in 2 s"
echo "RESULT event layer $(cat "$W"/event-status/*.json 2>/dev/null | tr -d '\n')"
"$BIN/ckptctl" cancel "$JOB" > /dev/null 2>&1 || true

# The newer post calls: sessions of ibv_wr_* on an extended QP, through a checkpoint, a kill
# and a restart (its real QPs made again) and a checkpoint after the restart.
mkdir -m 700 "$W/wr-status"
JOB=$("$BIN/ckptctl" run --name wr -- env LD_PRELOAD="$LIB" CKPT_VERBS_STATUS="$W/wr-status" \
    "$WR" 900)
OUT=$W/state/jobs/$JOB/stdout
say "wr: job $JOB started"
wr_ticks() { grep -c '^tick ' "$OUT" 2>/dev/null || true; }
wr_more() { # at least N more ticks than now, within 60 s
    local want=$(( $(wr_ticks) + $1 ))
    for _ in $(seq 600); do [ "$(wr_ticks)" -ge "$want" ] && return 0; sleep 0.1; done
    say "wr: no progress"; tail -n 5 "$OUT"; tail -n 20 "${OUT%stdout}stderr"; exit 4
}
wr_more 5
echo "RESULT wr $(grep -m1 '^ready' "$OUT")"
one_more_registered
"$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/wr1.ckpt" 2>&1 || { cat "$W/wr1.ckpt"; exit 7; }
echo "RESULT wr checkpoint 1 ok"
wr_more 5
"$BIN/ckptctl" checkpoint "$JOB" --kill > "$W/wr2.ckpt" 2>&1 || { cat "$W/wr2.ckpt"; exit 7; }
for _ in $(seq 100); do "$BIN/ckptctl" status "$JOB" | head -1 | grep -Eq 'stopped|killed' && break; sleep 0.1; done
echo "RESULT wr stopped at $(tail -n 1 "$OUT")"
rm -f "$W"/wr-status/*.json
"$BIN/ckptctl" restart "$JOB" > "$W/wr.restart" 2>&1 || { cat "$W/wr.restart"; exit 8; }
echo "RESULT wr restarted"
wr_more 5
"$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/wr3.ckpt" 2>&1 || { cat "$W/wr3.ckpt"; exit 7; }
echo "RESULT wr checkpoint 3 ok"
wr_more 5
echo "RESULT wr last $(tail -n 1 "$OUT")"
grep -q 'verbs_wr:' "${OUT%stdout}stderr" && { say "wr: it complained:"; cat "${OUT%stdout}stderr"; }
echo "RESULT wr layer $(cat "$W"/wr-status/*.json 2>/dev/null | tr -d '\n')"
"$BIN/ckptctl" cancel "$JOB" > /dev/null 2>&1 || true
