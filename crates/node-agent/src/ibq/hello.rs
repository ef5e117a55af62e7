//! A new connection's hello: read within [`HELLO`], checked (the pid the kernel gave, the
//! protocol version) and registered; a refusal is logged, a version refusal once per process.
use super::*;

/// How many processes refused for their protocol version are remembered, so that the warning
/// is logged once per process (its control thread tries again every second). A node runs a
/// few hundred job processes; past this the memory starts again, and a process is warned about
/// once more.
const VERSION_WARNED_MAX: usize = 4096;

/// The processes already warned about for their hello's protocol version, with that version.
#[derive(Debug, Default)]
pub(super) struct VersionWarned(std::sync::Mutex<HashMap<i32, u32>>);

impl VersionWarned {
    /// Whether the refusal of `pid` for version `layer` is news (not logged as such before).
    pub(super) fn first(&self, pid: i32, layer: u32) -> bool {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= VERSION_WARNED_MAX {
            m.clear();
        }
        m.insert(pid, layer) != Some(layer)
    }
}

impl Channels {
    /// Logs the refusal of the hello of `peer` (of job `job`).
    pub(super) fn refused_hello(&self, peer: Peer, job: u64, e: &HelloError) {
        match *e {
            HelloError::Version { pid, layer, agent } if !self.version_warned.first(pid, layer) => {
                debug!(
                    pid,
                    job,
                    layer_version = layer,
                    agent_version = agent,
                    "ib-quiesce channel refused again: protocol version"
                );
            }
            HelloError::Version { layer, agent, .. } => warn!(
                pid = peer.pid,
                uid = peer.uid,
                job,
                layer_version = layer,
                agent_version = agent,
                reason = %e,
                "ib-quiesce channel refused"
            ),
            _ => warn!(
                pid = peer.pid,
                uid = peer.uid,
                job,
                reason = %e,
                "ib-quiesce channel refused"
            ),
        }
    }

    /// Reads the hello of `pid` (of job `job`) on `stream` and registers its channel; or, if
    /// the connection was made for a lookup, answers it (None).
    pub(super) async fn hello(
        &self,
        stream: UnixStream,
        pid: i32,
        job: u64,
        slot: JobSlot,
        process: &Arc<PeerProcess>,
    ) -> Result<Option<Arc<Mutex<Conn>>>, HelloError> {
        let (r, mut writer) = stream.into_split();
        let mut lines = CappedLines::new(BufReader::new(r));
        let first = match tokio::time::timeout(HELLO, lines.next_line(MAX_LINE)).await {
            Err(_) => return Err(HelloError::Silent { pid, wait: HELLO }),
            Ok(Err(LineError::TooLong(e))) => return Err(HelloError::TooLong { pid, cap: e.cap }),
            Ok(Err(LineError::Io(source))) => return Err(HelloError::Io { pid, source }),
            Ok(Ok(None)) => return Err(HelloError::Closed { pid }),
            Ok(Ok(Some(l))) => l,
        };
        // Read before the whole message: a hello of another version may differ in its fields.
        match hello_version(&first) {
            Some(PROTOCOL_VERSION) | None => {}
            Some(layer) => return Err(HelloError::version(pid, layer)),
        }
        let (claimed, channel, down, qps, mrs) = match ToAgent::decode(&first)
            .map_err(|source| HelloError::Malformed { pid, source })?
        {
            ToAgent::Hello {
                pid: claimed,
                channel,
                down,
                qps,
                mrs,
                ..
            } => (claimed, channel, down, qps, mrs),
            ToAgent::Lookup {
                pid: claimed,
                addresses,
                ..
            } => {
                check_claim(pid, claimed)?;
                self.answer_lookup(&mut writer, pid, job, &addresses)
                    .await?;
                return Ok(None);
            }
            _ => {
                return Err(HelloError::NotHello {
                    pid,
                    excerpt: excerpt(&first),
                })
            }
        };
        check_claim(pid, claimed)?;
        if down {
            self.lower_flags([pid]);
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
            drained: false,
            wants: Wants::All,
            io: Some((lines, writer)),
            _slot: slot,
        };
        let conn = Arc::new(Mutex::new(conn));
        let mut map = self.conns.lock().await;
        // One live process has one PID: a live entry of another job for it cannot be this
        // process's, and is not replaced.
        if let Some(other) = map.get(&pid).filter(|r| r.job != job && r.process.alive()) {
            return Err(HelloError::OtherJob {
                pid,
                job,
                other: other.job,
            });
        }
        map.insert(
            pid,
            Registered {
                conn: conn.clone(),
                process: process.clone(),
                job,
            },
        );
        Ok(Some(conn))
    }
}

/// Whether `claimed`, the pid a first message says, is `pid`, the kernel's: as the process
/// knows itself (in a job sandbox, by its PID in the sandbox's namespace).
fn check_claim(pid: i32, claimed: i32) -> Result<(), HelloError> {
    let known_as = FlagFor::of_process(pid);
    if claimed != pid && known_as.map(|w| w.pid) != Some(claimed) {
        return Err(HelloError::Impostor { pid, claimed });
    }
    Ok(())
}
