//! Pre-copy: while a job runs, its memory is copied into staging in the background
//! ("pre-dumps"); a checkpoint then freezes the job only to dump the pages written since the
//! newest pre-dump, on top of the chain of them.
//!
//! When (the speculation policy): a job's first pre-dump comes `first_after` after it starts,
//! is restored or is checkpointed (its k-th node waits k × `stagger` more, so a job's nodes do
//! not write at once); it copies all of the job's memory. Every `check_every` the agent counts
//! the pages written since the newest pre-dump (the kernel's soft-dirty bits); when dumping
//! them, at the speed the last pre-dump wrote, would freeze the job longer than
//! `target_frozen`, it takes another pre-dump of just those, at most every `min_interval`. After
//! `max_links` pre-dumps the next one starts a new chain with a full copy.
//!
//! The pre-dumps wait in `<local_dir>/<job>/.precopy/<n>/`; the checkpoint's dump moves them
//! into its node directory as `pre/1`, `pre/2`, ... (renames: the job is frozen no longer for
//! it), so every epoch holds its whole chain ([`ckpt_store::chain`]). A pre-dump that fails
//! leaves the job's checkpoints to full dumps until it is restored: the agent says why once.
//!
//! Locking: a job's chain has its own lock, held by a pre-dump while it runs and by a
//! checkpoint from initial synchronization to the end of the epoch; a pre-dump never holds the
//! job's lock, so status calls do not wait for it.
pub(crate) mod chain;

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_proto::Engine;
use tokio::sync::{Mutex, OwnedMutexGuard};
use tracing::{info, warn};

use crate::config::PrecopyConfig;
use crate::engine::{DumpSpec, SnapshotEngine};
use crate::jobs::{Jobs, NodeJob, Observed};
use crate::node::Node;
use crate::os::cgroup::Freezer;
use crate::os::modes::{ensure_dir, PRIVATE_DIR};
use crate::os::{procfs, sandbox};
use chain::Link;

pub use chain::{Chain, Mode};

/// Directory of a job's waiting pre-dumps inside its staging directory.
pub(crate) const WAITING_DIR: &str = ".precopy";

/// What a pre-dump needs of its job, read under the job's lock.
struct Target {
    root_pid: i32,
    pids: Vec<i32>,
    cgroup: PathBuf,
    /// The job's log directory.
    logs: PathBuf,
    external_netns: Option<u64>,
    /// See [`crate::engine::DumpSpec::guarded_ns`].
    guarded_ns: Option<(u64, u64)>,
    delay: Duration,
}

/// What the policy decided.
#[derive(Debug, PartialEq)]
enum Step {
    Wait,
    /// A full pre-dump, starting a new chain.
    Full,
    /// A pre-dump on top of the newest link.
    OnTop,
}

/// The policy: given the chain, the written bytes now (if counted), the settings and the
/// part's stagger delay, what to do.
fn decide(c: &Chain, dirty: Option<u64>, cfg: &PrecopyConfig, delay: Duration) -> Step {
    let since = c.since.map_or(Duration::MAX, |t| t.elapsed());
    if c.links.is_empty() {
        return if since >= cfg.first_after + delay {
            Step::Full
        } else {
            Step::Wait
        };
    }
    if since < cfg.min_interval {
        return Step::Wait;
    }
    let Some(dirty) = dirty else {
        return Step::Wait;
    };
    let predicted = if c.rate > 0.0 {
        Duration::from_secs_f64(dirty as f64 / c.rate)
    } else {
        Duration::MAX
    };
    if predicted <= cfg.target_frozen {
        Step::Wait
    } else if (c.links.len() as u32) < cfg.max_links {
        Step::OnTop
    } else {
        Step::Full
    }
}

/// Pre-dumps the node's jobs as the policy says, every `check_every`, until the agent stops.
/// Runs only when the mode is [`Mode::On`].
pub async fn run_loop(jobs: Arc<Jobs>) {
    let Mode::On(cfg) = jobs.node.precopy.clone() else {
        return;
    };
    loop {
        tokio::time::sleep(cfg.check_every).await;
        for j in jobs.snapshot() {
            jobs.node.precopy_job(&cfg, j).await;
        }
    }
}

impl Node {
    async fn precopy_job(&self, cfg: &PrecopyConfig, j: Arc<Mutex<NodeJob>>) {
        // A job whose lock is taken is in a checkpoint step, a restore or a launch: next time.
        let Ok(job) = j.try_lock() else { return };
        let Ok(mut chain) = job.precopy.clone().try_lock_owned() else {
            return;
        };
        let id = job.id();
        if job.work.is_some() {
            return;
        }
        let waiting = self.staging.job_dir(id).join(WAITING_DIR);
        let running = job.observe(self.host.as_ref()) == Observed::Running;
        if !running || chain.incarnation != job.incarnation() {
            if chain.incarnation != job.incarnation() || !chain.links.is_empty() {
                let inc = job.incarnation();
                drop(job);
                // Also what an earlier agent run or incarnation left there.
                tokio::task::spawn_blocking(move || {
                    chain.reset(inc);
                    let _ = fs::remove_dir_all(&waiting);
                })
                .await
                .expect("reset task");
            }
            return;
        }
        // Only CRIU, the default engine, pre-dumps (DMTCP has no pre-dumps).
        if Engine::named(&job.record.engine) != Ok(Engine::Criu) {
            return;
        }
        // A part held frozen after a restore waits for its release; the engine would thaw it.
        if chain.failed.is_some() || job.cgroup.state().ok() != Some(Freezer::Thawed) {
            return;
        }
        let root_pid = job.record.root_pid.unwrap_or(0);
        let external_netns = match job.record.sandbox {
            Some(_) => match sandbox::netns_inode(root_pid) {
                Some(ino) => Some(ino),
                None => return,
            },
            None => None,
        };
        let target = Target {
            root_pid,
            pids: job.cgroup.pids().unwrap_or_default(),
            cgroup: job.cgroup.path().to_path_buf(),
            logs: job.dir.join("logs"),
            external_netns,
            guarded_ns: job.record.guarded_ns,
            delay: cfg.stagger * job.record.part,
        };
        drop(job);
        let cfg = cfg.clone();
        let engine = self.engine.clone();
        tokio::task::spawn_blocking(move || {
            precopy_step(id, &cfg, engine.as_ref(), &mut chain, &target, &waiting)
        })
        .await
        .expect("pre-dump task");
    }

    /// The job's chain, for a checkpoint to hold from initial synchronization on: waits for a
    /// pre-dump in progress.
    pub(crate) async fn hold_chain(&self, job: &Mutex<NodeJob>) -> Option<OwnedMutexGuard<Chain>> {
        if !matches!(self.precopy, Mode::On(_)) {
            return None;
        }
        let chain = job.lock().await.precopy.clone();
        Some(chain.lock_owned().await)
    }

    /// This node's pre-copy state for the job, in words (for `ckptctl status`).
    pub(crate) fn precopy_text(&self, job: &NodeJob) -> String {
        match &self.precopy {
            Mode::Off(why) => format!("full dumps: {why}"),
            Mode::On(_) => match job.precopy.try_lock() {
                Err(_) => "pre-copy: a pre-dump or checkpoint is running".into(),
                Ok(c) if c.incarnation != job.incarnation() => "pre-copy: waiting".into(),
                Ok(c) => match &c.failed {
                    Some(why) => format!("full dumps until restarted: a pre-dump failed: {why}"),
                    None if c.links.is_empty() => "pre-copy: no pre-dump yet".into(),
                    None => {
                        let bytes: u64 = c.links.iter().map(|l| l.bytes).sum();
                        let dirty = c
                            .dirty
                            .map(|d| format!(", {} MB written since", d / 1_000_000))
                            .unwrap_or_default();
                        format!(
                            "pre-copy: {} pre-dump{} ready ({} MB){dirty}",
                            c.links.len(),
                            if c.links.len() == 1 { "" } else { "s" },
                            bytes / 1_000_000
                        )
                    }
                },
            },
        }
    }
}

/// One check of one job: count, decide, pre-dump. Blocking.
fn precopy_step(
    job: u64,
    cfg: &PrecopyConfig,
    engine: &dyn SnapshotEngine,
    c: &mut Chain,
    t: &Target,
    waiting: &std::path::Path,
) {
    let dirty = if c.links.is_empty() {
        None
    } else {
        let mut sum = 0u64;
        for &p in &t.pids {
            sum += procfs::soft_dirty_bytes(p).unwrap_or(0);
        }
        c.dirty = Some(sum);
        Some(sum)
    };
    let step = decide(c, dirty, cfg, t.delay);
    if step == Step::Wait {
        return;
    }
    if step == Step::Full {
        c.reset(c.incarnation);
    }
    let n = c.next + 1;
    let dir = waiting.join(n.to_string());
    let made = ensure_dir(waiting.parent().expect("job dir"), PRIVATE_DIR)
        .and_then(|()| ensure_dir(waiting, PRIVATE_DIR))
        .and_then(|()| match fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => fs::create_dir(&dir),
        });
    if let Err(e) = made {
        warn!(job, dir = %dir.display(), error = %e, "cannot make a pre-dump directory; trying again later");
        return;
    }
    c.next = n;
    // Parents are named relative to the new directory: the chain moves as a whole.
    let parent = c
        .links
        .last()
        .and_then(|l| l.dir.file_name())
        .map(|name| format!("../{}", name.to_string_lossy()));
    let log = t.logs.join(format!("pre-dump-{n}.log"));
    let begin = Instant::now();
    let r = engine.pre_dump(&DumpSpec {
        root_pid: t.root_pid,
        images_dir: &dir,
        cgroup: &t.cgroup,
        log_file: &log,
        external_netns: t.external_netns,
        parent: parent.as_deref(),
        track_mem: true,
        session: None,
        owner: None,
        guarded_ns: t.guarded_ns,
        stop: None,
    });
    let took = begin.elapsed();
    match r {
        Ok(()) => {
            let bytes = ckpt_store::digest::list_files(&dir, &[])
                .unwrap_or_default()
                .iter()
                .map(|f| fs::metadata(dir.join(f)).map_or(0, |m| m.len()))
                .sum::<u64>();
            c.rate = bytes as f64 / took.as_secs_f64().max(0.001);
            c.links.push(Link { dir, bytes });
            c.since = Some(Instant::now());
            c.dirty = Some(0);
            info!(
                job,
                link = c.links.len(),
                bytes,
                ms = took.as_millis() as u64,
                "pre-dumped"
            );
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&dir);
            let mut why = e.to_string();
            if why.contains("non-regular mapping") {
                why.insert_str(0, "a process maps a device (an InfiniBand verbs device?), which pre-dumps cannot copy: ");
            }
            c.reset(c.incarnation);
            if e.no_room() {
                // Staging filled up: the job's next checkpoint needs the room more; pre-copy
                // starts over after the usual delay.
                warn!(job, error = %why, "pre-dump failed for lack of room in staging; its pre-dumps were deleted, pre-copy starts over later");
                return;
            }
            warn!(job, error = %why, "pre-dump failed: this job's checkpoints are full dumps until it is restarted");
            c.failed = Some(why);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PrecopyConfig {
        PrecopyConfig {
            first_after: Duration::from_secs(10),
            min_interval: Duration::from_secs(30),
            target_frozen: Duration::from_millis(500),
            max_links: 2,
            ..PrecopyConfig::default()
        }
    }

    fn chain(age: Duration, links: usize, rate: f64) -> Chain {
        Chain {
            since: Some(Instant::now() - age),
            links: (0..links)
                .map(|i| Link {
                    dir: PathBuf::from(i.to_string()),
                    bytes: 0,
                })
                .collect(),
            rate,
            ..Chain::default()
        }
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn the_first_pre_dump_waits_for_its_delay_and_the_part_s_stagger() {
        let c = cfg();
        let first = |age, delay| decide(&chain(secs(age), 0, 0.0), None, &c, secs(delay));
        assert_eq!(first(5, 0), Step::Wait);
        assert_eq!(first(11, 0), Step::Full);
        // Part 2 of a job, 5 s stagger.
        assert_eq!(first(11, 10), Step::Wait);
        assert_eq!(first(21, 10), Step::Full);
    }

    #[test]
    fn after_a_checkpoint_the_first_pre_dump_counts_from_the_epoch_s_end() {
        let c = cfg();
        // The dump took the links 30 s ago; sealing went on until now.
        let mut taken = chain(secs(30), 0, 100e6);
        taken.epoch_ended();
        assert_eq!(decide(&taken, None, &c, secs(0)), Step::Wait);
        assert_eq!(decide(&taken, None, &c, secs(10)), Step::Wait);
        // An epoch that ended without taking them (aborted before its dump) leaves the
        // clock of the newest pre-dump as it was.
        let mut kept = chain(secs(60), 1, 100e6);
        kept.epoch_ended();
        assert_eq!(decide(&kept, Some(60_000_000), &c, secs(0)), Step::OnTop);
    }

    #[test]
    fn another_pre_dump_only_when_the_written_pages_would_freeze_too_long() {
        let c = cfg();
        // 100 MB/s: 40 MB is 400 ms, 60 MB is 600 ms.
        let next = |age, links, dirty| decide(&chain(secs(age), links, 100e6), dirty, &c, secs(0));
        assert_eq!(next(60, 1, Some(40_000_000)), Step::Wait);
        assert_eq!(next(60, 1, Some(60_000_000)), Step::OnTop);
        // Not before min_interval, nor without a count.
        assert_eq!(next(20, 1, Some(60_000_000)), Step::Wait);
        assert_eq!(next(60, 1, None), Step::Wait);
        // A full chain starts again.
        assert_eq!(next(60, 2, Some(60_000_000)), Step::Full);
    }

    /// An engine whose pre-dumps write one page file, or fail with `fails` as CRIU's summary.
    #[derive(Debug)]
    struct PreDumps {
        fails: Option<&'static str>,
    }

    impl SnapshotEngine for PreDumps {
        fn name(&self) -> &str {
            "pre-dumps"
        }
        fn version(&self) -> &str {
            "0"
        }
        fn dump(&self, _spec: &DumpSpec<'_>) -> Result<(), crate::engine::EngineError> {
            Ok(())
        }
        fn pre_dump(&self, spec: &DumpSpec<'_>) -> Result<(), crate::engine::EngineError> {
            match self.fails {
                None => {
                    fs::write(spec.images_dir.join("pages-1.img"), [0u8; 4096]).unwrap();
                    Ok(())
                }
                Some(summary) => {
                    // CRIU leaves a partial image behind.
                    fs::write(spec.images_dir.join("pages-1.img"), [0u8; 10]).unwrap();
                    Err(crate::engine::EngineError::Failed {
                        engine: "criu",
                        op: "pre-dump",
                        status: "exit status: 1".into(),
                        summary: summary.into(),
                        log: spec.log_file.to_path_buf(),
                    })
                }
            }
        }
        fn restore_argv(&self, _spec: &crate::engine::RestoreSpec<'_>) -> Vec<String> {
            Vec::new()
        }
        fn restore_failed(
            &self,
            status: String,
            log: &std::path::Path,
        ) -> crate::engine::EngineError {
            crate::engine::EngineError::Failed {
                engine: "criu",
                op: "restore",
                status,
                summary: String::new(),
                log: log.to_path_buf(),
            }
        }
    }

    /// The first pre-dump of a job, due, by `engine`: the chain after it, and whether the
    /// waiting directory still holds anything.
    fn step_with(engine: PreDumps) -> (Chain, bool) {
        let d = tempfile::tempdir().unwrap();
        let waiting = d.path().join("7").join(WAITING_DIR);
        let mut c = chain(secs(3600), 0, 0.0);
        let t = Target {
            root_pid: 1,
            pids: Vec::new(),
            cgroup: d.path().join("cg"),
            logs: d.path().to_path_buf(),
            external_netns: None,
            guarded_ns: None,
            delay: Duration::ZERO,
        };
        precopy_step(7, &cfg(), &engine, &mut c, &t, &waiting);
        let left = fs::read_dir(&waiting).map_or(0, |r| r.count());
        (c, left > 0)
    }

    #[test]
    fn a_pre_dump_that_succeeds_is_a_link_with_its_size() {
        let (c, left) = step_with(PreDumps { fails: None });
        assert!(c.failed.is_none());
        assert_eq!(c.links.len(), 1, "{c:?}");
        assert_eq!(c.links[0].bytes, 4096);
        assert!(c.links[0].dir.ends_with(".precopy/1"), "{c:?}");
        assert!(left);
    }

    #[test]
    fn a_pre_dump_of_a_device_mapping_turns_pre_copy_off_and_names_the_device() {
        let summary =
            "Error (criu/proc_parse.c:663): Can't handle non-regular mapping on 199's map";
        let (c, left) = step_with(PreDumps {
            fails: Some(summary),
        });
        let why = c.failed.expect("pre-copy off for this incarnation");
        assert!(why.starts_with("a process maps a device"), "{why}");
        assert!(why.contains("non-regular mapping"), "{why}");
        assert!(c.links.is_empty());
        assert!(!left, "the partial pre-dump is deleted");
    }

    #[test]
    fn a_pre_dump_that_fills_staging_starts_over_later() {
        let summary = "Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device";
        let (c, left) = step_with(PreDumps {
            fails: Some(summary),
        });
        assert!(c.failed.is_none(), "pre-copy stays on: {c:?}");
        assert!(c.links.is_empty());
        assert!(!left, "the room is given back");
        assert!(
            c.since.unwrap().elapsed() < secs(60),
            "the delay starts again"
        );
    }

    #[test]
    fn pre_copy_off_or_unsupported_says_why() {
        let mut c = cfg();
        let unsupported = || Err("no soft-dirty".to_string());
        assert!(matches!(Mode::resolve(&c, unsupported), Mode::Off(w) if w == "no soft-dirty"));
        assert!(matches!(Mode::resolve(&c, || Ok(())), Mode::On(_)));
        c.enabled = false;
        let never = || -> Result<(), String> { panic!("not asked when off") };
        assert!(matches!(Mode::resolve(&c, never), Mode::Off(w) if w.contains("agent.toml")));
    }
}
