//! Connecting to ckptd's control socket.
use std::path::{Path, PathBuf};
use std::time::Duration;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::control_client::ControlClient;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Default control socket.
pub const DEFAULT_SOCKET: &str = "/run/ckpt/ckptd.sock";

/// How long a ckptd that accepted the connection has to answer the first call. A ckptd that is
/// stopped or hung still has its socket bound, and the kernel accepts connections for it: only
/// an answer shows that it serves.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// Connects to the control socket at `path`, or to the first that answers of a list
/// (`/run/ckpt/a.sock,/run/ckpt/b.sock`: ckptd with standbys on this machine, of which only the
/// active one serves). The error names every socket tried and why it was passed over.
pub async fn connect(path: &Path) -> Result<ControlClient<Channel>, String> {
    connect_within(path, ANSWER_WITHIN).await
}

async fn connect_within(path: &Path, within: Duration) -> Result<ControlClient<Channel>, String> {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    let paths: Vec<PathBuf> = path
        .to_string_lossy()
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| PathBuf::from(p.trim()))
        .collect();
    if paths.len() == 1 {
        return connect_one(&paths[0], within).await;
    }
    // All at once: a stopped ckptd early in the list costs nothing when another serves.
    let mut tries: FuturesUnordered<_> = paths
        .iter()
        .enumerate()
        .map(|(i, p)| async move { (i, connect_one(p, within).await) })
        .collect();
    let mut why = vec![String::new(); paths.len()];
    while let Some((i, r)) = tries.next().await {
        match r {
            Ok(c) => return Ok(c),
            Err(e) => why[i] = format!("{}: {e}", paths[i].display()),
        }
    }
    if why.is_empty() {
        return Err("no socket named".into());
    }
    Err(why.join("; "))
}

/// Connects to one socket and waits (bounded by `within`) for its ckptd to answer.
async fn connect_one(path: &Path, within: Duration) -> Result<ControlClient<Channel>, String> {
    let dial = path.to_path_buf();
    // The URI is required by the API but unused: the connector dials the socket.
    let channel = Endpoint::try_from("http://[::]:50051")
        .map_err(|e| e.to_string())?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let dial = dial.clone();
            async move {
                tokio::net::UnixStream::connect(dial)
                    .await
                    .map(TokioIo::new)
            }
        }))
        .await
        .map_err(|e| with_causes(&e))?;
    let mut c = ControlClient::new(channel);
    // Job 0 is never issued: any answer, a refusal included, shows that this ckptd serves.
    match tokio::time::timeout(within, c.status(pb::StatusRequest { job_id: 0 })).await {
        Err(_) => Err(format!(
            "the connection was accepted but ckptd did not answer within {} s \
             (stopped, hung, or a deposed standby)",
            within.as_secs()
        )),
        Ok(Err(s)) if s.code() == tonic::Code::Unavailable || s.code() == tonic::Code::Unknown => {
            Err(s.message().to_string())
        }
        Ok(_) => Ok(c),
    }
}

/// tonic's error says "transport error"; its causes say what happened.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg = format!("{msg}: {s}");
        src = s.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket that accepts connections and never answers (a stopped ckptd) is passed over
    /// within the bound, and the error says so; a missing one is named too.
    #[tokio::test]
    async fn a_socket_that_accepts_but_never_answers_is_passed_over_within_the_bound() {
        let dir = tempfile_dir();
        let silent = dir.join("silent.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&silent).unwrap();
        let missing = dir.join("missing.sock");
        let begin = std::time::Instant::now();
        let e = connect_one(&silent, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(e.contains("did not answer within"), "{e}");
        assert!(begin.elapsed() < Duration::from_secs(5));
        let list = PathBuf::from(format!("{},{}", missing.display(), silent.display()));
        let e = connect_within(&list, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(
            e.contains("missing.sock: ") && e.contains("silent.sock: "),
            "{e}"
        );
        assert!(e.contains("No such file"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("ckptctl-client-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
