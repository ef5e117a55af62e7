# Sourced by the benchmark scripts that run in a soft-RoCE QEMU guest (scripts/testvm.sh) after
# their options are read. Needs NAME (for messages), REPO, BUILD (empty: --no-build), BIN and
# APPS. Defines log, die and prepare_memwrite_bench, checks for root and a prepared test VM, and
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
