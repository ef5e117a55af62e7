//! One connection to the control socket: the bounds on connections ([`Limits`], per-job slots),
//! line reading with a cap, and the request/answer calls on an identified channel.
use super::*;

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
pub(super) struct JobSlots(std::sync::Mutex<HashMap<u64, usize>>);

/// One connection's place in its job's count; given back on drop.
#[derive(Debug)]
pub(super) struct JobSlot {
    pub(super) job: u64,
    pub(super) slots: Arc<JobSlots>,
}

impl JobSlots {
    pub(super) fn take(self: &Arc<Self>, job: u64, limit: usize) -> Option<JobSlot> {
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
    pub(super) fn held(&self, job: u64) -> usize {
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
pub(super) enum LineError {
    TooLong(LineTooLong),
    Io(std::io::Error),
}

/// Lines of at most a cap. Cancel-safe: a line's part read so far stays in `part`, so a read
/// that timed out can be tried again.
pub(super) struct CappedLines<R> {
    pub(super) reader: R,
    pub(super) part: LineBuf,
}

impl<R: AsyncBufRead + Unpin> CappedLines<R> {
    pub(super) fn new(reader: R) -> Self {
        CappedLines {
            reader,
            part: LineBuf::default(),
        }
    }

    /// The next line, without its newline; `None` at the end of the stream (an unterminated
    /// last line is dropped).
    pub(super) async fn next_line(&mut self, cap: usize) -> Result<Option<Vec<u8>>, LineError> {
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

pub(super) struct Conn {
    pub(super) pid: i32,
    pub(super) channel: u64,
    /// Everything released and the connection closed: the process waits for its rebuild flag.
    pub(super) down: bool,
    /// A verbs layer that answered `drained`: connected, its objects alive, waiting for
    /// `release` (or `resume`). Not down.
    pub(super) drained: bool,
    /// After a rebuild, the peers whose endpoints the channel needs (sorted).
    pub(super) wants: Wants,
    /// None once the agent closed the connection (the channel sent a line over the cap).
    pub(super) io: Option<(CappedLines<BufReader<OwnedReadHalf>>, OwnedWriteHalf)>,
    /// The connection's place in its job's count.
    pub(super) _slot: JobSlot,
}

impl Conn {
    pub(super) async fn ask(
        &mut self,
        cmd: &ToChannel,
        timeout: Duration,
    ) -> Result<ToAgent, ChannelError> {
        let mut line = serde_json::to_vec(cmd).expect("serializable");
        line.push(b'\n');
        let (_, writer) = self.io.as_mut().ok_or(ChannelError::ShutByAgent)?;
        writer.write_all(&line).await.map_err(ChannelError::Send)?;
        self.reply(timeout, cmd.answer_cap()).await
    }

    /// The next message, of at most `cap` bytes; a channel's `failed` answer is an error. A
    /// longer line closes the connection.
    pub(super) async fn reply(
        &mut self,
        timeout: Duration,
        cap: usize,
    ) -> Result<ToAgent, ChannelError> {
        let (lines, _) = self.io.as_mut().ok_or(ChannelError::ShutByAgent)?;
        match tokio::time::timeout(timeout, lines.next_line(cap)).await {
            Err(_) => Err(ChannelError::Timeout(timeout)),
            Ok(Err(LineError::TooLong(e))) => {
                warn!(
                    pid = self.pid,
                    cap = e.cap,
                    "ib-quiesce channel sent a line over the cap; connection closed"
                );
                self.io = None;
                Err(ChannelError::TooLong { cap: e.cap })
            }
            Ok(Err(LineError::Io(e))) => Err(ChannelError::Io(e)),
            Ok(Ok(None)) => Err(ChannelError::Closed),
            Ok(Ok(Some(l))) => match ToAgent::decode(&l).map_err(ChannelError::Malformed)? {
                ToAgent::Failed { error } => Err(ChannelError::Failed(error)),
                m => Ok(m),
            },
        }
    }
}

/// Where a `quiesce` or `release` left a channel: what it drained and kept, and how long it
/// took.
pub(super) enum Stage {
    /// Everything released and the connection closed: down until rebuilt.
    Released(QuiesceReport, Duration),
    /// A verbs layer drained with its objects alive, still connected: it waits for `release`
    /// (or `resume`).
    Drained(QuiesceReport, Duration),
}

impl Conn {
    /// Sends `cmd` (`quiesce` or `release`) and takes its answer within `wait`. `quiesced`: the
    /// channel released everything and closes its socket next, so that the snapshot holds
    /// none; that close is waited for too (also within `wait`), and the connection is then
    /// down. `drained` (to a `quiesce` only): the connection stays up, marked drained.
    pub(super) async fn quiesce_stage(
        &mut self,
        cmd: &ToChannel,
        wait: Duration,
    ) -> Result<Stage, ChannelError> {
        let release = matches!(cmd, ToChannel::Release);
        if release && !self.drained {
            return Err(ChannelError::NotDrained);
        }
        match self.ask(cmd, wait).await? {
            ToAgent::Quiesced { report, micros } => {
                self.closes_after_quiesced(wait).await?;
                Ok(Stage::Released(report, Duration::from_micros(micros)))
            }
            ToAgent::Drained { report, micros } if !release => {
                self.drained = true;
                Ok(Stage::Drained(report, Duration::from_micros(micros)))
            }
            other => Err(unexpected(other)),
        }
    }

    /// After a `quiesced` answer: waits (within `wait`) for the end of the stream, then marks
    /// the connection down.
    pub(super) async fn closes_after_quiesced(
        &mut self,
        wait: Duration,
    ) -> Result<(), ChannelError> {
        match self.reply(wait, MAX_LINE).await {
            Err(ChannelError::Closed) => {
                self.down = true;
                self.drained = false;
                Ok(())
            }
            Err(e) => Err(ChannelError::NotDisconnected(Box::new(e))),
            Ok(m) => Err(ChannelError::SaidAfterQuiesced(Box::new(m))),
        }
    }
}

pub(super) fn unexpected(m: ToAgent) -> ChannelError {
    ChannelError::Unexpected(Box::new(m))
}
