//! The Prometheus endpoint of both daemons: `GET /metrics` over HTTP at `[metrics] listen`,
//! answering only a request that carries `Authorization: Bearer <token>` with the token of
//! `[metrics] token_file` (Prometheus' `authorization: { credentials_file: ... }`). The body is
//! the process's default `prometheus` registry in the text format (0.0.4) that `promtool check
//! metrics` reads. Off unless `listen` is set.
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use serde::Deserialize;

use crate::config::ConfigError;

/// The `[metrics]` table of ckptd.toml and agent.toml.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Where to serve `/metrics` (`HOST:PORT`); unset: no endpoint.
    pub listen: Option<SocketAddr>,
    /// The file holding the bearer token a scrape must present: root's, not readable by group
    /// or others. Needed when `listen` is set.
    pub token_file: Option<PathBuf>,
}

/// The shortest token accepted: a guessable one protects nothing.
const MIN_TOKEN: usize = 16;
/// Connections served at once; one more is closed at once.
const MAX_CONNECTIONS: usize = 16;
/// Connections from one address at once (Prometheus keeps one per target).
const MAX_PER_CLIENT: usize = 4;
/// How long a client may take to send its request's head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a connection may stay open.
const CONNECTION_LIMIT: Duration = Duration::from_secs(60);
/// The longest token accepted.
const MAX_TOKEN: usize = 4096;

impl MetricsConfig {
    /// Checks that an endpoint has a token file; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.listen.is_some() && self.token_file.is_none() {
            return Err(ConfigError::Invalid {
                key: "metrics.token_file",
                problem: "is needed with metrics.listen: scrapes must present its token \
                          (make one: `(umask 077; head -c 32 /dev/urandom | base64 > /etc/ckpt/metrics.token)`)"
                    .into(),
            });
        }
        Ok(())
    }
}

/// Reads the token from `path`: a regular file of this daemon's user (or root) that group and
/// others may neither read nor write, holding at least 16 characters (surrounding whitespace
/// is not part of it).
pub fn read_token(path: &Path) -> Result<String, String> {
    use nix::fcntl::OFlag;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let bad = |e: &dyn std::fmt::Display| format!("metrics token file {}: {e}", path.display());
    let me = nix::unistd::geteuid().as_raw();
    let trusted = |m: &std::fs::Metadata| m.uid() == 0 || m.uid() == me;
    // Its directory is root's and nobody else's to change: no one swaps the file under us.
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let dm = std::fs::metadata(dir).map_err(|e| bad(&e))?;
    if !trusted(&dm) || dm.mode() & 0o022 != 0 {
        return Err(format!(
            "metrics token file {}: its directory {} must be root's and writable by root only",
            path.display(),
            dir.display()
        ));
    }
    // Not a link, and never blocking on a FIFO.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY).bits())
        .open(path)
        .map_err(|e| bad(&e))?;
    let m = f.metadata().map_err(|e| bad(&e))?;
    if !m.is_file() || !trusted(&m) || m.mode() & 0o077 != 0 {
        return Err(format!(
            "metrics token file {} must be a regular file of root's that only root may read (chown root {0}; chmod 600 {0})",
            path.display()
        ));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(
        &mut std::io::Read::take(&f, MAX_TOKEN as u64 + 2),
        &mut text,
    )
    .map_err(|e| bad(&e))?;
    let token = text.trim().to_string();
    // A bearer token is visible ASCII: anything else could never match a header.
    if !(MIN_TOKEN..=MAX_TOKEN).contains(&token.len())
        || !token.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(format!(
            "metrics token file {} must hold one token of {MIN_TOKEN} to {MAX_TOKEN} visible ASCII characters",
            path.display()
        ));
    }
    Ok(token)
}

/// Whether `header` is `Bearer <token>`, compared in time independent of where they differ.
fn authorized(header: Option<&hyper::header::HeaderValue>, token: &str) -> bool {
    let Some(given) = header
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (a, b) = (given.trim().as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Registers `collectors` in the process's default registry, which the endpoint serves; once
/// per process (a second registration of a name is a bug).
pub fn register(collectors: Vec<Box<dyn prometheus::core::Collector>>) {
    for c in collectors {
        prometheus::default_registry()
            .register(c)
            .expect("each metric registered once");
    }
}

/// The process's metrics in the text format, after `refresh` updated the ones computed on
/// demand (agents up, jobs by state, ...). One scrape at a time: refreshes do not interleave.
pub fn render(refresh: &(dyn Fn() + Send + Sync)) -> String {
    use prometheus::Encoder;
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    refresh();
    let mut out = Vec::new();
    prometheus::TextEncoder::new()
        .encode(&prometheus::gather(), &mut out)
        .expect("text encoding into memory");
    String::from_utf8(out).expect("text format is UTF-8")
}

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r
}

/// The answer to a request: 200 with the metrics for an authorized scrape; else 404, 405 or
/// 401, each closing the connection.
async fn answer(
    req: Request<hyper::body::Incoming>,
    token: Arc<str>,
    refresh: Arc<dyn Fn() + Send + Sync>,
) -> Response<Full<Bytes>> {
    let refused = |status, text: &'static str| {
        let mut r = reply(status, text);
        r.headers_mut().insert(
            hyper::header::CONNECTION,
            hyper::header::HeaderValue::from_static("close"),
        );
        r
    };
    if req.uri().path() != "/metrics" {
        return refused(StatusCode::NOT_FOUND, "only /metrics is served here\n");
    }
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return refused(StatusCode::METHOD_NOT_ALLOWED, "GET /metrics\n");
    }
    if !authorized(req.headers().get(hyper::header::AUTHORIZATION), &token) {
        let mut r = refused(
            StatusCode::UNAUTHORIZED,
            "a scrape needs `Authorization: Bearer <token>` with the token of [metrics] token_file\n",
        );
        r.headers_mut().insert(
            hyper::header::WWW_AUTHENTICATE,
            hyper::header::HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    // The refresh reads the daemon's state (a database, statvfs): off the async workers.
    let text = tokio::task::spawn_blocking(move || render(refresh.as_ref()))
        .await
        .unwrap_or_default();
    let mut r = reply(StatusCode::OK, text);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

/// A bound endpoint, ready to [`serve`](Endpoint::serve).
pub struct Endpoint {
    listener: tokio::net::TcpListener,
    token: String,
}

impl std::fmt::Debug for Endpoint {
    // Never the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

/// Connections open per client address.
#[derive(Debug, Default)]
struct Clients(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One of a client's connections, counted while it lives.
struct Slot {
    clients: Arc<Clients>,
    ip: std::net::IpAddr,
}

impl Clients {
    /// A slot for a new connection from `ip`, unless it has [`MAX_PER_CLIENT`] already.
    fn take(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<Slot> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_default();
        if *n >= MAX_PER_CLIENT {
            return None;
        }
        *n += 1;
        Some(Slot {
            clients: self.clone(),
            ip,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut m = self.clients.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

impl Endpoint {
    /// Reads the token and binds `[metrics] listen`; `None` when it is unset. The error names
    /// the file or the address.
    pub async fn bind(cfg: &MetricsConfig) -> Result<Option<Endpoint>, String> {
        let Some(addr) = cfg.listen else {
            return Ok(None);
        };
        let path = cfg
            .token_file
            .as_deref()
            .ok_or("metrics.listen is set without metrics.token_file")?;
        let token = read_token(path)?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
        Ok(Some(Endpoint { listener, token }))
    }

    /// The bound address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves scrapes until the process ends; `refresh` runs before each one. Connections
    /// beyond [`MAX_CONNECTIONS`], or [`MAX_PER_CLIENT`] from one address, are closed at once.
    pub async fn serve(self, refresh: Arc<dyn Fn() + Send + Sync>) {
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let clients = Arc::new(Clients::default());
        let token: Arc<str> = self.token.into();
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (Ok(permit), Some(slot)) =
                (slots.clone().try_acquire_owned(), clients.take(peer.ip()))
            else {
                continue;
            };
            let (token, refresh) = (token.clone(), refresh.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let (token, refresh) = (token.clone(), refresh.clone());
                    async move { Ok::<_, Infallible>(answer(req, token, refresh).await) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                // A client that stalls mid-body or keeps the connection forever loses it.
                let _ = tokio::time::timeout(CONNECTION_LIMIT, conn).await;
                drop((permit, slot));
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_the_exact_bearer_token_is_authorized() {
        let t = "0123456789abcdef0123";
        let h = |s: &str| hyper::header::HeaderValue::from_str(s).unwrap();
        assert!(authorized(Some(&h(&format!("Bearer {t}"))), t));
        assert!(!authorized(None, t));
        assert!(!authorized(Some(&h(t)), t));
        assert!(!authorized(Some(&h(&format!("Basic {t}"))), t));
        assert!(!authorized(Some(&h(&format!("Bearer {t}x"))), t));
        assert!(!authorized(Some(&h("Bearer 0123456789abcdef012X")), t));
        assert!(!authorized(Some(&h("Bearer ")), t));
    }

    #[test]
    fn a_token_file_others_may_read_or_a_short_token_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("token");
        std::fs::write(&p, "  s3cr3t-t0ken-0f-20ch\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_token(&p).unwrap(), "s3cr3t-t0ken-0f-20ch");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_token(&p).unwrap_err();
        assert!(
            e.contains("only root may read") && e.contains("chmod 600"),
            "{e}"
        );
        for bad in [
            "short",
            "sixteen-chars-and-\u{e9}",
            "two tokens-of-16-characters",
        ] {
            std::fs::write(&p, bad).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
            assert!(
                read_token(&p).unwrap_err().contains("visible ASCII"),
                "{bad}"
            );
        }
        // A FIFO does not hang the daemon, and a directory others may write is refused.
        let fifo = d.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(read_token(&fifo).is_err());
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::write(&p, "s3cr3t-t0ken-0f-20ch").unwrap();
        let e = read_token(&p).unwrap_err();
        assert!(e.contains("writable by root only"), "{e}");
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(read_token(&link).is_err(), "a link is not followed");
        let e = read_token(&d.path().join("missing")).unwrap_err();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn an_endpoint_without_a_token_file_is_a_config_error() {
        let c = MetricsConfig {
            listen: Some("127.0.0.1:9464".parse().unwrap()),
            token_file: None,
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("metrics.token_file"), "{e}");
        assert!(MetricsConfig::default().validate().is_ok());
    }
}
