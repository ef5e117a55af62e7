//! Lost nodes. A node whose agent has sent no heartbeat for `node_timeout` (or that has not
//! registered within `node_timeout` of ckptd's start) takes every running job with a part
//! there that ckptd may move by itself (a restart policy, [`Job::may_move`]) to `lost`,
//! whichever part it ran (the launcher's or an attached one), naming the node and since when;
//! so does a node that reports parts its shims fenced. What is left of the job on its other
//! nodes is killed: an MPI job missing a rank cannot go on, and a restart needs its parts gone.
//! The job's committed epochs stay restorable, and the restart policy takes it from there.
//!
//! A node cut off from ckptd but alive has killed those parts by then: every answer of ckptd
//! grants a lease (`fence_lease`) shorter than `node_timeout`, and a node's shims kill its
//! movable parts once the lease runs out (the node agent's `lease.rs` has the arithmetic). So a
//! part restarted elsewhere never runs twice.
//!
//! A job without a restart policy is never fenced and never lost this way while it runs:
//! nobody would restart it, and a node ckptd cannot hear (a slow ckptd, a cut management link)
//! may well run its part on. Only once its launcher has ended with a failure (held back until
//! its nodes are heard from, `jobs.rs`) does a silent node make it lost. Its status names the node as unreachable ([`Coordinator::unreachable`]);
//! if the node is really gone, the job ends as its launcher ends, or the node comes back and
//! reports its part absent. A restart by hand moves such a part off a node ckptd cannot reach
//! only when the caller says the node is down (`restart.rs`).
//!
//! ckptd's own stalls (a stopped process, a starved runtime) are not the nodes' silence: a
//! node is down only once it has been silent for `node_timeout` of ckptd's own running time
//! since its last stall.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::warn;

use super::{now_ms, Coordinator, DriveError};
use crate::model::{Job, JobState, LostNode};

/// How often the nodes' last heartbeats are looked at (in memory: cheap), so that a node is
/// declared lost within this of its `node_timeout`.
const TICK: Duration = Duration::from_millis(100);
/// How often the jobs are looked at, besides at once when a node goes down: for nodes that
/// never registered since ckptd started, failures other than a lost node, and backoffs.
const SCAN_EVERY: u32 = 5;
/// A tick of the node watcher this late means ckptd itself did not run (stopped, starved):
/// the nodes' heartbeats of that time may be waiting unread, so silence counts afresh.
const STALL: Duration = Duration::from_secs(1);

impl Coordinator {
    /// The nodes down now, with the time each was last heard from (ms since the Unix epoch):
    /// registered agents silent past `node_timeout`, and, once ckptd has run that long, nodes
    /// of `wanted` that never registered (with ckptd's start as their time).
    fn down_nodes(&self, wanted: &[String]) -> HashMap<String, u64> {
        let timeout = self.cfg.node_timeout;
        let mut down = HashMap::new();
        if self.awake.lock().expect("awake lock").elapsed() <= timeout {
            // ckptd stalled within node_timeout: it cannot tell a silent node from its own
            // sleep yet.
            return down;
        }
        let views = self.agents.views();
        for v in &views {
            if v.since_seen > timeout {
                down.insert(v.node.clone(), v.last_seen_unix_ms);
            }
        }
        if self.started.elapsed() > timeout {
            for n in wanted {
                if !views.iter().any(|v| &v.node == n) {
                    down.insert(n.clone(), self.started_unix_ms);
                }
            }
        }
        down
    }

    /// Marks every running job with a part on a node that is down as lost, and kills what is
    /// left of it on its other nodes. Returns the jobs marked.
    pub async fn mark_lost(&self) -> Result<Vec<u64>, DriveError> {
        let jobs: Vec<_> = self
            .registry
            .jobs()?
            .into_iter()
            .filter(|j| *j.state() == JobState::Running && (j.may_move() || self.end_held(j)))
            .collect();
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let wanted: Vec<String> = jobs.iter().flat_map(|j| j.nodes()).collect();
        let down = self.down_nodes(&wanted);
        let mut marked = Vec::new();
        for job in jobs {
            let Some((node, since)) = job
                .nodes()
                .into_iter()
                .find_map(|n| down.get(&n).map(|s| (n, *s)))
            else {
                continue;
            };
            let alive: Vec<String> = job
                .nodes()
                .into_iter()
                .filter(|n| !down.contains_key(n))
                .collect();
            let why = format!(
                "no heartbeat for {} (node_timeout {})",
                humantime::format_duration(Duration::from_millis(
                    now_ms().saturating_sub(since) / 100 * 100
                )),
                humantime::format_duration(self.cfg.node_timeout)
            );
            if self.lose(&job, node, since, alive, &why).await? {
                marked.push(job.id);
            }
        }
        Ok(marked)
    }

    /// Takes `job`, as read, to `lost` because of `node` (last heard from at `since`, ms since
    /// the Unix epoch; `why`, for the log), and kills what is left of it on `alive`. False when
    /// the job ended or was restarted since it was read.
    async fn lose(
        &self,
        job: &Job,
        node: String,
        since: u64,
        alive: Vec<String>,
        why: &str,
    ) -> Result<bool, DriveError> {
        let lost = LostNode {
            node,
            since_unix_ms: since,
            noticed_unix_ms: now_ms(),
        };
        let incarnation = job.incarnation;
        let updated = self
            .update_job(job.id, |j| {
                j.lose(incarnation, lost.clone());
                Ok(())
            })
            .await?;
        if updated.lost.as_ref() != Some(&lost) || *updated.state() != JobState::Lost {
            return Ok(false);
        }
        warn!(
            job = job.id,
            node = %lost.node,
            why,
            "job lost: a node of it is down or fenced; what is left of it elsewhere is killed (restart it with `ckptctl restart {}`)",
            job.id
        );
        self.agents.forget_job(job.id);
        self.kill_parts(job.id, &alive, "kill").await;
        Ok(true)
    }

    /// A node reported parts its shims fenced (it had not reached ckptd for its lease): each
    /// running job of which the node is one is lost, as if the node had been declared down.
    pub(super) async fn fenced(&self, node: &str, fenced: Vec<(u64, u64)>) {
        for (id, after_ms) in fenced {
            let Ok(Some(job)) = self.registry.job(id) else {
                continue;
            };
            let nodes = job.nodes();
            // A report of a part that has moved, or of a job no longer running, is stale.
            if *job.state() != JobState::Running || !nodes.iter().any(|n| n == node) {
                continue;
            }
            let alive = nodes.into_iter().filter(|n| n != node).collect();
            let since = now_ms().saturating_sub(after_ms);
            let why = format!(
                "its shims fenced (killed) its part: the node had no answer from ckptd for {after_ms} ms, past its lease (fence_lease {})",
                humantime::format_duration(self.cfg.lease())
            );
            if let Err(e) = self.lose(&job, node.to_string(), since, alive, &why).await {
                warn!(job = id, error = %e, "cannot record a fenced job as lost");
            }
        }
    }

    /// The nodes of a running job without a restart policy that ckptd has not heard from for
    /// `node_timeout`: the job is not lost (its parts there are not fenced and may run on), and
    /// its status says so.
    pub fn unreachable(&self, job: &Job) -> Vec<LostNode> {
        if *job.state() != JobState::Running || job.may_move() {
            return Vec::new();
        }
        let nodes = job.nodes();
        let down = self.down_nodes(&nodes);
        let noticed = now_ms();
        nodes
            .into_iter()
            .filter_map(|n| {
                down.get(&n).map(|&since| LostNode {
                    node: n,
                    since_unix_ms: since,
                    noticed_unix_ms: noticed,
                })
            })
            .collect()
    }

    /// ckptd itself did not run for a while: every node's silence counts from now.
    fn stalled(&self) {
        *self.awake.lock().expect("awake lock") = std::time::Instant::now();
    }

    /// Says which jobs a node just gone silent holds that it does not fence.
    fn warn_unreachable(&self, node: &str) {
        let Ok(jobs) = self.registry.jobs() else {
            return;
        };
        let kept: Vec<u64> = jobs
            .iter()
            .filter(|j| *j.state() == JobState::Running && !j.may_move())
            .filter(|j| j.nodes().iter().any(|n| n == node))
            .map(|j| j.id)
            .collect();
        if !kept.is_empty() {
            warn!(
                node,
                jobs = ?kept,
                "no heartbeat from the node for node_timeout; these jobs have no restart policy, so their parts there are not fenced and they are not lost: they go on if the node does (if it is down for good, a restart moves its part only with `ckptctl restart --down NODE`)"
            );
        }
    }

    /// Marks jobs lost as their nodes go down, until `stop` turns true.
    pub async fn watch_nodes(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut tick = 0u32;
        let mut was_down = std::collections::BTreeSet::new();
        let mut last = std::time::Instant::now();
        loop {
            tick = tick.wrapping_add(1);
            if last.elapsed() > STALL {
                warn!(
                    stalled_ms = last.elapsed().as_millis() as u64,
                    "ckptd did not run for a while (stopped or starved): nodes get node_timeout afresh before any is taken for down"
                );
                self.stalled();
            }
            last = std::time::Instant::now();
            // A node just gone down is acted on at once; one down for long, at the jobs' pace.
            let down: std::collections::BTreeSet<String> =
                self.down_nodes(&[]).into_keys().collect();
            let news = down.iter().any(|n| !was_down.contains(n));
            for n in down.iter().filter(|n| !was_down.contains(*n)) {
                self.warn_unreachable(n);
            }
            was_down = down;
            if news || tick % SCAN_EVERY == 0 {
                if let Err(e) = self.mark_lost().await {
                    warn!(error = %e, "cannot look for lost jobs");
                }
                if let Err(e) = self.recover().await {
                    warn!(error = %e, "cannot restart failed jobs");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(TICK) => {}
                _ = stop.wait_for(|v| *v) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CoordinatorConfig;
    use crate::model::fixtures::job;
    use crate::registry::Registry;

    /// A node is down once silent for node_timeout, but not right after a stall of ckptd's
    /// own: the heartbeats it sent meanwhile may wait unread. It gets node_timeout afresh.
    #[tokio::test]
    async fn a_stall_of_ckptd_gives_every_node_its_node_timeout_afresh() {
        let d = tempfile::tempdir().unwrap();
        let reg = Registry::open(&d.path().join("r.redb")).unwrap();
        let cfg = CoordinatorConfig {
            node_timeout: Duration::from_secs(1),
            ..CoordinatorConfig::default()
        };
        let c = Coordinator::new(reg, cfg, None).unwrap();
        let at = crate::agents::Registration {
            address: "unix:/nonexistent/agent.sock".into(),
            ..Default::default()
        };
        c.agents
            .register("n1", at, ckpt_auth::transport::Dial::LocalOnly)
            .unwrap();
        assert!(c.down_nodes(&[]).is_empty(), "just heard from");
        std::thread::sleep(Duration::from_millis(1100));
        assert!(
            c.down_nodes(&[]).contains_key("n1"),
            "silent for node_timeout"
        );
        c.stalled();
        assert!(c.down_nodes(&[]).is_empty(), "ckptd was not running");
        std::thread::sleep(Duration::from_millis(1100));
        assert!(
            c.down_nodes(&[]).contains_key("n1"),
            "silent for node_timeout since"
        );
    }

    /// A coordinator restart in the middle of a restart takes the job back to where the
    /// restart began (the old incarnation's late reports are stale: a `--kill` checkpoint's
    /// SIGKILL is not a failure), marks its held parts to be killed as nodes register, and a
    /// start it interrupted leaves the job lost until an agent says what became of it.
    #[test]
    fn a_coordinator_restart_during_a_restart_goes_back_to_where_it_began() {
        let d = tempfile::tempdir().unwrap();
        let reg = Registry::open(&d.path().join("r.redb")).unwrap();
        let mut stopped = job(1, JobState::Stopped);
        stopped.begin_restart().unwrap();
        let mut starting = job(2, JobState::Starting);
        starting.incarnation = 1;
        let mut old = job(3, JobState::Restarting);
        old.before_restart = None;
        for j in [&stopped, &starting, &old] {
            reg.put_job(j).unwrap();
        }
        let c = Coordinator::new(reg, CoordinatorConfig::default(), None).unwrap();
        let state = |id| c.registry.job(id).unwrap().unwrap().state().clone();
        assert_eq!(state(1), JobState::Stopped);
        assert_eq!(state(2), JobState::Lost);
        assert_eq!(
            state(3),
            JobState::Lost,
            "a record from before ckpt kept it"
        );
        let mut j = c.registry.job(1).unwrap().unwrap();
        assert!(
            !j.observe(
                j.incarnation,
                JobState::Exited {
                    code: None,
                    signal: Some(9)
                }
            ),
            "the old incarnation's end is stale"
        );
        assert_eq!(j.failure(), None);
        let interrupted = c.interrupted.lock().unwrap().clone();
        assert_eq!(interrupted, [1, 3].into_iter().collect());
    }
}
