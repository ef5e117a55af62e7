//! Connecting to ckptd's control socket.
use std::path::PathBuf;

use ckpt_proto::v1::control_client::ControlClient;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Default control socket.
pub const DEFAULT_SOCKET: &str = "/run/ckpt/ckptd.sock";

/// Connects to the control socket at `path`.
pub async fn connect(path: PathBuf) -> Result<ControlClient<Channel>, tonic::transport::Error> {
    // The URI is required by the API but unused: the connector dials the socket.
    let channel = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await?;
    Ok(ControlClient::new(channel))
}
