# Sourced by the benchmark scripts that run in a soft-RoCE QEMU guest (scripts/testvm.sh) after
# their options are read. Needs NAME (for messages), REPO, BUILD (empty: --no-build), BIN and
# APPS. Defines log and die, checks for root and a prepared test VM, and refuses to build when
# --bin/--apps name binaries built elsewhere.
log() { echo "$NAME: $*" >&2; }
die() { log "$*"; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root (QEMU guest with the host root shared)"
[ -f "${CKPT_VM_DIR:-/var/cache/ckpt-vm}/abi" ] || die "no test VM prepared (scripts/setup.sh --vm)"
if [ -n "$BUILD" ]; then
    [ "$BIN" = "$REPO/target/release" ] && [ "$APPS" = "$REPO/target/apps" ] \
        || die "--bin/--apps name binaries built elsewhere: add --no-build"
fi
