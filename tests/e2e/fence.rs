//! The fence matrix: a fence kills only what may move. An MPICH job (and with `CKPT_FULL=1` an
//! Open MPI one too, the flavour of the first report) across three test hosts
//! (n4 a spare, `node_timeout` 2 s, so a lease of 1 s), with and without a restart policy,
//! meets an outage of ckptd or of a node's link:
//!
//! - **ckptd stopped** (SIGSTOP) for three leases, then continued;
//! - **ckptd slowed**: stopped for 0.7 of a lease in every second, eight times, beside two
//!   processes spinning on the CPU (the machine's two cores busy);
//! - **a link cut**: n3's host-side link down (neither ckptd nor the other nodes reach it),
//!   for twice `node_timeout` without a policy, until the job restarted with one.
//!
//! Without a restart policy no part is ever killed: the original processes all live after the
//! outage, no node wrote `fenced.json`, nothing was restarted, and the job ends with the
//! answer of an uninterrupted run. With one, the job ends with that answer too, and if a part
//! was fenced and restarted, every original process was dead before the restored parts ran
//! (the last seen gone, looked at every 5 ms, against the restart's `running_unix_ms`), and a
//! cut-off node's part before ckptd declared the node lost: no part ran in two copies. Each cell prints what happened, with its times, for the table.
use std::time::{Duration, Instant};

use ckpt_tests::hosts::{heat_on_first, hosts_with, outcome, result_on, wait_copied, LIMIT};
use ckpt_tests::netns::Cluster;
use ckpt_tests::{skip_unless_ready, Ckptd, Mpi};

const NODES: [&str; 3] = ["n1", "n2", "n3"];
const RANKS: u32 = 6;
const N: u32 = 256;
/// Long enough (about 12 s of sleeps alone) to span the outage and a checkpoint before it.
const ITERS: u32 = 6000;
const SLEEP_US: u32 = 2000;

/// What happens to ckptd or to a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outage {
    Stopped,
    Slowed,
    LinkCut,
}

/// Four test hosts, the job on n1..n3, launched from n1; with `policy`, `[recovery]
/// on_failure = "restart:2"`.
fn cluster_and_job(policy: bool, mpi: Mpi) -> Option<(Cluster, Ckptd, u64)> {
    let recovery = if policy {
        "[recovery]\non_failure = \"restart:2\"\nbackoff = \"1s\"\n"
    } else {
        ""
    };
    let (cluster, d) = hosts_with(
        &["n1", "n2", "n3", "n4"],
        false,
        true,
        None,
        &format!("node_timeout = \"2s\"\n{recovery}[spares]\nnodes = [\"n4\"]\n"),
    )?;
    let job = heat_on_first(&d, &cluster, 3, mpi, (RANKS, N, ITERS, SLEEP_US));
    Some((cluster, d, job))
}

/// Now, in ms since the Unix epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn alive(pids: &[i32]) -> usize {
    pids.iter()
        .filter(|&&p| std::path::Path::new(&format!("/proc/{p}")).exists())
        .count()
}

/// The parts' run directories that hold `fenced.json`, on every node.
fn fenced(d: &Ckptd, job: u64) -> Vec<String> {
    let mut out = Vec::new();
    for n in NODES {
        let run = d.job_dir_on(n, job).join("run");
        for e in std::fs::read_dir(&run).into_iter().flatten().flatten() {
            if e.path().join("fenced.json").exists() {
                out.push(format!("{n}:{}", e.file_name().to_string_lossy()));
            }
        }
    }
    out
}

/// Two processes spinning on the CPU until dropped.
struct Hogs(Vec<std::process::Child>);

impl Hogs {
    fn start() -> Self {
        Hogs(
            (0..2)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .expect("spawn a CPU hog")
                })
                .collect(),
        )
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One cell; returns its row of the table.
fn cell(outage: Outage, policy: bool, mpi: Mpi) -> String {
    let want = mpi.reference_checksum(RANKS, N, ITERS);
    let Some((cluster, d, job)) = cluster_and_job(policy, mpi) else {
        return "skipped".into();
    };
    let id = job.to_string();
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    wait_copied(&d, job, false);
    let before: Vec<i32> = NODES.iter().flat_map(|n| d.job_pids_on(n, job)).collect();
    assert_eq!(
        alive(&before),
        before.len(),
        "every part runs before the outage"
    );
    // When the last of the original processes is gone, and the last of n3's (ms since the
    // Unix epoch).
    let watch = |pids: Vec<i32>| {
        let begin = Instant::now();
        std::thread::spawn(move || {
            while alive(&pids) > 0 && begin.elapsed() < LIMIT {
                std::thread::sleep(Duration::from_millis(5));
            }
            (alive(&pids) == 0).then(now_ms)
        })
    };
    let watcher = watch(before.clone());
    let n3_watcher = watch(d.job_pids_on("n3", job));
    let outage_ms = now_ms();
    let mut seen = String::new();
    match outage {
        Outage::Stopped => {
            d.signal_daemon(false, libc::SIGSTOP);
            std::thread::sleep(Duration::from_secs(3));
            d.signal_daemon(false, libc::SIGCONT);
        }
        Outage::Slowed => {
            let _hogs = Hogs::start();
            for _ in 0..8 {
                d.signal_daemon(false, libc::SIGSTOP);
                std::thread::sleep(Duration::from_millis(700));
                d.signal_daemon(false, libc::SIGCONT);
                std::thread::sleep(Duration::from_millis(300));
            }
        }
        Outage::LinkCut if !policy => {
            cluster.set_link("n3", false);
            std::thread::sleep(Duration::from_secs(4));
            // ckptd hears nothing from n3, and says so, but the job is not lost.
            let st = d.status(job);
            cluster.set_link("n3", true);
            assert_eq!(st["state"], "running", "{st}");
            assert_eq!(st["unreachable"][0]["node"], "n3", "{st}");
            assert!(
                st["detail"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("not fenced"),
                "{st}"
            );
            seen = ", status said n3 unreachable".into();
        }
        Outage::LinkCut => {
            cluster.set_link("n3", false);
            let cut = Instant::now();
            while d.status(job)["recoveries"][0]["outcome"]
                .as_str()
                .is_none_or(|o| o == "restoring")
            {
                assert!(cut.elapsed() < LIMIT, "not restarted: {}", d.status(job));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    let after_outage = alive(&before);
    if !policy {
        assert_eq!(
            after_outage,
            before.len(),
            "{outage:?} without a restart policy killed a part: {}",
            d.status(job)
        );
    }
    let answer = result_on(&d, "n1", job);
    if outage == Outage::LinkCut && policy {
        // The link comes back: n3's agent reports the fenced part and starts nothing.
        cluster.set_link("n3", true);
        std::thread::sleep(Duration::from_secs(2));
        assert!(d.job_pids_on("n3", job).is_empty(), "n3 runs a part again");
    }
    let st = d.status(job);
    let restarts = st["recoveries"].as_array().cloned().unwrap_or_default();
    let fences = fenced(&d, job);
    assert_eq!(answer, want, "{outage:?}, policy {policy}: {st}");
    let row = if !policy {
        assert!(restarts.is_empty(), "restarted: {st}");
        assert!(fences.is_empty(), "fenced: {fences:?}");
        format!("not killed, no restart, right answer{seen}")
    } else if let Some(r) = restarts.first() {
        let dead = watcher.join().unwrap().expect("the original parts died");
        let n3_dead = n3_watcher.join().unwrap().expect("n3's part died");
        let began = r["at_unix_ms"].as_u64().unwrap();
        let running = r["running_unix_ms"].as_u64().unwrap();
        let noticed = r["noticed_unix_ms"].as_u64().unwrap_or(0);
        // The restored parts are held frozen until every node is restored, and released
        // together: none of them runs before then. (The watcher sees a death up to 5 ms late,
        // and the kill of the surviving nodes' parts comes just before the restart begins.)
        assert!(
            dead < running,
            "an original process lived at {dead}, after the restored parts ran at {running}: {st}"
        );
        let cut = if outage == Outage::LinkCut {
            // The order that matters: n3's part was dead before ckptd declared n3 lost, so
            // before anything of it could be restored elsewhere.
            assert!(
                n3_dead < noticed,
                "n3's part died at {n3_dead}, after ckptd declared it lost at {noticed}"
            );
            format!(
                "; n3's part dead {} ms into the cut, n3 declared lost at {} ms",
                n3_dead - outage_ms,
                noticed - outage_ms
            )
        } else {
            String::new()
        };
        format!(
            "fenced {} part(s), {} restart(s) ({}), right answer; every original dead {} ms into the outage, {} ms before the restart began, {} ms before the restored parts ran{cut}",
            fences.len(),
            restarts.len(),
            r["trigger"].as_str().unwrap_or_default(),
            dead as i64 - outage_ms as i64,
            began as i64 - dead as i64,
            running as i64 - dead as i64
        )
    } else {
        assert!(fences.is_empty(), "fenced but not restarted: {fences:?}");
        "not fenced, no restart, right answer".into()
    };
    eprintln!("fence cell {mpi:?} {outage:?} / policy {policy}: {row}");
    row
}

/// Every outage × with and without a restart policy, all six run; prints the table.
#[test]
fn a_fence_kills_only_what_may_move() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "nft");
    let mut flavours = vec![Mpi::Mpich];
    if ckpt_tests::full() && ckpt_tests::skip_reason(&["mpirun.openmpi", "mpicc.openmpi"]).is_none()
    {
        flavours.push(Mpi::OpenMpi);
    }
    let mut rows = Vec::new();
    for (mpi, outage, policy) in flavours.iter().flat_map(|m| {
        [Outage::Stopped, Outage::Slowed, Outage::LinkCut]
            .into_iter()
            .flat_map(move |o| [false, true].map(|p| (*m, o, p)))
    }) {
        {
            let begin = Instant::now();
            let what = outcome(std::panic::catch_unwind(|| cell(outage, policy, mpi)));
            rows.push(format!(
                "{:<8} {:<8} {:<10} {:>4.0} s  {what}",
                format!("{mpi:?}"),
                format!("{outage:?}"),
                if policy { "restart:2" } else { "none" },
                begin.elapsed().as_secs_f64()
            ));
        }
    }
    eprintln!("fence matrix (MPI, outage, policy, time, outcome):");
    for r in &rows {
        eprintln!("  {r}");
    }
    assert!(
        rows.iter().all(|r| r.contains(" ok: ")),
        "{}",
        rows.join("\n")
    );
}
