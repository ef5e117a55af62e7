//! End-to-end tests of when ckptd checkpoints by itself: periodic checkpoints of a real 4-rank
//! MPI job under a real ckptd (with its agent) and real CRIU, across a ckptd restart; bad
//! input. Skips with a printed reason where root, CRIU or MPI are missing.
use std::time::{Duration, Instant};

use ckpt_tests::{skip_unless_ready, Ckptd, Mpi, Options};

const RANKS: u32 = 4;
const N: u32 = 256;
const ITERS: u32 = 3000;
/// Per-iteration sleep: the job runs ~15-25 s, time for several checkpoints 2 s apart and a
/// ckptd restart.
const SLEEP_US: u32 = 5000;
const LIMIT: Duration = Duration::from_secs(120);

/// The job's committed epochs, oldest first.
fn committed(d: &Ckptd, job: u64) -> Vec<serde_json::Value> {
    d.epochs(job)
        .into_iter()
        .filter(|e| e["state"] == "committed")
        .collect()
}

/// Waits (bounded) until the job has at least `n` committed epochs, while it runs.
#[track_caller]
fn wait_committed(d: &Ckptd, job: u64, n: usize) -> Vec<serde_json::Value> {
    let begin = Instant::now();
    loop {
        let c = committed(d, job);
        if c.len() >= n {
            return c;
        }
        assert!(
            begin.elapsed() < LIMIT && d.status(job)["state"] != "exited (0)",
            "{} committed epochs, wanted {n}: {:?}",
            c.len(),
            d.epochs(job)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `run --every 2s`: ckptd checkpoints the running job every 2 s, one epoch at a time, also
/// after ckptd itself was restarted (the policy is in its database), and the job still ends
/// with the answer of an uninterrupted run.
#[test]
fn every_two_seconds_checkpoints_the_job_across_a_ckptd_restart() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let mut d = Ckptd::start(Options::default());
    let mut args = vec!["run", "--every", "2s", "--name", "heat", "--"];
    let argv = Mpi::Mpich.heat_argv(RANKS, N, ITERS, SLEEP_US);
    args.extend(argv.iter().map(String::as_str));
    let out = d.ctl(&args);
    let job: u64 = out.ok().trim().parse().expect("a job id");
    assert!(out.stderr.contains("checkpoints every 2s"), "{out:?}");
    d.wait_progress(job, 1, LIMIT);
    let policy = &d.status(job)["policy"];
    assert_eq!(policy["every"], "2s", "{policy}");
    assert_eq!(policy["interval_s"], 2, "{policy}");

    // Right after the first periodic commit, ckptd goes away for a while and comes back.
    wait_committed(&d, job, 1);
    d.stop_daemon();
    std::thread::sleep(Duration::from_secs(1));
    let restarted_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    d.start_daemon();
    d.wait_registered();
    assert_eq!(
        d.status(job)["policy"]["every"],
        "2s",
        "the policy survived"
    );
    let epochs = wait_committed(&d, job, 3);
    assert!(
        epochs
            .iter()
            .any(|e| e["started_unix_ms"].as_u64() > Some(restarted_ms)),
        "a periodic checkpoint after the ckptd restart: {epochs:?}"
    );
    assert!(
        !d.output(job).contains("checksum"),
        "the job ran through 3 checkpoints; make it longer"
    );
    assert_eq!(d.wait_checksum(job, LIMIT), want, "the answer is right");

    let all = d.epochs(job);
    for e in &all {
        assert_eq!(e["trigger"], "periodic", "{e}");
    }
    for pair in all.windows(2) {
        assert!(
            pair[1]["started_unix_ms"].as_u64() >= pair[0]["finished_unix_ms"].as_u64(),
            "epochs {} and {} overlap: {all:?}",
            pair[0]["epoch"],
            pair[1]["epoch"]
        );
    }
    assert!(committed(&d, job).len() >= 3, "{all:?}");
}

/// Intervals that make no sense are refused before anything runs, saying what to write.
#[test]
fn a_zero_or_unreadable_interval_is_refused() {
    skip_unless_ready!();
    let d = Ckptd::start(Options::default());
    let out = d.ctl(&["run", "--every", "0", "--", "/bin/sleep", "30"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("at least 1s"), "{out:?}");
    assert!(
        d.ctl(&["list", "--json"]).ok().trim() == "[]",
        "nothing was started"
    );
    let job = d.run_job("sleeper", &["/bin/sleep".to_string(), "30".to_string()]);
    let out = d.ctl(&["policy", &job.to_string(), "--every", "soon"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("30m, 2h or 90s"), "{out:?}");
    let out = d.ctl(&["policy", &job.to_string()]);
    assert!(out.ok().contains("no policy"), "{out:?}");
    let out = d.ctl(&["policy", &job.to_string(), "--every", "auto"]);
    assert!(
        out.ok()
            .contains("auto: no checkpoint of this job measured yet"),
        "{out:?}"
    );
    d.ctl(&["cancel", &job.to_string()]).ok();
}

/// A batch script's pattern: `run --name heat --resume --checkpoint-on USR1,TERM` starts the
/// job and waits; USR1 (Slurm's warning before the time limit) checkpoints and stops the job
/// and exits 75; the requeued script's same command resumes the job from that checkpoint
/// and, with `--wait`, ends with the job's status and the uninterrupted answer. Another user's
/// job of the same name, newer and running, neither resumes it nor stops it from resuming;
/// once it finished, `--resume` starts afresh.
#[test]
fn a_signal_stops_the_job_after_a_checkpoint_and_resume_finishes_it() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    use ckpt_tests::NOBODY;
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let d = Ckptd::start(Options::default());
    d.open_to_users();
    let argv = Mpi::Mpich.heat_argv(RANKS, N, ITERS, SLEEP_US);
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--name", "heat", "--resume"];
        args.extend(extra);
        args.push("--");
        args.extend(argv.iter().map(String::as_str));
        args.into_iter().map(String::from).collect::<Vec<String>>()
    };
    let first = run(&["--checkpoint-on", "USR1,TERM"]);
    let waiting = d.ctl_spawn(&first.iter().map(String::as_str).collect::<Vec<_>>());
    let begin = Instant::now();
    let job = loop {
        let list: Vec<serde_json::Value> =
            serde_json::from_str(d.ctl(&["list", "--json"]).ok()).unwrap();
        if let Some(j) = list.iter().find(|j| j["name"] == "heat") {
            break j["id"].as_u64().unwrap();
        }
        assert!(begin.elapsed() < LIMIT, "the job never appeared");
        std::thread::sleep(Duration::from_millis(100));
    };
    d.wait_progress(job, 1, LIMIT);
    // SAFETY: kill(2) on our own child's PID.
    unsafe { libc::kill(waiting.id() as i32, libc::SIGUSR1) };
    let out = ckpt_tests::Ctl::finish(waiting, LIMIT);
    assert_eq!(out.code, 75, "{out:?}");
    assert_eq!(out.stdout.trim(), job.to_string(), "{out:?}");
    assert!(out.stderr.contains("got SIGUSR1"), "{out:?}");
    assert!(out.stderr.contains("stopped after checkpoint 1"), "{out:?}");
    assert_eq!(d.status(job)["state"], "stopped");
    assert!(d.job_pids(job).is_empty(), "the job is stopped");

    // Names are per owner: another user's `--resume` of the same name neither resumes this
    // job nor blocks it. It starts a job of its own, still running when the requeued script
    // comes back (the newest job of that name).
    let out = d.ctl_as(
        NOBODY,
        &[
            "run",
            "--name",
            "heat",
            "--resume",
            "--",
            "/bin/sleep",
            "120",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let squatter: u64 = out.stdout.trim().parse().expect("a job id");
    assert!(squatter > job, "{out:?}");
    assert!(out.stderr.contains("starting it fresh"), "{out:?}");
    assert!(!out.stderr.contains(&format!("job {job}")), "{out:?}");
    assert_eq!(d.status(squatter)["owner_uid"], NOBODY);
    assert_eq!(d.status(job)["state"], "stopped", "untouched");

    // The requeued script: the same command, now with --wait for the end.
    let again = run(&["--wait", "--checkpoint-on", "USR1,TERM"]);
    let out = d.ctl(&again.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.code, 0, "the job ended well: {out:?}");
    assert_eq!(out.stdout.trim(), job.to_string(), "the same job: {out:?}");
    assert!(out.stderr.contains("resuming from epoch 1"), "{out:?}");
    assert_eq!(
        ckpt_tests::checksum_in(&d.output(job)).as_deref(),
        Some(want.as_str()),
        "the answer of an uninterrupted run"
    );
    assert!(
        d.output(job).matches("iter 150/").count() == 1,
        "it did not start over: {}",
        d.output(job)
    );

    let out = d.ctl(&["cancel", &squatter.to_string()]);
    assert_eq!(out.code, 0, "{out:?}");

    // Finished: a further --resume runs it afresh, as a new job.
    let out = d.ctl(&[
        "run",
        "--name",
        "heat",
        "--resume",
        "--wait",
        "--",
        "/bin/true",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_ne!(out.stdout.trim(), job.to_string(), "{out:?}");
    assert!(out.stderr.contains("starting it fresh"), "{out:?}");
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// `run --deadline +15s` on a job that needs 25 s or more: before the deadline its final
/// checkpoint is durable in shared storage and the job stopped; `run --resume` later finishes
/// it with the answer of an uninterrupted run. Deadlines that passed or leave no time for a
/// checkpoint are refused, saying the estimate.
#[test]
fn a_deadline_stops_the_job_with_a_durable_checkpoint_and_resume_finishes_it() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let d = Ckptd::start(Options {
        shared_size: Some("512M".into()),
        extra_toml: "[policy]\ndeadline_margin = \"3s\"\n".into(),
        ..Default::default()
    });
    // 25 s or more without interruption: still running at the deadline.
    let argv = Mpi::Mpich.heat_argv(RANKS, N, ITERS, 8_000);
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--name", "slow"];
        args.extend(extra);
        args.push("--");
        args.extend(argv.iter().map(String::as_str));
        d.ctl(&args)
    };
    let out = run(&["--deadline", "@1"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("passed"), "{out:?}");
    let out = run(&["--deadline", "+2s"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("too close") && out.stderr.contains("margin of 3 s"),
        "{out:?}"
    );

    let deadline = now_ms() + 15_000;
    let out = run(&["--deadline", &format!("@{}", deadline.div_ceil(1000))]);
    let job: u64 = out.ok().trim().parse().unwrap();
    assert!(out.stderr.contains("final checkpoint before"), "{out:?}");
    let begin = Instant::now();
    let durable_at = loop {
        let epochs = d.epochs(job);
        if epochs.iter().any(|e| e["storage"] == "durable") {
            break now_ms();
        }
        assert!(begin.elapsed() < LIMIT, "no durable epoch: {epochs:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        durable_at <= deadline,
        "durable {} ms after the deadline",
        durable_at - deadline
    );
    let epochs = d.epochs(job);
    let last = epochs.last().unwrap();
    assert_eq!(last["trigger"], "deadline", "{epochs:?}");
    assert_eq!(last["kill"], true, "{epochs:?}");
    assert_eq!(d.status(job)["state"], "stopped");
    assert!(d.status(job)["policy"].is_null(), "the deadline is done");
    assert!(
        !d.output(job).contains("checksum"),
        "stopped before its end"
    );
    let est: serde_json::Value =
        serde_json::from_str(d.ctl(&["estimate", &job.to_string(), "--json"]).ok()).unwrap();
    assert_eq!(est["known"], true, "{est}");
    assert!(est["predicted"]["frozen_ms"].as_u64() > Some(0), "{est}");

    let out = run(&["--resume", "--wait"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("resuming from epoch"), "{out:?}");
    assert_eq!(
        ckpt_tests::checksum_in(&d.output(job)).as_deref(),
        Some(want.as_str())
    );
}
