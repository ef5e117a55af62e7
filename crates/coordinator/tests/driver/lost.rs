//! Lost nodes, against the in-process fake agents of the phase tests: a job with a restart
//! policy whose node goes silent is lost, and comes back by itself on a spare, once and not in
//! a loop; a job without one is not fenced, so it is not lost either, and its part is moved off
//! a silent node only when the caller says that node is down.
use std::time::Duration;

use crate::cluster::*;
use coordinator::model::JobState;

use crate::placement::{placed, with_job_network};
use crate::spares::{beat, only_up, with_spares};

/// The launcher's node (n1) goes silent while a job that may move runs: the job becomes lost,
/// naming n1, what is left of it on n2 and n3 is killed, and a plain restart puts n1's part
/// (the launcher) on the free spare; the job then runs again and is no longer lost.
#[tokio::test]
async fn a_job_whose_launcher_node_goes_down_is_lost_and_restarts_on_a_spare() {
    let c = with_spares().await;
    let job = c.job().await;
    set_policy(&c, job, "restart");
    c.checkpoint(job, false).await.unwrap();
    assert!(
        c.coord.mark_lost().await.unwrap().is_empty(),
        "every node is up"
    );
    only_up(&c, &["n2", "n3", "n4", "n5"]).await;
    c.world.lock().unwrap().log.clear();
    assert_eq!(c.coord.mark_lost().await.unwrap(), [job]);
    let lost = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(*lost.state(), JobState::Lost);
    let why = lost.lost.clone().expect("the lost node is recorded");
    assert_eq!(why.node, "n1");
    assert!(why.since_unix_ms <= why.noticed_unix_ms, "{why:?}");
    assert_eq!(c.nodes_called("signal"), ["n2", "n3"], "the rest is killed");
    let info = coordinator::wire::job_info(&lost, vec![]);
    assert!(
        info.detail.contains("node n1") && info.detail.contains("restarts it by itself"),
        "{}",
        info.detail
    );
    assert!(c.coord.mark_lost().await.unwrap().is_empty(), "lost once");
    beat(&c, &["n2", "n3", "n4", "n5"]).await;
    assert_eq!(c.restart(job, 0).await.unwrap(), 1);
    let after = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(*after.state(), JobState::Running);
    assert_eq!(after.node, "n5", "the launcher's part runs on the spare");
    assert_eq!(after.lost, None);
}

/// An attached part's node goes down: the job is lost naming that node, the launcher and the
/// other part are killed; a job that is not running (stopped after a checkpoint) is left as it
/// is.
#[tokio::test]
async fn a_job_whose_attached_node_goes_down_is_lost_and_a_stopped_one_is_not() {
    let c = with_spares().await;
    let running = c.job().await;
    set_policy(&c, running, "restart");
    let stopped = c.stopped_job().await;
    only_up(&c, &["n1", "n2", "n4", "n5"]).await;
    c.world.lock().unwrap().log.clear();
    assert_eq!(c.coord.mark_lost().await.unwrap(), [running]);
    let lost = c.coord.registry.job(running).unwrap().unwrap();
    assert_eq!(lost.lost.map(|l| l.node).as_deref(), Some("n3"));
    assert_eq!(c.nodes_called("signal"), ["n1", "n2"]);
    assert_eq!(c.job_state(stopped), JobState::Stopped);
}

/// A job without a restart policy is not fenced by its nodes, so a silent node does not make
/// it lost: nothing is killed, it stays running, and its status names the node as
/// unreachable. Once cancelled, a restart that would move the silent node's part elsewhere is
/// refused, naming the node, until the caller says the node is down; in place it is not.
#[tokio::test]
async fn a_job_without_a_restart_policy_is_not_lost_with_a_silent_node_nor_moved_off_it() {
    let c = with_spares().await;
    let job = c.job().await;
    c.checkpoint(job, false).await.unwrap();
    only_up(&c, &["n1", "n2", "n4", "n5"]).await;
    c.world.lock().unwrap().log.clear();
    assert!(c.coord.mark_lost().await.unwrap().is_empty());
    assert_eq!(c.job_state(job), JobState::Running);
    assert!(c.nodes_called("signal").is_empty(), "nothing killed");
    let j = c.coord.registry.job(job).unwrap().unwrap();
    let unreachable = c.coord.unreachable(&j);
    assert_eq!(
        unreachable
            .iter()
            .map(|l| l.node.as_str())
            .collect::<Vec<_>>(),
        ["n3"]
    );
    let mut info = coordinator::wire::job_info(&j, vec![]);
    coordinator::wire::with_unreachable(&mut info, &j, unreachable);
    assert_eq!(info.state, "running");
    assert!(
        info.detail.contains("unreachable") && info.detail.contains("n3"),
        "{}",
        info.detail
    );
    // n3 heard from again: nothing to say.
    beat(&c, &["n3"]).await;
    assert!(c.coord.unreachable(&j).is_empty());

    only_up(&c, &["n1", "n2", "n4", "n5"]).await;
    c.coord.cancel(&OWNER, job).await.unwrap();
    let moved = |down: &[&str]| coordinator::driver::Placement {
        map: vec!["n3=n4".into()],
        down: down.iter().map(|d| d.to_string()).collect(),
        ..Default::default()
    };
    let e = c
        .coord
        .begin_restart(&OWNER, job, 0, &moved(&[]))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, coordinator::driver::DriveError::PartMayRun { node, .. } if node == "n3"),
        "{e}"
    );
    assert!(e.to_string().contains("--down n3"), "{e}");
    assert_eq!(c.job_state(job), JobState::Cancelled, "left as it was");
    let e = c
        .coord
        .begin_restart(&OWNER, job, 0, &moved(&["n2"]))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, coordinator::driver::DriveError::PartMayRun { .. }),
        "another node named: {e}"
    );
    let begun = c
        .coord
        .begin_restart(&OWNER, job, 0, &moved(&["n3"]))
        .await
        .expect("n3 said down");
    assert_eq!(begun.moves.get("n3").map(String::as_str), Some("n4"));
}

/// Gives the job a policy on failure, as `ckptctl run --on-failure` would have.
fn set_policy(c: &Cluster, job: u64, policy: &str) {
    let mut j = c.coord.registry.job(job).unwrap().unwrap();
    j.on_failure = coordinator::model::OnFailure::parse(policy).unwrap();
    c.coord.registry.put_job(&j).unwrap();
}

/// Waits (bounded) until the job is in `state`.
async fn wait_state(c: &Cluster, job: u64, state: JobState) {
    for _ in 0..100 {
        if c.job_state(job) == state {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("job {job} is {:?}, not {state:?}", c.job_state(job));
}

/// `--on-failure restart:2`: n1, the launcher's node, goes down; ckptd restarts the job by
/// itself from its latest committed epoch with n1's part on the free spare, and records the
/// restart (trigger, epoch, moves, outcome). The job fails again before a new checkpoint: it
/// is not restarted in a loop, and says why.
#[tokio::test]
async fn a_job_with_a_restart_policy_comes_back_by_itself_once_and_not_in_a_loop() {
    let c = with_spares().await;
    let job = c.job().await;
    set_policy(&c, job, "restart:2");
    c.coord.recover().await.unwrap();
    assert_eq!(c.job_state(job), JobState::Running, "nothing failed");
    c.checkpoint(job, false).await.unwrap();
    only_up(&c, &["n2", "n3", "n4", "n5"]).await;
    assert_eq!(c.coord.mark_lost().await.unwrap(), [job]);
    c.coord.recover().await.unwrap();
    wait_state(&c, job, JobState::Running).await;
    let mut j = c.coord.registry.job(job).unwrap().unwrap();
    for _ in 0..100 {
        if j.recoveries.iter().all(|r| r.outcome != "restoring") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        j = c.coord.registry.job(job).unwrap().unwrap();
    }
    assert_eq!(j.node, "n5", "the launcher's part on the first spare");
    assert_eq!(j.recoveries.len(), 1, "{:?}", j.recoveries);
    let r = &j.recoveries[0];
    assert_eq!(
        (r.trigger.as_str(), r.epoch, r.moves.clone()),
        ("node n1 lost", 1, vec!["n1=n5".to_string()])
    );
    // Its times, in order: the node's last contact, declared lost, placed, restored, running.
    let times = [
        r.failed_unix_ms,
        r.noticed_unix_ms,
        r.at_unix_ms,
        r.restored_unix_ms,
        r.running_unix_ms,
    ];
    assert!(
        times[0] > 0 && times.windows(2).all(|w| w[0] <= w[1]),
        "{r:?}"
    );
    let info = coordinator::wire::job_info(&j, vec![]);
    assert_eq!(info.on_failure, "restart:2");
    assert_eq!(info.recoveries[0].outcome, "running again from epoch 1");
    // The epoch restored keeps the restart too, as `ckptctl epochs` shows it.
    let e = c.coord.registry.epoch(job, 1).unwrap().unwrap();
    assert_eq!(
        e.restarts, j.recoveries,
        "the epoch's record of its restarts"
    );

    // n5 goes down too, before the job's next checkpoint: given up on, with the reason.
    only_up(&c, &["n2", "n3", "n4"]).await;
    assert_eq!(c.coord.mark_lost().await.unwrap(), [job]);
    c.world.lock().unwrap().log.clear();
    c.coord.recover().await.unwrap();
    c.coord.recover().await.unwrap();
    let j = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(*j.state(), JobState::Lost);
    assert_eq!(j.recoveries.len(), 1, "no second restart");
    assert!(
        j.recovery_note.contains("failed again") && j.recovery_note.contains("epoch 1"),
        "{}",
        j.recovery_note
    );
    assert!(c.nodes_called("restore").is_empty(), "nothing restored");
}

/// A lost job with a restart policy but no free spare waits, saying why, without using up a
/// try; it is restarted once a spare is free.
#[tokio::test]
async fn a_lost_job_waits_for_a_free_spare_without_using_a_try() {
    let c = with_spares().await;
    let job = c.job().await;
    set_policy(&c, job, "restart");
    c.checkpoint(job, false).await.unwrap();
    only_up(&c, &["n1", "n2"]).await;
    assert_eq!(c.coord.mark_lost().await.unwrap(), [job]);
    c.coord.recover().await.unwrap();
    let j = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(*j.state(), JobState::Lost);
    assert!(j.recoveries.is_empty());
    assert!(
        j.recovery_note
            .contains("node n3 lost: waiting to restart by itself")
            && j.recovery_note.contains("spare"),
        "{}",
        j.recovery_note
    );
    beat(&c, &["n1", "n2", "n4"]).await;
    c.coord.recover().await.unwrap();
    wait_state(&c, job, JobState::Running).await;
    let j = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(j.recoveries[0].moves, ["n3=n4"]);
}

/// `--on-failure` that makes no sense, or a restart policy for a job that cannot move, is
/// refused before anything starts, with a message that says what to do.
#[tokio::test]
async fn bad_restart_policies_are_refused_with_the_reason() {
    let spec = |policy: &str| coordinator::driver::RunSpec {
        on_failure: policy.into(),
        ..sleep_on("n1")
    };
    let c = with_spares().await;
    for (policy, says) in [
        ("restart:0", "never restarts"),
        ("restart:-3", "cannot be negative"),
        ("restart:5000", "more than 100"),
        ("twice", "expected"),
    ] {
        let e = c.coord.run(OWNER, spec(policy)).await.unwrap_err();
        assert!(
            matches!(&e, coordinator::driver::DriveError::Invalid(m) if m.contains(says)),
            "{policy}: {e}"
        );
    }
    let ok = c.coord.run(OWNER, spec("restart:4")).await.unwrap();
    assert_eq!(ok.on_failure.text(), "restart:4");
    let plain = Cluster::start().await;
    let e = plain.coord.run(OWNER, spec("restart")).await.unwrap_err();
    assert!(e.to_string().contains("without a sandbox"), "{e}");
    assert!(plain.calls("launch").is_empty(), "nothing launched");
    let stop = plain.coord.run(OWNER, spec("stop")).await.unwrap();
    assert_eq!(stop.on_failure.text(), "stop");
}

/// The launcher's exit (code 1), as its heartbeat reports it.
fn launcher_failed(incarnation: u32, job: u64) -> Vec<ckpt_proto::v1::JobReport> {
    vec![ckpt_proto::v1::JobReport {
        job_id: job,
        incarnation,
        state: ckpt_proto::v1::PartState::Exited.into(),
        end: Some(ckpt_proto::v1::JobEnd {
            how: Some(ckpt_proto::v1::job_end::How::ExitCode(1)),
        }),
        ..Default::default()
    }]
}

/// An MPI launcher ends with an error when a node of its job dies. That end waits until the
/// job's other nodes have been heard from since: n3 silent, the job stays running and is lost
/// with n3 at the node timeout, restartable; with every node alive, the same end is the job's.
#[tokio::test]
async fn a_launchers_failed_end_while_a_node_is_silent_is_the_nodes_loss() {
    let c = with_spares().await;
    let job = c.job().await;
    let inc = c.coord.registry.job(job).unwrap().unwrap().incarnation;
    tokio::time::sleep(Duration::from_millis(300)).await;
    beat(&c, &["n2"]).await;
    assert!(
        c.coord
            .heartbeat("n1", launcher_failed(inc, job), None)
            .await
    );
    assert_eq!(
        c.job_state(job),
        JobState::Running,
        "held: n3 not heard from since"
    );
    only_up(&c, &["n1", "n2"]).await;
    assert!(
        c.coord
            .heartbeat("n1", launcher_failed(inc, job), None)
            .await
    );
    assert_eq!(c.job_state(job), JobState::Running, "still held");
    assert_eq!(c.coord.mark_lost().await.unwrap(), [job]);
    let lost = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(lost.lost.map(|l| l.node).as_deref(), Some("n3"));

    let c = with_spares().await;
    let job = c.job().await;
    assert!(
        c.coord
            .heartbeat("n1", launcher_failed(inc, job), None)
            .await
    );
    assert_eq!(c.job_state(job), JobState::Running);
    beat(&c, &["n2", "n3"]).await;
    assert!(
        c.coord
            .heartbeat("n1", launcher_failed(inc, job), None)
            .await
    );
    assert!(
        matches!(c.job_state(job), JobState::Exited { code: Some(1), .. }),
        "{:?}",
        c.job_state(job)
    );
}

/// MPICH's mpiexec ends with the OR of its ranks' statuses: a rank on n2 killed by SIGKILL
/// makes it exit 15. n2 reports the death; the launcher's end that follows is a failure, and
/// the job comes back by itself in place, the report forgotten with the old incarnation.
#[tokio::test]
async fn a_rank_killed_on_another_node_makes_the_launchers_end_a_failure() {
    let c = with_spares().await;
    let job = c.job().await;
    set_policy(&c, job, "restart:2");
    c.checkpoint(job, false).await.unwrap();
    let inc = c.coord.registry.job(job).unwrap().unwrap().incarnation;
    let killed = vec![ckpt_proto::v1::JobReport {
        job_id: job,
        incarnation: 1,
        state: ckpt_proto::v1::PartState::Running.into(),
        killed: "heat (pid 77) killed by signal 9".into(),
        ..Default::default()
    }];
    // From a node that holds no part of the job: not taken.
    assert!(c.coord.heartbeat("n4", killed.clone(), None).await);
    assert!(c
        .coord
        .registry
        .job(job)
        .unwrap()
        .unwrap()
        .killed
        .is_empty());
    assert!(c.coord.heartbeat("n2", killed, None).await);
    let mut end = launcher_failed(inc, job);
    end[0].end = Some(ckpt_proto::v1::JobEnd {
        how: Some(ckpt_proto::v1::job_end::How::ExitCode(15)),
    });
    assert!(c.coord.heartbeat("n1", end.clone(), None).await);
    tokio::time::sleep(Duration::from_millis(20)).await;
    beat(&c, &["n2", "n3"]).await;
    assert!(c.coord.heartbeat("n1", end, None).await);
    let j = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(
        j.failure().as_deref(),
        Some("heat (pid 77) killed by signal 9 on n2"),
        "{:?}",
        j.state()
    );
    c.coord.recover().await.unwrap();
    wait_state(&c, job, JobState::Running).await;
    let j = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(
        j.recoveries[0].trigger,
        "heat (pid 77) killed by signal 9 on n2"
    );
    assert!(j.recoveries[0].moves.is_empty(), "in place");
    assert!(j.killed.is_empty(), "forgotten with the old incarnation");
}

/// Every job address held by a stopped job: another job is refused ("no free job address ...
/// cancel jobs that will not restart"). Cancelling the stopped job, as that says, gives them
/// back without a call to its nodes (nothing of it runs); its checkpoints stay restorable, and
/// the other job starts.
#[tokio::test]
async fn cancelling_a_stopped_job_gives_back_its_job_addresses() {
    let c = Cluster::start_with(|cfg| {
        cfg.job_network.addresses = "10.9.0.10-10.9.0.12".into();
        cfg.job_network.prefix = 24;
    })
    .await;
    let stopped = c.stopped_job().await;
    let refused = c.coord.run(OWNER, sleep_on("n1")).await.unwrap_err();
    assert!(
        refused.to_string().contains("no free job address")
            && refused
                .to_string()
                .contains("cancel jobs that will not restart"),
        "{refused}"
    );
    let job = c.coord.cancel(&OWNER, stopped).await.unwrap();
    assert_eq!(*job.state(), JobState::Cancelled);
    assert!(c.calls("signal").is_empty(), "{:?}", c.calls("signal"));
    let e = c.coord.registry.epoch(stopped, 2).unwrap().unwrap();
    assert!(e.is_restorable());
    c.coord.run(OWNER, sleep_on("n1")).await.unwrap();
    // Cancelled once, it is not cancelled again.
    let again = c.coord.cancel(&OWNER, stopped).await.unwrap_err();
    assert!(again.to_string().contains("cancelled"), "{again}");
}

/// A restart that moves n3's part to n4 records where it runs before the parts are released:
/// a restored `ckpt-rsh` that finds its part ended on n3 (killed by the checkpoint) and asks
/// where it is hears n4, not n3 (and does not report the killed part's end to its launcher).
#[tokio::test]
async fn a_moved_part_is_located_on_its_new_node_before_the_parts_run() {
    let c = with_job_network().await;
    let job = c.stopped_job().await;
    let token = c.coord.registry.job(job).unwrap().unwrap().token;
    c.script("n1", "release", Act::Hang);
    let moves = placed(&[], &["n3=n4"]);
    let (_, located) = tokio::join!(c.restart_on(job, 0, &moves), async {
        c.wait_call("n1", "release").await;
        c.coord
            .locate(ckpt_proto::v1::LocateRequest {
                job_id: job,
                token: token.clone(),
                node: "n3".into(),
            })
            .await
    });
    assert_eq!(located.unwrap().node, "n4");
}
