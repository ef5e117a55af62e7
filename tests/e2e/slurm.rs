//! End-to-end tests with a real Slurm (slurmctld, a slurmd on each of 3 test hosts, munge)
//! and ckpt agents beside the slurmds: a batch job runs an MPI program across its allocation
//! under ckpt with docs/slurm.md's batch script; Slurm takes the nodes away (`scontrol requeue`, or a
//! job of a higher-priority partition that preempts it by requeueing); the job is checkpointed
//! on the signal, requeued, resumes from its checkpoint and finishes with the checksum of an
//! uninterrupted run. When Slurm gives the requeued job other nodes (one of its first ones
//! taken by the preempting job and drained), a job that runs in sandboxes resumes on its new
//! allocation; there the agents enforce Slurm's allocations and put every part into the Slurm
//! job (`[slurm] adopt`), so Slurm tracks, accounts for and may kill its processes, and the
//! preemption warns the batch script first (a grace time and `preempt_send_user_signal`). The
//! one-line script (`exec ckptctl run --slurm`), warned of its time limit, requeues itself.
use std::time::{Duration, Instant};

use ckpt_tests::hosts::hosts_with_agents;
use ckpt_tests::netns::Cluster;
use ckpt_tests::slurm::Slurm;
use ckpt_tests::{apps, bin_dir, checksum_in, slow_variant, Ckptd, Mpi, Options, NOBODY};

const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// With a fourth node for the requeued job to move to.
const FOUR: [&str; 4] = ["n1", "n2", "n3", "n4"];
const RANKS: u32 = 6;
const N: u32 = 256;
const ITERS: u32 = 3000;
/// ~20 s uninterrupted.
const SLEEP_US: u32 = 6000;
const LIMIT: Duration = Duration::from_secs(180);

/// How Slurm takes the nodes away.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Preemption {
    /// `scontrol requeue JOB`.
    Requeue,
    /// A job of the `high` partition wants every node (the one-line script).
    HigherPriorityJob,
    /// A job of the `high` partition wants n1, which is then drained: the agents adopt the
    /// parts into the Slurm job, so Slurm's kill would reach them; `low` has a grace time and
    /// Slurm sends the batch script its `--signal` (USR1) at the preemption
    /// (`preempt_send_user_signal`): ckptctl checkpoints and stops the job, the script
    /// requeues it, and Slurm gives it n2, n3 and n4 (the job runs in sandboxes, on a job
    /// network).
    RequeueOntoOtherNodes,
    /// The one-line batch script (`exec ckptctl run --slurm`) warned of its time limit: USR1
    /// to the batch shell, as `#SBATCH --signal=B:USR1@60` sends it (`scancel --batch
    /// --signal=USR1`). ckptctl checkpoints and stops the job, then asks Slurm itself to
    /// requeue the batch job.
    TimeLimitWarning,
    /// The one-line script's ckptctl killed outright (SIGKILL to the batch shell): the batch
    /// job fails, and Slurm's epilog (`ckptctl slurm-epilog`) checkpoints and stops the
    /// program it left running.
    BatchKilled,
    /// The one-line script's batch job cancelled (`scancel`): TERM, as for a preemption, so
    /// the program is checkpointed and stopped; ckptctl asks for no requeue, and the batch job
    /// ends.
    Cancelled,
}

impl Preemption {
    /// Whether the batch script is the one-line `run --slurm`.
    fn one_line(self) -> bool {
        matches!(
            self,
            Preemption::TimeLimitWarning
                | Preemption::Cancelled
                | Preemption::HigherPriorityJob
                | Preemption::BatchKilled
        )
    }
}

/// The batch script; MPI's hosts are the allocation's `field` (`NodeAddr`, or
/// `NodeHostName` for a job in sandboxes: each sandbox keeps its node's host name, and
/// ckpt-rsh finds the node a part runs on now). docs/slurm.md's long script, or its one line
/// (`run --slurm`), with a time limit for the deadline it derives.
fn batch_script(d: &Ckptd, field: &str, one_line: bool) -> String {
    if one_line {
        return format!(
            r#"#!/bin/bash
#SBATCH --job-name=heat
#SBATCH --nodes=3
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --time=30
#SBATCH --signal=B:USR1@60
hosts=$(for h in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
          scontrol show node "$h" | sed -n 's/.*{field}=\([^ ]*\).*/\1/p'
        done | paste -sd,)
echo "batch run ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST"
exec {ctl} --socket {socket} run --slurm -- mpiexec.mpich -hosts "$hosts" -n {RANKS} {app} {N} {ITERS} {SLEEP_US}
"#,
            ctl = bin_dir().join("ckptctl").display(),
            socket = d.socket.display(),
            app = apps().join("heat.mpich").display(),
        );
    }
    format!(
        r#"#!/bin/bash
#SBATCH --job-name=heat
#SBATCH --nodes=3
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@60
# The allocation's addresses, for mpiexec.
hosts=$(for h in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
          scontrol show node "$h" | sed -n 's/.*{field}=\([^ ]*\).*/\1/p'
        done | paste -sd,)
echo "batch run ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST"
{ctl} --socket {socket} run --name "heat-$SLURM_JOB_ID" --node "$SLURMD_NODENAME" --resume \
    --checkpoint-on USR1,TERM -- mpiexec.mpich -hosts "$hosts" -n {RANKS} {app} {N} {ITERS} {SLEEP_US} &
pid=$!
trap 'kill -USR1 $pid 2>/dev/null' USR1
trap 'kill -TERM $pid 2>/dev/null' TERM
wait $pid; rc=$?
while kill -0 $pid 2>/dev/null; do wait $pid; rc=$?; done
echo "ckptctl exited $rc"
[ $rc -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"
exit $rc
"#,
        ctl = bin_dir().join("ckptctl").display(),
        socket = d.socket.display(),
        app = apps().join("heat.mpich").display(),
    )
}

/// agent.toml's `[slurm]` for agents that run parts only for users Slurm gave the node, and
/// put them into the user's Slurm job there (`adopt`, the default).
fn slurm_gate(d: &Ckptd) -> String {
    format!(
        "[slurm]\nenforce = true\nconf = \"{}\"\n",
        d.dir.path().join("slurm").join("slurm.conf").display()
    )
}

/// A batch job of the test Slurm whose program computes under ckpt.
struct Batch {
    slurm: Slurm,
    d: Ckptd,
    cluster: Cluster,
    /// The Slurm job.
    id: u64,
    /// The ckpt job.
    job: u64,
    /// The batch job's output.
    out: std::path::PathBuf,
    /// The program's output (on n1).
    progress: std::path::PathBuf,
    /// What Slurm's epilog (`ckptctl slurm-epilog`) printed.
    epilog_log: std::path::PathBuf,
}

/// Starts Slurm and ckpt on 3 test hosts (4 to move to), submits the batch script `how`
/// takes, and waits until its program computes; `None` when the test is skipped.
fn start_batch(how: Preemption) -> Option<Batch> {
    if let Some(why) = ckpt_tests::skip_reason(&["mpiexec.mpich", "mpicc.mpich", "nsenter", "nft"])
    {
        eprintln!("SKIPPED: {why}");
        return None;
    }
    if let Some(why) = Cluster::unavailable().or_else(Slurm::unavailable) {
        eprintln!("SKIPPED: {why}");
        return None;
    }
    let moves = how == Preemption::RequeueOntoOtherNodes;
    let (cluster, d) = if moves {
        // Agents that run parts only inside the Slurm job and put them into it.
        hosts_with_agents(&FOUR, false, true, None, "", slurm_gate)?
    } else {
        let cluster = Cluster::create(3).expect("create test hosts");
        let mut d = Ckptd::start(Options {
            no_agent: true,
            ..Options::default()
        });
        for n in NODES {
            d.start_agent_in(&cluster, n);
        }
        d.wait_agents(&NODES);
        (cluster, d)
    };
    // Slurm's epilog, as docs/slurm.md sets it up.
    let epilog = d.dir.path().join("epilog.sh");
    let epilog_log = d.dir.path().join("epilog.log");
    ckpt_tests::script(
        &epilog,
        &format!(
            "exec {} --socket {} slurm-epilog >> {} 2>&1",
            bin_dir().join("ckptctl").display(),
            d.socket.display(),
            epilog_log.display()
        ),
    );
    let (more, low) = if moves {
        (
            "SlurmctldParameters=preempt_send_user_signal\n",
            "GraceTime=120",
        )
    } else {
        ("", "")
    };
    let slurm = Slurm::start_configured(
        &cluster,
        &d.dir.path().join("slurm"),
        &format!("EpilogSlurmctld={}\n{more}", epilog.display()),
        low,
    )
    .expect("start Slurm");
    let script = d.dir.path().join("heat.sbatch");
    let field = if moves { "NodeHostName" } else { "NodeAddr" };
    std::fs::write(&script, batch_script(&d, field, how.one_line())).unwrap();
    let out = slurm.dir.join("heat.out");
    let id = slurm
        .sbatch(&[
            "-o",
            out.to_str().unwrap(),
            "-D",
            d.dir.path().to_str().unwrap(),
            script.to_str().unwrap(),
        ])
        .expect("sbatch");
    slurm.wait_job(id, "RUNNING", LIMIT);
    let first_nodes = slurm.job_field(id, "NodeList");
    assert_eq!(
        first_nodes,
        "n[1-3]",
        "the first run's nodes: {}",
        slurm.explain(id)
    );

    // Once the job computes, Slurm takes its nodes.
    let name = format!("{}-{id}", if how.one_line() { "slurm" } else { "heat" });
    let begin = Instant::now();
    let job = loop {
        let list: Vec<serde_json::Value> =
            serde_json::from_str(d.ctl(&["list", "--json"]).ok()).unwrap();
        if let Some(j) = list.iter().find(|j| j["name"] == name) {
            break j["id"].as_u64().unwrap();
        }
        assert!(begin.elapsed() < LIMIT, "no ckpt job: {}", read(&out));
        std::thread::sleep(Duration::from_millis(200));
    };
    let progress = d.job_dir_on("n1", job).join("stdout");
    let begin = Instant::now();
    while read(&progress).matches("iter ").count() < 2 {
        assert!(begin.elapsed() < LIMIT, "no progress: {}", read(&out));
        std::thread::sleep(Duration::from_millis(100));
    }
    Some(Batch {
        slurm,
        d,
        cluster,
        id,
        job,
        out,
        progress,
        epilog_log,
    })
}

fn preempted_batch_job_resumes_from_its_checkpoint(how: Preemption) {
    let Some(b) = start_batch(how) else {
        return;
    };
    // The test hosts stay in `b` to the end.
    let Batch {
        d,
        slurm,
        cluster,
        id,
        job,
        out,
        progress,
        ..
    } = b;
    let want = Mpi::Mpich.reference_checksum(RANKS, N, ITERS);
    let moves = how == Preemption::RequeueOntoOtherNodes;
    let high = match how {
        Preemption::RequeueOntoOtherNodes => {
            // The agents put every part into the Slurm job: Slurm tracks the ranks on each
            // node, and accounts for them.
            if ckpt_tests::slurm::adoption_here() {
                for n in NODES {
                    slurm.tracks(&cluster, n, id, "heat.mpich");
                }
                let rss = slurm.extern_max_rss(id);
                assert!(
                    rss > ckpt_tests::slurm::ACCOUNTED,
                    "Slurm accounts for the parts in {id}.extern (more than its own sleep): MaxRSS {rss}"
                );
            }
            // Preempted by a job that wants n1 (drained once the job stopped: the requeued
            // job cannot have it again).
            slurm
                .sbatch(&[
                    "-p",
                    "high",
                    "-N",
                    "1",
                    "-w",
                    "n1",
                    "--exclusive",
                    "-o",
                    "/dev/null",
                    "--wrap",
                    "sleep 600",
                ])
                .expect("sbatch high");
            None
        }
        Preemption::Requeue => {
            scontrol(&slurm, &["requeue", &id.to_string()]);
            None
        }
        Preemption::BatchKilled | Preemption::Cancelled => {
            unreachable!("the batch job ends: its own tests")
        }
        Preemption::TimeLimitWarning => {
            slurm.run_ok("scancel", &["--batch", "--signal=USR1", &id.to_string()]);
            None
        }
        Preemption::HigherPriorityJob => Some(
            slurm
                .sbatch(&[
                    "-p",
                    "high",
                    "-N",
                    "3",
                    "--exclusive",
                    "-o",
                    "/dev/null",
                    "--wrap",
                    "sleep 3",
                ])
                .expect("sbatch high"),
        ),
    };
    // Checkpointed and stopped by the signal, not killed.
    d.wait_state(job, "stopped", LIMIT);
    if moves {
        scontrol(
            &slurm,
            &["update", "NodeName=n1", "State=DRAIN", "Reason=ckpt-test"],
        );
    }
    assert!(
        !read(&progress).contains("checksum"),
        "stopped before its end; make it longer"
    );
    if let Some(h) = high {
        slurm.wait_job(h, "COMPLETED", LIMIT);
    }
    // Requeued, run again, resumed, finished. Slurm holds a requeued job back for two
    // minutes (its begin time); the test does not wait that long.
    slurm.wait_job(id, "PENDING", LIMIT);
    let start_now = || scontrol(&slurm, &["update", &format!("JobId={id}"), "StartTime=now"]);
    // Not in the second the first run's credential was revoked: slurmd compares the new
    // credential's creation time with the revocation time in whole seconds, and a job started
    // within the same second is killed at once ("Job credential revoked"), failed for good.
    // Slurm's own two-minute hold is there for this; a 2 s wait is enough.
    std::thread::sleep(Duration::from_secs(2));
    start_now();
    // The launcher's part moved with the others: its output goes on in its new job directory.
    let progress = if moves {
        d.job_dir_on("n4", job).join("stdout")
    } else {
        progress
    };
    let begin = Instant::now();
    let mut asked = Instant::now();
    let mut restored_tracked = moves && !ckpt_tests::slurm::adoption_here();
    while checksum_in(&read(&progress)).is_none() {
        // The restored parts went into the new Slurm job: the one moved to n4 among them.
        if moves && !restored_tracked && read(&out).contains("resuming from epoch") {
            slurm.tracks(&cluster, "n4", id, "heat.mpich");
            slurm.tracks(&cluster, "n2", id, "heat.mpich");
            restored_tracked = true;
        }
        assert!(
            begin.elapsed() < LIMIT,
            "no result: {}\n{}",
            read(&out),
            slurm.explain(id)
        );
        // slurmctld may set the requeue's begin time only after the update (once the job's
        // epilog ended): ask again while it is still pending.
        if asked.elapsed() > Duration::from_secs(5) && slurm.job_field(id, "JobState") == "PENDING"
        {
            start_now();
            asked = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // MPICH's launcher sometimes never exits after its ranks printed their result, with or
    // without checkpoints (see multi_node.rs): a job still running 20 s after its result is
    // cancelled, which ends the batch job too.
    let begin = Instant::now();
    while slurm.job_field(id, "JobState") == "RUNNING" && begin.elapsed() < Duration::from_secs(20)
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut finished = slurm.job_field(id, "JobState") == "COMPLETED";
    if !finished {
        println!("job {job} printed its result but did not exit; cancelling it");
        let cancel = d.ctl(&["cancel", &job.to_string()]);
        if cancel.code == 4 && cancel.stderr.contains("is exited") {
            // It ended by itself between the look and the cancel: the batch job ends with it.
            println!("job {job} ended by itself meanwhile");
            let begin = Instant::now();
            while slurm.job_field(id, "JobState") == "RUNNING" {
                assert!(begin.elapsed() < LIMIT, "the batch job outlived its job");
                std::thread::sleep(Duration::from_millis(200));
            }
            finished = slurm.job_field(id, "JobState") == "COMPLETED";
        } else {
            cancel.ok();
            slurm.wait_job(id, "FAILED", LIMIT);
        }
    }
    let text = read(&out);
    if how.one_line() {
        // ckptctl said what it took from Slurm. Warned by USR1, it asked Slurm itself for the
        // requeue (the test did not: the job reached PENDING above through it); preempted
        // (TERM), it left the requeue to Slurm.
        assert!(
            text.contains(&format!(
                "ckptctl: Slurm job {id}: ckpt job \"slurm-{id}\", launched on n1; USR1 or TERM checkpoint and stop it, a final checkpoint before its time limit (20"
            )),
            "{text}"
        );
        assert!(!text.contains("no final checkpoint"), "{text}");
        let (signal, requeue) = match how {
            Preemption::TimeLimitWarning => {
                ("SIGUSR1", format!("asking Slurm to requeue job {id}"))
            }
            _ => ("SIGTERM", "not asking for a requeue".to_string()),
        };
        assert!(
            text.contains(&format!("ckptctl: got {signal}: checkpointing job {job}")),
            "{text}"
        );
        assert!(text.contains(&requeue), "{text}");
    } else {
        assert!(text.contains("ckptctl exited 75"), "{text}");
        assert_eq!(
            text.contains("ckptctl exited 0"),
            finished,
            "the batch job ends with the job: {text}"
        );
    }
    assert!(
        text.contains("resuming from epoch 1"),
        "it resumed from its checkpoint: {text}"
    );
    assert_eq!(
        text.matches("starting it fresh").count(),
        1,
        "it started fresh only once: {text}"
    );
    assert_eq!(
        checksum_in(&read(&progress)).as_deref(),
        Some(want.as_str()),
        "the answer of an uninterrupted run: {text}"
    );
    if finished {
        assert_eq!(d.status(job)["state"], "exited (0)");
    }
    if moves {
        assert!(
            text.contains(&format!(
                "restarting on the nodes of Slurm job {id} (n2, n3, n4)"
            )),
            "{text}"
        );
        assert!(restored_tracked, "checked while it ran");
        let nodes = d.status(job)["nodes"].clone();
        let part = |n: &str| {
            nodes
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["node"] == n)
                .cloned()
                .unwrap_or_else(|| panic!("no part on {n}: {nodes}"))
        };
        assert_eq!(part("n4")["moved_from"], "n1", "{nodes}");
        for n in ["n2", "n3"] {
            assert!(
                part(n)["moved_from"]
                    .as_str()
                    .unwrap_or_default()
                    .is_empty(),
                "{nodes}"
            );
        }
        assert!(
            !nodes.as_array().unwrap().iter().any(|p| p["node"] == "n1"),
            "nothing runs on the drained node: {nodes}"
        );
    }
}

/// `scontrol ARGS`, which must succeed.
#[track_caller]
fn scontrol(slurm: &Slurm, args: &[&str]) {
    slurm.run_ok("scontrol", args);
}

fn read(p: &std::path::Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// `ckptctl run --slurm` where the batch job cannot be read: outside a batch job, and with a
/// Slurm that does not answer. Each is said before ckptd is asked (none runs here) and exits 2,
/// naming what to do; no job is started.
#[test]
fn run_slurm_outside_a_batch_job_or_without_an_answering_slurm_says_so_and_starts_nothing() {
    if std::process::Command::new("scontrol")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: needs scontrol (slurm-client, scripts/setup.sh)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = |env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(bin_dir().join("ckptctl"));
        cmd.arg("--socket")
            .arg(dir.path().join("no-ckptd.sock"))
            .args(["run", "--slurm", "--", "true"])
            .env_remove("SLURM_JOB_ID")
            .env_remove("SLURM_CONF");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("not inside a Slurm job") && err.contains("sbatch"),
        "{err}"
    );
    let (code, err) = run(&[("SLURM_JOB_ID", "12; rm")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("is not a Slurm job id"), "{err}");
    // A controller that refuses connections (nothing listens on its port).
    let conf = dir.path().join("slurm.conf");
    std::fs::write(
        &conf,
        format!(
            "ClusterName=gone\nSlurmctldHost=gone(127.0.0.1)\nSlurmctldPort={}\n\
             MessageTimeout=1\nTCPTimeout=1\n",
            ckpt_tests::free_port()
        ),
    )
    .unwrap();
    let conf = conf.to_str().unwrap();
    let (code, err) = run(&[("SLURM_JOB_ID", "12"), ("SLURM_CONF", conf)]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("`scontrol show job 12` failed") && err.contains("Unable to contact"),
        "{err}"
    );
}

#[test]
fn slurm_requeue_checkpoints_the_batch_job_and_it_resumes() {
    // Preemption requeues the job the same way, through Slurm's own decision.
    slow_variant!("slurm_preemption_by_a_higher_priority_job_checkpoints_and_resumes");
    preempted_batch_job_resumes_from_its_checkpoint(Preemption::Requeue);
}

/// Slurm gives the requeued job other nodes: it resumes on its new allocation.
#[test]
fn slurm_requeue_onto_other_nodes_resumes_on_the_new_allocation() {
    preempted_batch_job_resumes_from_its_checkpoint(Preemption::RequeueOntoOtherNodes);
}

/// With the one-line script: Slurm's TERM checkpoints it, and Slurm requeues it.
#[test]
fn slurm_preemption_by_a_higher_priority_job_checkpoints_and_resumes() {
    preempted_batch_job_resumes_from_its_checkpoint(Preemption::HigherPriorityJob);
}

/// The one-line batch script (`exec ckptctl run --slurm`): warned of its time limit, it
/// checkpoints, stops and requeues itself, and its next run resumes.
#[test]
fn slurm_one_line_script_checkpoints_on_the_time_limit_warning_requeues_itself_and_resumes() {
    preempted_batch_job_resumes_from_its_checkpoint(Preemption::TimeLimitWarning);
}

/// The one-line script's batch job cancelled: its program is checkpointed and stopped, and the
/// batch job is not requeued.
#[test]
fn slurm_one_line_script_cancelled_with_scancel_stops_its_program_and_is_not_requeued() {
    let Some(b) = start_batch(Preemption::Cancelled) else {
        return;
    };
    // The test hosts stay in `b` to the end.
    let Batch {
        d,
        slurm,
        id,
        job,
        out,
        ..
    } = b;
    slurm.run_ok("scancel", &[&id.to_string()]);
    d.wait_state(job, "stopped", LIMIT);
    slurm.wait_job(id, "CANCELLED", LIMIT);
    // Not requeued: still cancelled a while later (a requeue shows at once).
    std::thread::sleep(Duration::from_secs(3));
    let text = read(&out);
    assert_eq!(slurm.job_field(id, "JobState"), "CANCELLED", "{text}");
    assert!(
        text.contains(&format!("ckptctl: got SIGTERM: checkpointing job {job}")),
        "{text}"
    );
    assert!(text.contains("not asking for a requeue"), "{text}");
    assert!(!text.contains("asking Slurm to requeue"), "{text}");
    assert_eq!(d.status(job)["latest_committed_epoch"], 1, "{text}");
}

/// The one-line script's ckptctl killed outright: Slurm's epilog checkpoints and stops the
/// program it left running.
#[test]
fn slurm_epilog_stops_the_program_of_a_batch_job_whose_ckptctl_was_killed() {
    let Some(b) = start_batch(Preemption::BatchKilled) else {
        return;
    };
    // The test hosts stay in `b` to the end.
    let Batch {
        d,
        slurm,
        id,
        job,
        epilog_log,
        ..
    } = b;
    // Another user running the epilog for this job reaches nothing of root's.
    d.open_to_users();
    let mut other = std::process::Command::new(bin_dir().join("ckptctl"));
    other
        .arg("--socket")
        .arg(&d.socket)
        .arg("slurm-epilog")
        .env("SLURM_JOB_ID", id.to_string())
        .env("SLURM_JOB_UID", "0")
        .current_dir("/");
    ckpt_tests::as_user(&mut other, NOBODY);
    let o = other.output().unwrap();
    assert!(o.status.success(), "{o:?}");
    assert_eq!(d.status(job)["state"], "running", "{o:?}");
    slurm.run_ok("scancel", &["--batch", "--signal=KILL", &id.to_string()]);
    slurm.wait_job(id, "FAILED", LIMIT);
    d.wait_state(job, "stopped", LIMIT);
    let log = read(&epilog_log);
    assert!(
        log.contains(&format!(
            "Slurm job {id} ended with job {job} (slurm-{id}) still running"
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "got the end of Slurm job {id}: checkpointing job {job} and stopping it"
        )),
        "{log}"
    );
    assert_eq!(d.status(job)["latest_committed_epoch"], 1, "{log}");
    assert!(d.job_pids_on("n1", job).is_empty(), "no process left");
}
