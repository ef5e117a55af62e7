//! Several nodes on one machine: agents in network namespaces joined by a bridge, one ckptd in
//! the root namespace. Skips with a printed reason where namespaces, CRIU or MPI are missing.
//!
//! One file although long: each file here is one suite, one test binary that
//! `scripts/test.sh` runs and times as a line, and the node-loss tests and the recovery matrix
//! at its end share the cluster builders and the checks of what a lost node leaves behind.
use std::time::{Duration, Instant};

use ckpt_tests::hosts::{
    assert_still_committed, committed_epochs, destroy_sandbox, heat_on_first, hosts_with, outcome,
    result_on, run_on, wait_copied, BOTH_MPIS, LIMIT,
};
use ckpt_tests::netns::Cluster;
use ckpt_tests::{checksum_in, skip_unless_ready, slow_variant, Ckptd, Mpi, Options};

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
        // A node timeout well past the cut below: n2 stays a node of the job (its lease, half
        // of it, does not run out), only the epoch aborts.
        extra_toml: "node_timeout = \"30s\"\n[deadlines]\nsync = \"3s\"\n".into(),
        ..Options::default()
    });
    for n in ["n1", "n2", "n3"] {
        d.start_agent_in(&cluster, n);
    }
    d.wait_agents(&NODES);

    let job = run_on(&d, "n2", &Mpi::Mpich.heat_argv(4, 256, 3000, 2000));
    let out_file = d.job_dir_on("n2", job).join("stdout");
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

const NODES: [&str; 3] = ["n1", "n2", "n3"];
const RANKS: u32 = 6;
const N: u32 = 256;
const ITERS: u32 = 3000;
const SLEEP_US: u32 = 2000;

/// Three test hosts, one agent on each, one ckptd; `None` (with the reason printed) where
/// namespaces are unavailable.
fn three_nodes(failpoints: bool) -> Option<(Cluster, Ckptd)> {
    nodes_with(failpoints, false)
}

/// Like [`three_nodes`], and with `job_network` every part runs in a sandbox with an address
/// from `<subnet>.150-<subnet>.199` of the test hosts' bridge.
fn nodes_with(failpoints: bool, job_network: bool) -> Option<(Cluster, Ckptd)> {
    hosts_with(&NODES, failpoints, job_network, None, "")
}

/// Starts the heat program with 6 ranks over the three nodes, launched from n1, and waits
/// until it computes.
fn run_across(d: &Ckptd, cluster: &Cluster, mpi: Mpi) -> u64 {
    let hosts: Vec<&str> = cluster.nodes.iter().map(|n| n.ip.as_str()).collect();
    run_on(
        d,
        "n1",
        &mpi.heat_argv_on(&hosts, RANKS, N, ITERS, SLEEP_US),
    )
}

/// [`result_on`] for a launcher on n1.
fn result_on_n1(d: &Ckptd, job: u64) -> String {
    result_on(d, "n1", job)
}

/// `ckptctl status` names every node with its role, its ranks and their state.
fn assert_status_shows_every_node(d: &Ckptd, job: u64) {
    let st = d.status(job);
    let nodes = st["nodes"].as_array().expect("nodes");
    let mut names: Vec<&str> = nodes.iter().filter_map(|n| n["node"].as_str()).collect();
    // The launcher node first, then the others in the order mpiexec reached them.
    names[1..].sort_unstable();
    assert_eq!(names, NODES, "{st}");
    assert_eq!(nodes[0]["role"], "launcher", "{st}");
    let mut all_ranks = Vec::new();
    for n in nodes {
        assert_eq!(n["state"], "running", "{st}");
        let ranks = n["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 2, "two ranks on {}: {st}", n["node"]);
        all_ranks.extend(ranks.iter().filter_map(|r| r.as_i64()));
        if n["node"] != "n1" {
            assert_eq!(n["role"], "attached", "{st}");
        }
    }
    all_ranks.sort_unstable();
    assert_eq!(all_ranks, (0..RANKS as i64).collect::<Vec<_>>(), "{st}");
    let text = d.ctl(&["status", &job.to_string()]).ok().to_string();
    assert!(
        text.contains("node n2 (attached): running, ") && text.contains("ranks "),
        "{text}"
    );
}

/// The main multi-node story: a 6-rank job across 3 nodes, started by mpiexec through
/// ckpt-rsh, checkpointed twice, every process on every node SIGKILLed, restarted, and
/// finishing with the checksum of an uninterrupted run.
///
/// The first restart meets an obstacle and fails on n3, naming the node and the cause; the nodes
/// already restored are killed, and the job restarts once the obstacle is gone.
fn checkpoint_kill_restart_across_three_nodes(mpi: Mpi, obstacle: Obstacle) {
    let want = mpi.reference_checksum(RANKS, N, ITERS);
    let Some((cluster, d)) = three_nodes(false) else {
        return;
    };
    let job = run_across(&d, &cluster, mpi);
    assert_status_shows_every_node(&d, job);
    for _ in 0..2 {
        d.ctl(&["checkpoint", &job.to_string(), "--wait"]).ok();
    }
    let epochs = d.epochs(job);
    for e in &epochs {
        assert_eq!(e["state"], "committed", "{e}");
        let mut nodes: Vec<&str> = e["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|n| n.as_str())
            .collect();
        nodes.sort_unstable();
        assert_eq!(nodes, NODES, "every node is in the epoch: {e}");
    }
    // Partner copies follow each commit in the background: every node's images of epoch 2
    // also sit on the next node.
    let begin = std::time::Instant::now();
    while d.epochs(job)[1]["partner_copy"] != true {
        assert!(
            begin.elapsed() < LIMIT,
            "no partner copies: {:?}",
            d.epochs(job)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    for (node, holder) in [("n1", "n2"), ("n2", "n3"), ("n3", "n1")] {
        let copy = d
            .dir
            .path()
            .join(holder)
            .join("local")
            .join(job.to_string())
            .join("2")
            .join(node);
        assert!(copy.join("MANIFEST").is_file(), "{}", copy.display());
    }
    let n3_pid = d
        .job_pids_on("n3", job)
        .into_iter()
        .max()
        .expect("n3 has processes");
    d.kill_job_on(&NODES, job);
    d.wait_state(job, "killed", LIMIT);
    // A refused restart names the node and `what`, and leaves nothing running anywhere.
    let refused = |out: ckpt_tests::Ctl, what: &str| {
        assert_ne!(out.code, 0, "{out:?}");
        assert!(
            out.stderr.contains("node n3") && out.stderr.contains(what),
            "the error names the node and {what}: {out:?}"
        );
        for n in NODES {
            assert!(
                d.job_pids_on(n, job).is_empty(),
                "a failed restart leaves nothing running on {n}"
            );
        }
        d.wait_state(job, "killed", LIMIT);
    };
    match obstacle {
        Obstacle::TakenPid => match PidSquatter::take(n3_pid) {
            Some(squatter) => {
                // A namespace named as n1's sandbox for this job would be, left by another
                // agent: n1's part (no sandbox) is still held in n1's own namespace while n3
                // waits for its PID. (The hold once went to whatever namespace had that name,
                // leaving the part unheld.)
                let stale = format!("ckpt-n1-{job}");
                let ip = |args: &[&str]| {
                    std::process::Command::new("ip")
                        .args(args)
                        .status()
                        .expect("run ip")
                };
                // (An earlier test's sandbox of that name may be there already.)
                let made = !std::path::Path::new("/run/netns").join(&stale).exists();
                if made {
                    assert!(ip(&["netns", "add", &stale]).success());
                }
                let restart = d.ctl_spawn(&["restart", &job.to_string()]);
                let table = format!("ckpt_hold_n1_{job}");
                let begin = Instant::now();
                let held_at_home = loop {
                    let listed = cluster
                        .command_in("n1", &"nft".into())
                        .args(["list", "table", "inet", &table])
                        .stdout(std::process::Stdio::null())
                        .stderr(std::process::Stdio::null())
                        .status()
                        .expect("run nft")
                        .success();
                    if listed || begin.elapsed() > Duration::from_secs(10) {
                        break listed;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                };
                let out = ckpt_tests::Ctl::finish(restart, LIMIT);
                if made {
                    ip(&["netns", "del", &stale]);
                }
                assert!(held_at_home, "n1's part was not held in n1's namespace");
                refused(out, &n3_pid.to_string());
                drop(squatter);
            }
            None => eprintln!("SKIPPED the taken-PID step: could not obtain PID {n3_pid}"),
        },
        Obstacle::MissingAddress => {
            cluster.set_job_address("n3", false);
            refused(
                d.ctl(&["restart", &job.to_string()]),
                &format!("address {} ", cluster.node("n3").ip),
            );
            cluster.set_job_address("n3", true);
        }
    }
    // n2's own copy of epoch 2 is lost: it restores from the partner copy n3 keeps (nodes pass
    // their images to the next one in name order after each commit).
    let lost = d
        .dir
        .path()
        .join("n2/local")
        .join(job.to_string())
        .join("2/n2");
    std::fs::remove_dir_all(&lost).expect("remove n2's copy");
    let out = d.ctl(&["restart", &job.to_string()]);
    out.ok();
    assert!(
        out.stderr
            .contains("node n2 restored (held) from its partner copy"),
        "{out:?}"
    );
    assert!(lost.join("MANIFEST").is_file(), "n2's copy is back");
    assert_eq!(result_on_n1(&d, job), want, "restarted on all three nodes");
}

/// What stands in the way of the first restart.
#[derive(Debug, Clone, Copy)]
enum Obstacle {
    /// A process outside the job holds one of n3's PIDs.
    TakenPid,
    /// n3's job address is gone.
    MissingAddress,
}

/// A process that holds a given PID (obtained through /proc/sys/kernel/ns_last_pid); killed on
/// drop.
struct PidSquatter(std::process::Child);

const LAST_PID: &str = "/proc/sys/kernel/ns_last_pid";

impl PidSquatter {
    fn take(pid: i32) -> Option<Self> {
        let last: i32 = std::fs::read_to_string(LAST_PID)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let mut got = None;
        for _ in 0..20 {
            std::fs::write(LAST_PID, (pid - 1).to_string()).ok()?;
            let mut c = std::process::Command::new("sleep")
                .arg("300")
                .spawn()
                .ok()?;
            if c.id() as i32 == pid {
                got = Some(PidSquatter(c));
                break;
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        // Move the allocator back past the job's IDs, or the next processes (the restore's own
        // helpers) would take the job's other PIDs and thread IDs.
        let _ = std::fs::write(LAST_PID, last.max(pid).to_string());
        got
    }
}

impl Drop for PidSquatter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn mpich_across_three_nodes_checkpoint_kill_restart() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "nft");
    checkpoint_kill_restart_across_three_nodes(Mpi::Mpich, Obstacle::TakenPid);
}

#[test]
fn openmpi_across_three_nodes_checkpoint_kill_restart() {
    skip_unless_ready!("mpirun.openmpi", "mpicc.openmpi", "nsenter", "nft");
    checkpoint_kill_restart_across_three_nodes(Mpi::OpenMpi, Obstacle::MissingAddress);
}

/// Checkpoints `job` with every dump held 4 s and kills the agent of `kill` once `watch` is
/// frozen and dumping: ckptctl fails (exit 6) naming `kill`.
fn kill_agent_during_dump(d: &mut Ckptd, job: u64, watch: &str, kill: &str) {
    d.set_failpoints("local-checkpoint=delay:4s\n");
    let ctl = d.ctl_spawn(&["checkpoint", &job.to_string(), "--wait"]);
    let state = d.cgroup_on(watch, job).join("freezer.state");
    let begin = Instant::now();
    while std::fs::read_to_string(&state).unwrap_or_default().trim() != "FROZEN" {
        assert!(begin.elapsed() < LIMIT, "{watch} never froze");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Frozen is the end of the quiesce phase; its reply may still be on the way. The dump is
    // held for 4 s, so one second later the node is in the local checkpoint.
    std::thread::sleep(Duration::from_secs(1));
    d.kill_agent_on(kill);
    let out = ctl.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(6), "{stderr}");
    assert!(
        stderr.contains(&format!("node {kill}")),
        "{kill} is named: {stderr}"
    );
    d.set_failpoints("");
}

/// An agent killed while its node dumps: the epoch is aborted, every node thaws (the killed
/// agent's node when systemd restarts the agent), and the job finishes right on all nodes.
#[test]
fn agent_killed_during_local_checkpoint_aborts_and_the_job_goes_on_everywhere() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter");
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let Some((cluster, mut d)) = three_nodes(true) else {
        return;
    };
    let job = run_across(&d, &cluster, Mpi::Mpich);
    d.ctl(&["checkpoint", &job.to_string(), "--wait"]).ok();
    kill_agent_during_dump(&mut d, job, "n2", "n2");
    // systemd restarts the agent: it thaws its part and is told to abort the epoch.
    d.start_agent_in(&cluster, "n2");
    let e = &d.epochs(job)[1];
    assert_eq!(
        (e["state"].as_str(), e["failed_phase"].as_str()),
        (Some("failed"), Some("local-checkpoint")),
        "{e}"
    );
    assert_eq!(result_on_n1(&d, job), want);
    // Only the committed epoch has images left, on every node.
    for n in NODES {
        let staged = d.dir.path().join(n).join("local").join(job.to_string());
        let epochs: Vec<String> = std::fs::read_dir(&staged)
            .map(|r| {
                r.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(epochs, ["1"], "staging of {n}: {epochs:?}");
    }
}

/// Relays deployed: with `[relays] above = 2, fanout = 2`, ckptd drives the epochs of a job on
/// three nodes through n1, which relays to n2 under a grant ckptd signs, and n3 directly.
/// A relayed checkpoint commits; the relay's agent killed while n2 (below it) dumps fails the
/// epoch naming n1, every node thaws and the job runs on; the next relayed checkpoint commits,
/// and the job killed everywhere restarts from it to the checksum of an uninterrupted run.
#[test]
fn relays_carry_epochs_and_a_dead_relay_aborts_one() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter");
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let Some((cluster, mut d)) = hosts_with(
        &NODES,
        true,
        false,
        None,
        "[relays]\nabove = 2\nfanout = 2\n",
    ) else {
        return;
    };
    let dir = d.dir.path().to_path_buf();
    let log = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    let job = run_across(&d, &cluster, Mpi::Mpich);
    d.ctl(&["checkpoint", &job.to_string(), "--wait"]).ok();
    assert!(
        log("ckptd.log").contains("the epoch goes through relays: n1 (2 nodes)"),
        "{}",
        log("ckptd.log")
    );
    let relayed = |n: usize| {
        log("agent-n1.log")
            .matches("relaying the epoch to 1 node(s) below n1")
            .count()
            >= n
    };
    assert!(relayed(1), "{}", log("agent-n1.log"));

    // The relay dies while the node below it dumps.
    kill_agent_during_dump(&mut d, job, "n2", "n1");
    let state = d.cgroup_on("n2", job).join("freezer.state");
    // The node below the dead relay was told to abort by ckptd itself, and thawed.
    let begin = Instant::now();
    while std::fs::read_to_string(&state).unwrap_or_default().trim() != "THAWED" {
        assert!(
            begin.elapsed() < LIMIT,
            "n2 stayed frozen after its relay died"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let registrations = || {
        log("ckptd.log")
            .lines()
            .filter(|l| l.contains("agent registered") && l.contains("\"n1\""))
            .count()
    };
    let before = registrations();
    d.start_agent_in(&cluster, "n1");
    let begin = Instant::now();
    while registrations() == before {
        assert!(begin.elapsed() < LIMIT, "n1's agent did not register again");
        std::thread::sleep(Duration::from_millis(50));
    }
    let e = &d.epochs(job)[1];
    assert_eq!(
        (e["state"].as_str(), e["failed_phase"].as_str()),
        (Some("failed"), Some("local-checkpoint")),
        "{e}"
    );

    // The next epoch goes through the restarted relay, and the job restarts from it.
    d.ctl(&["checkpoint", &job.to_string(), "--wait"]).ok();
    assert!(relayed(2), "{}", log("agent-n1.log"));
    assert_eq!(d.epochs(job)[2]["state"], "committed");
    d.kill_job_on(&NODES, job);
    d.wait_state(job, "killed", LIMIT);
    d.ctl(&["restart", &job.to_string()]).ok();
    assert_eq!(
        result_on_n1(&d, job),
        want,
        "restarted from the relayed epoch"
    );
}

/// Job sandboxes: a 6-rank MPICH job across three nodes runs in sandboxes (its own PID, IPC and
/// UTS namespaces and a job address per part); it is checkpointed, killed on every node, every
/// PID it had is then taken by other processes, and the restart succeeds anyway, to the
/// checksum of an uninterrupted run. When the job ends, its sandboxes' namespaces are gone.
#[test]
fn sandboxed_job_restarts_while_other_processes_hold_all_its_old_pids() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "nft");
    let mpi = Mpi::Mpich;
    let want = mpi.reference_checksum(RANKS, N, ITERS);
    let Some((cluster, d)) = nodes_with(false, true) else {
        return;
    };
    // Named by host name, as a user would: the sandbox keeps the node's host name, so the
    // launcher knows its own node, and ckpt-rsh resolves the others.
    let hosts: Vec<&str> = cluster.nodes.iter().map(|n| n.netns.as_str()).collect();
    let job = run_on(
        &d,
        "n1",
        &mpi.heat_argv_on(&hosts, RANKS, N, ITERS, SLEEP_US),
    );
    assert_status_shows_every_node(&d, job);
    let st = d.status(job);
    let subnet = cluster.host_ip.rsplit_once('.').unwrap().0.to_string();
    let mut addresses: Vec<String> = st["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["address"].as_str().unwrap_or_default().to_string())
        .collect();
    addresses.sort();
    addresses.dedup();
    assert_eq!(addresses.len(), 3, "one job address per part: {st}");
    for a in &addresses {
        assert!(
            a.starts_with(&format!("{subnet}.1")) && a.ends_with("/24"),
            "{st}"
        );
    }
    for n in NODES {
        assert!(
            std::path::Path::new(&format!("/run/netns/ckpt-{n}-{job}")).exists(),
            "{n} made the part's network namespace"
        );
    }
    d.ctl(&["checkpoint", &job.to_string(), "--wait"]).ok();
    let old: Vec<i32> = NODES.iter().flat_map(|n| d.job_pids_on(n, job)).collect();
    d.kill_job_on(&NODES, job);
    d.wait_state(job, "killed", LIMIT);
    let squatters: Vec<PidSquatter> = old.iter().filter_map(|&p| PidSquatter::take(p)).collect();
    eprintln!(
        "{} of the job's {} old PIDs taken by other processes",
        squatters.len(),
        old.len()
    );
    assert!(
        squatters.len() * 2 >= old.len(),
        "could take only {} of {} PIDs",
        squatters.len(),
        old.len()
    );
    d.ctl(&["restart", &job.to_string()]).ok();
    assert_eq!(result_on_n1(&d, job), want, "restarted in fresh sandboxes");
    drop(squatters);
    let begin = Instant::now();
    while NODES
        .iter()
        .any(|n| std::path::Path::new(&format!("/run/netns/ckpt-{n}-{job}")).exists())
    {
        assert!(
            begin.elapsed() < LIMIT,
            "the sandboxes' network namespaces outlive the job"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// How a lost node's part is placed.
#[derive(Clone, Copy, Debug)]
enum Replace {
    /// `restart --on-spares`, n4 being the spare.
    OnSpares,
    /// `restart --map n3=n4`.
    Map,
}

/// Four test hosts (n4 a spare in ckptd.toml, nodes down after 2 s without heartbeat),
/// sandboxes, shared storage if `shared`; a job across n1..n3.
fn three_and_a_spare(mpi: Mpi, shared: bool) -> Option<(Cluster, Ckptd, u64)> {
    three_and_a_spare_with(mpi, shared, "")
}

/// [`three_and_a_spare`] with more ckptd.toml tables.
fn three_and_a_spare_with(
    mpi: Mpi,
    shared: bool,
    more_toml: &str,
) -> Option<(Cluster, Ckptd, u64)> {
    let all = ["n1", "n2", "n3", "n4"];
    let (cluster, d) = hosts_with(
        &all,
        false,
        true,
        shared.then_some("512M"),
        &format!("node_timeout = \"2s\"\n{more_toml}[spares]\nnodes = [\"n4\"]\n"),
    )?;
    let job = heat_on_first(&d, &cluster, 3, mpi, (RANKS, N, ITERS, SLEEP_US));
    Some((cluster, d, job))
}

/// The job address and where the part ran before, of the part on `node` in a status.
fn part_of(st: &serde_json::Value, node: &str) -> Option<(String, String)> {
    st["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == node)
        .map(|n| {
            (
                n["address"].as_str().unwrap_or_default().to_string(),
                n["moved_from"].as_str().unwrap_or_default().to_string(),
            )
        })
}

/// A node is lost for good after a checkpoint: its agent SIGKILLed, the job's processes and
/// sandbox gone, its local images deleted. The restart runs its part on n4, with its job
/// address, and the job ends with the checksum of an uninterrupted run; n3's part is reached
/// by ckpt-rsh on n1 where it runs now. `--on-spares` is tried with shared storage and n3's
/// partner copy (on n1) lost too: n4 restores the shared copy; `--map n3=n4` without shared
/// storage: n4 fetches n3's partner copy from n1, which keeps it, with the grant ckptd gives.
fn lost_node_restarts_on_n4(mpi: Mpi, how: Replace) {
    let want = mpi.reference_checksum(RANKS, N, ITERS);
    let shared = matches!(how, Replace::OnSpares);
    let Some((_cluster, mut d, job)) = three_and_a_spare(mpi, shared) else {
        return;
    };
    let (before, _) = part_of(&d.status(job), "n3").expect("a part on n3");
    d.ctl(&["checkpoint", &job.to_string(), "--wait"]).ok();
    let from = if shared { "shared" } else { "partner" };
    wait_copied(&d, job, shared);
    // n3 is gone: agent, processes, sandbox, local images.
    d.kill_agent_on("n3");
    d.kill_job_on(&NODES, job);
    destroy_sandbox("n3", job);
    std::fs::remove_dir_all(d.dir.path().join("n3").join("local")).unwrap();
    if shared {
        // The partner copy n1 keeps of n3's images is lost too: only the shared copy is left.
        let copy = d
            .dir
            .path()
            .join("n1/local")
            .join(job.to_string())
            .join("1/n3");
        std::fs::remove_dir_all(&copy).unwrap_or_else(|e| panic!("{}: {e}", copy.display()));
    }
    // The launcher's end (killed) waits for n3 to be heard from again; n3 stays silent, so
    // the job is lost with it once the node timeout (2 s) has passed.
    d.wait_state(job, "lost", LIMIT);
    // Bad placements are refused with their own exit codes, and nothing runs anywhere.
    let id = job.to_string();
    let nothing_restored = |what: &str| {
        for n in ["n1", "n2", "n4"] {
            assert!(
                d.job_pids_on(n, job).is_empty(),
                "{what} left a part on {n}"
            );
        }
    };
    match how {
        Replace::Map => {
            for (args, code) in [
                (["--nodes", "n1,n2"], 2),
                (["--map", "n3=n9"], 3),
                (["--map", "n3=n1"], 4),
            ] {
                let out = d.ctl(&["restart", &id, args[0], args[1]]);
                assert_eq!(out.code, code, "{args:?}: {out:?}");
                nothing_restored(args[1]);
            }
        }
        Replace::OnSpares => {
            // Another job on the only spare: no spare is free.
            let other: u64 = d
                .ctl(&["run", "--node", "n4", "--", "/bin/sleep", "600"])
                .ok()
                .trim()
                .parse()
                .unwrap();
            let out = d.ctl(&["restart", &id, "--on-spares"]);
            assert_eq!(out.code, 10, "{out:?}");
            assert!(out.stderr.contains("no spare is free"), "{out:?}");
            nothing_restored("no spare");
            d.ctl(&["cancel", &other.to_string()]).ok();
            d.wait_state(other, "cancelled", LIMIT);
        }
    }
    // The job has no restart policy, so n3 does not fence its part: ckptd, which cannot tell
    // a dead n3 from a cut-off one, moves the part only once told that n3 is down.
    let restart = |down: &[&str]| {
        let mut args = vec!["restart", &id];
        match how {
            Replace::OnSpares => args.push("--on-spares"),
            Replace::Map => args.extend(["--map", "n3=n4"]),
        }
        args.extend(down.iter().copied());
        d.ctl(&args)
    };
    let refused = restart(&[]);
    assert_eq!(refused.code, 4, "{refused:?}");
    assert!(
        refused.stderr.contains("may still run") && refused.stderr.contains("--down n3"),
        "{refused:?}"
    );
    nothing_restored("a restart without --down");
    let r = restart(&["--down", "n3"]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stderr.contains("moving n3's part to n4"), "{r:?}");
    assert!(
        r.stderr.contains(&format!(
            "node n4 restored (held) n3's part from its {from} copy"
        )),
        "{r:?}"
    );
    let st = d.status(job);
    assert_eq!(
        part_of(&st, "n4"),
        Some((before, "n3".to_string())),
        "the part kept its job address, and status says where it ran: {st}"
    );
    assert_eq!(part_of(&st, "n3"), None, "{st}");
    assert_eq!(
        result_on_n1(&d, job),
        want,
        "restarted with n3's part on n4"
    );
}

#[test]
fn a_lost_nodes_part_restarts_on_a_spare_from_the_shared_copy() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "nft");
    slow_variant!("openmpi_lost_nodes_part_restarts_on_a_spare_from_the_shared_copy");
    lost_node_restarts_on_n4(Mpi::Mpich, Replace::OnSpares);
}

#[test]
fn mpich_lost_nodes_part_restarts_on_another_node_from_a_third_nodes_partner_copy() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "nft");
    lost_node_restarts_on_n4(Mpi::Mpich, Replace::Map);
}

#[test]
fn openmpi_lost_nodes_part_restarts_on_a_spare_from_the_shared_copy() {
    skip_unless_ready!("mpirun.openmpi", "mpicc.openmpi", "nsenter", "nft");
    lost_node_restarts_on_n4(Mpi::OpenMpi, Replace::OnSpares);
}

#[test]
fn openmpi_lost_nodes_part_restarts_on_another_node_from_a_third_nodes_partner_copy() {
    skip_unless_ready!("mpirun.openmpi", "mpicc.openmpi", "nsenter", "nft");
    slow_variant!("mpich_lost_nodes_part_restarts_on_another_node_from_a_third_nodes_partner_copy");
    lost_node_restarts_on_n4(Mpi::OpenMpi, Replace::Map);
}

/// `ckptctl drain n2 --migrate` (a node reclaim) with a spare: the job is checkpointed and
/// stopped, restarted with n2's part on n4 at once, and finishes with the right answer.
#[test]
fn drain_migrates_a_nodes_part_to_the_spare_and_the_job_finishes_right() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "nft");
    slow_variant!("openmpi_drain_migrates_a_nodes_part_to_the_spare_and_the_job_finishes_right");
    drain_migrates(Mpi::Mpich);
}

#[test]
fn openmpi_drain_migrates_a_nodes_part_to_the_spare_and_the_job_finishes_right() {
    skip_unless_ready!("mpiexec.openmpi", "mpicc.openmpi", "nsenter", "nft");
    drain_migrates(Mpi::OpenMpi);
}

/// `drain n2 --migrate` of a job across n1..n3: checkpointed, its n2 part running again on the
/// spare n4 with its job address, nothing left on n2, and the job's answer right.
fn drain_migrates(mpi: Mpi) {
    let want = mpi.reference_checksum(RANKS, N, ITERS);
    let Some((_cluster, d, job)) = three_and_a_spare(mpi, true) else {
        return;
    };
    let (before, _) = part_of(&d.status(job), "n2").expect("a part on n2");
    let r = d.ctl(&["drain", "n2", "--migrate"]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout.contains(&format!(
            "job {job}: checkpointed to epoch 1, running again with its n2 part on n4"
        )),
        "{r:?}"
    );
    let st = d.status(job);
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(part_of(&st, "n4"), Some((before, "n2".to_string())), "{st}");
    let left: Vec<String> = d
        .job_pids_on("n2", job)
        .iter()
        .map(|p| {
            let cmd = std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let cg = std::fs::read_to_string(format!("/proc/{p}/cgroup")).unwrap_or_default();
            format!("{p} {} {}", cmd.replace('\0', " "), cg.trim())
        })
        .collect();
    assert!(left.is_empty(), "nothing of the job left on n2: {left:?}");
    assert_eq!(result_on_n1(&d, job), want, "finished on n1, n4, n3");
}

/// The launcher's node is destroyed while the job runs, after a checkpoint: its agent and the
/// job's processes killed, its sandbox, job directory (with the job's output) and staging gone.
/// The job, run with `[recovery] on_failure = "restart:2"`, is lost once n1 has been silent
/// for the node timeout and comes back by itself: the launcher's part on the spare n4 from the
/// partner copy n2 keeps, the others in place. n4's output begins with what the job had
/// printed by the checkpoint (carried by the epoch), the job finishes right, and its status
/// names the restart. Bad `--on-failure` values are refused first, each with its reason.
#[test]
fn the_launchers_node_destroyed_comes_back_on_the_spare_by_itself_with_its_output() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "nft");
    let mpi = Mpi::Mpich;
    let want = mpi.reference_checksum(RANKS, N, ITERS);
    let Some((_cluster, mut d, job)) =
        three_and_a_spare_with(mpi, false, "[recovery]\non_failure = \"restart:2\"\n")
    else {
        return;
    };
    for (policy, says) in [
        ("restart:0", "never restarts"),
        ("restart:-1", "cannot be negative"),
        ("restart:1000", "more than 100"),
        ("sometimes", "expected"),
    ] {
        let out = d.ctl(&["run", "--on-failure", policy, "--", "/bin/true"]);
        assert_eq!(out.code, 2, "{policy}: {out:?}");
        assert!(out.stderr.contains(says), "{policy}: {out:?}");
    }
    assert_eq!(d.status(job)["on_failure"], "restart:2");
    d.ctl(&["checkpoint", &job.to_string(), "--wait"]).ok();
    wait_copied(&d, job, false);
    let printed = std::fs::read_to_string(d.job_dir_on("n1", job).join("stdout")).unwrap();
    assert!(printed.contains("iter "), "{printed:?}");
    d.kill_agent_on("n1");
    d.kill_job_on(&["n1"], job);
    destroy_sandbox("n1", job);
    for gone in ["local", "state"] {
        std::fs::remove_dir_all(d.dir.path().join("n1").join(gone)).unwrap();
    }
    assert_eq!(
        result_on(&d, "n4", job),
        want,
        "restarted by itself with the launcher on n4"
    );
    let st = d.status(job);
    let r = &st["recoveries"][0];
    assert_eq!(r["trigger"], "node n1 lost", "{st}");
    assert_eq!(r["moves"], serde_json::json!(["n1=n4"]), "{st}");
    assert_eq!(r["epoch"], 1, "{st}");
    let text = std::fs::read_to_string(d.job_dir_on("n4", job).join("stdout")).unwrap();
    assert!(
        !text.contains('\0'),
        "the output before the checkpoint is back, not zeros"
    );
    let first = printed.lines().next().unwrap();
    assert!(
        text.starts_with(first),
        "n4's output begins as n1's did ({first:?}): {text:?}"
    );
}

/// What the matrix loses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// n1, where mpiexec runs.
    Launcher,
    /// n3, a node with ranks only.
    Attached,
}

/// How the matrix loses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Agent and processes killed, sandbox, job directory and staging deleted.
    Destroyed,
    /// Agent killed; the processes live on until the node's lease runs out.
    AgentKilled,
    /// Agent killed, then the part's processes end by themselves (an OOM kill, or the job's
    /// end) before the lease runs out: the node's sandbox is left to the part's shim.
    PartEnded,
    /// Host-side link down: nobody reaches the node, which runs on.
    LinkCut,
    /// `drain NODE --migrate`.
    Drain,
    /// `checkpoint --kill`, then `restart --map NODE=n4`.
    RestartMap,
}

/// One cell of the recovery matrix.
#[derive(Debug, Clone, Copy)]
struct Cell {
    mpi: Mpi,
    role: Role,
    fault: Fault,
    shared: bool,
    /// Epochs go through relays (`[relays] above = 2, fanout = 2`: n1 relays to n2, n3 is
    /// driven by ckptd).
    relayed: bool,
}

impl Cell {
    fn name(&self) -> String {
        format!(
            "{}/{:?}/{:?}/{}{}",
            match self.mpi {
                Mpi::Mpich => "mpich",
                Mpi::OpenMpi => "openmpi",
            },
            self.role,
            self.fault,
            if self.shared { "shared" } else { "partner" },
            if self.relayed { "/relayed" } else { "" }
        )
    }

    /// Every combination, in a fixed order.
    fn all() -> Vec<Cell> {
        let mut cells = Vec::new();
        for mpi in [Mpi::Mpich, Mpi::OpenMpi] {
            for role in [Role::Launcher, Role::Attached] {
                for fault in [
                    Fault::Destroyed,
                    Fault::AgentKilled,
                    Fault::PartEnded,
                    Fault::LinkCut,
                    Fault::Drain,
                    Fault::RestartMap,
                ] {
                    for shared in [false, true] {
                        for relayed in [false, true] {
                            cells.push(Cell {
                                mpi,
                                role,
                                fault,
                                shared,
                                relayed,
                            });
                        }
                    }
                }
            }
        }
        cells
    }
}

/// The cell CI runs, beside the tests above that are cells of their own (drain, restart
/// --map, the launcher's node destroyed, a link cut) and the soak's rounds (MPICH's launcher
/// node destroyed, an Open MPI attached node's agent killed): an Open MPI launcher moved after
/// its node's link was cut (its parts fenced by their lease; calls to it answered by nobody,
/// so the restart must not ask it), with shared storage, its epochs through relays (the
/// launcher's node was the relay); and an Open MPI launcher whose agent died and whose part
/// then ended by itself, moved with its partner copy (the soak found its restart hung: the
/// dead agent's sandbox still held the job address). `CKPT_FULL=1` adds an MPICH attached
/// node destroyed; `CKPT_MATRIX=full` runs all 96, `CKPT_MATRIX=NAME,NAME` the named ones.
const SLICE: [&str; 2] = [
    "openmpi/Launcher/LinkCut/shared/relayed",
    "openmpi/Launcher/PartEnded/partner",
];
/// The cell `CKPT_FULL=1` adds to [`SLICE`].
const FULL_SLICE: &str = "mpich/Attached/Destroyed/shared";

/// Runs one cell: a 6-rank job across n1..n3 launched from n1, `[recovery] on_failure =
/// "restart:2"`, n4 the spare. After a committed checkpoint whose copy is safe elsewhere (the
/// partner copy, or the shared one), the node is lost as the cell says; the job must end with
/// the answer of an uninterrupted run, nothing of it left running on the lost node, and every
/// epoch committed before still committed. Returns what happened, for the table.
fn run_cell(cell: Cell) -> String {
    let mpi = cell.mpi;
    let want = mpi.reference_checksum(RANKS, N, ITERS);
    // deadlines.sync far longer than a restart takes to begin: one that waited out a call to
    // the lost node shows (below).
    let relays = if cell.relayed {
        "[relays]\nabove = 2\nfanout = 2\n"
    } else {
        ""
    };
    let Some((cluster, mut d, job)) = three_and_a_spare_with(
        mpi,
        cell.shared,
        &format!("[recovery]\non_failure = \"restart:2\"\n[deadlines]\nsync = \"5m\"\n{relays}"),
    ) else {
        return "skipped".into();
    };
    let node = match cell.role {
        Role::Launcher => "n1",
        Role::Attached => "n3",
    };
    let id = job.to_string();
    let on_node = d.job_pids_on(node, job);
    assert!(!on_node.is_empty(), "a part on {node}");
    match cell.fault {
        Fault::Drain => {
            let r = d.ctl(&["drain", node, "--migrate"]);
            assert_eq!(r.code, 0, "{r:?}");
        }
        Fault::RestartMap => {
            let out = d.ctl(&["checkpoint", "--kill", &id]);
            assert!(out.ok().contains("committed"), "{out:?}");
            wait_copied(&d, job, cell.shared);
            let r = d.ctl(&["restart", &id, "--map", &format!("{node}=n4")]);
            assert_eq!(r.code, 0, "{r:?}");
        }
        fault => {
            d.ctl(&["checkpoint", &id, "--wait"]).ok();
            wait_copied(&d, job, cell.shared);
            match fault {
                Fault::Destroyed => {
                    d.kill_agent_on(node);
                    d.kill_job_on(&[node], job);
                    destroy_sandbox(node, job);
                    for gone in ["local", "state"] {
                        std::fs::remove_dir_all(d.dir.path().join(node).join(gone)).unwrap();
                    }
                }
                Fault::AgentKilled => d.kill_agent_on(node),
                Fault::PartEnded => {
                    d.kill_agent_on(node);
                    d.kill_job_on(&[node], job);
                    assert_unplugged(node, job);
                }
                Fault::LinkCut => cluster.set_link(node, false),
                _ => unreachable!(),
            }
        }
    }
    let committed = committed_epochs(&d, job);
    if cell.relayed {
        let log = std::fs::read_to_string(d.dir.path().join("ckptd.log")).unwrap_or_default();
        assert!(
            log.contains("the epoch goes through relays: n1 (2 nodes)"),
            "the checkpoint went through n1 as a relay: {}",
            log.lines().rev().take(20).collect::<Vec<_>>().join("\n")
        );
    }
    let launcher = if cell.role == Role::Launcher {
        "n4"
    } else {
        "n1"
    };
    assert_eq!(result_on(&d, launcher, job), want, "the answer");
    let st = d.status(job);
    let how = if matches!(
        cell.fault,
        Fault::Destroyed | Fault::AgentKilled | Fault::PartEnded | Fault::LinkCut
    ) {
        let r = &st["recoveries"][0];
        assert_eq!(r["trigger"], format!("node {node} lost"), "{st}");
        assert_eq!(
            r["moves"],
            serde_json::json!([format!("{node}=n4")]),
            "{st}"
        );
        // Begun at once, not after a call to the lost node (which answers nothing when its
        // link is cut) waited out its deadline.
        let waited = r["at_unix_ms"].as_u64().unwrap() - r["noticed_unix_ms"].as_u64().unwrap();
        assert!(
            waited < 60_000,
            "the restart began {waited} ms after the loss was noticed: {st}"
        );
        "restarted by itself"
    } else {
        "restarted by hand"
    };
    if cell.fault == Fault::LinkCut {
        cluster.set_link(node, true);
        std::thread::sleep(Duration::from_secs(2));
    }
    let left: Vec<i32> = on_node
        .iter()
        .copied()
        .filter(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
        .collect();
    assert!(left.is_empty(), "{node} still runs {left:?}");
    assert!(d.job_pids_on(node, job).is_empty(), "{node} runs a part");
    assert_still_committed(&d, job, &committed, &cell.name());
    format!(
        "right answer, {how}, {} committed epochs kept",
        committed.len()
    )
}

/// Waits (bounded) until the sandbox of `job` on `node` has no job interface up: a part that
/// ended with its agent dead takes its job address off the network by itself (its shim does),
/// or the address and MAC its next incarnation holds elsewhere are answered for twice.
fn assert_unplugged(node: &str, job: u64) {
    let ns = format!("ckpt-{node}-{job}");
    let begin = Instant::now();
    loop {
        let out = std::process::Command::new("ip")
            .args(["-n", &ns, "-o", "link", "show", "dev", "eth0"])
            .output()
            .unwrap();
        let link = String::from_utf8_lossy(&out.stdout).into_owned();
        let flags = link.split(['<', '>']).nth(1).unwrap_or_default();
        if !out.status.success() || !flags.split(',').any(|f| f == "UP") {
            return;
        }
        assert!(
            begin.elapsed() < Duration::from_secs(10),
            "{node}'s part ended with its agent dead, but its sandbox still has its job interface up: {link}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// {MPICH, Open MPI} × {launcher's node, attached node} × {destroyed, agent killed, part ended,
/// link cut, drain --migrate, restart --map} × {partner copy, shared storage} × {flat, through
/// relays}. Prints a table of every cell run; fails if any failed.
#[test]
fn recovery_matrix() {
    if let Some(why) = ckpt_tests::skip_reason(&BOTH_MPIS) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let asked = std::env::var("CKPT_MATRIX").unwrap_or_default();
    let cells: Vec<Cell> = Cell::all()
        .into_iter()
        .filter(|c| match asked.as_str() {
            "full" => true,
            "" => {
                SLICE.contains(&c.name().as_str()) || (ckpt_tests::full() && c.name() == FULL_SLICE)
            }
            names => names.split(',').any(|n| n == c.name()),
        })
        .collect();
    let mut rows = Vec::new();
    for cell in cells {
        let begin = Instant::now();
        let what = outcome(std::panic::catch_unwind(|| run_cell(cell)));
        let row = format!(
            "| {} | {} | {:.0} s |",
            cell.name(),
            what,
            begin.elapsed().as_secs_f64()
        );
        eprintln!("{row}");
        rows.push(row);
    }
    println!(
        "| cell | outcome | took |\n|---|---|---|\n{}",
        rows.join("\n")
    );
    assert!(
        rows.iter().all(|r| !r.contains("FAILED")),
        "{}",
        rows.join("\n")
    );
}
