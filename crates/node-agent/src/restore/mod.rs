//! Restart on this node: restore a part of a job from a committed epoch (the job's files put
//! back as its owner, then the engine's restore), then release or kill it. The TCP hold is in
//! `hold.rs`.

pub(crate) mod gate;
mod hold;
mod owned;

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use ckpt_store::manifest::{NodeManifest, OpenFile};
use tracing::{info, instrument, warn};

use crate::checkpoint::{channel_pids, guards};
use crate::copies::{Location, Sources, Usable};
use crate::engine::RestoreSpec;
use crate::error::AgentError;
use crate::jobs::{Jobs, NodeJob, OWNER_NOTE};
use crate::modes::{ensure_dir, PRIVATE_DIR};
use crate::owner::{
    put_back_own_output, run_put_back, verify_restored, Identity, PutBack, PutBackTask,
};
use crate::procfs;
use crate::sandbox;
use crate::shim::ShimMode;
use hold::{address_is_local, clear_stale_sockets};

/// How long a restore may take: the engine reads every image page back; at a pessimistic
/// 100 MB/s this covers 60 GB per node.
pub const RESTORE_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a restore waits for the PIDs of a just-killed incarnation to be released. Zombies
/// of killed processes linger until reaped, which init can take over a second to do.
pub const PID_FREE_TIMEOUT: Duration = Duration::from_secs(10);

/// A restored part of a job.
#[derive(Debug)]
pub struct Restored {
    /// PID of the restored root process.
    pub pid: i32,
    /// The job's incarnation on this node.
    pub incarnation: u32,
    /// Where the images came from.
    pub source: Location,
    /// Why the local copy was not used (empty if it was).
    pub note: String,
    /// ib-quiesce channels in the restored processes (rebuilt after the release).
    pub channels: u32,
    /// Time taken to find a usable copy of the images (fetching it if need be) and verify it.
    pub fetch_ms: u64,
}

impl Jobs {
    /// Restores this node's part of a job from a committed epoch: verify the manifest and every
    /// image against the committed digest, put the job's files back as they were, then have
    /// the shim run the engine's restore.
    ///
    /// Page data files of a local copy (only memory contents, see
    /// [`crate::engine::SnapshotEngine::memory_only`]) are verified while the engine restores
    /// when there are enough of them to be worth it (`[criu] restore_gate_min_mb`), everything
    /// else before it starts; no restored process runs before the page data has passed
    /// ([`gate`]). If it does not pass, the attempt is repeated with every file verified first,
    /// as with copies from elsewhere.
    #[instrument(skip_all, fields(phase = "restore", job = job_id, epoch = epoch, node = self.node()))]
    pub async fn restore(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        hold: bool,
        token: &str,
        sources: &Sources,
    ) -> Result<Restored, AgentError> {
        self.failpoint(job_id, "restore").await?;
        let begin = std::time::Instant::now();
        let mut pages_refused = false;
        let gated = self
            .restore_from(
                job_id,
                epoch,
                committed_digest,
                (hold, token),
                sources,
                Some(&mut pages_refused),
            )
            .await;
        let r = match gated {
            Err(error) if pages_refused => {
                // The gate killed the tree before it ran. Verifying everything first may find
                // an intact copy elsewhere, and names what is damaged as always.
                warn!(job = job_id, epoch, %error, "page data refused before any restored process ran; verifying every file first");
                self.restore_from(
                    job_id,
                    epoch,
                    committed_digest,
                    (hold, token),
                    sources,
                    None,
                )
                .await
            }
            r => r,
        };
        let m = crate::metrics::metrics();
        m.restores
            .with_label_values(&[if r.is_ok() { "done" } else { "failed" }])
            .inc();
        if r.is_ok() {
            m.restore_seconds.observe(begin.elapsed().as_secs_f64());
        }
        r
    }

    /// One attempt of [`Jobs::restore`]; with `gated`, the local page data is verified while
    /// the engine runs, and a refusal of it is reported there as well as in the error.
    async fn restore_from(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        (hold, token): (bool, &str),
        sources: &Sources,
        gated: Option<&mut bool>,
    ) -> Result<Restored, AgentError> {
        let j = self.get_or_create(job_id)?;
        let mut job = j.lock().await;
        // Processes of a just-killed incarnation may still be exiting: give them a moment.
        let begin = Instant::now();
        loop {
            let live = job.cgroup.pids().unwrap_or_default();
            if live.is_empty() {
                break;
            }
            if begin.elapsed() > PID_FREE_TIMEOUT {
                return Err(AgentError::StillRunning {
                    job: job_id,
                    pids: live,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A part that moves here restores the images of the node it ran on.
        let source_node = sources.source_node.as_deref().unwrap_or(&self.node);
        let node_dir = self.staging.node_dir(job_id, epoch, source_node);
        let verify_begin = Instant::now();
        let later = self.engine.memory_only().filter(|_| gated.is_some());
        let Usable {
            manifest: m,
            source,
            note,
            unverified,
        } = self
            .usable_images(job_id, epoch, committed_digest, sources, later)
            .await?;
        let verify_ms = verify_begin.elapsed().as_millis() as u64;
        let page_bytes: u64 = unverified.iter().map(|e| e.size).sum();
        let overlapped = later.is_some() && page_bytes >= self.engine.gate_min_bytes();
        let mut pages = (!unverified.is_empty()).then(|| {
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
        let engine = self.engine_named(job_id, &m.engine)?;
        if engine.restores_as_owner() {
            let images = node_dir.join(ckpt_store::chain::IMAGES_DIR);
            let v = owned::Verified {
                job_id,
                epoch,
                manifest: &m,
                images: &images,
                pages: pages.take(),
                hold,
                token,
                source,
                note,
                fetch_ms: verify_ms,
            };
            return self.restore_as_owner(job, engine, v).await;
        }
        let prepare_begin = Instant::now();
        // The engine finds a pre-copy chain's links through `parent` links, which copies do not
        // carry: made again from the (verified) manifest.
        ckpt_store::chain::relink(&node_dir, &m.chain).map_err(|source| AgentError::Store {
            job: job_id,
            source,
        })?;
        // A part that ran in a sandbox gets a fresh one with its job address, on this node as
        // on any other; its PIDs are its namespace's, free wherever it goes.
        let sandbox = match m.notes.get(sandbox::ADDRESS_NOTE) {
            Some(a) => Some(
                sandbox::JobAddress::parse(
                    a,
                    m.notes
                        .get(sandbox::GATEWAY_NOTE)
                        .map_or("", String::as_str),
                )
                .map_err(|message| AgentError::Start {
                    job: job_id,
                    message: format!("epoch {epoch}: {message}"),
                })?,
            ),
            None => None,
        };
        if sandbox.is_none() && source_node != self.node {
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
                    node: self.node.clone(),
                    addr: a.clone(),
                });
            }
        }
        // The owner recorded at checkpoint time (committed with the manifest) must still be
        // allowed to run jobs here; files are put back as that user.
        let owner_uid = m
            .notes
            .get(OWNER_NOTE)
            .and_then(|v| v.parse().ok())
            .or(job.record.owner)
            .ok_or_else(|| AgentError::OwnerUnknown {
                job: job_id,
                epoch,
                node: self.node.clone(),
            })?;
        let owner = self.policy.authorize(job_id, &self.node, owner_uid)?;
        job.record.owner = Some(owner.uid);
        if sandbox.is_none() {
            let ids: Vec<i32> = m.pids.iter().chain(&m.tids).copied().collect();
            wait_pids_free(job_id, &ids).await?;
        }
        let channels = channel_pids(&m.notes);
        let own_dir = fs::canonicalize(&job.dir).unwrap_or_else(|_| job.dir.clone());
        self.put_back_files(&job, &owner, &m, &node_dir).await?;
        let netns = match &sandbox {
            Some(addr) => Some(self.make_sandbox(job_id, addr).await?.netns),
            None => None,
        };
        let sandboxed = sandbox.is_some();
        job.record.sandbox = sandbox;
        if !token.is_empty() {
            job.record.token = token.to_string();
        }
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
        let cgroup_root = job.cgroup.engine_root();
        if cgroup_root.is_none() && source_node != self.node {
            return Err(AgentError::Start {
                job: job_id,
                message: format!(
                    "cannot tell the path of {} within its cgroup hierarchy (see /proc/self/mountinfo), so {source_node}'s part cannot be restored into it",
                    job.cgroup.path().display()
                ),
            });
        }
        // What must hold before a restored process runs (the page data verified, the TCP hold
        // in place) is done while the engine restores, which waits for it at the gate; without
        // a gate, before the engine starts.
        let gate = if overlapped {
            open_gate(&job.dir, &run_dir)
                .map_err(|e| warn!(job = job_id, error = %e, "cannot make the restore gate; verifying and holding before the restore"))
                .ok()
        } else {
            None
        };
        let mut pages_ms = None;
        if gate.is_none() {
            if let Some(check) = pages.take() {
                match check_pages(job_id, check).await {
                    Ok(took) => pages_ms = Some(took.as_millis() as u64),
                    Err(e) => {
                        // As if refused at the gate: tried again with every file verified.
                        if let Some(refused) = gated {
                            *refused = true;
                        }
                        return Err(e);
                    }
                }
            }
            if hold {
                self.hold_tcp(job_id, sandboxed, &m.tcp_ports).await?;
            }
        }
        let argv = self.engine.restore_argv(&RestoreSpec {
            images_dir: &node_dir.join(ckpt_store::chain::IMAGES_DIR),
            log_file: &log,
            pid_file: &pid_file,
            netns_fd: netns.is_some().then_some(crate::shim::RESTORE_NETNS_FD),
            job_dir: netns.is_some().then_some(own_dir.as_path()),
            cgroup_root,
            gate: gate.as_ref().map(|_| self.shim_exe.as_path()),
            session: None,
            coordinator_port: None,
        });
        // A sandbox's mounts are made again by the engine from the guarded ones it sees.
        let guard = guards(&m.notes);
        // Root's own trees (the trust check at start holds them root's alone), where the
        // engine follows its own links (a pre-copy chain's `parent`), even below a guard.
        let exempt: Vec<std::path::PathBuf> = [self.staging.root(), self.state_dir.as_path()]
            .iter()
            .filter_map(|p| fs::canonicalize(p).ok())
            .collect();
        let guarded = !guard.is_empty();
        let prepare_ms = prepare_begin.elapsed().as_millis() as u64;
        let behind_gate = gate.is_some();
        let gate_path = gate.as_ref().map(|g| g.path().to_path_buf());
        let engine = async {
            let lock = machine_restore_lock().await;
            let begin = Instant::now();
            let started = self
                .start_shim(
                    &mut job,
                    ShimMode::Restore {
                        argv,
                        pid_file,
                        netns,
                        gate: gate_path,
                        guard,
                        exempt,
                    },
                    &owner,
                    RESTORE_TIMEOUT,
                )
                .await;
            drop(lock);
            (started, begin.elapsed().as_millis() as u64)
        };
        let ports = &m.tcp_ports;
        let verdict = async {
            let mut gate = gate?;
            let (checked, held) = tokio::join!(
                async {
                    match pages.take() {
                        Some(check) => check_pages(job_id, check).await.map(Some),
                        None => Ok(None),
                    }
                },
                async {
                    if hold {
                        self.hold_tcp(job_id, sandboxed, ports).await
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
        if let Some((_gate, checked, held)) = verdict {
            let refused = match (checked, held) {
                (Ok(took), Ok(())) => {
                    pages_ms = took.map(|d| d.as_millis() as u64);
                    None
                }
                (Err(e), _) => {
                    if let Some(refused) = gated {
                        *refused = true;
                    }
                    Some(e)
                }
                (Ok(_), Err(e)) => Some(e),
            };
            if let Some(error) = refused {
                // The engine failed at the gate; nothing it restored may be left.
                let _ = job.cgroup.kill_all();
                if hold {
                    self.release_tcp(job_id, sandboxed).await;
                }
                return Err(error);
            }
        }
        // The namespace a guarded restore made: later dumps run the engine there, and only
        // there (see `DumpSpec::guarded_ns`).
        job.record.guarded_ns = match (&started, guarded) {
            (Ok(pid), true) => fs::metadata(format!("/proc/{pid}/ns/mnt")).ok().map(|m| {
                use std::os::unix::fs::MetadataExt;
                (m.dev(), m.ino())
            }),
            _ => None,
        };
        if guarded {
            // Kept across an agent restart: the next dump must still run there.
            if let Err(e) = job.save() {
                warn!(job = job_id, error = %e, "cannot record the restored part's mount namespace");
            }
        }
        let pid = match started {
            Ok(pid) if hold => {
                // Released together with the other nodes (`release`). A part that cannot be
                // held is not left running on its own: the coordinator only releases (or
                // kills) the parts that reported restored.
                if job.cgroup.state().map(|s| s == "THAWED").unwrap_or(false) {
                    if let Err(source) = job.cgroup.freeze() {
                        let _ = job.cgroup.kill_all();
                        self.release_tcp(job_id, sandboxed).await;
                        return Err(AgentError::Cgroup {
                            job: job_id,
                            source,
                        });
                    }
                }
                if let Err(e) = verify_restored(job_id, &job.cgroup, &owner) {
                    let _ = job.cgroup.kill_all();
                    self.release_tcp(job_id, sandboxed).await;
                    return Err(e);
                }
                pid
            }
            Ok(pid) => {
                // Checked frozen, as a held part is, so that no restored process can act
                // while it is checked; then it runs.
                check_restored(&job, &owner, false)?;
                pid
            }
            Err(e) => {
                if hold {
                    self.release_tcp(job_id, sandboxed).await;
                }
                return match e {
                    AgentError::Start { message, .. } => Err(AgentError::Engine {
                        job: job_id,
                        source: self.engine.restore_failed(message, &log),
                    }),
                    e => Err(e),
                };
            }
        };
        info!(
            pid,
            source = source.name(),
            held = hold,
            verify_ms,
            pages_verify_ms = pages_ms,
            behind_gate,
            prepare_ms,
            engine_ms,
            "job restored{}",
            if hold {
                ", held frozen until released"
            } else {
                ""
            }
        );
        job.ibq_down = channels.clone();
        job.ibq_restored = 0;
        // Layers drained in an epoch of the old incarnation are gone with it: the restored ones
        // come back released (down), in `channels`.
        job.layer_drained.clear();
        Ok(Restored {
            pid,
            incarnation: job.record.incarnation,
            source,
            note,
            channels: channels.len() as u32,
            fetch_ms: verify_ms,
        })
    }

    /// Restart, second step: lets a part restored with `hold` run (TCP first, then thaw), or
    /// kills it when the restart failed elsewhere.
    #[instrument(skip_all, fields(phase = "release", job = job_id, kill = kill, node = self.node()))]
    pub async fn release(&self, job_id: u64, kill: bool) -> Result<(), AgentError> {
        if !kill {
            self.failpoint(job_id, "release").await?;
        }
        let j = self.get(job_id)?;
        let job = j.lock_owned().await;
        let sandboxed = job.record.sandbox.is_some();
        // Running processes get their network back before they thaw; killed ones after they
        // are gone, so that nothing of theirs leaks out.
        if !kill {
            self.release_tcp(job_id, sandboxed).await;
        }
        let (_job, r) = tokio::task::spawn_blocking(move || {
            let r = if kill {
                job.cgroup.kill_all()
            } else if job.cgroup.exists() {
                job.cgroup.thaw()
            } else {
                Ok(())
            };
            (job, r)
        })
        .await
        .expect("release task");
        if kill {
            self.release_tcp(job_id, sandboxed).await;
            if sandboxed {
                sandbox::remove(&self.netns(job_id)).await;
            }
        }
        r.map_err(|source| AgentError::Cgroup {
            job: job_id,
            source,
        })
    }

    /// Puts the job's files back as they were at checkpoint time, before the engine restores:
    /// the job's own stdout and stderr (in the job directory, which root controls) here, and
    /// everything else, in directories the owner controls, through the put-back helper running
    /// as the owner ([`PutBack`]).
    async fn put_back_files(
        &self,
        job: &NodeJob,
        owner: &Identity,
        m: &NodeManifest,
        node_dir: &Path,
    ) -> Result<(), AgentError> {
        let job_id = job.record.id;
        let own_dir = fs::canonicalize(&job.dir).unwrap_or_else(|_| job.dir.clone());
        // A sandbox saw the job directory at its own path, bound again to this node's at
        // restore: its outputs are put back here.
        let files = m.open_files.iter().cloned().map(|mut f| {
            let p = Path::new(&f.path);
            if p.parent() == Some(Path::new(sandbox::JOB_DIR)) {
                if let Some(name) = p.file_name() {
                    f.path = own_dir.join(name).display().to_string();
                }
            }
            f
        });
        let (ours, theirs): (Vec<OpenFile>, Vec<OpenFile>) =
            files.partition(|f| crate::owner::own_output(Path::new(&f.path), &own_dir).is_some());
        if let Some(pf) = m.preserved.iter().find(|pf| pf.uid != owner.uid) {
            return Err(AgentError::FileRefused {
                job: job_id,
                action: "put back",
                path: pf.path.clone(),
                uid: owner.uid,
                problem: format!(
                    "it belonged to uid {} at checkpoint time, not to the job's owner",
                    pf.uid
                ),
            });
        }
        for f in &ours {
            // As the checkpoint saw it, if the epoch carries it (see `OUTPUTS_DIR`).
            let saved = Path::new(&f.path)
                .file_name()
                .map(|n| node_dir.join(crate::checkpoint::OUTPUTS_DIR).join(n));
            put_back_own_output(job_id, f, owner, saved.as_deref())?;
        }
        if theirs.is_empty() && m.preserved.is_empty() {
            return Ok(());
        }
        let task = PutBackTask {
            put_back: PutBack {
                owner: owner.clone(),
                open_files: theirs,
                preserved: m.preserved.clone(),
                saved_dir: node_dir.to_path_buf(),
            },
        };
        run_put_back(job_id, &self.shim_exe, &task).await
    }
}

/// Lock that serializes restores on one machine. Agents sharing a machine (test hosts, or
/// several agents with their own cgroup prefixes) share `/dev/shm` and `/tmp`, where the engine
/// re-creates deleted files under temporary names derived from the image: two restores at once
/// would collide on them. With one agent per machine the lock is never contended. It lives in
/// a directory of root's alone: in a directory every user may write (`/run/lock`), a user could
/// make the file first and hold the lock, and so hang every restore on the machine.
const RESTORE_LOCK_DIR: &str = "/run/ckpt";
const RESTORE_LOCK: &str = "restore.lock";

/// Checks a restored tree frozen, so that no restored process can act while it is checked
/// (every process the owner's, [`verify_restored`]), then lets it run unless it is `held`
/// for the release; kills it if the check fails.
fn check_restored(job: &NodeJob, owner: &Identity, held: bool) -> Result<(), AgentError> {
    let id = job.record.id;
    let cg = |source| AgentError::Cgroup { job: id, source };
    let checked = job
        .cgroup
        .freeze()
        .map_err(cg)
        .and_then(|()| verify_restored(id, &job.cgroup, owner))
        .and_then(|()| match held {
            true => Ok(()),
            false => job.cgroup.thaw().map_err(cg),
        });
    if checked.is_err() {
        let _ = job.cgroup.kill_all();
    }
    checked
}

/// Makes the run directory of the coming incarnation (as the shim will) and the gate in it.
fn open_gate(job_dir: &Path, run_dir: &Path) -> std::io::Result<gate::Gate> {
    ensure_dir(&job_dir.join("run"), PRIVATE_DIR)?;
    ensure_dir(run_dir, PRIVATE_DIR)?;
    gate::Gate::open(run_dir)
}

/// The outcome of the page data verification.
/// The threads that check page data while the engine restores: half of this machine's CPUs
/// (at least one), so that the engine and the processes it fills keep the rest. None if no
/// pool can be made (the check then uses every CPU).
fn gate_verify_pool() -> Option<rayon::ThreadPool> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    rayon::ThreadPoolBuilder::new()
        .num_threads((cpus / 2).max(1))
        .thread_name(|i| format!("gate-verify-{i}"))
        .build()
        .ok()
}

async fn check_pages(
    job: u64,
    check: tokio::task::JoinHandle<ckpt_store::Result<Duration>>,
) -> Result<Duration, AgentError> {
    check
        .await
        .expect("page verification task")
        .map_err(|source| AgentError::Store { job, source })
}

async fn machine_restore_lock() -> Option<fs::File> {
    tokio::task::spawn_blocking(|| match open_restore_lock(Path::new(RESTORE_LOCK_DIR)) {
        Ok(f) => Some(f),
        Err(e) => {
            warn!(dir = RESTORE_LOCK_DIR, error = %e, "cannot take the machine's restore lock; restoring without it");
            None
        }
    })
    .await
    .ok()
    .flatten()
}

/// Opens and takes the restore lock in `dir`, made root's 0755 if missing; a directory that is
/// not root's or that others may write, and a lock that is not a regular file of root's (a
/// link, a FIFO), are refused.
fn open_restore_lock(dir: &Path) -> std::io::Result<fs::File> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    match fs::DirBuilder::new().mode(0o755).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    ckpt_store::trust::check_root(dir, &ckpt_store::trust::Owners::ROOT)
        .map_err(std::io::Error::other)?;
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(dir.join(RESTORE_LOCK))?;
    let m = f.metadata()?;
    if !m.is_file() || m.uid() != 0 {
        return Err(std::io::Error::other(format!(
            "{} is not a regular file of root's",
            dir.join(RESTORE_LOCK).display()
        )));
    }
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file descriptor we own; released when the file is closed.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(f)
}

async fn wait_pids_free(job: u64, pids: &[i32]) -> Result<(), AgentError> {
    let begin = Instant::now();
    loop {
        let taken: Vec<i32> = pids
            .iter()
            .copied()
            .filter(|&p| procfs::pid_taken(p))
            .collect();
        if taken.is_empty() {
            return Ok(());
        }
        if begin.elapsed() > PID_FREE_TIMEOUT {
            return Err(AgentError::PidsTaken { job, pids: taken });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests;
