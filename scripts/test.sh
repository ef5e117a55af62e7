#!/usr/bin/env bash
# Runs every ckpt test on a Debian 12 machine, as root: provisions what the tests need
# (scripts/setup.sh), builds the release binaries once, then runs unit tests and the
# end-to-end tests (real CRIU, real MPICH and Open MPI jobs, real daemons) against them.
# Ends with the time of each suite and one line: "tests: N passed, N failed, N skipped"
# (skipped tests print why); exits 1 if any suite failed.
#
# Usage: scripts/test.sh [extra cargo test args for the e2e tests]
set -euo pipefail
cd "$(dirname "$0")/.."

# --vm: the soft-RoCE QEMU guests of the InfiniBand tests (tests/e2e/rdma.rs).
bash scripts/setup.sh --vm
export PATH="$HOME/.cargo/bin:$PATH"
LOG=$(mktemp /tmp/ckpt-test-log.XXXXXX)
trap 'rm -f "$LOG"' EXIT

echo "[test] cargo fmt --check"
cargo fmt --all -- --check

# The structure's guards, before anything is built: no import circle between the files of a
# crate, no function over 120 lines in crates/, no file over 700 lines whose header does not
# say why it is one (each names what it finds).
echo "[test] structure: import circles (scripts/modgraph.py), long functions (scripts/longfns.py), long files (scripts/longfiles.py)"
python3 scripts/modgraph.py $(ls crates)
python3 scripts/longfns.py 120
python3 scripts/longfiles.py 700

# Where cargo builds: target/ in the checkout, or CARGO_TARGET_DIR. .ci/run keeps one build
# directory and one copy of the sources between runs: the dependencies are compiled once, and
# this workspace's crates when they change. A build directory last used from another checkout
# has this workspace's crates built for that path (cargo names them by it): they are removed
# first, so that the directory does not grow.
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
if [ -n "${CARGO_TARGET_DIR:-}" ] && [ -d "$CARGO_TARGET_DIR/release" ] &&
    [ "$(cat "$CARGO_TARGET_DIR/.ckpt-source" 2>/dev/null)" != "$PWD" ]; then
    OWN=$(cargo metadata --no-deps --format-version 1 --locked |
        python3 -c 'import json, sys; print(" ".join("-p " + p["name"] for p in json.load(sys.stdin)["packages"]))')
    # Never a bare `cargo clean`, which would remove the dependencies too.
    [ -n "$OWN" ] || { echo "[test] cannot list this workspace's packages"; exit 1; }
    echo "[test] build directory $CARGO_TARGET_DIR: this workspace's old builds removed, dependencies kept"
    cargo clean --release --quiet $OWN
fi
[ -z "${CARGO_TARGET_DIR:-}" ] || { mkdir -p "$CARGO_TARGET_DIR" && echo "$PWD" > "$CARGO_TARGET_DIR/.ckpt-source"; }

# One feature set for every build below: the release binaries, the tests and the e2e tests
# are all built with the workspace's dev-dependencies (`--tests`, `--workspace` every time).
# A build of one package (`-p`), or one without the tests, resolves the dependencies'
# features otherwise and compiles them all again (about 3 minutes each here).
echo "[test] building release binaries and tests (shared by every test below)"
cargo build --release --workspace --locked --lib --bins --tests

if cargo clippy --version >/dev/null 2>&1; then
    echo "[test] cargo clippy (every target, benchmarks included, warnings are errors)"
    cargo clippy --release --workspace --locked --all-targets -- -D warnings
else
    echo "[test] clippy not installed: checking every target (benchmarks included) instead"
    cargo check --release --workspace --locked --all-targets
fi

if command -v cargo-machete >/dev/null 2>&1; then
    echo "[test] cargo machete (no declared dependency unused)"
    cargo machete
else
    echo "[test] cargo-machete not installed (cargo install cargo-machete): unused dependencies not checked"
fi

# Each suite's time, printed at the end, so that growth is seen.
TIMES=()
FAILED=0
timed() {
    local name=$1 begin=$SECONDS status=ok
    shift
    if ! "$@" 2>&1 | tee -a "$LOG"; then
        FAILED=1
        status=FAILED
    fi
    TIMES+=("$(printf '%-24s %5d s  %s' "$name" $((SECONDS - begin)) "$status")")
}

export CKPT_BIN_DIR="$TARGET/release"
echo "[test] unit tests (every library and program, the e2e harness's included)"
timed "unit" cargo test --release --workspace --locked --lib --bins
echo "[test] integration tests of the libraries"
timed "integration" cargo test --release --workspace --locked --exclude ckpt-tests --test '*'

echo "[test] end-to-end tests (one at a time: each runs a 4-rank MPI job on 2 cores)"
# Each e2e test's time (libtest's --report-time, "test NAME ... ok <12.345s>"): an unstable
# option of the test harness, let through for the test binaries only (a cargo runner), so the
# build itself stays on stable Rust. The slowest are listed at the end.
export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="env RUSTC_BOOTSTRAP=1"
for suite in $(sed -n 's/^name = "\(.*\)"$/\1/p' tests/Cargo.toml | grep -v '^ckpt-tests$'); do
    echo "[test] e2e suite $suite"
    timed "e2e $suite" cargo test --release --locked --workspace --test "$suite" -- \
        --test-threads=1 --show-output -Z unstable-options --report-time "$@"
done

echo "[test] slowest e2e tests:"
sed -n 's/^test \([^ ]*\) \.\.\. \([a-zA-Z]*\) <\([0-9.]*\)s>$/\3 \1 \2/p' "$LOG" |
    sort -rn | awk 'NR <= 15 { printf "  %6.0f s  %s %s\n", $1, $2, ($3 == "ok" ? "" : $3) }'
# Each failure's message once more, here at the end: a log cut to its head and tail keeps it.
if [ "$FAILED" = 1 ] && grep -q "panicked at" "$LOG"; then
    # Its first 25 lines and its last 15: an assertion's message often holds a guest's whole
    # console, and `left`/`right` and the console's end (where a script says why) come last.
    echo "[test] failures (each panic's message: its first 25 and last 15 lines):"
    awk 'function flush(   i) {
             for (i = 1; i <= n; i++) if (i <= 25 || i > n - 15) print "  " b[i]; else if (i == 26) print "  [...]"
             n = 0; on = 0
         }
         /panicked at/ { if (on) flush(); on = 1 }
         on && (/^stack backtrace:/ || /^note: / || /^failures:$/ || /^---- .* stdout ----$/) { flush() }
         on { b[++n] = $0 }
         END { if (on) flush() }' "$LOG"
fi
echo "[test] time per suite:"
printf '  %s\n' "${TIMES[@]}"
printf '  %-24s %5d s  (setup, build and lints included)\n' "all" "$SECONDS"

awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i == "passed;") p += $(i-1); if ($i == "failed;") f += $(i-1) } }
     /^SKIPPED/ { s++ }
     END { printf "tests: %d passed, %d failed, %d skipped\n", p - s, f, s }' "$LOG"
exit $FAILED
