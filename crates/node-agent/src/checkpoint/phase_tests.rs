//! The checkpoint phases on this node, in process and by any user: the real phases on the
//! recording fake host (`host/fake.rs`) with a fake engine. Each phase's success, a refusal,
//! and what its deadline leaves behind (the coordinator stops waiting and sends an abort),
//! checked on the calls the host and engine saw, in order.

use std::time::Duration;

use super::*;
use crate::os::host::fake::{Call, Step};
use crate::os::host::test_node::{Pages, TestNode, CHILD, JOB, OWNER, ROOT};

/// How long a test's coordinator waits for a phase that hangs: the real deadlines are
/// minutes (`[deadlines]` in `ckptd.toml`); what follows them is the same.
const DEADLINE: Duration = Duration::from_millis(200);

/// A node whose job runs.
async fn running() -> TestNode {
    let node = TestNode::new(Pages::VerifiedFirst);
    node.run_job().await;
    node
}

/// Takes the job through initial-sync and quiesce of epoch 1.
async fn frozen(node: &TestNode) {
    node.run().initial_sync(1).await.expect("initial-sync");
    node.run().quiesce(1).await.expect("quiesce");
}

/// Whether epoch `epoch` of the job has begun on the node.
async fn epoch_begun(node: &TestNode, epoch: u32) -> bool {
    let j = node.jobs.get(JOB).expect("job");
    let job = j.lock().await;
    job.work.as_ref().is_some_and(|w| w.epoch == epoch)
}

/// Runs abort in the background: it waits for the job, which a phase past its deadline still
/// holds, and is seen not to have finished before `latch` opens.
async fn abort_after_hang(node: &TestNode, latch: &crate::os::host::fake::Latch, epoch: u32) {
    let run = node.run();
    let abort = run.abort(epoch, "deadline");
    tokio::pin!(abort);
    assert!(
        tokio::time::timeout(DEADLINE, &mut abort).await.is_err(),
        "the abort waits for the step still running"
    );
    latch.open();
    abort.await.expect("abort");
}

#[tokio::test]
async fn initial_sync_counts_the_processes_and_begins_the_epoch_without_freezing() {
    let node = running().await;
    let synced = node.run().initial_sync(1).await.expect("initial-sync");
    assert_eq!(synced.processes, 2);
    assert_eq!(
        synced.estimated_bytes,
        2 << 20,
        "both processes' resident size"
    );
    assert_eq!(synced.channels, 0);
    let calls = node.host.calls();
    for c in [
        Call::OutsideTree(ROOT),
        Call::PrivilegeOf(ROOT),
        Call::PrivilegeOf(CHILD),
        Call::Rss(ROOT),
        Call::Rss(CHILD),
    ] {
        assert!(calls.contains(&c), "{c:?} in {calls:?}");
    }
    assert_eq!(node.host.actions(), [], "nothing frozen, nothing dumped");
    assert!(epoch_begun(&node, 1).await);
    assert!(node.node_dir(1).is_dir());
}

#[tokio::test]
async fn initial_sync_refuses_a_privileged_process_and_begins_nothing() {
    let node = running().await;
    node.host.script_privileged(CHILD, "set-user-ID root");
    let e = node.run().initial_sync(1).await.unwrap_err();
    match &e {
        AgentError::Privileged { job, pid, why, .. } => {
            assert_eq!((*job, *pid, why.as_str()), (JOB, CHILD, "set-user-ID root"))
        }
        other => panic!("{other}"),
    }
    assert!(!epoch_begun(&node, 1).await);
    assert_eq!(node.host.actions(), []);
    let e = node.run().quiesce(1).await.unwrap_err();
    assert!(matches!(e, AgentError::WrongPhase { .. }), "{e}");
    assert!(!node.host.frozen());
}

/// A stopped process (SIGSTOP, a Slurm suspend) is refused at once, named, before anything is
/// frozen: the engine would wait for it for ever inside the frozen cgroup.
#[tokio::test]
async fn initial_sync_refuses_a_stopped_process_and_freezes_nothing() {
    let node = running().await;
    node.host.script_stopped(CHILD, true);
    let e = node.run().initial_sync(1).await.unwrap_err();
    match &e {
        AgentError::Stopped { job, pid, .. } => assert_eq!((*job, *pid), (JOB, CHILD)),
        other => panic!("{other}"),
    }
    let text = e.to_string();
    assert!(
        text.contains(&format!("kill -CONT {CHILD}")) && text.contains("scontrol resume"),
        "the message says what to do: {text}"
    );
    assert!(!epoch_begun(&node, 1).await);
    assert_eq!(node.host.actions(), []);
    // Continued, it is checkpointed.
    node.host.script_stopped(CHILD, false);
    node.checkpoint(1, false).await;
}

/// A process stopped after initial-sync is found once the job is frozen: quiesce fails, before
/// any dump, and the abort thaws.
/// The abort of an epoch whose quiesce failed after the freeze thaws the job, and does no more.
async fn aborted_thaws(node: &TestNode) {
    node.run().abort(1, "quiesce failed").await.expect("abort");
    assert_eq!(node.host.actions(), [Call::FreezeForSnapshot, Call::Thaw]);
    assert!(!node.host.frozen());
}

#[tokio::test]
async fn a_process_stopped_after_initial_sync_fails_quiesce_and_the_abort_thaws() {
    let node = running().await;
    node.run().initial_sync(1).await.expect("initial-sync");
    node.host.script_stopped(ROOT, true);
    let e = node.run().quiesce(1).await.unwrap_err();
    assert!(matches!(e, AgentError::Stopped { pid: ROOT, .. }), "{e}");
    aborted_thaws(&node).await;
}

#[tokio::test]
async fn initial_sync_refuses_a_process_outside_the_tree() {
    let node = running().await;
    node.host.script_outside(CHILD, "orted");
    let e = node.run().initial_sync(1).await.unwrap_err();
    match &e {
        AgentError::OutsideTree {
            pid, comm, root, ..
        } => assert_eq!((*pid, comm.as_str(), *root), (CHILD, "orted", ROOT)),
        other => panic!("{other}"),
    }
    assert!(!epoch_begun(&node, 1).await);
}

#[tokio::test]
async fn initial_sync_refuses_a_job_without_processes() {
    let node = running().await;
    node.host.run(&[]);
    let e = node.run().initial_sync(1).await.unwrap_err();
    assert!(matches!(e, AgentError::NotRunning { .. }), "{e}");
    assert!(!epoch_begun(&node, 1).await);
}

/// An initial sync cut short by the coordinator's deadline leaves no epoch begun: the same
/// epoch begins cleanly afterwards.
#[tokio::test]
async fn initial_sync_past_its_deadline_leaves_nothing_begun() {
    let node = running().await;
    node.failpoints("initial-sync=delay:10s\n");
    let cut = tokio::time::timeout(DEADLINE, node.run().initial_sync(1)).await;
    assert!(cut.is_err(), "still running at the deadline");
    assert!(!epoch_begun(&node, 1).await);
    node.run().abort(1, "deadline").await.expect("abort");
    assert_eq!(node.host.actions(), [], "no thaw of a job never frozen");
    node.failpoints("");
    node.run().initial_sync(1).await.expect("initial-sync");
}

#[tokio::test]
async fn quiesce_freezes_the_job_for_the_snapshot() {
    let node = running().await;
    let e = node.run().quiesce(1).await.unwrap_err();
    assert!(
        matches!(e, AgentError::WrongPhase { .. }),
        "no quiesce before initial-sync: {e}"
    );
    node.run().initial_sync(1).await.expect("initial-sync");
    let (_, drained) = node.run().quiesce(1).await.expect("quiesce");
    assert_eq!(drained, 0);
    assert_eq!(node.host.actions(), [Call::FreezeForSnapshot]);
    assert!(node.host.frozen());
    let j = node.jobs.get(JOB).expect("job");
    let job = j.lock().await;
    let w = job.work.as_ref().expect("epoch");
    assert_eq!(w.phase, NodePhase::Quiesced);
    assert!(w.frozen_at.is_some());
    assert_eq!(
        node.jobs
            .node
            .frozen
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
}

/// A freeze the cgroup reports stuck fails quiesce with the cgroup's error; the abort that
/// follows thaws the job.
#[tokio::test]
async fn a_stuck_freeze_fails_quiesce_and_the_abort_thaws() {
    let node = running().await;
    node.host.script_freeze(Step::Stuck);
    node.run().initial_sync(1).await.expect("initial-sync");
    let e = node.run().quiesce(1).await.unwrap_err();
    assert!(
        matches!(
            &e,
            AgentError::Cgroup {
                source: crate::os::cgroup::CgroupError::Stuck { .. },
                ..
            }
        ),
        "{e}"
    );
    aborted_thaws(&node).await;
    assert!(!node.node_dir(1).exists(), "the epoch's directory deleted");
}

/// A freeze that outlasts the coordinator's deadline: the abort waits for it to end, then
/// thaws the job it froze late.
#[tokio::test]
async fn a_freeze_past_the_deadline_is_thawed_by_the_abort_once_it_ends() {
    let node = running().await;
    let latch = TestNode::latch();
    node.host.script_freeze(Step::Hang(latch.clone()));
    node.run().initial_sync(1).await.expect("initial-sync");
    let cut = tokio::time::timeout(DEADLINE, node.run().quiesce(1)).await;
    assert!(cut.is_err(), "still freezing at the deadline");
    abort_after_hang(&node, &latch, 1).await;
    assert_eq!(node.host.actions(), [Call::FreezeForSnapshot, Call::Thaw]);
    assert!(!node.host.frozen());
    assert!(!epoch_begun(&node, 1).await);
}

#[tokio::test]
async fn local_checkpoint_dumps_the_frozen_job() {
    let node = running().await;
    node.run().initial_sync(1).await.expect("initial-sync");
    let e = node.run().local_checkpoint(1, false).await.unwrap_err();
    assert!(
        matches!(e, AgentError::WrongPhase { .. }),
        "no dump before the freeze: {e}"
    );
    node.run().quiesce(1).await.expect("quiesce");
    node.run()
        .local_checkpoint(1, false)
        .await
        .expect("local-checkpoint");
    assert_eq!(
        node.host.actions(),
        [Call::FreezeForSnapshot, Call::Dump],
        "dumped after the freeze"
    );
    assert!(node.host.frozen(), "still frozen until resume");
    assert!(node
        .node_dir(1)
        .join(crate::os::host::test_node::PAGES)
        .is_file());
    let j = node.jobs.get(JOB).expect("job");
    let job = j.lock().await;
    let w = job.work.as_ref().expect("epoch");
    assert_eq!(w.phase, NodePhase::Checkpointed);
    assert_eq!(
        crate::part::notes::PartNotes::read(&w.notes).owner,
        Some(OWNER)
    );
}

/// A dump the engine fails fails local-checkpoint naming the engine; the abort thaws the job
/// and deletes what was written.
#[tokio::test]
async fn a_failed_dump_fails_local_checkpoint_and_the_abort_thaws_and_deletes() {
    let node = running().await;
    node.engine.script_dump(Step::Stuck);
    frozen(&node).await;
    let e = node.run().local_checkpoint(1, false).await.unwrap_err();
    assert!(matches!(e, AgentError::Engine { job: JOB, .. }), "{e}");
    node.run().abort(1, "dump failed").await.expect("abort");
    assert_eq!(
        node.host.actions(),
        [Call::FreezeForSnapshot, Call::Dump, Call::Thaw]
    );
    assert!(!node.host.frozen());
    assert!(!node.node_dir(1).exists());
}

/// A frozen job whose dump will hang until the latch opens or a stop ends it.
async fn dump_hangs() -> (TestNode, std::sync::Arc<crate::os::host::fake::Latch>) {
    let node = running().await;
    let latch = TestNode::latch();
    node.engine.script_dump(Step::Hang(latch.clone()));
    frozen(&node).await;
    (node, latch)
}

/// The error of a dump that was stopped (anything else fails the test).
fn stopped<T: std::fmt::Debug>(dumped: Result<T, AgentError>) -> AgentError {
    match dumped {
        Err(
            e @ AgentError::Engine {
                source: crate::engine::EngineError::Stopped { .. },
                ..
            },
        ) => e,
        other => panic!("not a stopped dump: {other:?}"),
    }
}

/// A dump that never ends by itself (CRIU seizing a stopped process in a frozen cgroup): the
/// abort after the coordinator's deadline stops the engine, without waiting for it to end,
/// thaws the job and deletes the images; the dump fails saying it was stopped. An abort of
/// another epoch stops nothing.
#[tokio::test]
async fn a_dump_past_the_deadline_is_stopped_and_thawed_by_the_abort() {
    let (node, latch) = dump_hangs().await;
    let run = node.run();
    let (dumped, aborted) = tokio::join!(run.local_checkpoint(1, false), async {
        tokio::time::sleep(DEADLINE).await;
        assert!(
            !node.jobs.engine_stop(JOB).stop(Some(2)),
            "an abort of epoch 2 does not stop epoch 1's dump"
        );
        tokio::time::timeout(Duration::from_secs(10), node.run().abort(1, "deadline")).await
    });
    aborted
        .expect("the abort does not wait for the engine to end by itself")
        .expect("abort");
    assert!(!latch.is_open(), "nothing but the stop ended the dump");
    let e = stopped(dumped);
    assert!(e.to_string().contains("was stopped"), "{e}");
    assert_eq!(
        node.host.actions(),
        [Call::FreezeForSnapshot, Call::Dump, Call::Thaw]
    );
    assert!(!node.host.frozen());
    assert!(!node.node_dir(1).exists());
    assert!(!epoch_begun(&node, 1).await);
}

/// A cancel's signal does not wait for a dump that hangs either: the dump is stopped, and
/// the signal goes out at once.
#[tokio::test]
async fn a_cancel_during_a_hung_dump_stops_the_dump() {
    let (node, latch) = dump_hangs().await;
    let run = node.run();
    let (dumped, signalled) = tokio::join!(run.local_checkpoint(1, false), async {
        tokio::time::sleep(DEADLINE).await;
        tokio::time::timeout(
            Duration::from_secs(10),
            crate::launch::PartRun::of(&node.jobs, JOB).signal(libc::SIGTERM),
        )
        .await
    });
    assert!(signalled.is_ok(), "the signal does not wait for the dump");
    stopped(dumped);
    assert!(!latch.is_open());
}

#[tokio::test]
async fn resume_thaws_the_job_and_finalize_seals_the_epoch() {
    let node = running().await;
    node.run().initial_sync(1).await.expect("initial-sync");
    let e = node.run().resume(1, false).await.unwrap_err();
    assert!(
        matches!(e, AgentError::WrongPhase { .. }),
        "no resume before the dump: {e}"
    );
    node.run().quiesce(1).await.expect("quiesce");
    node.run()
        .local_checkpoint(1, false)
        .await
        .expect("local-checkpoint");
    node.run().resume(1, false).await.expect("resume");
    assert_eq!(
        node.host.actions(),
        [Call::FreezeForSnapshot, Call::Dump, Call::Thaw]
    );
    assert!(!node.host.frozen());
    assert_eq!(node.host.members(), [ROOT, CHILD], "the job runs on");
    assert_eq!(
        node.jobs
            .node
            .frozen
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    let f = node.run().finalize(1).await.expect("finalize");
    assert_eq!(f.image_files, 2);
    assert!(!f.manifest_digest.is_empty());
}

#[tokio::test]
async fn resume_with_kill_stops_the_job() {
    let node = running().await;
    node.checkpoint(1, true).await;
    assert_eq!(
        node.host.actions(),
        [Call::FreezeForSnapshot, Call::Dump, Call::KillAll]
    );
    assert!(node.host.members().is_empty(), "killed");
}

/// A thaw that outlasts the deadline: the abort waits for it and finds the job thawed.
/// One the cgroup reports stuck fails resume; the abort thaws again.
#[tokio::test]
async fn a_thaw_past_the_deadline_or_stuck_ends_with_the_job_thawed() {
    let node = running().await;
    let latch = TestNode::latch();
    node.host.script_thaw(Step::Hang(latch.clone()));
    frozen(&node).await;
    node.run()
        .local_checkpoint(1, false)
        .await
        .expect("local-checkpoint");
    let cut = tokio::time::timeout(DEADLINE, node.run().resume(1, false)).await;
    assert!(cut.is_err(), "still thawing at the deadline");
    abort_after_hang(&node, &latch, 1).await;
    assert_eq!(
        node.host.actions(),
        [Call::FreezeForSnapshot, Call::Dump, Call::Thaw],
        "thawed once: the abort found it thawed"
    );
    assert!(!node.host.frozen());

    node.host.script_thaw(Step::Stuck);
    node.run().initial_sync(2).await.expect("initial-sync");
    node.run().quiesce(2).await.expect("quiesce");
    node.run()
        .local_checkpoint(2, false)
        .await
        .expect("local-checkpoint");
    let e = node.run().resume(2, false).await.unwrap_err();
    assert!(matches!(e, AgentError::Cgroup { .. }), "{e}");
    node.host.script_thaw(Step::Succeed);
    node.run().abort(2, "resume failed").await.expect("abort");
    assert!(!node.host.frozen(), "the abort thawed it");
    assert_eq!(node.host.actions().last(), Some(&Call::Thaw));
}

/// An abort after the dump (another node failed its dump) thaws the frozen job and deletes
/// the epoch; an abort of an epoch that froze nothing thaws nothing.
#[tokio::test]
async fn abort_thaws_a_frozen_job_and_only_a_frozen_one() {
    let node = running().await;
    node.run().initial_sync(1).await.expect("initial-sync");
    node.run().abort(1, "another node").await.expect("abort");
    assert_eq!(node.host.actions(), [], "nothing to thaw");
    assert!(!node.node_dir(1).exists());

    node.run().initial_sync(2).await.expect("initial-sync");
    node.run().quiesce(2).await.expect("quiesce");
    node.run()
        .local_checkpoint(2, false)
        .await
        .expect("local-checkpoint");
    node.run().abort(2, "another node").await.expect("abort");
    assert_eq!(
        node.host.actions(),
        [Call::FreezeForSnapshot, Call::Dump, Call::Thaw]
    );
    assert!(!node.host.frozen());
    assert!(!node.node_dir(2).exists());
    assert!(!epoch_begun(&node, 2).await);
    node.run().abort(2, "again").await.expect("a second abort");
    assert_eq!(node.host.actions().len(), 3, "nothing more to do");
}

/// A look at the part (what `ckptctl status` shows) says it is frozen while a phase holds it
/// frozen, and answers while a step holds the part's lock (a dump may take minutes) with what
/// its cgroup shows, saying it is busy.
#[tokio::test]
async fn a_look_at_a_frozen_or_busy_part_says_so() {
    let node = running().await;
    let v = crate::launch::PartRun::of(&node.jobs, JOB)
        .part_view()
        .await
        .expect("view");
    assert!(!v.frozen && !v.busy, "{v:?}");
    frozen(&node).await;
    let v = crate::launch::PartRun::of(&node.jobs, JOB)
        .part_view()
        .await
        .expect("view");
    assert!(v.frozen && !v.busy, "{v:?}");
    node.run().abort(1, "looked").await.expect("abort");
    let j = node.jobs.get(JOB).expect("job");
    let _step = j.lock().await;
    let v = tokio::time::timeout(
        Duration::from_secs(30),
        crate::launch::PartRun::of(&node.jobs, JOB).part_view(),
    )
    .await
    .expect("an answer though the lock is held")
    .expect("view");
    assert!(v.busy && !v.frozen, "{v:?}");
}
