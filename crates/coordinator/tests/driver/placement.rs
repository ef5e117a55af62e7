//! Where a restart puts a job's parts, against the in-process fake agents of the phase tests:
//! moves (`--nodes`, `--map`), spares for nodes that are down, `drain`, and the job's record
//! after a restart (partner copies: `copies.rs`).
use std::collections::BTreeMap;
use std::time::Duration;

use crate::cluster::*;
use coordinator::model::JobState;
use tokio::sync::mpsc;
use tonic::Code;

pub(crate) fn placed(nodes: &[&str], map: &[&str]) -> coordinator::driver::Placement {
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
    let job = c.stopped_job().await;
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
    let job = c.stopped_job().await;
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

/// The nodes that restored, sorted, the one that restored `from`'s images marked `<-from`.
fn restored_from(c: &Cluster, from: &str) -> Vec<String> {
    let mut restored: Vec<String> = c
        .calls("restore")
        .into_iter()
        .map(|(n, d)| {
            let moved = d.ends_with(&format!(" from={from}"));
            format!(
                "{n}{}",
                if moved {
                    format!("<-{from}")
                } else {
                    String::new()
                }
            )
        })
        .collect();
    restored.sort();
    restored
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
    let job = c.stopped_job().await;
    let e = refused_restart(&c, job, placed(&[], &["n3=n4"]), Code::FailedPrecondition).await;
    assert!(e.contains("without a job network"), "{e}");
}

/// A placement onto a Slurm allocation of `nodes`.
fn allocation(nodes: &[&str]) -> coordinator::driver::Placement {
    coordinator::driver::Placement {
        allocation: Some(coordinator::driver::Allocation {
            name: "Slurm job 42".into(),
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
        }),
        ..Default::default()
    }
}

/// `run --resume` inside a Slurm job that got n4, n3 and n2: n1's part goes to n4, the
/// others stay where they ran.
#[tokio::test]
async fn a_restart_onto_an_allocation_keeps_the_parts_on_it_and_moves_the_others() {
    let c = with_job_network().await;
    let job = c.stopped_job().await;
    assert_eq!(
        c.restart_on(job, 0, &allocation(&["n4", "n3", "n2"]))
            .await
            .unwrap(),
        2
    );
    assert_eq!(restored_from(&c, "n1"), ["n2", "n3", "n4<-n1"]);
    let after = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(after.moved, BTreeMap::from([("n1".into(), "n4".into())]));
}

/// An allocation too small, one that names a node twice, one given with --map, and a job
/// without sandboxes outside its nodes: refused before any node restores anything, naming
/// the allocation and what to do.
#[tokio::test]
async fn a_restart_onto_an_allocation_that_cannot_hold_the_job_is_refused() {
    let c = with_job_network().await;
    let job = c.stopped_job().await;
    let e = refused_restart(&c, job, allocation(&["n3", "n4"]), Code::InvalidArgument).await;
    assert!(
        e.contains("has 3 parts")
            && e.contains("Slurm job 42 has 2 node(s)")
            && e.contains("sbatch --nodes=3"),
        "{e}"
    );
    // Another user's allocation reaches no job of the owner's.
    let stranger = coordinator::driver::Caller {
        uid: OWNER.uid + 1,
        gid: OWNER.gid + 1,
        pid: None,
    };
    let e = c
        .coord
        .begin_restart(&stranger, job, 0, &allocation(&["n2", "n3", "n4"]))
        .await
        .unwrap_err();
    assert_eq!(
        coordinator::grpc::to_status(&e).code(),
        Code::PermissionDenied,
        "{e}"
    );
    let with_map = coordinator::driver::Placement {
        map: vec!["n3=n4".into()],
        ..allocation(&["n2", "n3", "n4"])
    };
    // Another job runs on the allocation's free node.
    let other = c.job_on("n4").await;
    let runs_there = format!("job {other} runs a part there");
    let cases = [
        (
            allocation(&["n2", "n3", "n3"]),
            Code::InvalidArgument,
            "names node n3 twice",
        ),
        (with_map, Code::InvalidArgument, "do not go with it"),
        (
            allocation(&["n2", "n3", "n4"]),
            Code::FailedPrecondition,
            runs_there.as_str(),
        ),
        // A node whose agent is not registered (e.g. under another name than Slurm's).
        (
            allocation(&["n2", "n3", "n9"]),
            Code::NotFound,
            "n9 is a node of Slurm job 42 but has no ckpt agent up there; start ckpt-agent on it, with agent.toml node_name",
        ),
    ];
    for (placement, code, says) in cases {
        let e = refused_restart(&c, job, placement, code).await;
        assert!(e.contains(says), "{e}");
    }

    let c = Cluster::start().await;
    c.add_node("n4").await;
    let job = c.stopped_job().await;
    let e = refused_restart(
        &c,
        job,
        allocation(&["n2", "n3", "n4"]),
        Code::FailedPrecondition,
    )
    .await;
    assert!(
        e.contains("Slurm job 42 has the nodes n2, n3, n4")
            && e.contains("(n1 outside them) without a job network")
            && e.contains("sbatch --nodelist=n1,n2,n3"),
        "{e}"
    );
    // Where it ran, it restarts without a job network.
    assert_eq!(
        c.restart_on(job, 0, &allocation(&["n3", "n1", "n2", "n4"]))
            .await
            .unwrap(),
        2
    );
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
    assert_eq!(after.state, JobState::Running);
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
    assert_eq!(after.state, JobState::Running);
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

/// The launcher's node (n1) goes silent while the job runs: the job becomes lost, naming n1,
/// what is left of it on n2 and n3 is killed, and a plain restart puts n1's part (the
/// launcher) on the free spare; the job then runs again and is no longer lost.
#[tokio::test]
async fn a_job_whose_launcher_node_goes_down_is_lost_and_restarts_on_a_spare() {
    let c = with_spares().await;
    let job = c.job().await;
    c.checkpoint(job, false).await.unwrap();
    assert!(
        c.coord.mark_lost().await.unwrap().is_empty(),
        "every node is up"
    );
    only_up(&c, &["n2", "n3", "n4", "n5"]).await;
    c.world.lock().unwrap().log.clear();
    assert_eq!(c.coord.mark_lost().await.unwrap(), [job]);
    let lost = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(lost.state, JobState::Lost);
    let why = lost.lost.clone().expect("the lost node is recorded");
    assert_eq!(why.node, "n1");
    assert!(why.since_unix_ms <= why.noticed_unix_ms, "{why:?}");
    assert_eq!(c.nodes_called("signal"), ["n2", "n3"], "the rest is killed");
    let info = coordinator::wire::job_info(&lost, vec![]);
    assert!(
        info.detail.contains("node n1") && info.detail.contains(&format!("ckptctl restart {job}")),
        "{}",
        info.detail
    );
    assert!(c.coord.mark_lost().await.unwrap().is_empty(), "lost once");
    beat(&c, &["n2", "n3", "n4", "n5"]).await;
    assert_eq!(c.restart(job, 0).await.unwrap(), 1);
    let after = c.coord.registry.job(job).unwrap().unwrap();
    assert_eq!(after.state, JobState::Running);
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
    let stopped = c.stopped_job().await;
    only_up(&c, &["n1", "n2", "n4", "n5"]).await;
    c.world.lock().unwrap().log.clear();
    assert_eq!(c.coord.mark_lost().await.unwrap(), [running]);
    let lost = c.coord.registry.job(running).unwrap().unwrap();
    assert_eq!(lost.lost.map(|l| l.node).as_deref(), Some("n3"));
    assert_eq!(c.nodes_called("signal"), ["n1", "n2"]);
    assert_eq!(c.job_state(stopped), JobState::Stopped);
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
    assert_eq!(j.state, JobState::Lost);
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
    assert_eq!(j.state, JobState::Lost);
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
        j.state
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
    assert_eq!(job.state, JobState::Cancelled);
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
