# Sourced by the benchmark scripts that run in a soft-RoCE QEMU guest (scripts/testvm.sh) after
# their options are read. Needs NAME (for messages), REPO, BUILD (empty: --no-build), BIN and
# APPS. Defines log, die, prepare_memwrite_bench, run_guest and report_head, checks for root and a prepared test VM, and
# refuses to build when --bin/--apps name binaries built elsewhere.
log() { echo "$NAME: $*" >&2; }
die() { log "$*"; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root (QEMU guest with the host root shared)"
[ -f "${CKPT_VM_DIR:-/var/cache/ckpt-vm}/abi" ] || die "no test VM prepared (scripts/setup.sh --vm)"
if [ -n "$BUILD" ]; then
    [ "$BIN" = "$REPO/target/release" ] && [ "$APPS" = "$REPO/target/apps" ] \
        || die "--bin/--apps name binaries built elsewhere: add --no-build"
fi

# For the benchmarks of tests/apps/memwrite: builds (unless --no-build) the daemons, ckpt-rsh and
# memwrite, sets CRIU, and checks that each file named in "$@" exists.
prepare_memwrite_bench() {
    if [ -n "$BUILD" ]; then
        log "building ckptd, ckptctl, ckpt-agent, ckpt-rsh and memwrite (release)"
        (cd "$REPO" && cargo build --release -p ckptd -p ckptctl -p node-agent) >&2
        make -s -C "$REPO/tests/apps" OUT="$REPO/target/apps" "$REPO/target/apps/memwrite" >&2
    fi
    CRIU=/opt/ckpt/criu/bin/criu
    [ -x "$CRIU" ] || CRIU=$(command -v criu) || die "no criu (scripts/setup.sh installs it)"
    local f
    for f in "$@"; do
        [ -f "$f" ] || die "missing $f (drop --no-build)"
    done
}

# Boots one guest named $1 that runs $TMP/guest.sh (memory MEM, bound TIMEOUT), saying "booting
# the guest ($2)"; its console goes to $TMP/console.txt. Sets LOAD (the host's load before),
# OTHERS (QEMU guests already running) and WALL (seconds). A failed guest ends the bench with
# the console's tail.
run_guest() {
    LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
    OTHERS=$(pgrep -xc qemu-system-x86 || true)
    [ "$OTHERS" = 0 ] || log "warning: $OTHERS other QEMU guest(s) running; the numbers will be noisy"
    local begin=$SECONDS rc=0
    log "booting the guest ($2)"
    "$REPO/scripts/testvm.sh" run "$TMP/guest.sh" name="$1" mem="$MEM" timeout="$TIMEOUT" \
        > "$TMP/console" 2>&1 || rc=$?
    WALL=$((SECONDS - begin))
    tr -d '\r' < "$TMP/console" > "$TMP/console.txt"
    [ "$rc" = 0 ] || { tail -n 80 "$TMP/console.txt" >&2; die "guest failed (status $rc)"; }
}

# The first lines of a report: the bench, when, its arguments (ARGS), the host and the guest.
report_head() {
    echo "# $NAME — $(date -u '+%F %H:%M UTC')"
    echo "# args: ${ARGS:-(none)}; host $(nproc) cores, load before $LOAD, other guests $OTHERS; wall ${WALL} s"
    grep '^GUEST' "$TMP/console.txt" | sed 's/^/# /'
}
