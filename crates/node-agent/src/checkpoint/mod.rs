//! The checkpoint steps on this node: initial-sync, quiesce (freeze), local-checkpoint (dump), resume (thaw or kill),
//! finalize (seal), abort. The dump's work is in `dump.rs`, the ib-quiesce channels in
//! `channels.rs`. Verbs layers quiesce in two rounds of the quiesce phase: in the first they
//! drain and the node does not freeze; in the second (every node drained by then) they release
//! and the node freezes. So every node is frozen before any dumps.

mod channels;
mod dump;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ckpt_proto::v1::Phase;
use ckpt_store::manifest::{self, NodeManifest};

use tokio::sync::OwnedMutexGuard;
use tracing::{info, instrument, warn};

use crate::error::{io_err, AgentError};
use crate::jobs::{now_ms, EpochWork, JobRef, Jobs, NodeJob, NodePhase, Observed, PauseGuard};
use crate::os::cgroup::Freezer;
use crate::os::host::Host;
use crate::os::modes::{set_mode, PRIVATE_DIR};
use crate::os::procfs;
use channels::{refuse_rdma_cm, refuse_verbs_without_channel};
use dump::{dump_frozen, dump_running};

/// Headroom over the resident size when checking staging room: images add metadata, and a
/// checkpoint that fills the disk fails late.
const ROOM_FACTOR: f64 = 1.10;

/// Staging room a checkpoint needs for `resident` bytes of memory: [`ROOM_FACTOR`] times what
/// the dump writes. With a chain of pre-dumps (`on_chain`: bytes written since the newest, and
/// the chain's own bytes) that is only the written bytes, unless so much was written that the
/// dump is a full one ([`dump::full_dump`]), which first deletes the chain and so gets its
/// room back.
fn room_needed(resident: u64, on_chain: Option<(u64, u64)>) -> u64 {
    let room = |bytes: u64| (bytes as f64 * ROOM_FACTOR) as u64;
    match on_chain {
        None => room(resident),
        Some((written, _)) if !dump::full_dump(written, resident) => room(written),
        Some((_, chain)) => room(resident).saturating_sub(chain),
    }
}

/// Result of a finished local checkpoint.
#[derive(Debug, Clone)]
pub struct Finalized {
    /// Total image bytes.
    pub image_bytes: u64,
    /// Number of image files.
    pub image_files: u32,
    /// Digest of the node manifest.
    pub manifest_digest: String,
}

/// Result of initial synchronization.
#[derive(Debug, Clone)]
pub struct Synced {
    /// Processes in the job on this node.
    pub processes: u32,
    /// Estimated image size.
    pub estimated_bytes: u64,
    /// Free bytes in staging.
    pub staging_free_bytes: u64,
    /// ib-quiesce channels among the processes.
    pub channels: u32,
}

/// Refuses a job holding a stopped process ([`Host::stopped`]), naming it.
fn refuse_stopped(host: &dyn Host, job: u64, pids: &[i32]) -> Result<(), AgentError> {
    match host.stopped(pids) {
        None => Ok(()),
        Some(p) => Err(AgentError::Stopped {
            job,
            pid: p.pid,
            how: match p.state {
                't' => "stopped by a debugger or tracer",
                _ => "stopped (SIGSTOP or SIGTSTP)",
            },
            comm: p.comm,
        }),
    }
}

/// Refuses a user's job (not root's: `owner` 0 or unknown) holding a process with more than its
/// owner's rights ([`Host::privilege_of`]): a set-user-ID or set-group-ID program or one with
/// capabilities would be dumped and restored privileged, so the checkpoint is refused at initial
/// sync, naming the process.
fn refuse_privileged(
    host: &dyn Host,
    job: u64,
    pids: &[i32],
    owner: Option<u32>,
) -> Result<(), AgentError> {
    let Some(owner) = owner.filter(|&o| o != 0) else {
        return Ok(());
    };
    for &pid in pids {
        if let Some(why) = host.privilege_of(pid, owner) {
            return Err(AgentError::Privileged {
                job,
                pid,
                comm: procfs::stat(pid).map(|s| s.comm).unwrap_or_default(),
                why,
            });
        }
    }
    Ok(())
}

/// The checkpoint steps of one job's part on this node: what they use of the node and the
/// job's entry in the table, with the stop of its dump (which an abort reaches without the
/// job's lock). Made for each step ([`CheckpointRun::of`]); each step locks the job itself.
pub struct CheckpointRun<'a>(JobRef<'a>);

impl<'a> CheckpointRun<'a> {
    /// The steps of job `job_id` of the table `jobs`.
    pub fn of(jobs: &'a Jobs, job_id: u64) -> Self {
        CheckpointRun(jobs.job_ref(job_id))
    }
}

impl<'a> std::ops::Deref for CheckpointRun<'a> {
    type Target = JobRef<'a>;
    fn deref(&self) -> &JobRef<'a> {
        &self.0
    }
}

impl CheckpointRun<'_> {
    /// Phase 1, initial synchronization: the job runs, no process holds verbs resources without
    /// a channel, no process with one holds on verbs devices more than its channel (or verbs
    /// layer) knows or uses a feature it cannot rebuild, the engine works, and staging has room.
    #[instrument(skip_all, fields(phase = Phase::InitialSync.name(), job = self.job_id, epoch = epoch, node = self.node.name.as_str()))]
    pub async fn initial_sync(&self, epoch: u32) -> Result<Synced, AgentError> {
        let job_id = self.job_id;
        // A pre-dump in progress finishes first; none starts until the epoch ends.
        let begin = Instant::now();
        let chain = match self.entry() {
            Ok(job) => self.node.hold_chain(&job).await,
            Err(_) => None,
        };
        if begin.elapsed() > Duration::from_secs(1) {
            info!(
                job = self.job_id,
                epoch,
                waited_ms = begin.elapsed().as_millis() as u64,
                "initial-sync waited for the job's pre-dump in progress (the wait counts against ckptd's deadlines.sync)"
            );
        }
        let j = self.entry()?;
        let mut job = j.lock().await;
        if let Some(w) = &job.work {
            return Err(AgentError::WrongPhase {
                job: job_id,
                epoch,
                call: Phase::InitialSync.name(),
                state: format!("epoch {} is {:?}", w.epoch, w.phase),
            });
        }
        self.node
            .failpoint(job_id, Phase::InitialSync.name())
            .await?;
        let (pids, channeled) = self.processes_to_dump(job_id, &job).await?;
        let estimated: u64 = pids.iter().map(|&p| self.node.host.rss_bytes(p)).sum();
        // On top of a chain of pre-dumps, the dump writes what was written since the newest.
        let on_chain = chain.as_ref().and_then(|c| {
            (c.incarnation == job.record.incarnation && !c.links.is_empty()).then(|| {
                let dirty = pids
                    .iter()
                    .map(|&p| procfs::soft_dirty_bytes(p).unwrap_or(0));
                (dirty.sum(), c.links.iter().map(|l| l.bytes).sum())
            })
        });
        let (node_dir, free) = self.stage_room(job_id, epoch, room_needed(estimated, on_chain))?;
        let root_pid = job.record.root_pid.unwrap_or(0);
        job.work = Some(EpochWork {
            epoch,
            phase: NodePhase::Synced,
            node_dir,
            frozen_at: None,
            pids,
            root_pid,
            open_files: Vec::new(),
            preserved: Vec::new(),
            tcp_ports: Vec::new(),
            tcp_addrs: Vec::new(),
            tids: Vec::new(),
            notes: BTreeMap::new(),
            suspended: None,
            pause: None,
            chain,
            links: Vec::new(),
            kill_lock: false,
        });
        Ok(Synced {
            processes: job.work.as_ref().map(|w| w.pids.len() as u32).unwrap_or(0),
            estimated_bytes: estimated,
            staging_free_bytes: free,
            channels: channeled.len() as u32,
        })
    }

    /// The processes of `job` that the epoch dumps, and those of them with an ib-quiesce
    /// channel up, once every check passed: each is in the job's tree (unless its engine finds
    /// them itself), the job runs, and none is stopped, privileged or holds verbs resources
    /// its channel (or verbs layer) cannot take through a checkpoint.
    async fn processes_to_dump(
        &self,
        job_id: u64,
        job: &NodeJob,
    ) -> Result<(Vec<i32>, Vec<i32>), AgentError> {
        let engine = self.node.engine_named(job_id, &job.record.engine)?;
        let root = job.record.root_pid.unwrap_or(0);
        let live = self.node.host.pids(&job.cgroup).unwrap_or_default();
        // An engine that is not given the tree's root finds the processes itself (DMTCP's
        // coordinator, which its launcher started outside the tree, among them).
        let outside = match engine.freezes() {
            true => self.node.host.outside_tree(root, &live),
            false => Vec::new(),
        };
        if let Some(p) = outside.into_iter().min_by_key(|p| p.pid) {
            return Err(AgentError::OutsideTree {
                job: job_id,
                pid: p.pid,
                comm: p.comm,
                root,
            });
        }
        let ended = match job.observe(self.node.host.as_ref()) {
            Observed::Running => None,
            Observed::Exited(e) => Some(e.text()),
            Observed::Lost => Some("no processes".to_string()),
        };
        if let Some(state) = ended {
            return Err(AgentError::NotRunning { job: job_id, state });
        }
        let pids = self
            .node
            .host
            .pids(&job.cgroup)
            .map_err(|source| AgentError::Cgroup {
                job: job_id,
                source,
            })?;
        if !engine.freezes() {
            let session = job.session_dir();
            let owner = job.record.owner.unwrap_or(u32::MAX);
            let e = engine.clone();
            tokio::task::spawn_blocking(move || e.running(&session, owner))
                .await
                .expect("engine status task")
                .map_err(|state| AgentError::NotRunning { job: job_id, state })?;
        }
        // A process with a channel releases the device before the freeze; checked again then.
        let channeled = self.node.channels.up(&pids).await;
        refuse_verbs_without_channel(
            job_id,
            pids.iter().filter(|p| !channeled.contains(p)),
            self.node.channels.socket(),
        )?;
        refuse_rdma_cm(job_id, &pids)?;
        refuse_stopped(self.node.host.as_ref(), job_id, &pids)?;
        refuse_privileged(self.node.host.as_ref(), job_id, &pids, job.record.owner)?;
        self.node.check_channels(job_id, &channeled).await?;
        Ok((pids, channeled))
    }

    /// Room for the epoch in staging (`need` bytes, else the error says how much is free) and
    /// the node's directory of the epoch made there; with the free bytes.
    fn stage_room(
        &self,
        job_id: u64,
        epoch: u32,
        need: u64,
    ) -> Result<(std::path::PathBuf, u64), AgentError> {
        let free = self
            .node
            .staging
            .free_bytes()
            .map_err(|source| AgentError::Store {
                job: job_id,
                source,
            })?;
        if free < need {
            return Err(AgentError::NoRoom {
                job: job_id,
                dir: self.node.staging.root().to_path_buf(),
                need,
                free,
            });
        }
        let node_dir = self
            .node
            .staging
            .create_node_dir(job_id, epoch, &self.node.name)
            .map_err(|source| AgentError::Store {
                job: job_id,
                source,
            })?;
        // Root's alone even where staging is a shared directory (see `protect_staging`).
        let job_stage = self.node.staging.job_dir(job_id);
        set_mode(&job_stage, PRIVATE_DIR).map_err(io_err(job_id, "chmod", &job_stage))?;
        Ok((node_dir, free))
    }

    /// The job, locked, for the checkpoint step `call` of `epoch`: it must have reached `phase`
    /// of that epoch (else the error names `call`), and the step's failpoint runs first.
    async fn enter_phase(
        &self,
        job_id: u64,
        epoch: u32,
        phase: NodePhase,
        call: &'static str,
    ) -> Result<OwnedMutexGuard<NodeJob>, AgentError> {
        let mut job = self.entry()?.lock_owned().await;
        job.expect_phase(epoch, phase, call)?;
        self.node.failpoint(job_id, call).await?;
        Ok(job)
    }

    /// Phase 2, pre-checkpoint coordination: quiesce the job's channels and freeze every
    /// process of the job on this node. Where verbs layers only drained, this is the first
    /// round: the node does not freeze, and says how many drained; the coordinator then runs a
    /// second round on every node, which releases them and freezes (a node that froze in the
    /// first round has nothing to do). Returns the freeze's time and the processes drained.
    #[instrument(skip_all, fields(phase = Phase::Quiesce.name(), job = self.job_id, epoch = epoch, node = self.node.name.as_str()))]
    pub async fn quiesce(&self, epoch: u32) -> Result<(Duration, u32), AgentError> {
        let job_id = self.job_id;
        let mut job = self.entry()?.lock_owned().await;
        match job
            .work
            .as_ref()
            .filter(|w| w.epoch == epoch)
            .map(|w| w.phase)
        {
            Some(NodePhase::Synced) => {
                self.node.failpoint(job_id, Phase::Quiesce.name()).await?;
                self.node.quiesce_channels(&mut job).await?;
                if !job.layer_drained.is_empty() {
                    let n = job.layer_drained.len() as u32;
                    info!(
                        layers = n,
                        "verbs layers drained; release and freeze in the second round"
                    );
                    job.work.as_mut().expect("checked").phase = NodePhase::Drained;
                    return Ok((Duration::ZERO, n));
                }
            }
            Some(NodePhase::Drained) => self.node.release_layers(&mut job).await?,
            // The second round, on a node that froze in the first.
            Some(NodePhase::Quiesced) => return Ok((Duration::ZERO, 0)),
            _ => return Err(job.wrong_phase(epoch, Phase::Quiesce.name())),
        }
        // An engine that suspends the job itself needs it running.
        if !self
            .node
            .engine_named(job_id, &job.record.engine)?
            .freezes()
        {
            job.work.as_mut().expect("checked").phase = NodePhase::Quiesced;
            return Ok((Duration::ZERO, 0));
        }
        let (mut job, took) = self.freeze(job_id, job).await?;
        job.work.as_mut().expect("checked").phase = NodePhase::Quiesced;
        Ok((took, 0))
    }

    /// Freezes the job's cgroup for the snapshot (background copies stop taking CPU and disk
    /// first, until the thaw) and records when, and the processes frozen. Returns the job and
    /// how long the freeze took.
    async fn freeze(
        &self,
        job_id: u64,
        mut job: OwnedMutexGuard<NodeJob>,
    ) -> Result<(OwnedMutexGuard<NodeJob>, Duration), AgentError> {
        job.work.as_mut().expect("checked").pause = Some(PauseGuard::new(&self.node.frozen));
        let begin = Instant::now();
        let host = self.node.host.clone();
        let (mut job, r) = tokio::task::spawn_blocking(move || {
            let r = host.freeze_for_snapshot(&job.cgroup);
            (job, r)
        })
        .await
        .expect("freeze task");
        let retries = r.map_err(|source| AgentError::Cgroup {
            job: job_id,
            source,
        })?;
        if retries > 0 {
            info!(
                job = self.job_id,
                retries, "froze again: a process was waiting for a vfork child"
            );
        }
        let pids = self.node.host.pids(&job.cgroup).unwrap_or_default();
        let w = job.work.as_mut().expect("checked");
        w.frozen_at = Some(begin);
        w.pids = pids;
        // Stopped since initial-sync: refused now, before the engine would wait for it. The
        // coordinator's abort thaws the job.
        refuse_stopped(self.node.host.as_ref(), job_id, &w.pids)?;
        Ok((job, begin.elapsed()))
    }

    /// Phase 3, local checkpoint: record open-file sizes, save what the engine does not, and
    /// have the engine dump the frozen tree into staging. Returns (elapsed, frozen so far).
    #[instrument(skip_all, fields(phase = Phase::LocalCheckpoint.name(), job = self.job_id, epoch = epoch, node = self.node.name.as_str()))]
    pub async fn local_checkpoint(
        &self,
        epoch: u32,
        kill: bool,
    ) -> Result<(Duration, Duration), AgentError> {
        let job_id = self.job_id;
        let mut job = self
            .enter_phase(
                job_id,
                epoch,
                NodePhase::Quiesced,
                Phase::LocalCheckpoint.name(),
            )
            .await?;
        let begin = Instant::now();
        let engine = self.node.engine_named(job_id, &job.record.engine)?;
        if kill && engine.freezes() {
            // The epoch ends the part: its connections are locked now, while it is frozen and
            // the engine's own lock not yet on, and stay so through the kill to the restart.
            // The engine lifts its lock at the end of its dump (the job was to run on), and
            // the frozen part's kernel would meanwhile take in (and acknowledge) what a peer
            // sends, which the images do not hold.
            let pids = job
                .work
                .as_ref()
                .map(|w| w.pids.clone())
                .unwrap_or_default();
            let locked = self.node.lock_tcp_before_kill(&mut job, &pids).await;
            job.work.as_mut().expect("checked").kill_lock = locked;
        }
        // An abort or a cancel ends the dump through this, without the job's lock.
        let stop = self.stop.clone();
        stop.begin(epoch);
        let (mut job, r) = tokio::task::spawn_blocking(move || {
            let r = match engine.freezes() {
                true => dump_frozen(&mut job, engine.as_ref(), &stop),
                false => dump_running(&mut job, engine.as_ref(), &stop),
            };
            stop.end();
            (job, r)
        })
        .await
        .expect("dump task");
        r?;
        let w = job.work.as_mut().expect("checked");
        w.phase = NodePhase::Checkpointed;
        Ok((begin.elapsed(), w.frozen_so_far()))
    }

    /// Phase 4, post-checkpoint coordination: thaw the job (or kill it for `--kill`). Returns
    /// (elapsed, time frozen from the freeze to the end of the thaw).
    #[instrument(skip_all, fields(phase = Phase::Resume.name(), job = self.job_id, epoch = epoch, kill = kill, node = self.node.name.as_str()))]
    pub async fn resume(&self, epoch: u32, kill: bool) -> Result<(Duration, Duration), AgentError> {
        let job_id = self.job_id;
        let mut job = self
            .enter_phase(job_id, epoch, NodePhase::Checkpointed, Phase::Resume.name())
            .await?;
        let begin = Instant::now();
        // The engine that suspended the job itself has let it run on already.
        let thaw = self
            .node
            .engine_named(job_id, &job.record.engine)?
            .freezes();
        let host = self.node.host.clone();
        if kill && !job.work.as_ref().is_some_and(|w| w.kill_lock) {
            // Not locked at the dump (an engine that suspends the job itself): now.
            let pids = host.pids(&job.cgroup).unwrap_or_default();
            self.node.lock_tcp_before_kill(&mut job, &pids).await;
        }
        let (mut job, r) = tokio::task::spawn_blocking(move || {
            let r = if kill {
                host.kill_all(&job.cgroup)
            } else if thaw {
                host.thaw(&job.cgroup)
            } else {
                Ok(())
            };
            (job, r)
        })
        .await
        .expect("resume task");
        r.map_err(|source| AgentError::Cgroup {
            job: job_id,
            source,
        })?;
        if kill {
            job.ibq_down.clear();
            job.layer_drained.clear();
            if job.record.sandbox.is_some() {
                // Its job address (and the MAC derived from it) leaves the network now, not at
                // the next heartbeat: a restart may put the part on another node at once (drain
                // --migrate), and two interfaces with one address would split its traffic.
                crate::os::sandbox::remove(&self.node.netns(job_id)).await;
            }
        }
        let w = job.work.as_mut().expect("checked");
        w.phase = NodePhase::Resumed;
        w.pause = None;
        Ok((begin.elapsed(), w.frozen_so_far()))
    }

    /// Seals the epoch on this node: digest and fsync every image, write the node manifest.
    /// Runs after the job has resumed, so it costs the job no frozen time.
    #[instrument(skip_all, fields(phase = Phase::Finalize.name(), job = self.job_id, epoch = epoch, node = self.node.name.as_str()))]
    pub async fn finalize(&self, epoch: u32) -> Result<Finalized, AgentError> {
        let job_id = self.job_id;
        let mut job = self
            .enter_phase(job_id, epoch, NodePhase::Resumed, Phase::Finalize.name())
            .await?;
        let engine = self.node.engine_named(job_id, &job.record.engine)?;
        let engine = (engine.name().to_string(), engine.version().to_string());
        // Nothing is committed that the engine could not restore.
        if let Some(w) = &job.work {
            dump::check_linked_remaps(&w.node_dir, &w.preserved).map_err(|why| {
                AgentError::Unrestorable {
                    job: job_id,
                    epoch,
                    why,
                }
            })?;
        }
        let mut w = job.work.take().expect("checked");
        let chain = w.chain.take();
        let node = self.node.name.clone();
        let r =
            tokio::task::spawn_blocking(move || -> Result<Finalized, ckpt_store::StoreError> {
                let files = ckpt_store::digest::seal_tree(&w.node_dir, &[manifest::FILE_NAME])?;
                let m = NodeManifest {
                    job_id,
                    epoch,
                    node,
                    engine: engine.0,
                    engine_version: engine.1,
                    created_unix_ms: now_ms(),
                    root_pid: w.root_pid,
                    pids: w.pids,
                    tids: w.tids,
                    files,
                    open_files: w.open_files,
                    preserved: w.preserved,
                    tcp_ports: w.tcp_ports,
                    tcp_addrs: w.tcp_addrs,
                    notes: w.notes,
                    chain: w.links,
                };
                let digest = manifest::write(&w.node_dir, &m)?;
                Ok(Finalized {
                    image_bytes: m.image_bytes(),
                    image_files: m.files.len() as u32,
                    manifest_digest: digest,
                })
            })
            .await
            .expect("finalize task");
        if let Some(mut c) = chain {
            c.epoch_ended();
        }
        r.map_err(|source| AgentError::Store {
            job: job_id,
            source,
        })
    }

    /// Abandons an epoch: thaw the job if it is frozen, delete the epoch's images on this node,
    /// and let verbs layers still drained run on (their objects are intact). Safe to call in
    /// any phase and more than once.
    #[instrument(skip_all, fields(phase = "abort", job = self.job_id, epoch = epoch, node = self.node.name.as_str()))]
    pub async fn abort(&self, epoch: u32, reason: &str) -> Result<(), AgentError> {
        let job_id = self.job_id;
        let j = self.entry()?;
        // A dump still running holds the job: it is stopped first (its engine killed), so
        // that the thaw below comes now, not when the engine ends by itself (if ever).
        if self.stop.clone().stop(Some(epoch)) {
            warn!(
                job = self.job_id,
                epoch, "the epoch's dump was still running: its engine is stopped"
            );
        }
        let mut job = j.lock_owned().await;
        let mut kill_lock = false;
        if job.work.as_ref().is_some_and(|w| w.epoch == epoch) {
            let w = job.work.take().expect("checked");
            kill_lock = w.kill_lock;
            if let Some(mut c) = w.chain {
                c.epoch_ended();
            }
        }
        warn!(reason, "aborting epoch");
        if kill_lock {
            // The part runs on: its connections with it.
            self.node.unlock_tcp_after_abort(&mut job).await;
        }
        let staging = self.node.staging.clone();
        let node = self.node.name.clone();
        let host = self.node.host.clone();
        let (mut job, r) = tokio::task::spawn_blocking(move || {
            let mut r = Ok(());
            let cg = &job.cgroup;
            if host.cgroup_exists(cg) && host.freezer_state(cg).is_ok_and(|s| s != Freezer::Thawed)
            {
                r = host.thaw(cg).map_err(|source| AgentError::Cgroup {
                    job: job_id,
                    source,
                });
            }
            if let Err(source) = staging.remove_node_dir(job_id, epoch, &node) {
                r = r.and(Err(AgentError::Store {
                    job: job_id,
                    source,
                }));
            }
            (job, r)
        })
        .await
        .expect("abort task");
        if !job.layer_drained.is_empty() {
            // After the thaw: a frozen process could not answer.
            self.node.channels.resume(&job.layer_drained).await;
            job.layer_drained.clear();
        }
        r
    }
}

#[cfg(test)]
mod phase_tests;
#[cfg(test)]
mod tests;
