# Sourced by the guest scripts: ckptd with its own agent (--standalone) in work directory $W,
# failpoints read from $W/failpoints, ready for ckptctl (CKPT_SOCKET exported). Its log is
# $W/ckptd.log; on exit it is stopped and the lines matching $CKPTD_LOG_GREP (default: all) of
# the log's last part are printed.
export CKPT_SOCKET=$W/ckptd.sock
cat > "$W/ckptd.toml" <<TOML
listen = "127.0.0.1:0"
socket = "$W/ckptd.sock"
database = "$W/ckptd.redb"
tls_dir = "$W/tls"
[agent]
state_dir = "$W/state"
local_dir = "$W/local"
allow_root_jobs = true
TOML
CKPT_FAILPOINTS=$W/failpoints "$BIN/ckptd" --standalone --config "$W/ckptd.toml" > "$W/ckptd.log" 2>&1 &
CKPTD=$!
trap 'kill $CKPTD 2>/dev/null || true; echo "--- ckptd log"; grep -E "${CKPTD_LOG_GREP:-.}" "$W/ckptd.log" | tail -n 60' EXIT
for _ in $(seq 200); do "$BIN/ckptctl" list > /dev/null 2>&1 && break; sleep 0.1; done
