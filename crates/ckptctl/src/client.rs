//! Connecting to ckptd's control socket.
use std::path::PathBuf;

use ckpt_proto::v1::control_client::ControlClient;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Default control socket.
pub const DEFAULT_SOCKET: &str = "/run/ckpt/ckptd.sock";

/// Connects to the control socket at `path`, or to the first that answers of a list
/// (`/run/ckpt/a.sock,/run/ckpt/b.sock`: ckptd with standbys on this machine, of which only the
/// active one serves).
pub async fn connect(path: PathBuf) -> Result<ControlClient<Channel>, tonic::transport::Error> {
    let paths: Vec<PathBuf> = path
        .to_string_lossy()
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| PathBuf::from(p.trim()))
        .collect();
    // The URI is required by the API but unused: the connector dials the socket.
    let channel = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let paths = paths.clone();
            async move {
                let mut last = std::io::Error::other("no socket named");
                for p in &paths {
                    match tokio::net::UnixStream::connect(p).await {
                        Ok(s) => return Ok(TokioIo::new(s)),
                        Err(e) if paths.len() == 1 => return Err(e),
                        Err(e) => {
                            last = std::io::Error::new(e.kind(), format!("{}: {e}", p.display()))
                        }
                    }
                }
                Err(last)
            }
        }))
        .await?;
    Ok(ControlClient::new(channel))
}
