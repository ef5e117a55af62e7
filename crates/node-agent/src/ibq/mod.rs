//! The agent's side of ib-quiesce: a Unix socket where every job process that opened an
//! ib-quiesce channel says hello, and the calls that drive those channels around a checkpoint
//! (see `ib_quiesce::control` for the protocol).
//!
//! At initial sync, `check` asks every channel what it holds (its descriptors on verbs devices,
//! and features in use it cannot rebuild), for the agent to compare with `/proc`.
//!
//! Quiesce asks every channel of the job's processes at once (their flush handshakes need each
//! other), then waits for each to close its connection, so the snapshot holds none. The verbs
//! layer of an unmodified program answers it `drained` instead and stays connected with its
//! objects alive; release, sent once every node drained, has it release them and close like a
//! channel (or resume lets it run on). Rebuild
//! raises each channel's flag, waits for its hello, has it recreate its objects and returns
//! their endpoints; reconnect hands each channel the endpoints it needs (the QPs or addresses
//! it named, from all nodes through the coordinator). A verbs layer that named addresses asks
//! for others later (`lookup.rs`), answered from the job's endpoints kept once per node.
//!
//! Who may connect: the socket is open to every local user (job processes run as their users),
//! so each connection is identified when it is accepted, before anything is read from it. The
//! credentials the kernel recorded at `connect` (`SO_PEERCRED`: pid, uid, gid) place the process
//! in a job: its cgroup (from `/proc/<pid>/cgroup`, read once) must be a job's cgroup, and its
//! uid that job's owner ([`authorize`]; [`JobLookup`] is how the job table answers). Others are
//! refused with a warning naming pid, uid and why. Lines are capped ([`MAX_LINE`]), and so are
//! the connections of one job ([`MAX_CONNS_PER_JOB`]) and those not yet identified
//! ([`MAX_UNIDENTIFIED`]).
//!
//! One file: the socket's server and the calls that drive the channels around a checkpoint share
//! each process's connection state.
use std::collections::HashMap;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use ib_quiesce::channel::QpId;
use ib_quiesce::control::{
    excerpt, flag_dir, flag_path, hello_version, FlagFor, Holdings, LineBuf, LineTooLong, ToAgent,
    ToChannel, Wants, MAX_LINE, PROTOCOL_VERSION,
};
use ib_quiesce::{Endpoint, QuiesceReport};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

mod conn;
mod error;
mod hello;
mod lookup;
mod peer;
mod process;
use conn::*;
pub use conn::{Limits, Rebuilt};
pub use error::{ChannelError, HelloError};
use hello::VersionWarned;
pub use peer::*;
use process::{boot_ticks, PeerProcess};

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

/// A channel that failed a call: which process, and why (the text the coordinator shows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelFailure {
    /// The process.
    pub pid: i32,
    /// What went wrong.
    pub message: String,
}

impl ChannelFailure {
    /// The failure of the channel of `pid` with `error`.
    fn of(pid: i32, error: &ChannelError) -> Self {
        ChannelFailure {
            pid,
            message: error.to_string(),
        }
    }
}

/// What a quiesce (or a release) did on this node.
#[derive(Debug, Clone, Default)]
pub struct Quiesced {
    /// Processes whose channels released everything and are now down (a rebuild brings them
    /// back).
    pub released: Vec<i32>,
    /// Processes whose verbs layers drained with their objects alive: still connected, they
    /// wait for [`Channels::release`] (or [`Channels::resume`]).
    pub drained: Vec<i32>,
    /// Summed over both.
    pub report: QuiesceReport,
    /// The slowest one's time.
    pub slowest: Duration,
}

impl Quiesced {
    /// Counts one channel's report and time.
    fn add(&mut self, report: &QuiesceReport, took: Duration) {
        self.report.flushed_qps += report.flushed_qps;
        self.report.kept_receives += report.kept_receives;
        self.report.held_completions += report.held_completions;
        self.slowest = self.slowest.max(took);
    }
}

/// A registered channel: its connection, the process that made it (by pidfd) and its job.
#[derive(Clone)]
struct Registered {
    conn: Arc<Mutex<Conn>>,
    process: Arc<PeerProcess>,
    job: u64,
}

/// The channels of this node's job processes, by pid. An entry is used only while the process
/// that registered it lives ([`PeerProcess`]): a PID that went to another process finds none.
pub struct Channels {
    socket: PathBuf,
    conns: Mutex<HashMap<i32, Registered>>,
    jobs: Box<dyn JobLookup>,
    cgroups: Box<dyn PeerCgroups>,
    limits: Limits,
    /// Permits for connections not yet identified and registered.
    unidentified: Arc<Semaphore>,
    slots: Arc<JobSlots>,
    /// Processes already warned about for their hello's protocol version.
    version_warned: VersionWarned,
    /// The flags raised, by the process's pid here: named as the process knows itself, which
    /// cannot be read back once it is gone.
    flags: std::sync::Mutex<HashMap<i32, FlagFor>>,
    /// Every endpoint of each job, from its last reconnect on this node: what lookups are
    /// answered from ([`Wants::Addresses`]). Held once per node, not per process.
    tables: std::sync::Mutex<HashMap<u64, Arc<lookup::Table>>>,
}

fn lock_flags(
    m: &std::sync::Mutex<HashMap<i32, FlagFor>>,
) -> std::sync::MutexGuard<'_, HashMap<i32, FlagFor>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
            version_warned: VersionWarned::default(),
            flags: std::sync::Mutex::default(),
            tables: std::sync::Mutex::default(),
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
            let (stream, accepted) = match listener.accept().await {
                Ok((s, _)) => (s, boot_ticks()),
                Err(e) => {
                    warn!(error = %e, "ib-quiesce control socket accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let me = self.clone();
            tokio::spawn(async move { me.admit(stream, accepted).await });
        }
    }

    /// Identifies a new connection (accepted at `accepted`, [`boot_ticks`]) and takes its
    /// hello; a refusal closes it with a warning. A registered channel is dropped when its
    /// process exits.
    async fn admit(self: &Arc<Self>, stream: UnixStream, accepted: u64) {
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
        let process = match PeerProcess::of(&stream, peer.pid, accepted) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                warn!(
                    pid = peer.pid,
                    uid = peer.uid,
                    reason = %e,
                    "ib-quiesce connection refused: cannot hold the connecting process"
                );
                return;
            }
        };
        let (_permit, owner, slot) = match self.identify(peer, &process).await {
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
        let registered = match self
            .hello(stream, peer.pid, owner.job, slot, &process)
            .await
        {
            Ok(Some(r)) => r,
            // A lookup, answered: its connection ends here.
            Ok(None) => return,
            Err(e) => return self.refused_hello(peer, owner.job, &e),
        };
        // Its process gone, the channel goes: nothing meant for the PID's next process
        // reaches whoever holds the connection now.
        let me = self.clone();
        tokio::spawn(async move {
            process.exited().await;
            let mut map = me.conns.lock().await;
            if map
                .get(&peer.pid)
                .is_some_and(|r| Arc::ptr_eq(&r.conn, &registered))
            {
                map.remove(&peer.pid);
                info!(
                    pid = peer.pid,
                    job = owner.job,
                    "ib-quiesce channel dropped: its process exited"
                );
            }
        });
    }

    /// The channel of `pid`, if the process that registered it still runs (else the entry is
    /// dropped).
    async fn live(&self, pid: i32) -> Option<Arc<Mutex<Conn>>> {
        let mut map = self.conns.lock().await;
        match map.get(&pid) {
            Some(r) if r.process.alive() => Some(r.conn.clone()),
            Some(_) => {
                map.remove(&pid);
                None
            }
            None => None,
        }
    }

    /// Ties `peer` to its job ([`authorize`]) and takes a place in the job's connections and
    /// among those not yet registered (held until the hello is in).
    async fn identify(
        &self,
        peer: Peer,
        process: &PeerProcess,
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
        // Read by PID: only if the process that connected still runs were they its cgroups.
        if !process.alive() {
            return Err(Refused::Cgroups {
                peer,
                error: "the process exited".into(),
            });
        }
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
                self.conns.lock().await.retain(|_, r| r.process.alive());
                self.slots
                    .take(owner.job, self.limits.per_job)
                    .ok_or_else(full)?
            }
        };
        Ok((permit, owner, slot))
    }

    /// Raises the rebuild flag of `pid` (a process without a channel pays no attention; one
    /// that is gone needs none).
    pub fn raise_flag(&self, pid: i32) -> Result<(), ChannelFailure> {
        let Some(who) = FlagFor::of_process(pid) else {
            return Ok(());
        };
        let flag = flag_path(&self.socket, who);
        std::fs::write(&flag, b"").map_err(|source| {
            ChannelFailure::of(pid, &ChannelError::Flag { path: flag, source })
        })?;
        lock_flags(&self.flags).insert(pid, who);
        Ok(())
    }

    /// Lowers the rebuild flags of `pids`.
    pub fn lower_flags(&self, pids: impl IntoIterator<Item = i32>) {
        for pid in pids {
            let who = lock_flags(&self.flags)
                .remove(&pid)
                .or_else(|| FlagFor::of_process(pid));
            if let Some(who) = who {
                let _ = std::fs::remove_file(flag_path(&self.socket, who));
            }
        }
    }

    /// Which of `pids` have a channel that said hello down (quiesced, or restored).
    pub async fn down_among(&self, pids: &[i32]) -> Vec<i32> {
        self.with_channel(pids, true).await
    }

    /// Which of `pids` have a channel that is up (drained verbs layers included: they are
    /// connected and not down).
    pub async fn up(&self, pids: &[i32]) -> Vec<i32> {
        self.with_channel(pids, false).await
    }

    /// Which of `pids` have a channel, down or up as `down` says.
    async fn with_channel(&self, pids: &[i32], down: bool) -> Vec<i32> {
        let mut found = Vec::new();
        for p in pids {
            if let Some(c) = self.live(*p).await {
                if c.lock().await.down == down {
                    found.push(*p);
                }
            }
        }
        found
    }

    /// Asks the channels of `pids` (those up), all at once, what they hold ([`Holdings`]);
    /// each has `timeout` to answer. A channel built before `check` existed answers that it
    /// cannot read the command: it is taken as one that cannot tell (no descriptors, nothing
    /// unsupported), with a warning. Any other failure names the pid.
    pub async fn check(
        &self,
        pids: &[i32],
        timeout: Duration,
    ) -> Result<Vec<(i32, Holdings)>, ChannelFailure> {
        let calls = pids.iter().map(|&pid| async move {
            let Some(conn) = self.live(pid).await else {
                return (pid, Err(ChannelError::Gone));
            };
            let mut c = conn.lock().await;
            let r = match c.ask(&ToChannel::Check, timeout).await {
                Ok(ToAgent::Checked { fds, unsupported }) => Ok(Holdings { fds, unsupported }),
                Ok(other) => Err(unexpected(other)),
                Err(e) if e.is_unknown_command() => {
                    warn!(pid, answer = %e, "channel predates the check; its descriptors are not compared");
                    Ok(Holdings::default())
                }
                Err(e) => Err(e),
            };
            (pid, r)
        });
        let mut held = Vec::new();
        for (pid, r) in join_all(calls).await {
            match r {
                Ok(h) => held.push((pid, h)),
                Err(e) => return Err(ChannelFailure::of(pid, &e)),
            }
        }
        Ok(held)
    }

    async fn take(&self, pid: i32) -> Option<Arc<Mutex<Conn>>> {
        self.conns.lock().await.remove(&pid).map(|r| r.conn)
    }

    /// Quiesces the channels of `pids`, all at once. Channels answer `quiesced` (everything
    /// released, now down) or, for a verbs layer, `drained` (objects alive, still connected:
    /// [`Channels::release`] comes next). Channels that quiesced stay down even when others
    /// failed (a rebuild brings them back).
    pub async fn quiesce(
        &self,
        pids: &[i32],
        timeout: Duration,
    ) -> (Quiesced, Vec<ChannelFailure>) {
        let cmd = ToChannel::Quiesce {
            timeout_ms: timeout.as_millis() as u64,
        };
        // The channel's own timeout, and time for its answer to arrive.
        self.quiesce_stage(pids, &cmd, timeout + Duration::from_secs(5))
            .await
    }

    /// Has the drained verbs layers of `pids` release every object, all at once; each answers
    /// `quiesced` and closes its connection, as a channel's quiesce does, and is then down.
    /// Those that released stay down even when others failed (a rebuild brings them back);
    /// those that failed stay drained.
    pub async fn release(
        &self,
        pids: &[i32],
        timeout: Duration,
    ) -> (Quiesced, Vec<ChannelFailure>) {
        self.quiesce_stage(pids, &ToChannel::Release, timeout).await
    }

    /// Sends `cmd` (`quiesce` or `release`) to the channels of `pids`, all at once, and waits
    /// up to `wait` for each answer and close; released ones leave the registry.
    async fn quiesce_stage(
        &self,
        pids: &[i32],
        cmd: &ToChannel,
        wait: Duration,
    ) -> (Quiesced, Vec<ChannelFailure>) {
        let calls = pids.iter().map(|&pid| async move {
            let Some(conn) = self.live(pid).await else {
                return (pid, Err(ChannelError::Missing));
            };
            let r = conn.lock().await.quiesce_stage(cmd, wait).await;
            (pid, r)
        });
        let mut done = Quiesced::default();
        let mut failed = Vec::new();
        for (pid, r) in join_all(calls).await {
            match r {
                Ok(Stage::Released(report, took)) => {
                    self.take(pid).await;
                    done.released.push(pid);
                    done.add(&report, took);
                }
                Ok(Stage::Drained(report, took)) => {
                    done.drained.push(pid);
                    done.add(&report, took);
                }
                Err(e) => failed.push(ChannelFailure::of(pid, &e)),
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
        // A channel that said hello down already (found among a restored part's processes) is
        // not flagged again: a flag it never takes down would bring it back at once after its
        // next release, its new connection then in the snapshot.
        let back: Vec<i32> = {
            let map = self.conns.lock().await;
            pids.iter()
                .copied()
                .filter(|p| {
                    map.get(p).is_some_and(|r| {
                        r.process.alive() && r.conn.try_lock().is_ok_and(|c| c.down)
                    })
                })
                .collect()
        };
        for &pid in pids.iter().filter(|p| !back.contains(p)) {
            self.raise_flag(pid)?;
        }
        let mut endpoints = Vec::new();
        let mut waiting: Vec<i32> = pids.to_vec();
        let mut conns = Vec::new();
        while !waiting.is_empty() {
            {
                let map = self.conns.lock().await;
                // Only a hello from the quiesced (or restored) process counts: an entry that is
                // up belongs to a connection from before (e.g. of a killed incarnation), and
                // one whose process exited to no one the PID may now name.
                waiting.retain(|p| match map.get(p) {
                    Some(r) if r.process.alive() && r.conn.try_lock().is_ok_and(|c| c.down) => {
                        conns.push((*p, r.conn.clone()));
                        false
                    }
                    _ => true,
                });
            }
            if waiting.is_empty() {
                break;
            }
            if begin.elapsed() > deadline {
                return Err(ChannelFailure::of(
                    waiting[0],
                    &ChannelError::NotBack(deadline),
                ));
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
                    addresses,
                    micros,
                }) => {
                    info!(
                        pid,
                        channel = format_args!("{:#x}", c.channel),
                        micros,
                        qps = endpoints.len(),
                        "channel rebuilt"
                    );
                    c.wants = Wants::from_wire(peers, addresses).sorted();
                    // What this node needs from the others: the QPs a channel named, or
                    // every endpoint for one that looks up the peers it meets later.
                    let node_needs = match &c.wants {
                        Wants::Qps(q) => Some(q.clone()),
                        Wants::All | Wants::Addresses(_) => None,
                    };
                    Ok((endpoints, node_needs))
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
                Err(e) => return Err(ChannelFailure::of(pid, &e)),
            }
        }
        if let Some(w) = &mut wants {
            w.sort_unstable();
            w.dedup();
        }
        Ok((endpoints, wants))
    }

    /// Hands the channels of `pids` the endpoints of their peers (each only those it named
    /// when it rebuilt), found in `endpoints`; they connect and run again. The job's endpoints
    /// are kept for the lookups of its channels ([`Wants::Addresses`]).
    pub async fn reconnect(
        &self,
        pids: &[i32],
        endpoints: &[Endpoint],
        timeout: Duration,
    ) -> Result<(), ChannelFailure> {
        let table = &self.keep_table(pids, endpoints).await;
        let calls = pids.iter().map(|&pid| async move {
            let Some(conn) = self.live(pid).await else {
                return (pid, Err(ChannelError::Gone));
            };
            let mut c = conn.lock().await;
            let endpoints: Vec<Endpoint> = match &c.wants {
                Wants::Addresses(a) => table.at(a),
                w => endpoints.iter().filter(|e| w.covers(e)).cloned().collect(),
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
            if let Err(e) = r {
                first.get_or_insert(ChannelFailure::of(pid, &e));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// After a failed quiesce, or to undo a drain: lets the channels of `pids` that are still
    /// up (drained verbs layers included) run again, all at once (each has [`HELLO`] to
    /// answer). A channel that does not is logged and left as it is.
    pub async fn resume(&self, pids: &[i32]) {
        let calls = pids.iter().map(|&pid| async move {
            let Some(conn) = self.live(pid).await else {
                return;
            };
            let mut c = conn.lock().await;
            if c.down {
                return;
            }
            match c.ask(&ToChannel::Resume, HELLO).await {
                Ok(ToAgent::Resumed) => c.drained = false,
                Ok(other) => warn!(pid, answer = %unexpected(other), "channel did not resume"),
                Err(e) => warn!(pid, error = %e, "channel did not resume"),
            }
        });
        join_all(calls).await;
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
mod tests;
