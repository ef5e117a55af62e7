//! Several nodes on one machine: agents in network namespaces joined by a bridge, one ckptd in
//! the root namespace. Skips with a printed reason where namespaces, CRIU or MPI are missing.
use std::time::{Duration, Instant};

use ckpt_tests::netns::Cluster;
use ckpt_tests::{checksum_in, skip_unless_ready, Ckptd, Mpi, Options};

const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn agents_in_namespaces_checkpoint_a_job_and_an_unreachable_node_aborts_initial_sync() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter");
    if let Some(why) = Cluster::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let want = Mpi::Mpich.reference_checksum(4, 256, 3000);
    let cluster = Cluster::create(3).expect("create test hosts");
    let mut d = Ckptd::start(Options {
        no_agent: true,
        extra_toml: "[deadlines]\nsync = \"3s\"\n".into(),
        ..Options::default()
    });
    for n in ["n1", "n2", "n3"] {
        d.start_agent_in(&cluster, n);
    }
    d.wait_agents(3);

    let mut args = vec!["run", "--name", "heat", "--node", "n2", "--"];
    let argv = Mpi::Mpich.heat_argv(4, 256, 3000, 2000);
    args.extend(argv.iter().map(String::as_str));
    let job: u64 = d.ctl(&args).ok().trim().parse().unwrap();
    let out_file = d.job_dir_on("n2", job).join("stdout");
    let begin = Instant::now();
    while !std::fs::read_to_string(&out_file)
        .unwrap_or_default()
        .contains("iter ")
    {
        assert!(begin.elapsed() < LIMIT, "no progress");
        std::thread::sleep(Duration::from_millis(50));
    }
    let st = d.status(job);
    assert_eq!(st["nodes"][0]["node"], "n2", "{st}");
    assert!(
        !st["nodes"][0]["processes"].as_array().unwrap().is_empty(),
        "status lists the node's processes: {st}"
    );
    d.ctl(&["checkpoint", &job.to_string(), "--wait"]).ok();

    // Node n2 becomes unreachable: the next epoch aborts in initial synchronization within its
    // deadline, naming the node; the job itself is not touched.
    cluster.set_link("n2", false);
    let t = Instant::now();
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    let took = t.elapsed();
    cluster.set_link("n2", true);
    assert!(out.code == 7 || out.code == 9, "{out:?}");
    assert!(out.stderr.contains("node n2"), "{out:?}");
    assert!(
        took < Duration::from_secs(15),
        "aborted within the deadline, took {took:?}"
    );
    let e = &d.epochs(job)[1];
    assert_eq!(
        (e["state"].as_str(), e["failed_phase"].as_str()),
        (Some("failed"), Some("initial-sync")),
        "{e}"
    );

    // The job went on; kill it on its node and restart it there from epoch 1.
    for p in d.job_pids_on("n2", job) {
        // SAFETY: kill(2) on a PID read from the job's own cgroup.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    let begin = Instant::now();
    while !d.job_pids_on("n2", job).is_empty() {
        assert!(begin.elapsed() < LIMIT, "job survives SIGKILL");
        for p in d.job_pids_on("n2", job) {
            // SAFETY: as above.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    d.wait_state(job, "killed", LIMIT);
    d.ctl(&["restart", &job.to_string()]).ok();
    d.wait_state(job, "exited", LIMIT);
    let text = std::fs::read_to_string(&out_file).unwrap();
    assert_eq!(
        checksum_in(&text).as_deref(),
        Some(want.as_str()),
        "restarted inside n2's namespace"
    );
}
