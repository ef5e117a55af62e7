//! End-to-end tests of the DMTCP engine (`ckptctl run --engine dmtcp`): a real 4-rank MPI heat
//! job under real DMTCP, checkpointed through ckpt's phases, killed and restarted; an abort in
//! each phase; and the refusal on a node without DMTCP, which runs everywhere. The others skip
//! with a printed reason where DMTCP is not installed (no registry these machines reach packages
//! it: see docs/dmtcp.md for building it).
use std::path::PathBuf;
use std::time::Duration;

use ckpt_tests::netns::Cluster;
use ckpt_tests::{skip_unless_ready, Ckptd, Mpi, Options};

const RANKS: u32 = 4;
const N: u32 = 256;
/// About 20 s of work: a job under DMTCP is checkpointed only once every process runs under it,
/// and must still run after two checkpoints (this machine has no DMTCP to time it again).
const ITERS: u32 = 9000;
const SLEEP_US: u32 = 2000;
const LIMIT: Duration = Duration::from_secs(180);

/// Where DMTCP is, as the agent's `[engines] dmtcp = "auto"` finds it.
fn dmtcp() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([
            PathBuf::from("/opt/dmtcp/bin"),
            PathBuf::from("/usr/local/bin"),
        ])
        .find(|d| d.join("dmtcp_launch").is_file())
}

macro_rules! skip_without_dmtcp {
    () => {
        if dmtcp().is_none() {
            eprintln!(
                "SKIPPED: needs DMTCP (dmtcp_launch on PATH or in /opt/dmtcp/bin; see docs/dmtcp.md)"
            );
            return;
        }
    };
}

/// `ckptctl run --engine dmtcp` of the heat job; its job id.
fn run_under_dmtcp(d: &Ckptd, mpi: Mpi) -> u64 {
    let argv = mpi.heat_argv(RANKS, N, ITERS, SLEEP_US);
    let mut args = vec!["run", "--engine", "dmtcp", "--name", "heat", "--"];
    args.extend(argv.iter().map(String::as_str));
    let out = d.ctl(&args);
    out.ok()
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("run printed no job id: {out:?}"))
}

/// Checkpoints until DMTCP has every process (it refuses while the job starts), then `n-1`
/// more times; every one committed.
fn checkpoint_times(d: &Ckptd, job: u64, n: u32) {
    let begin = std::time::Instant::now();
    loop {
        let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
        if out.code == 0 {
            break;
        }
        assert!(
            out.stderr
                .contains("not every process of the job runs under DMTCP yet"),
            "only a job still starting is refused: {out:?}"
        );
        assert!(begin.elapsed() < LIMIT, "DMTCP never had the job: {out:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
    for _ in 1..n {
        let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
        assert!(out.ok().contains("committed"), "{out:?}");
    }
}

fn checkpoint_kill_restart(mpi: Mpi) {
    let want = mpi.reference_checksum(RANKS, N, ITERS);
    let d = Ckptd::start(Options::default());
    let job = run_under_dmtcp(&d, mpi);
    d.wait_progress(job, 1, LIMIT);
    assert_eq!(d.status(job)["engine"], "dmtcp");
    checkpoint_times(&d, job, 2);
    let epochs: Vec<_> = d
        .epochs(job)
        .into_iter()
        .filter(|e| e["state"] == "committed")
        .collect();
    assert!(epochs.len() >= 2, "{epochs:?}");
    for e in &epochs {
        assert_eq!(e["engine"], "dmtcp", "{e}");
        assert!(e["image_bytes"].as_u64() > Some(1 << 20), "{e}");
        assert!(e["image_files"].as_u64() >= Some(RANKS as u64 + 1), "{e}");
    }
    let listed = d.ctl(&["epochs", &job.to_string()]);
    assert!(listed.ok().contains("dmtcp"), "{listed:?}");
    assert_eq!(d.status(job)["state"], "running");
    assert!(
        !d.output(job).contains("checksum"),
        "job must still be running when killed; make it longer"
    );
    // The images are root's in staging, away from the job's owner.
    let latest = epochs.last().unwrap()["epoch"].as_u64().unwrap() as u32;
    let images = d.images(job, latest).join("images");
    let names: Vec<String> = std::fs::read_dir(&images)
        .unwrap_or_else(|e| panic!("{}: {e}", images.display()))
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names
            .iter()
            .filter(|n| n.starts_with("ckpt_") && n.ends_with(".dmtcp"))
            .count()
            > RANKS as usize,
        "{names:?}"
    );

    d.kill_job(job);
    d.wait_state(job, "killed", LIMIT);
    let out = d.ctl(&["restart", &job.to_string()]);
    assert!(
        out.ok().contains(&format!("from epoch {latest}")),
        "{out:?}"
    );
    // The restored job is DMTCP's again: it is checkpointed as before.
    let lines = d.output(job).matches("iter ").count();
    d.wait_progress(job, lines + 1, LIMIT);
    checkpoint_times(&d, job, 1);
    assert_eq!(
        d.wait_checksum(job, LIMIT),
        want,
        "the restart under DMTCP reaches the uninterrupted answer"
    );
}

/// Only with `CKPT_FULL=1`: every run takes these steps with Open MPI
/// (`openmpi_heat_under_dmtcp_is_checkpointed_killed_and_restarted`), and checkpoints, kills and
/// restarts an MPICH job under DMTCP in `a_dmtcp_job_restarts_on_another_test_host`.
#[test]
fn mpich_heat_under_dmtcp_is_checkpointed_killed_and_restarted() {
    ckpt_tests::slow_variant!(
        "openmpi_heat_under_dmtcp_is_checkpointed_killed_and_restarted and a_dmtcp_job_restarts_on_another_test_host"
    );
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    skip_without_dmtcp!();
    checkpoint_kill_restart(Mpi::Mpich);
}

/// Open MPI under DMTCP: the engine points its session directory into the job's session and
/// keeps it to TCP between ranks; the restart gets back the session files and the shared
/// segments DMTCP saved beside its images.
#[test]
fn openmpi_heat_under_dmtcp_is_checkpointed_killed_and_restarted() {
    skip_unless_ready!("mpirun.openmpi", "mpicc.openmpi");
    skip_without_dmtcp!();
    checkpoint_kill_restart(Mpi::OpenMpi);
}

#[test]
fn a_node_without_dmtcp_refuses_the_job_at_run_naming_itself() {
    skip_unless_ready!();
    let d = Ckptd::start(Options {
        agent_toml: "[agent.engines]\ndmtcp = \"off\"\n".into(),
        ..Options::default()
    });
    let out = d.ctl(&[
        "run",
        "--engine",
        "dmtcp",
        "--name",
        "nope",
        "--",
        "/bin/sleep",
        "30",
    ]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains("node node0 has no dmtcp engine")
            && out.stderr.contains("criu")
            && out.stderr.contains("docs/dmtcp.md"),
        "the refusal names the node, what it has and what to do: {out:?}"
    );
    let list = d.ctl(&["list", "--json"]);
    assert!(
        !list.ok().contains("\"nope\""),
        "a refused run leaves no job behind: {list:?}"
    );
    let bad = d.ctl(&["run", "--engine", "blcr", "--", "/bin/true"]);
    assert_ne!(bad.code, 0, "{bad:?}");
    assert!(bad.stderr.contains("unknown snapshot engine"), "{bad:?}");
    let rdma = d.ctl(&["run", "--engine", "dmtcp", "--rdma", "--", "/bin/true"]);
    assert!(
        rdma.stderr.contains("--rdma needs the criu engine"),
        "{rdma:?}"
    );
}

#[test]
fn abort_in_every_phase_keeps_a_dmtcp_job_running() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    skip_without_dmtcp!();
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let d = Ckptd::start(Options {
        failpoints: true,
        ..Options::default()
    });
    let job = run_under_dmtcp(&d, Mpi::Mpich);
    d.wait_progress(job, 1, LIMIT);
    checkpoint_times(&d, job, 1);
    let committed = d.epochs(job).len();
    for (i, phase) in [
        "initial-sync",
        "quiesce",
        "local-checkpoint",
        "resume",
        "finalize",
    ]
    .iter()
    .enumerate()
    {
        d.set_failpoints(&format!("{phase}=error"));
        let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
        assert_eq!(out.code, 6, "{phase}: {out:?}");
        assert!(
            out.stderr
                .contains(&format!("failure injected in phase {phase}")),
            "{out:?}"
        );
        let epochs = d.epochs(job);
        let e = &epochs[committed + i];
        assert_eq!(
            (e["state"].as_str(), e["failed_phase"].as_str()),
            (Some("failed"), Some(*phase)),
            "{e}"
        );
        assert_eq!(d.status(job)["state"], "running", "{phase}");
        let epoch = e["epoch"].as_u64().unwrap() as u32;
        assert!(
            !d.images(job, epoch).exists(),
            "{phase}: partial images deleted"
        );
    }
    d.set_failpoints("");
    assert!(
        !d.output(job).contains("checksum"),
        "the job was still running through every abort"
    );
    // DMTCP still answers: a checkpoint after five aborted ones commits.
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert!(out.ok().contains("committed"), "{out:?}");
    assert_eq!(
        d.wait_checksum(job, LIMIT),
        want,
        "the job finished right after five aborted epochs"
    );
}

/// A DMTCP job of one test host is checkpointed to shared storage, its host's processes are
/// killed, and it restarts on another test host (DMTCP needs neither its old PIDs nor a job
/// network for that) to the uninterrupted answer; ckptd has a job network, which DMTCP jobs
/// do without. A node that lacks DMTCP is refused as a target, and so is a part the job's
/// launcher starts on a second node.
#[test]
fn a_dmtcp_job_restarts_on_another_test_host() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    skip_without_dmtcp!();
    if let Some(why) = Cluster::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let cluster = Cluster::create(3).expect("create test hosts");
    // With a job network: a DMTCP job gets no job address (it runs in the node's
    // namespaces), rather than being refused for one.
    let subnet = cluster.host_ip.rsplit_once('.').unwrap().0.to_string();
    let mut d = Ckptd::start(Options {
        no_agent: true,
        shared_size: Some("2G".into()),
        extra_toml: format!(
            "[job_network]\naddresses = \"{subnet}.150-{subnet}.199\"\nprefix = 24\n"
        ),
        ..Options::default()
    });
    for n in ["n1", "n2"] {
        d.start_agent_in(&cluster, n);
    }
    d.start_agent_in_with(&cluster, "n3", "[engines]\ndmtcp = \"off\"\n");
    d.wait_agents(&["n1", "n2", "n3"]);
    let argv = Mpi::Mpich.heat_argv(RANKS, N, ITERS, SLEEP_US);
    let job = run_on_n1(&d, "heat", &argv);
    wait_output_on(&d, "n1", job, "stdout", "no progress", |t| {
        t.contains("iter ")
    });
    let st = d.status(job);
    assert!(
        st["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["address"].as_str().unwrap_or_default().is_empty()),
        "a DMTCP job has no job address: {st}"
    );
    checkpoint_times(&d, job, 1);
    coordinator_reached_by_its_owner_only(&cluster, &d, job);
    let begin = std::time::Instant::now();
    while d.epochs(job)[0]["storage"] != "durable" {
        assert!(begin.elapsed() < LIMIT, "not flushed: {}", d.epochs(job)[0]);
        std::thread::sleep(Duration::from_millis(200));
    }
    d.kill_job_on(&["n1"], job);
    d.wait_state(job, "killed", LIMIT);
    let refused = d.ctl(&["restart", &job.to_string(), "--nodes", "n3"]);
    assert_eq!(refused.code, 4, "{refused:?}");
    assert!(refused.stderr.contains("runs under dmtcp"), "{refused:?}");
    let moved = d.ctl(&["restart", &job.to_string(), "--nodes", "n2"]);
    assert_eq!(moved.code, 0, "{moved:?}");
    let out = wait_output_on(&d, "n2", job, "stdout", "no result on n2", |t| {
        ckpt_tests::checksum_in(t).is_some()
    });
    let got = ckpt_tests::checksum_in(&out).unwrap();
    assert_eq!(
        got, want,
        "restarted on n2, the job reaches the uninterrupted answer"
    );

    // A DMTCP job whose launcher starts processes on a second node: ckptd refuses that part,
    // and the launcher says why in the job's stderr.
    let hosts: Vec<&str> = cluster.nodes[..2].iter().map(|n| n.ip.as_str()).collect();
    let argv = Mpi::Mpich.heat_argv_on(&hosts, RANKS, N, ITERS, SLEEP_US);
    let wide = run_on_n1(&d, "wide", &argv);
    let refusal = "no refusal of the second node";
    wait_output_on(&d, "n1", wide, "stderr", refusal, |t| {
        t.contains("cannot reconnect TCP between nodes")
    });
    assert!(
        !d.job_dir_on("n2", wide).join("stdout").exists(),
        "nothing of the job started on n2"
    );
    d.ctl(&["cancel", &wide.to_string()]);
}

/// The DMTCP coordinator of `job` on n1 answers its owner (root in these tests) on n1, and
/// neither another user there nor a process on another host (n2): the agent's fence. The job
/// runs on after their tries.
fn coordinator_reached_by_its_owner_only(cluster: &Cluster, d: &Ckptd, job: u64) {
    let record = d.job_dir_on("n1", job).join("job.json");
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    let port = record["coordinator_port"]
        .as_u64()
        .unwrap_or_else(|| panic!("no fenced port in job.json: {record}"));
    let command = dmtcp().unwrap().join("dmtcp_command");
    // Entered as root, then the user: `timeout` bounds a try whose packets are dropped.
    let status = |node: &str, host: &str, uid: u32| {
        let mut c = cluster.command_in(node, &PathBuf::from("setpriv"));
        c.args([
            format!("--reuid={uid}"),
            format!("--regid={uid}"),
            "--clear-groups".into(),
            "timeout".into(),
            "10".into(),
        ])
        .arg(&command)
        .args([
            "--coord-host",
            host,
            "--coord-port",
            &port.to_string(),
            "--status",
        ])
        .stdin(std::process::Stdio::null());
        let out = c.output().expect("run dmtcp_command");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), said)
    };
    let n1 = cluster.node("n1").ip.clone();
    let (ok, said) = status("n1", "127.0.0.1", 0);
    assert!(
        ok && said.contains("RUNNING=yes"),
        "the owner reaches its coordinator: {said}"
    );
    // Reset at once: DMTCP finds no coordinator.
    let refused = "Coordinator not found";
    let (ok, said) = status("n1", "127.0.0.1", ckpt_tests::NOBODY);
    assert!(
        !ok && said.contains(refused),
        "another user on n1 is refused: {said}"
    );
    let (ok, said) = status("n1", &n1, ckpt_tests::NOBODY);
    assert!(
        !ok && said.contains(refused),
        "another user on n1, by the node's address, is refused: {said}"
    );
    // Dropped: the try times out (exit 124) or DMTCP gives up.
    let (ok, said) = status("n2", &n1, 0);
    assert!(
        !ok && !said.contains("RUNNING"),
        "a process on n2 is refused: {said}"
    );
    assert_eq!(d.status(job)["state"], "running");
}

/// Starts `argv` on test host n1 under DMTCP as job `name`; its id.
fn run_on_n1(d: &Ckptd, name: &str, argv: &[String]) -> u64 {
    let mut args = vec![
        "run", "--engine", "dmtcp", "--node", "n1", "--name", name, "--",
    ];
    args.extend(argv.iter().map(String::as_str));
    d.ctl(&args).ok().trim().parse().unwrap()
}

/// Waits (bounded) until the job's `file` (`stdout`, `stderr`) on test host `node` is `done`,
/// failing with `what` and the job's output there if it is not; the file's text.
fn wait_output_on(
    d: &Ckptd,
    node: &str,
    job: u64,
    file: &str,
    what: &str,
    done: impl Fn(&str) -> bool,
) -> String {
    let begin = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(d.job_dir_on(node, job).join(file)).unwrap_or_default();
        if done(&text) {
            return text;
        }
        assert!(
            begin.elapsed() < LIMIT,
            "{what}: {}",
            d.job_output_on(node, job)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `checkpoint --kill` (preemption) of an Open MPI job under DMTCP: the epoch commits, every
/// process is gone (DMTCP's coordinator too), `verify` passes over the images and the saved
/// files beside them, and the restart finishes right.
#[test]
fn a_dmtcp_job_checkpointed_with_kill_stops_verifies_and_restarts_right() {
    skip_unless_ready!("mpirun.openmpi", "mpicc.openmpi");
    skip_without_dmtcp!();
    let want = Mpi::OpenMpi.reference_checksum(RANKS, N, ITERS);
    let d = Ckptd::start(Options::default());
    let job = run_under_dmtcp(&d, Mpi::OpenMpi);
    let id = job.to_string();
    d.wait_progress(job, 1, LIMIT);
    checkpoint_times(&d, job, 1);
    let out = d.ctl(&["checkpoint", &id, "--kill"]);
    assert!(out.ok().contains("committed"), "{out:?}");
    d.wait_state(job, "stopped", LIMIT);
    assert!(d.job_pids(job).is_empty(), "--kill stops every process");
    let latest = d.epochs(job).last().unwrap()["epoch"].as_u64().unwrap() as u32;
    let images = d.images(job, latest).join("images");
    let saved: Vec<String> = std::fs::read_dir(&images)
        .unwrap_or_else(|e| panic!("{}: {e}", images.display()))
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        saved.iter().any(|n| n.ends_with("_files")),
        "Open MPI's shared segments, saved by DMTCP, are in staging: {saved:?}"
    );
    let v = d.ctl(&["verify", &id]);
    assert!(v.ok().contains("node node0 local copy: ok"), "{v:?}");
    d.ctl(&["restart", &id]).ok();
    assert_eq!(
        d.wait_checksum(job, LIMIT),
        want,
        "restarted after a preemption, the job reaches the uninterrupted answer"
    );
}

/// A DMTCP checkpoint that does not end within `[engines] dmtcp_checkpoint_timeout` aborts the
/// epoch with that reason, deletes its images, and the job runs on to the right answer.
#[test]
fn a_dmtcp_checkpoint_past_its_timeout_aborts_and_the_job_runs_on() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    skip_without_dmtcp!();
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let d = Ckptd::start(Options {
        agent_toml: "[agent.engines]\ndmtcp_checkpoint_timeout = \"1ms\"\n".into(),
        ..Options::default()
    });
    let job = run_under_dmtcp(&d, Mpi::Mpich);
    d.wait_progress(job, 1, LIMIT);
    let begin = std::time::Instant::now();
    let out = loop {
        let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
        if !out
            .stderr
            .contains("not every process of the job runs under DMTCP yet")
        {
            break out;
        }
        assert!(begin.elapsed() < LIMIT, "DMTCP never had the job: {out:?}");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains("dmtcp_checkpoint_timeout"),
        "the abort names the setting: {out:?}"
    );
    let e = d.epochs(job).last().unwrap().clone();
    assert_eq!(
        (e["state"].as_str(), e["failed_phase"].as_str()),
        (Some("failed"), Some("local-checkpoint")),
        "{e}"
    );
    let epoch = e["epoch"].as_u64().unwrap() as u32;
    assert!(!d.images(job, epoch).exists(), "its images are deleted");
    assert_eq!(d.status(job)["state"], "running");
    assert_eq!(
        d.wait_checksum(job, LIMIT),
        want,
        "the job finished right after the abandoned checkpoint"
    );
}
