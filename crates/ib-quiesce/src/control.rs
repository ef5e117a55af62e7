//! The control channel between a process's [`Channel`] and the local node agent.
//!
//! When the agent starts a job's processes it sets [`SOCKET_ENV`] to its control socket. A
//! process that opens a channel then runs a control thread that connects there, says hello
//! (its pid and channel id) and obeys the agent's commands, one JSON object per line:
//!
//! * `quiesce`: gate the application's calls, drain, flush and release every verbs object
//!   ([`Channel::quiesce`]), check that no `/dev/infiniband` mapping or descriptor is left, and
//!   answer. After a successful quiesce the thread closes its socket, so the snapshot holds no
//!   connection, and waits for the agent's rebuild flag, a file named by its pid in
//!   [`flag_dir`], checked every few milliseconds without holding a descriptor.
//! * `resume`: after a failed quiesce, let the application's calls through again.
//! * `rebuild` and `reconnect`: after the snapshot (in the same process, or in one restored from
//!   it) recreate everything, publish the new endpoints, and connect to the peers' endpoints the
//!   agent relays from the coordinator; then ungate.
//!
//! Application calls made while the channel is gated block until it is up again, so the
//! checkpoint is invisible to the application.
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
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

/// What a channel tells the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum ToAgent {
    /// First message on every connection.
    Hello {
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
        /// How long it took.
        micros: u64,
    },
    /// Connected again; the application runs.
    Reconnected {
        /// How long it took.
        micros: u64,
    },
    /// Posts are let through again after a failed quiesce.
    Resumed,
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
    /// Undo a failed quiesce.
    Resume,
    /// Recreate every object.
    Rebuild,
    /// Connect to these endpoints and let the application run.
    Reconnect {
        /// The new endpoints of the peers named in `rebuilt` (or of the whole job).
        endpoints: Vec<Endpoint>,
    },
}

/// Where the agent puts rebuild flags for the channels of its control socket `socket`.
pub fn flag_dir(socket: &Path) -> PathBuf {
    socket
        .parent()
        .unwrap_or(Path::new("/"))
        .join("ibq-rebuild")
}

/// The rebuild flag of the channel in process `pid`.
pub fn flag_path(socket: &Path, pid: i32) -> PathBuf {
    flag_dir(socket).join(pid.to_string())
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

/// A line longer than the reader's cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a line longer than the {cap}-byte cap")]
pub struct LineTooLong {
    /// The cap.
    pub cap: usize,
}

/// The part of a line read so far. It never holds more than the cap it is fed with: a line
/// that would grow past it is an error, and the part is dropped.
#[derive(Debug, Default)]
pub struct LineBuf {
    part: Vec<u8>,
}

impl LineBuf {
    /// Takes bytes from `avail` up to and including the next newline. Returns how many it took
    /// and, if the newline was among them, the whole line without it.
    pub fn feed(
        &mut self,
        avail: &[u8],
        cap: usize,
    ) -> std::result::Result<(usize, Option<Vec<u8>>), LineTooLong> {
        let (take, end) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (avail.len(), false),
        };
        if self.part.len() + take > cap {
            self.part = Vec::new();
            return Err(LineTooLong { cap });
        }
        self.part.extend_from_slice(&avail[..take]);
        if end {
            Ok((take + 1, Some(std::mem::take(&mut self.part))))
        } else {
            Ok((take, None))
        }
    }
}

/// What a line reader with cap `cap` returns for `input`, read to its end: the lines (without
/// their newlines) before the first one longer than the cap, and whether it stopped at such a
/// line. An unterminated last part is never returned, but is too long once it passes the cap.
/// The model the readers' property tests (here and in the node agent) check against.
#[doc(hidden)]
pub fn lines_within_cap(input: &[u8], cap: usize) -> (Vec<Vec<u8>>, bool) {
    let mut lines = Vec::new();
    let mut segments: Vec<&[u8]> = input.split(|&b| b == b'\n').collect();
    let last = segments.pop().unwrap_or_default();
    for seg in segments {
        if seg.len() > cap {
            return (lines, true);
        }
        lines.push(seg.to_vec());
    }
    (lines, last.len() > cap)
}

/// Reads the next line of at most `cap` bytes, without its newline; `None` at the end of the
/// stream (an unterminated last line is dropped: its writer died mid-message). A longer line
/// is an `InvalidData` error carrying [`LineTooLong`].
pub fn read_line(
    r: &mut impl BufRead,
    part: &mut LineBuf,
    cap: usize,
) -> std::io::Result<Option<Vec<u8>>> {
    loop {
        let avail = match r.fill_buf() {
            Ok(a) => a,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(None);
        }
        let (used, line) = part
            .feed(avail, cap)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        r.consume(used);
        if line.is_some() {
            return Ok(line);
        }
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

/// Starts the control thread if the process runs under a ckpt agent ([`SOCKET_ENV`] set).
pub fn start<V: Verbs + 'static>(shared: &Arc<Shared<V>>) -> Option<std::thread::JoinHandle<()>> {
    start_at(shared, PathBuf::from(std::env::var_os(SOCKET_ENV)?))
}

/// Starts the control thread for the agent socket `socket`.
pub fn start_at<V: Verbs + 'static>(
    shared: &Arc<Shared<V>>,
    socket: PathBuf,
) -> Option<std::thread::JoinHandle<()>> {
    let shared = shared.clone();
    std::thread::Builder::new()
        .name("ib-quiesce".into())
        .spawn(move || control_loop(&shared, &socket))
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

/// The control thread: connected to the agent while the channel is up; after a quiesce,
/// disconnected until the agent raises the rebuild flag. It lives as long as the process.
fn control_loop<V: Verbs + 'static>(shared: &Shared<V>, socket: &Path) {
    let pid = std::process::id() as i32;
    let flag = flag_path(socket, pid);
    let mut down = false;
    loop {
        if down {
            while !flag.exists() {
                std::thread::sleep(FLAG_POLL);
            }
        }
        let Ok(mut stream) = UnixStream::connect(socket) else {
            std::thread::sleep(if down {
                FLAG_POLL
            } else {
                Duration::from_secs(1)
            });
            continue;
        };
        let (channel, qps, mrs) = shared.peek(|c| {
            let (q, m) = c.counts();
            (c.id(), q, m)
        });
        let hello = ToAgent::Hello {
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
            let reply = match ToChannel::decode(&line) {
                Err(e) => ToAgent::Failed {
                    error: format!("unreadable command: {e}"),
                },
                Ok(ToChannel::Quiesce { timeout_ms }) => {
                    let t = Instant::now();
                    match shared.quiesce(Duration::from_millis(timeout_ms)) {
                        Ok(report) => {
                            down = true;
                            let _ = send(
                                &mut stream,
                                &ToAgent::Quiesced {
                                    report,
                                    micros: micros(t),
                                },
                            );
                            // Both descriptors close here; the agent waits for the EOF
                            // before it freezes the process.
                            break;
                        }
                        Err(e) => {
                            down = shared.peek(|c| c.state()) == State::Down;
                            ToAgent::Failed {
                                error: e.to_string(),
                            }
                        }
                    }
                }
                Ok(ToChannel::Resume) => match shared.resume() {
                    Ok(()) => ToAgent::Resumed,
                    Err(e) => ToAgent::Failed {
                        error: e.to_string(),
                    },
                },
                Ok(ToChannel::Rebuild) => {
                    let t = Instant::now();
                    match shared.rebuild() {
                        Ok((endpoints, peers)) => ToAgent::Rebuilt {
                            endpoints,
                            peers: Some(peers),
                            micros: micros(t),
                        },
                        Err(e) => ToAgent::Failed {
                            error: e.to_string(),
                        },
                    }
                }
                Ok(ToChannel::Reconnect { endpoints }) => {
                    let t = Instant::now();
                    match shared.reconnect(&endpoints) {
                        Ok(()) => {
                            down = false;
                            ToAgent::Reconnected { micros: micros(t) }
                        }
                        Err(e) => ToAgent::Failed {
                            error: e.to_string(),
                        },
                    }
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{Fabric, FakeVerbs};
    use crate::verbs::{QpCaps, RecvWr, SendOp, SendWr, Sge};
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::AtomicBool;

    const CAPS: QpCaps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_sge: 1,
    };

    struct Rank {
        shared: Arc<Shared<FakeVerbs>>,
        buf: Box<[u8; 64]>,
        key: u32,
        cq: u32,
        qp: u32,
    }

    fn pair() -> (Fabric, Rank, Rank) {
        let f = Fabric::new();
        let mk = |id| {
            let mut ch = Channel::open(f.end(id), "").unwrap();
            let buf = Box::new([0u8; 64]);
            let key = ch.reg_mr(buf.as_ptr() as u64, 64, 0x7).unwrap();
            let cq = ch.create_cq(32).unwrap();
            let qp = ch.create_qp(cq, cq, CAPS).unwrap();
            (ch, buf, key, cq, qp)
        };
        let (mut a, mut b) = (mk(0), mk(1));
        let (ea, eb) = (a.0.endpoint(a.4).unwrap(), b.0.endpoint(b.4).unwrap());
        a.0.connect(a.4, eb).unwrap();
        b.0.connect(b.4, ea).unwrap();
        let rank = |(ch, buf, key, cq, qp): (Channel<FakeVerbs>, _, _, _, _)| Rank {
            shared: Shared::new(ch),
            buf,
            key,
            cq,
            qp,
        };
        (f, rank(a), rank(b))
    }

    /// An application thread that keeps sending and polling through the shared channel, and
    /// counts its calls, until told to stop.
    fn app(r: &Rank, stop: Arc<AtomicBool>, calls: Arc<AtomicU64>) -> std::thread::JoinHandle<()> {
        let (s, qp, cq, key) = (r.shared.clone(), r.qp, r.cq, r.key);
        let addr = r.buf.as_ptr() as u64;
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let wr = SendWr {
                    wr_id: n,
                    op: SendOp::Write {
                        remote_addr: 0,
                        rkey: crate::channel::MR_KEY_BASE,
                    },
                    sges: vec![Sge {
                        addr,
                        len: 8,
                        lkey: key,
                    }],
                    signaled: n % 4 == 0,
                };
                s.call(|c| c.post_send(qp, &wr)).unwrap();
                s.call(|c| c.poll_cq(cq, 16)).unwrap();
                calls.fetch_add(1, Ordering::Relaxed);
                n += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    }

    fn line<T: serde::de::DeserializeOwned>(r: &mut BufReader<UnixStream>) -> Option<T> {
        let mut l = String::new();
        (r.read_line(&mut l).ok()? > 0).then(|| serde_json::from_str(&l).expect("json"))
    }

    fn tell(s: &mut UnixStream, c: &ToChannel) {
        let mut v = serde_json::to_vec(c).unwrap();
        v.push(b'\n');
        s.write_all(&v).unwrap();
    }

    /// The agent's side of the protocol, by hand: hello, quiesce (then the channel hangs up),
    /// flag, hello again (down), rebuild, reconnect. Meanwhile the application thread is held
    /// at the gate and goes on afterwards.
    #[test]
    fn the_control_protocol_quiesces_and_rebuilds_while_the_application_waits() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("control.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        std::fs::create_dir_all(flag_dir(&socket)).unwrap();
        let (_f, a, b) = pair();
        let stop = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(AtomicU64::new(0));
        let worker = app(&a, stop.clone(), calls.clone());
        start_at(&a.shared, socket.clone()).unwrap();
        start_at(&b.shared, socket.clone()).unwrap();
        let accept = |listener: &UnixListener| {
            let (s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let hello: ToAgent = line(&mut r).unwrap();
            (s, r, hello)
        };
        let mut conns: Vec<_> = (0..2).map(|_| accept(&listener)).collect();
        for (_, _, h) in &conns {
            assert!(
                matches!(
                    h,
                    ToAgent::Hello {
                        down: false,
                        qps: 1,
                        mrs: 1,
                        ..
                    }
                ),
                "{h:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
        assert!(calls.load(Ordering::Relaxed) > 0, "the application runs");
        for (s, _, _) in &mut conns {
            tell(s, &ToChannel::Quiesce { timeout_ms: 5000 });
        }
        for (_, r, _) in &mut conns {
            let q: ToAgent = line(r).unwrap();
            assert!(matches!(q, ToAgent::Quiesced { .. }), "{q:?}");
            assert!(
                line::<ToAgent>(r).is_none(),
                "the channel hangs up after quiescing"
            );
        }
        let held = calls.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            calls.load(Ordering::Relaxed),
            held,
            "application calls wait at the gate"
        );
        assert_eq!(a.shared.peek(|c| c.state()), State::Down);
        // Both processes in one test: the flag is per pid, so both come back.
        std::fs::write(flag_path(&socket, std::process::id() as i32), b"").unwrap();
        let mut conns: Vec<_> = (0..2).map(|_| accept(&listener)).collect();
        let mut endpoints = Vec::new();
        let mut wants = Vec::new();
        for (s, r, h) in &mut conns {
            assert!(matches!(h, ToAgent::Hello { down: true, .. }), "{h:?}");
            tell(s, &ToChannel::Rebuild);
            match line::<ToAgent>(r).unwrap() {
                ToAgent::Rebuilt {
                    endpoints: e,
                    peers,
                    ..
                } => {
                    endpoints.extend(e);
                    wants.push(peers.expect("a channel names its peers"));
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(endpoints.len(), 2);
        // Each channel names the other's QP, and gets only that endpoint.
        assert_eq!(wants.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1]);
        assert_ne!(wants[0], wants[1]);
        for ((s, r, _), want) in conns.iter_mut().zip(&wants) {
            let mine: Vec<Endpoint> = endpoints
                .iter()
                .filter(|e| want.contains(&e.id))
                .cloned()
                .collect();
            assert_eq!(mine.len(), 1);
            tell(s, &ToChannel::Reconnect { endpoints: mine });
            let m: ToAgent = line(r).unwrap();
            assert!(matches!(m, ToAgent::Reconnected { .. }), "{m:?}");
        }
        let t = Instant::now();
        while calls.load(Ordering::Relaxed) <= held + 5 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the application resumes"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
        worker.join().unwrap();
        assert_eq!(a.shared.rebuilds(), 1);
    }

    /// A failed quiesce (the peer never answers the flush marker) leaves the channel up and the
    /// application running.
    #[test]
    fn a_quiesce_that_times_out_lets_the_application_run_on() {
        let (_f, a, _b) = pair();
        let r = a.shared.quiesce(Duration::from_millis(200));
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert_eq!(a.shared.peek(|c| c.state()), State::Up);
        let wr = RecvWr {
            wr_id: 1,
            sges: vec![Sge {
                addr: a.buf.as_ptr() as u64,
                len: 8,
                lkey: a.key,
            }],
        };
        a.shared.call(|c| c.post_recv(a.qp, &wr)).unwrap();
    }

    /// A command line longer than [`MAX_LINE`] closes the connection; the control thread then
    /// says hello to the agent again.
    #[test]
    fn an_over_long_command_closes_the_connection_and_the_channel_says_hello_again() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("control.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        std::fs::create_dir_all(flag_dir(&socket)).unwrap();
        let (_f, a, _b) = pair();
        start_at(&a.shared, socket).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        assert!(matches!(
            line::<ToAgent>(&mut r),
            Some(ToAgent::Hello { .. })
        ));
        let mut long = vec![b' '; MAX_LINE + 1];
        long.push(b'\n');
        // The channel may close while this is still being written.
        let _ = s.write_all(&long);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        assert_eq!(
            std::io::Read::read_to_end(&mut r, &mut rest).unwrap(),
            0,
            "closed without an answer"
        );
        let (s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut r = BufReader::new(s);
        assert!(matches!(
            line::<ToAgent>(&mut r),
            Some(ToAgent::Hello { down: false, .. })
        ));
    }

    #[test]
    fn a_line_over_the_cap_is_an_error_and_one_at_the_cap_is_not() {
        let mut input = vec![b'a'; 10];
        input.push(b'\n');
        input.extend_from_slice(&[b'b'; 11]);
        input.push(b'\n');
        let mut r = BufReader::with_capacity(4, &input[..]);
        let mut part = LineBuf::default();
        assert_eq!(
            read_line(&mut r, &mut part, 10).unwrap(),
            Some(vec![b'a'; 10])
        );
        let e = read_line(&mut r, &mut part, 10).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("10-byte cap"), "{e}");
    }

    /// One valid line of every message each side decodes.
    fn samples() -> Vec<Vec<u8>> {
        let endpoint = Endpoint {
            id: (7, 0x710000),
            rkeys: vec![(0x7100_0000, 42), (0x7100_0001, 43)],
            ..Endpoint::default()
        };
        let agent = [
            ToAgent::Hello {
                pid: 1,
                channel: 7,
                down: true,
                qps: 2,
                mrs: 3,
            },
            ToAgent::Quiesced {
                report: QuiesceReport::default(),
                micros: 5,
            },
            ToAgent::Rebuilt {
                endpoints: vec![endpoint.clone()],
                peers: Some(vec![(8, 0x710001)]),
                micros: 6,
            },
            ToAgent::Reconnected { micros: 7 },
            ToAgent::Resumed,
            ToAgent::Failed { error: "x".into() },
        ];
        let channel = [
            ToChannel::Quiesce { timeout_ms: 100 },
            ToChannel::Resume,
            ToChannel::Rebuild,
            ToChannel::Reconnect {
                endpoints: vec![endpoint],
            },
        ];
        agent
            .iter()
            .map(|m| serde_json::to_vec(m).unwrap())
            .chain(channel.iter().map(|c| serde_json::to_vec(c).unwrap()))
            .collect()
    }

    /// A change to a line: overwrite, insert or remove a byte at a position (modulo the length).
    #[derive(Debug, Clone)]
    enum Mutation {
        Set(usize, u8),
        Insert(usize, u8),
        Remove(usize),
        Truncate(usize),
    }

    fn mutation() -> impl proptest::strategy::Strategy<Value = Mutation> {
        use proptest::prelude::*;
        let byte = prop_oneof![
            Just(b'{'),
            Just(b'}'),
            Just(b'['),
            Just(b'"'),
            Just(b':'),
            Just(b'-'),
            Just(b'9'),
            Just(0xff),
            any::<u8>()
        ];
        prop_oneof![
            (any::<usize>(), byte.clone()).prop_map(|(i, b)| Mutation::Set(i, b)),
            (any::<usize>(), byte).prop_map(|(i, b)| Mutation::Insert(i, b)),
            any::<usize>().prop_map(Mutation::Remove),
            any::<usize>().prop_map(Mutation::Truncate),
        ]
    }

    fn mutate(mut line: Vec<u8>, ms: &[Mutation]) -> Vec<u8> {
        for m in ms {
            let n = line.len().max(1);
            match *m {
                Mutation::Set(i, b) if !line.is_empty() => line[i % n] = b,
                Mutation::Insert(i, b) => line.insert(i % (line.len() + 1), b),
                Mutation::Remove(i) if !line.is_empty() => {
                    line.remove(i % n);
                }
                Mutation::Truncate(i) => line.truncate(i % n),
                _ => {}
            }
        }
        line
    }

    /// Both decoders on any line: an error or a message, never a panic; a message decoded is
    /// encoded back to the same message.
    fn decode_both(line: &[u8]) {
        if let Ok(m) = ToAgent::decode(line) {
            assert_eq!(
                ToAgent::decode(&serde_json::to_vec(&m).unwrap()).unwrap(),
                m
            );
        }
        if let Ok(c) = ToChannel::decode(line) {
            assert_eq!(
                ToChannel::decode(&serde_json::to_vec(&c).unwrap()).unwrap(),
                c
            );
        }
        if let Err(e) = ToAgent::decode(line) {
            assert!(
                e.to_string().len() < 600,
                "the message quotes a bounded excerpt"
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        #[test]
        fn the_decoders_never_panic_on_random_lines(
            line in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2048),
        ) {
            decode_both(&line);
        }

        #[test]
        fn the_decoders_never_panic_on_mutated_messages(
            which in 0usize..10,
            ms in proptest::collection::vec(mutation(), 1..8),
        ) {
            let line = samples()[which].clone();
            decode_both(&mutate(line, &ms));
        }

        #[test]
        fn the_decoders_never_panic_on_deep_nesting(depth in 0usize..20_000, open in 0u8..3) {
            let c = [b'[', b'{', b'"'][open as usize];
            let mut line = b"{\"msg\":".to_vec();
            line.extend(std::iter::repeat_n(c, depth));
            decode_both(&line);
        }

        /// The channel's line reader, fed any bytes, returns exactly the lines within the cap
        /// and stops at the first longer one.
        #[test]
        fn the_channels_line_reader_splits_any_input_within_the_cap(
            input in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::strategy::Just(b'\n'),
                    proptest::prelude::any::<u8>()
                ],
                0..4096,
            ),
            cap in 0usize..512,
            chunk in 1usize..64,
        ) {
            let (want, too_long) = lines_within_cap(&input, cap);
            let mut r = BufReader::with_capacity(chunk, &input[..]);
            let mut part = LineBuf::default();
            let mut got = Vec::new();
            let ended_long = loop {
                match read_line(&mut r, &mut part, cap) {
                    Ok(Some(l)) => {
                        decode_both(&l);
                        got.push(l);
                    }
                    Ok(None) => break false,
                    Err(e) => {
                        proptest::prop_assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
                        break true;
                    }
                }
            };
            proptest::prop_assert_eq!((got, ended_long), (want, too_long));
        }
    }
}
