//! Spare nodes and drain, against the in-process fake agents of the phase tests: a restart
//! that puts the part of a node that is down on a free spare, `drain --migrate`, and what
//! `ckptctl nodes` shows of them.
use std::collections::BTreeMap;
use std::time::Duration;

use crate::cluster::*;
use coordinator::model::JobState;
use tokio::sync::mpsc;
use tonic::Code;

use crate::placement::{placed, refused_restart, restored_from, with_job_network};

/// A cluster with a job network, spares n5 and n4 (in that order), a 1 s node timeout, and
/// shared storage on every node.
pub(crate) async fn with_spares() -> Cluster {
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
pub(crate) async fn only_up(c: &Cluster, up: &[&str]) {
    tokio::time::sleep(Duration::from_millis(1200)).await;
    beat(c, up).await;
}

/// Heartbeats from `nodes` now.
pub(crate) async fn beat(c: &Cluster, nodes: &[&str]) {
    for n in nodes {
        assert!(c.coord.heartbeat(n, vec![], None).await, "{n} registered");
    }
}

/// n3 is down and so is the first spare, n5: a restart (plain, as spares are configured, and
/// with --on-spares) puts n3's part on n4, the next free spare, with n3's address.
#[tokio::test]
async fn a_restart_puts_the_part_of_a_node_that_is_down_on_a_free_spare() {
    let c = with_spares().await;
    let job = c.stopped_job().await;
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
    assert_eq!(restored_from(&c, "n3"), ["n1", "n2", "n4<-n3"]);
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
    let job = c.stopped_job().await;
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
    beat(&c, &["n1", "n2", "n3", "n4", "n5"]).await;
    let jobs = c.coord.begin_drain(&ROOT, "n2", true).unwrap();
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [job]);
    let (tx, _rx) = mpsc::unbounded_channel();
    let done = c.coord.drive_drain("n2", jobs, true, tx).await;
    assert_eq!(done.len(), 1);
    assert!(done[0].error.is_none(), "{:?}", done[0]);
    // n5 is the first spare and up: it takes n2's part.
    assert_eq!(done[0].moved_to.as_deref(), Some("n5"));
    let after = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(*after.state(), JobState::Running);
    assert_eq!(after.nodes(), ["n1", "n5", "n3"]);
    // Drained again without --migrate: n5's part stops, no job is left there.
    let jobs = c.coord.begin_drain(&ROOT, "n5", false).unwrap();
    let (tx, _rx) = mpsc::unbounded_channel();
    let done = c.coord.drive_drain("n5", jobs, false, tx).await;
    assert!(
        done[0].error.is_none() && done[0].moved_to.is_none(),
        "{done:?}"
    );
    assert_eq!(c.job_state(job), JobState::Stopped);
    assert!(c.coord.begin_drain(&ROOT, "n5", true).unwrap().is_empty());
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
    let jobs = c.coord.begin_drain(&ROOT, "n2", true).unwrap();
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

/// After a move, a restart from an epoch taken before it runs the job on that epoch's nodes,
/// and the job's record (nodes, addresses, launcher's incarnation) says so.
#[tokio::test]
async fn a_restart_from_an_epoch_before_a_move_runs_on_that_epochs_nodes() {
    let c = with_job_network().await;
    let job = c.stopped_job().await;
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
    assert_eq!(*after.state(), JobState::Running);
}

/// `drain --migrate` that could not move every job is refused before anything is stopped: a
/// job without sandboxes, or more jobs than free spares. A node that is down is refused too.
#[tokio::test]
async fn drain_migrate_that_cannot_move_every_job_stops_nothing() {
    // No job network: the job cannot move.
    let c = Cluster::start_with(|cfg| cfg.spares.nodes = vec!["n4".into()]).await;
    c.add_node("n4").await;
    let job = c.job().await;
    let e = c.coord.begin_drain(&ROOT, "n2", true).unwrap_err();
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
    let e = c.coord.begin_drain(&ROOT, "n2", true).unwrap_err();
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
    let e = c.coord.begin_drain(&ROOT, "n2", false).unwrap_err();
    assert!(e.to_string().contains("--on-spares"), "{e}");
}

/// What `ckptctl nodes` shows: n3, silent past `node_timeout`, is down since its last
/// heartbeat; spare n4 runs a job (in use), spare n5 is free; staging space comes with
/// heartbeats; the owner and root see job ids, another user only counts them.
#[tokio::test]
async fn nodes_show_states_spares_staging_and_jobs_by_who_asks() {
    use ckpt_proto::v1 as pb;
    use coordinator::driver::Caller;
    let c = with_spares().await;
    let job = c.job().await;
    let other = c.job_on("n4").await;
    only_up(&c, &["n1", "n2", "n4", "n5"]).await;
    assert!(c.coord.heartbeat("n1", vec![], Some((5, 10))).await);
    let by_name = |who: Caller| -> BTreeMap<String, pb::NodeInfo> {
        c.coord
            .nodes(&who)
            .unwrap()
            .into_iter()
            .map(|n| (n.name.clone(), n))
            .collect()
    };
    let mine = by_name(OWNER);
    let states: Vec<(&str, &str)> = mine
        .values()
        .map(|n| (n.name.as_str(), n.state.as_str()))
        .collect();
    assert_eq!(
        states,
        [
            ("n1", "up"),
            ("n2", "up"),
            ("n3", "down"),
            ("n4", "up"),
            ("n5", "up")
        ]
    );
    assert!(mine["n3"].down_since_unix_ms > 0, "{:?}", mine["n3"]);
    assert!(
        mine["n3"].heartbeat_age_ms >= Some(1000),
        "{:?}",
        mine["n3"]
    );
    assert_eq!(mine["n1"].down_since_unix_ms, 0);
    assert_eq!(mine["n1"].jobs, [job]);
    assert_eq!(mine["n3"].jobs, [job], "a down node still lists its jobs");
    assert_eq!(mine["n4"].jobs, [other]);
    assert!(mine["n4"].spare && !mine["n4"].free, "{:?}", mine["n4"]);
    assert!(mine["n5"].spare && mine["n5"].free, "{:?}", mine["n5"]);
    assert!(!mine["n1"].spare);
    assert_eq!(
        (
            mine["n1"].staging_free_bytes,
            mine["n1"].staging_total_bytes
        ),
        (5, 10)
    );
    assert_eq!(mine["n1"].engines[0].name, "criu");
    assert_eq!(by_name(ROOT)["n1"].jobs, [job]);
    let theirs = by_name(Caller {
        uid: 1001,
        gid: 1001,
        pid: None,
    });
    assert!(theirs["n1"].jobs.is_empty() && theirs["n4"].jobs.is_empty());
    assert_eq!((theirs["n1"].other_jobs, theirs["n4"].other_jobs), (1, 1));
}
