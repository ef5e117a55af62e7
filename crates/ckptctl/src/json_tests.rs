//! `--json` output as scripts read it: every key and value of a job, an epoch, the nodes and the
//! cluster summary, pinned so that a change to how ckptctl reads a reply cannot change them.
//! The replies carry both ckptd's words and their kinds, as ckptd sends them.
use ckpt_proto::v1 as pb;
use serde_json::json;

use crate::nodes::{cluster_json, nodes_json};
use crate::show::{epoch_json, job_json};

/// A restart record with every field set.
fn recovery() -> pb::RecoveryInfo {
    pb::RecoveryInfo {
        at_unix_ms: 1_000,
        trigger: "node n2 lost".into(),
        epoch: 2,
        moves: vec!["n2=n3".into()],
        outcome: "running again from epoch 2".into(),
        failed_unix_ms: 900,
        noticed_unix_ms: 950,
        restored_unix_ms: 1_100,
        running_unix_ms: 1_200,
        fetch_ms: 40,
        restore_ms: 90,
        trigger_kind: pb::Trigger::Recovery.into(),
    }
}

/// A job killed by signal 9, as ckptd describes it.
fn killed_job() -> pb::JobInfo {
    pb::JobInfo {
        id: 7,
        name: "heat".into(),
        owner_uid: 1000,
        state: "killed (signal 9)".into(),
        argv: vec!["mpiexec".into(), "./heat".into()],
        cwd: "/home/u".into(),
        created_unix_ms: 500,
        exit_code: None,
        exit_signal: Some(9),
        last_epoch: 3,
        latest_committed_epoch: 2,
        nodes: vec![pb::NodeJobInfo {
            node: "n1".into(),
            processes: vec![pb::ProcessInfo {
                pid: 42,
                comm: "heat".into(),
                rank: Some(0),
                state: pb::ProcessState::Sleeping.into(),
                rss_bytes: 4096,
            }],
            role: "launcher".into(),
            state: pb::PartState::Exited.into(),
            end: Some(pb::JobEnd::killed(9)),
            detail: String::new(),
            address: "10.9.0.2/24".into(),
            moved_from: "n0".into(),
            snapshot_mode: "full dumps: pre-copy is off".into(),
        }],
        job_dir: "/var/lib/ckpt/agent/jobs/7".into(),
        detail: String::new(),
        flush: "epoch 2: 1 of 2 MB".into(),
        policy: Some(pb::JobPolicy {
            every: "auto".into(),
            interval_s: 600,
            why: "5% of run time".into(),
            next_checkpoint_unix_ms: 0,
            deadline_unix_ms: 0,
            auto: true,
        }),
        engine: "criu".into(),
        lost: Some(pb::LostInfo {
            node: "n2".into(),
            since_unix_ms: 900,
            noticed_unix_ms: 950,
        }),
        unreachable: vec![pb::LostInfo {
            node: "n3".into(),
            since_unix_ms: 800,
            noticed_unix_ms: 960,
        }],
        on_failure: "restart:3".into(),
        recoveries: vec![recovery()],
        recovery_note: "waiting".into(),
        recovering: true,
        state_kind: pb::JobStateKind::Exited.into(),
        on_failure_max_restarts: 3,
    }
}

#[test]
fn a_jobs_json_keeps_its_keys_and_values() {
    let want = json!({
        "id": 7, "name": "heat", "owner_uid": 1000, "state": "killed (signal 9)",
        "argv": ["mpiexec", "./heat"], "cwd": "/home/u", "created_unix_ms": 500,
        "exit_code": null, "exit_signal": 9, "last_epoch": 3, "latest_committed_epoch": 2,
        "job_dir": "/var/lib/ckpt/agent/jobs/7", "flush": "epoch 2: 1 of 2 MB", "engine": "criu",
        "detail": "", "on_failure": "restart:3", "recovery_note": "waiting", "recovering": true,
        "recoveries": [{
            "at_unix_ms": 1000, "trigger": "node n2 lost", "epoch": 2, "moves": ["n2=n3"],
            "outcome": "running again from epoch 2", "failed_unix_ms": 900,
            "noticed_unix_ms": 950, "restored_unix_ms": 1100, "running_unix_ms": 1200,
            "fetch_ms": 40, "restore_ms": 90,
        }],
        "lost": {"node": "n2", "since_unix_ms": 900, "noticed_unix_ms": 950},
        "unreachable": [{"node": "n3", "since_unix_ms": 800, "noticed_unix_ms": 960}],
        "policy": {
            "every": "auto", "interval_s": 600, "why": "5% of run time",
            "next_checkpoint_unix_ms": 0, "deadline_unix_ms": null,
        },
        "nodes": [{
            "node": "n1", "state": "exited", "role": "launcher", "address": "10.9.0.2/24",
            "moved_from": "n0", "snapshot_mode": "full dumps: pre-copy is off",
            "exit_code": null, "exit_signal": 9, "detail": "", "ranks": [0],
            "processes": [{"pid": 42, "comm": "heat", "state": "sleeping", "rank": 0}],
        }],
    });
    assert_eq!(job_json(&killed_job()), want);
}

#[test]
fn an_epochs_json_keeps_its_keys_and_values() {
    let failed = pb::EpochInfo {
        job_id: 7,
        epoch: 3,
        state: "failed".into(),
        failed_phase: "quiesce".into(),
        reason: "node n2: no answer".into(),
        started_unix_ms: 2_000,
        finished_unix_ms: 2_500,
        frozen_ms: 0,
        total_ms: 500,
        image_bytes: 0,
        image_files: 0,
        kill: false,
        nodes: vec!["n1".into(), "n2".into()],
        storage: String::new(),
        flush_detail: String::new(),
        flushed_bytes: 0,
        flush_ms: 0,
        local_copy: false,
        shared_copy: false,
        partner_copy: false,
        encoded: String::new(),
        parity_bytes: 0,
        shared_bytes: 0,
        trigger: String::new(),
        durable_ms: 0,
        engine: "criu".into(),
        restarts: vec![],
        state_kind: pb::EpochStateKind::Failed.into(),
        phase_kind: pb::OperationPhase::Quiesce.into(),
        trigger_kind: pb::Trigger::User.into(),
        storage_kind: pb::EpochStorage::Unspecified.into(),
    };
    assert_eq!(
        epoch_json(&failed),
        json!({
            "job_id": 7, "epoch": 3, "state": "failed", "failed_phase": "quiesce",
            "reason": "node n2: no answer", "started_unix_ms": 2000, "finished_unix_ms": 2500,
            "frozen_ms": 0, "total_ms": 500, "image_bytes": 0, "image_files": 0, "kill": false,
            "nodes": ["n1", "n2"], "storage": "", "flush_detail": "", "flushed_bytes": 0,
            "flush_ms": 0, "local_copy": false, "shared_copy": false, "partner_copy": false,
            "encoded": "", "parity_bytes": 0, "shared_bytes": 0, "durable_ms": 0, "trigger": "user", "engine": "criu",
            "restarts": [],
        })
    );
    let durable = pb::EpochInfo {
        epoch: 2,
        state: "committed".into(),
        failed_phase: String::new(),
        reason: String::new(),
        frozen_ms: 120,
        image_bytes: 2 << 20,
        image_files: 9,
        kill: true,
        storage: "durable".into(),
        flushed_bytes: 2 << 20,
        flush_ms: 300,
        local_copy: true,
        shared_copy: true,
        partner_copy: true,
        encoded: "xor:8".into(),
        parity_bytes: 300 << 10,
        shared_bytes: 1 << 20,
        trigger: "periodic".into(),
        durable_ms: 800,
        restarts: vec![recovery()],
        state_kind: pb::EpochStateKind::Committed.into(),
        phase_kind: pb::OperationPhase::Unspecified.into(),
        trigger_kind: pb::Trigger::Periodic.into(),
        storage_kind: pb::EpochStorage::Durable.into(),
        ..failed
    };
    let v = epoch_json(&durable);
    assert_eq!(
        (
            &v["state"],
            &v["failed_phase"],
            &v["storage"],
            &v["trigger"],
            &v["kill"]
        ),
        (
            &json!("committed"),
            &json!(""),
            &json!("durable"),
            &json!("periodic"),
            &json!(true)
        ),
        "{v}"
    );
    assert_eq!(v["restarts"][0]["trigger"], "node n2 lost", "{v}");
    assert_eq!(v["encoded"], "xor:8", "{v}");
    assert_eq!(v["parity_bytes"], 300 << 10, "{v}");
}

/// Nodes up, down and absent, spares among them, as ckptd describes them.
fn nodes_reply() -> pb::NodesReply {
    let node = |name: &str, kind: pb::NodeStateKind, state: &str| pb::NodeInfo {
        name: name.into(),
        state: state.into(),
        state_kind: kind.into(),
        ..Default::default()
    };
    pb::NodesReply {
        nodes: vec![
            pb::NodeInfo {
                spare: false,
                address: "10.0.0.1:7601".into(),
                version: "0.1.0".into(),
                heartbeat_age_ms: Some(300),
                engines: vec![pb::EngineInfo {
                    name: "criu".into(),
                    version: "4.2".into(),
                }],
                rdma_devices: vec!["rxe0".into()],
                staging_free_bytes: 10,
                staging_total_bytes: 20,
                jobs: vec![7],
                other_jobs: 1,
                ..node("n1", pb::NodeStateKind::Up, "up")
            },
            pb::NodeInfo {
                heartbeat_age_ms: Some(9_000),
                down_since_unix_ms: 1_234,
                ..node("n2", pb::NodeStateKind::Down, "down")
            },
            pb::NodeInfo {
                spare: true,
                free: true,
                ..node("s1", pb::NodeStateKind::Up, "up")
            },
            pb::NodeInfo {
                spare: true,
                ..node("s2", pb::NodeStateKind::Absent, "absent")
            },
        ],
        node_timeout_ms: 5_000,
        version: "0.1.0".into(),
    }
}

#[test]
fn the_nodes_json_keeps_its_keys_and_values() {
    let v = nodes_json(&nodes_reply());
    let want_n1 = json!({
        "name": "n1", "state": "up", "spare": false, "spare_free": null,
        "address": "10.0.0.1:7601", "version": "0.1.0", "heartbeat_age_ms": 300,
        "down_since_unix_ms": null, "engines": [{"name": "criu", "version": "4.2"}],
        "rdma_devices": ["rxe0"], "staging_free_bytes": 10, "staging_total_bytes": 20,
        "jobs": [7], "other_users_jobs": 1,
    });
    assert_eq!(v["nodes"][0], want_n1);
    assert_eq!(
        (&v["ckptd_version"], &v["node_timeout_ms"]),
        (&json!("0.1.0"), &json!(5000))
    );
    let n2 = &v["nodes"][1];
    assert_eq!(
        (&n2["state"], &n2["down_since_unix_ms"], &n2["spare_free"]),
        (&json!("down"), &json!(1234), &json!(null))
    );
    assert_eq!(
        (&v["nodes"][2]["spare_free"], &v["nodes"][3]["state"]),
        (&json!(true), &json!("absent"))
    );
}

#[test]
fn the_cluster_json_counts_as_before() {
    use pb::JobStateKind as K;
    let job = |id: u64, kind: K, state: &str| pb::JobInfo {
        id,
        state: state.into(),
        state_kind: kind.into(),
        ..Default::default()
    };
    let jobs = [
        job(1, K::Running, "running"),
        job(2, K::Running, "running"),
        job(3, K::Checkpointing, "checkpointing"),
        job(4, K::Restarting, "restarting"),
        job(5, K::Starting, "starting"),
        job(6, K::Exited, "exited (0)"),
        job(7, K::Exited, "killed (signal 9)"),
        job(8, K::Lost, "lost"),
        job(9, K::FailedToStart, "failed to start"),
    ];
    assert_eq!(
        cluster_json(&nodes_reply(), &jobs),
        json!({
            "ckptd_version": "0.1.0",
            "nodes": {
                "total": 4, "up": 2, "down": 1, "absent": 1, "spares": 2, "spares_free": 1,
            },
            "down": [
                {"name": "n2", "state": "down", "down_since_unix_ms": 1234},
                {"name": "s2", "state": "absent", "down_since_unix_ms": null},
            ],
            "jobs": {
                "live": {"running": 2, "checkpointing": 1, "restarting": 1, "starting": 1},
                "ended": 4,
            },
        })
    );
}
