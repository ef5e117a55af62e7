//! Jobs and epochs for the unit tests of the modules that keep them.
use std::collections::BTreeMap;

use super::*;

/// Every phase, in order.
pub(crate) const PHASES: [Phase; 6] = [
    Phase::InitialSync,
    Phase::Quiesce,
    Phase::LocalCheckpoint,
    Phase::Resume,
    Phase::Finalize,
    Phase::Commit,
];

/// A phase added to [`Phase`] stops this match from compiling: add it to [`PHASES`] too.
#[allow(dead_code)]
fn every_phase_is_in_phases(p: Phase) {
    match p {
        Phase::InitialSync
        | Phase::Quiesce
        | Phase::LocalCheckpoint
        | Phase::Resume
        | Phase::Finalize
        | Phase::Commit => {}
    }
}

/// A job of uid 1000 in `state`, launched on n1.
pub(crate) fn job(id: u64, state: JobState) -> Job {
    Job {
        name: "heat".into(),
        owner_uid: 1000,
        owner_gid: 1000,
        argv: vec!["mpiexec".into()],
        cwd: "/".into(),
        node: "n1".into(),
        incarnation: 1,
        ..Job::new(id, state)
    }
}

/// Takes `e` from initial synchronization through every phase and commits it with
/// `manifests` at `at_ms`.
pub(crate) fn commit(e: &mut Epoch, manifests: BTreeMap<String, String>, at_ms: u64) {
    for p in [
        Phase::Quiesce,
        Phase::LocalCheckpoint,
        Phase::Resume,
        Phase::Finalize,
        Phase::Commit,
    ] {
        e.enter(p).unwrap();
    }
    e.commit(manifests, at_ms).unwrap();
}
