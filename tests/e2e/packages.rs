//! The Debian packages (docs/packages.md): built by `scripts/package.sh` from the release
//! binaries, installed with apt on a fresh Debian 12 test host, used, and purged.
use std::path::{Path, PathBuf};
use std::process::Command;

use ckpt_tests::{bin_dir, skip_unless_ready, workspace};

/// The test host's base system, made by debootstrap once and kept with the CI's builds.
const BASE: &str = "/var/cache/ckpt-ci/pkgtest/bookworm-base.tar.zst";
/// A base older than this is made again (apt updates the host's index at every run anyway).
const BASE_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

fn script() -> PathBuf {
    workspace().join("tests/packages/fresh_host.sh")
}

/// The test host's base system: debootstrap's, made now if missing or old.
fn base() -> PathBuf {
    let base = PathBuf::from(BASE);
    let fresh = std::fs::metadata(&base)
        .and_then(|m| m.modified())
        .is_ok_and(|t| t.elapsed().is_ok_and(|age| age < BASE_MAX_AGE));
    if !fresh {
        std::fs::create_dir_all(base.parent().unwrap()).unwrap();
        let st = Command::new("bash")
            .arg(script())
            .arg("--base")
            .arg(&base)
            .status()
            .expect("run fresh_host.sh --base");
        assert!(st.success(), "debootstrap of the test host's base failed");
    }
    base
}

/// Builds the two packages from the release binaries, at Debian revision `revision`; their
/// paths.
fn packages(out: &Path, revision: u32) -> Vec<PathBuf> {
    let target = bin_dir()
        .parent()
        .expect("bin dir in a target dir")
        .to_path_buf();
    let r = Command::new("bash")
        .arg(workspace().join("scripts/package.sh"))
        .args(["--no-build", "--revision", &revision.to_string(), "--out"])
        .arg(out)
        .env("CARGO_TARGET_DIR", &target)
        .env("CKPT_PACKAGE_FAST", "1")
        .output()
        .expect("run scripts/package.sh");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "scripts/package.sh failed:\n{err}");
    let debs: Vec<PathBuf> = String::from_utf8_lossy(&r.stdout)
        .lines()
        .map(PathBuf::from)
        .collect();
    assert_eq!(debs.len(), 2, "two packages, one per line: {debs:?}\n{err}");
    debs
}

/// What `dpkg-deb OPTION DEB [ARGS]` prints.
fn dpkg_deb(option: &str, deb: &Path, args: &[&str]) -> String {
    let out = Command::new("dpkg-deb")
        .arg(option)
        .arg(deb)
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn field(deb: &Path, name: &str) -> String {
    dpkg_deb("-f", deb, &[name]).trim().to_string()
}

fn contents(deb: &Path) -> String {
    dpkg_deb("-c", deb, &[])
}

/// What each package holds, and what it asks of the system.
fn check_contents(daemons: &Path, client: &Path) {
    let d = contents(daemons);
    for path in [
        "./usr/lib/ckpt/ckptd",
        "./usr/lib/ckpt/ckpt-agent",
        "./usr/lib/ckpt/ckpt-rsh",
        "./usr/lib/ckpt/ckpt-init",
        "./usr/lib/ckpt/libckpt_verbs.so",
        "./usr/lib/ckpt/libckpt_criu_verbs.so",
        "./usr/lib/ckpt/criu/bin/criu",
        "./usr/lib/ckpt/criu/usr/sbin/criu",
        "./usr/sbin/ckptd -> ../lib/ckpt/ckptd",
        "./usr/lib/systemd/system/ckptd.service",
        "./usr/lib/systemd/system/ckpt-agent.service",
        "./etc/ckpt/agent.toml",
        "./etc/ckpt/ckptd.toml",
        "./usr/share/doc/ckpt-daemons/criu/criu/copyright",
    ] {
        assert!(d.contains(path), "ckpt-daemons lacks {path}:\n{d}");
    }
    let c = contents(client);
    for path in [
        "./usr/bin/ckptctl",
        "./usr/share/man/man1/ckptctl.1.gz",
        "./usr/share/man/man1/ckptctl-run.1.gz",
        "./usr/share/bash-completion/completions/ckptctl",
        "./usr/share/zsh/vendor-completions/_ckptctl",
    ] {
        assert!(c.contains(path), "ckpt-client lacks {path}:\n{c}");
    }
    let deps = field(daemons, "Depends");
    assert!(
        deps.contains("libibverbs1") && deps.contains("nftables"),
        "{deps}"
    );
    // The bundled CRIU's own libc must not tie the package to this libc's version.
    assert!(!deps.contains("<<"), "{deps}");
    assert_eq!(field(daemons, "Package"), "ckpt-daemons");
    assert_eq!(field(client, "Package"), "ckpt-client");
}

/// `scripts/package.sh` builds ckpt-daemons and ckpt-client; on a fresh Debian 12 test host
/// apt installs them with what they depend on; ckptd and an agent started by their units'
/// commands run a job that is checkpointed, outlives an upgrade of the packages and a restart
/// of both daemons, is stopped by a checkpoint and restarted to the right output;
/// `dpkg --purge` then leaves no file behind that the host did not have.
#[test]
fn packages_install_run_a_job_and_purge_to_nothing_on_a_fresh_host() {
    skip_unless_ready!();
    for tool in ["debootstrap", "dpkg-shlibdeps", "zstd"] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map_or(true, |o| !o.status.success())
        {
            eprintln!("SKIPPED: needs {tool} (scripts/setup.sh installs it)");
            return;
        }
    }
    if !Path::new("/opt/ckpt/criu/usr/sbin/criu").exists() {
        eprintln!("SKIPPED: needs the private CRIU that ckpt-daemons bundles (CKPT_FORCE_PRIVATE_CRIU=1 scripts/setup.sh)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let debs = packages(&dir.path().join("debs"), 1);
    check_contents(&debs[0], &debs[1]);
    // What the host upgrades to while its job runs.
    let newer = packages(&dir.path().join("debs/upgrade"), 2);
    assert_eq!(field(&newer[0], "Version"), "0.1.0-2");
    let base = base();
    let work = dir.path().join("host");
    std::fs::create_dir(&work).unwrap();
    let out = Command::new("timeout")
        .arg("900")
        .arg("bash")
        .arg(script())
        .arg(&base)
        .arg(dir.path().join("debs"))
        .arg(&work)
        .output()
        .expect("run fresh_host.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "the fresh host failed:\n{text}");
    assert!(text.contains("ckpt-daemons 0.1.0-1 installed"), "{text}");
    assert!(text.contains("ckpt-client 0.1.0-1 installed"), "{text}");
    assert!(text.contains("epoch 1 committed"), "{text}");
    // Upgraded under the running job: the site's edit kept, the daemons restarted, the job on.
    assert!(text.contains("upgraded: ckpt-daemons 0.1.0-2"), "{text}");
    assert!(text.contains("upgraded: ckpt-client 0.1.0-2"), "{text}");
    assert!(
        text.contains("upgrade kept the edited agent.toml"),
        "{text}"
    );
    assert!(text.contains("after the upgrade: job running"), "{text}");
    assert!(text.contains("epoch 2 committed"), "{text}");
    assert!(text.contains("restarted from epoch 2"), "{text}");
    assert!(text.contains("output: 1 to 100, once each"), "{text}");
    // The inventory sees what the packages put there, so an empty leftover list means something.
    let installed: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("installed paths: "))
        .and_then(|n| n.trim().parse().ok())
        .expect("the inventory's count after install");
    assert!(
        installed > 100,
        "{installed} new paths after install:\n{text}"
    );
    let left: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("leftover: "))
        .collect();
    assert!(left.is_empty(), "the purge left {left:#?}");
}
