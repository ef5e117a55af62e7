use super::*;

#[test]
fn the_state_follows_the_last_parenthesis() {
    assert_eq!(stat_state("42 (sh) S 1 42 42 0"), Some('S'));
    assert_eq!(stat_state("7 (a) b) (c) D 1 7"), Some('D'));
    assert_eq!(stat_state("7 (never closed"), None);
    assert_eq!(stat_state(""), None);
    // SAFETY: gettid has no preconditions.
    let own = unsafe { libc::gettid() };
    assert_eq!(task_state(own), Some('R'), "this thread is running");
}

/// A real cgroup with a sleeping child: frozen, thawed, its tasks named for an error.
/// Needs root and a freezer; skips otherwise.
#[test]
fn a_real_cgroup_freezes_thaws_and_names_its_tasks() {
    let Some(parent) = test_parent("freeze") else {
        return;
    };
    let cg = parent.job(1);
    cg.create().unwrap();
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    fs::write(cg.procs_file(), child.id().to_string()).unwrap();
    cg.freeze().unwrap();
    assert_eq!(cg.state().unwrap(), Freezer::Frozen);
    let tasks = cg.describe_tasks();
    assert!(
        tasks.starts_with(&format!("pid {} (sleep) state ", child.id())),
        "{tasks}"
    );
    cg.thaw().unwrap();
    assert_eq!(cg.state().unwrap(), Freezer::Thawed);
    cg.kill_all().unwrap();
    let _ = child.wait();
    assert_eq!(cg.describe_tasks(), "none");
    cg.remove().unwrap();
}

/// Signals reach the cgroup's members and no other process: a term signal by pidfd, a
/// kill through `cgroup.kill` (v2); a process outside it lives on.
#[test]
fn signals_reach_members_only() {
    let Some(parent) = test_parent("sig") else {
        return;
    };
    let cg = parent.job(2);
    cg.create().unwrap();
    let sleep = || {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    };
    let (mut inside, mut outside) = (sleep(), sleep());
    fs::write(cg.procs_file(), inside.id().to_string()).unwrap();
    assert_eq!(cg.signal_all(libc::SIGTERM).unwrap(), 1);
    let st = inside.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&st),
        Some(libc::SIGTERM)
    );
    let mut again = sleep();
    fs::write(cg.procs_file(), again.id().to_string()).unwrap();
    cg.kill_all().unwrap();
    let st = again.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&st),
        Some(libc::SIGKILL)
    );
    assert!(
        outside.try_wait().unwrap().is_none(),
        "not a member: untouched"
    );
    let _ = outside.kill();
    let _ = outside.wait();
    cg.remove().unwrap();
}

#[test]
fn a_cgroup_is_named_by_its_path_within_the_hierarchy() {
    let info = "\
25 30 0:22 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs ro,mode=755
31 25 0:27 / /sys/fs/cgroup/freezer rw,nosuid - cgroup cgroup rw,freezer
32 25 0:28 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
33 25 0:29 /sub /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
";
    let f = |d: &str, fl| hierarchy_path(info, Path::new(d), fl);
    assert_eq!(
        f("/sys/fs/cgroup/freezer/ckpt-job-7", Flavor::V1).as_deref(),
        Some("/ckpt-job-7")
    );
    assert_eq!(
        f("/sys/fs/cgroup/unified/ckpt/ckpt-job-7", Flavor::V2).as_deref(),
        Some("/sub/ckpt/ckpt-job-7")
    );
    assert_eq!(
        f("/sys/fs/cgroup/memory/x", Flavor::V1),
        None,
        "not the freezer"
    );
    assert_eq!(f("/tmp/x", Flavor::V2), None);
    // Every v1 hierarchy by its controllers, as the engine takes a cgroup root.
    let info = format!(
        "{info}34 25 0:30 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,xattr,cpu,cpuacct\n"
    );
    let g = |d: &str| v1_root(&info, Path::new(d));
    assert_eq!(
        g("/sys/fs/cgroup/memory/slurm/uid_0/job_7/step_extern").as_deref(),
        Some("memory:/slurm/uid_0/job_7/step_extern")
    );
    assert_eq!(
        g("/sys/fs/cgroup/cpu,cpuacct/slurm").as_deref(),
        Some("cpu,cpuacct:/slurm")
    );
    assert_eq!(g("/sys/fs/cgroup/unified/x"), None, "not v1");
}

#[test]
fn a_cgroup_slurm_lends_is_neither_made_nor_removed_and_holds_only_its_shims_descendants() {
    let Some(parent) = test_parent("lent") else {
        return;
    };
    if parent.flavor != Flavor::V1 {
        eprintln!("SKIPPED: Slurm lends cgroup v1 freezers only, and this host has v2");
        return;
    }
    let own = parent.job(1);
    own.create().unwrap();
    let mut cg = JobCgroup::lent(Lent {
        slurm_job: 9,
        socket: PathBuf::new(),
        freezer: own.path().to_path_buf(),
        others: Vec::new(),
    });
    cg.create().unwrap();
    // The job's shim and its two processes; one of them moved by "the user" into a
    // cgroup below the step.
    let mut shim = std::process::Command::new("sh")
        .args(["-c", "sleep 31 & echo $!; sleep 32 & echo $!; wait"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(shim.stdout.take().unwrap());
    let mut ours = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        ours.push(line.trim().parse::<i32>().unwrap());
    }
    ours.sort_unstable();
    let below = own.path().join("x");
    fs::create_dir(&below).unwrap();
    fs::write(cg.procs_file(), ours[0].to_string()).unwrap();
    fs::write(below.join("cgroup.procs"), ours[1].to_string()).unwrap();
    // Not the shim's: Slurm's `sleep`, or an ssh session Slurm adopted.
    let mut foreign = std::process::Command::new("sleep")
        .arg("33")
        .spawn()
        .unwrap();
    fs::write(cg.procs_file(), foreign.id().to_string()).unwrap();
    assert_eq!(cg.pids().unwrap(), Vec::<i32>::new(), "no shim named yet");
    let start = crate::os::procfs::stat(shim.id() as i32)
        .unwrap()
        .start_ticks;
    cg.set_tree(Some((shim.id() as i32, start)));
    assert_eq!(cg.pids().unwrap(), ours, "the shim's, below the step too");
    assert_eq!(
        {
            let mut m = members(&cg.procs_file(), Some((shim.id() as i32, None)));
            m.sort_unstable();
            m
        },
        ours,
        "as the shim's kills see them"
    );
    cg.remove().unwrap();
    assert!(cg.exists(), "Slurm removes what it lent");
    cg.kill_all().unwrap();
    let _ = shim.wait();
    assert!(
        crate::os::procfs::stat(foreign.id() as i32).is_some_and(|s| s.state != 'Z'),
        "what is not the job's was left alone"
    );
    let _ = foreign.kill();
    let _ = foreign.wait();
    fs::remove_dir(&below).unwrap();
    own.remove().unwrap();
    let gone = JobCgroup::lent(Lent {
        slurm_job: 9,
        socket: PathBuf::new(),
        freezer: own.path().to_path_buf(),
        others: Vec::new(),
    });
    let e = gone.create().unwrap_err().to_string();
    assert!(e.contains("Slurm job 9"), "{e}");
    assert!(!own.exists(), "not made again");
}
