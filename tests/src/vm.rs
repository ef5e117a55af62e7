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
    if r.status != 0 {
        panic!("{}", failed_guests(&[("guest", &r)]));
    }
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
    let mut runs = run_guests(name, script, env, port, timeout_s, 2).into_iter();
    let (a, b) = (runs.next(), runs.next());
    (a.expect("guest a"), b.expect("guest b"))
}

/// Roles of the guests of [`run_guests`], in order.
const ROLES: [&str; 3] = ["a", "b", "c"];

/// [`run_two`] for `count` guests (2 or 3): `c` is 192.168.98.3 with 2.5 GiB. Three guests share
/// one segment through a hub on this host (ports `port + 10` to `port + 12`); two are joined by
/// a plain wire. Returns the runs in the order a, b, c.
pub fn run_guests(
    name: &str,
    script: &str,
    env: &str,
    port: u16,
    timeout_s: u32,
    count: usize,
) -> Vec<GuestRun> {
    assert!((2..=ROLES.len()).contains(&count), "2 or 3 guests");
    let boot = Boot {
        name,
        script,
        env,
        port,
        timeout_s,
        count,
    };
    for attempt in 1..=2 {
        let runs = guests_once(&boot);
        if runs.iter().any(|r| r.status == LOCKED_UP) && attempt == 1 {
            // The guest kernel hung, not the test: said, and tried once more.
            let tails: String = runs.iter().map(|r| tail(&r.console)).collect();
            eprintln!(
                "NOTE: a guest kernel locked up (soft lockup); running the guests again:\n{tails}"
            );
            continue;
        }
        if runs.iter().any(|r| r.status != 0) {
            let named: Vec<(&str, &GuestRun)> = ["guest a", "guest b", "guest c"]
                .into_iter()
                .zip(&runs)
                .collect();
            panic!("{}", failed_guests(&named));
        }
        return runs;
    }
    unreachable!("the second attempt returns or panics")
}

/// What [`run_guests`] boots (its arguments).
struct Boot<'a> {
    name: &'a str,
    script: &'a str,
    env: &'a str,
    port: u16,
    timeout_s: u32,
    count: usize,
}

/// One run of [`run_guests`]'s guests, ended together if a kernel locks up.
fn guests_once(boot: &Boot) -> Vec<GuestRun> {
    let (name, env, port, count) = (boot.name, boot.env, boot.port, boot.count);
    let script = crate::workspace().join(boot.script);
    let share = tempfile::tempdir().expect("share dir");
    let share_arg = format!("share={}", share.path().display());
    let timeout = format!("timeout={}", boot.timeout_s);
    // Guest i sends from `port + i`; to its peer's port with two, to the hub's with three.
    let hub = (count > 2).then(|| Hub::start(port, port + 10, count));
    let settings = |i: usize| {
        let role = ROLES[i];
        let peer = match &hub {
            Some(_) => port + 10 + i as u16,
            None => port + 1 - i as u16,
        };
        vec![
            format!("name={name}{role}"),
            format!("ip=192.168.98.{}/24", i + 1),
            format!("mac=52:54:00:00:98:1{}", i + 1),
            format!("wire={}:{peer}", port + i as u16),
            format!("mem={}", if i == 0 { "3072" } else { "2560" }),
            timeout.clone(),
            share_arg.clone(),
        ]
    };
    let body = |i: usize| {
        format!(
            "export ROLE={} {env}\nbash {}\n",
            ROLES[i],
            script.display()
        )
    };
    let abort = Arc::new(AtomicBool::new(false));
    let others: Vec<_> = (1..count)
        .map(|i| {
            let (body, set, abort) = (body(i), settings(i), Arc::clone(&abort));
            std::thread::spawn(move || {
                let set: Vec<&str> = set.iter().map(String::as_str).collect();
                run_watched(&body, &set, &abort)
            })
        })
        .collect();
    let set = settings(0);
    let set: Vec<&str> = set.iter().map(String::as_str).collect();
    let mut runs = vec![run_watched(&body(0), &set, &abort)];
    runs.extend(others.into_iter().map(|t| t.join().expect("guest")));
    drop(hub);
    runs
}

/// An Ethernet segment for three or more guests: guest i's wire sends to this host's UDP port
/// `base + i`, and each frame goes on, from that same port, to the guests that should see it
/// (the one its destination address was last seen from; every other guest until then, and for
/// broadcasts). Ended when dropped.
struct Hub {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Hub {
    /// Listens on `base..base + count`; guest i receives at `guests + i`.
    fn start(guests: u16, base: u16, count: usize) -> Hub {
        use std::collections::HashMap;
        use std::net::UdpSocket;
        use std::sync::Mutex;
        let sockets: Arc<Vec<UdpSocket>> = Arc::new(
            (0..count)
                .map(|i| {
                    let s = UdpSocket::bind(("127.0.0.1", base + i as u16)).expect("hub port");
                    s.set_read_timeout(Some(std::time::Duration::from_millis(200)))
                        .expect("hub timeout");
                    s
                })
                .collect(),
        );
        let seen: Arc<Mutex<HashMap<[u8; 6], usize>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..count)
            .map(|from| {
                let (sockets, seen, stop) = (sockets.clone(), seen.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut frame = vec![0u8; 65536];
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(n) = sockets[from].recv(&mut frame) else {
                            continue;
                        };
                        if n < 12 {
                            continue;
                        }
                        let mac = |at: usize| -> [u8; 6] {
                            frame[at..at + 6].try_into().expect("6 bytes")
                        };
                        let to = {
                            let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                            seen.insert(mac(6), from);
                            seen.get(&mac(0)).copied()
                        };
                        for i in (0..count).filter(|&i| i != from && to.is_none_or(|t| t == i)) {
                            let _ =
                                sockets[i].send_to(&frame[..n], ("127.0.0.1", guests + i as u16));
                        }
                    }
                })
            })
            .collect();
        Hub { stop, threads }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The last lines of a console.
fn tail(console: &str) -> String {
    tail_n(console, 8)
}

/// The last `n` lines of a console.
pub fn tail_n(console: &str, n: usize) -> String {
    let lines: Vec<&str> = console.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n") + "\n"
}

/// The message of a failed guest run: each guest's status, and first the lines of a failed
/// one's console before its script's failure report (a line with "ends with status", which
/// tests/guest/two_nodes.sh prints; else its last lines): there a script says why it stopped,
/// and a CI log cut to each panic's first lines keeps it. Then the ends and the whole consoles.
pub fn failed_guests(runs: &[(&str, &GuestRun)]) -> String {
    let mut m = String::new();
    for (name, r) in runs {
        m += &format!("{name}: script status {}\n", r.status);
    }
    for (name, r) in runs.iter().filter(|(_, r)| r.status != 0) {
        let lines: Vec<&str> = r.console.lines().collect();
        let end = lines
            .iter()
            .rposition(|l| l.contains(" ends with status "))
            .map_or(lines.len(), |i| i + 1);
        let why = lines[end.saturating_sub(20)..end].join("\n");
        m += &format!("--- {name}, why it stopped\n{why}\n");
    }
    for (name, r) in runs {
        m += &format!(
            "--- {name}, the end of its console\n{}",
            tail_n(&r.console, 30)
        );
    }
    for (name, r) in runs {
        m += &format!("--- {name}, its whole console\n{}", r.console);
    }
    m
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
    if r.status != 0 {
        panic!("{}", failed_guests(&[("guest", &r)]));
    }
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

    /// The hub floods a frame for an address it has not seen to every other guest, and once
    /// it has seen an address, sends frames for it to that guest only.
    #[test]
    fn the_hub_floods_unknown_addresses_and_learns_where_each_is() {
        use std::net::UdpSocket;
        use std::time::Duration;
        // Ports of their own (the guest tests use 17991-18007).
        let base = 17960;
        let guests: Vec<UdpSocket> = (0..3)
            .map(|i| {
                let s = UdpSocket::bind(("127.0.0.1", base + i)).unwrap();
                s.set_read_timeout(Some(Duration::from_millis(300)))
                    .unwrap();
                s
            })
            .collect();
        let hub_base = base + 10;
        let _hub = super::Hub::start(base, hub_base, 3);
        let frame = |dst: u8, src: u8| {
            let mut f = vec![0u8; 60];
            f[..6].copy_from_slice(&[2, 0, 0, 0, 0, dst]);
            f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, src]);
            f
        };
        let got = |i: usize| {
            let mut buf = [0u8; 100];
            guests[i].recv(&mut buf).ok().map(|n| buf[..n].to_vec())
        };
        // From guest 0 (address 10) to 12, unknown yet: both others get it.
        guests[0]
            .send_to(&frame(12, 10), ("127.0.0.1", hub_base))
            .unwrap();
        assert_eq!(got(1), Some(frame(12, 10)));
        assert_eq!(got(2), Some(frame(12, 10)));
        // Guest 2 answers from 12: only guest 0 (where 10 was seen) gets it.
        guests[2]
            .send_to(&frame(10, 12), ("127.0.0.1", hub_base + 2))
            .unwrap();
        assert_eq!(got(0), Some(frame(10, 12)));
        assert_eq!(got(1), None, "guest 1 is not where 10 is");
        // Now 12 is known: guest 0's next frame to it reaches guest 2 only.
        guests[0]
            .send_to(&frame(12, 10), ("127.0.0.1", hub_base))
            .unwrap();
        assert_eq!(got(2), Some(frame(12, 10)));
        assert_eq!(got(1), None);
    }
}
