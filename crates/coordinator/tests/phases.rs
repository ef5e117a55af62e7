//! The phase driver against in-process fake agents: the real coordinator, registry and gRPC
//! clients, and one fake `Agent` service per node on a Unix socket in a temporary directory. A
//! script tells a fake to fail or to hang in any call; every call is logged. No root, no CRIU,
//! no processes: every phase's abort path and deadline, for checkpoint and restart, in
//! milliseconds.
#[path = "phases/cluster.rs"]
mod cluster;

use std::collections::BTreeMap;
use std::time::Duration;

use cluster::*;
use coordinator::agents::FailureKind;
use coordinator::driver::{Caller, DriveError};
use coordinator::model::{EpochState, JobState, Phase};
use tokio::sync::mpsc;
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
        .register_agent("n1", &addr, vec![], String::new())
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
        .register_agent("n2", "unix:/nonexistent/agent.sock", vec![], String::new())
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

/// A stopped job with committed epochs 1 (kept running) and 2 (`--kill`).
async fn stopped_job(c: &Cluster) -> u64 {
    let job = c.job().await;
    c.checkpoint(job, false).await.unwrap();
    c.checkpoint(job, true).await.unwrap();
    assert_eq!(c.job_state(job), JobState::Stopped);
    c.world.lock().unwrap().log.clear();
    job
}

#[tokio::test]
async fn a_restart_restores_every_node_held_then_releases_them_together() {
    let c = Cluster::start().await;
    let job = stopped_job(&c).await;
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
    let job = stopped_job(&c).await;
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
    let job = stopped_job(&c).await;
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
    let job = stopped_job(&c).await;
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
    let job = stopped_job(&c).await;
    c.script("n1", "restore", Act::Fail(Code::DataLoss));
    let e = c.restart(job, 0).await.unwrap_err();
    let DriveError::RestartFailed { epoch, failure, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!((*epoch, failure.kind), (1, FailureKind::DataLoss), "{e}");
    assert!(e.to_string().contains("before that, epoch 2"), "{e}");
    assert_eq!(c.job_state(job), JobState::Stopped);
}

fn placed(nodes: &[&str], map: &[&str]) -> coordinator::driver::Placement {
    coordinator::driver::Placement {
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
        map: map.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    }
}

/// A cluster with a job network and a fourth node, n4, that runs nothing.
async fn with_job_network() -> Cluster {
    let c = Cluster::start_with(|cfg| {
        cfg.job_network.addresses = "10.9.0.10-10.9.0.20".into();
        cfg.job_network.prefix = 24;
    })
    .await;
    c.add_node("n4").await;
    c
}

/// `restart --map n3=n4`: n4 restores n3's part (named as the images' node), the job's nodes
/// and addresses follow, and a restored `ckpt-rsh` that still names n3 finds n4.
#[tokio::test]
async fn a_restart_moves_a_part_to_another_node_with_its_address() {
    let c = with_job_network().await;
    let job = stopped_job(&c).await;
    let before = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(
        c.restart_on(job, 0, &placed(&[], &["n3=n4"]))
            .await
            .unwrap(),
        2
    );
    let mut restored = c.calls("restore");
    restored.sort();
    let details: Vec<(String, bool)> = restored
        .iter()
        .map(|(n, d)| (n.clone(), d.ends_with(" from=n3")))
        .collect();
    assert_eq!(
        details,
        [
            ("n1".to_string(), false),
            ("n2".to_string(), false),
            ("n4".to_string(), true)
        ]
    );
    let after = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(after.nodes(), ["n1", "n2", "n4"]);
    assert_eq!(after.addresses.get("n4"), before.addresses.get("n3"));
    assert!(!after.addresses.contains_key("n3"));
    assert_eq!(after.moved, BTreeMap::from([("n3".into(), "n4".into())]));
    let located = c
        .coord
        .locate(ckpt_proto::v1::LocateRequest {
            job_id: job,
            token: after.token.clone(),
            node: "n3".into(),
        })
        .await
        .unwrap();
    assert_eq!(Some(located.agent), c.coord.agents.address("n4"));
}

/// Bad placements are refused before any node restores anything, each with its own error
/// (and so its own ckptctl exit code).
#[tokio::test]
async fn a_restart_refuses_bad_placements_before_touching_any_node() {
    let c = with_job_network().await;
    let job = stopped_job(&c).await;
    let cases: [(&[&str], &[&str], Code, &str); 6] = [
        (
            &["n4", "n2"],
            &[],
            Code::InvalidArgument,
            "ran on 3 node(s)",
        ),
        (&[], &["n3"], Code::InvalidArgument, "OLD=NEW"),
        (
            &[],
            &["n7=n4"],
            Code::InvalidArgument,
            "not a node of epoch",
        ),
        (
            &[],
            &["n3=n9"],
            Code::NotFound,
            "n9 has no registered agent",
        ),
        (
            &["n1", "n2", "n2"],
            &[],
            Code::FailedPrecondition,
            "two parts",
        ),
        (&[], &["n3=n1"], Code::FailedPrecondition, "two parts"),
    ];
    for (nodes, map, code, says) in cases {
        let e = refused_restart(&c, job, placed(nodes, map), code).await;
        assert!(e.contains(says), "{nodes:?} {map:?}: {e}");
    }
    // Another job runs on n4: not free for a moved part.
    let other = c.job_on("n4").await;
    let e = refused_restart(&c, job, placed(&[], &["n3=n4"]), Code::FailedPrecondition).await;
    assert!(e.contains(&format!("job {other} runs a part there")), "{e}");
}

/// A restart refused with `code` before any node restored anything; the job stays stopped.
async fn refused_restart(
    c: &Cluster,
    job: u64,
    placement: coordinator::driver::Placement,
    code: Code,
) -> String {
    let e = c.restart_on(job, 0, &placement).await.unwrap_err();
    assert_eq!(
        coordinator::grpc::to_status(&e).code(),
        code,
        "{placement:?}: {e}"
    );
    assert!(
        c.calls("restore").is_empty(),
        "nothing restored anywhere: {e}"
    );
    assert_eq!(c.job_state(job), JobState::Stopped);
    e.to_string()
}

/// A job that ran without a job network keeps the nodes' PIDs and addresses: it may not move.
#[tokio::test]
async fn a_job_without_sandboxes_restarts_only_on_its_own_nodes() {
    let c = Cluster::start().await;
    c.add_node("n4").await;
    let job = stopped_job(&c).await;
    let e = refused_restart(&c, job, placed(&[], &["n3=n4"]), Code::FailedPrecondition).await;
    assert!(e.contains("without a job network"), "{e}");
}

/// A cluster with a job network, spares n5 and n4 (in that order), a 1 s node timeout, and
/// shared storage on every node.
async fn with_spares() -> Cluster {
    let c = Cluster::start_sharing(
        |cfg| {
            cfg.job_network.addresses = "10.9.0.10-10.9.0.20".into();
            cfg.job_network.prefix = 24;
            cfg.spares.nodes = vec!["n5".into(), "n4".into()];
            cfg.node_timeout = Duration::from_secs(1);
        },
        "/shared",
    )
    .await;
    c.add_node_sharing("n4", "/shared").await;
    c.add_node_sharing("n5", "/shared").await;
    c
}

/// Lets the node timeout pass with only `up` sending heartbeats: the others are down.
async fn only_up(c: &Cluster, up: &[&str]) {
    tokio::time::sleep(Duration::from_millis(1200)).await;
    beat(c, up).await;
}

/// Heartbeats from `nodes` now.
async fn beat(c: &Cluster, nodes: &[&str]) {
    for n in nodes {
        assert!(c.coord.heartbeat(n, vec![]).await, "{n} registered");
    }
}

/// n3 is down and so is the first spare, n5: a restart (plain, as spares are configured, and
/// with --on-spares) puts n3's part on n4, the next free spare, with n3's address.
#[tokio::test]
async fn a_restart_puts_the_part_of_a_node_that_is_down_on_a_free_spare() {
    let c = with_spares().await;
    let job = stopped_job(&c).await;
    let before = c.coord.registry.job(job).unwrap().unwrap();
    only_up(&c, &["n1", "n2", "n4"]).await;
    let on_spares = coordinator::driver::Placement {
        on_spares: true,
        ..Default::default()
    };
    // --on-spares with --map is refused.
    let both = coordinator::driver::Placement {
        map: vec!["n3=n4".into()],
        ..on_spares.clone()
    };
    refused_restart(&c, job, both, Code::InvalidArgument).await;
    assert_eq!(c.restart_on(job, 0, &on_spares).await.unwrap(), 2);
    let mut restored: Vec<String> = c
        .calls("restore")
        .into_iter()
        .map(|(n, d)| format!("{n}{}", if d.ends_with(" from=n3") { "<-n3" } else { "" }))
        .collect();
    restored.sort();
    assert_eq!(restored, ["n1", "n2", "n4<-n3"]);
    let after = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(after.nodes(), ["n1", "n2", "n4"]);
    assert_eq!(after.addresses.get("n4"), before.addresses.get("n3"));
    let status = c.coord.inspect(&after).await;
    let n4 = status.iter().find(|n| n.node == "n4").unwrap();
    assert_eq!(
        n4.moved_from, "n3",
        "status tells where the part ran before"
    );
}

/// No free spare: the only one up runs another job. Refused with ResourceExhausted (ckptctl
/// exit 10), naming the node that is down, before any node restored anything.
#[tokio::test]
async fn a_restart_with_no_free_spare_is_refused_before_touching_any_node() {
    let c = with_spares().await;
    let job = stopped_job(&c).await;
    let other = c.job_on("n4").await;
    only_up(&c, &["n1", "n2", "n4"]).await;
    let e = refused_restart(&c, job, Default::default(), Code::ResourceExhausted).await;
    assert!(
        e.contains("n3 (down)") && e.contains("no spare is free"),
        "{e}"
    );
    assert_eq!(c.job_state(other), JobState::Running);
}

/// `drain n2 --migrate`: the job is checkpointed and stopped, then restarted with n2's part on
/// the spare; without --migrate it stays stopped. Only root drains.
#[tokio::test]
async fn drain_checkpoints_the_jobs_of_a_node_and_migrates_them_to_a_spare() {
    let c = with_spares().await;
    let job = c.job().await;
    let user = c.coord.begin_drain(&OWNER, "n2", true).unwrap_err();
    assert_eq!(
        coordinator::grpc::to_status(&user).code(),
        Code::PermissionDenied,
        "{user}"
    );
    let root = Caller {
        uid: 0,
        gid: 0,
        pid: None,
    };
    beat(&c, &["n1", "n2", "n3", "n4", "n5"]).await;
    let jobs = c.coord.begin_drain(&root, "n2", true).unwrap();
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [job]);
    let (tx, _rx) = mpsc::unbounded_channel();
    let done = c.coord.drive_drain("n2", jobs, true, tx).await;
    assert_eq!(done.len(), 1);
    assert!(done[0].error.is_none(), "{:?}", done[0]);
    // n5 is the first spare and up: it takes n2's part.
    assert_eq!(done[0].moved_to.as_deref(), Some("n5"));
    let after = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(after.state, JobState::Running);
    assert_eq!(after.nodes(), ["n1", "n5", "n3"]);
    // Drained again without --migrate: n5's part stops, no job is left there.
    let jobs = c.coord.begin_drain(&root, "n5", false).unwrap();
    let (tx, _rx) = mpsc::unbounded_channel();
    let done = c.coord.drive_drain("n5", jobs, false, tx).await;
    assert!(
        done[0].error.is_none() && done[0].moved_to.is_none(),
        "{done:?}"
    );
    assert_eq!(c.job_state(job), JobState::Stopped);
    assert!(c.coord.begin_drain(&root, "n5", true).unwrap().is_empty());
}

/// Without shared storage a spare cannot get the drained node's images: the job is
/// checkpointed and stays stopped, and the error says what to do.
#[tokio::test]
async fn drain_without_shared_storage_leaves_the_job_stopped_and_says_why() {
    let c = Cluster::start_with(|cfg| {
        cfg.job_network.addresses = "10.9.0.10-10.9.0.20".into();
        cfg.job_network.prefix = 24;
        cfg.spares.nodes = vec!["n4".into()];
    })
    .await;
    c.add_node("n4").await;
    let job = c.job().await;
    let root = Caller {
        uid: 0,
        gid: 0,
        pid: None,
    };
    let jobs = c.coord.begin_drain(&root, "n2", true).unwrap();
    let (tx, _rx) = mpsc::unbounded_channel();
    let done = c.coord.drive_drain("n2", jobs, true, tx).await;
    let e = done[0].error.as_ref().expect("not migrated").to_string();
    assert!(
        e.contains("not flushed to shared storage")
            && e.contains(&format!("ckptctl restart {job}")),
        "{e}"
    );
    assert_eq!(done[0].epoch, Some(1));
    assert_eq!(c.job_state(job), JobState::Stopped);
    assert!(c.calls("restore").is_empty());
}

/// n3's partner copy is kept by n1 (the ring n1 -> n2 -> n3 -> n1). When n3's part moves to
/// n4, ckptd grants n4 the fetch of that copy on n1 and names n1 as the partner in n4's
/// restore.
#[tokio::test]
async fn a_moved_part_may_fetch_its_partner_copy_from_a_third_node() {
    let c = Cluster::start_with(|cfg| {
        cfg.job_network.addresses = "10.9.0.10-10.9.0.20".into();
        cfg.job_network.prefix = 24;
        cfg.redundancy.partner = true;
    })
    .await;
    c.add_node("n4").await;
    let job = stopped_job(&c).await;
    let begin = std::time::Instant::now();
    while c
        .coord
        .registry
        .epoch(job, 2)
        .unwrap()
        .unwrap()
        .partners
        .is_empty()
    {
        assert!(
            begin.elapsed() < Duration::from_secs(10),
            "no partner copies"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let partners = c.coord.registry.epoch(job, 2).unwrap().unwrap().partners;
    assert_eq!(
        partners.get("n3").map(String::as_str),
        Some("n1"),
        "{partners:?}"
    );
    c.world.lock().unwrap().log.clear();
    assert_eq!(
        c.restart_on(job, 2, &placed(&[], &["n3=n4"]))
            .await
            .unwrap(),
        2
    );
    assert_eq!(
        c.calls("allow-fetch"),
        [("n1".to_string(), format!("{job} 2 n3->n4"))]
    );
    let n4 = c
        .calls("restore")
        .into_iter()
        .find(|(n, _)| n == "n4")
        .unwrap()
        .1;
    assert!(n4.ends_with(" partner=n1 from=n3"), "{n4}");
}

/// After a move, a restart from an epoch taken before it runs the job on that epoch's nodes,
/// and the job's record (nodes, addresses, launcher's incarnation) says so.
#[tokio::test]
async fn a_restart_from_an_epoch_before_a_move_runs_on_that_epochs_nodes() {
    let c = with_job_network().await;
    let job = stopped_job(&c).await;
    let before = c.coord.registry.job(job).unwrap().unwrap();
    c.restart_on(job, 2, &placed(&[], &["n3=n4"]))
        .await
        .unwrap();
    c.checkpoint(job, true).await.unwrap();
    assert_eq!(
        c.coord.registry.epoch(job, 3).unwrap().unwrap().nodes,
        ["n1", "n2", "n4"]
    );
    c.restart_on(job, 2, &Default::default()).await.unwrap();
    let after = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(after.nodes(), ["n1", "n2", "n3"]);
    assert_eq!(after.addresses, before.addresses);
    assert!(after.moved.is_empty(), "{:?}", after.moved);
    assert_eq!(after.state, JobState::Running);
}

/// `drain --migrate` that could not move every job is refused before anything is stopped: a
/// job without sandboxes, or more jobs than free spares. A node that is down is refused too.
#[tokio::test]
async fn drain_migrate_that_cannot_move_every_job_stops_nothing() {
    let root = Caller {
        uid: 0,
        gid: 0,
        pid: None,
    };
    // No job network: the job cannot move.
    let c = Cluster::start_with(|cfg| cfg.spares.nodes = vec!["n4".into()]).await;
    c.add_node("n4").await;
    let job = c.job().await;
    let e = c.coord.begin_drain(&root, "n2", true).unwrap_err();
    assert_eq!(
        coordinator::grpc::to_status(&e).code(),
        Code::FailedPrecondition,
        "{e}"
    );
    assert!(e.to_string().contains("nothing was stopped"), "{e}");
    assert_eq!(c.job_state(job), JobState::Running);
    // Two jobs on n2 (one on n2 alone), one spare up (n5 is down).
    let c = with_spares().await;
    let first = c.job().await;
    let second = c.job_on("n2").await;
    only_up(&c, &["n1", "n2", "n3", "n4"]).await;
    let e = c.coord.begin_drain(&root, "n2", true).unwrap_err();
    assert_eq!(
        coordinator::grpc::to_status(&e).code(),
        Code::ResourceExhausted,
        "{e}"
    );
    assert!(e.to_string().contains("2 job(s) on n2"), "{e}");
    for j in [first, second] {
        assert_eq!(c.job_state(j), JobState::Running);
    }
    // n2 stops sending heartbeats: its parts cannot be checkpointed.
    only_up(&c, &["n1", "n3", "n4", "n5"]).await;
    let e = c.coord.begin_drain(&root, "n2", false).unwrap_err();
    assert!(e.to_string().contains("--on-spares"), "{e}");
}
