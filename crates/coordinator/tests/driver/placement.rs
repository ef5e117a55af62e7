//! Where a restart puts a job's parts, against the in-process fake agents of the phase tests:
//! moves (`--nodes`, `--map`), a scheduler's allocation, and the refusals of each (spares and
//! drain: `spares.rs`; lost nodes: `lost.rs`; partner copies: `copies.rs`).
use std::collections::BTreeMap;

use crate::cluster::*;
use coordinator::model::JobState;
use tonic::Code;

pub(crate) fn placed(nodes: &[&str], map: &[&str]) -> coordinator::driver::Placement {
    coordinator::driver::Placement {
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
        map: map.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    }
}

/// A cluster with a job network and a fourth node, n4, that runs nothing.
pub(crate) async fn with_job_network() -> Cluster {
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
pub(crate) fn restored_from(c: &Cluster, from: &str) -> Vec<String> {
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
pub(crate) async fn refused_restart(
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
