//! Start-up errors an admin meets: a malformed config, a missing or too old CRIU. Each must be
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
                "state_dir = \"{0}/s\"\nlocal_dir = \"{0}/l\"\nlisten = \"127.0.0.1:0\"\n[criu]\npath = \"{criu}\"\n",
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
        let text = text.replace("/usr/local/bin", &bin_dir().display().to_string());
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
