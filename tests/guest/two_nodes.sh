# Sourced by the scripts that run in two soft-RoCE test guests joined by a wire
# (scripts/testvm.sh ... wire=...): guest "a" (192.168.98.1, node ga) runs ckptd and an agent,
# guest "b" (192.168.98.2, node gb) runs an agent. The cluster CA lives on a; b's credential
# travels through /share (a host directory both guests mount) instead of ssh. Jobs run as root.
#
# Needs: ROLE (a|b), BIN, CGPREFIX (the agents' cgroup prefix). Sets: W (the work directory,
# the same path in both guests, as a site's agents share one state_dir: MPICH's Hydra copies
# the job's environment, and with it the agent's socket path, to the other node), S (/share),
# IP, CKPT_SOCKET (on a); defines say, wait_file, kill_job, serve_kills.
: "${ROLE:?}" "${BIN:?}" "${CGPREFIX:?}"
W=/tmp/ckpt-two
mkdir -m 700 "$W"
S=/share
say() { echo "[guest $ROLE $(date +%T)] $*"; }
wait_file() { # FILE SECONDS
    for _ in $(seq $(( $2 * 10 ))); do [ -e "$1" ] && return 0; sleep 0.1; done
    say "timed out waiting for $1"; exit 7
}
IP=192.168.98.1; [ "$ROLE" = b ] && IP=192.168.98.2
for _ in $(seq 100); do busybox ping -c1 -W1 192.168.98.$([ "$ROLE" = a ] && echo 2 || echo 1) > /dev/null 2>&1 && break; done

cat > "$W/agent.toml" <<TOML
node_name = "g$ROLE"
listen = "$IP:7601"
coordinator = "192.168.98.1:7600"
state_dir = "$W/state"
local_dir = "$W/local"
heartbeat_interval = "200ms"
tls_dir = "$W/tls"
allow_root_jobs = true
[cgroup]
prefix = "$CGPREFIX"
TOML

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

if [ "$ROLE" = a ]; then
    cat > "$W/ckptd.toml" <<TOML
listen = "0.0.0.0:7600"
socket = "$W/ckptd.sock"
database = "$W/ckptd.redb"
tls_dir = "$W/ca"
TOML
    "$BIN/ckptd" --config "$W/ckptd.toml" ca init
    "$BIN/ckptd" --config "$W/ckptd.toml" ca issue gb --out "$S/gb.bundle.tmp"
    mv "$S/gb.bundle.tmp" "$S/gb.bundle"
    "$BIN/ckptd" --config "$W/ckptd.toml" ca issue ga | "$BIN/ckpt-agent" --config "$W/agent.toml" enroll -
    "$BIN/ckptd" --config "$W/ckptd.toml" > "$W/ckptd.log" 2>&1 &
    PIDS+=($!)
else
    wait_file "$S/gb.bundle" 300
    "$BIN/ckpt-agent" --config "$W/agent.toml" enroll "$S/gb.bundle"
    rm -f "$S/gb.bundle"
fi
"$BIN/ckpt-agent" --config "$W/agent.toml" > "$W/agent.log" 2>&1 &
PIDS+=($!)

kill_job() { # every process of the jobs on this node, as a node crash would
    for d in /sys/fs/cgroup/"$CGPREFIX"*; do
        [ -d "$d" ] && for p in $(cat "$d/cgroup.procs"); do kill -9 "$p" 2>/dev/null || true; done
    done
}

# Guest b: kills its processes of the jobs when a asks (/share/kill-K, answered by killed-K,
# for each K of the list; after the kill it runs after_kill if the script defines one), then
# waits for /share/done and shows its agent's log lines matching $2.
serve_kills() { # "K..." PATTERN
    touch "$S/b-up"
    for k in $1; do
        wait_file "$S/kill-$k" 900
        kill_job
        if declare -F after_kill > /dev/null; then after_kill; fi
        touch "$S/killed-$k"
    done
    wait_file "$S/done" 900
    echo "--- agent log (b)"; grep -E "$2" "$W/agent.log" | tail -n 40
}

if [ "$ROLE" = a ]; then
    export CKPT_SOCKET=$W/ckptd.sock
    wait_file "$S/b-up" 300
    for _ in $(seq 300); do "$BIN/ckptctl" list > /dev/null 2>&1 && break; sleep 0.1; done
    for _ in $(seq 300); do
        grep -q 'agent registered node="gb"' "$W/ckptd.log" && grep -q 'agent registered node="ga"' "$W/ckptd.log" && break
        sleep 0.1
    done
fi
