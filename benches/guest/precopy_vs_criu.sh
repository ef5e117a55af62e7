#!/usr/bin/env bash
# Runs inside one test guest for benches/precopy_vs_criu.sh (the guest's kernel tracks written
# pages; the host's does not). For each rewrite percentage P: tests/apps/memwrite holding MIB MiB
# and rewriting P % of it per step (a step each time the bench sends it SIGUSR1), twice:
#   criu: dumped K times by raw `criu dump` (cgroup frozen, dump, thaw: the full dump a
#         checkpoint without pre-copy makes), each into a fresh directory, one step before each;
#   ckpt: under ckptd with pre-copy, checkpointed K times, each time after a pre-dump was ready
#         and exactly one step of P % ran after it, so the dump writes what one step changed.
# Prints one "RUN mode=M pct=P ckpt=I frozen_ms= dump_bytes=" line per dump: for criu the time
# from freeze to thaw, for ckpt the epoch's frozen time as ckptd measured it; dump_bytes are the
# page bytes written while frozen.
#
# Environment: BIN (ckptd, ckptctl), MEMWRITE (the memwrite binary), CRIU, MIB, PCTS ("1 10 50"),
# K.
set -eu
: "${BIN:?}" "${MEMWRITE:?}" "${CRIU:?}" "${MIB:?}" "${PCTS:?}" "${K:?}"
W=$(mktemp -d /tmp/precopybench.XXXXXX)
# Staging and raw dumps in memory of their own (the guest's root is a 1 GiB tmpfs overlay).
mount -t tmpfs -o size="${TMPFS:-4g}" precopybench "$W"
say() { echo "[guest] $*"; }
echo "GUEST kernel $(uname -r), $(nproc) vCPUs, $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) MiB"
"$CRIU" check --feature mem_dirty_track > /dev/null 2>&1 || { say "no dirty tracking here"; exit 3; }

# Waits (at most $2 s) until file $1 has more "iter" lines than $3; prints the count.
wait_iters() {
    local n
    for _ in $(seq $(( $2 * 10 ))); do
        n=$(grep -c '^iter' "$1" 2>/dev/null || true)
        if [ "${n:-0}" -gt "$3" ]; then echo "$n"; return 0; fi
        sleep 0.1
    done
    say "no progress in $1"; tail -n 5 "$1"; exit 4
}
page_bytes() { find "$1" -maxdepth 1 -name 'pages-*.img' -printf '%s\n' | awk '{s += $1} END {print s + 0}'; }
ms() { date +%s%3N; }
# Runs one step of memwrite $1 (writing to file $2) and waits until it printed it.
step() {
    local n; n=$(grep -c '^iter' "$2" || true)
    kill -USR1 "$1"
    wait_iters "$2" 600 "$n" > /dev/null
}
STEPS=100000

CG=/sys/fs/cgroup/precopybench
for pct in $PCTS; do
    # Raw CRIU: full dumps of the same tree.
    mkdir -p "$CG"
    ( echo $BASHPID > "$CG/cgroup.procs"; exec setsid "$MEMWRITE" "$MIB" "$pct" "$STEPS" -1 ) > "$W/raw.out" 2>&1 &
    PID=$!
    wait_iters "$W/raw.out" 600 0 > /dev/null
    for i in $(seq "$K"); do
        D=$W/raw-$i; mkdir -p "$D"
        step "$PID" "$W/raw.out"
        t0=$(ms)
        echo 1 > "$CG/cgroup.freeze"
        while ! grep -q '^frozen 1' "$CG/cgroup.events"; do sleep 0.001; done
        "$CRIU" dump -t "$PID" -D "$D" -o dump.log --leave-running --freeze-cgroup "$CG" \
            || { say "criu dump failed"; tail -n 20 "$D/dump.log"; exit 5; }
        echo 0 > "$CG/cgroup.freeze"
        t1=$(ms)
        echo "RUN mode=criu pct=$pct ckpt=$i frozen_ms=$((t1 - t0)) dump_bytes=$(page_bytes "$D")"
        rm -rf "$D"
        sleep 1
    done
    kill -9 "$PID"; wait "$PID" 2>/dev/null || true
    rmdir "$CG" 2>/dev/null || true

    # ckpt with pre-copy: one pre-dump after each start or checkpoint, none more.
    rm -rf "$W/ck"; mkdir -p "$W/ck"
    export CKPT_SOCKET=$W/ck/ckptd.sock
    cat > "$W/ck/ckptd.toml" <<TOML
listen = "127.0.0.1:0"
socket = "$W/ck/ckptd.sock"
database = "$W/ck/ckptd.redb"
tls_dir = "$W/ck/tls"
[agent]
state_dir = "$W/ck/state"
local_dir = "$W/ck/local"
allow_root_jobs = true
[agent.precopy]
first_after = "1s"
check_every = "200ms"
min_interval = "1h"
[retention]
keep_local = 1
TOML
    "$BIN/ckptd" --standalone --config "$W/ck/ckptd.toml" > "$W/ck/ckptd.log" 2>&1 &
    CKPTD=$!
    for _ in $(seq 200); do "$BIN/ckptctl" list > /dev/null 2>&1 && break; sleep 0.1; done
    JOB=$("$BIN/ckptctl" run --json -- "$MEMWRITE" "$MIB" "$pct" "$STEPS" -1 \
        | sed -n 's/.*"id":\([0-9]*\).*/\1/p' | head -n 1)
    [ -n "$JOB" ] || { say "ckptctl run failed"; tail -n 20 "$W/ck/ckptd.log"; exit 6; }
    OUT=$W/ck/state/jobs/$JOB/stdout
    wait_iters "$OUT" 600 0 > /dev/null
    MW=$(pgrep -xn memwrite) || { say "memwrite not found"; exit 6; }
    # Epoch 1 is a warm-up, not reported: its pre-dump may have caught the job still filling
    # its memory.
    for i in $(seq $((K + 1))); do
        for _ in $(seq 3000); do
            "$BIN/ckptctl" status "$JOB" | grep -q 'pre-dump ready' && break
            sleep 0.1
        done
        "$BIN/ckptctl" status "$JOB" | grep -q 'pre-dump ready' \
            || { say "no pre-dump"; "$BIN/ckptctl" status "$JOB"; tail -n 30 "$W/ck/ckptd.log"; exit 7; }
        # Exactly one step after the pre-dump.
        step "$MW" "$OUT"
        "$BIN/ckptctl" checkpoint "$JOB" --wait > "$W/ck/checkpoint.out" 2>&1 \
            || { say "checkpoint failed"; tail -c 2000 "$W/ck/checkpoint.out"; exit 8; }
        e=$("$BIN/ckptctl" epochs "$JOB" --json | tr '{' '\n' | grep "\"epoch\":$i," )
        frozen=$(echo "$e" | grep -o '"frozen_ms":[0-9]*' | cut -d: -f2)
        D=$(ls -d "$W"/ck/local/"$JOB"/"$i"/*/images)
        [ "$i" -gt 1 ] || continue
        echo "RUN mode=ckpt pct=$pct ckpt=$((i - 1)) frozen_ms=$frozen dump_bytes=$(page_bytes "$D") chain_bytes=$(cat "$D"/../pre/*/pages-*.img | wc -c)"
    done
    "$BIN/ckptctl" cancel "$JOB" > /dev/null 2>&1 || true
    kill "$CKPTD"; wait "$CKPTD" 2>/dev/null || true
    grep -E "WARN|ERROR" "$W/ck/ckptd.log" | tail -n 5 || true
    rm -rf "$W/ck"
done
