#!/usr/bin/env bash
# The soak: ROUNDS rounds of a 6-rank MPI job (MPICH or Open MPI, drawn) across three test hosts
# and a spare, each with one fault drawn at random: a checkpoint phase failing on a node; an
# agent killed or ckptd restarted while a checkpoint holds inside a phase (initial-sync,
# quiesce, local-checkpoint, resume, finalize); a restore failing, or ckptd restarted inside
# one; a node destroyed with its disks; a drain --migrate; a rank killed. Every round's answer
# is checked against an uninterrupted run, and so is every committed epoch and what is left
# running. Prints a table of the rounds and the seed, which replays the same sequence.
#
# Usage: scripts/soak.sh [ROUNDS] [SEED]     (ROUNDS: default 100; CI runs 6 in scripts/test.sh)
# Root, on a machine set up by scripts/setup.sh; about 35-60 s a round on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
rounds=${1:-100}
case $rounds in
    ''|*[!0-9]*|0) echo "soak.sh: ROUNDS must be a positive number, not '$rounds'" >&2; exit 2 ;;
esac
export CKPT_SOAK_ROUNDS=$rounds
# A new sequence each run unless SEED is given (the test alone replays CI's).
export CKPT_SOAK_SEED=${2:-$(date +%s%N)}
# One build for the programs and the test, as scripts/test.sh does (one feature set).
cargo build --release --workspace --locked --lib --bins --tests
export CKPT_BIN_DIR="${CARGO_TARGET_DIR:-$PWD/target}/release"
exec cargo test --release --locked --workspace --test soak -- --nocapture
