//! Background work on committed epochs: partner copies (SCR's PARTNER), the flush to shared
//! storage (SCR's FLUSH), and retention of local and shared copies (SCR's CACHE_SIZE).
//!
//! Partner copies come first: for a job on several nodes, every node streams its images to the
//! next node of the job (a ring in name order), which keeps them in its staging.
//!
//! A flush starts once an epoch is committed and the job has resumed, so the job never waits
//! for it. Every node copies its images in parallel and reports progress; once all are done,
//! one node writes the epoch's commit record into shared storage and the epoch is `durable`.
//! Flushes of one job run one at a time, oldest first. A failed flush leaves the epoch
//! restorable from its local copies and removes the partial shared copies.
//!
//! The two stages take turns separately: an epoch's partner copies wait for the previous
//! epoch's partner copies only, not for its flush to shared storage (slower, and deduplicated
//! against the epochs before, so in order). A node lost soon after a checkpoint then finds the
//! newest epoch copied off it sooner.
//!
//! One file: partner copies, the flush and retention together decide which copies of an epoch
//! exist, and each must see what the others did.
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use ckpt_proto::v1 as pb;
use futures_util::future::join_all;
use tracing::{info, warn};

use super::{Coordinator, DriveError};
use crate::agents::{call, from_status, FailureKind, NodeFailure};
use crate::model::{Epoch, FlushState};

/// Bytes copied and bytes to copy, by node, of each flush in progress.
type Progress = HashMap<(u64, u32), BTreeMap<String, (u64, u64)>>;

/// State of the flushes of every job.
#[derive(Debug, Default)]
pub struct Flushes {
    progress: std::sync::Mutex<Progress>,
    /// Per job, the turns of its epochs at each stage.
    order: std::sync::Mutex<HashMap<u64, Arc<Turns>>>,
    /// Interrupted flushes, started again once all their nodes are registered.
    waiting: std::sync::Mutex<Vec<(u64, u32)>>,
}

impl Flushes {
    /// Queues an interrupted flush until its nodes register.
    pub fn wait_for_nodes(&self, job: u64, epoch: u32) {
        self.waiting.lock().expect("flush lock").push((job, epoch));
    }

    /// (bytes copied, bytes to copy) of an epoch's flush in progress, over all its nodes.
    pub fn progress(&self, job: u64, epoch: u32) -> Option<(u64, u64)> {
        self.progress
            .lock()
            .expect("flush lock")
            .get(&(job, epoch))
            .map(|m| m.values().fold((0, 0), |a, v| (a.0 + v.0, a.1 + v.1)))
    }

    /// The epochs of a job being flushed now, oldest first.
    pub fn in_progress(&self, job: u64) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .progress
            .lock()
            .expect("flush lock")
            .keys()
            .filter(|(j, _)| *j == job)
            .map(|(_, e)| *e)
            .collect();
        v.sort();
        v
    }

    fn set(&self, job: u64, epoch: u32, node: &str, done: u64, total: u64) {
        self.progress
            .lock()
            .expect("flush lock")
            .entry((job, epoch))
            .or_default()
            .insert(node.to_string(), (done, total));
    }

    fn clear(&self, job: u64, epoch: u32) {
        self.progress
            .lock()
            .expect("flush lock")
            .remove(&(job, epoch));
    }

    fn turns(&self, job: u64) -> Arc<Turns> {
        self.order
            .lock()
            .expect("flush lock")
            .entry(job)
            .or_default()
            .clone()
    }
}

/// A job's epochs take their turn at each stage of the background work, in epoch order (the
/// locks are fair: first come, first served).
#[derive(Debug, Default)]
struct Turns {
    partners: tokio::sync::Mutex<()>,
    shared: tokio::sync::Mutex<()>,
}

/// One retention decision: delete a node's local copies of an epoch, or all its copies.
#[derive(Debug, Clone)]
pub struct Prune {
    /// The epoch, as recorded after the decision.
    pub epoch: Epoch,
    /// Delete the shared copies too.
    pub shared: bool,
}

/// What [`Coordinator::retention`] decided.
#[derive(Debug)]
pub struct Retention {
    /// The epochs it changed, to be recorded.
    pub changed: Vec<Epoch>,
    /// What to delete.
    pub pruned: Vec<Prune>,
}

impl Coordinator {
    /// Whether a just-committed epoch is to be flushed: a flush epoch (`flush.every`) whose
    /// nodes all have shared storage.
    pub(crate) fn plans_flush(&self, e: &Epoch) -> bool {
        let every = self.cfg.flush.every;
        if every == 0 || e.number % every != 0 {
            return false;
        }
        let missing: Vec<&String> = e
            .nodes
            .iter()
            .filter(|n| self.agents.shared_dir(n).is_none())
            .collect();
        if !missing.is_empty() && missing.len() < e.nodes.len() {
            warn!(job = e.job_id, epoch = e.number, nodes = ?missing,
                "not flushing: these nodes have no shared_dir in their agent config");
        }
        missing.is_empty()
    }

    /// Whether a just-committed epoch gets partner copies: redundancy is on and the job spans
    /// several nodes.
    pub(crate) fn plans_partners(&self, e: &Epoch) -> bool {
        matches!(
            self.scheme_of(e.job_id),
            Some(ckpt_store::erasure::Scheme::Partner)
        ) && e.nodes.len() > 1
    }

    /// The redundancy scheme of a job's checkpoints: its own (`ckptctl run --redundancy`),
    /// else ckptd.toml's.
    pub(crate) fn scheme_of(&self, job: u64) -> Option<ckpt_store::erasure::Scheme> {
        let own = match self.registry.job(job) {
            Ok(Some(j)) => j.redundancy,
            _ => String::new(),
        };
        self.cfg.redundancy.scheme_for(&own)
    }

    /// Starts the flushes whose nodes have all registered again.
    pub(crate) fn resume_waiting_flushes(self: &Arc<Self>) {
        let ready: Vec<(u64, u32)> = {
            let mut w = self.flushes.waiting.lock().expect("flush lock");
            let mut ready = Vec::new();
            w.retain(|&(job, epoch)| {
                let nodes = self
                    .registry
                    .epoch(job, epoch)
                    .ok()
                    .flatten()
                    .map(|e| e.nodes)
                    .unwrap_or_default();
                if self.agents.all_registered(&nodes) {
                    ready.push((job, epoch));
                    false
                } else {
                    true
                }
            });
            ready
        };
        for (job, epoch) in ready {
            info!(job, epoch, "flushing again after a coordinator restart");
            self.flush_in_background(job, epoch);
        }
    }

    /// Flushes an epoch without holding up the caller.
    pub(crate) fn flush_in_background(self: &Arc<Self>, job: u64, epoch: u32) {
        let me = self.clone();
        tokio::spawn(async move { me.flush_epoch(job, epoch).await });
    }

    async fn flush_epoch(self: Arc<Self>, id: u64, number: u32) {
        let _backlog = crate::metrics::Backlog::enter();
        let turns = self.flushes.turns(id);
        let partners_turn = turns.partners.lock().await;
        let mut epoch = match self.registry.epoch(id, number) {
            Ok(Some(e)) if e.is_restorable() => e,
            _ => return,
        };
        if self.plans_partners(&epoch) && epoch.partners.is_empty() && epoch.local_copy {
            let partners = self.copy_to_partners(&epoch).await;
            match self
                .record(id, number, "partner copies", |e| e.partners = partners)
                .await
            {
                Some(e) => epoch = e,
                None => return,
            }
        }
        if let Some(scheme) = self.plans_encoding(&epoch) {
            if epoch.encodings.is_empty() && epoch.local_copy {
                let encodings = self.encode_groups(&epoch, scheme).await;
                match self
                    .record(id, number, "the parity", |e| e.encodings = encodings)
                    .await
                {
                    Some(e) => epoch = e,
                    None => return,
                }
            }
        }
        if epoch.flush != FlushState::Flushing {
            return;
        }
        // In line for the shared storage before the next epoch may copy to partners: the
        // flushes stay in epoch order.
        let _shared_turn = turns.shared.lock().await;
        drop(partners_turn);
        let begin = Instant::now();
        let result = match self.copy_to_shared(&epoch).await {
            Ok(written) => self.publish(&epoch).await.map(|()| written),
            Err(f) => Err(f),
        };
        self.flushes.clear(id, number);
        let flush_ms = begin.elapsed().as_millis() as u64;
        let pruned = {
            let _g = self.state.lock().await;
            let mut e = match self.registry.epoch(id, number) {
                Ok(Some(e)) if e.is_restorable() => e,
                _ => return,
            };
            match &result {
                Ok(written_bytes) => {
                    info!(
                        job = id,
                        epoch = number,
                        flush_ms,
                        written_bytes,
                        "epoch durable"
                    );
                    let m = crate::metrics::metrics();
                    m.flushes.with_label_values(&["durable"]).inc();
                    m.flush_bytes.inc_by(*written_bytes);
                    m.flush_seconds.observe(flush_ms as f64 / 1000.0);
                    e.flush = FlushState::Durable {
                        flush_ms,
                        written_bytes: *written_bytes,
                        durable_unix_ms: super::now_ms(),
                    };
                }
                Err(f) => {
                    warn!(job = id, epoch = number, error = %f, "flush failed; the epoch stays restorable from its local copies");
                    crate::metrics::metrics()
                        .flushes
                        .with_label_values(&["failed"])
                        .inc();
                    e.flush = FlushState::Failed {
                        reason: f.to_string(),
                    };
                }
            }
            if let Err(err) = self.registry.put_epoch(&e) {
                warn!(job = id, epoch = number, error = %err, "cannot record the flush");
                return;
            }
            if result.is_err() {
                self.remove_shared_copies(&e);
            }
            match self.apply_retention(id) {
                Ok(p) => p,
                Err(err) => {
                    warn!(job = id, error = %err, "retention failed");
                    Vec::new()
                }
            }
        };
        self.prune_in_background(id, pruned);
    }

    /// Records what the background work made of a committed epoch (`what`, for the log), under
    /// the state lock; the epoch as recorded, or none if it is no longer restorable.
    async fn record(
        &self,
        id: u64,
        number: u32,
        what: &str,
        change: impl FnOnce(&mut Epoch),
    ) -> Option<Epoch> {
        let _g = self.state.lock().await;
        match self.registry.epoch(id, number) {
            Ok(Some(mut e)) if e.is_restorable() => {
                change(&mut e);
                if let Err(err) = self.registry.put_epoch(&e) {
                    warn!(job = id, epoch = number, error = %err, "cannot record {what}");
                }
                Some(e)
            }
            _ => None,
        }
    }

    /// Has every node send its images to the next node of the epoch (a ring in name order), in
    /// parallel. Returns the copies that completed (node -> holder); a failed one is logged and
    /// leaves that node without a partner copy.
    async fn copy_to_partners(&self, e: &Epoch) -> BTreeMap<String, String> {
        let mut nodes = e.nodes.clone();
        nodes.sort();
        let deadline = self.cfg.deadlines.finalize;
        let calls = nodes.iter().enumerate().map(|(i, n)| {
            let holder = nodes[(i + 1) % nodes.len()].clone();
            let req = pb::ReplicateRequest {
                job_id: e.job_id,
                epoch: e.number,
                manifest_digest: e.manifests.get(n).cloned().unwrap_or_default(),
                partner: holder.clone(),
                partner_address: self.agents.address(&holder).unwrap_or_default(),
            };
            async move {
                let r = self
                    .agents
                    .call(n, "partner copy", deadline, |mut c| async move {
                        c.replicate(req).await
                    })
                    .await;
                (n.clone(), holder, r)
            }
        });
        let mut out = BTreeMap::new();
        for (n, holder, r) in join_all(calls).await {
            crate::metrics::metrics()
                .partner_copies
                .with_label_values(&[if r.is_ok() { "done" } else { "failed" }])
                .inc();
            match r {
                Ok(_) => {
                    out.insert(n, holder);
                }
                Err(f) => {
                    warn!(job = e.job_id, epoch = e.number, error = %f, holder, "partner copy failed")
                }
            }
        }
        info!(
            job = e.job_id,
            epoch = e.number,
            copies = out.len(),
            "partner copies done"
        );
        out
    }

    /// Has every node copy its images to shared storage, in parallel; records progress.
    /// Returns the bytes written (new chunks) over all nodes.
    async fn copy_to_shared(&self, e: &Epoch) -> Result<u64, NodeFailure> {
        let stall = self.cfg.deadlines.flush_stall;
        let calls = e.nodes.iter().map(|n| async move {
            let req = pb::FlushRequest {
                job_id: e.job_id,
                epoch: e.number,
                manifest_digest: e.manifests.get(n).cloned().unwrap_or_default(),
            };
            let stalled = || NodeFailure {
                node: n.clone(),
                kind: FailureKind::Deadline,
                message: format!(
                    "flush made no progress for {}",
                    humantime::format_duration(stall)
                ),
            };
            let mut client = self.agents.client(n)?;
            let mut stream = tokio::time::timeout(stall, client.flush(req))
                .await
                .map_err(|_| stalled())?
                .map_err(|s| from_status(n, "flush", &s))?
                .into_inner();
            loop {
                match tokio::time::timeout(stall, stream.message()).await {
                    Err(_) => return Err(stalled()),
                    Ok(Err(s)) => return Err(from_status(n, "flush", &s)),
                    Ok(Ok(None)) => {
                        return Err(NodeFailure {
                            node: n.clone(),
                            kind: FailureKind::Unreachable,
                            message: "the flush stream ended before the copy was complete".into(),
                        })
                    }
                    Ok(Ok(Some(p))) => {
                        self.flushes
                            .set(e.job_id, e.number, n, p.bytes_done, p.bytes_total);
                        if p.done {
                            return Ok(p.bytes_written);
                        }
                    }
                }
            }
        });
        join_all(calls)
            .await
            .into_iter()
            .sum::<Result<u64, NodeFailure>>()
    }

    /// Writes the epoch's commit record into shared storage through one of its nodes.
    async fn publish(&self, e: &Epoch) -> Result<(), NodeFailure> {
        let node = e.nodes.first().cloned().unwrap_or_default();
        let req = pb::PublishRequest {
            job_id: e.job_id,
            epoch: e.number,
            manifests: e.manifests.clone().into_iter().collect(),
            image_bytes: e.image_bytes,
            committed_unix_ms: e.finished_unix_ms,
        };
        self.agents
            .call(
                &node,
                "publish",
                self.cfg.deadlines.abort,
                |mut c| async move { c.publish(req).await },
            )
            .await
            .map(|_| ())
    }

    /// Deletes what a failed flush left in shared storage, keeping the local copies.
    fn remove_shared_copies(self: &Arc<Self>, e: &Epoch) {
        let me = self.clone();
        let e = e.clone();
        tokio::spawn(async move {
            // Never while a flush of the job to shared storage runs: it may be using the packs
            // a sweep frees.
            let turns = me.flushes.turns(e.job_id);
            let _g = turns.shared.lock().await;
            for n in &e.nodes {
                let req = pb::PruneRequest {
                    job_id: e.job_id,
                    epochs: vec![e.number],
                    shared: true,
                    keep_local: true,
                };
                if let Err(f) = me
                    .agents
                    .call(n, "prune", me.cfg.deadlines.abort, |mut c| async move {
                        c.prune(req).await
                    })
                    .await
                {
                    warn!(job = e.job_id, epoch = e.number, error = %f, "cannot remove a partial shared copy");
                }
            }
        });
    }

    /// Applies retention to a job's committed epochs and records the outcome (see
    /// [`Coordinator::retention`]); returns what to delete. Call with the state lock held.
    pub(crate) fn apply_retention(&self, id: u64) -> Result<Vec<Prune>, DriveError> {
        let r = self.retention(id, None)?;
        self.registry.put_epochs(&r.changed)?;
        Ok(r.pruned)
    }

    /// What retention makes of a job's committed epochs (newest first), with `newest` (being
    /// committed, not recorded yet) among them; nothing is recorded. Call with the state lock
    /// held. Decided on the epochs' heads: only the epochs it changes are read whole.
    ///
    /// * Local copies: the newest `keep_local` epochs keep them. An older epoch that is durable
    ///   loses only its local copies (a restart fetches it from shared storage); one being
    ///   flushed waits for its flush; any other is expired.
    /// * Shared copies: the newest `keep_shared` durable epochs keep them; older ones expire.
    pub(crate) fn retention(
        &self,
        id: u64,
        newest: Option<&Epoch>,
    ) -> Result<Retention, DriveError> {
        let r = &self.cfg.retention;
        let heads = self.registry.epoch_heads(id)?;
        let skip = newest.map(|e| e.number);
        let mut committed: Vec<&Epoch> = heads
            .iter()
            .map(|h| &**h)
            .filter(|e| Some(e.number) != skip)
            .chain(newest)
            .filter(|e| e.is_restorable())
            .collect();
        committed.sort_by_key(|e| std::cmp::Reverse(e.number));
        let mut changed: BTreeMap<u32, Epoch> = BTreeMap::new();
        let mut out = Vec::new();
        let whole = |n: u32| -> Result<Epoch, DriveError> {
            self.registry
                .epoch(id, n)?
                .ok_or(DriveError::UnknownJob { job: id })
        };
        if r.keep_local > 0 {
            let keep = r.keep_local;
            for e in committed.iter().skip(keep as usize) {
                match e.flush {
                    FlushState::Flushing => continue,
                    FlushState::Durable { .. } if !e.local_copy => continue,
                    _ => {}
                }
                let mut e = whole(e.number)?;
                if matches!(e.flush, FlushState::Durable { .. }) {
                    e.local_copy = false;
                    info!(
                        job = id,
                        epoch = e.number,
                        "local copies deleted; durable in shared storage"
                    );
                } else {
                    e.expire(format!("images deleted by retention (keep_local = {keep})"))?;
                    info!(job = id, epoch = e.number, "epoch expired");
                }
                out.push(Prune {
                    epoch: e.clone(),
                    shared: false,
                });
                changed.insert(e.number, e);
            }
        }
        if r.keep_shared > 0 {
            let keep = r.keep_shared;
            let durable: Vec<u32> = committed
                .iter()
                .map(|e| changed.get(&e.number).unwrap_or(e))
                .filter(|e| e.is_restorable() && e.is_durable())
                .skip(keep as usize)
                .map(|e| e.number)
                .collect();
            for n in durable {
                let mut e = match changed.remove(&n) {
                    Some(e) => e,
                    None => whole(n)?,
                };
                e.expire(format!(
                    "shared copies deleted by retention (keep_shared = {keep})"
                ))?;
                info!(job = id, epoch = e.number, "epoch expired");
                out.push(Prune {
                    epoch: e.clone(),
                    shared: true,
                });
                changed.insert(n, e);
            }
        }
        Ok(Retention {
            changed: changed.into_values().collect(),
            pruned: out,
        })
    }

    /// Has the nodes of a job that stopped or ended delete the images of the epochs it kept for
    /// its next epoch to delete ([`crate::model::Job::unpruned`]), without holding up the
    /// caller.
    pub(crate) async fn prune_unpruned(&self, id: u64) {
        let taken = {
            let _g = self.state.lock().await;
            let Ok(Some(mut job)) = self.registry.job(id) else {
                return;
            };
            if job.state().is_active() || job.unpruned.is_empty() {
                return;
            }
            let taken = std::mem::take(&mut job.unpruned);
            if let Err(e) = self.registry.put_job(&job) {
                warn!(job = id, error = %e, "cannot record the deletion of expired epochs");
                return;
            }
            taken
        };
        self.prune_detached(id, taken);
    }

    /// Deletes the local images of expired epochs of a job on the nodes each ran on, from a
    /// task of its own (over the nodes' clients: callers need no `Arc` of the coordinator).
    /// A node that cannot be reached keeps them (logged) until they are removed by hand.
    pub(crate) fn prune_detached(&self, id: u64, epochs: Vec<u32>) {
        let mut by_node: BTreeMap<(String, bool), Vec<u32>> = BTreeMap::new();
        for n in epochs {
            match self.registry.epoch_head(id, n) {
                Ok(Some(e)) => {
                    for node in &e.nodes {
                        by_node.entry((node.clone(), false)).or_default().push(n);
                    }
                }
                Ok(None) => {}
                Err(err) => {
                    warn!(job = id, epoch = n, error = %err, "cannot read an expired epoch; its images stay on its nodes")
                }
            }
        }
        if !by_node.is_empty() {
            tokio::spawn(self.prune_calls(id, by_node));
        }
    }

    /// The `Prune` calls deleting, on each (node, with its shared copies), the epochs listed;
    /// made all at once (a node that does not answer holds up no other). Needs nothing of the
    /// coordinator once made: the nodes' clients are taken now.
    fn prune_calls(
        &self,
        id: u64,
        by_node: BTreeMap<(String, bool), Vec<u32>>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let deadline = self.cfg.deadlines.abort;
        let calls: Vec<_> = by_node
            .into_iter()
            .map(|((node, shared), epochs)| {
                let client = self.agents.client(&node);
                let req = pb::PruneRequest {
                    job_id: id,
                    epochs,
                    shared,
                    keep_local: false,
                };
                async move {
                    let r = match client {
                        Ok(mut c) => call(&node, "prune", deadline, c.prune(req))
                            .await
                            .map(|_| ()),
                        Err(f) => Err(f),
                    };
                    if let Err(f) = r {
                        warn!(job = id, error = %f, "cannot delete images retention released; they stay on the node");
                    }
                }
            })
            .collect();
        async move {
            join_all(calls).await;
        }
    }

    /// Deletes what retention decided on the epochs' nodes, without holding up the caller. A
    /// node that cannot be reached keeps them (logged) until they are removed by hand.
    pub(crate) fn prune_in_background(self: &Arc<Self>, id: u64, pruned: Vec<Prune>) {
        if pruned.is_empty() {
            return;
        }
        let mut by_node: BTreeMap<(String, bool), Vec<u32>> = BTreeMap::new();
        for p in &pruned {
            for n in &p.epoch.nodes {
                by_node
                    .entry((n.clone(), p.shared))
                    .or_default()
                    .push(p.epoch.number);
            }
        }
        let shared = by_node.keys().any(|(_, shared)| *shared);
        let calls = self.prune_calls(id, by_node);
        let turns = self.flushes.turns(id);
        tokio::spawn(async move {
            // Shared copies are never deleted while a flush of the job runs: it may be using
            // the packs a sweep would free. Local copies need not wait.
            let _g = if shared {
                Some(turns.shared.lock().await)
            } else {
                None
            };
            calls.await;
        });
    }

    /// A line for `ckptctl status` about the job's flush in progress, if any.
    pub fn flush_summary(&self, id: u64) -> String {
        self.flushes
            .in_progress(id)
            .into_iter()
            .filter_map(|e| {
                self.flushes.progress(id, e).map(|(done, total)| {
                    format!(
                        "epoch {e}: {} of {} MB copied to shared storage ({}%)",
                        done >> 20,
                        total >> 20,
                        (done * 100).checked_div(total).unwrap_or(0)
                    )
                })
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CoordinatorConfig;
    use crate::model::EpochState;
    use crate::registry::Registry;

    fn committed(n: u32, flush: FlushState) -> Epoch {
        let mut e = Epoch::begin(1, n, false, vec!["n1".into(), "n2".into()], 0);
        let digests = [("n1", "a"), ("n2", "b")].map(|(n, d)| (n.to_string(), d.to_string()));
        crate::model::fixtures::commit(&mut e, digests.into(), 1);
        e.flush = flush;
        e
    }

    #[test]
    fn retention_keeps_durable_epochs_restorable_and_waits_for_flushes() {
        let d = tempfile::tempdir().unwrap();
        let reg = Registry::open(&d.path().join("r.redb")).unwrap();
        let durable = || FlushState::Durable {
            flush_ms: 1,
            written_bytes: 1,
            durable_unix_ms: 2,
        };
        let failed = FlushState::Failed { reason: "x".into() };
        for (n, f) in [
            (1, durable()),
            (2, FlushState::NotPlanned),
            (3, FlushState::Flushing),
            (4, durable()),
            (5, failed),
            (6, durable()),
        ] {
            reg.put_epoch(&committed(n, f)).unwrap();
        }
        let mut cfg = CoordinatorConfig::default();
        cfg.retention.keep_local = 2;
        cfg.retention.keep_shared = 2;
        let c = Coordinator::new(reg, cfg, None).unwrap();
        let pruned = c.apply_retention(1).unwrap();
        let es: BTreeMap<u32, Epoch> = c
            .registry
            .epochs(1)
            .unwrap()
            .into_iter()
            .map(|e| (e.number, e))
            .collect();
        let storage = |n: u32| (es[&n].state_name(), es[&n].storage_name());
        // The newest two keep everything.
        assert_eq!(storage(6), ("committed".into(), "durable"));
        assert_eq!(storage(5), ("committed".into(), "flush-failed"));
        // Older: durable ones lose only their local copies, one still flushing is left alone,
        // one without a shared copy expires.
        assert_eq!(storage(4), ("committed".into(), "shared-only"));
        assert_eq!(storage(3), ("committed".into(), "flushing"));
        assert_eq!(storage(2).0, "expired");
        // Beyond keep_shared = 2 durable epochs (6, 4), epoch 1 expires everywhere.
        assert!(
            matches!(&es[&1].state, EpochState::Expired { reason } if reason.contains("keep_shared = 2"))
        );
        let got: Vec<(u32, bool)> = pruned.iter().map(|p| (p.epoch.number, p.shared)).collect();
        assert_eq!(got, [(4, false), (2, false), (1, false), (1, true)]);
        // Applying it again changes nothing.
        assert!(c.apply_retention(1).unwrap().is_empty());
    }
}
