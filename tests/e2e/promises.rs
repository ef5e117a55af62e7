//! End-to-end tests of the promises docs/operations.md makes, on programs ckpt did not write
//! (the shell, `sleep`, the engine itself): a failed or aborted checkpoint leaves the job
//! running (thawed, the engine gone, cancel answering within seconds), whatever made it fail.
//! Each test failed before its fix; each skips with a printed reason where root or CRIU is
//! missing.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ckpt_tests::{script, skip_unless_ready, Ckptd, Ctl, Options};

/// Bound on any wait of these tests; what they wait for takes seconds when it works.
const LIMIT: Duration = Duration::from_secs(120);

/// A job of the shell's: `prelude`, then a counter printing `iter N` every 0.2 s for at most
/// two minutes.
fn counting(prelude: &str) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "{prelude}\ni=0; while [ $i -lt 600 ]; do echo \"iter $i\"; i=$((i+1)); sleep 0.2; done"
        ),
    ]
}

/// The job's cgroup's freezer state ("THAWED" where the file is gone).
fn freezer(d: &Ckptd, job: u64) -> String {
    std::fs::read_to_string(d.cgroup(job).join("freezer.state"))
        .unwrap_or_else(|_| "THAWED".into())
        .trim()
        .to_string()
}

/// Waits (bounded) until the job's cgroup is in `state`.
#[track_caller]
fn wait_freezer(d: &Ckptd, job: u64, state: &str) {
    let begin = Instant::now();
    while freezer(d, job) != state {
        assert!(
            begin.elapsed() < LIMIT,
            "job {job}'s cgroup is still {} after {LIMIT:?}, wanted {state}",
            freezer(d, job)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asserts that the job goes on printing: `more` lines past what it has printed now.
#[track_caller]
fn assert_runs_on(d: &Ckptd, job: u64, more: usize) {
    let now = d.output(job).matches("iter ").count();
    d.wait_progress(job, now + more, LIMIT);
}

/// The state letter of process `pid` (`/proc/PID/stat`).
fn proc_state(pid: i32) -> Option<char> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    text[text.rfind(')')? + 2..].chars().next()
}

/// The engine of [`start_with_hanging_criu`]: a dump that hangs is `sleep SECONDS`, a number
/// of this test's own (so that no other test's leftover is taken for it).
struct Hanging {
    /// While this file exists, dumps hang.
    file: PathBuf,
    /// The command line of a hanging dump.
    cmdline: Vec<u8>,
}

impl Hanging {
    /// Whether a hanging dump runs.
    fn running(&self) -> bool {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .any(|c| c == self.cmdline)
    }

    /// Waits (bounded) until a hanging dump runs (`true`) or none does.
    #[track_caller]
    fn wait(&self, running: bool) {
        let begin = Instant::now();
        while self.running() != running {
            assert!(
                begin.elapsed() < LIMIT,
                "the hanging engine {} after {LIMIT:?}",
                if running {
                    "never started"
                } else {
                    "still runs"
                }
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A coordinator whose criu is the real one, except that a dump hangs for ever (as one
/// seizing a stopped process in a frozen cgroup does) while the returned file exists.
fn start_with_hanging_criu(extra_toml: &str) -> (Ckptd, Hanging) {
    let holder = tempfile::Builder::new()
        .prefix("ckpt-criu-")
        .tempdir()
        .unwrap();
    let real = ckpt_tests::criu_path().unwrap();
    let file = holder.path().join("hang-dump");
    let seconds = 100_000 + std::process::id() % 100_000;
    let path = holder.path().join("criu");
    script(
        &path,
        &format!(
            "if [ \"$1\" = dump ] && [ -e {h} ]; then exec sleep {seconds}; fi\nexec {real} \"$@\"",
            h = file.display(),
            real = real.display()
        ),
    );
    let d = Ckptd::start(Options {
        criu: Some(path),
        extra_toml: extra_toml.into(),
        ..Options::default()
    });
    std::mem::forget(holder);
    let cmdline = format!("sleep\0{seconds}\0").into_bytes();
    (d, Hanging { file, cmdline })
}

/// A job holding a stopped process (SIGSTOP; Slurm's suspend sends it): the engine would wait
/// for it for ever inside the frozen cgroup, and the job stayed frozen for ever. The checkpoint
/// is refused at once, naming the process and what to do; the job runs on, thawed, with its
/// process still stopped as it was; continued, it is checkpointed; a cancel ends it.
#[test]
fn a_stopped_process_is_refused_at_once_and_the_job_left_as_it_was() {
    skip_unless_ready!();
    let d = Ckptd::start(Options::default());
    let job = d.run_job("stopped", &counting("sleep 600 & kill -STOP $!"));
    d.wait_progress(job, 2, LIMIT);
    // The shell's child, stopped (before or after it became `sleep`).
    let sleeper = d
        .job_pids(job)
        .into_iter()
        .find(|&p| proc_state(p) == Some('T'))
        .expect("a stopped process in the job");
    assert_eq!(proc_state(sleeper), Some('T'), "stopped");
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert_eq!(out.code, 6, "refused: {out:?}");
    assert!(
        out.stderr.contains(&format!("process {sleeper} ("))
            && out.stderr.contains("is stopped (SIGSTOP or SIGTSTP)")
            && out.stderr.contains(&format!("kill -CONT {sleeper}")),
        "names the process and what to do: {out:?}"
    );
    assert_eq!(freezer(&d, job), "THAWED");
    assert_eq!(d.status(job)["state"], "running");
    assert_runs_on(&d, job, 3);
    assert_eq!(proc_state(sleeper), Some('T'), "left stopped, as it was");
    let epochs = d.epochs(job);
    assert_eq!(epochs.len(), 1, "{epochs:?}");
    assert_eq!(epochs[0]["state"], "failed", "{epochs:?}");
    assert!(!d.images(job, 1).exists(), "nothing left of the epoch");

    // SAFETY: kill(2) on a PID of the job's own cgroup.
    unsafe { libc::kill(sleeper, libc::SIGCONT) };
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert!(out.ok().contains("epoch 2 committed"), "{out:?}");
    assert_runs_on(&d, job, 2);
    d.ctl(&["cancel", &job.to_string()]).ok();
    assert_eq!(d.status(job)["state"], "cancelled");
}

/// A dump that never ends by itself: meanwhile a cancel is refused at once (the job is being
/// checkpointed); at the coordinator's deadline the epoch is aborted, the engine killed and the
/// job thawed at once (before, the abort waited for the dump, which held the job frozen for
/// ever, and every call on it waiting); the job runs on, the next checkpoint commits, and a
/// cancel ends it.
#[test]
fn a_hung_dump_is_stopped_at_its_deadline_and_the_job_thawed() {
    skip_unless_ready!();
    let (d, hang) = start_with_hanging_criu("[deadlines]\ndump = \"5s\"\n");
    let job = d.run_job("hung", &counting(""));
    d.wait_progress(job, 2, LIMIT);
    std::fs::write(&hang.file, b"").unwrap();
    let waiting = d.ctl_spawn(&["checkpoint", &job.to_string(), "--wait"]);
    wait_freezer(&d, job, "FROZEN");
    hang.wait(true);
    let refused = d.ctl(&["cancel", &job.to_string()]);
    assert_eq!(refused.code, 4, "{refused:?}");
    assert!(refused.stderr.contains("checkpointing"), "{refused:?}");
    let out = Ctl::finish(waiting, LIMIT);
    assert_eq!(out.code, 9, "the deadline's own exit code: {out:?}");
    assert!(out.stderr.contains("deadline"), "{out:?}");
    wait_freezer(&d, job, "THAWED");
    hang.wait(false);
    assert_eq!(d.status(job)["state"], "running");
    assert_runs_on(&d, job, 3);
    let epochs = d.epochs(job);
    assert_eq!(epochs[0]["state"], "failed", "{epochs:?}");
    std::fs::remove_file(&hang.file).unwrap();
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert!(out.ok().contains("epoch 2 committed"), "{out:?}");
    assert_runs_on(&d, job, 2);
    d.ctl(&["cancel", &job.to_string()]).ok();
    assert_eq!(d.status(job)["state"], "cancelled");
    assert!(d.job_pids(job).is_empty(), "the job ended");
}

/// A file deleted while open and still linked elsewhere: the engine restores it through a link
/// it makes at the dump and removes after a dump that lets the job run on, so the committed
/// epoch could not be restored ("Can't link …/link_remap.N"). The agent keeps a copy in the
/// epoch and puts it back for the restore: the job is killed, restarted, and reads the file's
/// contents through the descriptor it held, twice over (a second epoch after the restart).
#[test]
fn a_file_deleted_while_open_is_restored_from_a_committed_epoch() {
    skip_unless_ready!();
    let d = Ckptd::start(Options::default());
    let files = tempfile::Builder::new()
        .prefix("ckpt-deleted-")
        .tempdir()
        .unwrap();
    let dir = files.path().display().to_string();
    // The shell holds `held` on descriptor 3, then its name goes; `other` still links it.
    let job = d.run_job(
        "deleted",
        &[
            "sh".into(),
            "-c".into(),
            format!(
                "cd {dir} && echo kept-data > held && exec 3<held && ln held other && rm held && \
                 i=0; while [ $i -lt 600 ]; do echo \"iter $i $(cat /proc/$$/fd/3)\"; i=$((i+1)); sleep 0.2; done"
            ),
        ],
    );
    d.wait_progress(job, 2, LIMIT);
    assert!(d.output(job).contains("kept-data"), "{}", d.output(job));
    for epoch in 1..=2 {
        let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
        assert!(
            out.ok().contains(&format!("epoch {epoch} committed")),
            "{out:?}"
        );
        let before = d.output(job).matches("iter ").count();
        d.kill_job(job);
        d.wait_state(job, "killed", LIMIT);
        let out = d.ctl(&["restart", &job.to_string()]);
        assert_eq!(out.code, 0, "epoch {epoch} restores: {out:?}");
        d.wait_progress(job, before + 2, LIMIT);
        let last = d
            .output(job)
            .lines()
            .rev()
            .find(|l| l.starts_with("iter "))
            .unwrap_or_default()
            .to_string();
        assert!(
            last.ends_with(" kept-data"),
            "read after the restart: {last:?}"
        );
    }
    // Nothing of the engine's links is left beside the user's file.
    let mut names: Vec<String> = std::fs::read_dir(files.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["other"], "the directory is as the job left it");
    d.ctl(&["cancel", &job.to_string()]).ok();
}

/// A program that daemonizes (util-linux's `setsid -f`, as a site's script starts a helper in
/// the background), and a helper that ignores SIGTERM: the job was reported "exited (0)" while
/// they ran on in its cgroup, which then stayed behind. A job ends with its command, as a batch
/// job does: what it left running is ended with it (SIGTERM, then SIGKILL), its stderr says
/// so, and nothing of the job is left on the node, processes or cgroup.
#[test]
fn a_daemonizing_program_ends_with_its_command() {
    skip_unless_ready!("setsid");
    let d = Ckptd::start(Options::default());
    let job = d.run_job(
        "daemon",
        &[
            "sh".into(),
            "-c".into(),
            "setsid -f sleep 600; (trap '' TERM; exec sleep 601) & echo launched".into(),
        ],
    );
    let state = d.wait_state(job, "exited", LIMIT);
    assert_eq!(state, "exited (0)");
    assert!(d.job_pids(job).is_empty(), "{:?}", d.job_pids(job));
    let stderr = std::fs::read_to_string(d.job_dir(job).join("stderr")).unwrap_or_default();
    assert!(
        stderr.contains("2 process(es) it left running were ended with it"),
        "the job's stderr says so: {stderr:?}"
    );
    let begin = Instant::now();
    while d.cgroup(job).exists() {
        assert!(begin.elapsed() < LIMIT, "the job's cgroup was left behind");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert_eq!(out.code, 4, "an ended job is not checkpointed: {out:?}");
}

/// A mount the test makes on the machine and removes when dropped.
struct NodeMount(PathBuf);

impl NodeMount {
    fn make(point: PathBuf) -> Self {
        std::fs::create_dir_all(&point).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "ckpt-passing"])
            .arg(&point)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount a tmpfs at {}", point.display());
        NodeMount(point)
    }

    /// A tmpfs at `point` in a peer group of its own (`mount --make-shared`), as systemd makes
    /// every mount of a node: what is mounted below it later propagates to its copies.
    fn shared(point: PathBuf) -> Self {
        let m = NodeMount::make(point);
        let ok = std::process::Command::new("mount")
            .arg("--make-shared")
            .arg(&m.0)
            .status()
            .unwrap()
            .success();
        assert!(ok, "make {} shared", m.0.display());
        m
    }
}

impl Drop for NodeMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-R")
            .arg(&self.0)
            .status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A mount the node makes after a sandboxed part started (another tool's, a login's
/// /run/user/UID), below a mount that is shared as systemd makes them: it reached the part's
/// namespace, was dumped with it, and once it was gone the part could not be restored ("Can't
/// stat mountpoint"). The part's mounts are now those it started with (and the followed ones):
/// it does not see the passing mount, and restores after the mount is gone.
#[test]
fn a_mount_the_node_makes_after_a_part_started_is_not_dumped_with_it() {
    skip_unless_ready!("nsenter", "nft", "mount", "umount");
    let Some((_cluster, d)) = ckpt_tests::hosts::hosts_with(&["n1"], false, true, None, "") else {
        return;
    };
    let parent = NodeMount::shared(PathBuf::from(format!(
        "/run/ckpt-shared-{}",
        std::process::id()
    )));
    let job = ckpt_tests::hosts::run_on(&d, "n1", &counting(""));
    let point = parent.0.join("passing");
    let passing = NodeMount::make(point.clone());
    let part = d.job_pids_on("n1", job);
    let seen = std::fs::read_to_string(format!("/proc/{}/mountinfo", part[0])).unwrap();
    assert!(
        !seen.contains(&point.display().to_string()),
        "the part does not see a mount made after it started: {seen}"
    );
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert!(out.ok().contains("epoch 1 committed"), "{out:?}");
    d.kill_job_on(&["n1"], job);
    d.wait_state(job, "killed", LIMIT);
    drop(passing);
    assert!(!point.exists(), "the node's mount is gone");
    let before = d.job_output_on("n1", job).matches("iter ").count();
    let out = d.ctl(&["restart", &job.to_string()]);
    assert_eq!(out.code, 0, "restored without the passing mount: {out:?}");
    let begin = Instant::now();
    while d.job_output_on("n1", job).matches("iter ").count() < before + 2 {
        assert!(begin.elapsed() < LIMIT, "no progress after the restart");
        std::thread::sleep(Duration::from_millis(100));
    }
    d.ctl(&["cancel", &job.to_string()]).ok();
}

/// A program that watches the mount its files are on (fanotify, as an auditing or caching tool
/// does) and checks each of its writes is reported, with a named socket beside them: its
/// restore is guarded against links in that directory (sticky `/tmp` is a user's). The guard
/// used to bind the directory onto itself for good, so after a restart the writes went through
/// a mount the program's mark did not cover ("MISSED"), and the agent's staging and state
/// directories showed as mounts in the job's view. The restored program sees the node's mounts
/// again, and none of the agent's.
#[test]
fn a_mark_on_a_mount_still_covers_the_files_of_a_restored_job() {
    skip_unless_ready!("python3");
    let d = Ckptd::start(Options::default());
    let files = tempfile::Builder::new()
        .prefix("ckpt-fanotify-")
        .tempdir()
        .unwrap();
    let dir = files.path().display().to_string();
    let job = d.run_job(
        "fanotify",
        &["python3".into(), "-c".into(), FANOTIFY.into(), dir.clone()],
    );
    d.wait_progress(job, 2, LIMIT);
    assert!(!d.output(job).contains("MISSED"), "{}", d.output(job));
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert!(out.ok().contains("epoch 1 committed"), "{out:?}");
    d.kill_job(job);
    d.wait_state(job, "killed", LIMIT);
    let _ = std::fs::remove_file(files.path().join("sock"));
    let before = d.output(job).matches("iter ").count();
    let out = d.ctl(&["restart", &job.to_string()]);
    assert_eq!(out.code, 0, "{out:?}");
    d.wait_progress(job, before + 3, LIMIT);
    let output = d.output(job);
    let after: Vec<&str> = output
        .lines()
        .filter(|l| l.starts_with("iter "))
        .skip(before)
        .collect();
    assert!(
        !after.is_empty() && after.iter().all(|l| l.ends_with(" seen")),
        "every write after the restart is reported: {after:?}"
    );
    let pid = d.job_pids(job)[0];
    let view = |p: &str| -> Vec<String> {
        std::fs::read_to_string(format!("/proc/{p}/mountinfo"))
            .unwrap()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(String::from))
            .collect()
    };
    let (theirs, ours) = (view(&pid.to_string()), view("self"));
    let agent = d.dir.path().display().to_string();
    let extra: Vec<&String> = theirs
        .iter()
        .filter(|m| !ours.contains(m))
        .filter(|m| dir.starts_with(m.as_str()) || m.starts_with(&agent))
        .collect();
    assert!(
        extra.is_empty(),
        "mounts in the restored job's view the node does not have, on the way to its files or of the agent's: {extra:?}"
    );
    d.ctl(&["cancel", &job.to_string()]).ok();
}

/// The watcher of [`a_mark_on_a_mount_still_covers_the_files_of_a_restored_job`]: marks the
/// mount of directory `argv[1]`, then every 0.2 s writes a file there and prints `iter N seen`
/// once the mark reports its close, `iter N MISSED` after 2 s without.
const FANOTIFY: &str = r#"
import ctypes, os, select, socket, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
d = sys.argv[1]
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(d, "sock"))
fan = libc.fanotify_init(0x1 | 0x2, os.O_RDONLY)
if fan < 0 or libc.fanotify_mark(fan, 0x1 | 0x10, 0x8, -100, d.encode()) != 0:
    sys.exit("fanotify: " + os.strerror(ctypes.get_errno()))
probe = os.path.join(d, "probe")
for i in range(600):
    with open(probe, "w") as f:
        f.write("x")
    seen, end = False, time.time() + 2
    while not seen and time.time() < end:
        if not select.select([fan], [], [], 0.5)[0]:
            continue
        try:
            buf = os.read(fan, 65536)
        except BlockingIOError:
            continue
        off = 0
        while off + 24 <= len(buf):
            size, _, _, _, mask, fd, pid = struct.unpack_from("IBBHQii", buf, off)
            if fd >= 0:
                try:
                    seen = seen or os.readlink("/proc/self/fd/%d" % fd) == probe
                except OSError:
                    pass
                os.close(fd)
            off += size
    print("iter %d %s" % (i, "seen" if seen else "MISSED"), flush=True)
    time.sleep(0.2)
"#;

/// A server's connections to a client outside the job, in each state a connection may be in
/// when the job is stopped by `checkpoint --kill` and restarted (as the engine's own tests of
/// those states do by hand), over IPv4 and IPv6: the client's half closed (the server in
/// CLOSE_WAIT), the server's half closed (FIN_WAIT2), both open; and words the client sends
/// after the dump, before the kill (the kill held back by a failpoint); and a `--kill` whose
/// epoch fails after the dump (the job runs on, its connections open). The engine's lock was
/// gone at the end of the dump, so the kill's FIN reached the client: after the restart it read
/// an end of file where the answer should be ("received b''"), and its words to the server were
/// lost; words sent before the kill were taken in by the frozen server's kernel, which the
/// images did not hold. The connections now stay locked from before the dump to the end of the
/// restart: the client gets its answer, the server goes on, and nothing of the lock is left.
#[test]
fn connections_to_a_client_outside_the_job_survive_a_checkpoint_kill_and_restart() {
    skip_unless_ready!("python3");
    let d = Ckptd::start(Options {
        failpoints: true,
        ..Options::default()
    });
    let mut failed = Vec::new();
    for host in ["127.0.0.1", "::1"] {
        if std::net::TcpListener::bind((host, 0)).is_err() {
            eprintln!("SKIPPED {host}: no such address here");
            continue;
        }
        for (mode, answer) in [
            ("close-wait", "answer after the restart"),
            ("fin-wait-2", "heard late words"),
            ("established", "answer after the restart"),
            ("sent-before-the-kill", "heard late words"),
            ("kill-aborted", "heard late words"),
        ] {
            let got = client_across_a_restart(&d, host, mode);
            let ok = got.contains(&format!("received b'{answer}'"));
            eprintln!("{host:>9} {mode:<11} {}", if ok { "ok" } else { &got });
            if !ok {
                failed.push(format!("{host} {mode}: {got}"));
            }
        }
    }
    assert!(failed.is_empty(), "the client outside the job: {failed:#?}");
    let tables = std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    let tables = String::from_utf8_lossy(&tables.stdout);
    assert!(
        !tables.contains("ckpt_lock_") && !tables.contains("ckpt_hold_"),
        "no lock or hold is left: {tables}"
    );
}

/// One cell of [`connections_to_a_client_outside_the_job_survive_a_checkpoint_kill_and_restart`]:
/// the server as a job on `host`, its client outside, the connections brought to `mode`, a
/// `checkpoint --kill` and a restart; then the client asks. Returns what the client printed and,
/// where the server did not go on after answering, what it printed.
fn client_across_a_restart(d: &Ckptd, host: &str, mode: &str) -> String {
    let port = ckpt_tests::free_port().to_string();
    let args = [port.as_str(), mode, host];
    let mut argv = vec!["python3".to_string(), "-c".into(), TCP_SERVER.into()];
    argv.extend(args.iter().map(|a| a.to_string()));
    let job = d.run_job("tcp-peer", &argv);
    let wait_for = |text: &str| {
        let begin = Instant::now();
        while !d.output(job).contains(text) {
            assert!(begin.elapsed() < LIMIT, "{}", d.output(job));
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for("listening");
    let mut client = std::process::Command::new("python3")
        .args(["-c", TCP_CLIENT])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("ready");
    d.wait_progress(job, 2, LIMIT);
    let say = |client: &mut std::process::Child, line: &str| {
        use std::io::Write;
        let stdin = client.stdin.as_mut().unwrap();
        stdin.write_all(format!("{line}\n").as_bytes()).unwrap();
        stdin.flush().unwrap();
    };
    if mode == "sent-before-the-kill" {
        // The kill waits 3 s after the dump: the client's words come in that time.
        d.set_failpoints("resume=delay:3s\n");
        let kill = d.ctl_spawn(&["checkpoint", &job.to_string(), "--kill"]);
        let begin = Instant::now();
        while !d
            .epochs(job)
            .iter()
            .any(|e| e["state"].as_str().unwrap_or_default().contains("resume"))
        {
            assert!(begin.elapsed() < LIMIT, "the epoch never reached resume");
            std::thread::sleep(Duration::from_millis(20));
        }
        say(&mut client, "send");
        let out = Ctl::finish(kill, LIMIT);
        assert!(out.ok().contains("epoch 1 committed"), "{out:?}");
        d.set_failpoints("");
    } else if mode == "kill-aborted" {
        // The epoch fails after its dump, before the kill: the job runs on, its connections
        // with it.
        d.set_failpoints("resume=error\n");
        let out = d.ctl(&["checkpoint", &job.to_string(), "--kill"]);
        assert_ne!(out.code, 0, "the epoch fails: {out:?}");
        d.set_failpoints("");
        say(&mut client, "send");
    } else {
        let out = d.ctl(&["checkpoint", &job.to_string(), "--kill"]);
        assert!(out.ok().contains("epoch 1 committed"), "{out:?}");
    }
    if mode != "kill-aborted" {
        d.wait_state(job, "stopped", LIMIT);
        // Long enough for a FIN, or the reset of a peer gone, to reach the client.
        std::thread::sleep(Duration::from_secs(1));
        let before = d.output(job).matches("iter ").count();
        let out = d.ctl(&["restart", &job.to_string()]);
        assert_eq!(out.code, 0, "{out:?}");
        d.wait_progress(job, before + 2, LIMIT);
    }
    say(&mut client, "go");
    let mut got = Ctl::finish(client, LIMIT).stdout.trim().to_string();
    let before = d.output(job).matches("iter ").count();
    let begin = Instant::now();
    while d.output(job).matches("iter ").count() < before + 2 && begin.elapsed() < LIMIT / 4 {
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = d.output(job);
    if !output.contains("answered") || output.matches("iter ").count() < before + 2 {
        got += &format!(" | the server: {output}");
    }
    d.ctl(&["cancel", &job.to_string()]).ok();
    got
}

/// The server of [`client_across_a_restart`]: on `argv[3]`:`argv[1]`, accepts a data and a
/// control connection and brings the data connection to `argv[2]` (`close-wait`: waits for the
/// client's end of file; `fin-wait-2`: closes its own side). Then prints `iter N` every 0.2 s;
/// told `go` on the control connection it answers: on the data connection, which it then
/// closes, or (`fin-wait-2`, `sent-before-the-kill`, `kill-aborted`) on the control connection, with what the
/// client sent on the data connection. It runs on once the client is gone.
const TCP_SERVER: &str = r#"
import select, socket, sys
port, mode, host = int(sys.argv[1]), sys.argv[2], sys.argv[3]
srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(2)
print("listening", flush=True)
data, _ = srv.accept()
ctl, _ = srv.accept()
if mode == "close-wait" and data.recv(16) != b"":
    sys.exit("the client sent data where its end of file was awaited")
if mode == "fin-wait-2":
    data.shutdown(socket.SHUT_WR)
print("ready", flush=True)
watched = [ctl]
for i in range(600):
    if select.select(watched, [], [], 0.2)[0]:
        word = ctl.recv(16)
        if word == b"go" and mode in ("fin-wait-2", "sent-before-the-kill", "kill-aborted"):
            ctl.sendall(b"heard " + data.recv(64))
            print("answered", flush=True)
        elif word == b"go":
            data.sendall(b"answer after the restart")
            data.shutdown(socket.SHUT_WR)
            print("answered", flush=True)
        elif word == b"":
            watched = []
        else:
            sys.exit("the control connection said %r" % word)
    print("iter %d" % i, flush=True)
"#;

/// The client of [`client_across_a_restart`], outside the job: connects twice (closing its
/// side of the first for `close-wait`), waits for a line on its stdin, then says `go` on the
/// second (first sending `late words` on the first, for `fin-wait-2`; for
/// `sent-before-the-kill` and `kill-aborted`, at a line before) and prints what the answer's connection brings,
/// to its end.
const TCP_CLIENT: &str = r#"
import socket, sys
port, mode, host = int(sys.argv[1]), sys.argv[2], sys.argv[3]
data = socket.create_connection((host, port))
ctl = socket.create_connection((host, port))
if mode == "close-wait":
    data.shutdown(socket.SHUT_WR)
if mode in ("sent-before-the-kill", "kill-aborted"):
    sys.stdin.readline()
    data.sendall(b"late words")
sys.stdin.readline()
if mode == "fin-wait-2":
    data.sendall(b"late words")
ctl.sendall(b"go")
answers = ctl if mode in ("fin-wait-2", "sent-before-the-kill", "kill-aborted") else data
answers.settimeout(20)
got = b""
try:
    while not (answers is ctl and got.startswith(b"heard ") and len(got) >= 16):
        chunk = answers.recv(4096)
        if not chunk:
            break
        got += chunk
except OSError as e:
    print("error %s after %r" % (e, got), flush=True)
print("received %r" % got, flush=True)
"#;
