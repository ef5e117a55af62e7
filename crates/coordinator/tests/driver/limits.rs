//! `[limits]` in ckptd.toml, against the in-process fake agents of the phase tests: what one
//! user may hold (live jobs, job addresses) and ask for (checkpoints per hour, verifies at
//! once) is refused beyond its limit, naming it, and root is never held back.
use std::time::Duration;

use crate::cluster::*;
use coordinator::driver::DriveError;
use tonic::Code;

fn quota(r: Result<impl std::fmt::Debug, DriveError>, key: &str) {
    match r {
        Err(e @ DriveError::Quota(_)) => {
            assert_eq!(
                coordinator::grpc::to_status(&e).code(),
                Code::ResourceExhausted
            );
            assert!(
                e.to_string().contains(&format!("[limits] {key}")),
                "the refusal names the limit: {e}"
            );
        }
        other => panic!("expected a refusal by [limits] {key}, got {other:?}"),
    }
}

#[tokio::test]
async fn a_user_beyond_the_live_jobs_limit_is_refused_at_run_and_restart_and_root_is_not() {
    let c = Cluster::start_with(|cfg| cfg.limits.jobs = 2).await;
    let first = c.coord.run(OWNER, sleep_on("n1")).await.unwrap().id;
    c.coord.run(OWNER, sleep_on("n2")).await.unwrap();
    quota(c.coord.run(OWNER, sleep_on("n3")).await, "jobs");
    let other = coordinator::driver::Caller { uid: 1001, ..OWNER };
    c.coord.run(other, sleep_on("n3")).await.unwrap();
    for _ in 0..3 {
        c.coord.run(ROOT, sleep_on("n3")).await.unwrap();
    }
    // A stopped job is not live: one more may run; its restart would make three.
    c.checkpoint(first, true).await.unwrap();
    c.coord.run(OWNER, sleep_on("n3")).await.unwrap();
    quota(c.restart(first, 0).await, "jobs");
    // A refused restart leaves the job as it was: still stopped, still restartable.
    assert_eq!(c.job_state(first), coordinator::model::JobState::Stopped);
}

#[tokio::test]
async fn a_user_beyond_the_job_address_limit_is_refused_at_run_and_attach() {
    let c = Cluster::start_with(|cfg| {
        cfg.job_network.addresses = "10.9.0.10-10.9.0.40".into();
        cfg.job_network.prefix = 24;
        cfg.limits.addresses = 4;
    })
    .await;
    // Three parts, three addresses; one more job of one node makes four.
    let job = c.job().await;
    let second = c.coord.run(OWNER, sleep_on("n1")).await.unwrap();
    quota(c.coord.run(OWNER, sleep_on("n2")).await, "addresses");
    let token = second.token.clone();
    quota(
        c.coord
            .attach(ckpt_proto::v1::AttachRequest {
                job_id: second.id,
                token,
                host: "n2".into(),
                command: "rank".into(),
                cwd: "/".into(),
                attempt: String::new(),
            })
            .await,
        "addresses",
    );
    c.coord.run(ROOT, sleep_on("n2")).await.unwrap();
    // A cancelled job gives its addresses back.
    c.coord.cancel(&OWNER, job).await.unwrap();
    c.coord.run(OWNER, sleep_on("n2")).await.unwrap();
}

#[tokio::test]
async fn checkpoints_beyond_the_hourly_limit_are_refused_but_kill_and_root_are_not() {
    let c = Cluster::start_with(|cfg| cfg.limits.checkpoints_per_hour = 2).await;
    let job = c.job().await;
    c.checkpoint(job, false).await.unwrap();
    c.checkpoint(job, false).await.unwrap();
    quota(c.checkpoint(job, false).await, "checkpoints_per_hour");
    // The refusal began no epoch: the job runs on, its history has two.
    assert_eq!(c.coord.registry.epochs(job).unwrap().len(), 2);
    assert_eq!(c.job_state(job), coordinator::model::JobState::Running);
    let (j, e) = c
        .coord
        .begin_checkpoint(&ROOT, job, false, coordinator::model::Trigger::User)
        .await
        .unwrap();
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    c.coord.drive_checkpoint(j, e, tx).await.unwrap();
    // The last checkpoint before a preemption is never refused.
    c.checkpoint(job, true).await.unwrap();
}

#[tokio::test]
async fn verifies_beyond_the_limit_at_once_are_refused_and_one_more_runs_when_one_ends() {
    let c = Cluster::start_with(|cfg| {
        cfg.limits.verifies = 1;
        cfg.deadlines.restore = Duration::from_secs(2);
    })
    .await;
    let job = c.stopped_job().await;
    c.script("n1", "verify", Act::Hang);
    let coord = c.coord.clone();
    let slow = tokio::spawn(async move { coord.verify(&OWNER, job, 0).await });
    c.wait_call("n1", "verify").await;
    quota(c.coord.verify(&OWNER, job, 0).await, "verifies");
    c.coord.verify(&ROOT, job, 0).await.unwrap();
    // The hung verify ends at its deadline, n1 not verified, and frees its slot.
    let done = slow.await.unwrap().unwrap();
    assert!(
        done.nodes.iter().any(|n| n.node == "n1" && !n.ok),
        "{done:?}"
    );
    c.unscript();
    let again = c.coord.verify(&OWNER, job, 0).await.unwrap();
    assert!(again.nodes.iter().all(|n| n.ok), "{again:?}");
}
