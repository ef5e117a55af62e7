//! Checkpoints ckptd takes by itself (`run --every`, `ckptctl policy`), against the in-process
//! fake agents of the phase tests, with the scheduler running as in ckptd.
use std::time::{Duration, Instant};

use crate::cluster::*;
use coordinator::driver::DriveError;
use coordinator::model::{EpochState, Every, JobState, PolicyChange, Trigger};
use tokio::sync::watch;

fn every(s: u64) -> PolicyChange {
    PolicyChange {
        every: Some(Some(Every::Seconds(s))),
        ..Default::default()
    }
}

/// Runs the scheduler until the returned sender is dropped.
fn schedule(c: &Cluster) -> watch::Sender<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(c.coord.clone().schedule(rx));
    tx
}

/// Waits (bounded) until the job has `n` committed epochs.
async fn committed(
    c: &Cluster,
    job: u64,
    n: usize,
    limit: Duration,
) -> Vec<coordinator::model::Epoch> {
    let begin = Instant::now();
    loop {
        let epochs: Vec<_> = c
            .coord
            .registry
            .epochs(job)
            .unwrap()
            .into_iter()
            .filter(|e| e.state == EpochState::Committed)
            .collect();
        if epochs.len() >= n {
            return epochs;
        }
        assert!(
            begin.elapsed() < limit,
            "{} committed epochs after {limit:?}, wanted {n}",
            epochs.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every second: epochs follow each other at least the interval apart (counted from the end of
/// the one before), marked periodic, and none starts while another runs.
#[tokio::test]
async fn a_periodic_policy_checkpoints_the_job_every_interval_one_epoch_at_a_time() {
    let c = Cluster::start().await;
    let job = c.job().await;
    c.coord.set_policy(&OWNER, job, every(1)).await.unwrap();
    let _run = schedule(&c);
    let epochs = committed(&c, job, 3, Duration::from_secs(10)).await;
    for pair in epochs.windows(2) {
        assert!(
            pair[1].started_unix_ms >= pair[0].finished_unix_ms + 1000,
            "epoch {} began {} ms after epoch {} ended",
            pair[1].number,
            pair[1].started_unix_ms as i64 - pair[0].finished_unix_ms as i64,
            pair[0].number
        );
    }
    assert!(
        epochs.iter().all(|e| e.trigger == Trigger::Periodic),
        "{epochs:?}"
    );
    let info = c
        .coord
        .policy_info(&c.coord.registry.job(job).unwrap().unwrap())
        .unwrap();
    assert_eq!((info.every.as_str(), info.interval_s), ("1s", 1));
    assert!(info.next_checkpoint_unix_ms > 0);
}

/// A checkpoint in progress (here one that hangs in the local checkpoint until its deadline
/// aborts it) holds the next periodic one back: the job never has two epochs at once, and the
/// scheduler carries on after the failure.
#[tokio::test]
async fn a_periodic_checkpoint_waits_for_the_one_in_progress_and_goes_on_after_a_failure() {
    let c = Cluster::start_with(|cfg| {
        cfg.deadlines.dump = Duration::from_millis(1500);
    })
    .await;
    let job = c.job().await;
    c.script("n2", "local-checkpoint", Act::Hang);
    c.coord.set_policy(&OWNER, job, every(1)).await.unwrap();
    let _run = schedule(&c);
    let begin = Instant::now();
    let mut seen_in_progress = 0;
    while begin.elapsed() < Duration::from_millis(2500) {
        let live = c
            .coord
            .registry
            .epochs(job)
            .unwrap()
            .iter()
            .filter(|e| e.phase().is_some())
            .count();
        assert!(live <= 1, "{live} epochs in progress at once");
        seen_in_progress += live;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen_in_progress > 0, "no periodic checkpoint began");
    c.unscript();
    let epochs = committed(&c, job, 1, Duration::from_secs(10)).await;
    let failed = c.coord.registry.epoch(job, 1).unwrap().unwrap();
    assert!(
        matches!(failed.state, EpochState::Failed { .. }),
        "{failed:?}"
    );
    assert!(epochs[0].number > 1);
    assert_eq!(c.job_state(job), JobState::Running);
}

/// Only the owner (or root) sets a job's policy; `off` stops it; a job that is not running is
/// never checkpointed by its policy.
#[tokio::test]
async fn only_the_owner_sets_a_policy_and_a_stopped_job_is_left_alone() {
    let c = Cluster::start().await;
    let job = c.stopped_job().await;
    let other = coordinator::driver::Caller {
        uid: 1001,
        gid: 1001,
        pid: None,
    };
    let e = c.coord.set_policy(&other, job, every(1)).await.unwrap_err();
    assert!(matches!(e, DriveError::NotOwner { .. }), "{e}");
    let e = c.coord.set_policy(&OWNER, 99, every(1)).await.unwrap_err();
    assert!(matches!(e, DriveError::UnknownJob { .. }), "{e}");
    c.coord.set_policy(&ROOT, job, every(1)).await.unwrap();
    let _run = schedule(&c);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_eq!(
        c.coord.registry.epochs(job).unwrap().len(),
        2,
        "a stopped job was checkpointed"
    );
    let j = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(c.coord.policy_info(&j).unwrap().next_checkpoint_unix_ms, 0);
    c.coord
        .set_policy(
            &OWNER,
            job,
            PolicyChange {
                every: Some(None),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let j = c.coord.registry.job(job).unwrap().unwrap();
    assert!(c.coord.policy_info(&j).is_none());
}

/// `run --resume --name NAME` restarts the caller's latest job of that name from its latest
/// committed epoch when it was stopped; refuses a running one and another user's; starts
/// fresh when there is nothing to resume.
#[tokio::test]
async fn resume_finds_the_callers_latest_stopped_job_of_a_name() {
    use coordinator::driver::Resume;
    let c = Cluster::start().await;
    let other = coordinator::driver::Caller {
        uid: 1001,
        gid: 1001,
        pid: None,
    };
    // Nothing of that name yet, or no name at all.
    assert!(matches!(
        c.coord
            .resolve_resume(&OWNER, "fake", PolicyChange::default())
            .await
            .unwrap(),
        Resume::Fresh
    ));
    let e = c
        .coord
        .resolve_resume(&OWNER, "", PolicyChange::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, DriveError::Invalid(m) if m.contains("--name")),
        "{e}"
    );
    // A running job of that name.
    let job = c.job().await;
    let e = c
        .coord
        .resolve_resume(&OWNER, "fake", PolicyChange::default())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("still runs"), "{e}");
    // Stopped after its second checkpoint: resumed from epoch 2, with the policy given.
    c.checkpoint(job, false).await.unwrap();
    c.checkpoint(job, true).await.unwrap();
    match c
        .coord
        .resolve_resume(&OWNER, "fake", every(60))
        .await
        .unwrap()
    {
        Resume::Restart(j, epoch) => {
            assert_eq!((j.id, epoch), (job, 2));
            assert_eq!(j.policy.every, Some(Every::Seconds(60)));
        }
        Resume::Fresh => panic!("a stopped job with epochs is resumed"),
    }
    // Names are per owner: another user's `--resume` of the name starts a job of theirs
    // (nothing of this one is named to them), and so does root's; this one stays resumable.
    for who in [&other, &ROOT] {
        assert!(matches!(
            c.coord
                .resolve_resume(who, "fake", PolicyChange::default())
                .await
                .unwrap(),
            Resume::Fresh
        ));
    }
    assert!(matches!(
        c.coord
            .resolve_resume(&OWNER, "fake", PolicyChange::default())
            .await
            .unwrap(),
        Resume::Restart(..)
    ));
}

fn deadline_in(ms: u64) -> PolicyChange {
    PolicyChange {
        deadline_unix_ms: Some(Some(coordinator::driver::now_ms() + ms)),
        ..Default::default()
    }
}

/// A deadline: the final checkpoint (with kill) comes before it, marked `deadline`, the job
/// is stopped and the deadline cleared; a deadline that passed or leaves no time for a
/// checkpoint is refused, saying why.
#[tokio::test]
async fn a_deadline_stops_the_job_after_a_final_checkpoint_before_it() {
    let c = Cluster::start_with(|cfg| {
        cfg.policy.deadline_margin = Duration::from_millis(1000);
    })
    .await;
    let job = c.job().await;
    let e = c
        .coord
        .set_policy(&OWNER, job, deadline_in(0))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, DriveError::Invalid(m) if m.contains("passed")),
        "{e}"
    );
    let refusal = |e: &DriveError| {
        let s = coordinator::grpc::to_status(e);
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{e}");
        s.metadata()
            .get(ckpt_proto::REFUSAL_KEY)
            .map(|v| v.to_str().unwrap().to_string())
    };
    assert_eq!(refusal(&e), None, "a passed deadline is just invalid");
    let e = c
        .coord
        .set_policy(&OWNER, job, deadline_in(500))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, DriveError::DeadlineTooClose(m) if m.contains("too close") && m.contains("margin of 1 s")),
        "{e}"
    );
    // What `ckptctl run --slurm` recognises it by (it then runs without a deadline).
    assert_eq!(
        refusal(&e).as_deref(),
        Some(ckpt_proto::REFUSAL_DEADLINE_TOO_CLOSE)
    );
    let deadline = coordinator::driver::now_ms() + 2500;
    c.coord
        .set_policy(
            &OWNER,
            job,
            PolicyChange {
                deadline_unix_ms: Some(Some(deadline)),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let _run = schedule(&c);
    let epochs = committed(&c, job, 1, Duration::from_secs(10)).await;
    let last = &epochs[0];
    assert_eq!(last.trigger, Trigger::Deadline);
    assert!(last.kill);
    assert!(
        last.finished_unix_ms <= deadline,
        "{} > {deadline}",
        last.finished_unix_ms
    );
    assert_eq!(c.job_state(job), JobState::Stopped);
    let begin = Instant::now();
    while c
        .coord
        .registry
        .job(job)
        .unwrap()
        .unwrap()
        .policy
        .deadline_unix_ms
        .is_some()
    {
        assert!(
            begin.elapsed() < Duration::from_secs(5),
            "the deadline was not cleared"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A job that stops with expired epochs' deletions still waiting for its next epoch (its
/// `--kill` checkpoint failed after the kill): the scheduler has its nodes delete them.
#[tokio::test]
async fn a_stopped_jobs_waiting_deletions_are_made_by_the_scheduler() {
    let c = Cluster::start_with(|cfg| cfg.retention.keep_local = 1).await;
    let job = c.job().await;
    c.checkpoint(job, false).await.unwrap();
    c.checkpoint(job, false).await.unwrap();
    assert_eq!(c.unpruned(job), [1]);
    c.script("n1", "finalize", Act::Fail(tonic::Code::Internal));
    c.checkpoint(job, true).await.unwrap_err();
    assert_eq!(c.job_state(job), JobState::Stopped);
    assert!(c.calls("prune").is_empty());
    let _run = schedule(&c);
    assert_eq!(c.pruned("[1]").await, all_nodes());
    assert!(c.unpruned(job).is_empty());
}
