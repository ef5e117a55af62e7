//! Start-up errors an admin meets: a malformed config, a missing or too old CRIU, a node that
//! was not enrolled or holds another node's credential, a cluster ckptd without its CA. Each must be
//! refused at start with a message naming the problem and a distinct exit code. Also checks the
//! packaged systemd units and example configs.
use std::path::Path;
use std::process::Command;

use ckpt_tests::{bin_dir, script, workspace};

fn have_bins() -> bool {
    let ok = ["ckptd", "ckpt-agent"]
        .iter()
        .all(|b| bin_dir().join(b).is_file());
    if !ok {
        eprintln!(
            "SKIPPED: needs release binaries in {} (cargo build --release)",
            bin_dir().display()
        );
    }
    ok
}

fn run(bin: &str, config: &Path, extra: &[&str]) -> (i32, String) {
    let out = Command::new(bin_dir().join(bin))
        .arg("--config")
        .arg(config)
        .args(extra)
        .output()
        .expect("run daemon");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn malformed_config_is_refused_with_the_key_named() {
    if !have_bins() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("bad.toml");
    std::fs::write(&cfg, "[deadlines]\ndump = \"soon\"\n").unwrap();
    let (code, err) = run("ckptd", &cfg, &["--standalone"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("bad.toml") && err.contains("dump"), "{err}");
    std::fs::write(&cfg, "[criu]\npaht = \"/usr/sbin/criu\"\n").unwrap();
    let (code, err) = run("ckpt-agent", &cfg, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("paht"), "{err}");
    let (code, err) = run("ckpt-agent", &d.path().join("missing.toml"), &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("missing.toml"), "{err}");
}

/// `[verbs_layer] preload = "always"` with a layer that is missing, or that a user other than
/// root could replace (the agent would put it into every job): the agent does not start, and
/// says which file and what is wrong.
#[test]
fn an_agent_told_to_always_preload_refuses_a_missing_or_replaceable_verbs_layer() {
    if !have_bins() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let writable = d.path().join("libckpt_verbs.so");
    std::fs::write(&writable, b"not a library").unwrap();
    std::fs::set_permissions(
        &writable,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    for (layer, expect) in [
        (
            "/nonexistent/libckpt_verbs.so",
            "/nonexistent/libckpt_verbs.so",
        ),
        (writable.to_str().unwrap(), "writable by group or others"),
    ] {
        let cfg = d.path().join("ckptd.toml");
        std::fs::write(
            &cfg,
            format!(
                "socket = \"{0}/ckptd.sock\"\ndatabase = \"{0}/db\"\ntls_dir = \"{0}/tls\"\n[agent]\nstate_dir = \"{0}/s\"\nlocal_dir = \"{0}/l\"\n[agent.verbs_layer]\npreload = \"always\"\npath = \"{layer}\"\n",
                d.path().display()
            ),
        )
        .unwrap();
        let (code, err) = run("ckptd", &cfg, &["--standalone"]);
        assert_ne!(code, 0, "{layer}: started: {err}");
        assert!(
            err.contains("verbs_layer") && err.contains(expect),
            "{layer}: {err}"
        );
    }
}

#[test]
fn missing_or_old_criu_is_refused_at_start() {
    if !have_bins() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let old = d.path().join("criu-old");
    script(&old, "echo 'Version: 3.17.1'");
    for (criu, expect) in [
        ("/nonexistent/criu", "not found"),
        (old.to_str().unwrap(), "3.17.1"),
    ] {
        let cfg = d.path().join("agent.toml");
        std::fs::write(
            &cfg,
            format!(
                "state_dir = \"{0}/s\"\nlocal_dir = \"{0}/l\"\nlisten = \"127.0.0.1:0\"\ntls_dir = \"{0}/tls\"\n[criu]\npath = \"{criu}\"\n",
                d.path().display()
            ),
        )
        .unwrap();
        let (code, err) = run("ckpt-agent", &cfg, &[]);
        assert_eq!(code, 3, "{criu}: {err}");
        assert!(
            err.contains(expect) && err.contains("4.2") && err.contains("setup.sh"),
            "{criu}: {err}"
        );
    }
}

/// An agent without its credential, or with another node's, does not start and names the
/// command that fixes it; `enroll` refuses a bundle of another node; a cluster ckptd (not
/// standalone) without its CA does not start either.
#[test]
fn nodes_without_their_credential_are_refused_at_start() {
    if !have_bins() {
        return;
    }
    let Some(criu) = ckpt_tests::criu_path() else {
        eprintln!("SKIPPED: needs CRIU (scripts/setup.sh)");
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let p = d.path().display();
    let ckptd_cfg = d.path().join("ckptd.toml");
    std::fs::write(
        &ckptd_cfg,
        format!("socket = \"{p}/c.sock\"\ndatabase = \"{p}/c.redb\"\ntls_dir = \"{p}/ca\"\n"),
    )
    .unwrap();
    let (code, err) = run("ckptd", &ckptd_cfg, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ckptd ca init"), "{err}");

    let agent_cfg = d.path().join("agent.toml");
    std::fs::write(
        &agent_cfg,
        format!(
            "node_name = \"n1\"\nstate_dir = \"{p}/s\"\nlocal_dir = \"{p}/l\"\nlisten = \"127.0.0.1:0\"\n\
             tls_dir = \"{p}/tls\"\n[criu]\npath = \"{}\"\n",
            criu.display()
        ),
    )
    .unwrap();
    let (code, err) = run("ckpt-agent", &agent_cfg, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ckpt-agent enroll"), "{err}");

    // n2's bundle on n1: enroll refuses it and installs nothing.
    let (code, err) = run("ckptd", &ckptd_cfg, &["ca", "init"]);
    assert_eq!(code, 0, "{err}");
    let bundle = Command::new(bin_dir().join("ckptd"))
        .arg("--config")
        .arg(&ckptd_cfg)
        .args(["ca", "issue", "n2", "--out"])
        .arg(d.path().join("n2.bundle"))
        .output()
        .unwrap();
    assert!(bundle.status.success(), "{bundle:?}");
    let bundle_path = d.path().join("n2.bundle").display().to_string();
    let (code, err) = run("ckpt-agent", &agent_cfg, &["enroll", &bundle_path]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ckptd ca issue n1"), "{err}");
    assert!(!d.path().join("tls/node.key").exists());
    // Installed by hand anyway (copied into place): the agent still refuses it.
    std::fs::create_dir_all(d.path().join("tls")).unwrap();
    let text = std::fs::read_to_string(d.path().join("n2.bundle")).unwrap();
    let blocks: Vec<&str> = text.split_inclusive("-----\n").collect();
    let pem = |begin: usize| blocks[begin..begin + 2].concat();
    std::fs::write(d.path().join("tls/ca.pem"), pem(0)).unwrap();
    std::fs::write(d.path().join("tls/node.pem"), pem(2)).unwrap();
    std::fs::write(d.path().join("tls/node.key"), pem(4)).unwrap();
    let (code, err) = run("ckpt-agent", &agent_cfg, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("node n2, not of node n1"), "{err}");
}

#[test]
fn example_configs_parse_and_systemd_units_verify() {
    if !have_bins() {
        return;
    }
    let pkg = workspace().join("packaging");
    // The example configs are accepted as they are, and --check-config catches a bad one.
    let (code, err) = run(
        "ckpt-agent",
        &pkg.join("config/agent.toml"),
        &["--check-config"],
    );
    assert_eq!(code, 0, "agent.toml example rejected: {err}");
    let (code, err) = run("ckptd", &pkg.join("config/ckptd.toml"), &["--check-config"]);
    assert_eq!(code, 0, "ckptd.toml example rejected: {err}");
    let d = tempfile::tempdir().unwrap();
    let bad = d.path().join("bad.toml");
    std::fs::write(&bad, "heartbeat_interval = \"1ms\"\n").unwrap();
    let (code, err) = run("ckpt-agent", &bad, &["--check-config"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("heartbeat_interval"), "{err}");
    let Ok(sa) = which("systemd-analyze") else {
        eprintln!("SKIPPED (units): systemd-analyze not installed");
        return;
    };
    let mut units = Vec::new();
    for unit in ["ckptd.service", "ckpt-agent.service"] {
        let text = std::fs::read_to_string(pkg.join("systemd").join(unit)).unwrap();
        let text = text.replace("/usr/sbin", &bin_dir().display().to_string());
        let p = d.path().join(unit);
        std::fs::write(&p, text).unwrap();
        units.push(p);
    }
    let out = Command::new(sa)
        .arg("verify")
        .args(&units)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let relevant: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("ckptd.service") || l.contains("ckpt-agent.service"))
        .filter(|l| !l.contains("Documentation"))
        .collect();
    assert!(
        out.status.success() && relevant.is_empty(),
        "systemd-analyze verify: {err}"
    );
}

fn which(prog: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(prog))
                .find(|p| p.is_file())
        })
        .ok_or(())
}

/// A machine whose apt lists no Debian source for bookworm (an air-gapped site whose local
/// mirror is configured elsewhere, say) and that needs the private CRIU: setup stops and says
/// which source line to add, instead of reaching a mirror of its own choosing.
#[test]
fn setup_without_a_configured_debian_source_says_which_line_to_add() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: needs root (a mount namespace hiding apt's sources)");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let empty = d.path().join("sources.list.d");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(d.path().join("sources.list"), "").unwrap();
    // apt's sources hidden in a private mount namespace; a fresh prefix, so that the private
    // CRIU has to be fetched.
    let hide = format!(
        "mount --bind {0}/sources.list.d /etc/apt/sources.list.d && \
         {{ [ ! -e /etc/apt/sources.list ] || mount --bind {0}/sources.list /etc/apt/sources.list; }} && \
         exec bash {1}",
        d.path().display(),
        workspace().join("scripts/setup.sh").display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &hide])
        .env("CKPT_CRIU_PREFIX", d.path().join("criu"))
        .env("CKPT_FORCE_PRIVATE_CRIU", "1")
        .env_remove("CKPT_SID_MIRROR")
        .output()
        .expect("run setup.sh");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no Debian source for bookworm")
            && err.contains("deb MIRROR-URL bookworm main")
            && err.contains("CKPT_SID_MIRROR"),
        "{err}"
    );
    assert!(
        !d.path().join("criu/bin/criu").exists(),
        "nothing installed"
    );
}

/// Under systemd (`Type=notify` units with `WatchdogSec=`), ckptd and ckpt-agent each say
/// `READY=1` with a one-line status once their sockets are bound, ping the watchdog, ckptd
/// says `STOPPING=1` when it is stopped, and a job never sees the daemons' `NOTIFY_SOCKET` or
/// `WATCHDOG_USEC`.
#[test]
fn daemons_tell_systemd_when_they_serve_and_jobs_do_not_see_its_socket() {
    ckpt_tests::skip_unless_ready!();
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    // Watchdog pings are counted apart; the other notifications come in order.
    let pings = std::cell::Cell::new(0);
    let recv = || loop {
        let mut buf = [0u8; 1024];
        let n = sock.recv(&mut buf).expect("a notification within 60 s");
        let m = String::from_utf8_lossy(&buf[..n]).into_owned();
        if m == "WATCHDOG=1" {
            pings.set(pings.get() + 1);
        } else {
            return m;
        }
    };
    let mut c = ckpt_tests::Ckptd::start(ckpt_tests::Options {
        separate_agent: true,
        notify_socket: Some(path.clone()),
        // 400 ms: a ping every 200 ms from each daemon.
        watchdog_usec: Some(400_000),
        ..Default::default()
    });
    // Both are ready before the agent registered (which `start` waited for).
    let mut ready = [recv(), recv()];
    ready.sort();
    let [agent, ckptd] = &ready;
    assert!(
        agent.starts_with("READY=1\nSTATUS=node node0 serving on 127.0.0.1:")
            && agent.contains("coordinator 127.0.0.1:"),
        "{agent:?}"
    );
    assert!(
        ckptd.starts_with("READY=1\nSTATUS=serving ckptctl on ")
            && ckptd.contains("agents on ")
            && !ckptd[8..].contains('\n'),
        "{ckptd:?}"
    );
    let job = c.run_job(
        "env",
        &[
            "sh".into(),
            "-c".into(),
            "echo NS=${NOTIFY_SOCKET:-unset} WD=${WATCHDOG_USEC:-unset}".into(),
        ],
    );
    c.wait_state(job, "exited", std::time::Duration::from_secs(60));
    assert!(
        c.output(job).contains("NS=unset WD=unset"),
        "{}",
        c.output(job)
    );
    c.stop_daemon();
    assert_eq!(recv(), "STOPPING=1\nSTATUS=stopping");
    assert!(pings.get() >= 2, "watchdog pings: {}", pings.get());
}

/// A user who makes the agent's directories first (`/dev/shm/ckpt` after a reboot), or who may
/// write where root keeps images, could plant links that root writes through. The user plants
/// them; `ckptd --standalone` refuses to start on each such directory, naming it, its owner or
/// its mode, and what to do, and nothing is written through the links.
#[test]
fn a_staging_or_state_directory_a_user_made_or_may_write_is_refused_at_start() {
    if !have_bins() {
        return;
    }
    let Some(criu) = ckpt_tests::criu_path() else {
        eprintln!("SKIPPED: needs CRIU (scripts/setup.sh)");
        return;
    };
    use ckpt_tests::NOBODY;
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let p = d.path().display().to_string();
    // What the links point at: root's, in a directory only root may enter.
    let victim = d.path().join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o700)).unwrap();
    // A sticky directory every user may write, as /dev/shm and /tmp are.
    let shm = d.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    std::fs::set_permissions(&shm, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let as_nobody = |script: &str| {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]).current_dir("/");
        ckpt_tests::as_user(&mut cmd, NOBODY);
        let st = cmd.status().expect("run sh as nobody");
        assert!(st.success(), "as nobody: {script}");
    };
    // The user makes the staging directory first and plants job and epoch links in it.
    as_nobody(&format!(
        "mkdir -m 0755 {p}/shm/ckpt && ln -s {p}/victim {p}/shm/ckpt/1 && ln -s {p}/victim {p}/shm/ckpt/extra"
    ));
    // A state directory the user made, and a shared directory every user may write.
    as_nobody(&format!(
        "mkdir -m 0755 {p}/shm/state && ln -s {p}/victim {p}/shm/state/jobs"
    ));
    let open_shared = d.path().join("shared");
    std::fs::create_dir(&open_shared).unwrap();
    std::fs::set_permissions(&open_shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let roots = d.path().join("roots");
    std::fs::create_dir(&roots).unwrap();
    let cases = [
        (
            format!("state_dir = \"{p}/roots/s\"\nlocal_dir = \"{p}/shm/ckpt\"\n"),
            "local_dir",
            "belongs to uid 65534",
        ),
        (
            format!("state_dir = \"{p}/roots/s\"\nlocal_dir = \"{p}/shm\"\n"),
            "local_dir",
            "may be written by users other than root",
        ),
        (
            format!("state_dir = \"{p}/shm/state\"\nlocal_dir = \"{p}/roots/l\"\n"),
            "state_dir",
            "belongs to uid 65534",
        ),
        (
            format!(
                "state_dir = \"{p}/roots/s\"\nlocal_dir = \"{p}/roots/l\"\nshared_dir = \"{p}/shared\"\n"
            ),
            "shared_dir",
            "may be written by users other than root",
        ),
    ];
    for (dirs, what, why) in cases {
        let cfg = d.path().join("ckptd.toml");
        std::fs::write(
            &cfg,
            format!(
                "socket = \"{p}/ckptd.sock\"\ndatabase = \"{p}/db\"\ntls_dir = \"{p}/tls\"\n[agent]\n{dirs}[agent.criu]\npath = \"{}\"\n",
                criu.display()
            ),
        )
        .unwrap();
        let (code, err) = run("ckptd", &cfg, &["--standalone"]);
        assert_eq!(code, 4, "{what}: started or failed otherwise: {err}");
        assert!(
            err.contains(what) && err.contains(why) && err.contains("agent.toml"),
            "{what}: the message names the directory, why and what to do: {err}"
        );
        assert_eq!(
            std::fs::read_dir(&victim).unwrap().count(),
            0,
            "{what}: nothing was written through the user's links"
        );
    }
    // The same directories, root's and private, are accepted: the daemon starts.
    let cfg = d.path().join("ckptd.toml");
    std::fs::write(
        &cfg,
        format!(
            "socket = \"{p}/ckptd.sock\"\ndatabase = \"{p}/db\"\ntls_dir = \"{p}/tls\"\n[agent]\nstate_dir = \"{p}/roots/s\"\nlocal_dir = \"{p}/shm/root-ckpt\"\n[agent.criu]\npath = \"{}\"\n",
            criu.display()
        ),
    )
    .unwrap();
    let mut daemon = Command::new(bin_dir().join("ckptd"))
        .arg("--config")
        .arg(&cfg)
        .arg("--standalone")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start ckptd");
    let begin = std::time::Instant::now();
    while !d.path().join("ckptd.sock").exists() {
        if let Some(st) = daemon.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            daemon
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("ckptd exited ({st}) on root's own directories: {err}");
        }
        assert!(
            begin.elapsed() < std::time::Duration::from_secs(30),
            "ckptd did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = daemon.kill();
    let _ = daemon.wait();
    let local = std::fs::metadata(d.path().join("shm/root-ckpt")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((local.uid(), local.mode() & 0o7777), (0, 0o700));
}

/// `[registry] backend = "etcd"` reached without TLS is refused at start (the registry holds
/// every job's secret); with a CA file that is not there, ckptd says which file and stops.
#[test]
fn an_etcd_registry_without_tls_or_its_files_is_refused() {
    if !have_bins() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let tls = d.path().join("tls");
    let cfg = d.path().join("ckptd.toml");
    let base = format!(
        "listen = \"127.0.0.1:0\"\nsocket = \"{}\"\ntls_dir = \"{}\"\nfence_lease = \"11s\"\nnode_timeout = \"12s\"\n",
        d.path().join("ckptd.sock").display(),
        tls.display()
    );
    std::fs::write(&cfg, &base).unwrap();
    let (code, err) = run("ckptd", &cfg, &["ca", "init"]);
    assert_eq!(code, 0, "{err}");
    std::fs::write(
        &cfg,
        format!("{base}[registry]\nbackend = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n"),
    )
    .unwrap();
    let (code, err) = run("ckptd", &cfg, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("registry.endpoints") && err.contains("TLS only"),
        "{err}"
    );
    let missing = d.path().join("etcd-ca.pem");
    std::fs::write(
        &cfg,
        format!(
            "{base}[registry]\nbackend = \"etcd\"\nendpoints = [\"https://127.0.0.1:2379\"]\n\
             ca = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\n",
            missing.display(),
            tls.join("ckptd.pem").display(),
            tls.join("ckptd.key").display()
        ),
    )
    .unwrap();
    let (code, err) = run("ckptd", &cfg, &[]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains(&missing.display().to_string()), "{err}");
}
