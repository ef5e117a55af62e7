//! A standby ckptd: the registry in a 3-member etcd on loopback (TLS, client certificates), two
//! ckptd processes, agents on test hosts given both addresses. The active ckptd is SIGKILLed
//! in the middle of a checkpoint; the standby takes over, the interrupted epoch is aborted (the
//! job runs on), the next checkpoint commits. Then the first ckptd, started again, stands by;
//! the active one hangs (SIGSTOP) and is deposed: the first takes over, a checkpoint commits,
//! and the hung one, continued, stops on its own (exit 5). A restart from the last checkpoint
//! computes the right answer. Skips with a printed reason where etcd, namespaces, CRIU or MPICH
//! are missing.
use std::time::{Duration, Instant};

use ckpt_tests::etcd::Etcd;
use ckpt_tests::hosts::{committed_epochs, result_on, run_on, LIMIT};
use ckpt_tests::netns::Cluster;
use ckpt_tests::{skip_unless_ready, slow_variant, Ckptd, Mpi, Options};

const NODES: [&str; 2] = ["n1", "n2"];
const RANKS: u32 = 4;
const N: u32 = 256;
const ITERS: u32 = 12000;
const SLEEP_US: u32 = 2000;

#[test]
fn the_active_ckptd_killed_during_a_checkpoint_the_standby_takes_over() {
    failover(false);
}

/// The same, etcd having lost its leading member first.
#[test]
fn the_same_with_etcd_down_one_member() {
    slow_variant!("the_active_ckptd_killed_during_a_checkpoint_the_standby_takes_over");
    failover(true);
}

fn log(d: &Ckptd, name: &str) -> String {
    std::fs::read_to_string(d.dir.path().join(name)).unwrap_or_default()
}

/// Waits (bounded) until `name` holds `what` `times` times.
fn wait_log(d: &Ckptd, name: &str, what: &str, times: usize) {
    let begin = Instant::now();
    while log(d, name).matches(what).count() < times {
        assert!(
            begin.elapsed() < LIMIT,
            "{name} never said {what:?} {times} times: {}",
            tail(&log(d, name), 20)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn failover(lose_etcd_member: bool) {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "etcd");
    if let Some(why) = Etcd::unavailable().or_else(Cluster::unavailable) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let mut etcd = Etcd::start(3);
    let cluster = Cluster::create(NODES.len()).expect("create test hosts");
    let mut d = Ckptd::start(Options {
        no_agent: true,
        failpoints: true,
        etcd: Some(etcd.registry_keys()),
        standby: true,
        // Twice the registry's lease (5 s) and 1 s: the agents' leases outlast a failover.
        extra_toml: "fence_lease = \"11s\"\nnode_timeout = \"12s\"\n".into(),
        ..Options::default()
    });
    for n in NODES {
        d.start_agent_in(&cluster, n);
    }
    d.wait_agents(&NODES);
    let hosts: Vec<&str> = cluster.nodes.iter().map(|n| n.ip.as_str()).collect();
    let job = run_on(
        &d,
        "n1",
        &Mpi::Mpich.heat_argv_on(&hosts, RANKS, N, ITERS, SLEEP_US),
    );
    let id = job.to_string();
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    assert!(
        log(&d, "ckptd-b.log").contains("standing by: another ckptd is active"),
        "the second ckptd stands by: {}",
        log(&d, "ckptd-b.log")
    );
    if lose_etcd_member {
        // The member that leads etcd: the others elect another, the two left are a quorum.
        let leader = etcd.leader().expect("an etcd member leads");
        etcd.kill_member(leader);
    }

    // The dump is held 4 s on every node; in it, the active ckptd is lost.
    d.set_failpoints("local-checkpoint=delay:4s\n");
    let ctl = d.ctl_spawn(&["checkpoint", &id, "--wait"]);
    let state = d.cgroup_on("n2", job).join("freezer.state");
    let begin = Instant::now();
    while std::fs::read_to_string(&state).unwrap_or_default().trim() != "FROZEN" {
        assert!(
            begin.elapsed() < LIMIT,
            "n2 never froze: {}\n{}",
            tail(&log(&d, "ckptd.log"), 30),
            etcd.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        d.kill_daemon_hard(false),
        "the first ckptd was running: {}",
        tail(&log(&d, "ckptd.log"), 20)
    );
    let killed = Instant::now();
    let out = ctl.wait_with_output().unwrap();
    assert_ne!(out.status.code(), Some(0), "{out:?}");
    d.set_failpoints("");

    // The standby serves: ckptctl, given both sockets, reaches it.
    while d.ctl(&["list"]).code != 0 {
        assert!(
            killed.elapsed() < LIMIT,
            "the standby did not take over: {}",
            log(&d, "ckptd-b.log")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let serving = killed.elapsed();
    assert!(
        log(&d, "ckptd-b.log").contains("this ckptd is now the active one"),
        "{}",
        log(&d, "ckptd-b.log")
    );
    // The interrupted epoch is failed, the one before stays committed, and the job ran on.
    let e = &d.epochs(job)[1];
    assert_eq!(e["state"], "failed", "{e}");
    assert!(
        e["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("coordinator"),
        "{e}"
    );
    assert_eq!(committed_epochs(&d, job), [1]);
    let st = d.status(job);
    assert_eq!(st["state"], "running", "{st}");

    // Every node's agent finds the new ckptd; the next checkpoint commits there.
    d.wait_nodes_in(&NODES, "up", LIMIT);
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    let committed = killed.elapsed();
    eprintln!(
        "failover: ckptctl served {:.1} s after the kill, the next checkpoint committed at {:.1} s",
        serving.as_secs_f64(),
        committed.as_secs_f64()
    );
    assert_eq!(committed_epochs(&d, job), [1, 3]);
    // A replaced ckptd, back with an old fence (1: below any winner's), is refused by an agent
    // that has heard from its successor, before the call does anything.
    let nodes: serde_json::Value =
        serde_json::from_str(d.ctl(&["nodes", "--json"]).ok()).expect("nodes --json");
    let n1 = nodes["nodes"]
        .as_array()
        .and_then(|a| a.iter().find(|n| n["name"] == "n1"))
        .and_then(|n| n["address"].as_str())
        .expect("n1's agent address")
        .to_string();
    let tls = d.dir.path().join("tls").display().to_string();
    let out = std::process::Command::new(ckpt_tests::bin_dir().join("ckpt-attack"))
        .args([
            n1.as_str(),
            "--target",
            "n1",
            "--job",
            &id,
            "--replaced-ckptd",
            &tls,
            "1",
        ])
        .output()
        .expect("run ckpt-attack");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("RPC Agent.InspectFenced FailedPrecondition")
            && said.contains("fence 1 is older than"),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The first ckptd, started again, stands by. The active one hangs (a head node that stops
    // answering, its process alive): its lease runs out, the first takes over, and the agents
    // give the hung one up within a quarter of their lease and reach it.
    d.start_daemon();
    wait_log(&d, "ckptd.log", "standing by: another ckptd is active", 1);
    d.signal_daemon(true, libc::SIGSTOP);
    let hung = Instant::now();
    // Until the other takes over, ckptctl given both sockets names the hung one (the kernel
    // still accepts connections for it) instead of waiting on it.
    let r = d.ctl(&["list"]);
    if r.code != 0 {
        assert!(r.stderr.contains("did not answer within"), "{r:?}");
    }
    wait_log(&d, "ckptd.log", "this ckptd is now the active one", 2);
    d.wait_nodes_in(&NODES, "up", LIMIT);
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    eprintln!(
        "a hung ckptd: the other took over and committed a checkpoint {:.1} s after it hung",
        hung.elapsed().as_secs_f64()
    );
    assert_eq!(committed_epochs(&d, job).last(), Some(&4));
    // Continued, the hung one finds its lease gone and stops, without a write.
    d.signal_daemon(true, libc::SIGCONT);
    let begin = Instant::now();
    let code = loop {
        if let Some(code) = d.daemon_exit(true) {
            break code;
        }
        assert!(
            begin.elapsed() < LIMIT,
            "the deposed ckptd runs on: {}",
            tail(&log(&d, "ckptd-b.log"), 20)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, 5, "{}", tail(&log(&d, "ckptd-b.log"), 20));
    assert!(log(&d, "ckptd-b.log").contains("lost the leadership"));
    assert_eq!(d.status(job)["state"], "running");
    assert_eq!(committed_epochs(&d, job).last(), Some(&4));

    // A restart from it, through the new ckptd, gives the right answer.
    d.kill_job_on(&NODES, job);
    d.wait_state(job, "killed", LIMIT);
    let r = d.ctl(&["restart", &id]);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(result_on(&d, "n1", job), want);
    drop(d);
    assert!(
        lose_etcd_member || etcd.healthy(),
        "etcd stayed healthy: {}",
        etcd.logs()
    );
}
