//! The restore's steps on this node, in process and by any user: a checkpoint taken on the
//! recording fake host (`host/fake.rs`), then restored from its committed digest with the
//! shim faked by the host. The order of the steps (the images verified before the engine
//! starts, the restored tree checked frozen before it runs), each refusal (images missing or
//! damaged, an owner the node no longer lets run jobs, a failed engine), the deadline of the
//! old incarnation's exit, and the fall-back from the gate to verifying every file first.

use super::*;
use crate::copies::{Location, Sources};
use crate::os::host::fake::{Call, RESTORED_PID};
use crate::os::host::test_node::{Pages, TestNode, CHILD, JOB, PAGES, ROOT};
use crate::os::owner::LaunchPolicy;

/// The shim's start for a restore (behind the gate or not).
fn restore_shim(gated: bool) -> Call {
    Call::SpawnShim {
        restore: true,
        gated,
    }
}

/// A node with epoch 1 of the job committed and the job killed after it (as `--kill` or a
/// failed node leaves it); the committed digest and the log's mark after the checkpoint.
async fn checkpointed(pages: Pages) -> (TestNode, String, usize) {
    let node = TestNode::new(pages);
    node.run_job().await;
    let digest = node.checkpoint(1, true).await;
    let mark = node.host.mark();
    (node, digest, mark)
}

/// Restores epoch 1 of the job with `digest`, held for the release or not.
async fn restore(node: &TestNode, digest: &str, hold: bool) -> Result<Restored, AgentError> {
    RestartRun::to_restore(&node.jobs, JOB)?
        .restore(
            1,
            digest,
            crate::restore::Terms {
                hold,
                ..Default::default()
            },
            &Sources::default(),
        )
        .await
}

/// Overwrites the start of an image file of epoch 1, keeping its length.
fn damage(node: &TestNode, file: &str) {
    let path = node.node_dir(1).join(file);
    let mut bytes = fs::read(&path).expect("image");
    bytes[..4].copy_from_slice(b"XXXX");
    fs::write(&path, bytes).expect("damaged image");
}

#[tokio::test]
async fn a_restore_starts_the_engine_then_checks_the_tree_frozen_and_lets_it_run() {
    let (node, digest, mark) = checkpointed(Pages::VerifiedFirst).await;
    let r = restore(&node, &digest, false).await.expect("restore");
    assert_eq!(r.pid, RESTORED_PID);
    assert_eq!(r.source, Location::Local);
    assert_eq!(r.incarnation, 2);
    let calls = node.host.calls();
    assert_eq!(
        calls.get(mark),
        Some(&Call::Pids),
        "first: the old incarnation is gone"
    );
    assert_eq!(
        node.host.actions_since(mark),
        [
            Call::RestoreArgv,
            restore_shim(false),
            Call::Freeze,
            Call::Thaw
        ],
        "the engine, then the tree checked frozen, then it runs"
    );
    assert_eq!(node.host.members(), [RESTORED_PID]);
    assert!(!node.host.frozen());
}

/// Page data that may be checked beside other steps is checked before the engine starts
/// when there is too little of it for the gate: damaged, no engine starts at all.
#[tokio::test]
async fn damaged_page_data_is_refused_before_the_engine_starts() {
    let (node, digest, mark) = checkpointed(Pages::CheckedFirst).await;
    damage(&node, PAGES);
    let e = restore(&node, &digest, false).await.unwrap_err();
    assert!(e.to_string().contains("pages-1.img"), "{e}");
    assert_eq!(node.host.actions_since(mark), [], "no engine started");
    assert!(node.host.members().is_empty());
}

#[tokio::test]
async fn page_data_checked_first_then_the_engine_restores() {
    let (node, digest, mark) = checkpointed(Pages::CheckedFirst).await;
    restore(&node, &digest, false).await.expect("restore");
    assert_eq!(
        node.host.actions_since(mark),
        [
            Call::RestoreArgv,
            restore_shim(false),
            Call::Freeze,
            Call::Thaw
        ]
    );
}

#[tokio::test]
async fn a_missing_image_is_refused_before_the_engine_starts() {
    let (node, digest, mark) = checkpointed(Pages::VerifiedFirst).await;
    fs::remove_file(node.node_dir(1).join("images/core-1.img")).expect("remove");
    let e = restore(&node, &digest, false).await.unwrap_err();
    assert!(e.to_string().contains("core-1.img"), "{e}");
    assert_eq!(node.host.actions_since(mark), []);
}

/// An owner the node no longer lets run jobs (its `min_uid` raised since the checkpoint):
/// refused, naming the uid, before anything is put back or started.
#[tokio::test]
async fn an_owner_the_node_no_longer_allows_is_refused() {
    let (node, digest, mark) = checkpointed(Pages::VerifiedFirst).await;
    let TestNode {
        dir,
        jobs,
        host,
        engine,
    } = node;
    let jobs = jobs.with_launch_policy(LaunchPolicy {
        allow_root: false,
        min_uid: 70_000,
    });
    let node = TestNode {
        dir,
        jobs,
        host,
        engine,
    };
    let e = restore(&node, &digest, false).await.unwrap_err();
    assert!(
        matches!(e, AgentError::UidBelowMinimum { uid: 65534, .. }),
        "{e}"
    );
    assert_eq!(node.host.actions_since(mark), []);
}

#[tokio::test]
async fn a_failed_engine_restore_names_its_log_and_leaves_no_tree() {
    let (node, digest, mark) = checkpointed(Pages::VerifiedFirst).await;
    node.host.script_restore_fails("criu exited with status 1");
    let e = restore(&node, &digest, false).await.unwrap_err();
    assert!(matches!(e, AgentError::Engine { job: JOB, .. }), "{e}");
    assert!(e.to_string().contains("restore-1-2.log"), "{e}");
    assert_eq!(
        node.host.actions_since(mark),
        [Call::RestoreArgv, restore_shim(false)],
        "nothing to check or run"
    );
}

/// The old incarnation's processes never leave (the checkpoint let the job run on): after
/// [`PID_FREE_TIMEOUT`] the restore gives up naming them, before anything else.
#[tokio::test]
async fn a_restore_over_a_running_incarnation_gives_up_after_its_deadline() {
    let node = TestNode::new(Pages::VerifiedFirst);
    node.run_job().await;
    let digest = node.checkpoint(1, false).await;
    let mark = node.host.mark();
    let begin = std::time::Instant::now();
    let e = restore(&node, &digest, false).await.unwrap_err();
    assert!(begin.elapsed() >= PID_FREE_TIMEOUT);
    match e {
        AgentError::StillRunning { job, pids } => assert_eq!((job, pids), (JOB, vec![ROOT, CHILD])),
        other => panic!("{other}"),
    }
    assert_eq!(node.host.actions_since(mark), []);
}

/// A part restored held stays frozen (checked) until the release thaws it; a release with
/// kill (the restart failed elsewhere) kills it.
#[tokio::test]
async fn a_held_restore_stays_frozen_until_the_release() {
    let (node, digest, mark) = checkpointed(Pages::VerifiedFirst).await;
    restore(&node, &digest, true).await.expect("restore");
    assert_eq!(
        node.host.actions_since(mark),
        [Call::RestoreArgv, restore_shim(false)],
        "left frozen as the engine made it"
    );
    assert!(node.host.frozen());
    let run = RestartRun::of(&node.jobs, JOB).expect("the job");
    run.release(false).await.expect("release");
    assert_eq!(node.host.actions().last(), Some(&Call::Thaw));
    assert!(!node.host.frozen());

    run.release(true).await.expect("release with kill");
    assert_eq!(node.host.actions().last(), Some(&Call::KillAll));
    assert!(node.host.members().is_empty());
}

/// Behind the gate the engine starts while the page data is checked, and the restored tree
/// runs only once the check has passed.
#[tokio::test]
async fn behind_the_gate_the_engine_starts_while_page_data_is_checked() {
    let (node, digest, mark) = checkpointed(Pages::BehindGate).await;
    restore(&node, &digest, false).await.expect("restore");
    assert_eq!(
        node.host.actions_since(mark),
        [
            Call::RestoreArgv,
            restore_shim(true),
            Call::Freeze,
            Call::Thaw
        ]
    );
    assert_eq!(node.host.members(), [RESTORED_PID]);
}

/// Damaged page data refused at the gate: the tree the engine made is killed before any of it
/// ran, and the restore falls back to verifying every file before the engine, which finds
/// the damage and starts nothing.
#[tokio::test]
async fn page_data_refused_at_the_gate_falls_back_to_verifying_first() {
    let (node, digest, mark) = checkpointed(Pages::BehindGate).await;
    damage(&node, PAGES);
    let e = restore(&node, &digest, false).await.unwrap_err();
    assert!(e.to_string().contains("pages-1.img"), "{e}");
    assert_eq!(
        node.host.actions_since(mark),
        [Call::RestoreArgv, restore_shim(true), Call::KillAll],
        "one engine start, its tree killed; the second attempt starts none"
    );
    let calls = node.host.calls();
    let pids_checks = calls[mark..].iter().filter(|c| **c == Call::Pids).count();
    assert!(pids_checks >= 2, "a second attempt ran: {calls:?}");
}
