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
#
# Last, tests/apps/verbs_newqp as two processes of one job at two addresses of the guest (a
# second IPv4 address on eth0 gives rxe0 a second GID) that meet only after a checkpoint: each
# layer is sent the endpoints at its own address only, then asks the agent for the other's
# when the program makes its address handle; messages must reach the QP they name, and each
# completion must name the sender's QP by the number it published; then a kill and a restart.
# Prints "RESULT ..." lines for the e2e test.
#
# Environment: BIN (release binaries), LIB (libckpt_verbs.so), APP (verbs_refusals),
# WR (verbs_wr), NEWQP (verbs_newqp).
set -eu
: "${BIN:?}" "${LIB:?}" "${APP:?}" "${WR:?}" "${NEWQP:?}"
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

# Two addresses, two processes that meet after a checkpoint: lookups.
ip addr add 10.0.9.15/24 dev eth0
v4gids() { cat /sys/class/infiniband/rxe0/ports/1/gids/* 2>/dev/null | grep -c '^0000:0000:0000:0000:0000:ffff:' || true; }
for _ in $(seq 100); do [ "$(v4gids)" -ge 2 ] && break; sleep 0.1; done
[ "$(v4gids)" -ge 2 ] || { say "meet: rxe0 has no second IPv4 GID"; cat /sys/class/infiniband/rxe0/ports/1/gids/*; exit 9; }
D=$W/meet && mkdir -p "$D" && mkdir -m 700 "$W/meet-status"
JOB=$("$BIN/ckptctl" run --name meet -- env LD_PRELOAD="$LIB" CKPT_VERBS_STATUS="$W/meet-status" \
    NEWQP_MEET=1 sh -c "NEWQP_GID_NTH=0 $NEWQP $D p q & NEWQP_GID_NTH=1 $NEWQP $D q p & wait")
say "meet: job $JOB started"
field() { awk -v k="$2" '{ for (i = 1; i < NF; i++) if ($i == k) print $(i + 1) }' "$D/$1.status" 2>/dev/null; }
meet_wait() { # both processes have PEERS peers and got 10 more messages than now, within 60 s
    local want_p=$(( $(field p ok || echo 0) + 10 )) want_q=$(( $(field q ok || echo 0) + 10 ))
    for _ in $(seq 600); do
        [ "$(field p peers)" = "$1" ] && [ "$(field q peers)" = "$1" ] \
            && [ "$(field p ok)" -ge $want_p ] && [ "$(field q ok)" -ge $want_q ] && return 0
        sleep 0.1
    done
    say "meet: no traffic with $1 peer(s)"; cat "$D"/*.status; cat "$W/state/jobs/$JOB/stdout"; exit 10
}
for _ in $(seq 300); do [ -e "$D/p.status" ] && [ -e "$D/q.status" ] && break; sleep 0.1; done
one_more_registered; one_more_registered # p and q
echo "RESULT meet $(grep '^ready' "$W/state/jobs/$JOB/stdout" | sort | tr '\n' ' ')"
"$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/meet1.ckpt" 2>&1 || { cat "$W/meet1.ckpt"; exit 11; }
echo "RESULT meet checkpoint 1 ok"
touch "$D/meet"
meet_wait 1
say "meet: met; checkpoint --kill and restart"
"$BIN/ckptctl" checkpoint "$JOB" --kill > "$W/meet2.ckpt" 2>&1 || { cat "$W/meet2.ckpt"; exit 11; }
for _ in $(seq 100); do "$BIN/ckptctl" status "$JOB" | head -1 | grep -Eq 'stopped|killed' && break; sleep 0.1; done
for f in "$W"/meet-status/*.json; do echo "RESULT meet before restart $(tr -d '\n' < "$f")"; done
rm -f "$W"/meet-status/*.json
"$BIN/ckptctl" restart "$JOB" > "$W/meet.restart" 2>&1 || { cat "$W/meet.restart"; exit 12; }
meet_wait 1
"$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/meet3.ckpt" 2>&1 || { cat "$W/meet3.ckpt"; exit 11; }
meet_wait 1
for n in p q; do echo "RESULT meet $n $(cat "$D/$n.status")"; done
for f in "$W"/meet-status/*.json; do echo "RESULT meet after restart $(tr -d '\n' < "$f")"; done
"$BIN/ckptctl" cancel "$JOB" > /dev/null 2>&1 || true
