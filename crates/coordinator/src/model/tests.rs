use std::collections::BTreeMap;

use super::fixtures::{commit, PHASES};
use super::*;

fn epoch() -> Epoch {
    Epoch::begin(1, 1, false, vec!["n1".into()], 0)
}

fn manifests() -> BTreeMap<String, String> {
    [("n1".to_string(), "d".to_string())].into()
}

#[test]
fn phases_only_advance_one_at_a_time() {
    for (i, &from) in PHASES.iter().enumerate() {
        for (j, &to) in PHASES.iter().enumerate() {
            let mut e = epoch();
            e.state = EpochState::InProgress(from);
            let r = e.enter(to);
            assert_eq!(r.is_ok(), j == i + 1, "{from:?} -> {to:?}");
            if r.is_err() {
                assert_eq!(
                    e.state,
                    EpochState::InProgress(from),
                    "refused transition changed state"
                );
            }
        }
    }
}

#[test]
fn commit_only_from_commit_phase_with_every_manifest() {
    for &p in &PHASES[..5] {
        let mut e = epoch();
        e.state = EpochState::InProgress(p);
        assert!(e.commit(manifests(), 1).is_err(), "commit from {p:?}");
    }
    let mut e = epoch();
    e.state = EpochState::InProgress(Phase::Commit);
    let err = e.commit(BTreeMap::new(), 1).unwrap_err();
    assert!(err.action.contains("n1"), "{err}");
    e.commit(manifests(), 1).unwrap();
    assert!(e.is_restorable());
    assert!(e.commit(manifests(), 2).is_err(), "double commit");
    assert!(e.fail("late", 2).is_err(), "a committed epoch cannot fail");
    assert!(e.enter(Phase::InitialSync).is_err());
}

#[test]
fn only_committed_epochs_expire_and_expired_ones_are_not_restorable() {
    let mut e = epoch();
    assert!(e.expire("retention").is_err(), "an epoch in progress");
    for p in &PHASES[1..] {
        e.enter(*p).unwrap();
    }
    e.commit(manifests(), 1).unwrap();
    assert!(e.is_restorable());
    e.expire("keep_local = 1").unwrap();
    assert!(!e.is_restorable());
    assert_eq!(e.state_name(), "expired");
    assert!(e.expire("again").is_err(), "expired is terminal");
    assert!(e.fail("late", 2).is_err());
}

#[test]
fn storage_follows_the_flush_and_the_local_copy() {
    let mut e = epoch();
    assert_eq!(e.storage_name(), "");
    commit(&mut e, manifests(), 2);
    assert_eq!(e.storage_name(), "local");
    e.flush = FlushState::Flushing;
    assert_eq!(e.storage_name(), "flushing");
    e.flush = FlushState::Durable {
        flush_ms: 1,
        written_bytes: 1,
        durable_unix_ms: 3,
    };
    assert!(e.is_durable());
    assert_eq!(e.storage_name(), "durable");
    e.local_copy = false;
    assert_eq!(e.storage_name(), "shared-only");
    assert!(e.is_restorable());
    // Records written before flushing existed read as local copies, nothing flushed.
    let mut v = serde_json::to_value(epoch()).unwrap();
    v.as_object_mut().unwrap().remove("flush");
    v.as_object_mut().unwrap().remove("local_copy");
    let old: Epoch = serde_json::from_value(v).unwrap();
    assert_eq!((old.flush, old.local_copy), (FlushState::NotPlanned, true));
}

#[test]
fn failed_epochs_are_terminal_and_keep_their_phase() {
    let mut e = epoch();
    e.enter(Phase::Quiesce).unwrap();
    e.enter(Phase::LocalCheckpoint).unwrap();
    e.fail("criu died", 5).unwrap();
    assert_eq!(
        e.state,
        EpochState::Failed {
            phase: Phase::LocalCheckpoint,
            reason: "criu died".into()
        }
    );
    assert!(!e.is_restorable());
    assert!(e.fail("again", 6).is_err());
    for &p in &PHASES {
        assert!(e.enter(p).is_err());
    }
    assert!(e.commit(manifests(), 7).is_err());
}

#[test]
fn a_restart_places_the_job_from_its_epoch_whatever_ran_since() {
    let mut j = job(JobState::Stopped);
    let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let m = |a: &[(&str, &str)]| {
        a.iter()
            .map(|(x, y)| (x.to_string(), y.to_string()))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    j.node = "n1".into();
    j.parts = v(&["n2", "n3"]);
    j.addresses = m(&[("n1", "a1"), ("n2", "a2"), ("n3", "a3")]);
    let epoch1 = j.nodes();
    // Epoch 1 restarted with every part moved.
    j.place_from(&epoch1, &m(&[("n1", "n6"), ("n2", "n5"), ("n3", "n4")]));
    assert_eq!(j.nodes(), v(&["n6", "n5", "n4"]));
    assert_eq!(j.addresses, m(&[("n6", "a1"), ("n5", "a2"), ("n4", "a3")]));
    assert_eq!(j.moved, m(&[("n1", "n6"), ("n2", "n5"), ("n3", "n4")]));
    // Epoch 1 again, on its own nodes: back where it ran, nothing moved.
    j.place_from(&epoch1, &m(&[]));
    assert_eq!(j.nodes(), epoch1);
    assert_eq!(j.addresses, m(&[("n1", "a1"), ("n2", "a2"), ("n3", "a3")]));
    assert!(j.moved.is_empty(), "{:?}", j.moved);
    // n3 to n4, then an epoch there, then n4 to n5: ckpt-rsh still names n3.
    j.place_from(&epoch1, &m(&[("n3", "n4")]));
    let epoch2 = j.nodes();
    j.place_from(&epoch2, &m(&[("n4", "n5")]));
    assert_eq!(j.nodes(), v(&["n1", "n2", "n5"]));
    assert_eq!(j.moved, m(&[("n3", "n5")]));
    assert_eq!(j.addresses.get("n5").map(String::as_str), Some("a3"));
    // A restart places the job before it releases the parts and again once they run: the
    // second placement changes nothing.
    let once = (j.nodes(), j.addresses.clone(), j.moved.clone());
    j.place_from(&epoch2, &m(&[("n4", "n5")]));
    assert_eq!((j.nodes(), j.addresses.clone(), j.moved.clone()), once);
}

fn job(state: JobState) -> Job {
    super::fixtures::job(3, state)
}

fn all_states() -> Vec<JobState> {
    vec![
        JobState::Starting,
        JobState::Running,
        JobState::Checkpointing,
        JobState::Restarting,
        JobState::Exited {
            code: Some(0),
            signal: None,
        },
        JobState::Stopped,
        JobState::Cancelled,
        JobState::Lost,
    ]
}

#[test]
fn job_guards_refuse_every_illegal_transition() {
    for s in all_states() {
        let mut j = job(s.clone());
        assert_eq!(
            j.begin_checkpoint().is_ok(),
            s == JobState::Running,
            "checkpoint from {s:?}"
        );
        let mut j2 = job(s.clone());
        assert_eq!(
            j2.begin_restart().is_ok(),
            !s.is_active(),
            "restart from {s:?}"
        );
        // Running (killed), or ended in a way a restart follows (given up); not one that
        // starts, checkpoints, restarts, finished with its own code or was cancelled.
        let mut j3 = job(s.clone());
        assert_eq!(
            j3.cancel().is_ok(),
            matches!(s, JobState::Running | JobState::Stopped | JobState::Lost),
            "cancel from {s:?}"
        );
        let mut j4 = job(s.clone());
        assert_eq!(
            j4.end_checkpoint(None, false).is_ok(),
            s == JobState::Checkpointing
        );
        let mut j5 = job(s.clone());
        assert_eq!(j5.end_restart(Ok(2)).is_ok(), s == JobState::Restarting);
        if s != JobState::Running {
            assert_eq!(j.state, s, "refused checkpoint changed state");
        }
    }
    // Killed by a signal: a restart follows, so it may be given up (and gives back its
    // addresses).
    let mut killed = job(JobState::Exited {
        code: None,
        signal: Some(9),
    });
    assert!(killed.holds_addresses());
    killed.cancel().unwrap();
    assert!(!killed.holds_addresses());
    let err = job(JobState::Running).begin_restart().unwrap_err();
    assert!(err.to_string().contains("job 3 is running"), "{err}");
}

#[test]
fn checkpoint_numbers_epochs_and_kill_stops() {
    let mut j = job(JobState::Running);
    assert_eq!(j.begin_checkpoint().unwrap(), 1);
    j.end_checkpoint(Some(1), false).unwrap();
    assert_eq!(j.begin_checkpoint().unwrap(), 2);
    j.end_checkpoint(None, false).unwrap();
    assert_eq!(j.latest_committed, 1, "a failed epoch is not restorable");
    assert_eq!(j.begin_checkpoint().unwrap(), 3);
    j.end_checkpoint(Some(3), true).unwrap();
    assert_eq!(j.state, JobState::Stopped);
    j.begin_restart().unwrap();
    j.end_restart(Ok(5)).unwrap();
    assert_eq!((j.state.clone(), j.incarnation), (JobState::Running, 5));
}

#[test]
fn reports_about_other_incarnations_are_ignored() {
    let mut j = job(JobState::Running);
    let exited = JobState::Exited {
        code: Some(0),
        signal: None,
    };
    assert!(!j.observe(0, exited.clone()), "stale incarnation");
    assert!(j.observe(1, exited.clone()));
    assert_eq!(j.state, exited);
    let mut j = job(JobState::Checkpointing);
    assert!(
        !j.observe(1, JobState::Lost),
        "no change during a checkpoint"
    );
    let mut j = job(JobState::Running);
    assert!(j.observe(1, JobState::Lost));
    assert!(!j.observe(1, JobState::Lost));
    assert!(
        j.observe(1, exited.clone()),
        "a definitive exit replaces lost"
    );
    assert!(!j.observe(1, JobState::Lost), "and is not replaced by lost");
    assert_eq!(j.state, exited);
    let mut j = job(JobState::Lost);
    j.lost = Some(LostNode {
        node: "n3".into(),
        since_unix_ms: 1,
        noticed_unix_ms: 2,
    });
    let killed = JobState::Exited {
        code: None,
        signal: Some(9),
    };
    assert!(
        !j.observe(1, killed),
        "the launcher killed after its job was lost with a node does not end it"
    );
    assert_eq!(j.state, JobState::Lost);
}

#[test]
fn a_jobs_engine_is_stored_by_name_and_none_as_empty() {
    let mut j = super::fixtures::job(1, JobState::Running);
    for (engine, stored) in [
        (None, ""),
        (Some(Engine::Criu), "criu"),
        (Some(Engine::Dmtcp), "dmtcp"),
    ] {
        j.engine = engine;
        let v = serde_json::to_value(&j).unwrap();
        assert_eq!(v["engine"], stored);
        let back: Job = serde_json::from_value(v).unwrap();
        assert_eq!(back.engine, engine);
        assert_eq!(back.snapshot_engine(), engine.unwrap_or(Engine::Criu));
    }
    let mut v = serde_json::to_value(&j).unwrap();
    v.as_object_mut().unwrap().remove("engine");
    assert_eq!(
        serde_json::from_value::<Job>(v.clone()).unwrap().engine,
        None
    );
    v["engine"] = "blcr".into();
    let e = serde_json::from_value::<Job>(v).unwrap_err().to_string();
    assert!(
        e.contains("unknown snapshot engine \"blcr\": use criu or dmtcp"),
        "{e}"
    );
}
