#!/usr/bin/env bash
# The packages on a fresh Debian 12 test host (tests/e2e/packages.rs): install ckpt-daemons and
# ckpt-client with apt, start ckptd and an agent with the commands their units run, run a job as
# a user, checkpoint it, upgrade the packages under it and restart the daemons, stop it with a
# checkpoint, restart it from there, then purge the packages and list every file they left.
#
# Usage: fresh_host.sh BASE_TAR DEB_DIR WORK
#        fresh_host.sh --base BASE_TAR      (makes BASE_TAR, once: a few minutes)
#   BASE_TAR  a debootstrap of bookworm (minbase, with systemd), as --base makes it
#   DEB_DIR   ckpt-daemons_*.deb and ckpt-client_*.deb (scripts/package.sh), and in
#             DEB_DIR/upgrade the same at a later revision
#   WORK      an empty directory of the caller's: the host's root is WORK/root
# Prints "step: ..." lines as it goes, "installed paths: N" (new after the install and the
# job), and "leftover: PATH" for each file the purge left.
# Runs as root. The host's processes live in their own PID, mount, UTS and network namespaces,
# so that they all end with this script; apt alone reaches the network (the Debian mirror).
set -euo pipefail

if [ "$1" = --base ]; then
    # The mirror that this machine's apt uses for bookworm, else Debian's own.
    mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
    mirror=${mirror:-http://deb.debian.org/debian}
    tmp=$(mktemp -d "$(dirname "$2")/.base.XXXXXX")
    debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,procps,iproute2 \
        bookworm "$tmp/root" "$mirror" >"$tmp/debootstrap.log" 2>&1 ||
        { tail -20 "$tmp/debootstrap.log"; rm -rf "$tmp"; exit 1; }
    tar -C "$tmp/root" --zstd -cf "$tmp/base.tar.zst" .
    mv "$tmp/base.tar.zst" "$2"
    rm -rf "$tmp"
    exit 0
fi
BASE_TAR=$1 DEBS=$2 WORK=$3
R=$WORK/root
USER_UID=1000

say() { printf 'step: %s\n' "$*"; }
die() { printf 'FAILED: %s\n' "$*"; exit 1; }

mkdir -p "$R"
tar -C "$R" --zstd -xf "$BASE_TAR"
cp "$DEBS"/ckpt-daemons_*.deb "$DEBS"/ckpt-client_*.deb "$R/tmp/"
mkdir "$R/tmp/upgrade"
cp "$DEBS"/upgrade/ckpt-daemons_*.deb "$DEBS"/upgrade/ckpt-client_*.deb "$R/tmp/upgrade/"
cp /etc/resolv.conf "$R/etc/resolv.conf"
# The user whose job runs (made before the inventory: the purge is not to remove them).
chroot "$R" useradd -m -u $USER_UID alice

# Every file of the host but the kernel's, run-time and apt's own bookkeeping.
inventory() {
    (cd "$R" && find . -xdev \( -path ./proc -o -path ./sys -o -path ./dev -o -path ./run \
        -o -path ./tmp -o -path ./var/lib/dpkg -o -path ./var/lib/apt -o -path ./var/cache \
        -o -path ./var/log -o -path ./etc/ld.so.cache -o -path ./etc/resolv.conf \
        -o -path ./var/lib/systemd/deb-systemd-helper-masked \) -prune -o -print | sort)
}
inventory >"$WORK/before.txt"

# In the host's own namespaces: /proc of its PID namespace, the machine's /sys and /dev.
in_host() {
    local net=$1
    shift
    unshare --mount --pid --uts --fork --kill-child ${net:+--net} bash -euo pipefail -c '
        R=$1; shift
        hostname fresh
        ip link set lo up 2>/dev/null || true
        # The root a mount point of its own, then pivoted to: CRIU checks the mount tree.
        mount --bind "$R" "$R"
        mount -t proc proc "$R/proc"
        mount --rbind /sys "$R/sys"
        mount --rbind /dev "$R/dev"
        mount -t tmpfs -o mode=0755 tmpfs "$R/run"
        mkdir -p "$R/tmp/.host"
        cd "$R"
        pivot_root . tmp/.host
        umount -l /tmp/.host
        exec /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"' \
        in_host "$R" "$@"
}

say "apt installs the packages and what they depend on"
in_host "" bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends /tmp/ckpt-daemons_*.deb /tmp/ckpt-client_*.deb' \
    >"$WORK/apt.log" 2>&1 || { tail -30 "$WORK/apt.log"; die "apt-get install"; }
in_host "" dpkg-query -W -f='${Package} ${Version} ${db:Status-Status}\n' ckpt-daemons ckpt-client

say "the units' commands start ckptd and the agent; a user's job is checkpointed and restarted"
cat >"$R/tmp/run.sh" <<'EOF'
#!/bin/bash
# Inside the test host: what an admin and a user do after installing the packages.
set -euo pipefail
unit_cmd() { sed -n 's/^ExecStart=//p' "/usr/lib/systemd/system/$1.service"; }
for u in ckptd ckpt-agent; do
    doc=$(sed -n 's|^Documentation=file://\([^ ]*\).*|\1|p' "/usr/lib/systemd/system/$u.service")
    [ -f "$doc" ] || { echo "$u.service points at $doc, which is not installed"; exit 1; }
done
as_alice() { setpriv --reuid 1000 --regid 1000 --init-groups env HOME=/home/alice "$@"; }
# CRIU reads a process's resource limits with prlimit(2), which needs CAP_SYS_RESOURCE for
# another user's process. A machine (or container) that withholds it from root can checkpoint
# only root's jobs: the job is root's there, as the config allows.
if [ $(( 0x$(sed -n 's/^CapEff:\t*//p' /proc/self/status) >> 24 & 1 )) = 0 ]; then
    echo "no CAP_SYS_RESOURCE here: the job runs as root (allow_root_jobs = true)"
    sed -i 's/^allow_root_jobs = false/allow_root_jobs = true/' /etc/ckpt/agent.toml
    as_alice() { "$@"; }
fi
# What systemd does for the units before their commands run (RuntimeDirectory, StateDirectory,
# UMask, Environment).
mkdir -p -m 0755 /run/ckpt /var/lib/ckpt
umask 077
export CKPT_LOG=info
ckptd ca init >/tmp/ca.log 2>&1
ckptd ca issue fresh | ckpt-agent enroll - >>/tmp/ca.log 2>&1
STARTS=0
start_daemons() {
    STARTS=$((STARTS + 1))
    umask 077
    $(unit_cmd ckptd) >>/tmp/ckptd.log 2>&1 &
    CKPTD=$!
    $(unit_cmd ckpt-agent) >>/tmp/agent.log 2>&1 &
    AGENT=$!
    umask 022
    # Up once this agent registered with this ckptd (the logs are appended to at each start).
    for _ in $(seq 100); do
        [ "$(grep -c 'registered coordinator' /tmp/agent.log)" -ge $STARTS ] &&
            ckptctl --json nodes 2>/dev/null | grep -q '"state": *"up"' && return 0
        sleep 0.2
    done
    echo "the daemons did not come up (start $STARTS)"; return 1
}
# As `systemctl stop` does with KillMode=process: TERM to the main process alone.
stop_daemons() {
    kill -TERM $CKPTD $AGENT
    for _ in $(seq 100); do
        kill -0 $CKPTD 2>/dev/null || kill -0 $AGENT 2>/dev/null || return 0
        sleep 0.1
    done
    echo "a daemon ignored TERM for 10 s"; return 1
}
start_daemons
ckptctl nodes
cd /home/alice
JOB=$(as_alice ckptctl run --name count -- /bin/sh -c \
    'i=0; while [ $i -lt 100 ]; do i=$((i+1)); echo $i; sleep 0.2; done')
echo "job $JOB"
OUT=/var/lib/ckpt/agent/jobs/$JOB/stdout
# The job's state, from the first line of `ckptctl status` ("job 1 (count): running").
state() { ckptctl status "$JOB" | head -1 | sed 's/^[^:]*: //'; }
wait_for() { # a state, in bounded time
    for _ in $(seq 300); do
        case "$(state)" in "$1"*) return 0 ;; esac
        sleep 0.2
    done
    ckptctl status "$JOB"; return 1
}
for _ in $(seq 100); do [ "$(wc -l <"$OUT")" -ge 5 ] && break; sleep 0.2; done
as_alice ckptctl checkpoint "$JOB" --wait
# An upgrade while the job runs: dpkg puts the new files in place under the running daemons;
# where systemd runs, the postinst then try-restarts the units, done here by hand.
echo "# a site's own line" >>/etc/ckpt/agent.toml
dpkg -i /tmp/upgrade/ckpt-daemons_*.deb /tmp/upgrade/ckpt-client_*.deb >/tmp/upgrade.log 2>&1 ||
    { cat /tmp/upgrade.log; exit 1; }
dpkg-query -W -f='upgraded: ${Package} ${Version}\n' ckpt-daemons ckpt-client
grep -q "^# a site's own line" /etc/ckpt/agent.toml && echo "upgrade kept the edited agent.toml"
stop_daemons
start_daemons
echo "after the upgrade: job $(state)"
as_alice ckptctl checkpoint "$JOB" --kill
wait_for stopped
STOPPED_AT=$(wc -l <"$OUT")
echo "stopped after $STOPPED_AT lines"
as_alice ckptctl restart "$JOB"
wait_for exited
as_alice ckptctl epochs "$JOB"
if [ "$(cat "$OUT")" = "$(seq 100)" ]; then echo "output: 1 to 100, once each"; else
    echo "output: wrong"; cat "$OUT"; exit 1
fi
EOF
chmod 755 "$R/tmp/run.sh"
if ! in_host net /tmp/run.sh; then
    for f in ca ckptd agent; do echo "--- $f.log"; tail -40 "$R/tmp/$f.log" 2>/dev/null || true; done
    die "the job on the installed packages"
fi

# What the packages (and the job) added, so that the check below is seen to see them.
inventory >"$WORK/installed.txt"
echo "installed paths: $(comm -13 "$WORK/before.txt" "$WORK/installed.txt" | wc -l)"

say "dpkg --purge removes them, and apt the packages they pulled in"
in_host "" bash -c 'dpkg --purge ckpt-client ckpt-daemons && DEBIAN_FRONTEND=noninteractive \
    apt-get autoremove --purge -y -qq' >"$WORK/purge.log" 2>&1 ||
    { tail -30 "$WORK/purge.log"; die "dpkg --purge"; }
inventory >"$WORK/after.txt"
comm -13 "$WORK/before.txt" "$WORK/after.txt" | sed 's/^\./leftover: /'
say "done"
