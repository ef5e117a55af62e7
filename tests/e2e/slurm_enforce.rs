//! End-to-end tests of `[slurm] enforce` with a real Slurm (slurmctld, a slurmd on each of 2
//! test hosts, munge): agents run parts only for users Slurm gave the node, and put them into
//! the user's Slurm job there (`adopt`), where Slurm tracks them and `scancel` stops them.
use std::time::{Duration, Instant};

use ckpt_tests::netns::Cluster;
use ckpt_tests::slurm::Slurm;
use ckpt_tests::{bin_dir, skip_unless_ready, Ckptd, Options, NOBODY};

const LIMIT: Duration = Duration::from_secs(180);

fn read(p: &std::path::Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// Agents with `[slurm] enforce`: a user without a Slurm job on a node is refused there, with
/// a message naming Slurm; the same user's batch job on n2 runs a program there under ckpt,
/// and from it a part on n1, outside its allocation, is refused. A restart is held to the same
/// rule as a launch.
#[test]
fn enforcing_agents_run_parts_only_for_users_slurm_gave_the_node() {
    use std::os::unix::fs::chown;
    skip_unless_ready!("nsenter");
    if let Some(why) = Cluster::unavailable().or_else(Slurm::unavailable) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let cluster = Cluster::create(2).expect("create test hosts");
    let mut d = Ckptd::start(Options {
        no_agent: true,
        ..Options::default()
    });
    d.open_to_users();
    let slurm_dir = d.dir.path().join("slurm");
    let gate = format!(
        "[slurm]\nenforce = true\nconf = \"{}\"\n",
        slurm_dir.join("slurm.conf").display()
    );
    for n in ["n1", "n2"] {
        d.start_agent_in_with(&cluster, n, &gate);
    }
    d.wait_agents(&["n1", "n2"]);
    let slurm = Slurm::start(&cluster, &slurm_dir).expect("start Slurm");
    let ctl = bin_dir().join("ckptctl");

    // No Slurm job: refused on n2, nothing started.
    let refused = d.ctl_as(NOBODY, &["run", "--node", "n2", "--", "/bin/sleep", "30"]);
    assert_eq!(refused.code, 5, "refused as a permission: {refused:?}");
    for word in ["node n2", "Slurm", "uid 65534 has none there", "sbatch"] {
        assert!(refused.stderr.contains(word), "{word}: {refused:?}");
    }
    let jobs: Vec<serde_json::Value> =
        serde_json::from_str(d.ctl(&["list", "--json"]).ok()).unwrap();
    assert!(
        jobs.iter().all(|j| j["state"] != "running"),
        "nothing runs: {jobs:?}"
    );

    // A batch job of the same user on n2: admitted there, not on n1.
    let work = tempfile::Builder::new()
        .prefix("ckpt-slurm-user-")
        .tempdir()
        .unwrap();
    chown(work.path(), Some(NOBODY), Some(NOBODY)).unwrap();
    let out = work.path().join("batch.out");
    let script = format!(
        "{ctl} --socket {s} run --wait --node n2 -- /bin/echo admitted; echo \"n2: $?\"; \
         {ctl} --socket {s} run --node n1 -- /bin/true; echo \"n1: $?\"",
        ctl = ctl.display(),
        s = d.socket.display(),
    );
    let id = sbatch_as_nobody_on_n2(&slurm, &out, work.path(), &script);
    slurm.wait_job(id, "COMPLETED", LIMIT);
    let text = read(&out);
    assert!(text.contains("n2: 0"), "admitted on n2: {text}");
    assert!(text.contains("started on node n2"), "{text}");
    assert!(text.contains("n1: 5"), "refused on n1 (permission): {text}");
    assert!(
        text.contains("node n1 runs jobs only for users with a running Slurm job on it"),
        "{text}"
    );

    // Inside the Slurm job (`adopt`): Slurm tracks the part among the job's processes, and
    // `scancel` stops it as it stops any of them.
    if ckpt_tests::slurm::adoption_here() {
        scancel_stops_an_adopted_part(&cluster, &d, &slurm, work.path());
    }

    // A restart passes the same gate: root's program, started from root's batch job on n2 and
    // stopped by a checkpoint, is refused on n2 once that batch job ended (root is held to
    // the rule too), and restarts from root's next batch job there.
    let root_batch = |name: &str, script: String| {
        let out = work.path().join(name);
        let o = slurm
            .command("sbatch")
            .args(["--parsable", "-N1", "-w", "n2", "-o"])
            .arg(&out)
            .args(["--wrap", &script])
            .output()
            .expect("sbatch");
        let id: u64 = String::from_utf8_lossy(&o.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("sbatch as root: {o:?}"));
        slurm.wait_job(id, "COMPLETED", LIMIT);
        read(&out)
    };
    let ckptctl = format!("{} --socket {}", ctl.display(), d.socket.display());
    let text = root_batch(
        "root-1.out",
        format!(
            "J=$({ckptctl} run --node n2 -- /bin/sleep 300) && echo job=$J && \
             {ckptctl} checkpoint $J --kill; echo \"stopped: $?\""
        ),
    );
    assert!(text.contains("stopped: 0"), "{text}");
    let job = text
        .lines()
        .find_map(|l| l.strip_prefix("job="))
        .unwrap_or_else(|| panic!("no job id: {text}"))
        .to_string();
    let refused = d.ctl(&["restart", &job]);
    assert_eq!(
        refused.code, 5,
        "restart refused as a permission: {refused:?}"
    );
    assert!(
        refused.stderr.contains("node n2") && refused.stderr.contains("Slurm"),
        "{refused:?}"
    );
    let text = root_batch(
        "root-2.out",
        format!("{ckptctl} restart {job}; echo \"restarted: $?\"; {ckptctl} cancel {job}"),
    );
    assert!(text.contains("restarted: 0"), "{text}");
}

/// Submits `script` as nobody's batch job on n2, its output to `out`, run in `work`; its id.
fn sbatch_as_nobody_on_n2(
    slurm: &Slurm,
    out: &std::path::Path,
    work: &std::path::Path,
    script: &str,
) -> u64 {
    let mut sbatch = slurm.command("sbatch");
    sbatch
        .args(["--parsable", "-N1", "-w", "n2", "-o"])
        .arg(out)
        .arg("-D")
        .arg(work)
        .args(["--wrap", script]);
    ckpt_tests::as_user(&mut sbatch, NOBODY);
    let o = sbatch.output().expect("sbatch");
    String::from_utf8_lossy(&o.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("sbatch as nobody: {o:?}"))
}

/// A part started from nobody's batch job on n2, inside that Slurm job: Slurm tracks it among
/// the job's processes, and `scancel` of the batch job stops it.
fn scancel_stops_an_adopted_part(
    cluster: &Cluster,
    d: &Ckptd,
    slurm: &Slurm,
    work: &std::path::Path,
) {
    let ctl = bin_dir().join("ckptctl");
    let adopted_out = work.join("adopted.out");
    let script = format!(
        "J=$({ctl} --socket {s} run --node n2 -- /bin/sleep 301) && echo job=$J; \
         {ctl} --socket {s} run --node n2 -- /bin/sleep 302; echo \"second: $?\"; sleep 600",
        ctl = ctl.display(),
        s = d.socket.display(),
    );
    let held = sbatch_as_nobody_on_n2(slurm, &adopted_out, work, &script);
    let begin = Instant::now();
    let adopted = loop {
        if let Some(j) = read(&adopted_out)
            .lines()
            .find_map(|l| l.strip_prefix("job="))
        {
            break j.to_string();
        }
        assert!(begin.elapsed() < LIMIT, "no job: {}", read(&adopted_out));
        std::thread::sleep(Duration::from_millis(200));
    };
    slurm.tracks(cluster, "n2", held, "sleep 301");
    // A second ckpt job in the same Slurm job's step there is refused: a checkpoint of either
    // would freeze the other.
    let begin = Instant::now();
    while !read(&adopted_out).contains("second: ") {
        assert!(begin.elapsed() < LIMIT, "{}", read(&adopted_out));
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = read(&adopted_out);
    assert!(!text.contains("second: 0"), "{text}");
    assert!(
        text.contains(&format!(
            "ckpt job {adopted} already runs in Slurm job {held}'s extern step"
        )),
        "{text}"
    );
    slurm.run_ok("scancel", &[&held.to_string()]);
    slurm.wait_job(held, "CANCELLED", LIMIT);
    let begin = Instant::now();
    while d.status(adopted.parse().unwrap())["state"] == "running" {
        assert!(
            begin.elapsed() < LIMIT,
            "scancel did not stop job {adopted}'s part"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
