//! The agent's side of ib-quiesce: a Unix socket where every job process that opened an
//! ib-quiesce channel says hello, and the calls that drive those channels around a checkpoint
//! (see `ib_quiesce::control` for the protocol).
//!
//! Quiesce asks every channel of the job's processes at once (their flush handshakes need each
//! other), then waits for each to close its connection, so the snapshot holds none. Rebuild
//! raises each channel's flag, waits for its hello, has it recreate its objects and returns
//! their endpoints; reconnect hands every endpoint of the job (gathered by the coordinator
//! from all nodes) to each channel.
//!
//! Who may connect: the socket is open to every local user (job processes run as their users),
//! so each connection is identified when it is accepted, before anything is read from it. The
//! credentials the kernel recorded at `connect` (`SO_PEERCRED`: pid, uid, gid) place the process
//! in a job: its cgroup (from `/proc/<pid>/cgroup`, read once) must be a job's cgroup, and its
//! uid that job's owner ([`authorize`]; [`JobLookup`] is how the job table answers). Others are
//! refused with a warning naming pid, uid and why. Lines are capped ([`MAX_LINE`]), and so are
//! the connections of one job ([`MAX_CONNS_PER_JOB`]) and those not yet identified
//! ([`MAX_UNIDENTIFIED`]).
use std::collections::HashMap;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use ib_quiesce::channel::QpId;
use ib_quiesce::control::{
    excerpt, flag_dir, flag_path, LineBuf, LineTooLong, ToAgent, ToChannel, MAX_LINE,
};
use ib_quiesce::{Endpoint, QuiesceReport};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};
use tracing::{info, warn};

/// How long a new connection has to say hello.
const HELLO: Duration = Duration::from_secs(5);

/// How many connections one job may hold at once (registered, or identified and saying
/// hello). A job process holds one, its channel's; one job has at most a few hundred ranks on
/// a node (one per core), and a rank that rebuilds briefly holds a second while the agent drops
/// its first. 1024 covers 512 ranks with that margin, and bounds what a job's processes, which
/// can fork at will, make the agent keep.
pub const MAX_CONNS_PER_JOB: usize = 1024;

/// How many connections may be open at once before they are identified and have said hello
/// (each for at most [`HELLO`]). After a checkpoint every rank of the node says hello at once;
/// 256 takes a full node's ranks in one go, and a channel refused for this tries again shortly.
pub const MAX_UNIDENTIFIED: usize = 256;

/// A job as the control socket needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobOwner {
    /// Job id.
    pub job: u64,
    /// The user the job's processes run as.
    pub uid: u32,
}

/// How [`Channels`] learns the node's jobs. The job table injects one at construction; a
/// closure `Fn(&Path) -> Option<JobOwner>` is one.
pub trait JobLookup: Send + Sync {
    /// The job whose cgroup is the directory `cgroup` (an absolute path, compared with the
    /// job's `JobCgroup::path`), if this node has one.
    fn job_in(&self, cgroup: &Path) -> Option<JobOwner>;
}

impl<F: Fn(&Path) -> Option<JobOwner> + Send + Sync> JobLookup for F {
    fn job_in(&self, cgroup: &Path) -> Option<JobOwner> {
        self(cgroup)
    }
}

/// Where a connecting process sits in the cgroup hierarchies: the OS side of [`authorize`].
/// [`ProcCgroups`] is the real one; a closure `Fn(i32) -> io::Result<Vec<PathBuf>>` is one.
pub trait PeerCgroups: Send + Sync {
    /// The cgroup directories (absolute paths) process `pid` is in.
    fn cgroups_of(&self, pid: i32) -> std::io::Result<Vec<PathBuf>>;
}

impl<F: Fn(i32) -> std::io::Result<Vec<PathBuf>> + Send + Sync> PeerCgroups for F {
    fn cgroups_of(&self, pid: i32) -> std::io::Result<Vec<PathBuf>> {
        self(pid)
    }
}

/// Reads `/proc/<pid>/cgroup` and places each entry under its hierarchy's mount point, from
/// this process's `/proc/self/mountinfo`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcCgroups;

impl PeerCgroups for ProcCgroups {
    fn cgroups_of(&self, pid: i32) -> std::io::Result<Vec<PathBuf>> {
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
        Ok(cgroup_dirs(&cgroups, &mounts))
    }
}

/// The directories of the cgroups listed in `proc_cgroup` (the text of a `/proc/<pid>/cgroup`),
/// under the cgroup mounts listed in `mountinfo` (of the reader's mount namespace). A v2 entry
/// (`0::/path`) goes under each `cgroup2` mount, a v1 entry (`N:freezer:/path`) under each
/// `cgroup` mount whose options name all its controllers. Entries outside a mount's root are
/// skipped.
pub fn cgroup_dirs(proc_cgroup: &str, mountinfo: &str) -> Vec<PathBuf> {
    struct Mount<'a> {
        root: &'a str,
        at: &'a str,
        v2: bool,
        options: Vec<&'a str>,
    }
    let mounts: Vec<Mount> = mountinfo
        .lines()
        .filter_map(|l| {
            let (head, tail) = l.split_once(" - ")?;
            let head: Vec<&str> = head.split(' ').collect();
            let mut tail = tail.split(' ');
            let (fstype, _source, options) = (tail.next()?, tail.next()?, tail.next()?);
            let v2 = match fstype {
                "cgroup2" => true,
                "cgroup" => false,
                _ => return None,
            };
            Some(Mount {
                root: head.get(3)?,
                at: head.get(4)?,
                v2,
                options: options.split(',').collect(),
            })
        })
        .collect();
    let mut dirs = Vec::new();
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let v2 = id == "0" && controllers.is_empty();
        for m in &mounts {
            let fits = if v2 {
                m.v2
            } else {
                !m.v2
                    && !controllers.is_empty()
                    && controllers.split(',').all(|c| m.options.contains(&c))
            };
            let Ok(rel) = Path::new(path).strip_prefix(m.root) else {
                continue;
            };
            if fits && !rel.components().any(|c| c.as_os_str() == "..") {
                let dir = Path::new(m.at).join(rel);
                if !dirs.contains(&dir) {
                    dirs.push(dir);
                }
            }
        }
    }
    dirs
}

/// Who connected: the credentials the kernel recorded when the process called `connect`
/// (`SO_PEERCRED`), so a process cannot change them afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Process id.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// Why a connection to the control socket was refused (and closed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The process is in no job's cgroup.
    #[error("pid {} (uid {}) is in no job's cgroup (its cgroups: {cgroups})", peer.pid, peer.uid)]
    NotInJob {
        /// Who connected.
        peer: Peer,
        /// Its cgroup directories.
        cgroups: String,
    },
    /// The process's cgroups could not be read (it may have exited).
    #[error("cannot read the cgroups of pid {} (uid {}): {error}", peer.pid, peer.uid)]
    Cgroups {
        /// Who connected.
        peer: Peer,
        /// Why.
        error: String,
    },
    /// The process is in a job's cgroup but runs as another user than the job's.
    #[error("pid {} runs as uid {}, but job {job} belongs to uid {owner}", peer.pid, peer.uid)]
    NotOwner {
        /// Who connected.
        peer: Peer,
        /// The job whose cgroup holds it.
        job: u64,
        /// The job's user.
        owner: u32,
    },
    /// The job holds its maximum of connections.
    #[error("pid {} (uid {}) of job {job}: the job already holds {limit} connections", peer.pid, peer.uid)]
    JobFull {
        /// Who connected.
        peer: Peer,
        /// Its job.
        job: u64,
        /// The bound.
        limit: usize,
    },
    /// Too many connections are waiting to be identified.
    #[error("pid {} (uid {}): {limit} connections are already waiting to be identified", peer.pid, peer.uid)]
    Busy {
        /// Who connected.
        peer: Peer,
        /// The bound.
        limit: usize,
    },
}

/// Whether `peer`, whose cgroup directories are `cgroups`, may talk to the agent: one of them
/// must be a job's cgroup, and the peer's uid that job's owner. Returns the job.
pub fn authorize(
    peer: Peer,
    cgroups: &[PathBuf],
    jobs: &dyn JobLookup,
) -> Result<JobOwner, Refused> {
    let Some(owner) = cgroups.iter().find_map(|c| jobs.job_in(c)) else {
        return Err(Refused::NotInJob {
            peer,
            cgroups: format!("{cgroups:?}"),
        });
    };
    if owner.uid != peer.uid {
        return Err(Refused::NotOwner {
            peer,
            job: owner.job,
            owner: owner.uid,
        });
    }
    Ok(owner)
}

/// The connection bounds of a [`Channels`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections one job may hold ([`MAX_CONNS_PER_JOB`]).
    pub per_job: usize,
    /// Connections not yet identified ([`MAX_UNIDENTIFIED`]).
    pub unidentified: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            per_job: MAX_CONNS_PER_JOB,
            unidentified: MAX_UNIDENTIFIED,
        }
    }
}

/// How many connections each job holds.
#[derive(Debug, Default)]
struct JobSlots(std::sync::Mutex<HashMap<u64, usize>>);

/// One connection's place in its job's count; given back on drop.
#[derive(Debug)]
struct JobSlot {
    job: u64,
    slots: Arc<JobSlots>,
}

impl JobSlots {
    fn take(self: &Arc<Self>, job: u64, limit: usize) -> Option<JobSlot> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(job).or_default();
        if *n >= limit {
            return None;
        }
        *n += 1;
        Some(JobSlot {
            job,
            slots: self.clone(),
        })
    }

    #[cfg(test)]
    fn held(&self, job: u64) -> usize {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.get(&job).copied().unwrap_or(0)
    }
}

impl Drop for JobSlot {
    fn drop(&mut self) {
        let mut m = self.slots.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.job) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.job);
            }
        }
    }
}

/// A read that ended a connection's line protocol.
#[derive(Debug)]
enum LineError {
    TooLong(LineTooLong),
    Io(std::io::Error),
}

/// Lines of at most a cap. Cancel-safe: a line's part read so far stays in `part`, so a read
/// that timed out can be tried again.
struct CappedLines<R> {
    reader: R,
    part: LineBuf,
}

impl<R: AsyncBufRead + Unpin> CappedLines<R> {
    fn new(reader: R) -> Self {
        CappedLines {
            reader,
            part: LineBuf::default(),
        }
    }

    /// The next line, without its newline; `None` at the end of the stream (an unterminated
    /// last line is dropped).
    async fn next_line(&mut self, cap: usize) -> Result<Option<Vec<u8>>, LineError> {
        loop {
            let avail = self.reader.fill_buf().await.map_err(LineError::Io)?;
            if avail.is_empty() {
                return Ok(None);
            }
            let (used, line) = self.part.feed(avail, cap).map_err(LineError::TooLong)?;
            self.reader.consume(used);
            if line.is_some() {
                return Ok(line);
            }
        }
    }
}

/// What a node's channels published after a rebuild: their new endpoints, and the peer QPs
/// whose endpoints they need back (None: a channel did not say; it gets all of the job's).
pub type Rebuilt = (Vec<Endpoint>, Option<Vec<QpId>>);

struct Conn {
    pid: i32,
    channel: u64,
    down: bool,
    /// After a rebuild, the peer QPs whose endpoints the channel needs (None: all).
    wants: Option<Vec<QpId>>,
    /// None once the agent closed the connection (the channel sent a line over the cap).
    io: Option<(CappedLines<BufReader<OwnedReadHalf>>, OwnedWriteHalf)>,
    /// The connection's place in its job's count.
    _slot: JobSlot,
}

/// What a call on a connection the agent closed gets.
const CLOSED: &str = "the agent closed the connection after an over-long line";

impl Conn {
    async fn ask(&mut self, cmd: &ToChannel, timeout: Duration) -> Result<ToAgent, String> {
        let mut line = serde_json::to_vec(cmd).expect("serializable");
        line.push(b'\n');
        let (_, writer) = self.io.as_mut().ok_or(CLOSED)?;
        writer
            .write_all(&line)
            .await
            .map_err(|e| format!("cannot reach the channel: {e}"))?;
        self.reply(timeout, cmd.answer_cap()).await
    }

    /// The next message, of at most `cap` bytes; a channel's `failed` answer is an error. A
    /// longer line closes the connection.
    async fn reply(&mut self, timeout: Duration, cap: usize) -> Result<ToAgent, String> {
        let (lines, _) = self.io.as_mut().ok_or(CLOSED)?;
        match tokio::time::timeout(timeout, lines.next_line(cap)).await {
            Err(_) => Err(format!("no answer within {timeout:?}")),
            Ok(Err(LineError::TooLong(e))) => {
                warn!(
                    pid = self.pid,
                    cap = e.cap,
                    "ib-quiesce channel sent a line over the cap; connection closed"
                );
                self.io = None;
                Err(format!(
                    "its answer is longer than the {}-byte cap; the agent closed the connection",
                    e.cap
                ))
            }
            Ok(Err(LineError::Io(e))) => Err(format!("connection failed: {e}")),
            Ok(Ok(None)) => Err("the process closed its channel (did it exit?)".into()),
            Ok(Ok(Some(l))) => {
                match ToAgent::decode(&l).map_err(|e| format!("unreadable answer: {e}"))? {
                    ToAgent::Failed { error } => Err(error),
                    m => Ok(m),
                }
            }
        }
    }
}

fn unexpected(m: ToAgent) -> String {
    format!("unexpected answer {m:?}")
}

/// A channel that failed a call: which process, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelFailure {
    /// The process.
    pub pid: i32,
    /// What went wrong.
    pub message: String,
}

/// What a quiesce did on this node.
#[derive(Debug, Clone, Default)]
pub struct Quiesced {
    /// Processes whose channels are now down.
    pub pids: Vec<i32>,
    /// Summed over the channels.
    pub report: QuiesceReport,
    /// The slowest channel's time.
    pub slowest: Duration,
}

/// The channels of this node's job processes, by pid.
pub struct Channels {
    socket: PathBuf,
    conns: Mutex<HashMap<i32, Arc<Mutex<Conn>>>>,
    jobs: Box<dyn JobLookup>,
    cgroups: Box<dyn PeerCgroups>,
    limits: Limits,
    /// Permits for connections not yet identified and registered.
    unidentified: Arc<Semaphore>,
    slots: Arc<JobSlots>,
}

impl std::fmt::Debug for Channels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channels")
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

impl Channels {
    /// The registry for the control socket at `socket` (not yet listening), admitting the
    /// processes of the jobs `jobs` knows ([`authorize`]).
    pub fn new(socket: PathBuf, jobs: impl JobLookup + 'static) -> Arc<Self> {
        Self::with_parts(socket, jobs, ProcCgroups, Limits::default())
    }

    /// [`Channels::new`] with the cgroups of connecting processes read by `cgroups`, and
    /// `limits` on connections.
    pub fn with_parts(
        socket: PathBuf,
        jobs: impl JobLookup + 'static,
        cgroups: impl PeerCgroups + 'static,
        limits: Limits,
    ) -> Arc<Self> {
        Arc::new(Channels {
            socket,
            conns: Mutex::new(HashMap::new()),
            jobs: Box::new(jobs),
            cgroups: Box::new(cgroups),
            limits,
            unidentified: Arc::new(Semaphore::new(limits.unidentified)),
            slots: Arc::default(),
        })
    }

    /// The control socket's path (what job processes find in `CKPT_IBQ_SOCKET`).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Binds the control socket (replacing a stale one).
    ///
    /// The socket is `0666`: job processes run as their users, and which of them may talk to
    /// the agent is decided per connection ([`authorize`]). Its directory is what must stay
    /// closed to them: whoever can write `ibq/` can put a socket of their own in its place,
    /// receive the channels of other users' jobs and hand them endpoints (their memory keys
    /// then reach the impostor), and whoever can write `ibq/ibq-rebuild/` can raise rebuild
    /// flags. So both directories are made the agent's (its euid and egid) with mode `0755`, a
    /// symlink or file in their place is refused, and so is a parent (`state_dir`) that other
    /// users can write without the sticky bit (they could rename `ibq/` away).
    pub fn bind(&self) -> std::io::Result<UnixListener> {
        let dir = self.socket.parent().unwrap_or(Path::new("/"));
        let flags = flag_dir(&self.socket);
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            check_parent(parent)?;
        }
        for d in [dir, flags.as_path()] {
            own_dir(d)?;
        }
        // Flags of an earlier agent are stale: their channels reconnect when raised again.
        for e in std::fs::read_dir(&flags)?.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        let _ = std::fs::remove_file(&self.socket);
        let l = UnixListener::bind(&self.socket)?;
        std::fs::set_permissions(&self.socket, std::fs::Permissions::from_mode(0o666))?;
        Ok(l)
    }

    /// Accepts channels until the task is dropped.
    pub async fn serve(self: Arc<Self>, listener: UnixListener) {
        info!(socket = %self.socket.display(), "ib-quiesce control socket listening");
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    warn!(error = %e, "ib-quiesce control socket accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let me = self.clone();
            tokio::spawn(async move { me.admit(stream).await });
        }
    }

    /// Identifies a new connection and takes its hello; a refusal closes it with a warning.
    async fn admit(&self, stream: UnixStream) {
        let peer = match stream.peer_cred() {
            Ok(c) => match c.pid() {
                Some(pid) => Peer {
                    pid,
                    uid: c.uid(),
                    gid: c.gid(),
                },
                None => {
                    warn!(
                        uid = c.uid(),
                        "ib-quiesce connection refused: the kernel gave no peer pid"
                    );
                    return;
                }
            },
            Err(e) => {
                warn!(error = %e, "ib-quiesce connection refused: no peer credentials");
                return;
            }
        };
        let (_permit, owner, slot) = match self.identify(peer).await {
            Ok(admitted) => admitted,
            Err(why) => {
                warn!(
                    pid = peer.pid,
                    uid = peer.uid,
                    gid = peer.gid,
                    reason = %why,
                    "ib-quiesce connection refused"
                );
                return;
            }
        };
        if let Err(e) = self.hello(stream, peer.pid, owner.job, slot).await {
            warn!(
                pid = peer.pid,
                uid = peer.uid,
                job = owner.job,
                reason = %e,
                "ib-quiesce channel refused"
            );
        }
    }

    /// Ties `peer` to its job ([`authorize`]) and takes a place in the job's connections and
    /// among those not yet registered (held until the hello is in).
    async fn identify(
        &self,
        peer: Peer,
    ) -> Result<(OwnedSemaphorePermit, JobOwner, JobSlot), Refused> {
        let permit = self
            .unidentified
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refused::Busy {
                peer,
                limit: self.limits.unidentified,
            })?;
        let cgroups = self
            .cgroups
            .cgroups_of(peer.pid)
            .map_err(|e| Refused::Cgroups {
                peer,
                error: e.to_string(),
            })?;
        let owner = authorize(peer, &cgroups, self.jobs.as_ref())?;
        let full = || Refused::JobFull {
            peer,
            job: owner.job,
            limit: self.limits.per_job,
        };
        let slot = match self.slots.take(owner.job, self.limits.per_job) {
            Some(s) => s,
            None => {
                // Channels of processes that exited hold places until dropped.
                self.conns
                    .lock()
                    .await
                    .retain(|&pid, _| crate::procfs::pid_taken(pid));
                self.slots
                    .take(owner.job, self.limits.per_job)
                    .ok_or_else(full)?
            }
        };
        Ok((permit, owner, slot))
    }

    async fn hello(
        &self,
        stream: UnixStream,
        pid: i32,
        job: u64,
        slot: JobSlot,
    ) -> Result<(), String> {
        let (r, writer) = stream.into_split();
        let mut lines = CappedLines::new(BufReader::new(r));
        let first = match tokio::time::timeout(HELLO, lines.next_line(MAX_LINE)).await {
            Err(_) => return Err(format!("pid {pid} said nothing within {HELLO:?}")),
            Ok(Err(LineError::TooLong(e))) => {
                return Err(format!(
                    "pid {pid} sent a line longer than the {}-byte cap; connection closed",
                    e.cap
                ))
            }
            Ok(Err(LineError::Io(e))) => return Err(format!("pid {pid}: {e}")),
            Ok(Ok(None)) => return Err(format!("pid {pid} closed without a hello")),
            Ok(Ok(Some(l))) => l,
        };
        let ToAgent::Hello {
            pid: claimed,
            channel,
            down,
            qps,
            mrs,
        } = ToAgent::decode(&first).map_err(|e| format!("pid {pid}: {e}"))?
        else {
            return Err(format!(
                "pid {pid}: first message is not a hello: {}",
                excerpt(&first)
            ));
        };
        if claimed != pid {
            return Err(format!("pid {pid} claims to be pid {claimed}"));
        }
        if down {
            let _ = std::fs::remove_file(flag_path(&self.socket, pid));
        }
        info!(
            pid,
            job,
            channel = format_args!("{channel:#x}"),
            down,
            qps,
            mrs,
            "ib-quiesce channel registered"
        );
        let conn = Conn {
            pid,
            channel,
            down,
            wants: None,
            io: Some((lines, writer)),
            _slot: slot,
        };
        self.conns
            .lock()
            .await
            .insert(pid, Arc::new(Mutex::new(conn)));
        Ok(())
    }

    /// Which of `pids` have a channel that is up.
    pub async fn up(&self, pids: &[i32]) -> Vec<i32> {
        let conns = self.conns.lock().await;
        let mut up = Vec::new();
        for p in pids {
            if let Some(c) = conns.get(p) {
                if !c.lock().await.down {
                    up.push(*p);
                }
            }
        }
        up
    }

    async fn take(&self, pid: i32) -> Option<Arc<Mutex<Conn>>> {
        self.conns.lock().await.remove(&pid)
    }

    /// Quiesces the channels of `pids`, all at once. Channels that quiesced stay down even when
    /// others failed (a rebuild brings them back).
    pub async fn quiesce(
        &self,
        pids: &[i32],
        timeout: Duration,
    ) -> (Quiesced, Vec<ChannelFailure>) {
        let calls = pids.iter().map(|&pid| async move {
            let Some(conn) = self.conns.lock().await.get(&pid).cloned() else {
                return (pid, Err("no channel".to_string()));
            };
            let mut c = conn.lock().await;
            let wait = timeout + Duration::from_secs(5);
            let r = match c
                .ask(
                    &ToChannel::Quiesce {
                        timeout_ms: timeout.as_millis() as u64,
                    },
                    wait,
                )
                .await
            {
                Ok(ToAgent::Quiesced { report, micros }) => {
                    // The channel closes its socket next; a snapshot must not hold it.
                    match c.reply(wait, MAX_LINE).await {
                        Err(e) if e.contains("closed its channel") => {
                            c.down = true;
                            Ok((report, Duration::from_micros(micros)))
                        }
                        Err(e) => Err(format!("quiesced but did not disconnect: {e}")),
                        Ok(m) => Err(format!("quiesced but then said {m:?}")),
                    }
                }
                Ok(other) => Err(unexpected(other)),
                Err(e) => Err(e),
            };
            (pid, r)
        });
        let mut done = Quiesced::default();
        let mut failed = Vec::new();
        for (pid, r) in join_all(calls).await {
            match r {
                Ok((rep, took)) => {
                    self.take(pid).await;
                    done.pids.push(pid);
                    done.report.flushed_qps += rep.flushed_qps;
                    done.report.kept_receives += rep.kept_receives;
                    done.report.held_completions += rep.held_completions;
                    done.slowest = done.slowest.max(took);
                }
                Err(message) => failed.push(ChannelFailure { pid, message }),
            }
        }
        (done, failed)
    }

    /// Raises the rebuild flags of `pids`, waits for their channels' hellos (until `deadline`),
    /// and has each recreate its objects. Returns every new endpoint, and the peer QPs whose
    /// endpoints the channels need to reconnect (None: a channel did not say, send all).
    pub async fn rebuild(
        &self,
        pids: &[i32],
        deadline: Duration,
    ) -> Result<Rebuilt, ChannelFailure> {
        let begin = Instant::now();
        for &pid in pids {
            let flag = flag_path(&self.socket, pid);
            std::fs::write(&flag, b"").map_err(|e| ChannelFailure {
                pid,
                message: format!("cannot raise the rebuild flag {}: {e}", flag.display()),
            })?;
        }
        let mut endpoints = Vec::new();
        let mut waiting: Vec<i32> = pids.to_vec();
        let mut conns = Vec::new();
        while !waiting.is_empty() {
            {
                let map = self.conns.lock().await;
                // Only a hello from the quiesced (or restored) process counts: an entry that is
                // up belongs to a connection from before (e.g. of a killed incarnation).
                waiting.retain(|p| match map.get(p) {
                    Some(c) if c.try_lock().is_ok_and(|c| c.down) => {
                        conns.push((*p, c.clone()));
                        false
                    }
                    _ => true,
                });
            }
            if waiting.is_empty() {
                break;
            }
            if begin.elapsed() > deadline {
                return Err(ChannelFailure {
                    pid: waiting[0],
                    message: format!(
                        "its channel did not come back within {deadline:?} (is the process alive?)"
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let left = deadline
            .saturating_sub(begin.elapsed())
            .max(Duration::from_secs(1));
        let calls = conns.iter().map(|(pid, conn)| async move {
            let mut c = conn.lock().await;
            let r = match c.ask(&ToChannel::Rebuild, left).await {
                Ok(ToAgent::Rebuilt {
                    endpoints,
                    peers,
                    micros,
                }) => {
                    info!(
                        pid,
                        channel = format_args!("{:#x}", c.channel),
                        micros,
                        qps = endpoints.len(),
                        "channel rebuilt"
                    );
                    c.wants = peers.clone().map(|mut p| {
                        p.sort_unstable();
                        p
                    });
                    Ok((endpoints, peers))
                }
                Ok(other) => Err(unexpected(other)),
                Err(e) => Err(e),
            };
            (*pid, r)
        });
        let mut wants = Some(Vec::new());
        for (pid, r) in join_all(calls).await {
            match r {
                Ok((eps, peers)) => {
                    endpoints.extend(eps);
                    match (&mut wants, peers) {
                        (Some(w), Some(p)) => w.extend(p),
                        _ => wants = None,
                    }
                }
                Err(message) => return Err(ChannelFailure { pid, message }),
            }
        }
        if let Some(w) = &mut wants {
            w.sort_unstable();
            w.dedup();
        }
        Ok((endpoints, wants))
    }

    /// Hands the channels of `pids` the endpoints of their peers (each only those it named
    /// when it rebuilt), found in `endpoints`; they connect and run again.
    pub async fn reconnect(
        &self,
        pids: &[i32],
        endpoints: &[Endpoint],
        timeout: Duration,
    ) -> Result<(), ChannelFailure> {
        let calls = pids.iter().map(|&pid| async move {
            let Some(conn) = self.conns.lock().await.get(&pid).cloned() else {
                return (
                    pid,
                    Err("its channel is gone (did the process exit?)".to_string()),
                );
            };
            let mut c = conn.lock().await;
            let endpoints = match &c.wants {
                Some(w) => endpoints
                    .iter()
                    .filter(|e| w.binary_search(&e.id).is_ok())
                    .cloned()
                    .collect(),
                None => endpoints.to_vec(),
            };
            let cmd = ToChannel::Reconnect { endpoints };
            let r = match c.ask(&cmd, timeout).await {
                Ok(ToAgent::Reconnected { micros }) => {
                    c.down = false;
                    info!(pid, micros, "channel reconnected");
                    Ok(())
                }
                Ok(other) => Err(unexpected(other)),
                Err(e) => Err(e),
            };
            (pid, r)
        });
        let mut first = None;
        for (pid, r) in join_all(calls).await {
            if let Err(message) = r {
                first.get_or_insert(ChannelFailure { pid, message });
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// After a failed quiesce: lets the channels of `pids` that are still up run again.
    pub async fn resume(&self, pids: &[i32]) {
        for &pid in pids {
            let Some(conn) = self.conns.lock().await.get(&pid).cloned() else {
                continue;
            };
            let mut c = conn.lock().await;
            if c.down {
                continue;
            }
            if let Err(e) = c.ask(&ToChannel::Resume, HELLO).await {
                warn!(pid, error = %e, "channel did not resume");
            }
        }
    }
}

/// Refuses a parent of the socket's directory that other users could write: they could rename
/// the directory away and put their own in its place. The sticky bit stops that (only an entry's
/// owner may rename it).
fn check_parent(parent: &Path) -> std::io::Result<()> {
    let m = std::fs::metadata(parent)?;
    let me = nix::unistd::geteuid().as_raw();
    let open = m.mode() & 0o022 != 0 && m.mode() & 0o1000 == 0;
    if open || (m.uid() != me && m.uid() != 0) {
        return Err(std::io::Error::other(format!(
            "{} (owner uid {}, mode {:o}) can be written by other users, who could replace the \
             ib-quiesce control socket's directory; make it owned by root and not group- or \
             world-writable",
            parent.display(),
            m.uid(),
            m.mode() & 0o7777
        )));
    }
    Ok(())
}

/// Makes `dir` a directory owned by the agent (euid, egid) with mode `0755`, creating it if
/// missing; a symlink or a file in its place is refused.
fn own_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o755).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let m = std::fs::symlink_metadata(dir)?;
    if !m.file_type().is_dir() {
        return Err(std::io::Error::other(format!(
            "{} is not a directory (a symlink or file in its place is refused)",
            dir.display()
        )));
    }
    let (uid, gid) = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    if m.uid() != uid || m.gid() != gid {
        // Not a symlink (checked above), and its parent is closed to other users.
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
    }
    if m.mode() & 0o7777 != 0o755 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokio::io::AsyncReadExt;

    /// The cgroup the fake [`PeerCgroups`] puts every connecting process in.
    const JOB_CGROUP: &str = "/sys/fs/cgroup/ckpt-test-7";

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn my_uid() -> u32 {
        nix::unistd::getuid().as_raw()
    }

    fn me() -> Peer {
        Peer {
            pid: std::process::id() as i32,
            uid: my_uid(),
            gid: nix::unistd::getgid().as_raw(),
        }
    }

    /// Job 7, owned by `uid`, whose cgroup is [`JOB_CGROUP`].
    fn job7(uid: u32) -> impl Fn(&Path) -> Option<JobOwner> + Send + Sync {
        move |c: &Path| (c == Path::new(JOB_CGROUP)).then_some(JobOwner { job: 7, uid })
    }

    /// A registry serving in `dir` whose job 7 belongs to `owner`, where every connecting
    /// process is in the cgroup `peer_cgroup`.
    fn serving(dir: &Path, owner: u32, peer_cgroup: &'static str, limits: Limits) -> Arc<Channels> {
        let ch = Channels::with_parts(
            dir.join("ibq").join("control.sock"),
            job7(owner),
            move |_pid: i32| Ok(vec![PathBuf::from(peer_cgroup)]),
            limits,
        );
        let listener = ch.bind().unwrap();
        tokio::spawn(ch.clone().serve(listener));
        ch
    }

    /// Says this process's hello (channel 7, up, one QP and one MR) on `s`.
    async fn say_hello(s: &mut (impl tokio::io::AsyncWrite + Unpin)) {
        let hello = ToAgent::Hello {
            pid: me().pid,
            channel: 7,
            down: false,
            qps: 1,
            mrs: 1,
        };
        let mut line = serde_json::to_vec(&hello).unwrap();
        line.push(b'\n');
        s.write_all(&line).await.unwrap();
    }

    /// Whether the channel of this process comes up within two seconds.
    async fn comes_up(ch: &Channels) -> bool {
        for _ in 0..200 {
            if !ch.up(&[me().pid]).await.is_empty() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// Whether the agent closed `s` (within `within`).
    async fn closed_by_agent(s: &mut UnixStream, within: Duration) -> bool {
        let mut b = [0u8; 1];
        matches!(
            tokio::time::timeout(within, s.read(&mut b)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    /// Until `held` connections of job 7 hold places, or two seconds passed.
    async fn job7_holds(ch: &Channels, held: usize) -> usize {
        for _ in 0..200 {
            if ch.slots.held(7) == held {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ch.slots.held(7)
    }

    /// With job 7 belonging to `owner` and this process in the cgroup `peer_cgroup`: a
    /// connection that says hello is closed by the agent, and its channel never comes up.
    fn refused_on_the_socket(owner: u32, peer_cgroup: &'static str) {
        runtime().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let ch = serving(dir.path(), owner, peer_cgroup, Limits::default());
            let mut s = UnixStream::connect(ch.socket()).await.unwrap();
            say_hello(&mut s).await;
            assert!(closed_by_agent(&mut s, Duration::from_secs(5)).await);
            assert!(ch.up(&[me().pid]).await.is_empty());
        });
    }

    #[test]
    fn a_process_of_the_jobs_owner_in_the_jobs_cgroup_is_admitted() {
        let peer = me();
        let cgroups = [
            PathBuf::from("/sys/fs/cgroup/memory/user.slice"),
            PathBuf::from(JOB_CGROUP),
        ];
        assert_eq!(
            authorize(peer, &cgroups, &job7(peer.uid)),
            Ok(JobOwner {
                job: 7,
                uid: peer.uid
            })
        );
    }

    #[test]
    fn a_process_in_no_jobs_cgroup_is_refused() {
        let peer = me();
        let e = authorize(
            peer,
            &[PathBuf::from("/sys/fs/cgroup/user.slice")],
            &job7(peer.uid),
        )
        .unwrap_err();
        assert!(matches!(e, Refused::NotInJob { .. }), "{e:?}");
        let m = e.to_string();
        assert!(
            m.contains(&format!("pid {}", peer.pid))
                && m.contains(&format!("uid {}", peer.uid))
                && m.contains("no job's cgroup"),
            "{m}"
        );
        let e = authorize(peer, &[], &job7(peer.uid)).unwrap_err();
        assert!(matches!(e, Refused::NotInJob { .. }), "{e:?}");
        // And on the socket: closed before its hello counts.
        refused_on_the_socket(my_uid(), "/sys/fs/cgroup/user.slice");
    }

    #[test]
    fn a_process_of_another_user_in_a_jobs_cgroup_is_refused() {
        let peer = me();
        let owner = peer.uid.wrapping_add(1);
        let e = authorize(peer, &[PathBuf::from(JOB_CGROUP)], &job7(owner)).unwrap_err();
        assert_eq!(
            e,
            Refused::NotOwner {
                peer,
                job: 7,
                owner
            }
        );
        assert!(
            e.to_string().contains(&format!(
                "runs as uid {}, but job 7 belongs to uid {owner}",
                peer.uid
            )),
            "{e}"
        );
        refused_on_the_socket(owner, JOB_CGROUP);
    }

    /// An over-long hello closes that connection; a good one is served next; an over-long
    /// answer to a command closes that channel's connection and fails the command, naming the
    /// cap.
    #[test]
    fn an_over_long_line_closes_its_connection_and_the_agent_serves_others() {
        runtime().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let ch = serving(dir.path(), my_uid(), JOB_CGROUP, Limits::default());
            let mut long = UnixStream::connect(ch.socket()).await.unwrap();
            // The agent may close while this is still being written.
            let _ = long.write_all(&vec![b'x'; MAX_LINE + 1]).await;
            assert!(closed_by_agent(&mut long, Duration::from_secs(5)).await);
            assert_eq!(job7_holds(&ch, 0).await, 0, "its place is given back");

            let s = UnixStream::connect(ch.socket()).await.unwrap();
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            say_hello(&mut w).await;
            assert!(comes_up(&ch).await, "a good channel is served");

            let quiesce = tokio::spawn({
                let ch = ch.clone();
                async move { ch.quiesce(&[me().pid], Duration::from_secs(5)).await }
            });
            let mut cmd = String::new();
            r.read_line(&mut cmd).await.unwrap();
            assert!(cmd.contains("quiesce"), "{cmd}");
            let mut answer = vec![b' '; MAX_LINE + 1];
            answer.push(b'\n');
            let _ = w.write_all(&answer).await;
            let (done, failed) = quiesce.await.unwrap();
            assert!(done.pids.is_empty());
            assert_eq!(failed.len(), 1);
            assert!(
                failed[0].message.contains(&format!("{MAX_LINE}-byte cap")),
                "{failed:?}"
            );
            let mut rest = Vec::new();
            let eof = tokio::time::timeout(Duration::from_secs(5), r.read_to_end(&mut rest)).await;
            assert!(
                matches!(eof, Ok(Ok(_)) | Ok(Err(_))),
                "the agent closed the connection"
            );
        });
    }

    /// A registry serving in `dir` with `limits` that leave two places: two connections
    /// (returned with it) take them, and a third is refused.
    async fn two_held_and_a_third_refused(
        dir: &Path,
        limits: Limits,
    ) -> (Arc<Channels>, UnixStream, UnixStream) {
        let ch = serving(dir, my_uid(), JOB_CGROUP, limits);
        let a = UnixStream::connect(ch.socket()).await.unwrap();
        let b = UnixStream::connect(ch.socket()).await.unwrap();
        assert_eq!(job7_holds(&ch, 2).await, 2);
        let mut c = UnixStream::connect(ch.socket()).await.unwrap();
        assert!(
            closed_by_agent(&mut c, Duration::from_secs(5)).await,
            "a third is refused"
        );
        (ch, a, b)
    }

    #[test]
    fn connections_per_job_are_bounded() {
        runtime().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let limits = Limits {
                per_job: 2,
                unidentified: 16,
            };
            let (ch, mut a, mut b) = two_held_and_a_third_refused(dir.path(), limits).await;
            assert!(!closed_by_agent(&mut b, Duration::from_millis(100)).await);
            drop(a);
            assert_eq!(
                job7_holds(&ch, 1).await,
                1,
                "a closed one gives its place back"
            );
            a = UnixStream::connect(ch.socket()).await.unwrap();
            say_hello(&mut a).await;
            assert!(comes_up(&ch).await, "a new one takes the place");
            assert_eq!(ch.slots.held(7), 2);
            drop(b);
            drop(a);
        });
    }

    #[test]
    fn connections_not_yet_identified_are_bounded() {
        runtime().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let limits = Limits {
                per_job: 16,
                unidentified: 2,
            };
            let (ch, _a, mut b) = two_held_and_a_third_refused(dir.path(), limits).await;
            // Once one says hello, its permit is free for the next.
            say_hello(&mut b).await;
            assert!(comes_up(&ch).await);
            let mut d = UnixStream::connect(ch.socket()).await.unwrap();
            assert!(!closed_by_agent(&mut d, Duration::from_millis(200)).await);
        });
    }

    #[test]
    fn cgroup_entries_are_placed_under_their_hierarchys_mount() {
        let mountinfo = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 31 0:38 /jobs /mnt/jobs rw,relatime shared:9 - cgroup2 cgroup2 rw
";
        let cgroup = "\
9:name=systemd:/user.slice
6:freezer:/ckpt-5
4:memory:/process_api/x
0::/jobs/ckpt-5
";
        let dirs = cgroup_dirs(cgroup, mountinfo);
        let want: Vec<PathBuf> = [
            "/sys/fs/cgroup/systemd/user.slice",
            "/sys/fs/cgroup/freezer/ckpt-5",
            "/sys/fs/cgroup/memory/process_api/x",
            "/sys/fs/cgroup/unified/jobs/ckpt-5",
            "/mnt/jobs/ckpt-5",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(dirs, want);
        // Outside a mount's root, or climbing out of it: nowhere.
        let only_sub = "42 31 0:38 /jobs /mnt/jobs rw - cgroup2 cgroup2 rw\n";
        assert!(cgroup_dirs("0::/other\n", only_sub).is_empty());
        assert!(cgroup_dirs("0::/jobs/../x\n", only_sub).is_empty());
        assert!(cgroup_dirs("garbage\n::\n", mountinfo).is_empty());
    }

    /// The real reader places a process put in a job cgroup in that cgroup's directory, as
    /// `CgroupParent::job` names it (skipped where no cgroup can be made).
    #[test]
    fn the_proc_reader_finds_a_process_in_its_job_cgroup() {
        let prefix = format!("ckpt-ibqtest-{}-", std::process::id());
        let cg = match crate::cgroup::CgroupParent::resolve("auto", &prefix) {
            Ok(p) => p.job(1),
            Err(e) => return eprintln!("skipped: {e}"),
        };
        if let Err(e) = cg.create() {
            return eprintln!("skipped: cannot make a cgroup: {e}");
        }
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let joined = std::fs::write(cg.procs_file(), pid.to_string());
        let dirs = ProcCgroups.cgroups_of(pid);
        let _ = child.kill();
        let _ = child.wait();
        let _ = cg.remove();
        if let Err(e) = joined {
            return eprintln!("skipped: cannot move a process into a cgroup: {e}");
        }
        let dirs = dirs.unwrap();
        assert!(dirs.iter().any(|d| d == cg.path()), "{dirs:?}");
    }

    #[test]
    fn bind_makes_the_socket_directory_the_agents_and_refuses_what_others_could_replace() {
        // Binding needs a runtime (the listener registers with its reactor).
        runtime().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let socket = dir.path().join("ibq").join("control.sock");
            let ibq = dir.path().join("ibq");
            std::fs::create_dir(&ibq).unwrap();
            std::fs::set_permissions(&ibq, std::fs::Permissions::from_mode(0o777)).unwrap();
            if nix::unistd::geteuid().is_root() {
                std::os::unix::fs::chown(&ibq, Some(4321), Some(4321)).unwrap();
            } else {
                eprintln!("not root: the ownership fix is not exercised");
            }
            let ch = Channels::new(socket.clone(), job7(0));
            let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
            drop(ch.bind().unwrap());
            let m = std::fs::metadata(&ibq).unwrap();
            assert_eq!(
                (m.uid(), m.mode() & 0o7777),
                (nix::unistd::geteuid().as_raw(), 0o755)
            );
            assert_eq!(mode(&flag_dir(&socket)), 0o755);
            assert_eq!(mode(&socket), 0o666);

            // A symlink in place of the flag directory is refused.
            let flags = flag_dir(&socket);
            std::fs::remove_dir(&flags).unwrap();
            std::os::unix::fs::symlink(dir.path(), &flags).unwrap();
            let e = ch.bind().unwrap_err();
            assert!(e.to_string().contains("not a directory"), "{e}");
            std::fs::remove_file(&flags).unwrap();

            // A parent others can write is refused; with the sticky bit it is not.
            let set = |m| std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(m));
            set(0o777).unwrap();
            let e = ch.bind().unwrap_err();
            assert!(
                e.to_string().contains("can be written by other users"),
                "{e}"
            );
            set(0o1777).unwrap();
            drop(ch.bind().unwrap());
            set(0o700).unwrap();
        });
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The agent's line reader, fed any bytes in any chunks, returns exactly the lines of
        /// at most the cap, stops at the first longer one, and never panics; whatever it
        /// returns decodes (or not) without panicking.
        #[test]
        fn the_agents_line_reader_splits_any_input_within_the_cap(
            input in proptest::collection::vec(
                prop_oneof![Just(b'\n'), Just(b'{'), Just(b'"'), any::<u8>()], 0..4096),
            cap in 0usize..512,
        ) {
            let (want, too_long) = ib_quiesce::control::lines_within_cap(&input, cap);
            let got = runtime().block_on(async {
                let mut lines = CappedLines::new(BufReader::with_capacity(7, &input[..]));
                let mut got = Vec::new();
                loop {
                    match lines.next_line(cap).await {
                        Ok(Some(l)) => {
                            let _ = ToAgent::decode(&l);
                            got.push(l);
                        }
                        Ok(None) => return (got, false),
                        Err(LineError::TooLong(e)) => {
                            assert_eq!(e.cap, cap);
                            return (got, true);
                        }
                        Err(LineError::Io(e)) => panic!("{e}"),
                    }
                }
            });
            prop_assert_eq!(got, (want, too_long));
        }
    }

    /// A registry serving on a temporary socket, and a "process" (this test) whose channel says
    /// hello and then exits without answering.
    #[test]
    fn a_channel_whose_process_died_fails_the_quiesce_and_a_missing_one_the_rebuild() {
        runtime().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let ch = serving(dir.path(), my_uid(), JOB_CGROUP, Limits::default());
            let pid = std::process::id() as i32;
            let mut s = UnixStream::connect(ch.socket()).await.unwrap();
            say_hello(&mut s).await;
            assert!(comes_up(&ch).await);
            assert_eq!(ch.up(&[pid]).await, vec![pid]);
            drop(s);
            let (done, failed) = ch.quiesce(&[pid], Duration::from_secs(2)).await;
            assert!(done.pids.is_empty());
            assert_eq!(failed.len(), 1);
            assert!(
                failed[0].message.contains("cannot reach the channel"),
                "{failed:?}"
            );
            let e = ch
                .rebuild(&[pid], Duration::from_millis(300))
                .await
                .unwrap_err();
            assert_eq!(e.pid, pid);
            assert!(e.message.contains("did not come back"), "{e:?}");
            assert!(flag_path(ch.socket(), pid).exists(), "the flag was raised");
        });
    }
}
