//! End-to-end tests of who may run jobs and what root does with users' files: launches as root
//! or as system accounts are refused, a job never runs in a directory its user may not enter,
//! a restart never follows a symbolic link a user put in place of a job's file, and nothing the
//! daemons keep about a job is readable by other users. Real daemons, real CRIU; skips with a
//! printed reason where root or CRIU are missing.
//!
//! One file although long: each file here is one suite, one test binary that
//! `scripts/test.sh` runs and times as a line, and these tests share its job and link helpers.
//! Attacks on the daemons' network and socket entry points are in `attacks.rs`.
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_tests::{bin_dir, skip_unless_ready, Ckptd, Ctl, Options};

/// The unprivileged user the tests act as.
use ckpt_tests::NOBODY;
const LIMIT: Duration = Duration::from_secs(60);

/// Runs `prog args` as `uid` (gid the same, no supplementary groups) in `cwd`, as `setpriv`
/// would; root enters `cwd` first, so a process may have a working directory it cannot enter.
fn command_as(uid: u32, cwd: &Path, prog: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(prog);
    cmd.args(args).current_dir(cwd).stdin(Stdio::null());
    ckpt_tests::as_user(&mut cmd, uid);
    cmd
}

/// `ckptctl ARGS` as `uid`, from `cwd`.
fn ctl_as_in(d: &Ckptd, uid: u32, cwd: &Path, args: &[&str]) -> Ctl {
    let mut all = vec!["--socket", d.socket.to_str().unwrap()];
    all.extend(args);
    let o = command_as(uid, cwd, &bin_dir().join("ckptctl"), &all)
        .output()
        .expect("run ckptctl as another user");
    Ctl {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// Whether `uid` can read `path` (runs `cat` as that user).
fn readable_by(uid: u32, path: &Path) -> bool {
    command_as(
        uid,
        Path::new("/"),
        Path::new("/bin/cat"),
        &[path.to_str().unwrap()],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .status()
    .map(|s| s.success())
    .unwrap_or(false)
}

/// `ckptctl run` of `argv` as `uid` in `cwd`; returns the job id.
fn run_as(d: &Ckptd, uid: u32, cwd: &Path, argv: &[&str]) -> u64 {
    let mut args = vec!["run", "--"];
    args.extend(argv);
    let out = ctl_as_in(d, uid, cwd, &args);
    out.ok()
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("run printed no job id: {out:?}"))
}

/// A temporary directory owned by `uid`, 0755 (in /tmp, which every user may pass).
fn users_dir(uid: u32) -> tempfile::TempDir {
    let d = tempfile::Builder::new()
        .prefix("ckpt-sec-user-")
        .tempdir()
        .unwrap();
    std::os::unix::fs::chown(d.path(), Some(uid), Some(uid)).unwrap();
    fs::set_permissions(d.path(), fs::Permissions::from_mode(0o755)).unwrap();
    d
}

/// A root-owned file with known content in a directory only root may enter: what an attacker
/// would like root to truncate or overwrite.
fn root_file() -> (tempfile::TempDir, PathBuf, Vec<u8>) {
    let d = tempfile::Builder::new()
        .prefix("ckpt-sec-root-")
        .tempdir()
        .unwrap();
    fs::set_permissions(d.path(), fs::Permissions::from_mode(0o700)).unwrap();
    let p = d.path().join("precious");
    let content: Vec<u8> = b"root's own data, never to be touched by a restart\n".repeat(2000);
    fs::write(&p, &content).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).unwrap();
    (d, p, content)
}

/// Replaces `path` with a symbolic link to `target`, owned by `uid` (as that user would).
fn swap_for_link(path: &Path, target: &Path, uid: u32) {
    fs::remove_file(path).unwrap();
    std::os::unix::fs::symlink(target, path).unwrap();
    std::os::unix::fs::lchown(path, Some(uid), Some(uid)).unwrap();
}

/// Waits (bounded) until `cond` holds.
#[track_caller]
fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let begin = Instant::now();
    while !cond() {
        assert!(
            begin.elapsed() < LIMIT,
            "{what} did not happen in {LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Removes a file when dropped (for files tests create outside their temporary directories).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Checkpoints `job` and kills it (`checkpoint --kill`); waits until it is stopped.
fn checkpoint_and_kill(d: &Ckptd, job: u64) {
    let out = d.ctl(&["checkpoint", &job.to_string(), "--kill"]);
    assert!(out.ok().contains("committed"), "{out:?}");
    d.wait_state(job, "stopped", LIMIT);
    assert!(d.job_pids(job).is_empty(), "--kill stops every process");
}

/// Why jobs of other users than root cannot be checkpointed here, if they cannot: CRIU reads
/// every process's resource limits (prlimit), which for another user's process needs
/// CAP_SYS_RESOURCE, which some containers drop.
fn users_jobs_unsupported() -> Option<&'static str> {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    const CAP_SYS_RESOURCE: u32 = 24;
    (eff & (1 << CAP_SYS_RESOURCE) == 0)
        .then_some("needs CAP_SYS_RESOURCE (CRIU reads the rlimits of another user's processes)")
}

/// Where the tests of users' jobs run when this host cannot checkpoint them.
const IN_A_GUEST: &str = "run in a soft-RoCE test guest by users_jobs_are_checkpointed_in_a_guest";

/// The tests that checkpoint a job of NOBODY's.
const USERS_JOB_TESTS: [&str; 5] = [
    "restart_of_a_users_job_does_not_follow_a_link_put_in_place_of_an_output_file",
    "restart_of_a_users_job_does_not_follow_a_link_put_in_place_of_a_shm_file",
    "restart_of_a_users_job_does_not_hand_it_a_file_it_may_not_read",
    "restart_of_a_users_job_does_not_hand_it_a_file_whose_acl_grants_another",
    "other_users_read_nothing_the_daemons_keep",
];

/// Where this host cannot checkpoint a user's job (a container without CAP_SYS_RESOURCE), the
/// tests that do run again, this very test binary, inside a QEMU guest (`scripts/testvm.sh`),
/// whose root holds every capability: one boot, the host's binaries as they are.
#[test]
fn users_jobs_are_checkpointed_in_a_guest() {
    skip_unless_ready!("sh");
    if users_jobs_unsupported().is_none() {
        eprintln!("SKIPPED: not needed, this host checkpoints users' jobs itself");
        return;
    }
    if let Some(why) = ckpt_tests::vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    ckpt_tests::vm::rerun_in_guest("secusers", &USERS_JOB_TESTS);
}

/// A coordinator (the harness allows root's jobs), reachable by other users.
fn ckptd() -> Ckptd {
    let d = Ckptd::start(Options::default());
    d.open_to_users();
    d
}

/// The restart of `job` refuses to go through `link` (a link to root's file `victim`, which
/// holds `content`): it fails, naming the file and saying why, and the root file is untouched.
fn restart_refused_for_the_link(d: &Ckptd, job: u64, link: &Path, victim: &Path, content: &[u8]) {
    let out = d.ctl(&["restart", &job.to_string()]);
    assert_ne!(
        out.code, 0,
        "the restart must not proceed through the link: {out:?}"
    );
    assert!(
        out.stderr.contains(&link.display().to_string()) && out.stderr.contains("symbolic link"),
        "the message names the file and says why: {out:?}"
    );
    assert_eq!(
        fs::read(victim).unwrap(),
        content,
        "the root file is untouched"
    );
}

/// A user (NOBODY) replaces the output file a job of `owner` had open at checkpoint time, in a
/// directory of theirs, with a symbolic link to a file of root's: the restart refuses to touch
/// it, naming the file, and the root file is unchanged byte for byte. With the link gone, the
/// restart works and recreates the file, as the job's owner.
fn output_file_swapped_for_a_link(owner: u32) {
    let d = ckptd();
    let work = users_dir(NOBODY);
    let out_log = work.path().join("out.log");
    let (_root_dir, victim, content) = root_file();
    let job = run_as(
        &d,
        owner,
        work.path(),
        &[
            "sh",
            "-c",
            "exec 3>>out.log; while :; do echo tick >&3; sleep 0.05; done",
        ],
    );
    wait_for("the job's output", || {
        fs::read_to_string(&out_log).is_ok_and(|t| t.lines().count() >= 3)
    });
    checkpoint_and_kill(&d, job);
    assert!(
        fs::metadata(&out_log).unwrap().len() < content.len() as u64,
        "a restart that followed the link would truncate the root file"
    );
    swap_for_link(&out_log, &victim, NOBODY);

    restart_refused_for_the_link(&d, job, &out_log, &victim, &content);
    assert_eq!(
        fs::metadata(&victim).unwrap().mode() & 0o777,
        0o644,
        "nor its mode"
    );
    assert!(d.job_pids(job).is_empty(), "nothing was restored");

    // The link removed, the file is recreated at its checkpoint size, as the job's owner.
    fs::remove_file(&out_log).unwrap();
    d.ctl(&["restart", &job.to_string()]).ok();
    d.wait_state(job, "running", LIMIT);
    assert_eq!(fs::metadata(&out_log).unwrap().uid(), owner);
    assert_eq!(fs::read(&victim).unwrap(), content);
    d.ctl(&["cancel", &job.to_string()]).ok();
}

/// The same with a preserved shared-memory file (saved at checkpoint, put back at restart)
/// swapped for a link to a file of root's.
fn shm_file_swapped_for_a_link(owner: u32) {
    let d = ckptd();
    let work = users_dir(NOBODY);
    let (_root_dir, victim, content) = root_file();
    let shm = PathBuf::from(format!("/dev/shm/ckpt-sec-{}-{owner}", std::process::id()));
    let _cleanup = RemoveOnDrop(shm.clone());
    let script = format!(
        "echo segment > {s}; exec 4<{s}; while :; do sleep 0.05; done",
        s = shm.display()
    );
    let job = run_as(&d, owner, work.path(), &["sh", "-c", &script]);
    wait_for("the job's shared-memory file", || {
        fs::read_to_string(&shm).is_ok_and(|t| t.contains("segment"))
    });
    assert_eq!(fs::metadata(&shm).unwrap().uid(), owner);
    checkpoint_and_kill(&d, job);
    swap_for_link(&shm, &victim, NOBODY);

    restart_refused_for_the_link(&d, job, &shm, &victim, &content);
    assert_eq!(fs::metadata(&victim).unwrap().uid(), 0, "and still root's");
    assert!(d.job_pids(job).is_empty(), "nothing was restored");

    // Without the link the saved segment is put back, as the job's owner.
    fs::remove_file(&shm).unwrap();
    d.ctl(&["restart", &job.to_string()]).ok();
    d.wait_state(job, "running", LIMIT);
    assert_eq!(fs::read_to_string(&shm).unwrap(), "segment\n");
    assert_eq!(fs::metadata(&shm).unwrap().uid(), owner);
    d.ctl(&["cancel", &job.to_string()]).ok();
}

#[test]
fn restart_of_a_users_job_does_not_follow_a_link_put_in_place_of_an_output_file() {
    skip_unless_ready!("sh");
    if let Some(why) = users_jobs_unsupported() {
        eprintln!("SKIPPED: {why}; {IN_A_GUEST}");
        return;
    }
    output_file_swapped_for_a_link(NOBODY);
}

#[test]
fn restart_of_roots_job_does_not_follow_a_link_put_in_place_of_an_output_file() {
    skip_unless_ready!("sh");
    output_file_swapped_for_a_link(0);
}

#[test]
fn restart_of_a_users_job_does_not_follow_a_link_put_in_place_of_a_shm_file() {
    skip_unless_ready!("sh");
    if let Some(why) = users_jobs_unsupported() {
        eprintln!("SKIPPED: {why}; {IN_A_GUEST}");
        return;
    }
    shm_file_swapped_for_a_link(NOBODY);
}

#[test]
fn restart_of_roots_job_does_not_follow_a_link_put_in_place_of_a_shm_file() {
    skip_unless_ready!("sh");
    shm_file_swapped_for_a_link(0);
}

/// A file the job only reads, swapped for a link to a root-only file of the same size and
/// mode: the engine reopens it by path, as root; the agent finds the restored process holding a
/// file its owner may not read, kills it before it ever runs, and says so.
#[test]
fn restart_of_a_users_job_does_not_hand_it_a_file_it_may_not_read() {
    file_it_may_not_read(false);
}

/// The same with root's file carrying an ACL (as the system journal does on most
/// distributions), which grants another user: the kernel, asked as the job's owner, refuses.
#[test]
fn restart_of_a_users_job_does_not_hand_it_a_file_whose_acl_grants_another() {
    file_it_may_not_read(true);
}

fn file_it_may_not_read(acl: bool) {
    skip_unless_ready!("sh");
    if let Some(why) = users_jobs_unsupported() {
        eprintln!("SKIPPED: {why}; {IN_A_GUEST}");
        return;
    }
    let d = ckptd();
    let work = users_dir(NOBODY);
    let (_root_dir, victim, content) = root_file();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).unwrap();
    if acl {
        if let Err(e) = ckpt_store::testdata::set_access_acl(&victim, 1234, 4) {
            eprintln!("SKIPPED: this file system takes no ACL: {e}");
            return;
        }
    }
    let input = work.path().join("input.dat");
    fs::write(&input, vec![b'a'; content.len()]).unwrap();
    std::os::unix::fs::chown(&input, Some(NOBODY), Some(NOBODY)).unwrap();
    fs::set_permissions(&input, fs::Permissions::from_mode(0o600)).unwrap();
    let job = run_as(
        &d,
        NOBODY,
        work.path(),
        &["sh", "-c", "exec 5<input.dat; while :; do sleep 0.05; done"],
    );
    wait_for("the job's open input file", || {
        d.job_pids(job)
            .iter()
            .any(|pid| fs::read_link(format!("/proc/{pid}/fd/5")).is_ok_and(|t| t == input))
    });
    checkpoint_and_kill(&d, job);
    swap_for_link(&input, &victim, NOBODY);

    let out = d.ctl(&["restart", &job.to_string()]);
    assert_ne!(out.code, 0, "{out:?}");
    // The restore does not follow the link in the user's directory (its guard); where it
    // would, the check of what the restored processes hold refuses the file they got.
    let not_followed = out.stderr.contains(&input.display().to_string()[1..])
        && out.stderr.contains("symbolic link");
    let refused_after = out.stderr.contains(&victim.display().to_string())
        && out.stderr.contains("may not")
        && out.stderr.contains("killed");
    assert!(
        not_followed || refused_after,
        "the message names the file and says why: {out:?}"
    );
    assert!(
        d.job_pids(job).is_empty(),
        "the restored processes are gone"
    );
    assert_eq!(fs::read(&victim).unwrap(), content);
}

/// Files of the harness itself (config, daemon logs it redirects, the control socket every
/// user may connect to) and the ib-quiesce control socket (open to jobs by design).
fn harness_or_public(rel: &Path) -> bool {
    let first = rel.components().next().map(|c| c.as_os_str().to_owned());
    let top_level_harness = rel.components().count() == 1
        && [
            "ckptd.toml",
            "agent.toml",
            "ckptd.log",
            "agent.log",
            "failpoints",
            "ckptd.sock",
        ]
        .iter()
        .any(|n| rel == Path::new(n));
    top_level_harness
        || (first.as_deref() == Some("state".as_ref()) && rel.starts_with("state/ibq"))
}

/// The umask of the ckptd process started with this test's config, if found.
fn daemon_umask(d: &Ckptd) -> Option<u32> {
    let config = d.config.to_str()?.as_bytes().to_vec();
    fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let mut args = cmdline.split(|&b| b == 0);
        let exe = args.next()?;
        let ours = exe.ends_with(b"ckptd") && args.any(|a| a == config.as_slice());
        if !ours {
            return None;
        }
        let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let mask = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
        u32::from_str_radix(mask.trim(), 8).ok()
    })
}

/// Every path under `root` (not following links), with its metadata.
fn walk(root: &Path, out: &mut Vec<(PathBuf, fs::Metadata)>) {
    // A directory removed between its listing and this read (a finished step's scratch
    // directory) holds nothing to check.
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => panic!("read {}: {e}", root.display()),
    };
    for e in entries.flatten() {
        let p = e.path();
        let Ok(m) = fs::symlink_metadata(&p) else {
            continue;
        };
        let dir = m.is_dir();
        out.push((p.clone(), m));
        if dir {
            walk(&p, out);
        }
    }
}

/// After checkpoints of root's job and of NOBODY's, NOBODY reads nothing the daemons keep:
/// images, manifests, job records, launch specs, engine logs, the database; it lists no
/// directory; only its own job's stdout and stderr are readable to it, and to nobody else.
#[test]
fn other_users_read_nothing_the_daemons_keep() {
    skip_unless_ready!("sh");
    let d = ckptd();
    let work = users_dir(NOBODY);
    let loop_sh = "while :; do echo tick; sleep 0.05; done";
    let root_job = d.run_job("root-loop", &["sh".into(), "-c".into(), loop_sh.into()]);
    let own = run_as(&d, NOBODY, work.path(), &["sh", "-c", loop_sh]);
    let mut checkpointed = vec![root_job];
    match users_jobs_unsupported() {
        None => checkpointed.push(own),
        Some(why) => eprintln!("NOTE: NOBODY's job is not checkpointed: {why}"),
    }
    for &job in &checkpointed {
        let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
        assert!(out.ok().contains("committed"), "{out:?}");
    }
    // A restart too: what a restore leaves (CRIU's configuration and log, the run directory)
    // is checked with the rest.
    d.kill_job(root_job);
    d.wait_state(root_job, "killed", LIMIT);
    d.ctl(&["restart", &root_job.to_string()]).ok();
    let base = d.dir.path();
    let state_jobs = base.join("state/jobs");
    let own_dir = state_jobs.join(own.to_string());
    let root_dir = state_jobs.join(root_job.to_string());
    // The directories on the way to a job's output: users pass, nobody lists.
    let traverse: Vec<PathBuf> = vec![
        base.join("state"),
        state_jobs.clone(),
        own_dir.clone(),
        root_dir.clone(),
    ];
    let mut all = Vec::new();
    walk(base, &mut all);
    let modes: std::collections::HashMap<PathBuf, u32> =
        all.iter().map(|(p, m)| (p.clone(), m.mode())).collect();
    // Whether others may reach `p`: every directory above it (up to the test's own, which is
    // 0755 for the socket) lets others through.
    let reachable = |p: &Path| {
        p.ancestors()
            .skip(1)
            .take_while(|a| a.starts_with(base) && *a != base)
            .all(|a| modes.get(a).is_some_and(|m| m & 0o001 != 0))
    };
    // With the daemons' umask 077 every file they create is private by its own mode too.
    let umask = daemon_umask(&d);
    let strict = umask == Some(0o077);
    let mut loose = Vec::new();
    let mut checked = 0;
    for (p, m) in &all {
        let rel = p.strip_prefix(base).unwrap();
        if harness_or_public(rel) {
            continue;
        }
        checked += 1;
        let mode = m.mode() & 0o7777;
        let is_output = p
            .parent()
            .is_some_and(|dir| dir == own_dir || dir == root_dir)
            && p.file_name()
                .is_some_and(|n| n == "stdout" || n == "stderr");
        if is_output {
            let owner = if p.starts_with(&own_dir) { NOBODY } else { 0 };
            assert_eq!(m.uid(), owner, "{} belongs to the job's user", p.display());
            assert_eq!(mode, 0o600, "{} is its user's alone", p.display());
            continue;
        }
        assert_eq!(m.uid(), 0, "{} is root's", p.display());
        if traverse.contains(p) {
            assert_eq!(
                mode & 0o066,
                0,
                "{} (0{mode:o}) is not listable by others",
                p.display()
            );
            continue;
        }
        let others_read = mode & 0o004 != 0 && reachable(p);
        assert!(
            !others_read && mode & 0o022 == 0,
            "{} (0{mode:o}) must not be readable or writable by others",
            p.display()
        );
        // What the agent and ckptd write themselves has its mode set explicitly; the rest
        // (images, manifests, engine logs) is private through the umask and, in any case,
        // below directories others cannot enter.
        let name = p.file_name().unwrap().to_string_lossy();
        let explicit = ["job.json", "spec.json", "shim.log", "ckptd.redb"].contains(&&*name);
        if explicit || strict {
            let want = if m.is_dir() { 0o700 } else { 0o600 };
            assert_eq!(
                mode & 0o077,
                0,
                "{} (0{mode:o}) is root's alone (0{want:o})",
                p.display()
            );
        } else if mode & 0o077 != 0 {
            loose.push(format!("{} (0{mode:o})", rel.display()));
        }
        if m.is_dir() {
            assert!(
                !(mode & 0o005 != 0 && reachable(p)),
                "{} (0{mode:o}) must not be listable by others",
                p.display()
            );
        }
    }
    assert!(
        checked > 20,
        "the walk found the daemons' files ({checked})"
    );
    if !loose.is_empty() {
        eprintln!(
            "NOTE: ckptd runs with umask {}, not 0077: {} files are private only through their directories: {}",
            umask.map_or("unknown".into(), |u| format!("{u:04o}")),
            loose.len(),
            loose.join(", ")
        );
    }

    // And as NOBODY, for real.
    let images = d.images(root_job, 1);
    let manifest = images.join("MANIFEST");
    assert!(manifest.is_file(), "{}", manifest.display());
    for p in [
        base.join("ckptd.redb"),
        root_dir.join("job.json"),
        root_dir.join("run/1/spec.json"),
        root_dir.join("logs/dump-1.log"),
        root_dir.join("stdout"),
        manifest,
        // Even of its own job: they hold the job's secret and environment.
        own_dir.join("job.json"),
        own_dir.join("run/1/spec.json"),
    ] {
        assert!(p.exists(), "{}", p.display());
        assert!(!readable_by(NOBODY, &p), "NOBODY reads {}", p.display());
    }
    let image = fs::read_dir(images.join("images"))
        .unwrap()
        .flatten()
        .next()
        .expect("an image file")
        .path();
    assert!(
        !readable_by(NOBODY, &image),
        "NOBODY reads {}",
        image.display()
    );
    for p in [own_dir.join("stdout"), own_dir.join("stderr")] {
        assert!(
            readable_by(NOBODY, &p),
            "NOBODY reads its own {}",
            p.display()
        );
    }
    let ls = command_as(
        NOBODY,
        Path::new("/"),
        Path::new("/bin/ls"),
        &[state_jobs.to_str().unwrap()],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .status()
    .unwrap();
    assert!(!ls.success(), "NOBODY lists {}", state_jobs.display());
    d.ctl(&["cancel", &own.to_string()]).ok();
    d.ctl(&["cancel", &root_job.to_string()]).ok();
}

/// A job whose working directory is inside another user's 0700 directory is refused, saying
/// so, and nothing of it ran (root used to enter the directory for it).
#[test]
fn a_working_directory_the_user_may_not_enter_is_refused() {
    skip_unless_ready!("sh");
    let d = Ckptd::start(Options::default());
    d.open_to_users();
    let private = tempfile::Builder::new()
        .prefix("ckpt-sec-private-")
        .tempdir()
        .unwrap();
    fs::set_permissions(private.path(), fs::Permissions::from_mode(0o700)).unwrap();
    let inner = private.path().join("inner");
    fs::create_dir(&inner).unwrap();
    fs::set_permissions(&inner, fs::Permissions::from_mode(0o777)).unwrap();
    let marks = users_dir(NOBODY);
    let marker = marks.path().join("ran");
    let touch = format!("touch {}", marker.display());
    let out = ctl_as_in(&d, NOBODY, &inner, &["run", "--", "sh", "-c", &touch]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains("cannot enter working directory")
            && out.stderr.contains(&inner.display().to_string()),
        "the message says which directory: {out:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(!marker.exists(), "the job's command never ran");
    let listed: serde_json::Value = serde_json::from_str(d.ctl(&["list", "--json"]).ok()).unwrap();
    let job = listed
        .as_array()
        .unwrap()
        .last()
        .expect("the job is recorded")
        .clone();
    assert_eq!(job["state"], "failed to start", "{job}");
    assert!(d.job_pids(job["id"].as_u64().unwrap()).is_empty());
}

/// Whether `uid` has a passwd entry on this machine.
fn has_passwd_entry(uid: u32) -> bool {
    // SAFETY: getpwuid returns a pointer into static storage or null; only compared to null,
    // in a test that calls it from one thread.
    !unsafe { libc::getpwuid(uid) }.is_null()
}

/// Launches as root are refused unless `allow_root_jobs`; uids below `min_uid` and uids
/// without a passwd entry always; each error names the uid and the key to change, and nothing
/// is started.
#[test]
fn launches_as_root_system_accounts_and_unknown_users_are_refused() {
    skip_unless_ready!();
    let d = Ckptd::start(Options {
        agent_keys: "allow_root_jobs = false\nmin_uid = 1000\n".into(),
        ..Options::default()
    });
    d.open_to_users();
    let out = d.ctl(&["run", "--", "/bin/sleep", "60"]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains("uid 0") && out.stderr.contains("allow_root_jobs"),
        "{out:?}"
    );
    let out = ctl_as_in(&d, 1, Path::new("/"), &["run", "--", "/bin/sleep", "60"]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains("uid 1") && out.stderr.contains("min_uid"),
        "{out:?}"
    );
    let stranger = (54321..60000).find(|u| !has_passwd_entry(*u)).unwrap();
    let out = ctl_as_in(
        &d,
        stranger,
        Path::new("/"),
        &["run", "--", "/bin/sleep", "60"],
    );
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains(&format!("uid {stranger}")) && out.stderr.contains("no passwd entry"),
        "{out:?}"
    );
    let listed: serde_json::Value = serde_json::from_str(d.ctl(&["list", "--json"]).ok()).unwrap();
    let jobs = listed.as_array().unwrap();
    assert_eq!(jobs.len(), 3, "{listed}");
    for j in jobs {
        assert_eq!(j["state"], "failed to start", "{j}");
        assert!(d.job_pids(j["id"].as_u64().unwrap()).is_empty());
    }
    // An ordinary user still may.
    let ok = ctl_as_in(
        &d,
        NOBODY,
        Path::new("/"),
        &["run", "--", "/bin/sleep", "60"],
    );
    let job: u64 = ok.ok().trim().parse().unwrap();
    d.wait_state(job, "running", LIMIT);
    d.ctl(&["cancel", &job.to_string()]).ok();
}

/// A job name and command holding terminal escape sequences (a window title, a screen clear,
/// a line that fakes ckptctl's own) reach root's terminal as visible escapes, not as control
/// characters: `list`, `status` and the JSON view, which keeps the name as it is.
#[test]
fn a_users_job_name_cannot_drive_roots_terminal() {
    skip_unless_ready!("sh");
    let d = ckptd();
    let name = "heat\x1b]0;pwned\x07\x1b[2J\nckptctl: all jobs verified";
    let out = d.ctl_as(
        NOBODY,
        &[
            "run",
            "--name",
            name,
            "--",
            "/bin/sh",
            "-c",
            "sleep 30",
            "arg0\x1b[31m",
        ],
    );
    let job: u64 = out.ok().trim().parse().expect("a job id");
    for args in [vec!["list"], vec!["status", &job.to_string()]] {
        let out = d.ctl(&args);
        let text = out.ok();
        assert!(
            !text.contains('\x1b') && !text.contains('\x07'),
            "{args:?}: raw control characters reached the terminal: {text:?}"
        );
        assert!(
            text.contains("heat\\x1b]0;pwned\\x07\\x1b[2J\\nckptctl: all jobs verified"),
            "{args:?}: the name is shown, escaped, on one line: {text}"
        );
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("ckptctl: all jobs verified")),
            "{args:?}: no line of the user's making: {text}"
        );
        assert!(text.contains("arg0\\x1b[31m"), "{args:?}: {text}");
    }
    let json: serde_json::Value =
        serde_json::from_str(d.ctl(&["status", &job.to_string(), "--json"]).ok()).unwrap();
    assert_eq!(json["name"], name, "JSON keeps the name exactly");
    assert_eq!(d.ctl(&["cancel", &job.to_string()]).code, 0);
}

/// A user's job running a set-user-ID program would be dumped and restored with root's
/// rights: the checkpoint is refused at initial sync, naming the process and why, and the job
/// runs on untouched.
#[test]
fn a_users_job_holding_a_set_user_id_process_is_not_checkpointed() {
    skip_unless_ready!("sh");
    let d = ckptd();
    let dir = users_dir(0);
    let suid = dir.path().join("sleep-suid");
    fs::copy("/bin/sleep", &suid).unwrap();
    fs::set_permissions(&suid, fs::Permissions::from_mode(0o4755)).unwrap();
    let job = run_as(&d, NOBODY, Path::new("/"), &[suid.to_str().unwrap(), "60"]);
    wait_for("the job runs", || !d.job_pids(job).is_empty());
    let pid = d.job_pids(job)[0];
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    if !status
        .lines()
        .any(|l| l.starts_with("Uid:") && l.contains("\t0\t"))
    {
        eprintln!("SKIPPED: the set-user-ID bit had no effect here (a nosuid mount?)");
        return;
    }
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert_eq!(out.code, 6, "refused, the epoch aborted: {out:?}");
    assert!(
        out.stderr.contains(&format!("process {pid}")) && out.stderr.contains("set-user-ID"),
        "the message names the process and why: {out:?}"
    );
    assert_eq!(d.job_pids(job), vec![pid], "the job runs on");
    let epochs = d.epochs(job);
    assert_eq!(epochs[0]["failed_phase"], "initial-sync", "{epochs:?}");
    assert_eq!(d.ctl(&["cancel", &job.to_string()]).code, 0);
}

/// How many restores the socket race below tries (`CKPT_RACE_RESTORES`; the proof
/// runs 1000, CI fewer).
fn race_restores() -> usize {
    std::env::var("CKPT_RACE_RESTORES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60)
}

/// A job of the embedded agent, or of the agent of a test host (whose part runs in a sandbox).
struct Part<'a> {
    d: &'a Ckptd,
    node: Option<&'a str>,
}

impl Part<'_> {
    fn run(&self, name: &str, argv: &[String]) -> u64 {
        let mut args = vec!["run", "--name", name];
        if let Some(n) = self.node {
            args.extend(["--node", n]);
        }
        args.push("--");
        args.extend(argv.iter().map(String::as_str));
        let out = self.d.ctl(&args);
        out.ok()
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("run printed no job id: {out:?}"))
    }

    fn output(&self, job: u64) -> String {
        match self.node {
            Some(n) => {
                fs::read_to_string(self.d.job_dir_on(n, job).join("stdout")).unwrap_or_default()
            }
            None => self.d.output(job),
        }
    }

    fn pids(&self, job: u64) -> Vec<i32> {
        match self.node {
            Some(n) => self.d.job_pids_on(n, job),
            None => self.d.job_pids(job),
        }
    }

    fn kill(&self, job: u64) {
        match self.node {
            Some(n) => self.d.kill_job_on(&[n], job),
            None => self.d.kill_job(job),
        }
        self.d.wait_state(job, "killed", LIMIT);
    }
}

/// CRIU's restore binds a job's named Unix socket again and then changes its owner and mode by
/// path, following links. A user who controls the socket's directory renames a link to a root
/// file over the new socket the moment it appears (inotify), restore after restore, for root's
/// job (allowed here): the root file must never change owner, mode or content, whether a
/// restore went through or failed on the link. Between tries the user removes the socket, as
/// the attack does; a restore without the racer then runs, and the restored job is
/// checkpointed and restored again.
#[test]
fn a_link_raced_over_a_restored_socket_never_reaches_roots_file() {
    skip_unless_ready!("sh", "cc", "make");
    let d = ckptd();
    socket_race(&Part { d: &d, node: None });
}

/// The same race for a part in a sandbox (its mounts made again by CRIU from the node's), on a
/// test host with a job network.
#[test]
fn a_link_raced_over_a_sandboxed_parts_socket_never_reaches_roots_file() {
    skip_unless_ready!("sh", "cc", "make", "nsenter", "nft");
    if let Some(why) = ckpt_tests::netns::Cluster::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let cluster = ckpt_tests::netns::Cluster::create(1).expect("create a test host");
    let subnet = cluster.host_ip.rsplit_once('.').unwrap().0.to_string();
    let mut d = Ckptd::start(Options {
        no_agent: true,
        extra_toml: format!(
            "[job_network]\naddresses = \"{subnet}.150-{subnet}.199\"\nprefix = 24\n"
        ),
        ..Options::default()
    });
    d.open_to_users();
    d.start_agent_in(&cluster, "n1");
    d.wait_agents(&["n1"]);
    socket_race(&Part {
        d: &d,
        node: Some("n1"),
    });
}

fn socket_race(part: &Part<'_>) {
    let d = part.d;
    let (root_dir, victim, content) = root_file();
    let meta = |p: &Path| {
        let m = fs::metadata(p).unwrap();
        (m.uid(), m.gid(), m.mode() & 0o7777)
    };
    let before = meta(&victim);
    let place = users_dir(0);
    let dir = place.path().join("d");
    fs::create_dir(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(NOBODY), Some(NOBODY)).unwrap();
    let socket = dir.join("s");
    let apps = ckpt_tests::apps();
    let listener = apps.join("unix_listener");
    let job = part.run(
        "sock",
        &[listener.display().to_string(), socket.display().to_string()],
    );
    wait_for("the socket is bound", || {
        part.output(job).contains("listening")
    });
    let out = d.ctl(&["checkpoint", &job.to_string(), "--kill"]);
    assert!(out.ok().contains("committed"), "{out:?}");
    d.wait_state(job, "stopped", LIMIT);
    assert!(part.pids(job).is_empty(), "--kill stops every process");
    let mut racer = command_as(
        NOBODY,
        Path::new("/"),
        &apps.join("link_racer"),
        &[dir.to_str().unwrap(), "s", victim.to_str().unwrap()],
    )
    .stdout(Stdio::piped())
    .spawn()
    .expect("start the racer");
    let (mut restored, mut refused) = (0, 0);
    for i in 0..race_restores() {
        // The user's `rm ~/d/s` (of the socket or of a link left by the last try).
        let _ = fs::remove_file(&socket);
        let out = d.ctl(&["restart", &job.to_string(), "--epoch", "1"]);
        if out.code == 0 {
            restored += 1;
            part.kill(job);
        } else {
            refused += 1;
        }
        assert_eq!(
            meta(&victim),
            before,
            "try {i}: root's file changed: {out:?}"
        );
        assert_eq!(fs::read(&victim).unwrap(), content, "try {i}: {out:?}");
    }
    let _ = racer.kill();
    let _ = racer.wait();
    let mut swaps = String::new();
    use std::io::Read;
    racer
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut swaps)
        .unwrap();
    let swapped = swaps.lines().filter(|l| l.starts_with("swapped")).count();
    eprintln!(
        "socket race: {} restores, {restored} went through, {refused} failed on the link, {swapped} links swapped in; root's file unchanged",
        race_restores()
    );
    assert!(swapped > 0, "the racer never swapped a link in: {swaps}");
    // No race: the socket's directory replaced by a link to root's directory, as a user who
    // owned its parent could. The restore must not follow it (without the guard it binds the
    // socket in root's directory and gives it to the job's owner).
    let _ = fs::remove_file(&socket);
    let real = place.path().join("d.real");
    fs::rename(&dir, &real).unwrap();
    std::os::unix::fs::symlink(root_dir.path(), &dir).unwrap();
    let out = d.ctl(&["restart", &job.to_string(), "--epoch", "1"]);
    let planted = root_dir.path().join("s");
    assert!(
        !planted.exists(),
        "the restore made a socket in root's directory: {out:?}"
    );
    assert_ne!(out.code, 0, "a restore through the link: {out:?}");
    fs::remove_file(&dir).unwrap();
    fs::rename(&real, &dir).unwrap();
    // Without the racer: restored, checkpointed again (from the restore's own mount namespace)
    // and that checkpoint restored.
    let _ = fs::remove_file(&socket);
    let out = d.ctl(&["restart", &job.to_string(), "--epoch", "1"]);
    assert_eq!(out.code, 0, "{out:?}");
    let pid = part.pids(job)[0];
    let ours = fs::read_link("/proc/self/ns/mnt").unwrap();
    let theirs = fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
    let guarded = ours != theirs;
    // The job follows links in the socket's directory again (the guard is lifted).
    assert!(
        !nosymfollow_at(pid, &dir),
        "the restored job's mounts still refuse links"
    );
    let text = d.ctl(&["checkpoint", &job.to_string(), "--kill"]);
    assert!(text.ok().contains("committed"), "{text:?}");
    d.wait_state(job, "stopped", LIMIT);
    let _ = fs::remove_file(&socket);
    let out = d.ctl(&["restart", &job.to_string()]);
    assert_eq!(
        out.code, 0,
        "the checkpoint of a guarded restore restores: {out:?}"
    );
    let st = fs::symlink_metadata(&socket).unwrap();
    assert!(
        std::os::unix::fs::FileTypeExt::is_socket(&st.file_type()),
        "the job's socket is back"
    );
    assert!(guarded, "the restore ran in a mount namespace of its own");
    assert_eq!(meta(&victim), before);
    assert_eq!(d.ctl(&["cancel", &job.to_string()]).code, 0);
}

/// Whether the mount that holds `dir`, as process `pid` sees it, has `nosymfollow`.
fn nosymfollow_at(pid: i32, dir: &Path) -> bool {
    let info = fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    // The longest mount point that is a prefix of `dir`; its per-mount options (field 6).
    info.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let (point, options) = (Path::new(f.get(4)?), f.get(5)?);
            dir.starts_with(point)
                .then(|| (point.as_os_str().len(), options.contains("nosymfollow")))
        })
        .max_by_key(|(len, _)| *len)
        .is_some_and(|(_, on)| on)
}

/// A user who opens connection after connection to ckptd's control socket and holds them gets
/// at most its share (256); root and other users are still answered.
#[test]
fn a_user_holding_control_connections_does_not_lock_others_out() {
    // The system's Python: the user's run cannot reach an interpreter in root's home.
    let python = Path::new("/usr/bin/python3");
    if !python.exists() {
        eprintln!("SKIPPED: needs /usr/bin/python3 (Debian's python3 package)");
        return;
    }
    let d = ckptd();
    let hold = format!(
        "import socket, time\n\
         held = []\n\
         for _ in range(1100):\n\
         \x20   s = socket.socket(socket.AF_UNIX)\n\
         \x20   s.connect({:?})\n\
         \x20   held.append(s)\n\
         time.sleep(2)\n\
         alive = 0\n\
         for s in held:\n\
         \x20   s.setblocking(False)\n\
         \x20   try:\n\
         \x20       alive += s.recv(1) != b''\n\
         \x20   except BlockingIOError:\n\
         \x20       alive += 1\n\
         print(alive, flush=True)\n\
         time.sleep(30)\n",
        d.socket.display().to_string()
    );
    let mut holder = command_as(NOBODY, Path::new("/"), python, &["-c", &hold])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python3 as nobody");
    let mut line = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let alive: usize = line.trim().parse().unwrap_or_else(|_| panic!("{line:?}"));
    assert!(alive <= 256, "nobody holds {alive} connections");
    assert!(alive >= 200, "nobody's own share is served: {alive}");
    let out = d.ctl(&["list"]);
    assert_eq!(out.code, 0, "root is answered: {out:?}");
    let other = d.ctl_as(NOBODY - 1, &["list"]);
    assert_eq!(other.code, 0, "another user is answered: {other:?}");
    let _ = holder.kill();
    let _ = holder.wait();
}

/// `[limits]`: a user (nobody) past their live jobs and hourly checkpoints is refused with
/// exit 10, naming the limit, while root is not; a checkpoint with `--kill` is never refused
/// by the limit.
#[test]
fn a_user_past_their_limits_is_refused_and_root_is_not() {
    let d = Ckptd::start(Options {
        extra_toml: "[limits]\njobs = 1\ncheckpoints_per_hour = 1\n".into(),
        ..Default::default()
    });
    d.open_to_users();
    let sleep = ["/bin/sleep", "600"];
    let job = run_as(&d, NOBODY, Path::new("/"), &sleep);
    let refused = d.ctl_as(NOBODY, &["run", "--", "/bin/sleep", "600"]);
    assert_eq!(refused.code, 10, "{refused:?}");
    assert!(refused.stderr.contains("[limits] jobs"), "{refused:?}");
    let root_job = run_as(&d, 0, Path::new("/"), &sleep);
    let j = job.to_string();
    // The first checkpoint counts whatever its outcome (a user's dump may fail on this
    // kernel: see users_jobs_are_checkpointed_in_a_guest); the second is over the limit.
    d.ctl_as(NOBODY, &["checkpoint", "--wait", &j]);
    let again = d.ctl_as(NOBODY, &["checkpoint", "--wait", &j]);
    assert_eq!(again.code, 10, "{again:?}");
    assert!(
        again.stderr.contains("[limits] checkpoints_per_hour"),
        "{again:?}"
    );
    let last = d.ctl_as(NOBODY, &["checkpoint", "--kill", &j]);
    assert!(!last.stderr.contains("[limits]"), "{last:?}");
    for id in [job, root_job] {
        d.ctl(&["cancel", &id.to_string()]);
    }
}

/// A job holding a sparse file in /dev/shm: the checkpoint saves only its data and the restart
/// puts it back as sparse (neither staging nor /dev/shm fills with zeros); one longer than a
/// checkpoint saves (16 GiB) is refused, naming it, and the job runs on.
#[test]
fn sparse_shared_memory_files_are_saved_sparse_and_huge_ones_refused() {
    skip_unless_ready!("sh", "truncate");
    let d = ckptd();
    let tag = std::process::id();
    let small = PathBuf::from(format!("/dev/shm/ckpt-sparse-{tag}"));
    let huge = PathBuf::from(format!("/dev/shm/ckpt-huge-{tag}"));
    let _cleanup = (RemoveOnDrop(small.clone()), RemoveOnDrop(huge.clone()));
    let hold = |path: &Path, size: &str| {
        format!(
            "truncate -s {size} {p} && printf data >> {p} && exec 3<{p} && exec sleep 600",
            p = path.display()
        )
    };
    let job = d.run_job("huge", &["sh".into(), "-c".into(), hold(&huge, "20G")]);
    wait_for("the job holds its file", || {
        !d.job_pids(job).is_empty() && huge.exists()
    });
    std::thread::sleep(Duration::from_millis(300));
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains(&huge.display().to_string()) && out.stderr.contains("bytes long"),
        "the message names the file and why: {out:?}"
    );
    assert!(!d.job_pids(job).is_empty(), "the job runs on");
    assert_eq!(d.ctl(&["cancel", &job.to_string()]).code, 0);

    let job = d.run_job("sparse", &["sh".into(), "-c".into(), hold(&small, "2G")]);
    wait_for("the job holds its file", || {
        !d.job_pids(job).is_empty() && small.exists()
    });
    std::thread::sleep(Duration::from_millis(300));
    checkpoint_and_kill(&d, job);
    let blocks = |p: &Path| {
        fs::metadata(p)
            .map(|m| m.blocks() * 512)
            .unwrap_or(u64::MAX)
    };
    let extra = d.dir.path().join(format!("local/{job}/1/node0/extra"));
    let saved: Vec<PathBuf> = fs::read_dir(&extra)
        .unwrap_or_else(|e| panic!("{}: {e}", extra.display()))
        .map(|e| e.unwrap().path())
        .collect();
    assert!(!saved.is_empty(), "the file was saved");
    let used: u64 = saved.iter().map(|p| blocks(p)).sum();
    assert!(
        used < 16 << 20,
        "staging holds its data only: {used} bytes used"
    );
    fs::remove_file(&small).unwrap();
    let out = d.ctl(&["restart", &job.to_string()]);
    assert_eq!(out.code, 0, "{out:?}");
    let m = fs::metadata(&small).unwrap();
    assert_eq!(m.len(), (2u64 << 30) + 4, "put back at its length");
    assert!(
        blocks(&small) < 16 << 20,
        "and sparse: {} bytes used",
        blocks(&small)
    );
    assert_eq!(d.ctl(&["cancel", &job.to_string()]).code, 0);
}
