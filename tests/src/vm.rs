//! Soft-RoCE test guests: `scripts/testvm.sh` boots Debian's kernel under QEMU with the host's
//! root file system read-only beneath a tmpfs, so a guest runs this build's binaries, creates the
//! soft-RoCE device `rxe0` and gives real InfiniBand verbs to a test on a host that has none.
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    run_watched(body, settings, &AtomicBool::new(false))
}

/// A guest whose kernel reports a CPU stuck this long has locked up (seen once under TCG on
/// this 2-core host: both vCPUs stuck in the kernel until the run's timeout).
const LOCKUP_STUCK_S: u64 = 120;

/// Whether a console line is the kernel's soft-lockup report of a CPU stuck for at least
/// [`LOCKUP_STUCK_S`] seconds.
fn locked_up(line: &str) -> bool {
    line.contains("BUG: soft lockup")
        && line
            .split("stuck for ")
            .nth(1)
            .and_then(|r| r.split('s').next())
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n >= LOCKUP_STUCK_S)
}

/// [`run`], ended early (status [`LOCKED_UP`]) when its guest's kernel locks up or `abort` is
/// set; sets `abort` itself on a lockup, so that a peer guest is ended too.
fn run_watched(body: &str, settings: &[&str], abort: &AtomicBool) -> GuestRun {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("guest.sh");
    std::fs::write(&file, body).expect("write guest script");
    let mut child = Command::new(script())
        .arg("run")
        .arg(&file)
        .args(settings)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: QEMU and its `timeout` are ended with it.
        .process_group(0)
        .spawn()
        .expect("run testvm.sh");
    let pgid = child.id() as i32;
    // SAFETY: kill takes plain integers; the group is this harness's own child's.
    let end_group = move || unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    };
    let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let stderr = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
    let mut console = String::new();
    let mut lockup = false;
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        // Ends the guest when its peer locked up, even while it prints nothing.
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                if abort.load(Ordering::Relaxed) {
                    end_group();
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        });
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if !lockup && locked_up(&line) {
                lockup = true;
                abort.store(true, Ordering::Relaxed);
                end_group();
            }
            console.push_str(&line);
            console.push('\n');
        }
        done.store(true, Ordering::Relaxed);
    });
    let status = child.wait().expect("wait for testvm.sh");
    console.push_str(&stderr.join().unwrap_or_default());
    if std::env::var_os(CONSOLE_ENV).is_some() {
        eprintln!(
            "--- console of {}\n{console}",
            settings.first().unwrap_or(&"guest")
        );
    }
    // The group was killed before testvm.sh was reaped: its id is not signalled again, as it
    // may belong to another process group by now.
    let ended = abort.load(Ordering::Relaxed);
    GuestRun {
        status: if ended {
            LOCKED_UP
        } else {
            status.code().unwrap_or(-1)
        },
        console: if lockup {
            console + "testvm: the guest's kernel locked up; ended\n"
        } else {
            console
        },
    }
}

/// Set (to anything), every guest's console is printed, passed or not: where a guest test
/// spends its time (the scripts' `say` lines carry the time of day).
pub const CONSOLE_ENV: &str = "CKPT_GUEST_CONSOLE";

/// The status of a guest run ended because its kernel, or its peer's, locked up.
pub const LOCKED_UP: i32 = 124;

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
/// host directory at `/share`: `a` (192.168.98.1) with 3 GiB, `b` (192.168.98.2) with 2.5 GiB
/// (their /tmp, a tmpfs of half that, holds images, partner copies and pre-dumps),
/// named `<name>a`/`<name>b`, each running the workspace's `script` with `ROLE` (a or b) and the
/// variables `env` (`K=V ...`) exported; panics unless both end with status 0. Returns (a, b).
pub fn run_two(
    name: &str,
    script: &str,
    env: &str,
    port: u16,
    timeout_s: u32,
) -> (GuestRun, GuestRun) {
    for attempt in 1..=2 {
        let (a, b) = two_once(name, script, env, port, timeout_s);
        if (a.status == LOCKED_UP || b.status == LOCKED_UP) && attempt == 1 {
            // The guest kernel hung, not the test: said, and tried once more.
            eprintln!(
                "NOTE: a guest kernel locked up (soft lockup); running both guests again:\n{}{}",
                tail(&a.console),
                tail(&b.console)
            );
            continue;
        }
        assert_eq!(
            a.status, 0,
            "guest a: {}\nguest b: {}",
            a.console, b.console
        );
        assert_eq!(b.status, 0, "guest b: {}", b.console);
        return (a, b);
    }
    unreachable!("the second attempt returns or panics")
}

/// The last lines of a console.
fn tail(console: &str) -> String {
    let lines: Vec<&str> = console.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n") + "\n"
}

/// One run of [`run_two`]'s guests, ended together if either kernel locks up.
fn two_once(
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
    let abort = Arc::new(AtomicBool::new(false));
    let (body_b, set_b) = guest("b", port + 1, port, "2560");
    let abort_b = Arc::clone(&abort);
    let b = std::thread::spawn(move || {
        let set: Vec<&str> = set_b.iter().map(String::as_str).collect();
        run_watched(&body_b, &set, &abort_b)
    });
    let (body_a, set_a) = guest("a", port, port + 1, "3072");
    let set: Vec<&str> = set_a.iter().map(String::as_str).collect();
    let a = run_watched(&body_a, &set, &abort);
    (a, b.join().expect("guest b"))
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
        // Each test's time too (libtest's unstable --report-time, as scripts/test.sh asks).
        "{exports}export CKPT_BIN_DIR={bin}\n\
         RUSTC_BOOTSTRAP=1 exec {exe} --exact {tests} --test-threads=1 --nocapture \
         -Z unstable-options --report-time\n",
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_cpu_stuck_for_long_is_a_lockup() {
        let line = |s| {
            format!("[  872.8] watchdog: BUG: soft lockup - CPU#1 stuck for {s}s! [ld-linux-x86-64:316]")
        };
        assert!(super::locked_up(&line(778)));
        assert!(super::locked_up(&line(120)));
        assert!(!super::locked_up(&line(22)));
        assert!(!super::locked_up("stuck for 500s"));
    }
}
