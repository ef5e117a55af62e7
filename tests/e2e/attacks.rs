//! Attackers against the daemons' network and socket entry points: an unprivileged user on the
//! host, a foreign test host without a credential, and a node with its own valid credential
//! trying to act as another. Every port is found in the daemons' own socket tables, every RPC
//! of the Registry and Agent services is tried there (`ckpt-attack`), and the test checks that
//! each was refused and that nothing happened: no file, no process, no change of state.
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use ckpt_tests::netns::Cluster;
use ckpt_tests::sockets::{listening, Listening};
use ckpt_tests::{as_user, bin_dir, skip_unless_ready, Ckptd, Options};

use ckpt_tests::NOBODY;
const PWNED: &str = "/tmp/ckpt-attack-pwned";

/// Calls only the coordinator may make: a daemon must refuse them outright.
fn daemon_only(rpc: &str) -> bool {
    !matches!(
        rpc,
        "Registry.Attach" | "Registry.Locate" | "Agent.Poll" | "Agent.Signal"
    )
}

/// The `RPC name code message` lines of one run; asserts that every call was refused (or the
/// connection was), as `who` against `target`.
fn assert_refused(who: &str, target: &str, out: &Output) -> Vec<(String, String, String)> {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{who} -> {target}: ckpt-attack failed: {err}"
    );
    if text.starts_with("CONNECT refused") {
        return Vec::new();
    }
    let mut calls = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("RPC ") else {
            continue;
        };
        let mut f = rest.splitn(3, ' ');
        let (rpc, code, msg) = (
            f.next().unwrap_or_default().to_string(),
            f.next().unwrap_or_default().to_string(),
            f.next().unwrap_or_default().to_string(),
        );
        // A caller without a credential is refused before anything is looked at: it learns
        // neither what was wrong in its request nor which jobs exist (an unknown job is
        // answered as a wrong token). A node with its own credential may be told more.
        let anonymous = who != "node n2";
        let ok = matches!(
            code.as_str(),
            "Unauthenticated" | "PermissionDenied" | "Unimplemented"
        ) || (!anonymous
            && if daemon_only(&rpc) {
                code == "InvalidArgument"
            } else {
                code == "NotFound"
            });
        assert!(
            ok,
            "{who} -> {target}: {rpc} was not refused: {code} {msg}\n{text}"
        );
        calls.push((rpc, code, msg));
    }
    assert!(
        calls.len() >= 23,
        "{who} -> {target}: every call tried: {text}{err}"
    );
    calls
}

/// Runs `ckpt-attack` with `args` as `uid` (with no supplementary groups).
fn attack_as(uid: u32, args: &[String]) -> Output {
    let mut cmd = Command::new(bin_dir().join("ckpt-attack"));
    cmd.args(args).stdin(Stdio::null()).current_dir("/");
    as_user(&mut cmd, uid).output().expect("run ckpt-attack")
}

/// The cluster CA certificate where any user can read it, as `/etc/ckpt/tls/ca.pem` is.
fn public_ca(d: &Ckptd) -> (tempfile::TempDir, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::copy(d.dir.path().join("tls/ca.pem"), &ca).expect("copy CA");
    std::fs::set_permissions(&ca, std::fs::Permissions::from_mode(0o644)).unwrap();
    (dir, ca)
}

/// Where to dial a listening socket from the host (a wildcard address: loopback).
fn dial_addr(l: &Listening, host_ip: &str) -> String {
    match l {
        Listening::Unix(p) => format!("unix:{p}"),
        Listening::Tcp(a) if a.ip().is_unspecified() => format!("{host_ip}:{}", a.port()),
        Listening::Tcp(a) => a.to_string(),
    }
}

/// The gRPC sockets: the ib-quiesce control socket speaks its own line protocol, whose
/// callers are checked by the agent's own tests.
fn grpc_socket(l: &Listening) -> bool {
    !matches!(l, Listening::Unix(p) if p.ends_with("ibq/control.sock"))
}

/// Where a daemon's port is on the test network: ckptd on the host's bridge address, an agent
/// on its node's.
fn network_addr(cluster: &Cluster, daemon: &str, port: u16) -> String {
    let ip = if daemon == "ckptd" {
        &cluster.host_ip
    } else {
        &cluster.node(daemon).mgmt_ip
    };
    format!("{ip}:{port}")
}

fn registered_lines(d: &Ckptd) -> usize {
    std::fs::read_to_string(d.dir.path().join("ckptd.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("agent registered"))
        .count()
}

fn nothing_written(n1_local: &Path) {
    assert!(!Path::new(PWNED).exists(), "a Launch ran a command");
    assert!(!Path::new("/etc/x").exists(), "a Receive wrote /etc/x");
    // `../../x` from the partner copy's directory (<local>/<job>/<epoch>/<node>).
    let escaped = n1_local.join("1/x");
    assert!(!escaped.exists(), "a Receive wrote {}", escaped.display());
    assert!(!n1_local.join("x").exists());
}

#[test]
fn every_daemon_port_refuses_users_foreign_hosts_and_other_nodes() {
    skip_unless_ready!("nsenter");
    if let Some(why) = Cluster::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let _ = std::fs::remove_file(PWNED);
    let cluster = Cluster::create(3).expect("create test hosts");
    let mut d = Ckptd::start(Options {
        no_agent: true,
        ..Options::default()
    });
    for n in ["n1", "n2", "n3"] {
        d.start_agent_in(&cluster, n);
    }
    d.wait_agents(&["n1", "n2", "n3"]);
    // A job to aim at, on n1.
    let out = d.ctl(&["run", "--node", "n1", "--", "/bin/sleep", "600"]);
    let job: u64 = out.ok().trim().parse().expect("job id");
    let before = registered_lines(&d);
    let (_ca_dir, ca) = public_ca(&d);
    let ca = ca.display().to_string();

    // Every socket each daemon listens on, from its own tables.
    let mut targets: Vec<(String, Listening)> = Vec::new();
    for (name, pid) in d.daemon_pids() {
        for l in listening(pid).into_iter().filter(grpc_socket) {
            targets.push((name.clone(), l));
        }
    }
    let tcp: Vec<_> = targets
        .iter()
        .filter(|(_, l)| matches!(l, Listening::Tcp(_)))
        .collect();
    assert!(
        tcp.len() >= 4,
        "ckptd and three agents listen on TCP: {targets:?}"
    );
    let identity = |name: &str| -> Vec<String> {
        if name == "ckptd" {
            vec![]
        } else {
            vec!["--target".into(), name.to_string()]
        }
    };
    let job_arg = vec!["--job".to_string(), job.to_string()];
    // ckpt-attack's arguments against `name`: `args`, then the server's identity and the job.
    let attack_args = |name: &str, mut args: Vec<String>| {
        args.extend(identity(name));
        args.extend(job_arg.clone());
        args
    };
    // ckpt-attack run in `node`'s namespace.
    let attack_in = |node: &str, args: &[String]| {
        cluster
            .command_in(node, &bin_dir().join("ckpt-attack"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run ckpt-attack in {node}: {e:?}"))
    };

    // 1. An unprivileged user on the host: with the public CA (TLS, no certificate) and
    //    without (plain HTTP/2 on a TLS port); on Unix sockets, as itself.
    for (name, l) in &targets {
        let addr = dial_addr(l, &cluster.host_ip);
        let with_ca = attack_args(name, vec![addr.clone(), "--ca".into(), ca.clone()]);
        assert_refused("nobody", &addr, &attack_as(NOBODY, &with_ca));
        // The same for a job that does not exist: answered as the wrong token was.
        let mut unknown = vec![addr.clone(), "--ca".into(), ca.clone()];
        unknown.extend(identity(name));
        unknown.extend(["--job".to_string(), (job + 1000).to_string()]);
        assert_refused("nobody", &addr, &attack_as(NOBODY, &unknown));
        if matches!(l, Listening::Tcp(_)) {
            // Plain HTTP/2 on a TLS port: the server never completes a handshake, so every
            // call fails in the transport.
            let mut plain = vec![addr.clone()];
            plain.extend(job_arg.clone());
            let out = attack_as(NOBODY, &plain);
            let text = String::from_utf8_lossy(&out.stdout);
            for line in text.lines().filter(|l| l.starts_with("RPC ")) {
                let code = line.split(' ').nth(2).unwrap_or_default();
                assert!(
                    matches!(code, "Internal" | "Unknown" | "Unavailable")
                        && (line.contains("transport")
                            || line.contains("h2")
                            || line.contains("connect")),
                    "plain HTTP/2 to {addr} got an answer: {line}"
                );
            }
        }
    }

    // 2. A foreign host (n3's namespace, no credential): every TCP port, over the network.
    for (name, l) in &tcp {
        let Listening::Tcp(a) = l else { continue };
        let addr = network_addr(&cluster, name, a.port());
        let args = attack_args(name, vec![addr.clone(), "--ca".into(), ca.clone()]);
        let out = attack_in("n3", &args);
        assert_refused("foreign host", &addr, &out);
    }

    // 3. Node n2, with its own valid credential: it cannot register as n3, report n3's jobs,
    //    call n1's agent as the coordinator, stream n3's images, or write outside n1's
    //    staging through a partner copy.
    let n2_tls = d.dir.path().join("n2/tls").display().to_string();
    for (name, l) in &tcp {
        let Listening::Tcp(a) = l else { continue };
        if name == "n2" {
            continue;
        }
        let addr = network_addr(&cluster, name, a.port());
        let mut args = vec![addr.clone(), "--cred".into(), n2_tls.clone(), "n2".into()];
        if name != "ckptd" {
            // Relay grants n2 could hold from real epochs, shown outside what they cover.
            args.extend([
                "--grants".into(),
                d.dir.path().join("tls").display().to_string(),
            ]);
        }
        let out = attack_in("n2", &attack_args(name, args));
        let calls = assert_refused("node n2", &addr, &out);
        let code = |rpc: &str| {
            calls
                .iter()
                .find(|(r, _, _)| r == rpc)
                .map(|(_, c, m)| format!("{c} {m}"))
                .unwrap_or_default()
        };
        if name == "ckptd" {
            assert!(
                code("Registry.Register").starts_with("PermissionDenied"),
                "n2 registering as n3: {}",
                code("Registry.Register")
            );
        } else {
            // n2 may send its own images, but not with paths that leave the directory.
            for rpc in ["Agent.ReceiveAbsolute", "Agent.ReceiveDotDot"] {
                let c = code(rpc);
                assert!(
                    c.starts_with("InvalidArgument") || c.starts_with("PermissionDenied"),
                    "{rpc}: {c}"
                );
            }
            assert!(code("Agent.ReceiveForOther").starts_with("PermissionDenied"));
            assert!(code("Agent.Send").starts_with("PermissionDenied"));
            assert!(
                code("Agent.AllowFetch").starts_with("PermissionDenied"),
                "n2 granting itself another node's images: {}",
                code("Agent.AllowFetch")
            );
            // A relay's grant covers its job, epoch, relay and nodes until it expires, and is
            // the coordinator's; a relay plan is the coordinator's alone.
            for (rpc, why) in [
                ("Agent.EpochGrantOtherJob", "not job"),
                ("Agent.EpochGrantOtherEpoch", "not epoch 2"),
                ("Agent.EpochGrantExpired", "expired"),
                ("Agent.EpochGrantOtherRelay", "is node n9's"),
                ("Agent.EpochGrantOtherNode", "does not cover this node"),
                ("Agent.EpochGrantForged", "signed by node n2"),
                ("Agent.EpochRelayPlan", "only the coordinator"),
            ] {
                let c = code(rpc);
                assert!(
                    c.starts_with("PermissionDenied") && c.contains(why),
                    "{rpc} to {name}: {c}"
                );
            }
            // Erasure coding: no grant of parity, no encode, no read of another node's
            // images or parity without the coordinator's grant.
            for rpc in [
                "Agent.AllowFetchParity",
                "Agent.Encode",
                "Agent.ReadSegment",
                "Agent.ReadSegmentParity",
            ] {
                assert!(
                    code(rpc).starts_with("PermissionDenied"),
                    "{rpc}: {}",
                    code(rpc)
                );
            }
        }
    }

    // Nothing happened: no command ran, no file was written, no node (re)registered, the job
    // runs on as before.
    nothing_written(&d.dir.path().join("n1/local"));
    assert_eq!(registered_lines(&d), before, "a registration was accepted");
    let st = d.status(job);
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(st["nodes"][0]["node"], "n1", "{st}");
    d.ctl(&["cancel", &job.to_string()]).ok();
    std::thread::sleep(Duration::from_millis(100));
}

/// `ckptd --standalone` without a cluster CA opens no TCP port; its embedded agent's socket is
/// in a directory only root may enter; a user on its control socket cannot register or call
/// the agent service.
#[test]
fn a_standalone_ckptd_has_no_network_attack_surface() {
    skip_unless_ready!();
    let d = Ckptd::start(Options::default());
    let socks: Vec<Listening> = d
        .daemon_pids()
        .into_iter()
        .flat_map(|(_, pid)| listening(pid))
        .collect();
    let socks: Vec<Listening> = socks.into_iter().filter(grpc_socket).collect();
    assert!(
        !socks.iter().any(|l| matches!(l, Listening::Tcp(_))),
        "a standalone ckptd listens on TCP: {socks:?}"
    );
    let unix: Vec<&Listening> = socks
        .iter()
        .filter(|l| matches!(l, Listening::Unix(_)))
        .collect();
    assert!(
        unix.len() >= 2,
        "control socket and agent socket: {socks:?}"
    );
    let before = registered_lines(&d);
    for l in unix {
        let addr = dial_addr(l, "127.0.0.1");
        let out = attack_as(NOBODY, std::slice::from_ref(&addr));
        assert_refused("nobody", &addr, &out);
    }
    let agent_sock = d.dir.path().join("state/rpc/agent.sock");
    let out = attack_as(NOBODY, &[format!("unix:{}", agent_sock.display())]);
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("CONNECT refused"),
        "a user reached the embedded agent: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!Path::new(PWNED).exists(), "a Launch ran a command");
    assert_eq!(registered_lines(&d), before, "a registration was accepted");
}
