//! Soft-RoCE test guests: `scripts/testvm.sh` boots Debian's kernel under QEMU with the host's
//! root file system read-only beneath a tmpfs, so a guest runs this build's binaries, creates the
//! soft-RoCE device `rxe0` and gives real InfiniBand verbs to a test on a host that has none.
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::workspace;

/// The harness script.
pub fn script() -> PathBuf {
    workspace().join("scripts/testvm.sh")
}

/// Why guests cannot run here, if they cannot (`scripts/setup.sh --vm` prepares them).
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root".into());
    }
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .map(|s| !s.success())
        .unwrap_or(true)
    {
        return Some("needs qemu-system-x86_64 (run scripts/setup.sh --vm)".into());
    }
    let dir = std::env::var_os("CKPT_VM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/ckpt-vm"));
    if !dir.join("abi").is_file() {
        return Some(format!(
            "no test VM prepared in {} (run scripts/setup.sh --vm)",
            dir.display()
        ));
    }
    None
}

/// What a guest run returned.
#[derive(Debug)]
pub struct GuestRun {
    /// The script's exit status (125: the guest gave none).
    pub status: i32,
    /// The guest console: the script's output, kernel messages.
    pub console: String,
}

/// Boots one guest, runs `body` (bash) in it as root, and returns its status and console.
/// `settings` are `testvm.sh run` KEY=VALUE settings (name, ip, mac, wire, timeout...).
pub fn run(body: &str, settings: &[&str]) -> GuestRun {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("guest.sh");
    std::fs::write(&file, body).expect("write guest script");
    let out = Command::new(script())
        .arg("run")
        .arg(&file)
        .args(settings)
        .stdin(Stdio::null())
        .output()
        .expect("run testvm.sh");
    GuestRun {
        status: out.status.code().unwrap_or(-1),
        console: String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr),
    }
}

/// Boots one guest (2 GiB) named `name` that runs the workspace's `script` with the variables
/// `env` (`K=V ...`) exported, within `timeout_s`; panics unless it ends with status 0.
pub fn run_script(name: &str, script: &str, env: &str, timeout_s: u32) -> GuestRun {
    let body = format!(
        "export {env}\nbash {}\n",
        crate::workspace().join(script).display()
    );
    let r = run(
        &body,
        &[
            &format!("name={name}"),
            "mem=2048",
            &format!("timeout={timeout_s}"),
        ],
    );
    assert_eq!(r.status, 0, "guest script failed: {}", r.console);
    r
}

/// Boots two guests joined by a UDP wire on host ports `port` and `port + 1`, sharing a fresh
/// host directory at `/share`: `a` (192.168.98.1) with 2 GiB, `b` (192.168.98.2) with 1.5 GiB,
/// named `<name>a`/`<name>b`, each running the workspace's `script` with `ROLE` (a or b) and the
/// variables `env` (`K=V ...`) exported; panics unless both end with status 0. Returns (a, b).
pub fn run_two(
    name: &str,
    script: &str,
    env: &str,
    port: u16,
    timeout_s: u32,
) -> (GuestRun, GuestRun) {
    let script = crate::workspace().join(script);
    let body = |role: &str| format!("export ROLE={role} {env}\nbash {}\n", script.display());
    let share = tempfile::tempdir().expect("share dir");
    let share_arg = format!("share={}", share.path().display());
    let timeout = format!("timeout={timeout_s}");
    let guest = |role: &str, me: u16, peer: u16, mem: &str| {
        let settings = [
            format!("name={name}{role}"),
            format!("ip=192.168.98.{}/24", if role == "a" { 1 } else { 2 }),
            format!("mac=52:54:00:00:98:1{}", if role == "a" { 1 } else { 2 }),
            format!("wire={me}:{peer}"),
            format!("mem={mem}"),
            timeout.clone(),
            share_arg.clone(),
        ];
        (body(role), settings)
    };
    let (body_b, set_b) = guest("b", port + 1, port, "1536");
    let b = std::thread::spawn(move || {
        let set: Vec<&str> = set_b.iter().map(String::as_str).collect();
        run(&body_b, &set)
    });
    let (body_a, set_a) = guest("a", port, port + 1, "2048");
    let set: Vec<&str> = set_a.iter().map(String::as_str).collect();
    let a = run(&body_a, &set);
    let b = b.join().expect("guest b");
    assert_eq!(
        a.status, 0,
        "guest a: {}\nguest b: {}",
        a.console, b.console
    );
    assert_eq!(b.status, 0, "guest b: {}", b.console);
    (a, b)
}

/// Runs the named tests of the calling test binary again inside one guest (`name`: the guest's
/// name), for what this host's kernel or container cannot do (cgroup v2, every capability), and
/// panics unless every one of them ran and passed there, none skipped.
pub fn rerun_in_guest(name: &str, tests: &[&str]) {
    rerun_in_guest_with(name, tests, &[]);
}

/// [`rerun_in_guest`] with variables `env` exported to the tests (e.g. what the host computes
/// faster than the guest).
pub fn rerun_in_guest_with(name: &str, tests: &[&str], env: &[(&str, String)]) {
    let exe = std::env::current_exe().expect("this test binary");
    let exports: String = env
        .iter()
        .map(|(k, v)| format!("export {k}='{v}'\n"))
        .collect();
    let body = format!(
        "{exports}export CKPT_BIN_DIR={bin}\nexec {exe} --exact {tests} --test-threads=1 --nocapture\n",
        bin = crate::bin_dir().display(),
        exe = exe.display(),
        tests = tests.join(" "),
    );
    let r = run(&body, &[&format!("name={name}"), "mem=2048", "timeout=900"]);
    assert_eq!(r.status, 0, "guest run failed: {}", r.console);
    let want = format!("test result: ok. {} passed", tests.len());
    assert!(r.console.contains(&want), "all ran: {}", r.console);
    for line in ["SKIPPED", "NOTE:"] {
        assert!(!r.console.contains(line), "nothing skipped: {}", r.console);
    }
}
