#!/usr/bin/env bash
# Mutation check of the node agent's in-process tests (checkpoint/phase_tests.rs and
# restore/step_tests.rs, on the recording fake host): each mutant below is a small change of
# the agent's code that those tests must notice. For each, the committed tree (HEAD) is
# checked out into a temporary worktree, the change applied, and
# `cargo test -p node-agent --lib <filter>` run there; a mutant is "killed" when a test fails.
#
#   scripts/mutants.sh            every mutant
#   scripts/mutants.sh NAME...    only these (see `mutant_names`)
#
# Prints "mutant NAME: killed by TEST[, TEST...]" or "mutant NAME: SURVIVED"; exits 1 if one
# survived (or did not apply, or did not build), 0 otherwise; first, the tests must pass
# without any mutant. Each test run is bounded by
# MUTANT_TIMEOUT seconds (default 1200: a build of the crate on one core, then the tests).
# Uses CARGO_TARGET_DIR if set (else target/mutants in the repository) and CARGO_BUILD_JOBS
# (default 1). The worktree is removed at the end, whatever happens.
set -euo pipefail

root=$(git rev-parse --show-toplevel)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/mutants}
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1}
timeout_s=${MUTANT_TIMEOUT:-1200}

wt=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-mutants.XXXXXX")
logs=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-mutants-logs.XXXXXX")
cleanup() {
    git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || rm -rf "$wt"
    git -C "$root" worktree prune >/dev/null 2>&1 || true
    rm -rf "$logs"
}
trap cleanup EXIT
rmdir "$wt"
git -C "$root" worktree add --quiet --detach "$wt" HEAD

agent=crates/node-agent/src

mutant_names="skip_thaw_on_abort restore_before_verifying dump_without_freeze thaw_instead_of_kill keep_tree_refused_at_gate"

# Applies mutant $1 in the worktree (a perl substitution over one file); prints the test filter.
apply() {
    case "$1" in
    skip_thaw_on_abort)
        # An abort leaves a frozen job frozen.
        perl -0pi -e 's/r = host\.thaw\(cg\)\.map_err/r = Ok::<(), crate::cgroup::CgroupError>(()).map_err/' \
            "$wt/$agent/checkpoint/mod.rs"
        echo phase_tests ;;
    restore_before_verifying)
        # The engine restores before the page data has been checked (no gate).
        perl -0pi -e 's/        if gate\.is_none\(\) \{\n            pages_ms = self\.check_first\(&mut found, &ready\)\.await\?;\n        \}\n        let done = self\.engine_restore\(&mut found, &ready, gate\)\.await;/        let no_gate = gate.is_none();\n        let done = self.engine_restore(&mut found, &ready, gate).await;\n        if no_gate {\n            pages_ms = self.check_first(&mut found, &ready).await?;\n        }/' \
            "$wt/$agent/restore/run.rs"
        echo step_tests ;;
    dump_without_freeze)
        # Quiesce does not freeze: the dump runs on a running job.
        perl -0pi -e 's/let r = host\.freeze_for_snapshot\(&job\.cgroup\);/let r: Result<u32, crate::cgroup::CgroupError> = Ok(0);/' \
            "$wt/$agent/checkpoint/mod.rs"
        echo phase_tests ;;
    thaw_instead_of_kill)
        # Resume with --kill lets the job run on.
        perl -0pi -e 's/let r = if kill \{\n                host\.kill_all/let r = if false {\n                host.kill_all/' \
            "$wt/$agent/checkpoint/mod.rs"
        echo phase_tests ;;
    keep_tree_refused_at_gate)
        # A tree whose page data the gate refused is not killed.
        perl -0pi -e 's/ *let _ = self\.node\.host\.kill_all\(&self\.job\.cgroup\);\n//' \
            "$wt/$agent/restore/run.rs"
        echo step_tests ;;
    *)
        echo "unknown mutant $1 (known: $mutant_names)" >&2
        return 1 ;;
    esac
}

# The tests must pass on the tree as it is, or every mutant would look killed.
if ! (cd "$wt" && timeout "$timeout_s" cargo test -p node-agent --lib -- phase_tests step_tests) \
    >"$logs/baseline.log" 2>&1; then
    echo "baseline: the tests fail without any mutant:"
    tail -n 20 "$logs/baseline.log" | sed 's/^/    /'
    exit 1
fi
echo "baseline: $(grep -o '[0-9]* passed' "$logs/baseline.log" | head -1) without mutants"

survived=0
for m in ${*:-$mutant_names}; do
    git -C "$wt" checkout --quiet -- .
    filter=$(apply "$m") || { survived=1; continue; }
    if git -C "$wt" diff --quiet; then
        echo "mutant $m: DID NOT APPLY (the code it changes moved; update scripts/mutants.sh)"
        survived=1
        continue
    fi
    log="$logs/$m.log"
    set +e
    (cd "$wt" && timeout "$timeout_s" cargo test -p node-agent --lib "$filter") >"$log" 2>&1
    rc=$?
    set -e
    failed=$(sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$log" | sort -u | paste -sd, - | sed 's/,/, /g')
    if [ "$rc" -eq 0 ]; then
        echo "mutant $m: SURVIVED (every $filter test passed)"
        survived=1
    elif [ -n "$failed" ]; then
        echo "mutant $m: killed by $failed"
    elif [ "$rc" -eq 124 ]; then
        echo "mutant $m: TIMED OUT after ${timeout_s}s"
        survived=1
    else
        echo "mutant $m: DID NOT BUILD OR RUN (exit $rc):"
        tail -n 20 "$log" | sed 's/^/    /'
        survived=1
    fi
done
exit "$survived"
