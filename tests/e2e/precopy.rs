//! Pre-copy end to end: jobs pre-dumped while they run, checkpoints that dump only what changed
//! on top of the chain, restarts from every epoch, a damaged link refused; and, where the
//! kernel does not track written pages (this host), full dumps with a clear message. Where the
//! host cannot pre-copy, the pre-copy tests run again in a soft-RoCE test guest, whose Debian
//! kernel tracks written pages.
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ckpt_tests::{flip_byte_in_largest, skip_unless_ready, Ckptd, Mpi, Options};

const LIMIT: Duration = Duration::from_secs(300);
/// memwrite: MiB held, percent rewritten per step, steps, sleep per step (ms).
const MEMWRITE: [&str; 4] = ["48", "10", "36", "700"];
/// Pre-dumps soon after a start or a checkpoint, and one more when anything was written since.
const PRECOPY: &str = "[agent.precopy]\nenabled = true\nfirst_after = \"1s\"\nstagger = \"0s\"\ncheck_every = \"300ms\"\nmin_interval = \"2s\"\ntarget_frozen = \"1ms\"\n";
const GUEST_TESTS: [&str; 2] = [
    "memwrite_under_pre_copy_restarts_from_every_epoch_and_refuses_a_damaged_link",
    "an_mpich_job_under_pre_copy_is_checkpointed_killed_and_restarted",
];
/// Run in the guest too with `CKPT_FULL=1`.
const GUEST_SLOW_VARIANTS: [&str; 1] =
    ["an_mpich_job_over_verbs_under_pre_copy_is_checkpointed_killed_and_restarted"];

/// Why this kernel cannot pre-copy (CRIU's own check), or `None` if it can.
fn no_tracking() -> Option<String> {
    let criu = ckpt_tests::criu_path()?;
    let out = Command::new(criu)
        .args(["check", "--feature", "mem_dirty_track"])
        .output()
        .ok()?;
    (!out.status.success()).then(|| String::from_utf8_lossy(&out.stderr).trim().to_string())
}

/// Runs the pre-copy tests in a guest when this host cannot pre-copy; true if they ran there
/// (or were skipped, said so), false if this host runs them itself.
fn ran_elsewhere() -> bool {
    let Some(why) = no_tracking() else {
        return false;
    };
    match ckpt_tests::vm::unavailable() {
        Some(vm) => {
            eprintln!("SKIPPED: no dirty-page tracking here ({why}), and no test guest: {vm}")
        }
        // Every guest test in one boot: the first of them to get here starts it, the others
        // wait for it (tests run in parallel threads) and report how it went.
        None => {
            static GUEST_RUN: std::sync::Mutex<Option<bool>> = std::sync::Mutex::new(None);
            let mut ran = GUEST_RUN.lock().unwrap_or_else(|p| p.into_inner());
            match *ran {
                Some(true) => eprintln!("(ran in the test guest with the other pre-copy tests)"),
                Some(false) => panic!(
                    "the pre-copy tests failed in the test guest: see the test that ran them"
                ),
                None => {
                    *ran = Some(false);
                    // The guest runs the reference (no sleep) far slower: it comes from here.
                    let mpich =
                        ckpt_tests::skip_reason(&["mpiexec.mpich", "mpicc.mpich"]).is_none();
                    let mut env: Vec<_> = mpich
                        .then(|| (HEAT_REFERENCE_ENV, heat_reference()))
                        .into_iter()
                        .collect();
                    let mut tests = GUEST_TESTS.to_vec();
                    if ckpt_tests::full() {
                        tests.extend(GUEST_SLOW_VARIANTS);
                        env.push((ckpt_tests::FULL_ENV, "1".into()));
                    }
                    ckpt_tests::vm::rerun_in_guest_with("precopy", &tests, &env);
                    *ran = Some(true);
                }
            }
        }
    }
    true
}

/// heat: ranks, grid size, iterations, sleep per iteration (µs): about 30 s, here or in a guest.
const HEAT: (u32, u32, u32, u32) = (4, 256, 1500, 20_000);
const HEAT_REFERENCE_ENV: &str = "CKPT_PRECOPY_HEAT_REFERENCE";

/// The heat job's checksum run straight through (given by the host to a guest).
fn heat_reference() -> String {
    std::env::var(HEAT_REFERENCE_ENV)
        .unwrap_or_else(|_| Mpi::Mpich.reference_checksum(HEAT.0, HEAT.1, HEAT.2))
}

fn memwrite() -> Vec<String> {
    std::iter::once(ckpt_tests::apps().join("memwrite").display().to_string())
        .chain(MEMWRITE.iter().map(|s| s.to_string()))
        .collect()
}

/// memwrite's checksum run straight through, without sleeping.
fn memwrite_reference() -> String {
    let mut argv = memwrite();
    argv[4] = "0".into();
    let out = Command::new(&argv[0]).args(&argv[1..]).output().unwrap();
    ckpt_tests::checksum_in(&String::from_utf8_lossy(&out.stdout)).expect("memwrite checksum")
}

fn snapshot_mode(d: &Ckptd, job: u64) -> String {
    d.status(job)["nodes"][0]["snapshot_mode"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Waits (bounded) until the node has a pre-dump of the job ready.
fn wait_pre_dump(d: &Ckptd, job: u64) {
    let begin = Instant::now();
    loop {
        let mode = snapshot_mode(d, job);
        if mode.contains("ready") {
            return;
        }
        assert!(
            begin.elapsed() < LIMIT && !mode.starts_with("full dumps"),
            "no pre-dump of job {job}: {mode}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Checkpoints the job once a pre-dump is ready; returns the epoch's manifest.
fn checkpoint_on_top(d: &Ckptd, job: u64, epoch: u32) -> ckpt_store::manifest::NodeManifest {
    wait_pre_dump(d, job);
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert!(
        out.ok().contains(&format!("epoch {epoch} committed")),
        "{out:?}"
    );
    let (m, _) = ckpt_store::manifest::read(&d.images(job, epoch)).unwrap();
    assert!(
        !m.chain.is_empty(),
        "epoch {epoch} is dumped on a chain: {m:?}"
    );
    m
}

fn bytes_under(dir: &Path, prefix: &str) -> u64 {
    let (m, _) = ckpt_store::manifest::read(dir).unwrap();
    m.files
        .iter()
        .filter(|f| f.path.starts_with(prefix) && f.path.contains("pages-"))
        .map(|f| f.size)
        .sum()
}

/// memwrite (48 MiB, 10 % rewritten per step) pre-copied: four checkpoints, each dumped on a
/// chain of pre-dumps and writing while frozen less than half of what the chain holds;
/// retention (keep_local = 3) deletes epoch 1; SIGKILL; every remaining epoch restarts to the
/// right checksum; then a flipped byte in a pre-dump link of the newest epoch gets that epoch
/// refused by digest, and the restart falls back to the one before it.
#[test]
fn memwrite_under_pre_copy_restarts_from_every_epoch_and_refuses_a_damaged_link() {
    skip_unless_ready!();
    if ran_elsewhere() {
        return;
    }
    let want = memwrite_reference();
    let d = Ckptd::start(Options {
        agent_toml: PRECOPY.into(),
        extra_toml: "[retention]\nkeep_local = 3\n".into(),
        ..Options::default()
    });
    let job = d.run_job("memwrite", &memwrite());
    let id = job.to_string();
    d.wait_progress(job, 1, LIMIT);
    // The waiting pre-dumps hold the job's memory: root's alone.
    wait_pre_dump(&d, job);
    let waiting = d.dir.path().join("local").join(&id).join(".precopy");
    let meta = std::fs::metadata(&waiting).unwrap();
    assert_eq!(
        (meta.mode() & 0o077, meta.uid()),
        (0, 0),
        "{}",
        waiting.display()
    );
    for epoch in 1..=4 {
        let m = checkpoint_on_top(&d, job, epoch);
        let dir = d.images(job, epoch);
        let (frozen, chain) = (bytes_under(&dir, "images/"), bytes_under(&dir, "pre/"));
        assert!(
            frozen * 2 < chain,
            "epoch {epoch}: dumped {frozen} bytes while frozen, {chain} in its chain {:?}",
            m.chain
        );
    }
    assert!(
        !d.output(job).contains("checksum"),
        "the job must still run when killed; make it longer"
    );
    d.kill_job(job);
    d.wait_state(job, "killed", LIMIT);
    // Epoch 1, expired by epoch 4, would have been deleted by the job's next epoch: the job
    // ended, and ckptd has it deleted at once.
    let begin = Instant::now();
    while d.images(job, 1).exists() {
        assert!(begin.elapsed() < LIMIT, "retention kept epoch 1");
        std::thread::sleep(Duration::from_millis(50));
    }
    for epoch in [4, 2, 3] {
        let out = d.ctl(&["restart", &id, "--epoch", &epoch.to_string()]);
        assert!(out.ok().contains(&format!("epoch {epoch}")), "{out:?}");
        assert_eq!(
            d.wait_checksum(job, LIMIT),
            want,
            "restarted from epoch {epoch}"
        );
    }
    // A flipped byte in the newest epoch's oldest link: refused, epoch 3 restores.
    let name = flip_byte_in_largest(&d.images(job, 4).join("pre/1"));
    let out = d.ctl(&["restart", &id]);
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        text.contains("epoch 4 cannot be restored") && text.contains(&name),
        "the damaged link is named: {out:?}"
    );
    assert!(out.ok().contains("epoch 3"), "{out:?}");
    assert_eq!(d.wait_checksum(job, LIMIT), want, "fell back to epoch 3");
}

/// The 4-rank MPICH heat job pre-copied: three checkpoints on chains, SIGKILL, restart to the
/// right checksum.
#[test]
fn an_mpich_job_under_pre_copy_is_checkpointed_killed_and_restarted() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    if ran_elsewhere() {
        return;
    }
    let (ranks, n, iters, sleep_us) = HEAT;
    let want = heat_reference();
    let d = Ckptd::start(Options {
        agent_toml: PRECOPY.into(),
        ..Options::default()
    });
    // Over shared memory and TCP: a process that maps a verbs device (UCX on the guest's
    // soft-RoCE device) cannot be pre-dumped.
    let mut argv = Mpi::Mpich.heat_argv(ranks, n, iters, sleep_us);
    let ucx = [
        "-genv",
        "UCX_TLS",
        "sm,self,tcp",
        "-genv",
        "UCX_MODULES",
        "^rdmacm",
    ];
    argv.splice(1..1, ucx.map(String::from));
    let job = d.run_job("heat", &argv);
    d.wait_progress(job, 1, LIMIT);
    for epoch in 1..=3 {
        checkpoint_on_top(&d, job, epoch);
    }
    assert!(
        !d.output(job).contains("checksum"),
        "the job must still run when killed; make it longer"
    );
    d.kill_job(job);
    d.wait_state(job, "killed", LIMIT);
    d.ctl(&["restart", &job.to_string()]).ok();
    assert_eq!(d.wait_checksum(job, LIMIT), want);
}

/// The same job over verbs: UCX on its verbs transports only (no shared memory, so all four
/// ranks talk through the soft-RoCE device), through the verbs layer the agent preloads. Its
/// processes map the device while they run; the agent gives CRIU's pre-dumps the plugin that
/// passes over those mappings, and the layer marks the memory the adapter may have written
/// before each dump. A pre-dump is ready before the checkpoint, which records what was written
/// since it and dumps on the chain unless that is most of the job's memory (this small job's
/// registered memory, all marked, is: docs/infiniband.md). SIGKILL, restart to the right
/// checksum. Only with `CKPT_FULL=1`: every run pre-dumps a verbs job (both parts, in sandboxes,
/// through the plugin) before it checkpoints, moves and restarts it in
/// `rdma::an_rdma_job_with_shared_memory_moves_to_other_guests`.
#[test]
fn an_mpich_job_over_verbs_under_pre_copy_is_checkpointed_killed_and_restarted() {
    ckpt_tests::slow_variant!("rdma::an_rdma_job_with_shared_memory_moves_to_other_guests");
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    if ran_elsewhere() {
        return;
    }
    let devices = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| d.count())
        .unwrap_or(0);
    if devices == 0 {
        eprintln!("SKIPPED: no RDMA device on this host (the test guests have rxe0)");
        return;
    }
    let (ranks, n, iters, sleep_us) = HEAT;
    let want = heat_reference();
    let d = Ckptd::start(Options {
        agent_toml: PRECOPY.into(),
        ..Options::default()
    });
    let mut argv = Mpi::Mpich.heat_argv(ranks, n, iters, sleep_us);
    let ucx = [
        ("UCX_TLS", "rc_verbs,ud_verbs,self"),
        ("UCX_UD_VERBS_ETH_DGID_CHECK", "n"),
        ("UCX_MODULES", "^rdmacm"),
    ];
    let genv = ucx
        .iter()
        .flat_map(|(k, v)| ["-genv".to_string(), k.to_string(), v.to_string()]);
    argv.splice(1..1, genv);
    let job = d.run_job("heat", &argv);
    d.wait_progress(job, 1, LIMIT);
    // One checkpoint: its dump is a full one by the pre-copy rule (the marked registered
    // memory is most of this small job's), so more would show nothing new.
    wait_pre_dump(&d, job);
    let out = d.ctl(&["checkpoint", &job.to_string(), "--wait"]);
    assert!(out.ok().contains("epoch 1 committed"), "{out:?}");
    let (m, _) = ckpt_store::manifest::read(&d.images(job, 1)).unwrap();
    let layers = m.notes.get("ibq_channels").map(|p| p.split(',').count());
    assert_eq!(layers, Some(4), "every rank over the layer: {:?}", m.notes);
    let dirty: u64 = m.notes["precopy_dirty_bytes"].parse().unwrap();
    let links: usize = m.notes["precopy_links"].parse().unwrap();
    eprintln!("written since the pre-dump: {dirty} bytes; dumped on {links} link(s)");
    assert_eq!(links, m.chain.len(), "{:?}", m.notes);
    assert!(
        !d.output(job).contains("checksum"),
        "the job must still run when killed; make it longer"
    );
    d.kill_job(job);
    d.wait_state(job, "killed", LIMIT);
    d.ctl(&["restart", &job.to_string()]).ok();
    assert_eq!(d.wait_checksum(job, LIMIT), want);
}

/// Pre-copy asked for on a kernel that does not track written pages (this host's): the agent
/// says so once at start, `ckptctl status` shows full dumps and why, checkpoints are full dumps
/// without a chain, and the job restarts to the right checksum.
#[test]
fn pre_copy_without_dirty_page_tracking_takes_full_dumps_and_says_why() {
    skip_unless_ready!();
    if no_tracking().is_none() {
        eprintln!("SKIPPED: this kernel tracks written pages; the pre-copy tests cover it");
        return;
    }
    let want = memwrite_reference();
    let d = Ckptd::start(Options {
        agent_toml: PRECOPY.into(),
        ..Options::default()
    });
    let job = d.run_job("memwrite", &memwrite());
    let id = job.to_string();
    d.wait_progress(job, 1, LIMIT);
    let mode = snapshot_mode(&d, job);
    assert!(
        mode.starts_with("full dumps: this kernel does not track which pages")
            && mode.contains("mem_dirty_track"),
        "{mode}"
    );
    let text = d.ctl(&["status", &id]);
    assert!(text.ok().contains("checkpoints: full dumps"), "{text:?}");
    let log = std::fs::read_to_string(d.dir.path().join("ckptd.log")).unwrap();
    assert_eq!(
        log.matches("pre-copy is enabled in agent.toml but cannot run on this node")
            .count(),
        1,
        "said once: {log}"
    );
    // Long enough for pre-dumps to have started, had they been possible.
    std::thread::sleep(Duration::from_secs(2));
    for epoch in 1..=2 {
        let out = d.ctl(&["checkpoint", &id, "--wait"]);
        assert!(
            out.ok().contains(&format!("epoch {epoch} committed")),
            "{out:?}"
        );
        let (m, _) = ckpt_store::manifest::read(&d.images(job, epoch)).unwrap();
        assert!(m.chain.is_empty(), "{m:?}");
        assert!(!d.images(job, epoch).join("pre").exists());
    }
    d.kill_job(job);
    d.wait_state(job, "killed", LIMIT);
    d.ctl(&["restart", &id]).ok();
    assert_eq!(d.wait_checksum(job, LIMIT), want);
}
