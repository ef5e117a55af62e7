//! The ckptd daemon: both gRPC services on their listeners until shutdown.
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use ckpt_proto::v1::control_server::ControlServer;
use ckpt_proto::v1::registry_server::RegistryServer;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tracing::info;

use crate::driver::Coordinator;
use crate::grpc::{ControlHandler, RegistryHandler};

/// Binds the control socket: removes a stale socket file, creates the directory, and makes the
/// socket connectable by every user (each request is authorized by the caller's uid).
pub fn bind_control_socket(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(l)
}

/// Serves the Registry service to agents on `agents` (TLS with the coordinator's credential;
/// none for a standalone ckptd without one), and the Control service on the Unix socket
/// `control` — together with the Registry service, which a standalone ckptd's own agent and the
/// `ckpt-rsh` of its jobs reach there — until `shutdown` resolves.
pub async fn run(
    coord: Arc<Coordinator>,
    agents: Option<(TcpListener, Arc<rustls::ServerConfig>)>,
    control: UnixListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (tx, rx) = watch::channel(false);
    let mut rx2 = rx.clone();
    let mut rx3 = rx.clone();
    let mut rx1 = rx;
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(true);
    });
    tokio::spawn(coord.clone().schedule(rx2.clone()));
    tokio::spawn(coord.clone().watch_nodes(rx2.clone()));
    let reg_coord = coord.clone();
    let reg = async move {
        let Some((agents, tls)) = agents else {
            info!("no cluster credential: serving this machine only, on local sockets");
            return Ok(());
        };
        info!(agents = %agents.local_addr().map(|a| a.to_string()).unwrap_or_default(), "ckptd listening (TLS)");
        tonic::transport::Server::builder()
            .add_service(RegistryServer::new(RegistryHandler::new(reg_coord)))
            .serve_with_incoming_shutdown(
                ckpt_auth::transport::tls_incoming(agents, tls),
                async move {
                    let _ = rx1.wait_for(|v| *v).await;
                },
            )
            .await
    };
    let ctl = tonic::transport::Server::builder()
        .add_service(ControlServer::new(ControlHandler::new(coord.clone())))
        .add_service(RegistryServer::new(RegistryHandler::new(coord)))
        .serve_with_incoming_shutdown(ckpt_auth::transport::unix_incoming(control), async move {
            let _ = rx2.wait_for(|v| *v).await;
        });
    // Calls in flight (a `--wait` stream, an epoch) get SHUTDOWN_GRACE to end, not longer: the
    // agents' leases run while ckptd is away, and a restart must be back within them. An epoch
    // cut short is aborted when ckptd starts again.
    let served = async {
        let (a, b) = tokio::join!(reg, ctl);
        a.and(b)
    };
    tokio::select! {
        r = served => r,
        _ = async {
            let _ = rx3.wait_for(|v| *v).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            info!("calls still in flight at shutdown were cut short");
            Ok(())
        }
    }
}

/// How long calls in flight may take to end once ckptd is asked to stop.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_millis(500);
