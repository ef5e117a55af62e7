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
/// Scrapes served at once; more wait for a slot.
const MAX_CONNECTIONS: usize = 16;
/// How long a client may take to send its request's head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

impl MetricsConfig {
    /// Checks that an endpoint has a token file; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.listen.is_some() && self.token_file.is_none() {
            return Err(ConfigError::Invalid {
                key: "metrics.token_file",
                problem: "is needed with metrics.listen: scrapes must present its token \
                          (make one: `head -c 32 /dev/urandom | base64 > /etc/ckpt/metrics.token; chmod 600 /etc/ckpt/metrics.token`)"
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
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)
        .map_err(|e| format!("metrics token file {}: {e}", path.display()))?;
    let m = f
        .metadata()
        .map_err(|e| format!("metrics token file {}: {e}", path.display()))?;
    let me = nix::unistd::geteuid().as_raw();
    if !m.is_file() || (m.uid() != 0 && m.uid() != me) || m.mode() & 0o077 != 0 {
        return Err(format!(
            "metrics token file {} must be a regular file of root's that only root may read (chown root {0}; chmod 600 {0})",
            path.display()
        ));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(&f, 4096), &mut text)
        .map_err(|e| format!("metrics token file {}: {e}", path.display()))?;
    let token = text.trim().to_string();
    if token.len() < MIN_TOKEN || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "metrics token file {} must hold one token of at least {MIN_TOKEN} characters without spaces",
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

/// The process's metrics in the text format, after `refresh` updated the ones computed on
/// demand (agents up, jobs by state, ...).
pub fn render(refresh: &(dyn Fn() + Send + Sync)) -> String {
    use prometheus::Encoder;
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

fn answer(
    req: &Request<hyper::body::Incoming>,
    token: &str,
    refresh: &(dyn Fn() + Send + Sync),
) -> Response<Full<Bytes>> {
    if req.uri().path() != "/metrics" {
        return reply(StatusCode::NOT_FOUND, "only /metrics is served here\n");
    }
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "GET /metrics\n");
    }
    if !authorized(req.headers().get(hyper::header::AUTHORIZATION), token) {
        let mut r = reply(
            StatusCode::UNAUTHORIZED,
            "a scrape needs `Authorization: Bearer <token>` with the token of [metrics] token_file\n",
        );
        r.headers_mut().insert(
            hyper::header::WWW_AUTHENTICATE,
            hyper::header::HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    let mut r = reply(StatusCode::OK, render(refresh));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

/// A bound endpoint, ready to [`serve`](Endpoint::serve).
#[derive(Debug)]
pub struct Endpoint {
    listener: tokio::net::TcpListener,
    token: String,
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

    /// Serves scrapes until the process ends; `refresh` runs before each one.
    pub async fn serve(self, refresh: Arc<dyn Fn() + Send + Sync>) {
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let token: Arc<str> = self.token.into();
        loop {
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            let (stream, _) = match self.listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (token, refresh) = (token.clone(), refresh.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let r = answer(&req, &token, refresh.as_ref());
                    async move { Ok::<_, Infallible>(r) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                // A client that stalls mid-body or keeps the connection forever loses it.
                let _ = tokio::time::timeout(Duration::from_secs(60), conn).await;
                drop(permit);
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
        std::fs::write(&p, "short").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_token(&p).unwrap_err().contains("at least 16"));
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
