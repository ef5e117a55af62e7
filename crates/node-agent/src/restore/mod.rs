//! Restart on this node: restore a part of a job from a committed epoch (the job's files put
//! back as its owner, then the engine's restore), then release or kill it ([`RestartRun`]).
//! The TCP hold is in `part/tcp.rs`.

pub(crate) mod gate;
mod owned;
mod run;

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_store::manifest::{NodeManifest, OpenFile};
use tokio::sync::Mutex;
use tracing::{instrument, warn};

use crate::copies::{Location, Sources};
use crate::error::AgentError;
use crate::jobs::{Jobs, NodeJob};
use crate::node::Node;
use crate::os::host::Host;
use crate::os::modes::{ensure_dir, PRIVATE_DIR};
use crate::os::owner::{
    put_back_own_output, run_put_back, verify_restored, Identity, PutBack, PutBackTask,
};
use crate::os::procfs;
use crate::os::sandbox;
use run::RestoreRun;

/// How long a restore may take: the engine reads every image page back; at a pessimistic
/// 100 MB/s this covers 60 GB per node.
pub const RESTORE_TIMEOUT: Duration = Duration::from_secs(600);
/// What a restore is asked besides its epoch and where the images are.
#[derive(Debug, Clone, Copy, Default)]
pub struct Terms<'a> {
    /// Leave the restored processes frozen and their TCP ports blocked until the release.
    pub hold: bool,
    /// The job's token from this restart on (empty: the one it has).
    pub token: &'a str,
    /// ckptd may restart the part elsewhere by itself: its shim fences it when the node's
    /// lease runs out ([`crate::jobs::JobRecord::may_move`]).
    pub may_move: bool,
}

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

/// A restart's steps of one job's part on this node, the restore and then the release, over
/// the node and the job's entry in the table ([`RestartRun::to_restore`], [`RestartRun::of`]).
pub struct RestartRun<'a> {
    node: &'a Node,
    job_id: u64,
    job: Arc<Mutex<NodeJob>>,
}

impl<'a> RestartRun<'a> {
    /// For the restore of job `job_id`: its entry in `jobs`, made if this node has none (a
    /// part that moves here).
    pub fn to_restore(jobs: &'a Jobs, job_id: u64) -> Result<Self, AgentError> {
        Ok(RestartRun {
            node: &jobs.node,
            job_id,
            job: jobs.get_or_create(job_id)?,
        })
    }

    /// For the release of job `job_id`, which `jobs` must know.
    pub fn of(jobs: &'a Jobs, job_id: u64) -> Result<Self, AgentError> {
        Ok(RestartRun {
            node: &jobs.node,
            job_id,
            job: jobs.get(job_id)?,
        })
    }
}

impl RestartRun<'_> {
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
    #[instrument(skip_all, fields(phase = "restore", job = self.job_id, epoch = epoch, node = self.node.name.as_str()))]
    pub async fn restore(
        &self,
        epoch: u32,
        committed_digest: &str,
        terms: Terms<'_>,
        sources: &Sources,
    ) -> Result<Restored, AgentError> {
        let job_id = self.job_id;
        self.node.failpoint(job_id, "restore").await?;
        let begin = std::time::Instant::now();
        let mut pages_refused = false;
        let gated = self
            .restore_from(
                job_id,
                epoch,
                committed_digest,
                terms,
                sources,
                Some(&mut pages_refused),
            )
            .await;
        let r = match gated {
            Err(error) if pages_refused => {
                // The gate killed the tree before it ran. Verifying everything first may find
                // an intact copy elsewhere, and names what is damaged as always.
                warn!(job = job_id, epoch, %error, "page data refused before any restored process ran; verifying every file first");
                self.restore_from(job_id, epoch, committed_digest, terms, sources, None)
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

    /// One attempt of [`RestartRun::restore`] ([`RestoreRun`]); with `gated`, the local page data is
    /// verified while the engine runs, and a refusal of it is reported there as well as in the
    /// error.
    async fn restore_from(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        terms: Terms<'_>,
        sources: &Sources,
        gated: Option<&mut bool>,
    ) -> Result<Restored, AgentError> {
        let job = self.job.lock().await;
        RestoreRun::new(self.node, job, (job_id, epoch), terms, gated)
            .run(committed_digest, sources)
            .await
    }

    /// Restart, second step: lets a part restored with `hold` run (TCP first, then thaw), or
    /// kills it when the restart failed elsewhere.
    #[instrument(skip_all, fields(phase = "release", job = self.job_id, kill = kill, node = self.node.name.as_str()))]
    pub async fn release(&self, kill: bool) -> Result<(), AgentError> {
        let job_id = self.job_id;
        if !kill {
            self.node.failpoint(job_id, "release").await?;
        }
        let mut job = self.job.clone().lock_owned().await;
        let sandboxed = job.record.sandbox.is_some();
        // Running processes get their network back before they thaw; killed ones after they
        // are gone, so that nothing of theirs leaks out.
        if !kill {
            self.node.release_tcp(job_id, sandboxed).await;
            self.node.unlock_killed_tcp(&mut job).await;
        }
        let host = self.node.host.clone();
        let (_job, r) = tokio::task::spawn_blocking(move || {
            let r = if kill {
                host.kill_all(&job.cgroup)
            } else if host.cgroup_exists(&job.cgroup) {
                host.thaw(&job.cgroup)
            } else {
                Ok(())
            };
            (job, r)
        })
        .await
        .expect("release task");
        if kill {
            self.node.release_tcp(job_id, sandboxed).await;
            if sandboxed {
                sandbox::remove(&self.node.netns(job_id)).await;
            }
        }
        r.map_err(|source| AgentError::Cgroup {
            job: job_id,
            source,
        })
    }
}

impl Node {
    /// The owner recorded at checkpoint time (committed with the manifest; an older epoch
    /// without the note: the job's record), who must still be allowed to run jobs here: the
    /// restored part's files are put back, and it runs, as that user (with `[slurm] enforce`,
    /// only if Slurm gave that user this node). Recorded with the job.
    pub(super) async fn restored_owner(
        &self,
        job: &mut NodeJob,
        m: &NodeManifest,
        epoch: u32,
    ) -> Result<Identity, AgentError> {
        let job_id = job.record.id;
        let uid = crate::part::notes::PartNotes::read(&m.notes)
            .owner
            .or(job.record.owner)
            .ok_or_else(|| AgentError::OwnerUnknown {
                job: job_id,
                epoch,
                node: self.name.clone(),
            })?;
        let owner = self.policy.authorize(job_id, &self.name, uid)?;
        let place = self.slurm.place(job_id, &self.name, owner.uid).await?;
        self.step_free(job_id, owner.uid, place.as_ref())?;
        job.settle_cgroup(&self.cgroups, place.as_ref());
        job.record.owner = Some(owner.uid);
        Ok(owner)
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
        let (ours, theirs): (Vec<OpenFile>, Vec<OpenFile>) = files
            .partition(|f| crate::os::owner::own_output(Path::new(&f.path), &own_dir).is_some());
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
                .map(|n| node_dir.join(crate::part::OUTPUTS_DIR).join(n));
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

/// Locks that serialize the restores of one job on a machine. Agents sharing a machine (test
/// hosts, or several agents with their own cgroup prefixes) share `/dev/shm` and `/tmp`, where
/// the engine re-creates deleted files under temporary names derived from the image: two parts
/// of one job restored there at once would collide on them. Other jobs' restores do not wait:
/// one lock a machine let one job's hung restore (up to [`RESTORE_TIMEOUT`]) hold every other
/// restore of the node. A job takes lock `job % RESTORE_LOCK_SLOTS`, so the files are few. They
/// live in a directory of root's alone: in a directory every user may write (`/run/lock`), a
/// user could make a file first and hold the lock, and so hang restores on the machine.
const RESTORE_LOCK_DIR: &str = "/run/ckpt";
/// How many restore locks a machine has (see [`RESTORE_LOCK_DIR`]).
const RESTORE_LOCK_SLOTS: u64 = 64;

/// The name of job `job`'s restore lock in [`RESTORE_LOCK_DIR`].
fn restore_lock_name(job: u64) -> String {
    format!("restore-{}.lock", job % RESTORE_LOCK_SLOTS)
}

/// Checks a restored tree frozen, so that no restored process can act while it is checked
/// (every process the owner's, [`verify_restored`]), then lets it run unless it is `held`
/// for the release; kills it if the check fails.
fn check_restored(
    host: &dyn Host,
    job: &NodeJob,
    owner: &Identity,
    held: bool,
) -> Result<(), AgentError> {
    let id = job.record.id;
    let cg = |source| AgentError::Cgroup { job: id, source };
    let checked = host
        .freeze(&job.cgroup)
        .map_err(cg)
        .and_then(|()| verify_restored(id, (host, &job.cgroup), owner))
        .and_then(|()| match held {
            true => Ok(()),
            false => host.thaw(&job.cgroup).map_err(cg),
        });
    if checked.is_err() {
        let _ = host.kill_all(&job.cgroup);
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

async fn machine_restore_lock(job: u64) -> Option<fs::File> {
    tokio::task::spawn_blocking(move || match open_restore_lock(Path::new(RESTORE_LOCK_DIR), job) {
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

/// Opens and takes job `job`'s restore lock in `dir`, made root's 0755 if missing; a directory
/// that is not root's or that others may write, and a lock that is not a regular file of root's
/// (a link, a FIFO), are refused.
fn open_restore_lock(dir: &Path, job: u64) -> std::io::Result<fs::File> {
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
        .open(dir.join(restore_lock_name(job)))?;
    let m = f.metadata()?;
    if !m.is_file() || m.uid() != 0 {
        return Err(std::io::Error::other(format!(
            "{} is not a regular file of root's",
            dir.join(restore_lock_name(job)).display()
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
mod step_tests;
#[cfg(test)]
mod tests;
