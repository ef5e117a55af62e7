//! TLS under tonic: authenticated incoming connections for servers, TLS or Unix-socket channels
//! for clients.
//!
//! A server's listener is wrapped by [`tls_incoming`]: every accepted TCP connection does its
//! TLS handshake in a task of its own (bounded in time and in number, so that a peer that never
//! finishes cannot hold the daemon), and only completed handshakes reach tonic, each with the
//! [`PeerInfo`] its certificate proved. Handlers read it with [`crate::peer_of`].
//!
//! Clients name where to dial as `host:port` (TLS over TCP, checking that the server is the
//! identity they meant) or `unix:/path` (a socket in a root-only directory of this machine:
//! the standalone daemon's embedded agent, which therefore opens no TCP port at all).
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::ca::CLUSTER_NAME;
use crate::{cert, Peer, PeerInfo};

/// A TLS handshake takes a few round trips; a peer that has not finished in this long is not
/// going to, and its slot is better given to the next one.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once on one listener. Daemons connect a handful of times per
/// node; the bound only keeps unauthenticated peers from opening connections without limit.
pub const MAX_PENDING_HANDSHAKES: usize = 256;

/// A server-side connection whose TLS handshake completed.
#[derive(Debug)]
pub struct TlsConn {
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    info: PeerInfo,
}

impl Connected for TlsConn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

/// Implements `AsyncRead` and `AsyncWrite` for a connection type by forwarding to its
/// `stream` field.
macro_rules! forward_io {
    ($t:ty, $($bound:tt)*) => {
        impl<$($bound)*> AsyncRead for $t {
            fn poll_read(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                Pin::new(&mut self.stream).poll_read(cx, buf)
            }
        }

        impl<$($bound)*> AsyncWrite for $t {
            fn poll_write(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                Pin::new(&mut self.stream).poll_write(cx, buf)
            }

            fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                Pin::new(&mut self.stream).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<io::Result<()>> {
                Pin::new(&mut self.stream).poll_shutdown(cx)
            }

            fn poll_write_vectored(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.stream.is_write_vectored()
            }
        }
    };
}

forward_io!(TlsConn,);

/// Connections one daemon listener keeps open at once, and from one peer (an address over
/// TCP, a uid on a Unix socket; root is not counted there). A connection costs a descriptor and
/// a task: without a bound, one user holding connections open runs the daemon out of
/// descriptors and nobody else is answered. A job's launcher node may hold one connection per
/// remote part (its `ckpt-rsh`), so the bound per address stays far above a job's node count;
/// the daemons raise their open-file limit well above the total
/// (`ckpt_daemon::raise_open_files`).
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// At once on the listener.
    pub total: usize,
    /// At once from one peer.
    pub per_peer: usize,
}

impl ConnLimits {
    /// A daemon's TCP (TLS) listener.
    pub const TCP: ConnLimits = ConnLimits {
        total: 16_384,
        per_peer: 4_096,
    };
    /// ckptd's control socket (users' ckptctl, jobs' ckpt-rsh of a standalone ckptd).
    pub const LOCAL: ConnLimits = ConnLimits {
        total: 4_096,
        per_peer: 256,
    };
}

/// The open connections of one listener, by peer.
#[derive(Debug)]
struct Counts {
    limits: ConnLimits,
    by_peer: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    total: std::sync::atomic::AtomicUsize,
}

impl Counts {
    fn new(limits: ConnLimits) -> Arc<Self> {
        Arc::new(Counts {
            limits,
            by_peer: std::sync::Mutex::default(),
            total: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// A place for one more connection of `peer` (None: not counted per peer), if there is one.
    fn admit(self: &Arc<Self>, peer: Option<String>) -> Option<Place> {
        use std::sync::atomic::Ordering;
        let mut map = self.by_peer.lock().expect("connection counts");
        if self.total.load(Ordering::Relaxed) >= self.limits.total {
            return None;
        }
        if let Some(p) = &peer {
            let n = map.entry(p.clone()).or_insert(0);
            if *n >= self.limits.per_peer {
                return None;
            }
            *n += 1;
        }
        self.total.fetch_add(1, Ordering::Relaxed);
        Some(Place {
            counts: self.clone(),
            peer,
        })
    }
}

/// One connection's place in its listener's counts, given back when the connection closes.
#[derive(Debug)]
pub struct Place {
    counts: Arc<Counts>,
    peer: Option<String>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut map = self.counts.by_peer.lock().expect("connection counts");
        if let Some(p) = &self.peer {
            if let Some(n) = map.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    map.remove(p);
                }
            }
        }
        self.counts
            .total
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A connection holding its [`Place`]: what tonic serves, as the connection itself.
#[derive(Debug)]
pub struct Counted<S> {
    stream: S,
    _place: Place,
}

impl<S: Connected> Connected for Counted<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> S::ConnectInfo {
        self.stream.connect_info()
    }
}

forward_io!(Counted<S>, S: AsyncRead + AsyncWrite + Unpin);

/// The connections of a Unix socket `listener`, for `Server::serve_with_incoming*`, within
/// [`ConnLimits::LOCAL`] (per uid, from `SO_PEERCRED`; root's are counted in the total only).
/// A connection beyond a bound is closed at once, with a warning naming the uid.
pub fn unix_incoming(
    listener: tokio::net::UnixListener,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Counted<tokio::net::UnixStream>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let counts = Counts::new(ConnLimits::LOCAL);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                a = listener.accept() => a,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let uid = stream.peer_cred().map(|c| c.uid()).ok();
            let key = match uid {
                Some(0) => None,
                Some(u) => Some(u.to_string()),
                None => Some("unknown".to_string()),
            };
            let Some(place) = counts.admit(key) else {
                tracing::warn!(
                    uid,
                    total = ConnLimits::LOCAL.total,
                    per_user = ConnLimits::LOCAL.per_peer,
                    "too many connections on the local socket: connection closed"
                );
                continue;
            };
            if tx
                .send(Ok(Counted {
                    stream,
                    _place: place,
                }))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// The authenticated connections of `listener`, for `Server::serve_with_incoming*`. Accepting
/// stops when the stream is dropped (the server shut down), which closes the listener.
pub fn tls_incoming(
    listener: TcpListener,
    config: Arc<ServerConfig>,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Counted<TlsConn>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_PENDING_HANDSHAKES));
    let counts = Counts::new(ConnLimits::TCP);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (tcp, addr) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, or a connection reset before accept: not fatal.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            // Counted from accept to close, handshake included, per address.
            let Some(place) = counts.admit(Some(addr.ip().to_string())) else {
                tracing::warn!(%addr, total = ConnLimits::TCP.total, per_address = ConnLimits::TCP.per_peer, "too many connections: connection closed");
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::warn!(%addr, limit = MAX_PENDING_HANDSHAKES, "too many TLS handshakes in progress: connection dropped");
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            let place = place;
            tokio::spawn(async move {
                let _slot = slot;
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let peer = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .and_then(|c| cert::identity_of(c))
                            .map_or(Peer::Anonymous, Peer::Daemon);
                        let info = PeerInfo {
                            peer,
                            addr: Some(addr),
                        };
                        let conn = Counted {
                            stream: TlsConn { stream, info },
                            _place: place,
                        };
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%addr, error = %e, "TLS handshake refused");
                    }
                    Err(_) => {
                        tracing::warn!(%addr, "TLS handshake did not finish in time");
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// How a client reaches a server: TLS (with the configuration that says whom it expects), or
/// a Unix socket of this machine.
#[derive(Debug, Clone)]
pub enum Dial {
    /// TLS over TCP to `host:port`.
    Tls(Arc<ClientConfig>),
    /// Only `unix:/path` addresses (no credential at hand, e.g. the standalone daemon).
    LocalOnly,
}

/// Where an address points.
enum Target {
    Tcp(String),
    Unix(std::path::PathBuf),
}

fn target(addr: &str) -> Target {
    match addr.strip_prefix("unix:") {
        Some(p) => Target::Unix(p.into()),
        None => Target::Tcp(addr.to_string()),
    }
}

/// A channel to `addr` (`host:port` or `unix:/path`) that connects when first used.
pub fn channel(addr: &str, dial: Dial, connect_timeout: Duration) -> Result<Channel, String> {
    Ok(endpoint(addr)?.connect_with_connector_lazy(connector(addr, dial, connect_timeout)))
}

/// A channel to `addr` (`host:port` or `unix:/path`), connected now.
pub async fn connect(addr: &str, dial: Dial, connect_timeout: Duration) -> Result<Channel, String> {
    endpoint(addr)?
        .connect_with_connector(connector(addr, dial, connect_timeout))
        .await
        .map_err(|e| {
            // tonic's error says "transport error"; the cause says what happened.
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg = format!("{msg}: {s}");
                src = s.source();
            }
            format!("cannot reach {addr}: {msg}")
        })
}

fn endpoint(addr: &str) -> Result<Endpoint, String> {
    // The URI only fills HTTP/2's :authority; the connector dials `addr` itself.
    let first = addresses(addr).into_iter().next().unwrap_or_default();
    let uri = match target(&first) {
        Target::Tcp(a) => format!("http://{a}"),
        Target::Unix(_) => "http://localhost".into(),
    };
    Endpoint::from_shared(uri).map_err(|e| format!("bad address {addr:?}: {e}"))
}

/// The addresses of a list (`a:7600,b:7600`): a server with standbys, of which one serves.
pub fn addresses(addr: &str) -> Vec<String> {
    addr.split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(String::from)
        .collect()
}

type Io = TokioIo<Pin<Box<dyn IoStream>>>;

/// A byte stream a channel runs over.
trait IoStream: AsyncRead + AsyncWrite + Send {}
impl<T: AsyncRead + AsyncWrite + Send> IoStream for T {}

/// Dials `addr`: one address, or a list of which the first that answers serves (an active
/// ckptd among standbys, which listen on nothing). The one that answered is tried first next
/// time.
fn connector(
    addr: &str,
    dial: Dial,
    connect_timeout: Duration,
) -> impl tower::Service<
    Uri,
    Response = Io,
    Error = io::Error,
    Future = Pin<Box<dyn std::future::Future<Output = io::Result<Io>> + Send>>,
> + Clone {
    let addrs = Arc::new(addresses(addr));
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    tower::service_fn(move |_: Uri| {
        let (addrs, answered, dial) = (addrs.clone(), answered.clone(), dial.clone());
        Box::pin(async move {
            let first = answered.load(std::sync::atomic::Ordering::Relaxed);
            let mut errors = Vec::new();
            for i in 0..addrs.len() {
                let at = (first + i) % addrs.len();
                match dial_one(&addrs[at], dial.clone(), connect_timeout).await {
                    Ok(io) => {
                        answered.store(at, std::sync::atomic::Ordering::Relaxed);
                        return Ok(io);
                    }
                    Err(e) if addrs.len() == 1 => return Err(e),
                    Err(e) => errors.push(format!("{}: {e}", addrs[at])),
                }
            }
            Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                if errors.is_empty() {
                    "no address to dial".to_string()
                } else {
                    errors.join("; ")
                },
            ))
        }) as Pin<Box<dyn std::future::Future<Output = io::Result<Io>> + Send>>
    })
}

/// Dials one address, within `connect_timeout`.
async fn dial_one(addr: &str, dial: Dial, connect_timeout: Duration) -> io::Result<Io> {
    let fut = async move {
        match (target(addr), dial) {
            (Target::Unix(p), _) => {
                let s = tokio::net::UnixStream::connect(&p).await?;
                Ok(TokioIo::new(Box::pin(s) as Pin<Box<dyn IoStream>>))
            }
            (Target::Tcp(a), Dial::Tls(cfg)) => {
                let tcp = TcpStream::connect(&a).await?;
                let _ = tcp.set_nodelay(true);
                let name = ServerName::try_from(CLUSTER_NAME).expect("a valid DNS name");
                let tls = tokio_rustls::TlsConnector::from(cfg)
                    .connect(name, tcp)
                    .await?;
                Ok(TokioIo::new(Box::pin(tls) as Pin<Box<dyn IoStream>>))
            }
            (Target::Tcp(a), Dial::LocalOnly) => Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{a} is a network address and this daemon has no cluster credential to reach it with"),
            )),
        }
    };
    match tokio::time::timeout(connect_timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no connection within {connect_timeout:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{self, Credential};
    use crate::{ca, Identity};

    #[tokio::test]
    async fn handshakes_prove_identities_both_ways() {
        let dir = tempfile::tempdir().unwrap();
        ca::init(dir.path()).unwrap();
        let n1 = tempfile::tempdir().unwrap();
        ca::install(&ca::issue(dir.path(), "n1").unwrap(), n1.path(), None).unwrap();
        let coord = Credential::load(dir.path(), &Identity::Coordinator).unwrap();
        let node = Credential::load(n1.path(), &Identity::Node("n1".into())).unwrap();
        assert!(Credential::load(n1.path(), &Identity::Node("n2".into()))
            .unwrap_err()
            .to_string()
            .contains("ckptd ca issue n2"));

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let mut incoming = tls_incoming(listener, coord.server_config().unwrap());
        let (peers_tx, mut peers) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            use tokio_stream::StreamExt;
            // Keeps the listener open for the whole test.
            while let Some(Ok(c)) = incoming.next().await {
                let _ = peers_tx.send(c.stream.info.peer.clone());
            }
        });
        let t = Duration::from_secs(5);
        // The node, expecting the coordinator: accepted as node n1.
        let cfg = node.client_config(Identity::Coordinator).unwrap();
        connect(&addr, Dial::Tls(cfg), t).await.unwrap();
        assert_eq!(
            peers.recv().await,
            Some(Peer::Daemon(Identity::Node("n1".into())))
        );
        // Anonymous (a job's ckpt-rsh): accepted as anonymous.
        let anon = tls::anonymous_client_config(node.roots(), Identity::Coordinator).unwrap();
        connect(&addr, Dial::Tls(anon), t).await.unwrap();
        assert_eq!(peers.recv().await, Some(Peer::Anonymous));
        // Expecting node n2 behind the coordinator's address: the client refuses.
        let wrong = node.client_config(Identity::Node("n2".into())).unwrap();
        let e = connect(&addr, Dial::Tls(wrong), t).await.unwrap_err();
        assert!(e.contains("not node n2"), "{e}");
        // A credential of another cluster: the client does not trust the server.
        let other = tempfile::tempdir().unwrap();
        ca::init(other.path()).unwrap();
        let stranger = Credential::load(other.path(), &Identity::Coordinator).unwrap();
        let cfg = stranger.client_config(Identity::Coordinator).unwrap();
        assert!(connect(&addr, Dial::Tls(cfg), t).await.is_err());
        // Another cluster's credential presented to this server, which it does not trust.
        let forged = Credential {
            roots: coord.roots().clone(),
            ..stranger
        };
        let cfg = forged.client_config(Identity::Coordinator).unwrap();
        // The server refuses the handshake: no connection reaches tonic, so the next one that
        // does is the next good one (were the forged one let in, it would come first, as the
        // coordinator).
        let _ = connect(&addr, Dial::Tls(cfg), t).await;
        let good = node.client_config(Identity::Coordinator).unwrap();
        connect(&addr, Dial::Tls(good), t).await.unwrap();
        assert_eq!(
            peers.recv().await,
            Some(Peer::Daemon(Identity::Node("n1".into())))
        );
        // No credential at all and a network address: refused before dialling.
        let e = connect(&addr, Dial::LocalOnly, t).await.unwrap_err();
        assert!(e.contains("no cluster credential"), "{e}");
        // A list (an active ckptd among standbys, which listen on nothing): the first address
        // refuses, the next serves.
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string();
        let good = node.client_config(Identity::Coordinator).unwrap();
        connect(&format!("{closed}, {addr}"), Dial::Tls(good.clone()), t)
            .await
            .unwrap();
        assert_eq!(
            peers.recv().await,
            Some(Peer::Daemon(Identity::Node("n1".into())))
        );
        // None serves: the error names each.
        let closed2 = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string();
        let e = connect(&format!("{closed},{closed2}"), Dial::Tls(good), t)
            .await
            .unwrap_err();
        assert!(e.contains(&closed) && e.contains(&closed2), "{e}");
    }
}
