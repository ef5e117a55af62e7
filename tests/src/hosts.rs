//! Jobs across test hosts: the hosts with their agents, a job started on one of them, its
//! result, and what a lost node leaves behind.
use std::time::{Duration, Instant};

use crate::netns::Cluster;
use crate::{checksum_in, Ckptd, Options};

/// How long a step of a job across test hosts may take.
pub const LIMIT: Duration = Duration::from_secs(120);

/// What a test of both MPI libraries across test hosts needs.
pub const BOTH_MPIS: [&str; 6] = [
    "mpiexec.mpich",
    "mpicc.mpich",
    "mpiexec.openmpi",
    "mpicc.openmpi",
    "nsenter",
    "nft",
];

/// The most test hosts these tests use.
const ALL: [&str; 4] = ["n1", "n2", "n3", "n4"];

/// `nodes` test hosts with their agents; with `shared_size`, a shared file system for all.
pub fn hosts_with(
    nodes: &[&str],
    failpoints: bool,
    job_network: bool,
    shared_size: Option<&str>,
    more_toml: &str,
) -> Option<(Cluster, Ckptd)> {
    hosts_with_agents(
        nodes,
        failpoints,
        job_network,
        shared_size,
        more_toml,
        |_| String::new(),
    )
}

/// [`hosts_with`], with `agent_toml(ckptd)` (TOML tables) in every agent's agent.toml.
pub fn hosts_with_agents(
    nodes: &[&str],
    failpoints: bool,
    job_network: bool,
    shared_size: Option<&str>,
    more_toml: &str,
    agent_toml: impl Fn(&Ckptd) -> String,
) -> Option<(Cluster, Ckptd)> {
    if let Some(why) = Cluster::unavailable() {
        eprintln!("SKIPPED: {why}");
        return None;
    }
    let cluster = Cluster::create(nodes.len()).expect("create test hosts");
    let subnet = cluster
        .host_ip
        .rsplit_once('.')
        .expect("IPv4")
        .0
        .to_string();
    let mut d = Ckptd::start(Options {
        no_agent: true,
        failpoints,
        extra_toml: if job_network {
            format!("{more_toml}[job_network]\naddresses = \"{subnet}.150-{subnet}.199\"\nprefix = 24\n")
        } else {
            more_toml.to_string()
        },
        shared_size: shared_size.map(str::to_string),
        ..Options::default()
    });
    let tables = agent_toml(&d);
    for n in nodes {
        d.start_agent_in_with(&cluster, n, &tables);
    }
    d.wait_agents(nodes);
    Some((cluster, d))
}

/// Starts the heat program with `(ranks, n, iters, sleep_us)` over the first `nodes` test hosts
/// of `cluster`, launched from n1, and waits (bounded) until it prints progress.
pub fn heat_on_first(
    d: &Ckptd,
    cluster: &Cluster,
    nodes: usize,
    mpi: crate::Mpi,
    (ranks, n, iters, sleep_us): (u32, u32, u32, u32),
) -> u64 {
    let hosts: Vec<&str> = cluster.nodes[..nodes]
        .iter()
        .map(|n| n.netns.as_str())
        .collect();
    run_on(
        d,
        "n1",
        &mpi.heat_argv_on(&hosts, ranks, n, iters, sleep_us),
    )
}

/// A matrix cell's outcome, for its row of the table: `ok: ` and what it returned, or `FAILED: `
/// and the first line of its panic (200 characters at most).
pub fn outcome(r: std::thread::Result<String>) -> String {
    match r {
        Ok(s) => format!("ok: {s}"),
        Err(e) => format!(
            "FAILED: {}",
            e.downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
                .lines()
                .next()
                .unwrap_or_default()
                .chars()
                .take(200)
                .collect::<String>()
        ),
    }
}

/// Starts a job from `node` and waits (bounded) until it prints progress.
pub fn run_on(d: &Ckptd, node: &str, argv: &[String]) -> u64 {
    let mut args = vec!["run", "--name", "heat", "--node", node, "--"];
    args.extend(argv.iter().map(String::as_str));
    let job: u64 = d.ctl(&args).ok().trim().parse().unwrap();
    let out_file = d.job_dir_on(node, job).join("stdout");
    let begin = Instant::now();
    while !std::fs::read_to_string(&out_file)
        .unwrap_or_default()
        .contains("iter ")
    {
        assert!(
            begin.elapsed() < LIMIT,
            "no progress: {}",
            std::fs::read_to_string(d.job_dir_on(node, job).join("stderr")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    job
}

/// Waits (bounded) for the job's result printed by its launcher, then for its end. The
/// launcher is where the job's status says it runs (`node` until it says). MPICH over UCX/TCP
/// sometimes hangs in `MPI_Finalize` after the result is printed, with or without checkpoints
/// (UCX issue 8738): a job still running 8 s after its result (a clean exit takes under a
/// second) is cancelled, which must end it on every node.
pub fn result_on(d: &Ckptd, node: &str, job: u64) -> String {
    result_and_end(d, node, job, Duration::from_secs(8)).0
}

/// The node a job's launcher runs on, by its status `st`; `fallback` if it names none.
fn launcher_in(st: &serde_json::Value, fallback: &str) -> String {
    st["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["role"] == "launcher")
        .and_then(|n| n["node"].as_str())
        .unwrap_or(fallback)
        .to_string()
}

/// [`result_on`], waiting `patience` for the end after the result, and whether the job hung
/// after its result and was cancelled.
///
/// A result is not the end: a job whose launcher has printed its result but not exited is
/// still running, and a node lost then restarts it from its last epoch, which takes the
/// printed result back (its output is restored to what it was at that epoch). So this waits
/// for the job to stop being active, counting `patience` from when a result was last seen
/// with the job running, and reads the result the job ended with.
pub fn result_and_end(d: &Ckptd, node: &str, job: u64, patience: Duration) -> (String, bool) {
    let begin = Instant::now();
    let mut printed: Option<Instant> = None;
    loop {
        let st = d.status(job);
        let state = st["state"].as_str().unwrap_or_default().to_string();
        // A job that failed and is about to restart by itself is not over either.
        let active = st["recovering"] == true
            || matches!(
                state.as_str(),
                "starting" | "running" | "checkpointing" | "restarting"
            );
        let launcher = launcher_in(&st, node);
        let out = std::fs::read_to_string(d.job_dir_on(&launcher, job).join("stdout"));
        let sum = checksum_in(&out.unwrap_or_default());
        if !active {
            let sum = sum.unwrap_or_else(|| {
                panic!(
                    "the job ended ({state}) without a result: {st}\n{}",
                    d.job_output_on(&launcher, job)
                )
            });
            return (sum, false);
        }
        match (&sum, state.as_str()) {
            (Some(_), "running" | "checkpointing") => {
                let since = *printed.get_or_insert_with(Instant::now);
                if since.elapsed() > patience {
                    eprintln!("job {job} printed its result but did not exit; cancelling it");
                    d.ctl(&["cancel", &job.to_string()]).ok();
                    for n in ALL {
                        assert!(
                            d.job_pids_on(n, job).is_empty(),
                            "cancel left processes on {n}"
                        );
                    }
                    return (sum.unwrap_or_default(), true);
                }
            }
            _ => printed = None,
        }
        assert!(
            begin.elapsed() < 2 * LIMIT,
            "no result and end after {:?}: {st}\n{}",
            2 * LIMIT,
            d.job_output_on(&launcher, job)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits (bounded) until the job's first epoch has a copy on another node than each of its
/// own: in shared storage (`shared`), else its partner copies.
pub fn wait_copied(d: &Ckptd, job: u64, shared: bool) {
    let begin = Instant::now();
    let (key, want) = if shared {
        ("storage", serde_json::json!("durable"))
    } else {
        ("partner_copy", serde_json::json!(true))
    };
    while d.epochs(job)[0][key] != want {
        assert!(begin.elapsed() < LIMIT, "no {key}: {}", d.epochs(job)[0]);
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A node's sandbox of the job gone as with the node: its job interface (which sockets of
/// the killed processes would otherwise keep on the network) and its namespace.
pub fn destroy_sandbox(node: &str, job: u64) {
    let name = format!("ckpt-{node}-{job}");
    for args in [
        vec!["-n", name.as_str(), "link", "del", "eth0"],
        vec!["netns", "del", name.as_str()],
    ] {
        let _ = std::process::Command::new("ip").args(&args).status();
    }
}

/// The job's committed epochs now (at least one, or it panics).
pub fn committed_epochs(d: &Ckptd, job: u64) -> Vec<u64> {
    let committed: Vec<u64> = d
        .epochs(job)
        .iter()
        .filter(|e| e["state"] == "committed")
        .map(|e| e["epoch"].as_u64().unwrap())
        .collect();
    assert!(!committed.is_empty(), "a committed epoch");
    committed
}

/// Panics, naming `what` happened, if an epoch of `committed` is not committed any more.
pub fn assert_still_committed(d: &Ckptd, job: u64, committed: &[u64], what: &str) {
    for e in d.epochs(job) {
        let n = e["epoch"].as_u64().unwrap();
        if committed.contains(&n) {
            assert_eq!(e["state"], "committed", "{what}: epoch {n} lost: {e}");
        }
    }
}
