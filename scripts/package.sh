#!/usr/bin/env bash
# Build ckpt's Debian packages with cargo-deb (docs/packages.md):
#   ckpt-daemons  ckptd, ckpt-agent, ckpt-rsh, ckpt-init, the verbs layer and CRIU plugin, the
#                 systemd units, /etc/ckpt/{ckptd,agent}.toml, and the private CRIU
#   ckpt-client   ckptctl, its manual pages, bash/zsh/fish completion
#
# Usage: scripts/package.sh [--no-build] [--out DIR] [--revision N]
#   --no-build    package the release build already in the target directory (as the tests do)
#   --out DIR     where the .deb files go (default: TARGET/debian)
#   --revision N  the Debian revision (default 1): a rebuild of the same version to upgrade to
# Environment:
#   CARGO_TARGET_DIR    the build directory (default: target)
#   CKPT_CRIU_PREFIX    the private CRIU bundled into ckpt-daemons (default /opt/ckpt/criu, as
#                       scripts/setup.sh installs it; CKPT_FORCE_PRIVATE_CRIU=1 scripts/setup.sh
#                       makes one on a machine whose own criu is recent enough)
# Prints the paths of the two packages on stdout, one per line.
set -euo pipefail

CARGO_DEB_VERSION=3.8.0
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
PREFIX=${CKPT_CRIU_PREFIX:-/opt/ckpt/criu}
ARCH_TRIPLET=x86_64-linux-gnu
# Where ckpt-daemons puts the CRIU (the agent's `[criu] path = "auto"` looks there first).
CRIU_DEST=/usr/lib/ckpt/criu

log() { printf '[package] %s\n' "$*" >&2; }
die() { printf '[package] ERROR: %s\n' "$*" >&2; exit 1; }

BUILD=1
OUT=""
REVISION=1
while (($#)); do
    case "$1" in
        --no-build) BUILD=0 ;;
        --out)
            (($# >= 2)) || die "--out needs a directory"
            OUT=$2
            shift
            ;;
        --out=*) OUT=${1#--out=} ;;
        --revision)
            (($# >= 2)) && [[ $2 =~ ^[0-9]+$ ]] || die "--revision needs a number"
            REVISION=$2
            shift
            ;;
        -h | --help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done
OUT=${OUT:-$TARGET/debian}
export CARGO_TARGET_DIR=$TARGET

command -v dpkg-shlibdeps >/dev/null || die "dpkg-shlibdeps missing: apt-get install dpkg-dev (or run scripts/setup.sh)"
if [[ "$(cargo deb --version 2>/dev/null || true)" != *" $CARGO_DEB_VERSION"* ]]; then
    log "installing cargo-deb $CARGO_DEB_VERSION (crates.io)"
    # Built apart from ckpt's build directory (cargo install would use CARGO_TARGET_DIR).
    env -u CARGO_TARGET_DIR cargo install --quiet --locked cargo-deb --version "$CARGO_DEB_VERSION" >&2 ||
        die "cargo install cargo-deb failed"
fi

if ((BUILD)); then
    log "building the release binaries"
    (cd "$ROOT" && cargo build --release --locked --workspace --lib --bins >&2)
fi
REL=$TARGET/release
for f in ckptd ckpt-agent ckpt-rsh ckpt-init ckptctl libckpt_verbs.so libckpt_criu_verbs.so; do
    [[ -f $REL/$f ]] || die "$REL/$f missing: build first (drop --no-build)"
done

# The CRIU: the private prefix's binary and library closure, run through its own loader. Its
# Debian copyright files go to the docs.
[[ -x $PREFIX/usr/sbin/criu && -e $PREFIX/usr/lib/$ARCH_TRIPLET/ld-linux-x86-64.so.2 ]] ||
    die "no private CRIU in $PREFIX: run CKPT_FORCE_PRIVATE_CRIU=1 scripts/setup.sh (or set CKPT_CRIU_PREFIX)"
STAGE=$REL/pkg
rm -rf "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/criu/usr" "$STAGE/criu/bin" "$STAGE/criu-doc" "$STAGE/client/man"
# The release build keeps debug information (for backtraces and perf); packages do not.
for f in ckptd ckpt-agent ckpt-rsh ckpt-init ckptctl libckpt_verbs.so libckpt_criu_verbs.so; do
    strip --strip-debug -o "$STAGE/bin/$f" "$REL/$f"
done
for d in sbin lib lib64 libexec; do
    [[ -e $PREFIX/usr/$d ]] && cp -a "$PREFIX/usr/$d" "$STAGE/criu/usr/"
done
rm -f "$STAGE/criu/usr/lib/$ARCH_TRIPLET"/*.a
cp -a "$PREFIX/usr/share/doc/." "$STAGE/criu-doc/"
# setup.sh's wrapper, pointed at where the package puts the prefix.
grep -q '^P=' "$PREFIX/bin/criu" || die "$PREFIX/bin/criu is not the wrapper scripts/setup.sh writes"
sed "s|^P=.*|P=$CRIU_DEST|" "$PREFIX/bin/criu" >"$STAGE/criu/bin/criu"
chmod 755 "$STAGE/criu/bin/criu"

# ckptctl's manual pages and completion, from ckptctl itself.
"$REL/ckptctl" manual "$STAGE/client/man"
gzip -9n "$STAGE/client/man"/*.1
"$REL/ckptctl" completions bash >"$STAGE/client/ckptctl.bash"
"$REL/ckptctl" completions zsh >"$STAGE/client/_ckptctl"
"$REL/ckptctl" completions fish >"$STAGE/client/ckptctl.fish"

# The tests ask for --fast compression (CKPT_PACKAGE_FAST=1): larger packages, made sooner.
mkdir -p "$OUT"
DEB_ARGS=(--no-build --locked --no-strip --quiet --deb-revision "$REVISION" --output "$OUT")
[[ ${CKPT_PACKAGE_FAST:-0} == 1 ]] && DEB_ARGS+=(--fast)
declare -A DEB
for pair in ckptd:ckpt-daemons ckptctl:ckpt-client; do
    crate=${pair%%:*} name=${pair#*:}
    log "cargo deb -p $crate ($name)"
    (cd "$ROOT" && cargo deb -p "$crate" "${DEB_ARGS[@]}" >&2) || die "cargo deb -p $crate failed"
    DEB[$name]=$(ls -t "$OUT/${name}"_*-"${REVISION}"_*.deb | head -1)
done

# The daemons' Depends are written by hand (the bundled CRIU brings its own libraries): every
# package that dpkg-shlibdeps finds ckpt's own binaries need must be in them (libgcc-s1 aside,
# which libc6 itself depends on, and which cargo-deb leaves out too).
check_depends() {
    local deb=$1 have need p
    shift
    have=$(dpkg-deb -f "$deb" Depends)
    need=$(cd "$(mktemp -d)" && mkdir debian && touch debian/control &&
        dpkg-shlibdeps -xlibgcc-s1 -O "$@" 2>/dev/null | sed 's/^shlibs:Depends=//')
    for p in $(tr ',' '\n' <<<"$need" | awk '{print $1}'); do
        [[ $have == *"$p"* ]] || die "$(basename "$deb") does not depend on $p, which its binaries need (dpkg-shlibdeps: $need)"
    done
}
check_depends "${DEB[ckpt-daemons]}" "$STAGE"/bin/{ckptd,ckpt-agent,ckpt-rsh,ckpt-init,libckpt_verbs.so,libckpt_criu_verbs.so}
check_depends "${DEB[ckpt-client]}" "$STAGE/bin/ckptctl"
printf '%s\n' "${DEB[ckpt-daemons]}" "${DEB[ckpt-client]}"
