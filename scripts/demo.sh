#!/usr/bin/env bash
# The main job, end to end, on one machine (Debian 12, as root):
#   set up and build ckpt, start `ckptd --standalone`, run a 4-rank MPI heat job under ckpt,
#   checkpoint it twice while it runs, SIGKILL the whole job, restart it from its last
#   checkpoint, and compare its answer with an uninterrupted run.
#
# Usage: scripts/demo.sh [mpich|openmpi]
set -euo pipefail
cd "$(dirname "$0")/.."
MPI=${1:-mpich}

bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "[demo] building ckpt (release)"
cargo build --release --workspace --locked
BIN=$PWD/target/release
WORK=$(mktemp -d /tmp/ckpt-demo.XXXXXX)
make -s -C tests/apps OUT="$WORK/apps"

case "$MPI" in
  mpich)   RUN=(mpiexec.mpich -n 4 "$WORK/apps/heat.mpich") ;;
  openmpi) RUN=(mpirun.openmpi --allow-run-as-root --oversubscribe -n 4 "$WORK/apps/heat.openmpi") ;;
  *) echo "usage: $0 [mpich|openmpi]" >&2; exit 2 ;;
esac
ARGS=(384 4000 2000)   # grid size, iterations, microseconds of sleep per iteration

export CKPT_SOCKET=$WORK/ckptd.sock
cat > "$WORK/ckptd.toml" <<TOML
listen = "127.0.0.1:0"
socket = "$WORK/ckptd.sock"
database = "$WORK/ckptd.redb"
# No cluster CA: a standalone ckptd without one serves this machine on local sockets only.
tls_dir = "$WORK/tls"
[agent]
state_dir = "$WORK/state"
local_dir = "$WORK/local"
# The demo runs as root, so its job does too; a site leaves root jobs off (docs/security.md).
allow_root_jobs = true
[agent.cgroup]
prefix = "ckpt-demo-$$-"
TOML

"$BIN/ckptd" --standalone --config "$WORK/ckptd.toml" > "$WORK/ckptd.log" 2>&1 &
CKPTD=$!
JOB=""
cleanup() {
    [[ -n "$JOB" ]] && "$BIN/ckptctl" cancel "$JOB" >/dev/null 2>&1 || true
    kill "$CKPTD" 2>/dev/null || true
    wait "$CKPTD" 2>/dev/null || true
    for d in /sys/fs/cgroup/freezer/ckpt-demo-$$-* /sys/fs/cgroup/ckpt-demo-$$-*; do
        [[ -d $d ]] && rmdir "$d" 2>/dev/null || true
    done
}
trap cleanup EXIT
for _ in $(seq 100); do [[ -S $CKPT_SOCKET ]] && "$BIN/ckptctl" list >/dev/null 2>&1 && break; sleep 0.1; done

echo "[demo] reference: an uninterrupted run"
WANT=$("${RUN[@]}" "${ARGS[0]}" "${ARGS[1]}" 0 | awk '/^checksum/ {print $2}')
echo "[demo]   checksum $WANT"

JOB=$("$BIN/ckptctl" run --name heat -- "${RUN[@]}" "${ARGS[@]}")
OUT=$WORK/state/jobs/$JOB/stdout
echo "[demo] job $JOB started; output in $OUT"
sleep 2
"$BIN/ckptctl" checkpoint "$JOB" --wait
sleep 1
"$BIN/ckptctl" checkpoint "$JOB" --wait
"$BIN/ckptctl" epochs "$JOB"
echo "[demo] SIGKILL every process of job $JOB (as a node crash would)"
CG=""
for d in /sys/fs/cgroup/freezer/ckpt-demo-$$-"$JOB" /sys/fs/cgroup/ckpt-demo-$$-"$JOB"; do
    [[ -d $d ]] && CG=$d && break
done
[[ -n $CG ]] || { echo "[demo] cannot find the job's cgroup" >&2; exit 1; }
for p in $(cat "$CG/cgroup.procs"); do kill -9 "$p" 2>/dev/null || true; done
for _ in $(seq 100); do "$BIN/ckptctl" status "$JOB" | head -1 | grep -q killed && break; sleep 0.1; done
"$BIN/ckptctl" status "$JOB" | head -1
"$BIN/ckptctl" restart "$JOB"
for _ in $(seq 1200); do "$BIN/ckptctl" status "$JOB" | head -1 | grep -q exited && break; sleep 0.1; done
GOT=$(awk '/^checksum/ {c=$2} END {print c}' "$OUT")
echo "[demo] restarted job finished: checksum $GOT (uninterrupted run: $WANT)"
if [[ "$GOT" == "$WANT" ]]; then echo "[demo] OK: same answer as an uninterrupted run"; else echo "[demo] MISMATCH" >&2; exit 1; fi
