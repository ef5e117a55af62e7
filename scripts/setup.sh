#!/usr/bin/env bash
# Provision a Debian 12 (bookworm) machine for ckpt: system build/MPI deps and CRIU >= 4.2.
# Run as root. Idempotent: a second run only verifies and prints the summary.
#
# CRIU: a system criu >= 4.2 whose `criu check` passes is used as is. Otherwise criu 4.2.x is taken
# from Debian unstable (sid) and unpacked, with its whole library closure (including sid's libc),
# into a private prefix (default /opt/ckpt/criu) and started through the prefix's own dynamic loader
# by the wrapper PREFIX/bin/criu. The system's apt configuration and package state are not touched
# for that: sid is used only through a private sources list and private state/cache directories.
# The chosen criu path is written to /etc/ckpt/criu-path.
#
# Options:
#   --vm    also set up the soft-RoCE test VM (scripts/testvm.sh): QEMU, busybox, rdma-core tools,
#           and Debian's kernel package unpacked under /var/cache/ckpt-vm (not installed)
#   --dmtcp PREFIX   where DMTCP is installed (PREFIX/bin/dmtcp_launch), for the summary and
#           /etc/ckpt/dmtcp-path. Without it: dmtcp_launch on PATH, else /opt/dmtcp. DMTCP is
#           optional (`ckptctl run --engine dmtcp`); no registry packages it, so this script
#           never installs it: docs/dmtcp.md says how a site builds it.
#
# Environment:
#   CKPT_CRIU_PREFIX     private prefix for sid's criu (default /opt/ckpt/criu)
#   CKPT_FORCE_PRIVATE_CRIU=1   ignore a system criu and use the private one
#   CKPT_SID_MIRROR      override the Debian mirror URL used for sid (default: the system's configured
#                        bookworm/stable source; without one, setup stops and says what to add)
set -euo pipefail

PREFIX="${CKPT_CRIU_PREFIX:-/opt/ckpt/criu}"
CONF_DIR=/etc/ckpt
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
MIN_CRIU_MAJOR=4
MIN_CRIU_MINOR=2
ARCH_TRIPLET=x86_64-linux-gnu
START_TS=$(date +%s)

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

WITH_VM=0
DMTCP_PREFIX=""
while (($#)); do
    case "$1" in
        --vm) WITH_VM=1 ;;
        --dmtcp)
            (($# >= 2)) || die "--dmtcp needs the DMTCP install prefix (e.g. --dmtcp /opt/dmtcp)"
            DMTCP_PREFIX="$2"
            shift
            ;;
        --dmtcp=*) DMTCP_PREFIX="${1#--dmtcp=}" ;;
        *) die "unknown option $1 (see the head of $0)" ;;
    esac
    shift
done

[[ $(id -u) -eq 0 ]] || die "must run as root"
[[ $(uname -m) == x86_64 ]] || die "only x86_64 is supported (got $(uname -m))"
export DEBIAN_FRONTEND=noninteractive

# ---------------------------------------------------------------------------------------------
# 1. System packages
# ---------------------------------------------------------------------------------------------
# slurmctld, slurmd, slurm-client and munge: the batch-system tests start their own daemons
# (nothing is enabled or started by this script).
# libibverbs-dev, libclang-dev and cmake build ib-quiesce's rdma-core binding (ibverbs-sys runs
# cmake and bindgen); ibverbs-providers gives it the devices at run time.
PKGS=(build-essential pkg-config mpich libmpich-dev openmpi-bin libopenmpi-dev
      protobuf-compiler libprotobuf-dev nftables iptables iproute2 util-linux procps e2fsprogs
      debian-archive-keyring libibverbs-dev ibverbs-providers libclang-dev cmake
      slurmctld slurmd slurm-client munge)
# prometheus (the server and promtool): the metrics test scrapes the daemons with its own
# Prometheus on loopback; the packaged service is stopped and disabled right after install.
PKGS+=(prometheus)
# etcd-server and openssl: the standby-ckptd tests run their own 3-member etcd on loopback, with
# TLS from a CA they make with openssl; the packaged
# service is stopped and disabled right after install.
PKGS+=(etcd-server openssl)
# dpkg-dev (dpkg-shlibdeps), debootstrap and zstd: scripts/package.sh builds the Debian packages
# and their test installs them on a fresh Debian 12 root made by debootstrap.
PKGS+=(dpkg-dev debootstrap zstd)
command -v systemd-analyze >/dev/null 2>&1 || PKGS+=(systemd)
((WITH_VM)) && PKGS+=(qemu-system-x86 busybox-static cpio rdma-core ibverbs-utils ibverbs-providers)

pkg_installed() {
    [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" == installed ]]
}

missing=()
for p in "${PKGS[@]}"; do pkg_installed "$p" || missing+=("$p"); done
if ((${#missing[@]})); then
    log "installing system packages: ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    if [[ " ${missing[*]} " == *" etcd-server "* ]]; then
        if [[ -d /run/systemd/system ]]; then
            systemctl disable --now etcd.service >/dev/null 2>&1 || true
        else
            deb-systemd-helper disable etcd.service >/dev/null 2>&1 || true
        fi
    fi
    if [[ " ${missing[*]} " == *" prometheus "* ]]; then
        if [[ -d /run/systemd/system ]]; then
            systemctl disable --now prometheus.service >/dev/null 2>&1 || true
        else
            deb-systemd-helper disable prometheus.service >/dev/null 2>&1 || true
        fi
    fi
else
    log "system packages already installed"
fi

for b in mpicc.mpich mpiexec.mpich mpicc.openmpi mpirun.openmpi protoc nft promtool; do
    command -v "$b" >/dev/null 2>&1 || die "expected program '$b' not found after install"
done

if ((WITH_VM)); then
    log "preparing the soft-RoCE test VM"
    apt-get update -qq
    "$(dirname "$0")/testvm.sh" prepare || die "test VM preparation failed"
fi

# Rust toolchain: cannot be downloaded here (no rustup); just check.
CARGO=$(command -v cargo || true)
[[ -z $CARGO && -x /root/.cargo/bin/cargo ]] && CARGO=/root/.cargo/bin/cargo
if [[ -z $CARGO ]]; then
    die "cargo not found: ckpt needs a Rust toolchain >= 1.85 (install it with rustup or your distribution, then re-run)"
fi
RUSTC_VER=$("$(dirname "$CARGO")/rustc" --version 2>/dev/null || rustc --version 2>/dev/null || echo "rustc ?")
if [[ $RUSTC_VER =~ rustc\ 1\.([0-9]+) ]] && ((BASH_REMATCH[1] < 85)); then
    die "Rust >= 1.85 required, found: $RUSTC_VER"
fi

# ---------------------------------------------------------------------------------------------
# 2. CRIU >= 4.2
# ---------------------------------------------------------------------------------------------
# criu_version BIN -> prints "X.Y[.Z]" or nothing
criu_version() {
    "$1" --version 2>/dev/null | sed -n 's/^Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1
}
version_ok() {  # version_ok X.Y.Z
    local maj min
    IFS=. read -r maj min _ <<<"$1"
    [[ -n $maj && -n $min ]] || return 1
    ((maj > MIN_CRIU_MAJOR || (maj == MIN_CRIU_MAJOR && min >= MIN_CRIU_MINOR)))
}
criu_usable() {  # criu_usable BIN: version >= 4.2 and `criu check` passes
    local v
    v=$(criu_version "$1")
    [[ -n $v ]] && version_ok "$v" || return 1
    local out
    out=$("$1" check 2>&1 || true)
    [[ $out == *"Looks good"* ]]
}

# Debian mirror of the system (same host), used with suite sid.
detect_mirror() {
    local f uri=""
    if [[ -n ${CKPT_SID_MIRROR:-} ]]; then echo "$CKPT_SID_MIRROR"; return; fi
    # deb822 .sources: first URIs whose Suites mention bookworm (not -security)
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        uri=$(awk '
            /^[[:space:]]*$/ { if (u != "" && s ~ /(^|[[:space:]])(bookworm|stable)([[:space:]]|$)/) { print u; exit } u=""; s=""; next }
            /^URIs:/   { u=$2 }
            /^Suites:/ { $1=""; s=$0 }
            END { if (u != "" && s ~ /(^|[[:space:]])(bookworm|stable)([[:space:]]|$)/) print u }' "$f" | head -n1)
        [[ -n $uri ]] && break
    done
    if [[ -z $uri ]]; then
        # one-line format
        uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
              sed -e 's/#.*//' -e 's/\[[^]]*\]//' |
              awk '$1 == "deb" && ($3 == "bookworm" || $3 == "stable") { print $2; exit }')
    fi
    # No built-in fallback: a site without a configured Debian source (an air-gapped one with a
    # local mirror that is not listed, say) is told what to add instead of reaching out.
    [[ -n $uri ]] || return 1
    echo "$uri"
}

install_private_criu() {
    local mirror state="$PREFIX/.apt" dl="$PREFIX/.debs"
    mirror=$(detect_mirror) || die "no Debian source for bookworm (or stable) in /etc/apt/sources.list or /etc/apt/sources.list.d/: add your Debian mirror there (one-line format: 'deb MIRROR-URL bookworm main'), or set CKPT_SID_MIRROR=MIRROR-URL; CRIU >= 4.2 is taken from that mirror's suite sid"
    mirror=${mirror%/}
    log "installing criu from Debian sid ($mirror) into $PREFIX"
    [[ -f $KEYRING ]] || die "keyring $KEYRING missing (package debian-archive-keyring)"
    mkdir -p "$state/etc" "$state/lists/partial" "$state/cache/archives/partial" "$dl"
    echo "deb [signed-by=$KEYRING] $mirror sid main" >"$state/etc/sources.list"
    local APTOPT=(-o "Dir::Etc::sourcelist=$state/etc/sources.list" -o "Dir::Etc::sourceparts=-"
                  -o "Dir::State::Lists=$state/lists" -o "Dir::Cache=$state/cache"
                  -o "Dir::State::status=$state/empty-status"
                  -o "Acquire::Languages=none" -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root"
                  -o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
                  -o "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false"
                  -o "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false"
                  -o "Acquire::IndexTargets::deb::CNF::DefaultEnabled=false"
                  -o "Acquire::IndexTargets::deb::Contents-deb::DefaultEnabled=false")
    : >"$state/empty-status"   # pretend nothing is installed, so the closure is complete
    apt-get "${APTOPT[@]}" update -qq || die "apt-get update for sid failed"

    local cv
    cv=$(apt-cache "${APTOPT[@]}" show criu 2>/dev/null | sed -n 's/^Version: //p' | head -n1)
    [[ -n $cv ]] || die "no criu package in sid"
    log "sid criu version: $cv"
    version_ok "${cv#*:}" || die "sid criu $cv is older than $MIN_CRIU_MAJOR.$MIN_CRIU_MINOR"

    # Dependency closure (Depends + Pre-Depends only). Virtual packages show as <name>; their
    # providers are listed as well by --recurse, so they can just be dropped.
    local closure
    closure=$(apt-cache "${APTOPT[@]}" depends --recurse --no-recommends --no-suggests \
                --no-conflicts --no-breaks --no-replaces --no-enhances criu libcompel1 |
              grep -v '^[[:space:]]' | grep -v '^<' | sort -u)
    [[ -n $closure ]] || die "dependency resolution failed"
    log "packages: $(echo $closure)"

    rm -f "$dl"/*.deb
    (cd "$dl" && apt-get "${APTOPT[@]}" download -qq $closure) || die "apt-get download failed"

    local tmp
    tmp=$(mktemp -d "$PREFIX/.unpack.XXXXXX")
    for deb in "$dl"/*.deb; do dpkg -x "$deb" "$tmp"; done
    # replace the previous tree (everything but our hidden state dirs and bin/ wrapper)
    local e
    for e in "$tmp"/*; do
        rm -rf "${PREFIX:?}/$(basename "$e")"
        mv "$e" "$PREFIX/"
    done
    rmdir "$tmp"
    rm -rf "$dl"
    [[ -x $PREFIX/usr/sbin/criu ]] || die "criu binary missing after unpacking"
    [[ -e $PREFIX/usr/lib/$ARCH_TRIPLET/ld-linux-x86-64.so.2 ]] || die "loader missing in prefix"

    # Closure check: every library needed by criu must resolve inside the prefix.
    local missing_libs
    missing_libs=$("$PREFIX/usr/lib/$ARCH_TRIPLET/ld-linux-x86-64.so.2" \
        --library-path "$PREFIX/usr/lib/$ARCH_TRIPLET:$PREFIX/lib/$ARCH_TRIPLET" \
        --list "$PREFIX/usr/sbin/criu" | grep 'not found' || true)
    [[ -z $missing_libs ]] || die "unresolved libraries: $missing_libs"
    echo "$cv" >"$PREFIX/.criu-deb-version"
    rm -rf "$state/lists" "$state/cache"   # ~25 MB of sid indexes, not needed after install
}

write_wrapper() {
    mkdir -p "$PREFIX/bin"
    local w="$PREFIX/bin/criu" tmpw
    tmpw=$(mktemp "$PREFIX/bin/.criu.XXXXXX")
    cat >"$tmpw" <<EOF
#!/bin/sh
# criu from Debian sid, run through its own loader and libraries (generated by ckpt setup.sh)
P=$PREFIX
exec "\$P/usr/lib/$ARCH_TRIPLET/ld-linux-x86-64.so.2" \\
    --library-path "\$P/usr/lib/$ARCH_TRIPLET:\$P/lib/$ARCH_TRIPLET" \\
    "\$P/usr/sbin/criu" "\$@"
EOF
    chmod 755 "$tmpw"
    mv -f "$tmpw" "$w"
}

CRIU=""
SYS_CRIU=$(command -v criu 2>/dev/null || true)
[[ $SYS_CRIU == "$PREFIX/bin/criu" ]] && SYS_CRIU=""
if [[ -n $SYS_CRIU && ${CKPT_FORCE_PRIVATE_CRIU:-0} != 1 ]] && criu_usable "$SYS_CRIU"; then
    CRIU=$SYS_CRIU
    log "using system criu $SYS_CRIU ($(criu_version "$SYS_CRIU"))"
else
    [[ -n $SYS_CRIU ]] && log "system criu $SYS_CRIU ($(criu_version "$SYS_CRIU" || true)) not usable; using private prefix"
    mkdir -p "$PREFIX"
    if [[ -x $PREFIX/usr/sbin/criu && -x $PREFIX/bin/criu ]] && criu_usable "$PREFIX/bin/criu"; then
        log "private criu already installed in $PREFIX ($(criu_version "$PREFIX/bin/criu"))"
    else
        install_private_criu
        write_wrapper
    fi
    CRIU=$PREFIX/bin/criu
fi

# Verify: version, criu check, nftables network lock support.
CRIU_VER=$(criu_version "$CRIU")
version_ok "$CRIU_VER" || die "criu $CRIU reports version '$CRIU_VER' (< 4.2)"
check_out=$("$CRIU" check 2>&1 || true)
[[ $check_out == *"Looks good"* ]] || die "'$CRIU check' failed: $check_out"
nft_out=$("$CRIU" check --feature network_lock_nftables 2>&1 || true)
if [[ $nft_out == *"is supported"* ]]; then
    NFT_LOCK=supported
else
    NFT_LOCK="NOT supported ($(tail -n1 <<<"$nft_out"))"
    log "warning: criu nftables network lock: $NFT_LOCK"
fi

mkdir -p "$CONF_DIR"
if [[ "$(cat "$CONF_DIR/criu-path" 2>/dev/null || true)" != "$CRIU" ]]; then
    echo "$CRIU" >"$CONF_DIR/criu-path"
    log "wrote $CONF_DIR/criu-path"
fi

# ---------------------------------------------------------------------------------------------
# 3. DMTCP (optional; detected, never installed)
# ---------------------------------------------------------------------------------------------
DMTCP_LAUNCH=""
if [[ -n $DMTCP_PREFIX ]]; then
    [[ -x $DMTCP_PREFIX/bin/dmtcp_launch ]] ||
        die "--dmtcp $DMTCP_PREFIX: no $DMTCP_PREFIX/bin/dmtcp_launch (give the prefix DMTCP was installed to with 'make install')"
    DMTCP_LAUNCH="$DMTCP_PREFIX/bin/dmtcp_launch"
elif command -v dmtcp_launch >/dev/null 2>&1; then
    DMTCP_LAUNCH=$(command -v dmtcp_launch)
elif [[ -x /opt/dmtcp/bin/dmtcp_launch ]]; then
    DMTCP_LAUNCH=/opt/dmtcp/bin/dmtcp_launch
fi
if [[ -n $DMTCP_LAUNCH ]]; then
    DMTCP_VER=$("$DMTCP_LAUNCH" --version 2>/dev/null | awk '/DMTCP/ {print $NF; exit}')
    mkdir -p "$CONF_DIR"
    dirname "$(dirname "$DMTCP_LAUNCH")" > "$CONF_DIR/dmtcp-path"
    DMTCP_SUMMARY="$DMTCP_VER  ($(dirname "$DMTCP_LAUNCH"); set [engines] dmtcp to $(dirname "$(dirname "$DMTCP_LAUNCH")") if not on PATH)"
else
    rm -f "$CONF_DIR/dmtcp-path"
    DMTCP_SUMMARY="not installed  (optional: --engine dmtcp is refused on this node; see docs/dmtcp.md)"
fi

# ---------------------------------------------------------------------------------------------
# 4. Summary
# ---------------------------------------------------------------------------------------------
pkgver() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo "?"; }
OMPI_VER=$(ompi_info --version 2>/dev/null | sed -n 's/.*Open MPI v\([0-9.]*\).*/\1/p' | head -n1 || true)
MPICH_VER=$(mpichversion 2>/dev/null | sed -n 's/^MPICH Version:[[:space:]]*//p' | head -n1 || true)
log "summary:"
printf '  criu      %s  (%s; check: Looks good; nftables lock: %s)\n' "$CRIU_VER" "$CRIU" "$NFT_LOCK"
printf '  mpich     %s  (mpicc.mpich, mpiexec.mpich)\n' "${MPICH_VER:-$(pkgver mpich)}"
printf '  openmpi   %s  (mpicc.openmpi, mpirun.openmpi)\n' "${OMPI_VER:-$(pkgver openmpi-bin)}"
printf '  protoc    %s\n' "$(protoc --version 2>/dev/null | awk '{print $2}')"
printf '  nft       %s\n' "$(nft --version 2>/dev/null | awk '{print $2}')"
printf '  rust      %s\n' "$RUSTC_VER"
printf '  dmtcp     %s\n' "$DMTCP_SUMMARY"
log "done in $(( $(date +%s) - START_TS ))s"
