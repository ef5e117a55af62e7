//! A new connection's hello: read within [`HELLO`], checked (the pid the kernel gave) and
//! registered; a refusal is logged.
use super::*;

impl Channels {
    /// Logs the refusal of the hello of `peer` (of job `job`).
    pub(super) fn refused_hello(&self, peer: Peer, job: u64, e: &HelloError) {
        warn!(
            pid = peer.pid,
            uid = peer.uid,
            job,
            reason = %e,
            "ib-quiesce channel refused"
        );
    }

    /// Reads the hello of `pid` (of job `job`) on `stream` and registers its channel.
    pub(super) async fn hello(
        &self,
        stream: UnixStream,
        pid: i32,
        job: u64,
        slot: JobSlot,
        process: &Arc<PeerProcess>,
    ) -> Result<Arc<Mutex<Conn>>, HelloError> {
        let (r, writer) = stream.into_split();
        let mut lines = CappedLines::new(BufReader::new(r));
        let first = match tokio::time::timeout(HELLO, lines.next_line(MAX_LINE)).await {
            Err(_) => return Err(HelloError::Silent { pid, wait: HELLO }),
            Ok(Err(LineError::TooLong(e))) => return Err(HelloError::TooLong { pid, cap: e.cap }),
            Ok(Err(LineError::Io(source))) => return Err(HelloError::Io { pid, source }),
            Ok(Ok(None)) => return Err(HelloError::Closed { pid }),
            Ok(Ok(Some(l))) => l,
        };
        let ToAgent::Hello {
            pid: claimed,
            channel,
            down,
            qps,
            mrs,
            ..
        } = ToAgent::decode(&first).map_err(|source| HelloError::Malformed { pid, source })?
        else {
            return Err(HelloError::NotHello {
                pid,
                excerpt: excerpt(&first),
            });
        };
        if claimed != pid {
            return Err(HelloError::Impostor { pid, claimed });
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
            drained: false,
            wants: None,
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
        Ok(conn)
    }
}
