//! The agent's side of ib-quiesce: a Unix socket where every job process that opened an
//! ib-quiesce channel says hello, and the calls that drive those channels around a checkpoint
//! (see `ib_quiesce::control` for the protocol).
//!
//! Quiesce asks every channel of the job's processes at once (their flush handshakes need each
//! other), then waits for each to close its connection, so the snapshot holds none. Rebuild
//! raises each channel's flag, waits for its hello, has it recreate its objects and returns
//! their endpoints; reconnect hands every endpoint of the job (gathered by the coordinator
//! from all nodes) to each channel.
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use ib_quiesce::channel::QpId;
use ib_quiesce::control::{flag_path, ToAgent, ToChannel};
use ib_quiesce::{Endpoint, QuiesceReport};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex;
use tracing::{info, warn};

/// How long a new connection has to say hello.
const HELLO: Duration = Duration::from_secs(5);

/// What a node's channels published after a rebuild: their new endpoints, and the peer QPs
/// whose endpoints they need back (None: a channel did not say; it gets all of the job's).
pub type Rebuilt = (Vec<Endpoint>, Option<Vec<QpId>>);

struct Conn {
    channel: u64,
    down: bool,
    /// After a rebuild, the peer QPs whose endpoints the channel needs (None: all).
    wants: Option<Vec<QpId>>,
    lines: Lines<BufReader<OwnedReadHalf>>,
    writer: OwnedWriteHalf,
}

impl Conn {
    async fn ask(&mut self, cmd: &ToChannel, timeout: Duration) -> Result<ToAgent, String> {
        let mut line = serde_json::to_vec(cmd).expect("serializable");
        line.push(b'\n');
        self.writer
            .write_all(&line)
            .await
            .map_err(|e| format!("cannot reach the channel: {e}"))?;
        self.reply(timeout).await
    }

    /// The next message; a channel's `failed` answer is an error.
    async fn reply(&mut self, timeout: Duration) -> Result<ToAgent, String> {
        match tokio::time::timeout(timeout, self.lines.next_line()).await {
            Err(_) => Err(format!("no answer within {timeout:?}")),
            Ok(Err(e)) => Err(format!("connection failed: {e}")),
            Ok(Ok(None)) => Err("the process closed its channel (did it exit?)".into()),
            Ok(Ok(Some(l))) => {
                match serde_json::from_str(&l)
                    .map_err(|e| format!("unreadable answer {l:?}: {e}"))?
                {
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
}

impl std::fmt::Debug for Channels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channels")
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

impl Channels {
    /// The registry for the control socket at `socket` (not yet listening).
    pub fn new(socket: PathBuf) -> Arc<Self> {
        Arc::new(Channels {
            socket,
            conns: Mutex::new(HashMap::new()),
        })
    }

    /// The control socket's path (what job processes find in `CKPT_IBQ_SOCKET`).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Binds the control socket (replacing a stale one), readable by every job's user.
    pub fn bind(&self) -> std::io::Result<UnixListener> {
        let dir = self.socket.parent().unwrap_or(Path::new("/"));
        let flags = ib_quiesce::control::flag_dir(&self.socket);
        std::fs::create_dir_all(&flags)?;
        for d in [dir, flags.as_path()] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
        }
        // Flags of an earlier agent are stale: their channels reconnect when raised again.
        for e in std::fs::read_dir(&flags)?.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        let _ = std::fs::remove_file(&self.socket);
        let l = UnixListener::bind(&self.socket)?;
        std::fs::set_permissions(&self.socket, std::fs::Permissions::from_mode(0o777))?;
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
            tokio::spawn(async move {
                if let Err(e) = me.hello(stream).await {
                    warn!(error = %e, "ib-quiesce channel refused");
                }
            });
        }
    }

    async fn hello(&self, stream: UnixStream) -> Result<(), String> {
        let cred = stream.peer_cred().map_err(|e| e.to_string())?;
        let pid = cred.pid().ok_or("peer without a pid")?;
        let (r, writer) = stream.into_split();
        let mut lines = BufReader::new(r).lines();
        let first = tokio::time::timeout(HELLO, lines.next_line())
            .await
            .map_err(|_| format!("pid {pid} said nothing within {HELLO:?}"))?
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("pid {pid} closed without a hello"))?;
        let ToAgent::Hello {
            pid: claimed,
            channel,
            down,
            qps,
            mrs,
        } = serde_json::from_str(&first).map_err(|e| format!("pid {pid}: {e}"))?
        else {
            return Err(format!("pid {pid}: first message is not a hello"));
        };
        if claimed != pid {
            return Err(format!("pid {pid} claims to be pid {claimed}"));
        }
        if down {
            let _ = std::fs::remove_file(flag_path(&self.socket, pid));
        }
        info!(
            pid,
            channel = format_args!("{channel:#x}"),
            down,
            qps,
            mrs,
            "ib-quiesce channel registered"
        );
        let conn = Conn {
            channel,
            down,
            wants: None,
            lines,
            writer,
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
                    match c.reply(wait).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry serving on a temporary socket, and a "process" (this test) whose channel says
    /// hello and then exits without answering.
    #[test]
    fn a_channel_whose_process_died_fails_the_quiesce_and_a_missing_one_the_rebuild() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let ch = Channels::new(dir.path().join("ibq").join("control.sock"));
            let listener = ch.bind().unwrap();
            tokio::spawn(ch.clone().serve(listener));
            let pid = std::process::id() as i32;
            let mut s = UnixStream::connect(ch.socket()).await.unwrap();
            let hello = ToAgent::Hello {
                pid,
                channel: 7,
                down: false,
                qps: 1,
                mrs: 1,
            };
            let mut line = serde_json::to_vec(&hello).unwrap();
            line.push(b'\n');
            s.write_all(&line).await.unwrap();
            for _ in 0..200 {
                if !ch.up(&[pid]).await.is_empty() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
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
