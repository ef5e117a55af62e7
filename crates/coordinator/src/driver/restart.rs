//! Restarts from a committed epoch: which epoch may be restored, `verify` of its copies, and
//! the restore on every node with the release of the held job.

use ckpt_proto::v1 as pb;
use futures_util::future::join_all;
use tokio::sync::mpsc;
use tracing::{info, instrument, warn};

use super::placement::{Moves, Placement};
use super::{now_ms, Caller, Coordinator, DriveError, OperationPhase, Step};
use crate::agents::{FailureKind, NodeFailure};
use crate::model::{Epoch, Job, JobState, Recovery, Trigger, MAX_RESTARTS_KEPT};

/// A restart validated and begun by [`Coordinator::begin_restart`], for
/// [`Coordinator::drive_restart`] to carry out.
#[derive(Debug)]
pub struct Begun {
    /// The job, now restarting.
    pub job: Job,
    /// The epoch to restore.
    pub epoch: Epoch,
    /// The state the job goes back to if the restart fails.
    pub previous: JobState,
    /// The parts that move to other nodes.
    pub moves: Moves,
}

impl Begun {
    /// The record of this restart, asked for by `kind` (`trigger` in words), as it begins.
    pub fn record(&self, kind: Trigger, trigger: String) -> Recovery {
        Recovery::begun(
            kind,
            trigger,
            self.epoch.number,
            self.moves.iter().map(|(o, n)| format!("{o}={n}")).collect(),
            now_ms(),
        )
    }
}

/// What the agents' answers tell of one epoch's restore.
struct Restored {
    /// The launcher node's incarnation.
    incarnation: u32,
    /// When the last node answered, every part restored (held).
    at_unix_ms: u64,
    /// The longest any node took to find and verify its images, and to restore.
    fetch_ms: u64,
    restore_ms: u64,
}

impl Coordinator {
    /// A committed epoch of the job: `epoch`, or the latest committed one for 0.
    fn restorable_epoch(&self, job: &Job, epoch: u32) -> Result<Epoch, DriveError> {
        let id = job.id;
        let number = if epoch == 0 {
            job.latest_committed
        } else {
            epoch
        };
        if number == 0 {
            return Err(DriveError::NoCommittedEpoch { job: id });
        }
        let e = self.registry.epoch(id, number)?.ok_or_else(|| {
            DriveError::Invalid(format!(
                "job {id} has no epoch {number} (see `ckptctl epochs {id}`)"
            ))
        })?;
        if !e.is_restorable() {
            return Err(DriveError::EpochNotRestorable {
                job: id,
                epoch: number,
                state: e.state_name(),
            });
        }
        Ok(e)
    }

    /// Checks a committed epoch's images on every node against their digests, in parallel.
    /// Reads only; a node that cannot be reached is reported as not verified.
    pub async fn verify(
        &self,
        caller: &Caller,
        id: u64,
        epoch: u32,
    ) -> Result<pb::VerifyReply, DriveError> {
        let job = self.job_for(caller, id)?;
        let e = self.restorable_epoch(&job, epoch)?;
        let _slot = self.usage.verify(&self.cfg.limits, caller.uid)?;
        let d = self.cfg.deadlines.restore;
        let calls = e.nodes.iter().map(|n| {
            let req = pb::VerifyNodeRequest {
                job_id: id,
                epoch: e.number,
                manifest_digest: e.manifests.get(n).cloned().unwrap_or_default(),
                shared_durable: e.is_durable(),
                local_pruned: !e.local_copy,
            };
            async move {
                let r = self
                    .agents
                    .call(n, "verify", d, |mut c| async move { c.verify(req).await })
                    .await;
                // Whether the agent was asked is ckptd's to say, not the agent's.
                r.map(|v| pb::NodeVerify {
                    unreachable: false,
                    ..v
                })
                .unwrap_or_else(|f| pb::NodeVerify {
                    node: n.clone(),
                    ok: false,
                    unreachable: f.kind == FailureKind::Unreachable,
                    error: f.message,
                    ..Default::default()
                })
            }
        });
        Ok(pb::VerifyReply {
            job_id: id,
            epoch: e.number,
            nodes: join_all(calls).await,
        })
    }

    /// Validates a restart request and marks the job restarting.
    pub async fn begin_restart(
        &self,
        caller: &Caller,
        id: u64,
        epoch: u32,
        placement: &Placement,
    ) -> Result<Begun, DriveError> {
        self.job_for(caller, id)?;
        let job = self.refresh(id).await?;
        let e = self.restorable_epoch(&job, epoch)?;
        self.check_addresses_free(&job)?;
        let moves = self.place(&job, &e, placement)?;
        self.check_moved_parts_gone(&job, &moves, placement)?;
        let mut previous = job.state().clone();
        let mut unpruned = Vec::new();
        let job = self
            .update_job(id, |j| {
                previous = j.state().clone();
                if !j.state().is_active() {
                    self.check_live_jobs(j)?;
                }
                j.begin_restart()?;
                // Its nodes may change: the deletions its next epoch would carry go now.
                unpruned = std::mem::take(&mut j.unpruned);
                Ok(())
            })
            .await?;
        self.prune_detached(id, unpruned);
        // A restored job's next epoch opens new streams.
        self.agents.forget_job(id);
        self.interrupted
            .lock()
            .expect("interrupted lock")
            .remove(&id);
        Ok(Begun {
            job,
            epoch: e,
            previous,
            moves,
        })
    }

    /// Refuses to move a part of a job without a restart policy off a node ckptd has not heard
    /// from for `node_timeout` (or since it started), unless the caller says that node is down:
    /// such a part is never fenced ([`Job::may_move`]), so it may run on behind a cut link. A
    /// job stopped by ckpt had every part's end confirmed; a batch scheduler's allocation comes
    /// after the scheduler ended the old one.
    fn check_moved_parts_gone(
        &self,
        job: &Job,
        moves: &Moves,
        placement: &Placement,
    ) -> Result<(), DriveError> {
        if job.may_move() || *job.state() == JobState::Stopped || placement.allocation.is_some() {
            return Ok(());
        }
        let views = self.agents.views();
        for old in moves.keys() {
            if placement.down.iter().any(|d| d == old) {
                continue;
            }
            let since = match views.iter().find(|v| &v.node == old) {
                Some(v) if v.since_seen <= self.cfg.node_timeout => continue,
                Some(v) => format!(
                    "for {}",
                    humantime::format_duration(std::time::Duration::from_secs(
                        v.since_seen.as_secs()
                    ))
                ),
                None => "since ckptd started".into(),
            };
            return Err(DriveError::PartMayRun {
                job: job.id,
                node: old.clone(),
                since,
            });
        }
        Ok(())
    }

    /// Restores every node of an epoch begun by [`Coordinator::begin_restart`]. With
    /// `fallback` (the caller asked for the latest checkpoint), an epoch whose images are
    /// unusable on some node is skipped for the next older restorable one, each step reported.
    /// `record` (from [`Begun::record`]) gets the outcome and times, and is kept with the epoch
    /// restored (or the last one tried). Returns the job, the epoch it runs from and the
    /// record.
    #[instrument(skip_all, fields(job = begun.job.id, epoch = begun.epoch.number))]
    pub async fn drive_restart(
        &self,
        begun: Begun,
        fallback: bool,
        mut record: Recovery,
        progress: mpsc::UnboundedSender<Step>,
    ) -> Result<(Job, Epoch, Recovery), DriveError> {
        let Begun {
            job,
            epoch,
            previous,
            moves,
        } = begun;
        let id = job.id;
        let begin = std::time::Instant::now();
        let mut epoch = epoch;
        let mut skipped: Vec<String> = Vec::new();
        if !moves.is_empty() {
            let said: Vec<String> = moves
                .iter()
                .map(|(old, new)| format!("{old}'s part to {new}"))
                .collect();
            let _ = progress.send(Step {
                job: id,
                epoch: epoch.number,
                phase: OperationPhase::Restore,
                message: format!("moving {}", said.join(", ")),
            });
        }
        loop {
            let number = epoch.number;
            match self.restore_epoch(&job, &epoch, &moves, &progress).await {
                Ok(done) => {
                    let incarnation = done.incarnation;
                    let job = self
                        .update_job(id, |j| {
                            j.end_restart(Ok(incarnation))?;
                            j.running_since_unix_ms = now_ms();
                            j.lost = None;
                            j.place_from(&epoch.nodes, &moves);
                            Ok(())
                        })
                        .await?;
                    record.epoch = number;
                    record.outcome = format!("running again from epoch {number}");
                    record.restored_unix_ms = done.at_unix_ms;
                    record.running_unix_ms = now_ms();
                    record.fetch_ms = done.fetch_ms;
                    record.restore_ms = done.restore_ms;
                    // Every node fetched its images back into local staging if they were
                    // pruned: recorded, so that retention deletes them again in time.
                    if let Err(e) = self.keep_restart(id, number, &record, true).await {
                        // The job runs: the restart worked, whatever became of its record.
                        warn!(job = id, epoch = number, error = %e, "cannot record the restart with its epoch");
                    }
                    let _ = progress.send(Step {
                        job: id,
                        epoch: number,
                        phase: OperationPhase::Restore,
                        message: "running again".into(),
                    });
                    let m = crate::metrics::metrics();
                    m.restarts.with_label_values(&["done"]).inc();
                    m.restart_seconds.observe(begin.elapsed().as_secs_f64());
                    return Ok((job, epoch, record));
                }
                Err(f) => {
                    let older = if fallback && f.kind == FailureKind::DataLoss {
                        self.registry
                            .epochs(id)?
                            .into_iter()
                            .filter(|e| e.is_restorable() && e.number < number)
                            .max_by_key(|e| e.number)
                            // The moves were checked against this epoch's nodes: an older epoch
                            // on other nodes would need a placement of its own.
                            .filter(|e| moves.is_empty() || e.nodes == epoch.nodes)
                    } else {
                        None
                    };
                    let Some(older) = older else {
                        crate::metrics::metrics()
                            .restarts
                            .with_label_values(&["failed"])
                            .inc();
                        self.update_job(id, |j| Ok(j.end_restart(Err(previous))?))
                            .await?;
                        let mut failure = f;
                        for s in skipped.iter().rev() {
                            failure.message = format!("{}; before that, {s}", failure.message);
                        }
                        let e = DriveError::RestartFailed {
                            job: id,
                            epoch: number,
                            failure,
                        };
                        record.epoch = number;
                        record.outcome = format!("failed: {e}");
                        self.keep_restart(id, number, &record, false).await?;
                        return Err(e);
                    };
                    warn!(job = id, epoch = number, error = %f, older = older.number, "epoch unusable; falling back");
                    let _ = progress.send(Step {
                        job: id,
                        epoch: number,
                        phase: OperationPhase::Restore,
                        message: format!(
                            "epoch {number} cannot be restored ({f}); trying epoch {}",
                            older.number
                        ),
                    });
                    skipped.push(format!("epoch {number}: {f}"));
                    epoch = older;
                }
            }
        }
    }

    /// Keeps the record of a restart with the epoch it restored (`restored`: every node holds
    /// its images in local staging again).
    async fn keep_restart(
        &self,
        id: u64,
        number: u32,
        record: &Recovery,
        restored: bool,
    ) -> Result<(), DriveError> {
        let _g = self.state.lock().await;
        if let Some(mut e) = self.registry.epoch(id, number)? {
            e.local_copy |= restored;
            e.restarts.push(record.clone());
            let extra = e.restarts.len().saturating_sub(MAX_RESTARTS_KEPT);
            e.restarts.drain(..extra);
            self.registry.put_epoch(&e)?;
        }
        Ok(())
    }

    /// Restores every node of one epoch, held, then releases them together; on any failure
    /// the parts already restored are killed.
    async fn restore_epoch(
        &self,
        job: &Job,
        epoch: &Epoch,
        moves: &Moves,
        progress: &mpsc::UnboundedSender<Step>,
    ) -> Result<Restored, NodeFailure> {
        let (id, number) = (job.id, epoch.number);
        let _ = progress.send(Step {
            job: id,
            epoch: number,
            phase: OperationPhase::Restore,
            message: format!(
                "verifying and restoring {} node(s) from epoch {number}",
                epoch.nodes.len()
            ),
        });
        // Every node restores its part frozen, with the part's TCP ports blocked; only when all
        // are restored are they released together. A node released early would exchange
        // packets with peers that do not exist yet and get its connections reset. A job of one
        // part has no such peers: its engine brings every end of its connections back at once,
        // and it runs as soon as it is restored (saving the hold and a release round).
        let hold = epoch.nodes.len() > 1;
        let calls = epoch
            .nodes
            .iter()
            .map(|source| self.restore_part(job, epoch, (source, moves), hold, progress));
        let results = join_all(calls).await;
        let restored_at = now_ms();
        let mut tally = Tally::of(results, epoch, moves, id);
        if tally.failure.is_none() && !moves.is_empty() {
            // Placed before the parts run: a restored ckpt-rsh whose part ended on the node it
            // left (killed by the checkpoint) asks where the part runs now, and must hear the
            // new node; else it reports the killed part's end and the launcher aborts the job.
            let placed = self
                .update_job(id, |j| {
                    j.place_from(&epoch.nodes, moves);
                    Ok(())
                })
                .await;
            if let Err(e) = placed {
                tally.failure.get_or_insert(NodeFailure {
                    node: String::new(),
                    kind: FailureKind::Internal,
                    message: format!("cannot record where the moved parts run: {e}"),
                });
            }
        }
        self.release_together(id, hold, &mut tally).await;
        if let Some(f) = tally.failure {
            return Err(f);
        }
        if tally.channels > 0 {
            let r = self.rebuild_channels(&tally.restored, id, number).await?;
            let _ = progress.send(Step {
                job: id,
                epoch: number,
                phase: OperationPhase::Restore,
                message: r.say(tally.channels),
            });
        }
        Ok(Restored {
            incarnation: tally.incarnation,
            at_unix_ms: restored_at,
            fetch_ms: tally.fetch_ms,
            restore_ms: tally.restore_ms,
        })
    }

    /// Restores `source`'s part of the epoch on the node it goes to (itself unless it moves):
    /// the node it ran on, the node it restores on, and how that went.
    async fn restore_part(
        &self,
        job: &Job,
        epoch: &Epoch,
        (source, moves): (&String, &Moves),
        hold: bool,
        progress: &mpsc::UnboundedSender<Step>,
    ) -> (String, String, Result<pb::RestoreReply, NodeFailure>) {
        let (id, number) = (job.id, epoch.number);
        // A part that moves restores the images of the node it ran on: from a partner copy
        // this node keeps, rebuilt from its erasure-coded group, or from shared storage.
        let n = moves.get(source).unwrap_or(source);
        let moved = n != source;
        let partner = epoch
            .local_copy
            .then(|| epoch.partners.get(source).cloned())
            .flatten()
            .unwrap_or_default();
        let mut req = pb::RestoreRequest {
            job_id: id,
            epoch: number,
            manifest_digest: epoch.manifests.get(source).cloned().unwrap_or_default(),
            hold,
            token: job.token.clone(),
            shared_durable: epoch.is_durable(),
            partner_address: self.agents.address(&partner).unwrap_or_default(),
            partner,
            local_pruned: !epoch.local_copy,
            source_node: if moved { source.clone() } else { String::new() },
            encoding: String::new(),
            group: Vec::new(),
            may_move: job.may_move(),
        };
        if moved && !req.partner.is_empty() {
            // The part moved: the node keeping its partner copy serves it to n only with a
            // grant. Moved onto that node, it is a local copy there.
            let holder = req.partner.clone();
            let granted = holder != *n
                && self
                    .grant_read(epoch, &holder, source, n, false, self.cfg.deadlines.restore)
                    .await;
            if !granted {
                req.partner.clear();
                req.partner_address.clear();
            }
        }
        if moved {
            // Under an erasure-coded scheme, n may rebuild the images from the group.
            if let Some((encoding, group)) = self.group_for(epoch, source, n).await {
                req.encoding = encoding;
                req.group = group;
            }
        }
        let d = self.cfg.deadlines.restore;
        let first = req.clone();
        let mut r = self
            .agents
            .call(
                n,
                "restore",
                d,
                |mut c| async move { c.restore(first).await },
            )
            .await;
        if !moved && matches!(&r, Err(f) if f.kind == FailureKind::DataLoss) {
            // In place, its images gone or damaged (a disk replaced, say) and no other copy
            // served: once more with its erasure-coded group, which takes grants to read the
            // other members (asked for only now, as few restores need them).
            if let Some((encoding, group)) = self.group_for(epoch, source, n).await {
                info!(job = id, epoch = number, node = %n, "its images are not usable there; restoring again from its group's parity");
                req.encoding = encoding;
                req.group = group;
                r = self
                    .agents
                    .call(n, "restore", d, |mut c| async move { c.restore(req).await })
                    .await;
            }
        }
        if let Ok(reply) = &r {
            let held = if hold { " (held)" } else { "" };
            let message = match reply.source() {
                pb::CopyLocation::Local | pb::CopyLocation::Unspecified if !moved => {
                    format!("node {n} restored{held}")
                }
                _ if moved => format!(
                    "node {n} restored{held} {source}'s part from its {} copy",
                    reply.source().name()
                ),
                other => format!(
                    "node {n} restored{held} from its {} copy; {}",
                    other.name(),
                    reply.note
                ),
            };
            let _ = progress.send(Step {
                job: id,
                epoch: number,
                phase: OperationPhase::Restore,
                message,
            });
        }
        (source.clone(), n.clone(), r)
    }

    /// Lets the held parts run together, or, if the restart failed, kills every part restored
    /// and one a late node may still finish (its agent kills it once the restore is done).
    /// Unheld parts run already. A release that fails is the restart's failure, and then the
    /// parts released elsewhere are killed: the job cannot run incomplete.
    async fn release_together(&self, id: u64, hold: bool, tally: &mut Tally) {
        let kill = tally.failure.is_some();
        let to_release: Vec<String> = match (hold, kill) {
            (_, true) => tally.restored.iter().chain(&tally.late).cloned().collect(),
            (true, false) => tally.restored.clone(),
            (false, false) => Vec::new(),
        };
        let released = self
            .on_all_collect(
                &to_release,
                "release",
                self.cfg.deadlines.resume,
                |mut c| {
                    let req = pb::ReleaseRequest { job_id: id, kill };
                    async move { c.release(req).await }
                },
            )
            .await;
        for (_, r) in released {
            if let Err(e) = r {
                tally.failure.get_or_insert(e);
            }
        }
        if tally.failure.is_some() && !kill {
            let _ = self
                .on_all_collect(
                    &tally.restored,
                    "release",
                    self.cfg.deadlines.resume,
                    |mut c| {
                        let req = pb::ReleaseRequest {
                            job_id: id,
                            kill: true,
                        };
                        async move { c.release(req).await }
                    },
                )
                .await;
        }
    }
}

/// What the nodes of a restore answered, summed up.
struct Tally {
    /// The launcher's incarnation after the restore (the epoch's first node is the launcher).
    incarnation: u32,
    /// ib-quiesce channels in the restored processes, on every node.
    channels: u32,
    /// The slowest node's image fetch and restore.
    fetch_ms: u64,
    restore_ms: u64,
    /// The nodes that restored their part.
    restored: Vec<String>,
    /// Nodes that did not answer in time: they may still finish restoring their part.
    late: Vec<String>,
    /// Every node's failure, told in one (the first seen need not be the cause: an engine may
    /// fail on one node while another node's PIDs are taken).
    failure: Option<NodeFailure>,
}

impl Tally {
    /// The answers `(node it ran on, node it restored on, reply)` of job `id`'s restore.
    fn of(
        results: Vec<(String, String, Result<pb::RestoreReply, NodeFailure>)>,
        epoch: &Epoch,
        moves: &Moves,
        id: u64,
    ) -> Tally {
        let mut t = Tally {
            incarnation: 0,
            channels: 0,
            fetch_ms: 0,
            restore_ms: 0,
            restored: Vec::new(),
            late: Vec::new(),
            failure: None,
        };
        for (source, n, r) in results {
            match r {
                Ok(reply) => {
                    if epoch.nodes.first() == Some(&source) {
                        t.incarnation = reply.incarnation;
                    }
                    t.channels += reply.channels;
                    t.fetch_ms = t.fetch_ms.max(reply.fetch_us / 1000);
                    t.restore_ms = t.restore_ms.max(reply.elapsed_us / 1000);
                    t.restored.push(n);
                }
                Err(mut e) => {
                    if e.kind == FailureKind::Deadline {
                        t.late.push(n.clone());
                    }
                    if e.kind == FailureKind::Unreachable && !moves.values().any(|m| *m == n) {
                        // A node lost for good: its part can run elsewhere.
                        e.message = format!(
                            "{}; if {n} is lost, restart its part on another node with `ckptctl restart {id} --map {n}=NODE` (or name every node with --nodes)",
                            e.message
                        );
                    }
                    match &mut t.failure {
                        None => t.failure = Some(e),
                        Some(f) => {
                            f.message = format!("{}; and node {}: {}", f.message, e.node, e.message)
                        }
                    }
                }
            }
        }
        t
    }
}
