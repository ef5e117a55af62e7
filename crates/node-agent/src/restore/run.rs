//! One attempt at restoring a part of a job, as named steps over the node's services and the
//! locked job ([`RestoreRun`]): wait for the old incarnation to be gone, locate and verify a
//! copy of the images, make the node ready (files put back, sandbox, cgroup), then the engine's
//! restore (behind the gate, or with everything checked first), and the part held for the
//! release or let run.

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_store::manifest::NodeManifest;
use tokio::sync::MutexGuard;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::{
    check_pages, check_restored, gate, gate_verify_pool, machine_restore_lock, open_gate, owned,
    wait_pids_free, Restored, PID_FREE_TIMEOUT, RESTORE_TIMEOUT,
};
use crate::copies::{Location, Sources, Usable};
use crate::engine::{RestoreSpec, SnapshotEngine};
use crate::error::AgentError;
use crate::jobs::NodeJob;
use crate::node::Node;
use crate::os::cgroup::Freezer;
use crate::os::owner::{verify_restored, Identity};
use crate::part::notes::PartNotes;
use crate::part::tcp::{address_is_local, clear_stale_sockets};
use crate::shim::ShimMode;

/// A check of page data running beside the other steps: the time it took, or what failed.
type PagesCheck = JoinHandle<ckpt_store::Result<Duration>>;

/// What decides a gate: the page data's check (its time, if there was one) and the TCP hold.
type Verdict = (Result<Option<Duration>, AgentError>, Result<(), AgentError>);

/// One attempt at restoring this node's part of a job ([`RestartRun::restore`]). The job stays
/// locked for the whole attempt; [`RestoreRun::run`] takes the steps in order.
pub(super) struct RestoreRun<'a> {
    node: &'a Node,
    job: MutexGuard<'a, NodeJob>,
    job_id: u64,
    epoch: u32,
    /// Hold the restored part frozen, its TCP held, until the release.
    hold: bool,
    /// The job's token from this restart on (empty: the one it has).
    token: &'a str,
    /// Whether the restored part is fenced when the node's lease runs out.
    may_move: bool,
    /// Set when the page data is refused, so that the attempt is repeated with every file
    /// verified first; `None` in that repeat, which verifies everything before the engine.
    refused: Option<&'a mut bool>,
}

/// The images to restore from, found and verified (their page data perhaps still in check).
struct Located {
    manifest: NodeManifest,
    source: Location,
    /// Why the local copy was not used (empty if it was).
    note: String,
    /// The node this part ran on (another one when it moves here).
    source_node: String,
    /// That part's directory of the epoch in staging.
    node_dir: PathBuf,
    /// Time taken to find, fetch and verify the copy.
    verify_ms: u64,
    /// The check of the page data, when it runs beside what follows.
    pages: Option<PagesCheck>,
    /// Whether that check runs while the engine restores, behind the gate.
    overlapped: bool,
}

/// The node made ready for the engine's restore.
struct Ready {
    owner: Identity,
    sandboxed: bool,
    /// The sandbox's network namespace.
    netns: Option<PathBuf>,
    /// The job directory (canonical), bound into a sandbox at its own path.
    own_dir: PathBuf,
    /// PIDs of the processes that hold ib-quiesce channels.
    channels: Vec<i32>,
    /// The coming incarnation's run directory.
    run_dir: PathBuf,
    /// The engine's log.
    log: PathBuf,
    /// Where the engine writes the restored root's PID.
    pid_file: PathBuf,
    /// The job cgroups' paths within their hierarchies, for the engine.
    cgroup_roots: Vec<String>,
    /// When making the node ready began.
    begin: Instant,
}

/// The engine's restore, done.
struct Engined {
    /// The restored root's PID.
    started: Result<i32, AgentError>,
    engine_ms: u64,
    /// From making the node ready to the engine's start.
    prepare_ms: u64,
    behind_gate: bool,
    /// Whether the engine ran with guarded directories (in a mount namespace of its own).
    guarded: bool,
    /// Behind a gate: the page data's check (its time, if there was one) and the TCP hold.
    verdict: Option<Verdict>,
}

impl<'a> RestoreRun<'a> {
    /// An attempt over `job`, locked (see the fields for the rest).
    pub(super) fn new(
        node: &'a Node,
        job: MutexGuard<'a, NodeJob>,
        (job_id, epoch): (u64, u32),
        terms: super::Terms<'a>,
        refused: Option<&'a mut bool>,
    ) -> Self {
        RestoreRun {
            node,
            job,
            job_id,
            epoch,
            hold: terms.hold,
            token: terms.token,
            may_move: terms.may_move,
            refused,
        }
    }

    /// Every step, in order.
    pub(super) async fn run(
        mut self,
        committed_digest: &str,
        sources: &Sources,
    ) -> Result<Restored, AgentError> {
        self.wait_old_incarnation_gone().await?;
        let mut found = self.locate(committed_digest, sources).await?;
        let engine = self
            .node
            .engine_named(self.job_id, &found.manifest.engine)?;
        if engine.restores_as_owner() {
            return self.restore_as_owner(engine, found).await;
        }
        let ready = self.prepare(&found).await?;
        // What must hold before a restored process runs (the page data verified, the TCP hold
        // in place) is done while the engine restores, which waits for it at the gate; without
        // a gate, before the engine starts.
        let gate = self.gate(&found, &ready);
        let mut pages_ms = None;
        if gate.is_none() {
            pages_ms = self.check_first(&mut found, &ready).await?;
        }
        let done = self.engine_restore(&mut found, &ready, gate).await;
        if let Some(verdict) = done.verdict {
            pages_ms = self.decided(verdict, &ready).await?;
        }
        self.record_guarded_ns(&done.started, done.guarded);
        let pid = self.hold_or_run(done.started, &ready).await?;
        info!(
            pid,
            source = found.source.name(),
            held = self.hold,
            verify_ms = found.verify_ms,
            pages_verify_ms = pages_ms,
            behind_gate = done.behind_gate,
            prepare_ms = done.prepare_ms,
            engine_ms = done.engine_ms,
            "job restored{}",
            if self.hold {
                ", held frozen until released"
            } else {
                ""
            }
        );
        Ok(self.restored(pid, found, ready))
    }

    /// Processes of a just-killed incarnation may still be exiting: gives them a moment.
    async fn wait_old_incarnation_gone(&self) -> Result<(), AgentError> {
        let begin = Instant::now();
        loop {
            let live = self.node.host.pids(&self.job.cgroup).unwrap_or_default();
            if live.is_empty() {
                return Ok(());
            }
            if begin.elapsed() > PID_FREE_TIMEOUT {
                return Err(AgentError::StillRunning {
                    job: self.job_id,
                    pids: live,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Finds a usable copy of the images (fetching it if need be) and verifies it; the page
    /// data of a local copy is left to check beside the engine's restore when this attempt
    /// may (see [`RestartRun::restore`]).
    async fn locate(
        &self,
        committed_digest: &str,
        sources: &Sources,
    ) -> Result<Located, AgentError> {
        let node = self.node;
        // A part that moves here restores the images of the node it ran on.
        let source_node = sources
            .source_node
            .clone()
            .unwrap_or_else(|| node.name.clone());
        let node_dir = node.staging.node_dir(self.job_id, self.epoch, &source_node);
        let begin = Instant::now();
        let later = node.engine.memory_only().filter(|_| self.refused.is_some());
        let Usable {
            manifest,
            source,
            note,
            unverified,
        } = node
            .usable_images(self.job_id, self.epoch, committed_digest, sources, later)
            .await?;
        let verify_ms = begin.elapsed().as_millis() as u64;
        let page_bytes: u64 = unverified.iter().map(|e| e.size).sum();
        let overlapped = later.is_some() && page_bytes >= node.engine.gate_min_bytes();
        let pages = (!unverified.is_empty()).then(|| {
            let dir = node_dir.clone();
            tokio::task::spawn_blocking(move || {
                let begin = Instant::now();
                let verify = || ckpt_store::digest::verify_tree(&dir, &unverified);
                // Behind the gate the engine restores at the same time, and needs CPUs to
                // start and to fill the processes' memory: the check takes half of them.
                match overlapped.then(gate_verify_pool).flatten() {
                    Some(pool) => pool.install(verify),
                    None => verify(),
                }
                .map(|()| begin.elapsed())
            })
        });
        Ok(Located {
            manifest,
            source,
            note,
            source_node,
            node_dir,
            verify_ms,
            pages,
            overlapped,
        })
    }

    /// The rest, for an engine that restores as the job's owner.
    async fn restore_as_owner(
        self,
        engine: Arc<dyn SnapshotEngine>,
        mut found: Located,
    ) -> Result<Restored, AgentError> {
        let images = found.node_dir.join(ckpt_store::chain::IMAGES_DIR);
        let v = owned::Verified {
            job_id: self.job_id,
            epoch: self.epoch,
            manifest: &found.manifest,
            images: &images,
            pages: found.pages.take(),
            hold: self.hold,
            token: self.token,
            may_move: self.may_move,
            source: found.source,
            note: found.note,
            fetch_ms: found.verify_ms,
        };
        self.node.restore_as_owner(self.job, engine, v).await
    }

    /// Makes the node ready for the engine: the chain's links, the checks that the part may
    /// run here (its sandbox, its addresses, its owner, its PIDs), the job's files put back,
    /// a fresh sandbox, and the cgroup and paths of the coming incarnation.
    async fn prepare(&mut self, found: &Located) -> Result<Ready, AgentError> {
        let begin = Instant::now();
        let (node, job_id, epoch) = (self.node, self.job_id, self.epoch);
        let m = &found.manifest;
        let source_node = found.source_node.as_str();
        // The engine finds a pre-copy chain's links through `parent` links, which copies do not
        // carry: made again from the (verified) manifest.
        ckpt_store::chain::relink(&found.node_dir, &m.chain).map_err(|source| {
            AgentError::Store {
                job: job_id,
                source,
            }
        })?;
        // A part that ran in a sandbox gets a fresh one with its job address, on this node as
        // on any other; its PIDs are its namespace's, free wherever it goes.
        let notes = PartNotes::read(&m.notes);
        let sandbox = notes.sandbox().map_err(|message| AgentError::Start {
            job: job_id,
            message: format!("epoch {epoch}: {message}"),
        })?;
        if sandbox.is_none() && source_node != node.name {
            return Err(AgentError::Start {
                job: job_id,
                message: format!(
                    "{source_node}'s part of epoch {epoch} ran without a sandbox, with {source_node}'s PIDs and addresses: it restarts only on {source_node}"
                ),
            });
        }
        for a in m.tcp_addrs.iter().filter(|_| sandbox.is_none()) {
            if !address_is_local(a) {
                return Err(AgentError::AddressMissing {
                    job: job_id,
                    node: node.name.clone(),
                    addr: a.clone(),
                });
            }
        }
        let job = &mut self.job;
        let owner = node.restored_owner(job, m, epoch).await?;
        if sandbox.is_none() {
            let ids: Vec<i32> = m.pids.iter().chain(&m.tids).copied().collect();
            wait_pids_free(job_id, &ids).await?;
        }
        let channels = notes.channels;
        let own_dir = fs::canonicalize(&job.dir).unwrap_or_else(|_| job.dir.clone());
        node.put_back_files(job, &owner, m, &found.node_dir).await?;
        let netns = match &sandbox {
            Some(addr) => Some(node.make_sandbox(job_id, addr).await?.netns),
            None => None,
        };
        let sandboxed = sandbox.is_some();
        job.record.sandbox = sandbox;
        if !self.token.is_empty() {
            job.record.token = self.token.to_string();
        }
        job.record.may_move = self.may_move;
        // A cgroup the engine creates gets the freezer state of dump time (frozen); an existing
        // one would let the restored processes run at once.
        job.remove_empty_cgroup();
        if !sandboxed {
            clear_stale_sockets(&m.tcp_ports).await;
        }
        let inc = job.record.incarnation + 1;
        let run_dir = job.dir.join("run").join(inc.to_string());
        let log = job
            .dir
            .join("logs")
            .join(format!("restore-{epoch}-{inc}.log"));
        let pid_file = run_dir.join("restored.pid");
        // The tree goes into this agent's job cgroup, where the hold, the freezer and the kill
        // find it. A part dumped on another node was in that node's job cgroup, whose path need
        // not be this one's; without this node's path, it cannot move here.
        let cgroup_roots = job.cgroup.engine_roots().unwrap_or_default();
        if cgroup_roots.is_empty() && source_node != node.name {
            return Err(AgentError::Start {
                job: job_id,
                message: format!(
                    "cannot tell the path of {} within its cgroup hierarchy (see /proc/self/mountinfo), so {source_node}'s part cannot be restored into it",
                    job.cgroup.path().display()
                ),
            });
        }
        Ok(Ready {
            owner,
            sandboxed,
            netns,
            own_dir,
            channels,
            run_dir,
            log,
            pid_file,
            cgroup_roots,
            begin,
        })
    }

    /// The gate the engine's restore waits at, when the page data is checked beside it.
    fn gate(&self, found: &Located, ready: &Ready) -> Option<gate::Gate> {
        if !found.overlapped {
            return None;
        }
        open_gate(&self.job.dir, &ready.run_dir)
            .map_err(|e| warn!(job = self.job_id, error = %e, "cannot make the restore gate; verifying and holding before the restore"))
            .ok()
    }

    /// Without a gate: the page data checked and the TCP hold in place before the engine
    /// starts. Returns the check's time, if there was one.
    async fn check_first(
        &mut self,
        found: &mut Located,
        ready: &Ready,
    ) -> Result<Option<u64>, AgentError> {
        let mut pages_ms = None;
        if let Some(check) = found.pages.take() {
            match check_pages(self.job_id, check).await {
                Ok(took) => pages_ms = Some(took.as_millis() as u64),
                Err(e) => {
                    // As if refused at the gate: tried again with every file verified.
                    self.page_data_refused();
                    return Err(e);
                }
            }
        }
        if self.hold {
            self.node
                .hold_tcp(self.job_id, ready.sandboxed, &found.manifest.tcp_ports)
                .await?;
        }
        Ok(pages_ms)
    }

    /// The engine's restore, run by the shim as the owner under the machine's restore lock;
    /// behind a gate, with the page data's check and the TCP hold beside it, which decide
    /// whether the restored processes may run.
    async fn engine_restore(
        &mut self,
        found: &mut Located,
        ready: &Ready,
        gate: Option<gate::Gate>,
    ) -> Engined {
        let node = self.node;
        let (job_id, hold) = (self.job_id, self.hold);
        // Without a link on the way: the engine follows none on a guarded mount.
        let node_dir = fs::canonicalize(&found.node_dir).unwrap_or_else(|_| found.node_dir.clone());
        let argv = node.engine.restore_argv(&RestoreSpec {
            images_dir: &node_dir.join(ckpt_store::chain::IMAGES_DIR),
            log_file: &ready.log,
            pid_file: &ready.pid_file,
            netns_fd: ready
                .netns
                .is_some()
                .then_some(crate::shim::RESTORE_NETNS_FD),
            job_dir: ready.netns.is_some().then_some(ready.own_dir.as_path()),
            cgroup_roots: ready.cgroup_roots.clone(),
            gate: gate.as_ref().map(|_| node.shim_exe.as_path()),
            session: None,
            coordinator_port: None,
        });
        // A sandbox's mounts are made again by the engine from the guarded ones it sees.
        let guard = PartNotes::read(&found.manifest.notes).guards();
        // The epoch's images, in root's own staging (the trust check at start holds it root's
        // alone), where the engine follows its own links (a pre-copy chain's `parent`), even
        // below a guard. Nothing the job holds is there: the bind is gone once it is restored.
        let exempt = vec![node_dir.clone()];
        let guarded = !guard.is_empty();
        let prepare_ms = ready.begin.elapsed().as_millis() as u64;
        let behind_gate = gate.is_some();
        let gate_path = gate.as_ref().map(|g| g.path().to_path_buf());
        let job = &mut self.job;
        let engine = async {
            let lock = machine_restore_lock(self.job_id).await;
            let begin = Instant::now();
            let started = node
                .start_shim(
                    job,
                    ShimMode::Restore {
                        argv,
                        pid_file: ready.pid_file.clone(),
                        netns: ready.netns.clone(),
                        gate: gate_path,
                        guard,
                        exempt,
                    },
                    &ready.owner,
                    RESTORE_TIMEOUT,
                )
                .await;
            drop(lock);
            (started, begin.elapsed().as_millis() as u64)
        };
        let ports = &found.manifest.tcp_ports;
        let pages = found.pages.take();
        let verdict = async {
            let mut gate = gate?;
            let (checked, held) = tokio::join!(
                async {
                    match pages {
                        Some(check) => check_pages(job_id, check).await.map(Some),
                        None => Ok(None),
                    }
                },
                async {
                    if hold {
                        node.hold_tcp(job_id, ready.sandboxed, ports).await
                    } else {
                        Ok(())
                    }
                }
            );
            gate.decide(checked.is_ok() && held.is_ok());
            // Held open until the engine is done with it.
            Some((gate, checked, held))
        };
        let ((started, engine_ms), verdict) = tokio::join!(engine, verdict);
        Engined {
            started,
            engine_ms,
            prepare_ms,
            behind_gate,
            guarded,
            verdict: verdict.map(|(_gate, checked, held)| (checked, held)),
        }
    }

    /// What the gate decided: the page data's check time, or the error that refused the
    /// restored processes (then killed, before any of them ran).
    async fn decided(
        &mut self,
        (checked, held): Verdict,
        ready: &Ready,
    ) -> Result<Option<u64>, AgentError> {
        let error = match (checked, held) {
            (Ok(took), Ok(())) => return Ok(took.map(|d| d.as_millis() as u64)),
            (Err(e), _) => {
                self.page_data_refused();
                e
            }
            (Ok(_), Err(e)) => e,
        };
        // The engine failed at the gate; nothing it restored may be left.
        let _ = self.node.host.kill_all(&self.job.cgroup);
        if self.hold {
            self.node.release_tcp(self.job_id, ready.sandboxed).await;
        }
        Err(error)
    }

    /// Records the mount namespace a guarded restore made: later dumps run the engine there,
    /// and only there (see `DumpSpec::guarded_ns`).
    fn record_guarded_ns(&mut self, started: &Result<i32, AgentError>, guarded: bool) {
        let job = &mut self.job;
        job.record.guarded_ns = match (started, guarded) {
            (Ok(pid), true) => fs::metadata(format!("/proc/{pid}/ns/mnt")).ok().map(|m| {
                use std::os::unix::fs::MetadataExt;
                (m.dev(), m.ino())
            }),
            _ => None,
        };
        if guarded {
            // Kept across an agent restart: the next dump must still run there.
            if let Err(e) = job.save() {
                warn!(job = self.job_id, error = %e, "cannot record the restored part's mount namespace");
            }
        }
    }

    /// A held part stays frozen for the release, checked; another is checked frozen and then
    /// runs. A failed engine's error names its log.
    async fn hold_or_run(
        &mut self,
        started: Result<i32, AgentError>,
        ready: &Ready,
    ) -> Result<i32, AgentError> {
        let (node, job_id, sandboxed) = (self.node, self.job_id, ready.sandboxed);
        let (job, host) = (&self.job, node.host.as_ref());
        match started {
            Ok(pid) if self.hold => {
                // Released together with the other nodes (`release`). A part that cannot be
                // held is not left running on its own: the coordinator only releases (or
                // kills) the parts that reported restored.
                if host
                    .freezer_state(&job.cgroup)
                    .is_ok_and(|s| s == Freezer::Thawed)
                {
                    if let Err(source) = host.freeze(&job.cgroup) {
                        let _ = host.kill_all(&job.cgroup);
                        node.release_tcp(job_id, sandboxed).await;
                        return Err(AgentError::Cgroup {
                            job: job_id,
                            source,
                        });
                    }
                }
                if let Err(e) = verify_restored(job_id, (host, &job.cgroup), &ready.owner) {
                    let _ = host.kill_all(&job.cgroup);
                    node.release_tcp(job_id, sandboxed).await;
                    return Err(e);
                }
                Ok(pid)
            }
            Ok(pid) => {
                // Checked frozen, as a held part is, so that no restored process can act
                // while it is checked; then its connections are let through, and it runs.
                check_restored(host, job, &ready.owner, true)?;
                node.unlock_killed_tcp(&mut self.job).await;
                let (job, host) = (&self.job, node.host.as_ref());
                if let Err(source) = host.thaw(&job.cgroup) {
                    let _ = host.kill_all(&job.cgroup);
                    return Err(AgentError::Cgroup {
                        job: job_id,
                        source,
                    });
                }
                Ok(pid)
            }
            Err(e) => {
                if self.hold {
                    node.release_tcp(job_id, sandboxed).await;
                }
                match e {
                    AgentError::Start { message, .. } => Err(AgentError::Engine {
                        job: job_id,
                        source: node.engine.restore_failed(message, &ready.log),
                    }),
                    e => Err(e),
                }
            }
        }
    }

    /// The restored part, with the job's channel state of the new incarnation.
    fn restored(mut self, pid: i32, found: Located, ready: Ready) -> Restored {
        let job = &mut self.job;
        // The restored processes' channels come back down, waiting for a rebuild flag. They
        // are found at the rebuild among the part's processes: a part restored into a sandbox
        // has its PIDs back inside it, but other PIDs on the node than those the manifest
        // names.
        job.ibq_down.clear();
        job.ibq_restored = ready.channels.len();
        // Layers drained in an epoch of the old incarnation are gone with it: the restored ones
        // come back released (down).
        job.layer_drained.clear();
        Restored {
            pid,
            incarnation: job.record.incarnation,
            source: found.source,
            note: found.note,
            channels: ready.channels.len() as u32,
            fetch_ms: found.verify_ms,
        }
    }

    /// Marks the page data refused, when this attempt may be repeated with every file
    /// verified first.
    fn page_data_refused(&mut self) {
        if let Some(refused) = self.refused.as_deref_mut() {
            *refused = true;
        }
    }
}
