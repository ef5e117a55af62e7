//! One checkpoint epoch: initial synchronization, quiesce, local checkpoint, resume, finalize,
//! commit; the first failure aborts the epoch on every node.
//!
//! The phases travel over one [`EpochLink`] per node (an `Agent.Epoch` stream), taken by the
//! initial synchronization: the one the job's last committed epoch left open, or a new one. A
//! committed epoch leaves its links open for the next; a failed one drops them. The registry is written durably twice: when
//! the epoch begins and when it commits or aborts; the phases between are noted without a sync.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_proto::v1 as pb;
use prost::Message;
use tokio::sync::mpsc;
use tracing::{info, instrument, warn};

use super::flush::Prune;
use super::{now_ms, Caller, Coordinator, DriveError, OperationPhase, Step};
use crate::agents::{FailureKind, NodeFailure};
use crate::config::Deadlines;
use crate::link::{barrier, send_all, EpochLink};
use crate::metrics::metrics;
use crate::model::{Epoch, FlushState, Job, JobState, Phase, TransitionError, Trigger};

impl Coordinator {
    /// Validates a checkpoint request and starts the epoch; returns the job and the epoch.
    /// `trigger` says who asked (see [`Epoch::trigger`]).
    pub async fn begin_checkpoint(
        &self,
        caller: &Caller,
        id: u64,
        kill: bool,
        trigger: Trigger,
    ) -> Result<(Job, Epoch), DriveError> {
        self.job_for(caller, id)?;
        self.refresh(id).await?;
        let _g = self.state.lock().await;
        let mut job = self
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        let number = match job.begin_checkpoint() {
            Ok(n) => n,
            Err(e) if matches!(job.state(), JobState::Exited { .. } | JobState::Stopped | JobState::Cancelled | JobState::Lost) => {
                return Err(DriveError::State(TransitionError {
                    action: format!("checkpoint it: it has no running processes (restart it with `ckptctl restart {id}`)"),
                    ..e
                }))
            }
            Err(e) => return Err(e.into()),
        };
        self.count_checkpoint(caller, kill)?;
        let mut epoch = Epoch::begin(id, number, kill, job.nodes(), now_ms());
        epoch.trigger = trigger;
        self.registry.put_job_and_epoch(&job, &epoch)?;
        Ok((job, epoch))
    }

    /// Runs every phase of an epoch begun by [`Coordinator::begin_checkpoint`], then commits
    /// it, or aborts it on every node after the first failure.
    #[instrument(skip_all, fields(job = job.id, epoch = epoch.number))]
    pub async fn drive_checkpoint(
        self: &Arc<Self>,
        job: Job,
        epoch: Epoch,
        progress: mpsc::UnboundedSender<Step>,
    ) -> Result<Epoch, DriveError> {
        let mut run = EpochRun {
            coord: self,
            id: job.id,
            nodes: epoch.nodes.clone(),
            deadlines: self.cfg.deadlines.clone(),
            epoch,
            progress,
            begin: Instant::now(),
            phase_began: Instant::now(),
            timings: Vec::new(),
            channels: 0,
            links: Vec::new(),
            link_nodes: Vec::new(),
            generations: Vec::new(),
            finalize_sent: false,
            prune: job.unpruned.clone(),
        };
        match run.phases().await {
            Ok(manifests) => run.commit(manifests).await,
            Err((phase, failure)) => run.abort(phase, failure).await,
        }
    }
}

/// The protocol's name of a driver phase (commit has none: no node takes part in it).
pub(crate) fn wire_phase(p: Phase) -> pb::Phase {
    match p {
        Phase::InitialSync => pb::Phase::InitialSync,
        Phase::Quiesce => pb::Phase::Quiesce,
        Phase::LocalCheckpoint => pb::Phase::LocalCheckpoint,
        Phase::Resume => pb::Phase::Resume,
        Phase::Finalize | Phase::Commit => pb::Phase::Finalize,
    }
}

/// A step's failure: the phase it failed in, and which node failed how.
type StepResult<T> = Result<T, (Phase, NodeFailure)>;

/// One epoch in flight: what its steps share.
struct EpochRun<'c> {
    coord: &'c Arc<Coordinator>,
    id: u64,
    epoch: Epoch,
    nodes: Vec<String>,
    deadlines: Deadlines,
    progress: mpsc::UnboundedSender<Step>,
    begin: Instant,
    /// When the current phase began.
    phase_began: Instant,
    /// How long each phase done so far took.
    timings: Vec<(Phase, Duration)>,
    /// ib-quiesce channels in the job: once any may be down, they must be rebuilt, also when
    /// the epoch fails.
    channels: u32,
    /// One link per node (in `nodes` order), taken by the initial synchronization, and the
    /// registration of the node's agent it belongs to.
    links: Vec<Box<dyn EpochLink>>,
    /// The node each link reaches (a relay's own node when it drives a group).
    link_nodes: Vec<String>,
    generations: Vec<u64>,
    /// Finalize went out right behind resume (no rebuild between them).
    finalize_sent: bool,
    /// Expired epochs whose images the nodes delete at the initial synchronization (the job's
    /// `unpruned` when the epoch began).
    prune: Vec<u32>,
}

impl EpochRun<'_> {
    /// The phases up to the commit, in order; the first failure ends them.
    async fn phases(&mut self) -> StepResult<BTreeMap<String, String>> {
        let synced = self.sync().await?;
        self.quiesce(&synced).await?;
        self.dump().await?;
        self.resume().await?;
        self.finalize().await
    }

    /// Sends `phase` to every node; its answers are gathered by [`EpochRun::gather`].
    fn send(&mut self, phase: Phase, deadline: Duration) -> StepResult<()> {
        let cmd = self.command(phase, deadline);
        send_all(&mut self.links, cmd).map_err(|f| (phase, f))
    }

    /// The command of `phase`, as every node gets it.
    fn command(&self, phase: Phase, deadline: Duration) -> pb::EpochCommand {
        pb::EpochCommand {
            job_id: self.id,
            epoch: self.epoch.number,
            phase: wire_phase(phase) as i32,
            kill: self.epoch.kill,
            deadline_ms: u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX),
            prune: match phase {
                Phase::InitialSync => self.prune.clone(),
                _ => Vec::new(),
            },
            ..Default::default()
        }
    }

    /// Every node's answer to `phase`, merged; the first failure fails the phase.
    async fn gather(&mut self, phase: Phase, deadline: Duration) -> StepResult<pb::EpochEvent> {
        barrier(&mut self.links, wire_phase(phase), deadline)
            .await
            .map_err(|f| (phase, f))
    }

    /// Sends `phase` to every node and waits for every answer.
    async fn step(&mut self, phase: Phase, deadline: Duration) -> StepResult<pb::EpochEvent> {
        self.send(phase, deadline)?;
        self.gather(phase, deadline).await
    }

    /// Ends the current phase (its duration goes to the phase histogram once the epoch
    /// commits) and enters `next`.
    fn enter(&mut self, next: Phase) {
        if let Some(done) = self.epoch.phase() {
            self.timings.push((done, self.phase_began.elapsed()));
        }
        self.phase_began = Instant::now();
        self.coord.advance(&mut self.epoch, next);
    }

    fn say(&self, phase: Phase, message: String) {
        let _ = self.progress.send(Step {
            job: self.id,
            epoch: self.epoch.number,
            phase: OperationPhase::Epoch(phase),
            message,
        });
    }

    /// Initial synchronization: every node's epoch stream opens, and every node checks it can
    /// take the checkpoint and says how much it holds.
    #[instrument(skip_all, fields(phase = pb::Phase::InitialSync.name()))]
    async fn sync(&mut self) -> StepResult<pb::EpochEvent> {
        self.say(
            Phase::InitialSync,
            format!("checking {} node(s)", self.nodes.len()),
        );
        let relays = &self.coord.cfg.relays;
        let groups: Vec<Vec<String>> = match self.coord.credential {
            Some(_) => relays.groups(&self.nodes),
            None => self.nodes.chunks(1).collect(),
        }
        .into_iter()
        .map(<[String]>::to_vec)
        .collect();
        let relaying = groups.iter().filter(|g| g.len() > 1).count();
        if relaying > 0 {
            info!(
                relays = relaying,
                fanout = relays.fanout,
                "the epoch goes through relays: {}",
                groups
                    .iter()
                    .filter(|g| g.len() > 1)
                    .map(|g| format!("{} ({} nodes)", g[0], g.len()))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let cmd = self.command(Phase::InitialSync, self.deadlines.sync);
        for group in &groups {
            let plan = self
                .relay_plan(group)
                .map_err(|f| (Phase::InitialSync, f))?;
            let (mut link, generation) = self
                .coord
                .agents
                .epoch_link(&group[0], self.id)
                .map_err(|f| (Phase::InitialSync, f))?;
            link.send(pb::EpochCommand {
                relay: plan,
                ..cmd.clone()
            })
            .map_err(|f| (Phase::InitialSync, f))?;
            self.links.push(link);
            self.link_nodes.push(group[0].clone());
            self.generations.push(generation);
        }
        let synced = self.gather(Phase::InitialSync, self.deadlines.sync).await?;
        if synced.nodes as usize != self.nodes.len() {
            return Err((
                Phase::InitialSync,
                NodeFailure {
                    node: self.nodes[0].clone(),
                    kind: FailureKind::Internal,
                    message: format!(
                        "{} node(s) answered the initial synchronization, not the epoch's {}",
                        synced.nodes,
                        self.nodes.len()
                    ),
                },
            ));
        }
        self.channels = synced.channels;
        self.epoch.resident_bytes = synced.estimated_bytes;
        Ok(synced)
    }

    /// The plan of a group whose first node relays to the others, with the grant it shows
    /// them, signed by this ckptd: this job, this epoch, its phases, those nodes, until every
    /// phase's deadline has passed. None for a group of one (driven directly).
    fn relay_plan(&self, group: &[String]) -> Result<Option<pb::RelayPlan>, NodeFailure> {
        let [relay, below @ ..] = group else {
            return Ok(None);
        };
        if below.is_empty() {
            return Ok(None);
        }
        let d = &self.deadlines;
        let all = d.sync + d.quiesce * 2 + d.dump + d.resume + d.finalize;
        let grant = pb::Delegation {
            job_id: self.id,
            epoch: self.epoch.number,
            relay: relay.clone(),
            fence: self.coord.agents.fence().unwrap_or(0),
            nodes: below.to_vec(),
            phases: [
                pb::Phase::InitialSync,
                pb::Phase::Quiesce,
                pb::Phase::LocalCheckpoint,
                pb::Phase::Resume,
                pb::Phase::Finalize,
            ]
            .map(|p| p as i32)
            .to_vec(),
            not_after_ms: now_ms() + all.as_millis() as u64,
        }
        .encode_to_vec();
        let internal = |message: String| NodeFailure {
            node: relay.clone(),
            kind: FailureKind::Internal,
            message,
        };
        let cred = self.coord.credential.as_ref().ok_or_else(|| {
            internal("ckptd has no cluster credential to sign a relay's grant with".into())
        })?;
        let (signature, issuer) = cred
            .sign(&grant)
            .map_err(|e| internal(format!("ckptd cannot sign the relay's grant: {e}")))?;
        let children = below
            .iter()
            .map(|n| {
                let address = self.coord.agents.address(n).ok_or_else(|| NodeFailure {
                    node: n.clone(),
                    kind: FailureKind::Unreachable,
                    message: format!(
                        "its agent is not registered; {}",
                        crate::agents::UNREACHABLE_FIX
                    ),
                })?;
                Ok(pb::RelayChild {
                    node: n.clone(),
                    address,
                })
            })
            .collect::<Result<_, NodeFailure>>()?;
        Ok(Some(pb::RelayPlan {
            authority: Some(pb::DelegatedAuthority {
                grant,
                signature,
                issuer,
            }),
            children,
        }))
    }

    /// Quiesce: every node drains its InfiniBand channels and freezes the job's processes.
    /// When verbs layers only drained (they hold their objects while a peer may still be
    /// sending to them), a second round follows once every node drained: they release, and
    /// every node freezes. So all nodes are frozen before any dumps, as without layers.
    #[instrument(skip_all, fields(phase = pb::Phase::Quiesce.name()))]
    async fn quiesce(&mut self, synced: &pb::EpochEvent) -> StepResult<()> {
        self.enter(Phase::Quiesce);
        self.say(
            Phase::Quiesce,
            format!(
                "freezing {} processes (~{} MB resident)",
                synced.processes,
                synced.estimated_bytes >> 20
            ),
        );
        let first = self.step(Phase::Quiesce, self.deadlines.quiesce).await?;
        if first.drained > 0 {
            self.say(
                Phase::Quiesce,
                format!(
                    "{} verbs layer(s) drained on every node; releasing and freezing",
                    first.drained
                ),
            );
            self.step(Phase::Quiesce, self.deadlines.quiesce).await?;
        }
        Ok(())
    }

    /// Local checkpoint: every node snapshots its frozen processes into its staging.
    #[instrument(skip_all, fields(phase = pb::Phase::LocalCheckpoint.name()))]
    async fn dump(&mut self) -> StepResult<()> {
        self.enter(Phase::LocalCheckpoint);
        self.say(Phase::LocalCheckpoint, "all nodes frozen; dumping".into());
        self.step(Phase::LocalCheckpoint, self.deadlines.dump)
            .await?;
        Ok(())
    }

    /// Resume: every node thaws (or, for `--kill`, stops) the job; then its InfiniBand
    /// channels are rebuilt and reconnected across the nodes. Sealing needs no barrier after
    /// the thaw: without channels to rebuild, finalize follows resume on every stream at once.
    #[instrument(skip_all, fields(phase = pb::Phase::Resume.name()))]
    async fn resume(&mut self) -> StepResult<()> {
        self.enter(Phase::Resume);
        let kill = self.epoch.kill;
        self.say(
            Phase::Resume,
            if kill {
                "stopping the job"
            } else {
                "resuming the job"
            }
            .into(),
        );
        let rebuild = !kill && self.channels > 0;
        self.send(Phase::Resume, self.deadlines.resume)?;
        if !rebuild {
            self.send(Phase::Finalize, self.deadlines.finalize)?;
            self.finalize_sent = true;
        }
        let resumed = self.gather(Phase::Resume, self.deadlines.resume).await?;
        if rebuild {
            let (id, number) = (self.id, self.epoch.number);
            let r = self
                .coord
                .rebuild_channels(&self.nodes, id, number)
                .await
                .map_err(|f| (Phase::Resume, f))?;
            self.say(Phase::Resume, r.say(self.channels));
        }
        // The job's frozen time: from the first freeze to the last thaw, per node; the longest
        // node is what the job felt.
        self.epoch.frozen_ms = resumed.frozen_us / 1000;
        Ok(())
    }

    /// Finalize: every node digests and syncs its images and seals them with a manifest.
    /// Returns each node's manifest digest.
    #[instrument(skip_all, fields(phase = pb::Phase::Finalize.name()))]
    async fn finalize(&mut self) -> StepResult<BTreeMap<String, String>> {
        self.enter(Phase::Finalize);
        self.say(
            Phase::Finalize,
            format!(
                "job {} after {} ms frozen; sealing images",
                if self.epoch.kill {
                    "stopped"
                } else {
                    "resumed"
                },
                self.epoch.frozen_ms
            ),
        );
        if !self.finalize_sent {
            self.send(Phase::Finalize, self.deadlines.finalize)?;
        }
        let sealed = self
            .gather(Phase::Finalize, self.deadlines.finalize)
            .await?;
        self.epoch.image_bytes = sealed.image_bytes;
        self.epoch.image_files = sealed.image_files;
        self.enter(Phase::Commit);
        Ok(sealed.manifests.into_iter().collect())
    }

    /// Commit: the epoch and the job are written together; from here the epoch is
    /// restorable. Retention, partner copies and the flush follow in the background.
    #[instrument(skip_all, fields(phase = "commit"))]
    async fn commit(mut self, manifests: BTreeMap<String, String>) -> Result<Epoch, DriveError> {
        let (coord, id, number) = (self.coord, self.id, self.epoch.number);
        self.epoch.commit(manifests, now_ms())?;
        let flush = coord.plans_flush(&self.epoch);
        if flush {
            self.epoch.flush = FlushState::Flushing;
        }
        {
            let _g = coord.state.lock().await;
            let mut job = coord
                .registry
                .job(id)?
                .ok_or(DriveError::UnknownJob { job: id })?;
            job.end_checkpoint(Some(number), self.epoch.kill)?;
            let retained = coord.retention(id, Some(&self.epoch))?;
            let now = self.defer_prunes(&mut job, retained.pruned);
            coord
                .registry
                .put_job_and_epochs(&job, std::iter::once(&self.epoch).chain(&retained.changed))?;
            coord.prune_in_background(id, now);
            if flush
                || coord.plans_partners(&self.epoch)
                || coord.plans_encoding(&self.epoch).is_some()
            {
                coord.flush_in_background(id, number);
            }
        }
        // The job runs on: its streams carry its next epoch (a --kill epoch stopped it).
        if !self.epoch.kill {
            let links = std::mem::take(&mut self.links);
            for ((node, link), generation) in
                self.link_nodes.iter().zip(links).zip(&self.generations)
            {
                coord.agents.keep_epoch_link(node, id, link, *generation);
            }
        }
        let e = &self.epoch;
        self.say(
            Phase::Commit,
            format!(
                "committed: frozen {} ms, total {} ms, {} bytes in {} files",
                e.frozen_ms,
                self.begin.elapsed().as_millis(),
                e.image_bytes,
                e.image_files
            ),
        );
        info!(
            frozen_ms = e.frozen_ms,
            bytes = e.image_bytes,
            "epoch committed"
        );
        if let Some(why) = coord.parity_skipped(e) {
            warn!(job = id, epoch = e.number, "{why}");
            self.say(Phase::Commit, why);
        }
        let m = metrics();
        m.epochs.with_label_values(&["committed", ""]).inc();
        for (phase, took) in &self.timings {
            m.phase_seconds
                .with_label_values(&[phase.name()])
                .observe(took.as_secs_f64());
        }
        m.phase_seconds
            .with_label_values(&[Phase::Commit.name()])
            .observe(self.phase_began.elapsed().as_secs_f64());
        m.frozen_seconds.observe(e.frozen_ms as f64 / 1000.0);
        m.epoch_seconds.observe(self.begin.elapsed().as_secs_f64());
        m.image_bytes.inc_by(e.image_bytes);
        Ok(self.epoch)
    }

    /// Which of retention's deletions wait for the job's next epoch (recorded in `job`), once
    /// those this epoch's initial synchronization carried are done; returns the ones to make
    /// now. A deletion waits when its epoch's local copies are all on nodes of this epoch
    /// and the job runs on (a `--kill` epoch stopped it: everything now). A restart has the
    /// waiting ones made at once (`begin_restart`): the nodes a job runs on change only then.
    fn defer_prunes(&self, job: &mut Job, pruned: Vec<Prune>) -> Vec<Prune> {
        let ours: std::collections::BTreeSet<&str> =
            self.nodes.iter().map(String::as_str).collect();
        job.unpruned.retain(|n| !self.prune.contains(n));
        let mut now = Vec::new();
        for p in pruned {
            let waits = !p.shared
                && !self.epoch.kill
                && p.epoch.nodes.iter().all(|x| ours.contains(x.as_str()));
            if waits {
                job.unpruned.push(p.epoch.number);
            } else {
                now.push(p);
            }
        }
        now
    }

    /// Abort after `failure` in `phase`: every node thaws what it froze and drops the epoch's
    /// partial images, channels taken down are rebuilt, and the epoch is recorded failed. The
    /// job keeps running (or stays stopped if `--kill` had already stopped it).
    #[instrument(skip_all, fields(phase = "abort"))]
    async fn abort(mut self, phase: Phase, failure: NodeFailure) -> Result<Epoch, DriveError> {
        let (coord, id, number) = (self.coord, self.id, self.epoch.number);
        warn!(phase = phase.name(), error = %failure, "epoch failed; aborting");
        self.say(phase, format!("failed: {failure}; aborting"));
        let mut reason = failure.to_string();
        // A node that did not answer in time is not waited for again: it is told to abort in
        // the background (and again when its agent re-registers), so the caller learns of the
        // failure within the phase deadline.
        let slow = matches!(
            failure.kind,
            FailureKind::Unreachable | FailureKind::Deadline
        );
        let (later, now): (Vec<String>, Vec<String>) = self
            .nodes
            .iter()
            .cloned()
            .partition(|n| slow && *n == failure.node);
        if !later.is_empty() {
            let me = coord.clone();
            let why = reason.clone();
            tokio::spawn(async move {
                me.abort_all(&later, id, number, &why).await;
            });
        }
        for e in coord.abort_all(&now, id, number, &reason).await {
            reason.push_str(&format!("; abort on {e}"));
        }
        // Channels quiesced before the failure wait for new endpoints; the job cannot talk
        // until they have them.
        let killed = self.epoch.kill && phase > Phase::Resume;
        if self.channels > 0 && phase >= Phase::Quiesce && !killed {
            match coord.rebuild_channels(&now, id, number).await {
                Ok(r) => info!(
                    qps = r.qps,
                    relayed = r.relayed,
                    ms = r.took.as_millis() as u64,
                    "ib-quiesce channels rebuilt after the abort; the job runs on"
                ),
                Err(e) => {
                    warn!(error = %e, "ib-quiesce channels not rebuilt after the abort");
                    reason.push_str(&format!("; channel rebuild on {e}"));
                }
            }
        }
        self.epoch.fail(reason, now_ms())?;
        let _g = coord.state.lock().await;
        let mut job = coord
            .registry
            .job(id)?
            .ok_or(DriveError::UnknownJob { job: id })?;
        // A kill that happened before the failure leaves the job stopped.
        job.end_checkpoint(None, killed)?;
        coord.registry.put_job_and_epoch(&job, &self.epoch)?;
        metrics()
            .epochs
            .with_label_values(&["failed", phase.name()])
            .inc();
        Err(DriveError::EpochFailed {
            job: id,
            epoch: number,
            phase: phase.name(),
            failure,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_driver_phase_but_commit_has_its_own_protocol_name() {
        for p in [
            Phase::InitialSync,
            Phase::Quiesce,
            Phase::LocalCheckpoint,
            Phase::Resume,
            Phase::Finalize,
        ] {
            assert_eq!(wire_phase(p).name(), p.name());
        }
    }
}
