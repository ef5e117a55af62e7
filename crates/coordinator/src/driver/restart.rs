//! Restarts from a committed epoch: which epoch may be restored, `verify` of its copies, and
//! the restore on every node with the release of the held job.

use ckpt_proto::v1 as pb;
use futures_util::future::join_all;
use tokio::sync::mpsc;
use tracing::{instrument, warn};

use super::placement::{Moves, Placement};
use super::{now_ms, Caller, Coordinator, DriveError, Step};
use crate::agents::{FailureKind, NodeFailure};
use crate::model::{Epoch, Job, JobState};

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
                r.unwrap_or_else(|f| pb::NodeVerify {
                    node: n.clone(),
                    ok: false,
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

    /// Validates a restart request; returns the job, the epoch to restore, the state to go
    /// back to if the restart fails, and the parts that move to other nodes.
    pub async fn begin_restart(
        &self,
        caller: &Caller,
        id: u64,
        epoch: u32,
        placement: &Placement,
    ) -> Result<(Job, Epoch, JobState, Moves), DriveError> {
        self.job_for(caller, id)?;
        let job = self.refresh(id).await?;
        let e = self.restorable_epoch(&job, epoch)?;
        self.check_addresses_free(&job)?;
        let moves = self.place(&job, &e, placement)?;
        let mut previous = job.state.clone();
        let job = self
            .update_job(id, |j| {
                previous = j.state.clone();
                if !j.state.is_active() {
                    self.check_live_jobs(j)?;
                }
                Ok(j.begin_restart()?)
            })
            .await?;
        // A restored job's next epoch opens new streams.
        self.agents.forget_job(id);
        Ok((job, e, previous, moves))
    }

    /// Restores every node of an epoch begun by [`Coordinator::begin_restart`]. With
    /// `fallback` (the caller asked for the latest checkpoint), an epoch whose images are
    /// unusable on some node is skipped for the next older restorable one, each step reported.
    /// Returns the job and the epoch it runs from.
    #[instrument(skip_all, fields(job = job.id, epoch = epoch.number))]
    pub async fn drive_restart(
        &self,
        job: Job,
        epoch: Epoch,
        previous: JobState,
        moves: Moves,
        fallback: bool,
        progress: mpsc::UnboundedSender<Step>,
    ) -> Result<(Job, Epoch), DriveError> {
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
                phase: "restore",
                message: format!("moving {}", said.join(", ")),
            });
        }
        loop {
            let number = epoch.number;
            match self.restore_epoch(&job, &epoch, &moves, &progress).await {
                Ok(incarnation) => {
                    let job = self
                        .update_job(id, |j| {
                            j.end_restart(Ok(incarnation))?;
                            j.running_since_unix_ms = now_ms();
                            j.lost = None;
                            j.place_from(&epoch.nodes, &moves);
                            Ok(())
                        })
                        .await?;
                    if !epoch.local_copy {
                        // Every node fetched its images back into local staging: record it,
                        // so that retention deletes them again in time.
                        let _g = self.state.lock().await;
                        if let Some(mut e) = self.registry.epoch(id, number)? {
                            e.local_copy = true;
                            self.registry.put_epoch(&e)?;
                        }
                    }
                    let _ = progress.send(Step {
                        job: id,
                        epoch: number,
                        phase: "restore",
                        message: "running again".into(),
                    });
                    let m = crate::metrics::metrics();
                    m.restarts.with_label_values(&["done"]).inc();
                    m.restart_seconds.observe(begin.elapsed().as_secs_f64());
                    return Ok((job, epoch));
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
                        return Err(DriveError::RestartFailed {
                            job: id,
                            epoch: number,
                            failure,
                        });
                    };
                    warn!(job = id, epoch = number, error = %f, older = older.number, "epoch unusable; falling back");
                    let _ = progress.send(Step {
                        job: id,
                        epoch: number,
                        phase: "restore",
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

    /// Lets `to` fetch the partner copy of `source`'s images that `holder` keeps, for as long as
    /// a restore may take; false (logged) if the holder cannot be asked.
    async fn allow_fetch(
        &self,
        holder: &str,
        job: u64,
        epoch: u32,
        source: &str,
        to: &str,
        digest: &str,
    ) -> bool {
        let req = pb::AllowFetchRequest {
            job_id: job,
            epoch,
            node: source.into(),
            grantee: to.into(),
            manifest_digest: digest.into(),
            ttl_ms: self.cfg.deadlines.restore.as_millis() as u64,
        };
        match self
            .agents
            .call(
                holder,
                "allow-fetch",
                self.cfg.deadlines.sync,
                |mut c| async move { c.allow_fetch(req).await },
            )
            .await
        {
            Ok(_) => true,
            Err(e) => {
                warn!(job, epoch, %holder, error = %e, "the partner copy of a moved part cannot be granted; the restore uses shared storage");
                false
            }
        }
    }

    /// Restores every node of one epoch, held, then releases them together; on any failure
    /// the parts already restored are killed. Returns the launcher node's incarnation.
    async fn restore_epoch(
        &self,
        job: &Job,
        epoch: &Epoch,
        moves: &Moves,
        progress: &mpsc::UnboundedSender<Step>,
    ) -> Result<u32, NodeFailure> {
        let (id, number) = (job.id, epoch.number);
        let _ = progress.send(Step {
            job: id,
            epoch: number,
            phase: "restore",
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
        let d = self.cfg.deadlines.restore;
        let calls = epoch.nodes.iter().map(|source| {
            // A part that moves restores the images of the node it ran on: from a partner
            // copy this node keeps, or from shared storage.
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
            };
            async move {
                if moved && !req.partner.is_empty() {
                    // The part moved: the node keeping its partner copy serves it to n only
                    // with a grant. Moved onto that node, it is a local copy there.
                    let holder = req.partner.clone();
                    let granted = holder != *n
                        && self
                            .allow_fetch(&holder, id, number, source, n, &req.manifest_digest)
                            .await;
                    if !granted {
                        req.partner.clear();
                        req.partner_address.clear();
                    }
                }
                let r = self
                    .agents
                    .call(n, "restore", d, |mut c| async move { c.restore(req).await })
                    .await;
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
                        phase: "restore",
                        message,
                    });
                }
                (source.clone(), n.clone(), r)
            }
        });
        let results = join_all(calls).await;
        let mut incarnation = 0;
        let mut failure = None;
        let mut restored = Vec::new();
        // Nodes that did not answer in time may still finish restoring their part.
        let mut late = Vec::new();
        let mut channels = 0;
        for (source, n, r) in results {
            match r {
                Ok(reply) => {
                    // The launcher of the epoch (its first node) is the job's launcher again.
                    if epoch.nodes.first() == Some(&source) {
                        incarnation = reply.incarnation;
                    }
                    channels += reply.channels;
                    restored.push(n);
                }
                Err(mut e) => {
                    if e.kind == FailureKind::Deadline {
                        late.push(n.clone());
                    }
                    if e.kind == FailureKind::Unreachable && !moves.values().any(|m| *m == n) {
                        // A node lost for good: its part can run elsewhere.
                        e.message = format!(
                            "{}; if {n} is lost, restart its part on another node with `ckptctl restart {id} --map {n}=NODE` (or name every node with --nodes)",
                            e.message
                        );
                    }
                    // Every node's failure is told: the first one seen need not be the cause
                    // (an engine may fail on one node while another node's PIDs are taken).
                    match &mut failure {
                        None => failure = Some(e),
                        Some(f) => {
                            f.message = format!("{}; and node {}: {}", f.message, e.node, e.message)
                        }
                    }
                }
            }
        }
        let kill = failure.is_some();
        // Unheld parts run already; if the restart failed, every part restored is killed, and
        // so is one a late node may still finish (its agent kills it once the restore is done).
        let to_release: Vec<String> = match (hold, kill) {
            (_, true) => restored.iter().chain(&late).cloned().collect(),
            (true, false) => restored.clone(),
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
                failure.get_or_insert(e);
            }
        }
        if failure.is_some() && !kill {
            // Released elsewhere but not everywhere: the job cannot run incomplete.
            let _ = self
                .on_all_collect(&restored, "release", self.cfg.deadlines.resume, |mut c| {
                    let req = pb::ReleaseRequest {
                        job_id: id,
                        kill: true,
                    };
                    async move { c.release(req).await }
                })
                .await;
        }
        if let Some(f) = failure {
            return Err(f);
        }
        if channels > 0 {
            let r = self.rebuild_channels(&restored, id, number).await?;
            let _ = progress.send(Step {
                job: id,
                epoch: number,
                phase: "restore",
                message: r.say(channels),
            });
        }
        Ok(incarnation)
    }
}
