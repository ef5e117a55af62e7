# Sourced by the scripts that run in two soft-RoCE test guests joined by a wire
# (scripts/testvm.sh ... wire=...), or three on one segment: guest "a" (192.168.98.1, node ga)
# runs ckptd and an agent, guest "b" (192.168.98.2, node gb) runs an agent, and so does guest
# "c" (192.168.98.3, node gc) when GUESTS=3. The cluster CA lives on a; the others' credentials
# travel through /share (a host directory every guest mounts) instead of ssh. Jobs run as root.
#
# Needs: ROLE (a|b|c), BIN, CGPREFIX (the agents' cgroup prefix). GUESTS (2 or 3; 2 if unset).
# SPARES (node names), if set, are ckptd's spare nodes. JOBNET (FIRST-LAST addresses
# on 192.168.98.0/24), if set, gives ckptd a job network, so jobs run in sandboxes: macvlans of
# eth0, which cannot reach eth0's own addresses. The daemons then listen on a macvlan of eth0
# of their own, host0 (192.168.98.11 on a, .12 on b, .13 on c), as a site's would on an interface its
# sandboxes reach; JOBNET must lie in 192.168.98.48/28, routed through host0. The agents then
# also share storage, /share/shared. Sets: W (the work directory, the same path in both guests, as a site's agents share one state_dir: MPICH's Hydra copies
# the job's environment, and with it the agent's socket path, to the other node), S (/share),
# IP, CKPT_SOCKET (on a); defines say, wait_file, kill_job, serve_kills, fail_node.
: "${ROLE:?}" "${BIN:?}" "${CGPREFIX:?}"
W=/tmp/ckpt-two
mkdir -m 700 "$W"
S=/share
say() { echo "[guest $ROLE $(date +%T)] $*"; }
diag() { # what a failed run needs: the job processes, as the agent and they see themselves
    # The kernel's word on a process it killed (the console shows only its gravest messages).
    echo "--- kernel on $ROLE: $(dmesg | grep -iE 'out of memory|oom-kill|killed process' | tail -n 3 | tr '\n' ' ')"
    echo "--- memory on $ROLE: $(free -m | awk '/^Mem/ {print "used " $3 " MB, free " $4 " MB, shared " $5 " MB"}')"
    echo "--- rebuild flags on $ROLE: $(ls "$W/state/ibq/ibq-rebuild" 2>/dev/null | tr '\n' ' ')"
    local log
    log=$(grep -rl "Error (criu" "$W/state" "$W/local" 2>/dev/null | head -1)
    [ -n "$log" ] && { echo "--- $log"; grep -E "Error|unix|sk-unix|Dumping task|pid [0-9]" "$log" | tail -n 25; }
    for d in /sys/fs/cgroup/"$CGPREFIX"*; do
        [ -d "$d" ] || continue
        for p in $(cat "$d/cgroup.procs" 2>/dev/null); do
            echo "pid $p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-60) $(grep -E '^(State|NSpid)' /proc/$p/status | tr '\n\t' '  ') ns $(readlink /proc/$p/ns/pid) wchan $(cat /proc/$p/wchan)"
        done
    done
}
wait_file() { # FILE SECONDS (on b and c: given up at once when a has ended)
    for _ in $(seq $(( $2 * 10 ))); do
        [ -e "$1" ] && return 0
        if [ "$ROLE" != a ] && [ -e "$S/a-ended" ]; then
            say "guest a ended before $1"
            echo "--- agent log ($ROLE)"; tail -n 60 "$W/agent.log"
            diag
            exit 7
        fi
        sleep 0.1
    done
    say "timed out waiting for $1"; exit 7
}
say "booted"
GUESTS=${GUESTS:-2}
case "$ROLE" in a) NUM=1 ;; b) NUM=2 ;; c) NUM=3 ;; *) say "ROLE $ROLE: a, b or c"; exit 2 ;; esac
IP=192.168.98.$NUM
# The guests besides a; a waits for each of them, they for a.
OTHERS=b; [ "$GUESTS" = 3 ] && OTHERS="b c"
PEERS=192.168.98.1; [ "$ROLE" = a ] && PEERS=$(for g in $OTHERS; do echo "192.168.98.$([ $g = b ] && echo 2 || echo 3)"; done)
for peer in $PEERS; do
    for _ in $(seq 100); do busybox ping -c1 -W1 "$peer" > /dev/null 2>&1 && break; done
    # A peer that never boots (seen once: a guest whose console stayed empty) fails the run
    # now, not at the run's time limit.
    busybox ping -c1 -W1 "$peer" > /dev/null 2>&1 || { say "the peer $peer never answered: its guest did not boot"; exit 3; }
done
say "the peer answers"
LISTEN=$IP COORDINATOR=192.168.98.1
if [ -n "${JOBNET:-}" ]; then
    LISTEN=192.168.98.1$NUM COORDINATOR=192.168.98.11
    ip link add host0 link eth0 type macvlan mode bridge
    ip addr add "$LISTEN/24" dev host0
    ip link set host0 up
    # Replies to job addresses leave through host0 too: sent from eth0 they would go to the
    # wire, never to this guest's own sandboxes.
    ip route add 192.168.98.48/28 dev host0 src "$LISTEN"
fi

cat > "$W/agent.toml" <<TOML
node_name = "g$ROLE"
listen = "$LISTEN:7601"
coordinator = "$COORDINATOR:7600"
state_dir = "$W/state"
local_dir = "$W/local"
heartbeat_interval = "200ms"
tls_dir = "$W/tls"
allow_root_jobs = true
[cgroup]
prefix = "$CGPREFIX"
TOML
if [ -n "${JOBNET:-}" ]; then
    # Shared storage too (the host directory both guests mount), for jobs of one node to move.
    mkdir -p -m 755 "$S/shared"
    sed -i "1i shared_dir = \"$S/shared\"" "$W/agent.toml"
    printf '[job_network]\ninterface = "eth0"\n' >> "$W/agent.toml"
fi

PIDS=()
cleanup() { # THE-LAST-COMMAND
    local rc=$?
    if [ "$ROLE" = a ]; then
        if [ "$rc" != 0 ]; then
            echo "--- guest a ends with status $rc (the last command: $1); ckptd log"; tail -n 60 "$W/ckptd.log" 2>/dev/null
            echo "--- agent log (a)"; tail -n 60 "$W/agent.log" 2>/dev/null
            diag
            for g in $OTHERS; do echo "--- guest $g a few seconds before"; cat "$S/diag-$g.txt" 2>/dev/null; done
        fi
        touch "$S/a-ended"
    fi
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap 'cleanup "$BASH_COMMAND"' EXIT

if [ "$ROLE" = a ]; then
    cat > "$W/ckptd.toml" <<TOML
listen = "0.0.0.0:7600"
socket = "$W/ckptd.sock"
database = "$W/ckptd.redb"
tls_dir = "$W/ca"
# Guests under emulation, more vCPUs than this host has cores, stall for seconds while CRIU
# runs: a ckptd answer was seen 5 s late, and the default 5 s lease fenced a part; with three
# guests on two cores, an agent went 15 s without an answer during a dump and a 15 s lease
# fenced its part. 60 s here (lease 30 s); a lost guest is noticed that much later.
node_timeout = "60s"
# A checkpoint waits in initial-sync for a pre-dump in progress, which took 32 s with three
# guests (the default deadline is 30 s).
[deadlines]
sync = "2m"
TOML
    if [ -n "${JOBNET:-}" ]; then
        printf '[job_network]\naddresses = "%s"\nprefix = 24\n' "$JOBNET" >> "$W/ckptd.toml"
    fi
    if [ -n "${SPARES:-}" ]; then
        printf '[spares]\nnodes = [%s]\n' "$(printf '"%s", ' $SPARES | sed 's/, $//')" >> "$W/ckptd.toml"
    fi
    "$BIN/ckptd" --config "$W/ckptd.toml" ca init
    for g in $OTHERS; do
        "$BIN/ckptd" --config "$W/ckptd.toml" ca issue "g$g" --out "$S/g$g.bundle.tmp"
        mv "$S/g$g.bundle.tmp" "$S/g$g.bundle"
    done
    "$BIN/ckptd" --config "$W/ckptd.toml" ca issue ga | "$BIN/ckpt-agent" --config "$W/agent.toml" enroll -
    "$BIN/ckptd" --config "$W/ckptd.toml" > "$W/ckptd.log" 2>&1 &
    PIDS+=($!)
else
    wait_file "$S/g$ROLE.bundle" 300
    "$BIN/ckpt-agent" --config "$W/agent.toml" enroll "$S/g$ROLE.bundle"
    rm -f "$S/g$ROLE.bundle"
fi
"$BIN/ckpt-agent" --config "$W/agent.toml" > "$W/agent.log" 2>&1 &
PIDS+=($!)

kill_job() { # every process of the jobs on this node, as a node crash would
    for d in /sys/fs/cgroup/"$CGPREFIX"*; do
        [ -d "$d" ] && for p in $(cat "$d/cgroup.procs"); do kill -9 "$p" 2>/dev/null || true; done
    done
}

# Guest b (or c): kills its processes of the jobs when a asks (/share/kill-K, answered by
# killed-K, for each K of the list; after the kill it runs after_kill if the script defines
# one), then waits for /share/END (done) and shows its agent's log lines matching $2.
serve_kills() { # "K..." PATTERN [END]
    # What a's failure report shows of this guest (its processes may be gone by then).
    ( while [ ! -e "$S/done" ] && [ ! -e "$S/a-ended" ]; do
          diag > "$S/diag-$ROLE.tmp" 2>&1 && mv "$S/diag-$ROLE.tmp" "$S/diag-$ROLE.txt"; sleep 5
      done ) &
    touch "$S/$ROLE-up"
    for k in $1; do
        wait_file "$S/kill-$k" 900
        kill_job
        if declare -F after_kill > /dev/null; then after_kill; fi
        touch "$S/killed-$k"
    done
    wait_file "$S/${3:-done}" 900
    echo "--- agent log ($ROLE)"; grep -E "$2" "$W/agent.log" | tail -n 40
}

# This guest stops at once, as a node that fails: no shutdown, nothing flushed, its daemons and
# job processes gone with it (the run counts as passed: its status is written first).
fail_node() {
    say "powering off at once, as a failing node"
    echo 0 > "/share/.testvm-$(hostname).status"
    sync
    echo o > /proc/sysrq-trigger || busybox poweroff -f
    sleep 60
    exit 1
}

say "daemons started"
if [ "$ROLE" = a ]; then
    export CKPT_SOCKET=$W/ckptd.sock
    for g in $OTHERS; do
        wait_file "$S/$g-up" 300
        say "guest $g is up"
    done
    for _ in $(seq 300); do "$BIN/ckptctl" list > /dev/null 2>&1 && break; sleep 0.1; done
    for g in a $OTHERS; do
        for _ in $(seq 300); do grep -q "agent registered node=\"g$g\"" "$W/ckptd.log" && break; sleep 0.1; done
    done
fi
