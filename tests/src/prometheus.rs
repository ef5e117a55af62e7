//! A real Prometheus server (Debian's `prometheus` package) for the metrics tests: started on
//! loopback with its own config and data directory, scraping the given targets every second
//! with a bearer token, queried through its HTTP API. Dropping it kills it by PID.
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A plain HTTP/1.0 GET of `path` at `addr` with extra `headers`: the status code and the body.
pub fn http_get(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut req = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_string()))
}

/// Percent-encodes a query for a URL.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A running Prometheus.
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    /// Its HTTP address (`127.0.0.1:PORT`).
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Why Prometheus cannot run here, if it cannot.
    pub fn unavailable() -> Option<String> {
        for tool in ["prometheus", "promtool"] {
            let found = std::env::var_os("PATH")
                .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
                .unwrap_or(false);
            if !found {
                return Some(format!(
                    "{tool} not installed (Debian package prometheus; scripts/test.sh installs it)"
                ));
            }
        }
        None
    }

    /// Starts Prometheus scraping `targets` (job name, `host:port`) every second with the
    /// token in `token_file`; waits (bounded) until it answers.
    pub fn start(targets: &[(&str, &str)], token_file: &Path) -> Prometheus {
        let dir = tempfile::Builder::new()
            .prefix("ckpt-prom-")
            .tempdir()
            .expect("tempdir");
        let mut cfg = String::from(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n",
        );
        for (job, target) in targets {
            cfg.push_str(&format!(
                "  - job_name: {job}\n    authorization:\n      credentials_file: {}\n    static_configs:\n      - targets: ['{target}']\n",
                token_file.display()
            ));
        }
        let cfg_path = dir.path().join("prometheus.yml");
        std::fs::write(&cfg_path, cfg).expect("write prometheus.yml");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let addr = format!("127.0.0.1:{port}");
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", cfg_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let p = Prometheus {
            child,
            addr,
            _dir: dir,
        };
        let begin = Instant::now();
        while !matches!(http_get(&p.addr, "/-/ready", &[]), Ok((200, _))) {
            assert!(
                begin.elapsed() < Duration::from_secs(60),
                "prometheus not ready: {}",
                p.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The values of an instant query (`/api/v1/query`), as numbers, one per series.
    pub fn query(&self, q: &str) -> Vec<f64> {
        let (status, body) = http_get(
            &self.addr,
            &format!("/api/v1/query?query={}", encode(q)),
            &[],
        )
        .expect("query prometheus");
        assert_eq!(status, 200, "query {q}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("prometheus answers JSON");
        v["data"]["result"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["value"][1].as_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits (bounded) until `q` has one value that satisfies `ok`; returns it.
    pub fn wait_for(&self, q: &str, ok: impl Fn(f64) -> bool) -> f64 {
        let begin = Instant::now();
        loop {
            let v = self.query(q);
            if let [x] = v[..] {
                if ok(x) {
                    return x;
                }
            }
            assert!(
                begin.elapsed() < Duration::from_secs(60),
                "prometheus: {q} = {v:?}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
