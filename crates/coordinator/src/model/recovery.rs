//! What ckptd does by itself when a job fails (`ckptctl run --on-failure`, ckptd.toml
//! `[recovery]`), and the record of what it did.
use serde::{Deserialize, Serialize};

use super::{Job, JobState, Trigger};

/// The most automatic restarts a job may ask for.
pub const MAX_RESTARTS: u32 = 100;
/// `--on-failure restart` without a count.
pub const DEFAULT_RESTARTS: u32 = 3;

/// A job's policy on failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum OnFailure {
    /// It stays failed (`lost`, `killed`) until a person restarts it.
    #[default]
    Stop,
    /// ckptd restarts it from its latest committed epoch, at most `max` times.
    Restart {
        /// Automatic restarts allowed over the job's life.
        max: u32,
    },
}

impl OnFailure {
    /// Parses `stop`, `restart` or `restart:N` (1 ≤ N ≤ [`MAX_RESTARTS`]).
    pub fn parse(text: &str) -> Result<OnFailure, String> {
        let t = text.trim();
        let usage = "`stop`, `restart` (at most 3 times) or `restart:N` (N from 1 to 100)";
        if t == "stop" {
            return Ok(OnFailure::Stop);
        }
        if t == "restart" {
            return Ok(OnFailure::Restart {
                max: DEFAULT_RESTARTS,
            });
        }
        let Some(n) = t.strip_prefix("restart:") else {
            return Err(format!("--on-failure {text:?}: expected {usage}"));
        };
        match n.parse::<i64>() {
            Ok(0) => Err(format!(
                "--on-failure {text:?}: restart:0 never restarts; say `stop` for that, or {usage}"
            )),
            Ok(n) if n < 0 => Err(format!(
                "--on-failure {text:?}: a count of restarts cannot be negative; expected {usage}"
            )),
            Ok(n) if n > MAX_RESTARTS as i64 => Err(format!(
                "--on-failure {text:?}: {n} restarts is more than {MAX_RESTARTS}: a job that fails that often needs a person; expected {usage}"
            )),
            Ok(n) => Ok(OnFailure::Restart { max: n as u32 }),
            Err(_) => Err(format!(
                "--on-failure {text:?}: {n:?} is not a number; expected {usage}"
            )),
        }
    }

    /// As `parse` reads it.
    pub fn text(&self) -> String {
        match self {
            OnFailure::Stop => "stop".into(),
            OnFailure::Restart { max } => format!("restart:{max}"),
        }
    }
}

/// One restart of a job: by ckptd itself (kept in the job's record), or any restart (kept in
/// the record of the epoch it restored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    /// When it began, its nodes placed (ms since the Unix epoch).
    pub at_unix_ms: u64,
    /// What failed or who asked, in words: "node n3 lost", "killed by signal 9", "ckptctl
    /// restart by uid 1000", "drain n2".
    pub trigger: String,
    /// Who or what asked: a user, a drain, or ckptd itself after a failure (None in records
    /// from before ckpt recorded it).
    #[serde(default)]
    pub trigger_kind: Option<Trigger>,
    /// The epoch restored.
    pub epoch: u32,
    /// Parts that went to other nodes, `OLD=NEW`.
    pub moves: Vec<String>,
    /// "restoring", "running again from epoch E", or "failed: why".
    pub outcome: String,
    /// When the failure happened: a lost node's last contact (0 for other failures and for
    /// restarts by hand).
    #[serde(default)]
    pub failed_unix_ms: u64,
    /// When ckptd noticed it: the node declared lost (0 likewise).
    #[serde(default)]
    pub noticed_unix_ms: u64,
    /// Every node restored, held (0 until then).
    #[serde(default)]
    pub restored_unix_ms: u64,
    /// Released: running again (0 until then).
    #[serde(default)]
    pub running_unix_ms: u64,
    /// The longest any node took to find, fetch and verify its images.
    #[serde(default)]
    pub fetch_ms: u64,
    /// The longest restore call to a node (its fetch included).
    #[serde(default)]
    pub restore_ms: u64,
}

impl Recovery {
    /// A restart of `epoch` just begun, asked for by `kind` (`trigger` in words).
    pub fn begun(
        kind: Trigger,
        trigger: String,
        epoch: u32,
        moves: Vec<String>,
        now_ms: u64,
    ) -> Recovery {
        Recovery {
            at_unix_ms: now_ms,
            trigger,
            trigger_kind: Some(kind),
            epoch,
            moves,
            outcome: "restoring".into(),
            failed_unix_ms: 0,
            noticed_unix_ms: 0,
            restored_unix_ms: 0,
            running_unix_ms: 0,
            fetch_ms: 0,
            restore_ms: 0,
        }
    }
}

impl Job {
    /// Whether ckptd may restart the job's parts elsewhere by itself (it has a restart
    /// policy): only such parts are fenced by their nodes when ckptd is out of reach, and only
    /// such a job is taken to `lost` by a node ckptd does not hear from.
    pub fn may_move(&self) -> bool {
        matches!(self.on_failure, OnFailure::Restart { .. })
    }

    /// Why the job failed in a way `--on-failure restart` acts on: a node lost, or a process
    /// killed by a signal ckpt did not send (a cancel, a `--kill` checkpoint and a drain leave
    /// other states). None otherwise.
    pub fn failure(&self) -> Option<String> {
        match &self.state {
            JobState::Lost => self.lost.as_ref().map(|l| format!("node {} lost", l.node)),
            JobState::Exited {
                signal: Some(s), ..
            } => Some(format!("killed by signal {s}")),
            // The launcher ended with an error after a rank was killed (MPICH's mpiexec, for
            // one, exits with the OR of every rank's status: "exit 15"). An end with code 0 is
            // the job's success whatever happened on the way.
            JobState::Exited {
                code: Some(1..), ..
            } if !self.killed.is_empty() => Some(self.killed.clone()),
            JobState::Exited { code: Some(c), .. }
                if ckpt_proto::FAILURE_SIGNALS.iter().any(|s| 128 + s == *c) =>
            {
                Some(format!(
                    "exited {c}: a process of it was killed by signal {}",
                    c - 128
                ))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::job;

    #[test]
    fn on_failure_reads_stop_and_restart_counts_and_names_what_is_wrong() {
        assert_eq!(OnFailure::parse("stop"), Ok(OnFailure::Stop));
        assert_eq!(
            OnFailure::parse("restart"),
            Ok(OnFailure::Restart { max: 3 })
        );
        assert_eq!(
            OnFailure::parse("restart:7"),
            Ok(OnFailure::Restart { max: 7 })
        );
        assert_eq!(OnFailure::parse("restart:7").unwrap().text(), "restart:7");
        for (bad, says) in [
            ("restart:0", "never restarts"),
            ("restart:-2", "cannot be negative"),
            ("restart:101", "more than 100"),
            ("restart:99999999999999999999", "not a number"),
            ("restart:x", "not a number"),
            ("again", "expected"),
        ] {
            let e = OnFailure::parse(bad).unwrap_err();
            assert!(e.contains(says) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn a_lost_node_and_a_kill_are_failures_a_cancel_or_a_clean_exit_are_not() {
        let mut j = job(1, JobState::Lost);
        assert_eq!(j.failure(), None, "lost track of, no node lost");
        j.lost = Some(super::super::LostNode {
            node: "n3".into(),
            since_unix_ms: 0,
            noticed_unix_ms: 0,
        });
        assert_eq!(j.failure().as_deref(), Some("node n3 lost"));
        let exited = |code, signal| job(1, JobState::Exited { code, signal });
        assert_eq!(
            exited(None, Some(9)).failure().as_deref(),
            Some("killed by signal 9")
        );
        assert!(exited(Some(137), None)
            .failure()
            .unwrap()
            .contains("signal 9"));
        assert!(exited(Some(139), None)
            .failure()
            .unwrap()
            .contains("signal 11"));
        for fine in [Some(0), Some(1), Some(143), Some(130)] {
            assert_eq!(exited(fine, None).failure(), None, "{fine:?}");
        }
        for state in [JobState::Cancelled, JobState::Stopped, JobState::Running] {
            assert_eq!(job(1, state).failure(), None);
        }
        // A launcher that ends with its own code after a node reported a rank killed.
        let mut j = exited(Some(15), None);
        j.killed = "heat (pid 7) killed by signal 9 on n2".into();
        assert_eq!(j.failure().as_deref(), Some(j.killed.as_str()));
        let mut j = job(1, JobState::Cancelled);
        j.killed = "heat (pid 7) killed by signal 9 on n2".into();
        assert_eq!(j.failure(), None, "ckpt killed it");
        let mut j = exited(Some(0), None);
        j.killed = "heat (pid 7) killed by signal 9 on n2".into();
        assert_eq!(j.failure(), None, "it ended well all the same");
    }

    #[test]
    fn a_restart_recorded_before_its_trigger_kind_reads_back_without_one() {
        let r = Recovery::begun(Trigger::Drain, "drain n2".into(), 2, vec![], 1);
        let mut v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["trigger_kind"], "drain");
        v.as_object_mut().unwrap().remove("trigger_kind");
        let old: Recovery = serde_json::from_value(v).unwrap();
        assert_eq!(old.trigger_kind, None);
        assert_eq!(old.trigger, "drain n2");
    }
}
