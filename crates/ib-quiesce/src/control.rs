//! The control channel between a process's [`Channel`] and the local node agent.
//!
//! One file (tests in `control/tests.rs`): the line protocol, both its ends (the
//! agent's and the process's control thread) and their checks are read together.
//!
//! When the agent starts a job's processes it sets [`SOCKET_ENV`] to its control socket. A
//! process that opens a channel then runs a control thread that connects there, says hello (its
//! [`PROTOCOL_VERSION`], pid and channel id) and obeys the agent's commands, one JSON object per
//! line:
//!
//! * `quiesce`: gate the application's calls, drain, flush and release every verbs object
//!   ([`Channel::quiesce`]), check that no `/dev/infiniband` mapping or descriptor is left, and
//!   answer. After a successful quiesce the thread closes its socket, so the snapshot holds no
//!   connection, and waits for the agent's rebuild flag, a file named by its PID namespace and
//!   its pid there (the kernel's: [`FlagFor`]) in [`flag_dir`], checked every few milliseconds
//!   without holding a descriptor.
//!   The verbs layer of an unmodified program (`libckpt_verbs.so`) quiesces in two stages: it
//!   drains and answers `drained` with its objects alive, because it has no control region in
//!   its peers' memory to flush markers through; the agent sends `release` once every node of
//!   the job drained (the coordinator's quiesce phase is that barrier), and it answers
//!   `quiesced` as a channel does.
//! * `resume`: after a failed quiesce, let the application's calls through again.
//! * `check`: at initial sync, before any quiesce: say which descriptors on verbs devices the
//!   library holds and which features in use it cannot take through a checkpoint
//!   ([`Holdings`]); the agent compares them with what `/proc` shows of the process and
//!   refuses the checkpoint when something there is beyond the library's reach.
//! * `rebuild` and `reconnect`: after the snapshot (in the same process, or in one restored from
//!   it) recreate everything, publish the new endpoints, and connect to the peers' endpoints the
//!   agent relays from the coordinator; then ungate.
//!
//! Application calls made while the channel is gated block until it is up again, so the
//! checkpoint is invisible to the application.
use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::channel::{Channel, Endpoint, Error, QpId, QuiesceReport, Result, State};
use crate::verbs::{Verbs, VerbsError};

/// The environment variable naming the agent's control socket.
pub const SOCKET_ENV: &str = "CKPT_IBQ_SOCKET";

/// How often a quiesced channel looks for its rebuild flag.
const FLAG_POLL: Duration = Duration::from_millis(5);

/// How long the control thread waits before connecting again after the agent closed a
/// connection before any command: the agent refused it (one of its connection caps, or a line
/// over [`MAX_LINE`]). Without it a quiesced channel, whose flag stays raised, would reconnect
/// in a tight loop; 100 ms is still well inside the agent's rebuild deadline.
const REFUSED_RETRY: Duration = Duration::from_millis(100);

/// The version of this line protocol that the control thread says in its hello, raised when
/// either side's messages change in a way the other cannot read. Every version keeps the
/// hello's `msg` and `version` as they are, so that an agent can name a version it does not
/// speak ([`hello_version`]); it refuses such a hello, naming both, and closes that connection.
pub const PROTOCOL_VERSION: u32 = 1;

/// The version a hello without one is read as: layers built before hellos carried a version
/// speak version 1 (the protocol did not change when the version was added).
pub const UNVERSIONED: u32 = 1;

fn unversioned() -> u32 {
    UNVERSIONED
}

/// The version a hello line says ([`UNVERSIONED`] if it says none), read from its `msg` and
/// `version` alone so that a hello of another version is recognised even where its other
/// fields differ; `None` if the line is no hello.
pub fn hello_version(line: &[u8]) -> Option<u32> {
    #[derive(Deserialize)]
    struct Head {
        msg: String,
        #[serde(default = "unversioned")]
        version: u32,
    }
    let head: Head = serde_json::from_slice(line).ok()?;
    (head.msg == "hello").then_some(head.version)
}

/// What a channel tells the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum ToAgent {
    /// First message on every connection.
    Hello {
        /// The protocol version the channel speaks ([`PROTOCOL_VERSION`]); absent from the
        /// hellos of layers built before it was added, which speak version 1.
        #[serde(default = "unversioned")]
        version: u32,
        /// The process.
        pid: i32,
        /// The channel's id.
        channel: u64,
        /// The channel is quiesced and waits for a rebuild.
        down: bool,
        /// QPs in the channel.
        qps: usize,
        /// MRs in the channel.
        mrs: usize,
    },
    /// Drained, objects still alive: the verbs layer waits for `release` (or `resume`).
    Drained {
        /// What was drained and kept so far.
        report: QuiesceReport,
        /// How long it took.
        micros: u64,
    },
    /// Quiesce done; the connection closes next.
    Quiesced {
        /// What was drained and kept.
        report: QuiesceReport,
        /// How long it took.
        micros: u64,
    },
    /// Objects recreated; these are the QPs' new endpoints.
    Rebuilt {
        /// One per QP.
        endpoints: Vec<Endpoint>,
        /// The peer QPs whose new endpoints the reconnect needs (absent: all of the job's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peers: Option<Vec<QpId>>,
        /// Instead of `peers`: the addresses (channel ids) whose QPs' endpoints the reconnect
        /// needs, every QP of each; the channel asks for others when it meets them
        /// ([`lookup`]). Absent from the answers of layers built before lookups.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        addresses: Option<Vec<u64>>,
        /// How long it took.
        micros: u64,
    },
    /// The first and only message of a connection made to ask for endpoints ([`lookup`]): a
    /// channel after its reconnect, meeting a peer whose endpoints it was not given.
    Lookup {
        /// The protocol version ([`PROTOCOL_VERSION`]).
        #[serde(default = "unversioned")]
        version: u32,
        /// The process, as in its hello.
        pid: i32,
        /// The addresses asked for: those the program names its peers by, or where a peer's
        /// port is now (a completion's source). At most [`MAX_LOOKUP_ADDRESSES`].
        addresses: Vec<u64>,
    },
    /// Connected again; the application runs.
    Reconnected {
        /// How long it took.
        micros: u64,
    },
    /// Posts are let through again after a failed quiesce.
    Resumed,
    /// The answer to `check`: what the library holds ([`Holdings`]).
    Checked {
        /// The descriptors it holds open on verbs device files; absent: it cannot tell, and
        /// the agent does not compare descriptors.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fds: Option<Vec<i32>>,
        /// Features in use that it cannot rebuild after a snapshot, each with its call.
        #[serde(default)]
        unsupported: Vec<String>,
    },
    /// The command failed.
    Failed {
        /// Why.
        error: String,
    },
}

/// What the agent tells a channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum ToChannel {
    /// Drain and release everything within the timeout.
    Quiesce {
        /// Milliseconds.
        timeout_ms: u64,
    },
    /// After `drained`: every peer drained too; release every object.
    Release,
    /// Undo a failed quiesce.
    Resume,
    /// Say what the library holds (answer `checked`); changes nothing.
    Check,
    /// Recreate every object.
    Rebuild,
    /// Connect to these endpoints and let the application run.
    Reconnect {
        /// The new endpoints of the peers named in `rebuilt` (or of the whole job).
        endpoints: Vec<Endpoint>,
    },
    /// The answer to a `lookup`: the endpoints of the job's QPs at the addresses asked for,
    /// as of the last reconnect (none known: empty), on the lookup's own connection.
    Endpoints {
        /// The endpoints.
        endpoints: Vec<Endpoint>,
    },
}

/// What a library driven by the control thread holds, as it answers `check`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    /// The descriptors it holds open on verbs device files (its contexts' command
    /// descriptors); `None`: it cannot tell.
    pub fds: Option<Vec<i32>>,
    /// Features the program uses through it now that it cannot rebuild after a snapshot,
    /// each named with its call (`"multicast (ibv_attach_mcast)"`).
    pub unsupported: Vec<String>,
}

impl From<Holdings> for ToAgent {
    fn from(h: Holdings) -> Self {
        ToAgent::Checked {
            fds: h.fds,
            unsupported: h.unsupported,
        }
    }
}

/// The longest line either side reads, except the two that carry endpoints (see
/// [`MAX_ENDPOINTS_LINE`]). A hello, a command or any other answer is a few hundred bytes;
/// 64 KiB leaves room for a long error message, and bounds what a peer that never sends a
/// newline makes the reader hold.
pub const MAX_LINE: usize = 64 * 1024;

/// The longest `rebuilt` answer (read by the agent) and `reconnect` command (read by the
/// channel). They carry one endpoint per QP, and an endpoint grows with the channel's MRs:
/// about 250 bytes plus 25 per MR (`IBQ_ENDPOINT_MAX`, 4 KiB, holds one with 160 MRs). 16 MiB
/// carries 4096 such endpoints, a rank with an RC QP to each of 4096 peers, which [`MAX_LINE`]
/// could not (it holds 16). Each side accepts a line this long only where the protocol puts
/// one: the agent in answer to its own `rebuild`, the channel right after it answered
/// `rebuilt`.
pub const MAX_ENDPOINTS_LINE: usize = 16 << 20;

impl ToChannel {
    /// The longest answer line the agent reads to this command.
    pub fn answer_cap(&self) -> usize {
        match self {
            ToChannel::Rebuild => MAX_ENDPOINTS_LINE,
            _ => MAX_LINE,
        }
    }

    /// Decodes one control line (without its newline).
    pub fn decode(line: &[u8]) -> std::result::Result<Self, DecodeError> {
        decode(line)
    }
}

impl ToAgent {
    /// Decodes one control line (without its newline).
    pub fn decode(line: &[u8]) -> std::result::Result<Self, DecodeError> {
        decode(line)
    }
}

/// A control line that is no message of the protocol.
#[derive(Debug, thiserror::Error)]
#[error("unreadable line {excerpt}: {source}")]
pub struct DecodeError {
    /// The line's start, escaped (a line can be as long as the cap).
    pub excerpt: String,
    /// What the JSON decoder said.
    #[source]
    pub source: serde_json::Error,
}

fn decode<T: serde::de::DeserializeOwned>(line: &[u8]) -> std::result::Result<T, DecodeError> {
    serde_json::from_slice(line).map_err(|source| DecodeError {
        excerpt: excerpt(line),
        source,
    })
}

/// The start of `line`, escaped, for messages and logs.
pub fn excerpt(line: &[u8]) -> String {
    const SHOWN: usize = 120;
    let text = String::from_utf8_lossy(&line[..line.len().min(SHOWN)]);
    if line.len() > SHOWN {
        format!("{text:?}... ({} bytes)", line.len())
    } else {
        format!("{text:?}")
    }
}

/// A verbs device this process still maps or holds open, if any.
pub fn verbs_left() -> Option<String> {
    let prefix = crate::VERBS_DEVICE_PREFIX;
    if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
        if let Some(p) = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.starts_with(prefix))
        {
            return Some(p.to_string());
        }
    }
    std::fs::read_dir("/proc/self/fd")
        .ok()?
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .find(|p| p.starts_with(prefix))
}

/// Work the control thread hands to an application thread.
type Task<V> = Box<dyn FnOnce(&mut Channel<V>) + Send>;

/// How long the control thread waits for an application thread to take its work before doing
/// it itself.
const PICKUP: Duration = Duration::from_secs(1);

struct Gate<V: Verbs> {
    closed: bool,
    task: Option<Task<V>>,
}

/// A channel shared between the application's threads and the control thread. Application
/// calls go through [`Shared::call`], which waits while the channel is gated.
///
/// The control thread's work (quiesce, rebuild, reconnect) runs, when it can, in an
/// application thread waiting at the gate: the kernel lets only a thread with the opener's
/// credentials write to a verbs device file, and after a restore each thread has credentials
/// of its own, so the thread that reopens the device must be the one that posts (soft-RoCE
/// rings its doorbell with such a write). Only when no application thread calls in within a
/// second (it is computing) does the control thread do the work itself.
pub struct Shared<V: Verbs> {
    ch: Mutex<Channel<V>>,
    gate: Mutex<Gate<V>>,
    open: Condvar,
    rebuilds: AtomicU64,
}

impl<V: Verbs> std::fmt::Debug for Shared<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("rebuilds", &self.rebuilds)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in another caller leaves the data consistent (every call is a single step).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<V: Verbs + 'static> Shared<V> {
    /// Shares `ch`.
    pub fn new(ch: Channel<V>) -> Arc<Self> {
        Arc::new(Shared {
            ch: Mutex::new(ch),
            gate: Mutex::new(Gate {
                closed: false,
                task: None,
            }),
            open: Condvar::new(),
            rebuilds: AtomicU64::new(0),
        })
    }

    /// Runs an application call on the channel, waiting first while it is quiesced (and doing
    /// the control thread's work meanwhile).
    pub fn call<R>(&self, f: impl FnOnce(&mut Channel<V>) -> R) -> R {
        loop {
            let mut g = lock(&self.gate);
            loop {
                if let Some(task) = g.task.take() {
                    drop(g);
                    task(&mut lock(&self.ch));
                    g = lock(&self.gate);
                    continue;
                }
                if !g.closed {
                    break;
                }
                g = self.open.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            drop(g);
            let mut c = lock(&self.ch);
            // The control thread may have gated the channel between the two locks.
            if !lock(&self.gate).closed {
                return f(&mut c);
            }
        }
    }

    /// Runs a call without waiting for the gate (diagnostics).
    pub fn peek<R>(&self, f: impl FnOnce(&Channel<V>) -> R) -> R {
        f(&lock(&self.ch))
    }

    /// Completed rebuilds since the process started (or since the snapshot it was restored from).
    pub fn rebuilds(&self) -> u64 {
        self.rebuilds.load(Ordering::Relaxed)
    }

    fn set_gate(&self, closed: bool) {
        lock(&self.gate).closed = closed;
        if !closed {
            self.open.notify_all();
        }
    }

    /// Runs `f` on the channel in an application thread waiting at the (closed) gate, or here
    /// when none takes it within [`PICKUP`].
    fn run<R: Send + 'static>(&self, f: impl FnOnce(&mut Channel<V>) -> R + Send + 'static) -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        let task: Task<V> = Box::new(move |c| {
            let _ = tx.send(f(c));
        });
        lock(&self.gate).task = Some(task);
        self.open.notify_all();
        match rx.recv_timeout(PICKUP) {
            Ok(r) => r,
            Err(_) => {
                let mine = lock(&self.gate).task.take();
                if let Some(task) = mine {
                    task(&mut lock(&self.ch));
                }
                rx.recv().expect("a taken task always answers")
            }
        }
    }

    /// Gates application calls and quiesces. On failure before anything was released the
    /// channel is resumed and ungated; otherwise it stays gated until rebuilt.
    pub fn quiesce(&self, timeout: Duration) -> Result<QuiesceReport> {
        self.set_gate(true);
        let r = self.run(move |c| {
            let r = c.quiesce(timeout);
            if r.is_err() && c.state() == State::Quiescing {
                let _ = c.resume();
            }
            (r, c.state())
        });
        match r {
            (Ok(report), _) => match verbs_left() {
                None => Ok(report),
                Some(dev) => Err(Error::Verbs(VerbsError {
                    op: "quiesce",
                    message: format!(
                        "{dev} is still mapped or open after every object was released; \
                         another library in this process uses the device"
                    ),
                })),
            },
            (Err(e), state) => {
                if state == State::Up {
                    self.set_gate(false);
                }
                Err(e)
            }
        }
    }

    /// Lets application calls through after a failed quiesce.
    pub fn resume(&self) -> Result<()> {
        let mut c = lock(&self.ch);
        if c.state() == State::Quiescing {
            c.resume()?;
        }
        let up = c.state() == State::Up;
        drop(c);
        if up {
            self.set_gate(false);
        }
        Ok(())
    }

    /// Recreates every object; returns the new endpoints.
    /// Returns the new endpoints and the peers whose endpoints the reconnect needs.
    pub fn rebuild(&self) -> Result<(Vec<Endpoint>, Vec<QpId>)> {
        self.run(|c| {
            let eps = c.rebuild()?.into_iter().map(|(_, e)| e).collect();
            Ok((eps, c.peers()))
        })
    }

    /// Connects to the peers' new endpoints and ungates.
    pub fn reconnect(&self, endpoints: &[Endpoint]) -> Result<()> {
        let map: HashMap<_, _> = endpoints.iter().map(|e| (e.id, e.clone())).collect();
        self.run(move |c| c.reconnect(&map))?;
        self.rebuilds.fetch_add(1, Ordering::Relaxed);
        self.set_gate(false);
        Ok(())
    }
}

/// How a quiesce ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Quiesce {
    /// Everything is released: the process can be snapshotted.
    Released(QuiesceReport),
    /// Drained with every object alive; `release` (or `resume`) comes next.
    Drained(QuiesceReport),
}

/// What a control thread drives: an ib-quiesce channel ([`Shared`]), or the verbs layer of an
/// unmodified program. An error is the message the agent is sent.
pub trait Controlled: Send + Sync + 'static {
    /// The hello's channel id, QPs and MRs.
    fn hello(&self) -> (u64, usize, usize);
    /// Gates the application's calls and quiesces within `timeout`. On a failure before
    /// anything was released the application runs again.
    fn quiesce(&self, timeout: Duration) -> std::result::Result<Quiesce, String>;
    /// After [`Quiesce::Drained`]: releases every object.
    fn release(&self) -> std::result::Result<QuiesceReport, String>;
    /// After a failed or drained quiesce: lets the application's calls through again.
    fn resume(&self) -> std::result::Result<(), String>;
    /// Whether everything is released and not yet connected again (a rebuild or reconnect is
    /// due).
    fn is_down(&self) -> bool;
    /// Recreates every object: the new endpoints, and which peers' endpoints the reconnect
    /// needs.
    fn rebuild(&self) -> std::result::Result<(Vec<Endpoint>, Wants), String>;
    /// Connects to the peers' new endpoints and lets the application run.
    fn reconnect(&self, endpoints: &[Endpoint]) -> std::result::Result<(), String>;
    /// What it holds now (the answer to `check`), without gating anything.
    fn check(&self) -> Holdings;
}

impl<V: Verbs + 'static> Controlled for Shared<V> {
    fn hello(&self) -> (u64, usize, usize) {
        self.peek(|c| {
            let (q, m) = c.counts();
            (c.id(), q, m)
        })
    }
    fn quiesce(&self, timeout: Duration) -> std::result::Result<Quiesce, String> {
        Shared::quiesce(self, timeout)
            .map(Quiesce::Released)
            .map_err(|e| e.to_string())
    }
    fn release(&self) -> std::result::Result<QuiesceReport, String> {
        Err("an ib-quiesce channel releases everything when it quiesces; nothing to release".into())
    }
    fn resume(&self) -> std::result::Result<(), String> {
        Shared::resume(self).map_err(|e| e.to_string())
    }
    fn is_down(&self) -> bool {
        matches!(self.peek(|c| c.state()), State::Down | State::Rebuilt)
    }
    fn rebuild(&self) -> std::result::Result<(Vec<Endpoint>, Wants), String> {
        Shared::rebuild(self)
            .map(|(e, p)| (e, Wants::Qps(p)))
            .map_err(|e| e.to_string())
    }
    fn reconnect(&self, endpoints: &[Endpoint]) -> std::result::Result<(), String> {
        Shared::reconnect(self, endpoints).map_err(|e| e.to_string())
    }
    /// The channel's device descriptor (its backend's), and no unsupported feature: a
    /// channel offers only what it rebuilds.
    fn check(&self) -> Holdings {
        Holdings {
            fds: self.peek(|c| c.device_fds()),
            unsupported: Vec::new(),
        }
    }
}

/// Starts the control thread if the process runs under a ckpt agent ([`SOCKET_ENV`] set).
pub fn start<T: Controlled>(target: &Arc<T>) -> Option<std::thread::JoinHandle<()>> {
    start_at(target, PathBuf::from(std::env::var_os(SOCKET_ENV)?))
}

/// Starts the control thread for the agent socket `socket`.
pub fn start_at<T: Controlled>(
    target: &Arc<T>,
    socket: PathBuf,
) -> Option<std::thread::JoinHandle<()>> {
    let target = target.clone();
    std::thread::Builder::new()
        .name("ib-quiesce".into())
        .spawn(move || control_loop(target.as_ref(), &socket))
        .ok()
}

fn send(stream: &mut UnixStream, msg: &ToAgent) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)
}

fn micros(since: Instant) -> u64 {
    since.elapsed().as_micros() as u64
}

/// What the control loop does after answering a command.
enum Next {
    /// Answer and read the next command.
    Answer(ToAgent),
    /// Everything is released: answer, then close the connection (the agent waits for the EOF
    /// before it freezes the process) and wait for the rebuild flag.
    Down(ToAgent),
}

/// Obeys one command.
fn obey<T: Controlled>(target: &T, cmd: ToChannel) -> Next {
    let t = Instant::now();
    let failed = |error: String| Next::Answer(ToAgent::Failed { error });
    let quiesced = |report| {
        Next::Down(ToAgent::Quiesced {
            report,
            micros: micros(t),
        })
    };
    match cmd {
        ToChannel::Quiesce { timeout_ms } => {
            match target.quiesce(Duration::from_millis(timeout_ms)) {
                Ok(Quiesce::Released(report)) => quiesced(report),
                Ok(Quiesce::Drained(report)) => Next::Answer(ToAgent::Drained {
                    report,
                    micros: micros(t),
                }),
                Err(e) => failed(e),
            }
        }
        ToChannel::Release => match target.release() {
            Ok(report) => quiesced(report),
            Err(e) => failed(e),
        },
        ToChannel::Resume => match target.resume() {
            Ok(()) => Next::Answer(ToAgent::Resumed),
            Err(e) => failed(e),
        },
        ToChannel::Rebuild => match target.rebuild() {
            Ok((endpoints, wants)) => {
                let (peers, addresses) = wants.into_wire();
                Next::Answer(ToAgent::Rebuilt {
                    endpoints,
                    peers,
                    addresses,
                    micros: micros(t),
                })
            }
            Err(e) => failed(e),
        },
        ToChannel::Endpoints { .. } => {
            failed("endpoints answer a lookup; they are no command".into())
        }
        ToChannel::Reconnect { endpoints } => match target.reconnect(&endpoints) {
            Ok(()) => Next::Answer(ToAgent::Reconnected { micros: micros(t) }),
            Err(e) => failed(e),
        },
        ToChannel::Check => Next::Answer(target.check().into()),
    }
}

/// The control thread: connected to the agent while the channel is up; after a quiesce,
/// disconnected until the agent raises the rebuild flag. It lives as long as the process.
fn control_loop<T: Controlled>(target: &T, socket: &Path) {
    let mut down = false;
    loop {
        // Read again each time: a restart under DMTCP gives the process another PID, one into
        // a sandbox another PID namespace.
        let mut me = FlagFor::own();
        if down {
            while !flag_path(socket, me).exists() {
                std::thread::sleep(FLAG_POLL);
                me = FlagFor::own();
            }
        }
        let pid = me.pid;
        let Ok(mut stream) = UnixStream::connect(socket) else {
            std::thread::sleep(if down {
                FLAG_POLL
            } else {
                Duration::from_secs(1)
            });
            continue;
        };
        let (channel, qps, mrs) = target.hello();
        let hello = ToAgent::Hello {
            version: PROTOCOL_VERSION,
            pid,
            channel,
            down,
            qps,
            mrs,
        };
        if send(&mut stream, &hello).is_err() {
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        let Ok(reader) = stream.try_clone() else {
            continue;
        };
        let mut reader = BufReader::new(reader);
        let mut part = LineBuf::default();
        let mut cap = MAX_LINE;
        let mut commands = 0u64;
        // A line over the cap closes the connection like the end of the stream does.
        while let Ok(Some(line)) = read_line(&mut reader, &mut part, cap) {
            commands += 1;
            let next = match ToChannel::decode(&line) {
                Err(e) => Next::Answer(ToAgent::Failed {
                    error: format!("unreadable command: {e}"),
                }),
                Ok(cmd) => obey(target, cmd),
            };
            down = target.is_down();
            let reply = match next {
                Next::Down(reply) => {
                    let _ = send(&mut stream, &reply);
                    break;
                }
                Next::Answer(reply) => reply,
            };
            // Only the command that follows a `rebuilt` answer carries endpoints.
            cap = if matches!(reply, ToAgent::Rebuilt { .. }) {
                MAX_ENDPOINTS_LINE
            } else {
                MAX_LINE
            };
            if send(&mut stream, &reply).is_err() {
                break;
            }
        }
        drop(stream);
        if !down {
            // The agent went away (restarted): say hello to the next one.
            std::thread::sleep(Duration::from_secs(1));
        } else if commands == 0 {
            std::thread::sleep(REFUSED_RETRY);
        }
    }
}

mod flag;
mod lines;
mod lookup;
pub use flag::{flag_dir, flag_path, FlagFor};
pub use lines::{lines_within_cap, read_line, LineBuf, LineTooLong};
pub use lookup::{address_id, addresses_of, lookup, Wants, MAX_LOOKUP_ADDRESSES};

#[cfg(test)]
mod tests;
