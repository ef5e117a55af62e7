//! [`Etcd`]: an etcd cluster of three members on loopback (Debian's etcd-server), for the
//! tests of ckptd with standbys; members are killed by PID when it is dropped.
//!
//! As a site must run it: TLS between members and to clients, and a client certificate
//! required of every client (the registry holds every job's secret), from a CA made for the
//! cluster with openssl. Health and leadership are read from each member's plain-HTTP metrics
//! address.
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// One etcd cluster, its members' processes and data in a temporary directory.
#[derive(Debug)]
pub struct Etcd {
    dir: tempfile::TempDir,
    members: Vec<Member>,
}

#[derive(Debug)]
struct Member {
    name: String,
    client: u16,
    /// Plain HTTP: `/health` and `/metrics` only.
    metrics: u16,
    child: Option<Child>,
}

/// Runs openssl with `args` in `dir`; panics with its output on failure.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run openssl");
    assert!(out.status.success(), "openssl {args:?}: {out:?}");
}

/// A CA, a certificate for every member (server and peer, for 127.0.0.1) and one for ckptd
/// (client), in `dir`.
fn make_certificates(dir: &std::path::Path) {
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(key);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=ckpt test etcd CA",
    ]);
    openssl(dir, &ca);
    for (name, ext) in [
        (
            "member",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
        ),
        ("ckptd", "extendedKeyUsage=clientAuth\n"),
    ] {
        std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
        let (k, csr, pem) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        let mut req = vec!["req"];
        req.extend(key);
        let subj = format!("/CN={name}");
        req.extend(["-keyout", &k, "-out", &csr, "-subj", &subj]);
        openssl(dir, &req);
        let ext = format!("{name}.ext");
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext,
            ],
        );
    }
}

impl Etcd {
    /// Why no cluster can be started here (`etcd` not installed), if so.
    pub fn unavailable() -> Option<String> {
        which("etcd").is_none().then(|| {
            "etcd is not installed (Debian: etcd-server; scripts/setup.sh installs it)".into()
        })
    }

    /// Starts `n` members and waits (bounded) until the cluster answers.
    pub fn start(n: usize) -> Etcd {
        let dir = tempfile::Builder::new()
            .prefix("ckpt-etcd-")
            .tempdir()
            .expect("tempdir");
        let tls = dir.path().join("tls");
        std::fs::create_dir(&tls).unwrap();
        make_certificates(&tls);
        let ports: Vec<(u16, u16, u16)> = (0..n)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect();
        let cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer, _))| format!("m{i}=https://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let token = format!("ckpt-test-{}", std::process::id());
        let mut members = Vec::new();
        let file = |f: &str| tls.join(f).display().to_string();
        for (i, (client, peer, metrics)) in ports.iter().enumerate() {
            let name = format!("m{i}");
            let log = std::fs::File::create(dir.path().join(format!("{name}.log"))).unwrap();
            let child = Command::new("etcd")
                .args(["--name", &name])
                .arg("--data-dir")
                .arg(dir.path().join(&name))
                .args([
                    "--listen-client-urls",
                    &format!("https://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("https://127.0.0.1:{client}"),
                    "--listen-peer-urls",
                    &format!("https://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("https://127.0.0.1:{peer}"),
                    "--listen-metrics-urls",
                    &format!("http://127.0.0.1:{metrics}"),
                    "--cert-file",
                    &file("member.pem"),
                    "--key-file",
                    &file("member.key"),
                    "--trusted-ca-file",
                    &file("ca.pem"),
                    "--client-cert-auth",
                    "--peer-cert-file",
                    &file("member.pem"),
                    "--peer-key-file",
                    &file("member.key"),
                    "--peer-trusted-ca-file",
                    &file("ca.pem"),
                    "--peer-client-cert-auth",
                    "--initial-cluster",
                    &cluster,
                    "--initial-cluster-token",
                    &token,
                    "--initial-cluster-state",
                    "new",
                ])
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("start etcd");
            members.push(Member {
                name,
                client: *client,
                metrics: *metrics,
                child: Some(child),
            });
        }
        let me = Etcd { dir, members };
        let begin = Instant::now();
        while !me.healthy() {
            assert!(
                begin.elapsed() < Duration::from_secs(60),
                "etcd did not become healthy: {}",
                me.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        me
    }

    /// The members' client URLs.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("https://127.0.0.1:{}", m.client))
            .collect()
    }

    /// The keys of ckptd.toml's `[registry]` table that reach this cluster (endpoints, CA,
    /// ckptd's client certificate), without `backend` and `prefix`.
    pub fn registry_keys(&self) -> String {
        let tls = self.dir.path().join("tls");
        format!(
            "endpoints = [{}]\nca = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\n",
            self.endpoints()
                .iter()
                .map(|e| format!("\"{e}\""))
                .collect::<Vec<_>>()
                .join(", "),
            tls.join("ca.pem").display(),
            tls.join("ckptd.pem").display(),
            tls.join("ckptd.key").display()
        )
    }

    /// Whether a running member says the cluster is healthy (it has a leader and a quorum).
    pub fn healthy(&self) -> bool {
        self.members
            .iter()
            .filter(|m| m.child.is_some())
            .any(|m| health(m.metrics))
    }

    /// Which running member is the cluster's leader now, if one says so.
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|m| {
            m.child.is_some()
                && get(m.metrics, "/metrics")
                    .lines()
                    .any(|l| l.trim() == "etcd_server_is_leader 1")
        })
    }

    /// SIGKILLs member `i`, as a lost node would stop it.
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Every member's log, for a failure message.
    pub fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                let text = std::fs::read_to_string(self.dir.path().join(format!("{}.log", m.name)))
                    .unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                format!(
                    "--- {}:\n{}",
                    m.name,
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
    }
}

/// `GET /health` of the member on `port`.
fn health(port: u16) -> bool {
    get(port, "/health").contains("\"health\":\"true\"")
}

/// The answer to `GET path` of the member on `port` (empty if none).
fn get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(
        &([127, 0, 0, 1], port).into(),
        Duration::from_millis(500),
    ) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .is_err()
    {
        return String::new();
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn which(prog: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| PathBuf::from(d).join(prog))
        .find(|p| p.is_file())
}
