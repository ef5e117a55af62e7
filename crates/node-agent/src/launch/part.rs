//! One job's part on this node between checkpoints ([`PartRun`]): its new output and end for
//! `ckpt-rsh` (poll), its token, its signals (a SIGKILL waits for the processes to be gone) and
//! a look at it for `ckptctl status`.

use std::fs;
use std::time::Duration;

use crate::error::{io_err, AgentError};
use crate::jobs::{JobRef, Jobs, Observed};
use crate::os::cgroup::Freezer;
use crate::os::procfs;

/// How long a SIGKILL sent through [`PartRun::signal`] waits for the part's processes to be gone.
pub const KILL_WAIT: Duration = Duration::from_secs(5);

/// A part's new output and state, for `ckpt-rsh`.
#[derive(Debug, Clone)]
pub struct PollResult {
    /// Output after the stdout offset.
    pub stdout: Vec<u8>,
    /// Output after the stderr offset.
    pub stderr: Vec<u8>,
    /// The part's state; an exit is only reported with the last of its output.
    pub observed: Observed,
}

/// Largest chunk of each stream one poll returns.
const POLL_CHUNK: u64 = 1 << 20;

/// One job's part on this node between checkpoints: its output, its token, its signals, a
/// look at it; over the node, the job's entry and its dump's stop (a SIGKILL stops a dump).
pub struct PartRun<'a>(JobRef<'a>);

impl<'a> std::ops::Deref for PartRun<'a> {
    type Target = JobRef<'a>;
    fn deref(&self) -> &JobRef<'a> {
        &self.0
    }
}

impl<'a> PartRun<'a> {
    /// The part of job `job_id` in the table `jobs`.
    pub fn of(jobs: &'a Jobs, job_id: u64) -> Self {
        PartRun(jobs.job_ref(job_id))
    }

    /// Whether the freezer holds `cgroup`'s processes.
    fn frozen(&self, cgroup: &crate::os::cgroup::JobCgroup) -> bool {
        self.node
            .host
            .freezer_state(cgroup)
            .is_ok_and(|s| s == Freezer::Frozen)
    }
}

impl PartRun<'_> {
    /// New output of the job's part on this node after the given offsets, and its exit status
    /// once all output has been returned. Never waits for a phase in progress.
    pub async fn poll(
        &self,
        token: &str,
        stdout_offset: u64,
        stderr_offset: u64,
    ) -> Result<PollResult, AgentError> {
        let job_id = self.job_id;
        // An unknown job is answered as a wrong token: no one learns which jobs exist here.
        let j = self
            .job
            .clone()
            .ok_or(AgentError::BadToken { job: job_id })?;
        let Ok(job) = j.try_lock() else {
            return Ok(PollResult {
                stdout: Vec::new(),
                stderr: Vec::new(),
                observed: Observed::Running,
            });
        };
        if !ckpt_auth::token_eq(&job.record.token, token) {
            return Err(AgentError::BadToken { job: job_id });
        }
        let observed = job.observe(self.node.host.as_ref());
        let read = |name: &str, offset: u64| -> Result<(Vec<u8>, bool), AgentError> {
            use std::io::{Read, Seek, SeekFrom};
            let path = job.dir.join(name);
            let mut f = match fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((vec![], true)),
                Err(e) => return Err(io_err(job_id, "read", &path)(e)),
            };
            let mut buf = Vec::new();
            f.seek(SeekFrom::Start(offset))
                .and_then(|_| f.take(POLL_CHUNK).read_to_end(&mut buf))
                .map_err(io_err(job_id, "read", &path))?;
            let done = (buf.len() as u64) < POLL_CHUNK;
            Ok((buf, done))
        };
        let (stdout, out_done) = read("stdout", stdout_offset)?;
        let (stderr, err_done) = read("stderr", stderr_offset)?;
        let observed = if out_done && err_done {
            observed
        } else {
            Observed::Running
        };
        Ok(PollResult {
            stdout,
            stderr,
            observed,
        })
    }

    /// Whether `token` is the job's (constant time; an empty token never is).
    pub async fn check_token(&self, token: &str) -> Result<(), AgentError> {
        let job_id = self.job_id;
        // An unknown job is answered as a wrong token (see `poll`).
        let j = self
            .job
            .clone()
            .ok_or(AgentError::BadToken { job: job_id })?;
        let job = j.lock().await;
        if ckpt_auth::token_eq(&job.record.token, token) {
            Ok(())
        } else {
            Err(AgentError::BadToken { job: job_id })
        }
    }

    /// Sends a signal to every process of the job on this node. A SIGKILL (a cancel, the rest
    /// of a job after its launcher, a fence) returns once the part's processes are gone, or
    /// after [`KILL_WAIT`]: whoever sent it counts on them being gone, not on their way out.
    pub async fn signal(&self, sig: i32) -> Result<usize, AgentError> {
        let job_id = self.job_id;
        let j = self.entry()?;
        // A job told to end (a cancel, a fence, its launcher gone) is not kept waiting by its
        // dump, which holds the job: the dump is stopped, its epoch fails and is aborted.
        if matches!(sig, libc::SIGTERM | libc::SIGKILL) && self.stop.stop(None) {
            tracing::warn!(
                job = job_id,
                sig,
                "a dump was running: stopped, so that the signal reaches the job now"
            );
        }
        let job = j.lock().await;
        let cgroup_err = |source| AgentError::Cgroup {
            job: job_id,
            source,
        };
        let sent = job.cgroup.signal_all(sig).map_err(cgroup_err)?;
        if sig != libc::SIGKILL {
            return Ok(sent);
        }
        // A frozen process takes its SIGKILL only once thawed.
        if job.cgroup.state().is_ok_and(|s| s != Freezer::Thawed) {
            job.cgroup.thaw().map_err(cgroup_err)?;
        }
        let begin = std::time::Instant::now();
        let mut left = job.cgroup.pids().unwrap_or_default();
        for round in 1.. {
            if left.is_empty() || begin.elapsed() >= KILL_WAIT {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            if round % 10 == 0 {
                // Any forked since the last signal (cgroup v1 signals PID by PID).
                let _ = job.cgroup.signal_all(sig);
            }
            left = job.cgroup.pids().unwrap_or_default();
        }
        if !left.is_empty() {
            tracing::warn!(job = job_id, ?left, waited = ?KILL_WAIT, "SIGKILLed processes are still there (in uninterruptible sleep?)");
        }
        Ok(sent)
    }

    /// What this node has of the job: its state, its processes (each with its MPI rank if it
    /// is one), which part of the job this node runs and how its checkpoints are taken.
    pub async fn part_view(&self) -> Result<PartView, AgentError> {
        let job_id = self.job_id;
        let j = self.entry()?;
        let Ok(job) = tokio::time::timeout(VIEW_LOCK_WAIT, j.lock()).await else {
            // A phase or a restore holds the part (a dump may take minutes): what its cgroup
            // shows now, without the record.
            let cgroup = self.node.cgroups.job(job_id);
            return Ok(PartView {
                observed: Observed::Running,
                part: 0,
                frozen: self.frozen(&cgroup),
                processes: processes_of(self.node.host.as_ref(), &cgroup),
                snapshot_mode: String::new(),
                busy: true,
            });
        };
        let observed = job.observe(self.node.host.as_ref());
        Ok(PartView {
            frozen: observed == Observed::Running && self.frozen(&job.cgroup),
            observed,
            part: job.record.part,
            processes: processes_of(self.node.host.as_ref(), &job.cgroup),
            snapshot_mode: self.node.precopy_text(&job),
            busy: false,
        })
    }
}

/// How long a look at a part ([`PartRun::part_view`]) waits for its lock before it answers with
/// what the part's cgroup shows.
const VIEW_LOCK_WAIT: Duration = Duration::from_secs(1);

/// The processes in `cgroup`, with their MPI ranks.
fn processes_of(
    host: &dyn crate::os::host::Host,
    cgroup: &crate::os::cgroup::JobCgroup,
) -> Vec<(procfs::ProcStat, Option<i32>)> {
    host.pids(cgroup)
        .unwrap_or_default()
        .into_iter()
        .filter_map(procfs::stat)
        .map(|s| {
            let rank = procfs::mpi_rank(s.pid);
            (s, rank)
        })
        .collect()
}

/// A job's part on this node, as [`PartRun::part_view`] sees it.
#[derive(Debug)]
pub struct PartView {
    /// Its state.
    pub observed: Observed,
    /// Its processes are frozen (a checkpoint, a held restore, or one left so).
    pub frozen: bool,
    /// A phase or a restore held the part's lock: `part` and `snapshot_mode` are not known.
    pub busy: bool,
    /// Which part (0: the job's command).
    pub part: u32,
    /// Its processes and their MPI ranks.
    pub processes: Vec<(procfs::ProcStat, Option<i32>)>,
    /// How its checkpoints are taken here, in words.
    pub snapshot_mode: String,
}
