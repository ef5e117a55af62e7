//! The phase driver against in-process fake agents: the real coordinator, registry and gRPC
//! clients, and one fake `Agent` service per node on a Unix socket in a temporary directory. A
//! script tells a fake to fail or to hang in any call; every call is logged. No root, no CRIU,
//! no processes: every phase's abort path and deadline, for checkpoint and restart, in
//! milliseconds.
use std::collections::BTreeMap;

use crate::cluster::*;
use coordinator::agents::FailureKind;
use coordinator::driver::DriveError;
use coordinator::model::{EpochState, JobState, Phase};
use tonic::Code;

/// `ckptctl run --rdma` gives the UCX settings to the job's parts on other nodes, which
/// `ckpt-rsh` starts with a login environment.
#[tokio::test]
async fn a_jobs_parts_on_other_nodes_get_its_part_env() {
    let c = Cluster::start().await;
    let job = c.job().await;
    let launches = c.world.lock().unwrap().launches.clone();
    let part = format!("{job} UCX_TLS=rc_verbs,ud_verbs,self");
    assert_eq!(
        launches,
        [
            ("n1".to_string(), format!("{job} ")),
            ("n2".to_string(), part.clone()),
            ("n3".to_string(), part),
        ],
        "the launcher node has the job's own environment, the others the part_env too"
    );
}

/// A job's caller cannot use `part_env` to set ckpt's own variables (the job's token, the
/// agent's socket) in its parts: the run is refused before any node is asked to launch.
#[tokio::test]
async fn a_run_whose_part_env_sets_ckpts_own_variables_is_refused_before_any_launch() {
    let c = Cluster::start().await;
    let spec = coordinator::driver::RunSpec {
        name: "sneaky".into(),
        argv: vec!["mpiexec".into()],
        cwd: "/".into(),
        env: Default::default(),
        node: "n1".into(),
        part_env: [("CKPT_IBQ_SOCKET".to_string(), "/tmp/mine.sock".to_string())].into(),
        policy: Default::default(),
        engine: String::new(),
        on_failure: String::new(),
        redundancy: String::new(),
    };
    let e = c.coord.run(OWNER, spec).await.unwrap_err();
    assert!(
        matches!(&e, DriveError::Invalid(m) if m.contains("CKPT_IBQ_SOCKET")),
        "{e}"
    );
    assert!(
        c.world.lock().unwrap().launches.is_empty(),
        "nothing launched"
    );
}

#[tokio::test]
async fn a_run_asking_for_an_engine_its_node_lacks_is_refused_before_any_launch() {
    let c = Cluster::start().await;
    let spec = |engine: &str| coordinator::driver::RunSpec {
        name: "dmtcp".into(),
        argv: vec!["mpiexec".into()],
        cwd: "/".into(),
        env: Default::default(),
        node: "n1".into(),
        part_env: Default::default(),
        policy: Default::default(),
        engine: engine.into(),
        on_failure: String::new(),
        redundancy: String::new(),
    };
    let e = c.coord.run(OWNER, spec("dmtcp")).await.unwrap_err();
    assert!(
        matches!(&e, DriveError::Invalid(m) if m.contains("node n1 has no dmtcp engine") && m.contains("criu 4.2")),
        "{e}"
    );
    let e = c.coord.run(OWNER, spec("blcr")).await.unwrap_err();
    assert!(
        matches!(&e, DriveError::Invalid(m) if m.contains("unknown snapshot engine")),
        "{e}"
    );
    assert!(
        c.world.lock().unwrap().launches.is_empty(),
        "nothing launched"
    );
    let job = c.coord.run(OWNER, spec("criu")).await.unwrap();
    assert_eq!(job.snapshot_engine(), ckpt_proto::Engine::Criu);
}

#[tokio::test]
async fn a_checkpoint_runs_every_phase_on_every_node_and_commits_their_manifests() {
    let c = Cluster::start().await;
    let job = c.job().await;
    assert_eq!(c.checkpoint(job, false).await.unwrap(), 1);
    for (call, _) in PHASES {
        assert_eq!(c.nodes_called(call), all_nodes(), "{call}");
    }
    // Barriers: no node is asked for a phase before every node finished the one before;
    // finalize needs none after resume (without channels to rebuild it follows on each stream).
    let log = c.world.lock().unwrap().log.clone();
    for pair in PHASES[..4].windows(2) {
        let last_of = log
            .iter()
            .rposition(|(_, call, _)| *call == pair[0].0)
            .unwrap();
        let first_of_next = log
            .iter()
            .position(|(_, call, _)| *call == pair[1].0)
            .unwrap();
        assert!(
            last_of < first_of_next,
            "{} before {}: {log:?}",
            pair[0].0,
            pair[1].0
        );
    }
    let e = c.coord.registry.epoch(job, 1).unwrap().unwrap();
    assert_eq!(e.state, EpochState::Committed);
    let want: BTreeMap<String, String> = NODES
        .iter()
        .map(|n| (n.to_string(), digest(n, 1)))
        .collect();
    assert_eq!(e.manifests, want);
    assert_eq!((e.image_bytes, e.image_files, e.frozen_ms), (3000, 9, 5));
    assert!(c.calls("abort").is_empty());
    assert_eq!(c.job_state(job), JobState::Running);
    assert_eq!(
        c.coord.registry.job(job).unwrap().unwrap().latest_committed,
        1
    );
}

/// A node refusing phase `call`: the epoch fails in that phase naming the node, every node is
/// told to abort it, no node is asked for a later phase, and the job runs on.
async fn refusal_in(call: &'static str, phase: Phase) {
    let c = Cluster::start().await;
    let job = c.job().await;
    c.script("n2", call, Act::Fail(Code::FailedPrecondition));
    let e = c.checkpoint(job, false).await.unwrap_err();
    let DriveError::EpochFailed {
        phase: failed,
        failure,
        ..
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!(*failed, phase.name(), "{e}");
    assert_eq!(
        (failure.node.as_str(), failure.kind),
        ("n2", FailureKind::Refused),
        "{e}"
    );
    assert!(e.to_string().contains("refused by the script"), "{e}");
    assert_eq!(c.nodes_called("abort"), all_nodes());
    // Finalize travels right behind resume: it may have run on the other nodes, but the
    // epoch is aborted all the same.
    let later = PHASES
        .iter()
        .skip_while(|(p, _)| *p != call)
        .skip(if call == "resume" { 2 } else { 1 });
    for (next, _) in later {
        assert!(c.calls(next).is_empty(), "{next} after a failed {call}");
    }
    assert!(matches!(c.epoch_state(job, 1), EpochState::Failed { phase: p, .. } if p == phase));
    assert_eq!(c.job_state(job), JobState::Running);
    // The job is not harmed: the next checkpoint commits.
    c.unscript();
    assert_eq!(c.checkpoint(job, false).await.unwrap(), 2);
}

#[tokio::test]
async fn a_refusal_in_initial_sync_aborts_the_epoch() {
    refusal_in("initial-sync", Phase::InitialSync).await;
}

#[tokio::test]
async fn a_refusal_in_quiesce_aborts_the_epoch() {
    refusal_in("quiesce", Phase::Quiesce).await;
}

#[tokio::test]
async fn a_refusal_in_local_checkpoint_aborts_the_epoch() {
    refusal_in("local-checkpoint", Phase::LocalCheckpoint).await;
}

#[tokio::test]
async fn a_refusal_in_resume_aborts_the_epoch() {
    refusal_in("resume", Phase::Resume).await;
}

#[tokio::test]
async fn a_refusal_in_finalize_aborts_the_epoch() {
    refusal_in("finalize", Phase::Finalize).await;
}

#[tokio::test]
async fn finalize_follows_resume_on_each_node_and_waits_for_a_channel_rebuild() {
    let c = Cluster::start().await;
    let job = c.job().await;
    c.checkpoint(job, false).await.unwrap();
    let log = c.world.lock().unwrap().log.clone();
    for n in NODES {
        let at = |call: &str| {
            log.iter()
                .position(|(node, c, _)| node == n && *c == call)
                .unwrap()
        };
        assert!(at("resume") < at("finalize"), "{n}: {log:?}");
    }
    assert!(c.calls("rebuild").is_empty());
    // With ib-quiesce channels, the nodes rebuild them after every node resumed, and only
    // then seal.
    c.world.lock().unwrap().channels = 1;
    c.world.lock().unwrap().log.clear();
    c.checkpoint(job, false).await.unwrap();
    let log = c.world.lock().unwrap().log.clone();
    let last = |call: &str| log.iter().rposition(|(_, c, _)| *c == call).unwrap();
    let first = |call: &str| log.iter().position(|(_, c, _)| *c == call).unwrap();
    assert_eq!(c.nodes_called("rebuild"), all_nodes());
    assert!(last("resume") < first("rebuild"), "{log:?}");
    assert!(last("rebuild") < first("finalize"), "{log:?}");
}

/// Verbs layers that drained on one node: every node is asked for a second quiesce round
/// (the drained ones release and freeze then) before any node dumps; without drained layers
/// there is one round.
#[tokio::test]
async fn drained_verbs_layers_get_a_second_quiesce_round_on_every_node_before_any_dump() {
    let c = Cluster::start().await;
    let job = c.job().await;
    c.checkpoint(job, false).await.unwrap();
    assert_eq!(
        c.calls("quiesce").len(),
        3,
        "one round without drained layers"
    );
    c.world.lock().unwrap().drained.insert("n2".into(), 2);
    c.world.lock().unwrap().log.clear();
    c.checkpoint(job, false).await.unwrap();
    let log = c.world.lock().unwrap().log.clone();
    for n in NODES {
        let rounds: Vec<usize> = log
            .iter()
            .enumerate()
            .filter(|(_, (node, call, _))| node == n && *call == "quiesce")
            .map(|(i, _)| i)
            .collect();
        assert_eq!(rounds.len(), 2, "{n}: {log:?}");
    }
    let last_quiesce = log.iter().rposition(|(_, c, _)| *c == "quiesce").unwrap();
    let first_dump = log
        .iter()
        .position(|(_, c, _)| *c == "local-checkpoint")
        .unwrap();
    assert!(last_quiesce < first_dump, "{log:?}");
}

#[tokio::test]
async fn a_jobs_next_epoch_reuses_its_streams_and_a_failed_one_drops_them() {
    let c = Cluster::start().await;
    let job = c.job().await;
    let streams = || c.world.lock().unwrap().streams;
    c.checkpoint(job, false).await.unwrap();
    assert_eq!(streams(), 3);
    c.checkpoint(job, false).await.unwrap();
    assert_eq!(
        streams(),
        3,
        "the second epoch rode the first one's streams"
    );
    // Another job has streams of its own.
    let other = c.job().await;
    c.checkpoint(other, false).await.unwrap();
    assert_eq!(streams(), 6);
    // A failed epoch leaves nothing behind: the next one opens new streams.
    c.script("n2", "quiesce", Act::Fail(Code::FailedPrecondition));
    c.checkpoint(job, false).await.unwrap_err();
    c.unscript();
    let before = streams();
    assert_eq!(c.checkpoint(job, false).await.unwrap(), 4);
    assert_eq!(streams(), before + 3);
    // An agent that registers again gets new streams too.
    let addr = c.coord.agents.address("n1").unwrap();
    c.coord
        .register_agent(
            "n1",
            Registration {
                address: addr,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let before = streams();
    c.checkpoint(job, false).await.unwrap();
    assert_eq!(streams(), before + 1);
}

/// A node that never answers phase `call`: the epoch fails at the phase's deadline naming the
/// node; the others are aborted before the call returns, the silent one in the background.
async fn silence_in(call: &'static str, phase: Phase) {
    let c = Cluster::start().await;
    let job = c.job().await;
    c.script("n3", call, Act::Hang);
    let e = c.checkpoint(job, false).await.unwrap_err();
    let DriveError::EpochFailed {
        phase: failed,
        failure,
        ..
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!(*failed, phase.name(), "{e}");
    assert_eq!(
        (failure.node.as_str(), failure.kind),
        ("n3", FailureKind::Deadline),
        "{e}"
    );
    assert!(e.to_string().contains("deadline"), "{e}");
    assert_eq!(c.nodes_called("abort")[..2], ["n1", "n2"]);
    c.wait_call("n3", "abort").await;
    assert!(matches!(c.epoch_state(job, 1), EpochState::Failed { phase: p, .. } if p == phase));
    assert_eq!(c.job_state(job), JobState::Running);
}

#[tokio::test]
async fn a_deadline_in_initial_sync_aborts_the_epoch() {
    silence_in("initial-sync", Phase::InitialSync).await;
}

#[tokio::test]
async fn a_deadline_in_quiesce_aborts_the_epoch() {
    silence_in("quiesce", Phase::Quiesce).await;
}

#[tokio::test]
async fn a_deadline_in_local_checkpoint_aborts_the_epoch() {
    silence_in("local-checkpoint", Phase::LocalCheckpoint).await;
}

#[tokio::test]
async fn a_deadline_in_resume_aborts_the_epoch() {
    silence_in("resume", Phase::Resume).await;
}

#[tokio::test]
async fn a_deadline_in_finalize_aborts_the_epoch() {
    silence_in("finalize", Phase::Finalize).await;
}

#[tokio::test]
async fn an_unreachable_agent_fails_initial_sync_naming_its_node() {
    let c = Cluster::start().await;
    let job = c.job().await;
    // n2's agent moves away: its address now leads nowhere.
    c.coord
        .register_agent(
            "n2",
            Registration {
                address: "unix:/nonexistent/agent.sock".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let e = c.checkpoint(job, false).await.unwrap_err();
    let DriveError::EpochFailed { phase, failure, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!(*phase, Phase::InitialSync.name());
    assert_eq!(
        (failure.node.as_str(), failure.kind),
        ("n2", FailureKind::Unreachable),
        "{e}"
    );
    assert!(
        e.to_string().contains("node n2") && e.to_string().contains("`ckptctl nodes`"),
        "the message names the node and what to look at: {e}"
    );
    assert_eq!(c.nodes_called("abort")[..2], ["n1", "n3"]);
    assert_eq!(c.job_state(job), JobState::Running);
}

#[tokio::test]
async fn a_kill_checkpoint_that_fails_after_the_kill_leaves_the_job_stopped() {
    let c = Cluster::start().await;
    let job = c.job().await;
    c.script("n1", "finalize", Act::Fail(Code::Internal));
    let e = c.checkpoint(job, true).await.unwrap_err();
    assert!(
        matches!(
            e,
            DriveError::EpochFailed {
                phase: "finalize",
                ..
            }
        ),
        "{e}"
    );
    assert!(c
        .calls("resume")
        .iter()
        .all(|(_, d)| d.ends_with("kill=true")));
    assert_eq!(c.job_state(job), JobState::Stopped);
    // Failed before the kill: the job runs on.
    c.unscript();
    c.script("n1", "local-checkpoint", Act::Fail(Code::Internal));
    let job2 = c.job().await;
    c.checkpoint(job2, true).await.unwrap_err();
    assert!(c.calls("resume").is_empty());
    assert_eq!(c.job_state(job2), JobState::Running);
}

#[tokio::test]
async fn a_restart_restores_every_node_held_then_releases_them_together() {
    let c = Cluster::start().await;
    let job = c.stopped_job().await;
    assert_eq!(c.restart(job, 0).await.unwrap(), 2);
    let mut restored = c.calls("restore");
    restored.sort();
    let want: Vec<(String, String)> = NODES
        .iter()
        .map(|n| {
            (
                n.to_string(),
                format!("2 hold=true digest={}", digest(n, 2)),
            )
        })
        .collect();
    assert_eq!(restored, want);
    // Released only once every node restored.
    let log = c.world.lock().unwrap().log.clone();
    let last_restore = log
        .iter()
        .rposition(|(_, call, _)| *call == "restore")
        .unwrap();
    let first_release = log
        .iter()
        .position(|(_, call, _)| *call == "release")
        .unwrap();
    assert!(last_restore < first_release, "{log:?}");
    assert!(c.calls("release").iter().all(|(_, d)| d == "kill=false"));
    assert_eq!(c.nodes_called("release"), all_nodes());
    assert_eq!(c.job_state(job), JobState::Running);
}

/// Restart with `call` on n2 answered by `act`: it fails naming n2, every node that restored
/// is killed, and the job is left as it was (stopped), restorable again.
async fn restart_fails_on(call: &'static str, act: Act, kind: FailureKind) {
    let c = Cluster::start().await;
    let job = c.stopped_job().await;
    c.script("n2", call, act);
    let e = c.restart(job, 2).await.unwrap_err();
    let DriveError::RestartFailed { epoch, failure, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!(
        (*epoch, failure.node.as_str(), failure.kind),
        (2, "n2", kind),
        "{e}"
    );
    let killed: Vec<String> = c
        .calls("release")
        .into_iter()
        .filter(|(_, d)| d == "kill=true")
        .map(|(n, _)| n)
        .collect();
    for n in ["n1", "n3"] {
        assert!(
            killed.iter().any(|k| k == n),
            "{n} not killed: {:?}",
            c.calls("release")
        );
    }
    if call == "restore" {
        // A part never runs while another is missing: none is released to run.
        let released: Vec<_> = c
            .calls("release")
            .into_iter()
            .filter(|(_, d)| d == "kill=false")
            .collect();
        assert!(released.is_empty(), "released without n2: {released:?}");
    }
    assert_eq!(c.job_state(job), JobState::Stopped);
    assert_eq!(c.epoch_state(job, 2), EpochState::Committed);
    c.unscript();
    assert_eq!(c.restart(job, 2).await.unwrap(), 2);
    assert_eq!(c.job_state(job), JobState::Running);
}

#[tokio::test]
async fn a_refused_restore_kills_the_restored_parts() {
    restart_fails_on(
        "restore",
        Act::Fail(Code::FailedPrecondition),
        FailureKind::Refused,
    )
    .await;
}

#[tokio::test]
async fn a_restore_past_its_deadline_kills_the_restored_parts() {
    restart_fails_on("restore", Act::Hang, FailureKind::Deadline).await;
}

#[tokio::test]
async fn a_release_that_fails_kills_the_released_parts() {
    restart_fails_on("release", Act::Fail(Code::Internal), FailureKind::Internal).await;
}

#[tokio::test]
async fn a_release_past_its_deadline_kills_the_released_parts() {
    restart_fails_on("release", Act::Hang, FailureKind::Deadline).await;
}

/// Two nodes fail one restore for different reasons: the error tells both, not only the first
/// in node order (which may be a consequence, not the cause).
#[tokio::test]
async fn a_restore_failing_on_two_nodes_names_both() {
    let c = Cluster::start().await;
    let job = c.stopped_job().await;
    c.script("n1", "restore", Act::Fail(Code::Internal));
    c.script("n3", "restore", Act::Fail(Code::FailedPrecondition));
    let e = c.restart(job, 2).await.unwrap_err().to_string();
    assert!(
        e.contains("node n1") && e.contains("and node n3"),
        "both nodes named: {e}"
    );
    assert_eq!(c.job_state(job), JobState::Stopped);
}

#[tokio::test]
async fn images_lost_on_a_node_fall_back_to_the_previous_epoch() {
    let c = Cluster::start().await;
    let job = c.stopped_job().await;
    // n1 finds epoch 2's images damaged in every copy; epoch 1's are fine.
    c.script("n1", "restore", Act::FailIf(Code::DataLoss, "2 "));
    assert_eq!(c.restart(job, 0).await.unwrap(), 1);
    let epochs: Vec<char> = c
        .calls("restore")
        .iter()
        .map(|(_, d)| d.chars().next().unwrap())
        .collect();
    assert!(epochs.contains(&'2') && epochs.contains(&'1'), "{epochs:?}");
    assert_eq!(c.job_state(job), JobState::Running);
}

#[tokio::test]
async fn images_lost_in_every_epoch_fail_the_restart_naming_each() {
    let c = Cluster::start().await;
    let job = c.stopped_job().await;
    c.script("n1", "restore", Act::Fail(Code::DataLoss));
    let e = c.restart(job, 0).await.unwrap_err();
    let DriveError::RestartFailed { epoch, failure, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!((*epoch, failure.kind), (1, FailureKind::DataLoss), "{e}");
    assert!(e.to_string().contains("before that, epoch 2"), "{e}");
    assert_eq!(c.job_state(job), JobState::Stopped);
}

/// Retention's deletions ride the job's next epoch: a commit that expires an epoch makes no
/// call to any node; the next initial synchronization tells every node, once. A `--kill` epoch
/// (no next epoch follows) has its nodes delete at once.
#[tokio::test]
async fn retention_deletes_with_the_next_initial_sync_not_a_call_per_node() {
    let c = Cluster::start_with(|cfg| cfg.retention.keep_local = 2).await;
    let job = c.job().await;
    let unpruned = || c.unpruned(job);
    for _ in 0..3 {
        c.checkpoint(job, false).await.unwrap();
    }
    assert!(matches!(c.epoch_state(job, 1), EpochState::Expired { .. }));
    assert_eq!(unpruned(), [1], "epoch 1's deletion waits for epoch 4");
    assert!(c.calls("prune").is_empty());
    assert_eq!(c.nodes_told("initial-sync", "3"), all_nodes());
    c.checkpoint(job, false).await.unwrap();
    assert_eq!(c.nodes_told("initial-sync", "4 prune=[1]"), all_nodes());
    assert_eq!(unpruned(), [2], "told: only epoch 2 waits now");
    assert!(c.calls("prune").is_empty(), "{:?}", c.calls("prune"));
    // An epoch that fails keeps what it carried for the next.
    c.script("n2", "quiesce", Act::Fail(Code::FailedPrecondition));
    c.checkpoint(job, false).await.unwrap_err();
    c.unscript();
    assert_eq!(c.nodes_told("initial-sync", "5 prune=[2]"), all_nodes());
    assert_eq!(unpruned(), [2]);
    // The job stops with this one: epoch 3 (expired by it) and 2 go now.
    assert_eq!(c.checkpoint(job, true).await.unwrap(), 6);
    assert_eq!(c.nodes_told("initial-sync", "6 prune=[2]"), all_nodes());
    assert_eq!(c.pruned("[3]").await, all_nodes());
    assert!(unpruned().is_empty());
    assert!(matches!(c.epoch_state(job, 3), EpochState::Expired { .. }));
    assert_eq!(c.epoch_state(job, 4), EpochState::Committed);
}

/// A restart may move the job's parts: the deletions its next epoch would have carried are
/// made at once, on the nodes of their epochs.
#[tokio::test]
async fn a_restart_has_the_waiting_deletions_made_at_once() {
    let c = Cluster::start_with(|cfg| cfg.retention.keep_local = 1).await;
    let job = c.job().await;
    c.checkpoint(job, false).await.unwrap();
    c.checkpoint(job, false).await.unwrap();
    c.script("n1", "finalize", Act::Fail(Code::Internal));
    c.checkpoint(job, true).await.unwrap_err();
    c.unscript();
    assert_eq!(c.job_state(job), JobState::Stopped);
    assert_eq!(c.unpruned(job), [1]);
    assert!(c.calls("prune").is_empty());
    c.restart(job, 2).await.unwrap();
    assert_eq!(c.pruned("[1]").await, all_nodes());
    assert!(c.unpruned(job).is_empty());
}

/// `ckpt-rsh` stops waiting for a part slow to start (its call times out) and asks again with
/// the same attempt: the part starts once and the retry gets it; another `ckpt-rsh` naming the
/// same host is refused. A part whose start fails after its caller went away is not left
/// recorded: a later `ckpt-rsh` may start it.
#[tokio::test]
async fn a_slow_part_start_outlives_its_callers_timeout_and_the_retry_gets_it() {
    use std::time::Duration;
    // Deadlines of 300 ms: the slow start takes half of one.
    let c = Cluster::start().await;
    let job = c.coord.run(OWNER, sleep_on("n1")).await.unwrap();
    let attach = |host: &str, attempt: &str| ckpt_proto::v1::AttachRequest {
        job_id: job.id,
        token: job.token.clone(),
        host: host.into(),
        command: "rank".into(),
        cwd: "/".into(),
        attempt: attempt.into(),
    };
    let gave_up = |r: Result<_, tokio::time::error::Elapsed>| r.is_err();
    let launches_on = |n: &str| c.calls("launch").iter().filter(|(x, _)| x == n).count();
    c.script("n2", "launch", Act::Delay(Duration::from_millis(150)));
    let first = c.coord.attach(attach("n2", "a1"));
    assert!(gave_up(
        tokio::time::timeout(Duration::from_millis(30), first).await
    ));
    let r = c.coord.attach(attach("n2", "a1")).await.unwrap();
    assert_eq!((r.node.as_str(), r.pid), ("n2", 100));
    assert_eq!(launches_on("n2"), 1, "started once");
    let e = c.coord.attach(attach("n2", "a2")).await.unwrap_err();
    assert!(
        e.to_string().contains("already has processes on node n2"),
        "{e}"
    );
    c.script("n3", "launch", Act::Hang);
    let first = c.coord.attach(attach("n3", "b1"));
    assert!(gave_up(
        tokio::time::timeout(Duration::from_millis(30), first).await
    ));
    let parts = || c.coord.registry.job(job.id).unwrap().unwrap().parts;
    let begin = std::time::Instant::now();
    while parts().contains(&"n3".to_string()) {
        assert!(begin.elapsed() < Duration::from_secs(10), "{:?}", parts());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.unscript();
    c.coord.attach(attach("n3", "b2")).await.unwrap();
    assert_eq!(parts(), ["n2", "n3"]);
}
