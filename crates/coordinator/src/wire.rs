//! The Control API's forms of the coordinator's jobs, epochs and restarts (`JobInfo`,
//! `EpochInfo`, `RecoveryInfo`), with the enums for what they also say in words: a job's and an
//! epoch's state, an epoch's phase, who asked for an epoch or a restart, and where an epoch's
//! images are. Each enum comes from an exhaustive match on the model's own type, so a new
//! variant does not compile until the protocol has a value for it.
use ckpt_proto::v1 as pb;

use crate::model::{
    Epoch, EpochState, FlushState, Job, JobState, OnFailure, Phase, Recovery, Storage, Trigger,
};

/// Whether the job failed and ckptd restarts it by itself, or waits to.
fn recovering(job: &Job) -> bool {
    matches!(job.on_failure, crate::model::OnFailure::Restart { .. })
        && job.failure().is_some()
        && job.gave_up != Some(job.incarnation)
}

/// Adds to a job's wire form the nodes ckptd does not hear from while the job has no restart
/// policy ([`crate::Coordinator::unreachable`]), in `unreachable` and in words.
pub fn with_unreachable(info: &mut pb::JobInfo, job: &Job, nodes: Vec<crate::model::LostNode>) {
    if nodes.is_empty() {
        return;
    }
    let said: Vec<String> = nodes
        .iter()
        .map(|l| {
            format!(
                "{} (last heard from {})",
                l.node,
                humantime::format_rfc3339_seconds(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(l.since_unix_ms)
                )
            )
        })
        .collect();
    info.detail = format!(
        "unreachable: ckptd has no heartbeat from {}; the job has no restart policy, so its parts there are not fenced and it is not lost: it goes on as long as they do. If a node is down for good, cancel the job and restart it with `ckptctl restart {} --down NODE`",
        said.join(", "),
        job.id
    );
    info.unreachable = nodes
        .into_iter()
        .map(|l| pb::LostInfo {
            node: l.node,
            since_unix_ms: l.since_unix_ms,
            noticed_unix_ms: l.noticed_unix_ms,
        })
        .collect();
}

/// What to say of a running job whose processes the freezer holds on some node: it is not
/// running there, whatever its record says.
fn frozen_detail(job: &Job, nodes: &[pb::NodeJobInfo]) -> Option<String> {
    let frozen: Vec<&str> = nodes
        .iter()
        .filter(|n| n.state() == pb::PartState::Frozen)
        .map(|n| n.node.as_str())
        .collect();
    (*job.state() == JobState::Running && !frozen.is_empty()).then(|| {
        format!(
            "frozen on {}: its processes there are held by the freezer and do not run (a checkpoint or restart step in progress, or one that did not thaw them: ckpt-agent's log on that node says which)",
            frozen.join(", ")
        )
    })
}

/// Wire form of a job.
pub fn job_info(job: &Job, nodes: Vec<pb::NodeJobInfo>) -> pb::JobInfo {
    let frozen = frozen_detail(job, &nodes);
    let (exit_code, exit_signal) = match job.state() {
        JobState::Exited { code, signal } => (*code, *signal),
        _ => (None, None),
    };
    pb::JobInfo {
        id: job.id,
        name: job.name.clone(),
        owner_uid: job.owner_uid,
        state: job.state().name(),
        argv: job.argv.clone(),
        cwd: job.cwd.clone(),
        created_unix_ms: job.created_unix_ms,
        exit_code,
        exit_signal,
        last_epoch: job.last_epoch,
        latest_committed_epoch: job.latest_committed,
        nodes,
        job_dir: job.job_dir.clone(),
        detail: match (&job.state(), &job.lost) {
            (JobState::Lost, Some(l)) => format!(
                "lost: node {} was last heard from {} and declared lost {} later; {}",
                l.node,
                humantime::format_rfc3339_seconds(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(l.since_unix_ms)
                ),
                humantime::format_duration(std::time::Duration::from_secs(
                    l.noticed_unix_ms.saturating_sub(l.since_unix_ms) / 1000
                )),
                if recovering(job) {
                    format!(
                        "ckptd restarts it by itself (--on-failure {})",
                        job.on_failure.text()
                    )
                } else {
                    format!("restart it with `ckptctl restart {}`", job.id)
                }
            ),
            _ => frozen.unwrap_or_default(),
        },
        flush: String::new(),
        policy: None,
        engine: job.snapshot_engine().to_string(),
        lost: job
            .lost
            .as_ref()
            .filter(|_| *job.state() == JobState::Lost)
            .map(|l| pb::LostInfo {
                node: l.node.clone(),
                since_unix_ms: l.since_unix_ms,
                noticed_unix_ms: l.noticed_unix_ms,
            }),
        unreachable: Vec::new(),
        on_failure: job.on_failure.text(),
        on_failure_max_restarts: match job.on_failure {
            OnFailure::Stop => 0,
            OnFailure::Restart { max } => max,
        },
        recoveries: job.recoveries.iter().map(recovery_info).collect(),
        recovery_note: job.recovery_note.clone(),
        recovering: recovering(job),
        state_kind: job_state(job.state()).into(),
    }
}

/// Wire form of a restart's record.
fn recovery_info(r: &Recovery) -> pb::RecoveryInfo {
    pb::RecoveryInfo {
        at_unix_ms: r.at_unix_ms,
        trigger: r.trigger.clone(),
        epoch: r.epoch,
        moves: r.moves.clone(),
        outcome: r.outcome.clone(),
        failed_unix_ms: r.failed_unix_ms,
        noticed_unix_ms: r.noticed_unix_ms,
        restored_unix_ms: r.restored_unix_ms,
        running_unix_ms: r.running_unix_ms,
        fetch_ms: r.fetch_ms,
        restore_ms: r.restore_ms,
        trigger_kind: r
            .trigger_kind
            .map_or(pb::Trigger::Unspecified, trigger)
            .into(),
    }
}

/// Wire form of an epoch; `flushed` is the progress of its flush in progress, if any.
pub fn epoch_info(e: &Epoch, flushed: Option<(u64, u64)>) -> pb::EpochInfo {
    let (failed_phase, reason) = match &e.state {
        EpochState::Failed { phase, reason } => (phase.name().to_string(), reason.clone()),
        EpochState::Expired { reason } => (String::new(), reason.clone()),
        _ => (String::new(), String::new()),
    };
    let (state_kind, phase_kind) = epoch_state(&e.state);
    pb::EpochInfo {
        job_id: e.job_id,
        epoch: e.number,
        state: e.state_name(),
        failed_phase,
        reason,
        started_unix_ms: e.started_unix_ms,
        finished_unix_ms: e.finished_unix_ms,
        frozen_ms: e.frozen_ms,
        total_ms: e.finished_unix_ms.saturating_sub(e.started_unix_ms),
        image_bytes: e.image_bytes,
        image_files: e.image_files,
        kill: e.kill,
        nodes: e.nodes.clone(),
        storage: e.storage_name().into(),
        storage_kind: e
            .storage()
            .map_or(pb::EpochStorage::Unspecified, storage)
            .into(),
        flush_detail: match &e.flush {
            FlushState::Failed { reason } => reason.clone(),
            _ => String::new(),
        },
        flushed_bytes: match &e.flush {
            FlushState::Durable { .. } => e.image_bytes,
            _ => flushed.map(|p| p.0).unwrap_or(0),
        },
        flush_ms: match &e.flush {
            FlushState::Durable { flush_ms, .. } => *flush_ms,
            _ => 0,
        },
        shared_bytes: match &e.flush {
            FlushState::Durable { written_bytes, .. } => *written_bytes,
            _ => 0,
        },
        local_copy: e.is_restorable() && e.local_copy,
        shared_copy: e.is_restorable() && e.is_durable(),
        partner_copy: e.is_restorable() && e.has_partner_copies(),
        encoded: if e.is_restorable() {
            e.encoded_scheme().unwrap_or_default().to_string()
        } else {
            String::new()
        },
        parity_bytes: if e.is_restorable() && e.encoded_scheme().is_some() {
            e.encodings
                .iter()
                .flat_map(|g| &g.parity)
                .map(|s| s.size)
                .sum()
        } else {
            0
        },
        // A user's request has no words on the wire, as before `Trigger`.
        trigger: match e.trigger {
            Trigger::User => String::new(),
            t => t.name().into(),
        },
        trigger_kind: trigger(e.trigger).into(),
        durable_ms: e.durable_ms().unwrap_or(0),
        // Set by the caller, which has the job.
        engine: String::new(),
        restarts: e.restarts.iter().map(recovery_info).collect(),
        state_kind: state_kind.into(),
        phase_kind: phase_kind.into(),
    }
}

/// `JobInfo.state_kind` of a job in `state` (details such as the exit code have fields of their
/// own).
pub fn job_state(state: &JobState) -> pb::JobStateKind {
    match state {
        JobState::Starting => pb::JobStateKind::Starting,
        JobState::Running => pb::JobStateKind::Running,
        JobState::Checkpointing => pb::JobStateKind::Checkpointing,
        JobState::Restarting => pb::JobStateKind::Restarting,
        JobState::Exited { .. } => pb::JobStateKind::Exited,
        JobState::Stopped => pb::JobStateKind::Stopped,
        JobState::Cancelled => pb::JobStateKind::Cancelled,
        JobState::Lost => pb::JobStateKind::Lost,
        JobState::FailedToStart { .. } => pb::JobStateKind::FailedToStart,
    }
}

/// `EpochInfo.state_kind` and `phase_kind` of an epoch in `state`: the phase it runs or failed
/// in, UNSPECIFIED for the others.
pub fn epoch_state(state: &EpochState) -> (pb::EpochStateKind, pb::OperationPhase) {
    match state {
        EpochState::InProgress(p) => (pb::EpochStateKind::InProgress, phase(*p)),
        EpochState::Committed => (
            pb::EpochStateKind::Committed,
            pb::OperationPhase::Unspecified,
        ),
        EpochState::Failed { phase: p, .. } => (pb::EpochStateKind::Failed, phase(*p)),
        EpochState::Expired { .. } => {
            (pb::EpochStateKind::Expired, pb::OperationPhase::Unspecified)
        }
    }
}

/// A phase of a checkpoint epoch as the Control API names it.
pub fn phase(p: Phase) -> pb::OperationPhase {
    match p {
        Phase::InitialSync => pb::OperationPhase::InitialSync,
        Phase::Quiesce => pb::OperationPhase::Quiesce,
        Phase::LocalCheckpoint => pb::OperationPhase::LocalCheckpoint,
        Phase::Resume => pb::OperationPhase::Resume,
        Phase::Finalize => pb::OperationPhase::Finalize,
        Phase::Commit => pb::OperationPhase::Commit,
    }
}

/// `EpochInfo.trigger_kind` and `RecoveryInfo.trigger_kind`.
pub fn trigger(t: Trigger) -> pb::Trigger {
    match t {
        Trigger::User => pb::Trigger::User,
        Trigger::Periodic => pb::Trigger::Periodic,
        Trigger::Deadline => pb::Trigger::Deadline,
        Trigger::Drain => pb::Trigger::Drain,
        Trigger::Recovery => pb::Trigger::Recovery,
    }
}

/// `EpochInfo.storage_kind` of a committed epoch.
pub fn storage(s: Storage) -> pb::EpochStorage {
    match s {
        Storage::Local => pb::EpochStorage::Local,
        Storage::Flushing => pb::EpochStorage::Flushing,
        Storage::Durable => pb::EpochStorage::Durable,
        Storage::SharedOnly => pb::EpochStorage::SharedOnly,
        Storage::FlushFailed => pb::EpochStorage::FlushFailed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::PHASES;

    /// A running job frozen on a node says so, naming the node; a checkpointing one does not
    /// (it is frozen by design), nor one whose nodes all run.
    #[test]
    fn a_running_job_frozen_on_a_node_says_so() {
        let node = |name: &str, state: pb::PartState| pb::NodeJobInfo {
            node: name.into(),
            state: state.into(),
            ..Default::default()
        };
        let nodes = vec![
            node("n1", pb::PartState::Running),
            node("n2", pb::PartState::Frozen),
        ];
        let running = crate::model::fixtures::job(1, JobState::Running);
        let info = job_info(&running, nodes.clone());
        assert_eq!(info.state, "running");
        assert!(info.detail.starts_with("frozen on n2:"), "{}", info.detail);
        let busy = crate::model::fixtures::job(1, JobState::Checkpointing);
        assert_eq!(job_info(&busy, nodes).detail, "");
        let thawed = vec![node("n1", pb::PartState::Running)];
        assert_eq!(job_info(&running, thawed).detail, "");
    }

    #[test]
    fn every_job_state_has_its_kind() {
        let cases = [
            (JobState::Starting, pb::JobStateKind::Starting),
            (JobState::Running, pb::JobStateKind::Running),
            (JobState::Checkpointing, pb::JobStateKind::Checkpointing),
            (JobState::Restarting, pb::JobStateKind::Restarting),
            (
                JobState::Exited {
                    code: Some(3),
                    signal: None,
                },
                pb::JobStateKind::Exited,
            ),
            (
                JobState::Exited {
                    code: None,
                    signal: Some(9),
                },
                pb::JobStateKind::Exited,
            ),
            (
                JobState::Exited {
                    code: None,
                    signal: None,
                },
                pb::JobStateKind::Exited,
            ),
            (JobState::Stopped, pb::JobStateKind::Stopped),
            (JobState::Cancelled, pb::JobStateKind::Cancelled),
            (JobState::Lost, pb::JobStateKind::Lost),
            (
                JobState::FailedToStart { reason: "x".into() },
                pb::JobStateKind::FailedToStart,
            ),
        ];
        for (state, want) in cases {
            // A new state does not compile here until it has a case above.
            match state {
                JobState::Starting
                | JobState::Running
                | JobState::Checkpointing
                | JobState::Restarting
                | JobState::Exited { .. }
                | JobState::Stopped
                | JobState::Cancelled
                | JobState::Lost
                | JobState::FailedToStart { .. } => {}
            }
            assert_eq!(job_state(&state), want, "{state:?}");
        }
    }

    #[test]
    fn every_epoch_state_has_its_kind_and_phase() {
        for p in PHASES {
            assert_eq!(
                epoch_state(&EpochState::InProgress(p)),
                (pb::EpochStateKind::InProgress, phase(p))
            );
            let failed = EpochState::Failed {
                phase: p,
                reason: "x".into(),
            };
            assert_eq!(epoch_state(&failed), (pb::EpochStateKind::Failed, phase(p)));
        }
        assert_eq!(
            epoch_state(&EpochState::Committed),
            (
                pb::EpochStateKind::Committed,
                pb::OperationPhase::Unspecified
            )
        );
        let expired = EpochState::Expired { reason: "x".into() };
        assert_eq!(
            epoch_state(&expired),
            (pb::EpochStateKind::Expired, pb::OperationPhase::Unspecified)
        );
    }

    #[test]
    fn every_phase_has_the_value_of_its_name() {
        let mut seen = std::collections::BTreeSet::new();
        for p in PHASES {
            let kind = phase(p);
            // OPERATION_PHASE_LOCAL_CHECKPOINT for "local-checkpoint".
            let want = format!(
                "OPERATION_PHASE_{}",
                p.name().to_uppercase().replace('-', "_")
            );
            assert_eq!(kind.as_str_name(), want);
            assert!(seen.insert(kind as i32), "{p:?}");
        }
    }

    #[test]
    fn every_trigger_and_storage_has_the_value_of_its_name() {
        for t in [
            Trigger::User,
            Trigger::Periodic,
            Trigger::Deadline,
            Trigger::Drain,
            Trigger::Recovery,
        ] {
            match t {
                Trigger::User
                | Trigger::Periodic
                | Trigger::Deadline
                | Trigger::Drain
                | Trigger::Recovery => {}
            }
            let want = format!("TRIGGER_{}", t.name().to_uppercase());
            assert_eq!(trigger(t).as_str_name(), want);
        }
        for s in [
            Storage::Local,
            Storage::Flushing,
            Storage::Durable,
            Storage::SharedOnly,
            Storage::FlushFailed,
        ] {
            match s {
                Storage::Local
                | Storage::Flushing
                | Storage::Durable
                | Storage::SharedOnly
                | Storage::FlushFailed => {}
            }
            let want = format!(
                "EPOCH_STORAGE_{}",
                s.name().to_uppercase().replace('-', "_")
            );
            assert_eq!(storage(s).as_str_name(), want);
        }
    }

    #[test]
    fn a_jobs_and_an_epochs_words_and_kinds_agree() {
        use crate::model::fixtures;
        let mut j = fixtures::job(
            1,
            JobState::Exited {
                code: Some(3),
                signal: None,
            },
        );
        j.on_failure = OnFailure::Restart { max: 5 };
        let i = job_info(&j, vec![]);
        assert_eq!(
            (i.state.as_str(), i.state_kind(), i.exit_code),
            ("exited (3)", pb::JobStateKind::Exited, Some(3))
        );
        assert_eq!(
            (i.on_failure.as_str(), i.on_failure_max_restarts),
            ("restart:5", 5)
        );
        j.on_failure = OnFailure::Stop;
        assert_eq!(job_info(&j, vec![]).on_failure_max_restarts, 0);

        let mut e = Epoch::begin(1, 1, false, vec!["n1".into()], 0);
        let i = epoch_info(&e, None);
        assert_eq!(
            (i.state.as_str(), i.state_kind(), i.phase_kind()),
            (
                "in-progress (initial-sync)",
                pb::EpochStateKind::InProgress,
                pb::OperationPhase::InitialSync
            )
        );
        assert_eq!(
            (i.trigger.as_str(), i.trigger_kind(), i.storage_kind()),
            ("", pb::Trigger::User, pb::EpochStorage::Unspecified)
        );
        e.trigger = Trigger::Periodic;
        fixtures::commit(&mut e, [("n1".into(), "d".into())].into(), 5);
        let i = epoch_info(&e, None);
        assert_eq!(
            (i.state.as_str(), i.state_kind(), i.phase_kind()),
            (
                "committed",
                pb::EpochStateKind::Committed,
                pb::OperationPhase::Unspecified
            )
        );
        assert_eq!(
            (i.trigger.as_str(), i.trigger_kind()),
            ("periodic", pb::Trigger::Periodic)
        );
        assert_eq!(
            (i.storage.as_str(), i.storage_kind()),
            ("local", pb::EpochStorage::Local)
        );
        let old = Recovery {
            trigger_kind: None,
            ..Recovery::begun(Trigger::User, "x".into(), 1, vec![], 0)
        };
        assert_eq!(recovery_info(&old).trigger_kind(), pb::Trigger::Unspecified);
    }
}
