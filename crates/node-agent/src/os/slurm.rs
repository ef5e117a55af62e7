//! `[slurm] enforce`: a node that Slurm schedules runs a job's part (a launch, an attached
//! part, a restore) only for a user who holds a running Slurm job on it, as Slurm's own
//! `pam_slurm_adopt` admits to a node only such users. Slurm answers (`squeue`): the node's
//! name must be Slurm's name for it.
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use crate::error::AgentError;

/// How long Slurm may take to answer: slurmctld answers in milliseconds, and squeue gives up on
/// it after its `MessageTimeout` (10 s by default), once tried again.
const ASK_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether and how this node asks Slurm (`[slurm]` in agent.toml).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SlurmGate {
    /// Run a job's part (a launch, an attached part, a restore) only for a user who holds a
    /// running Slurm job on this node; `node_name` must be Slurm's name for it.
    pub enforce: bool,
    /// The slurm.conf that squeue reads (`SLURM_CONF`); Slurm's own default when `None`.
    pub conf: Option<PathBuf>,
}

impl SlurmGate {
    /// Whether uid `uid` may run job `job`'s part on `node`: with `enforce`, only if Slurm has a
    /// running job of that user on the node.
    pub async fn admits(&self, job: u64, node: &str, uid: u32) -> Result<(), AgentError> {
        if !self.enforce {
            return Ok(());
        }
        let unanswered = |why: String| AgentError::SlurmUnanswered {
            job,
            node: node.to_string(),
            uid,
            why,
        };
        let mut cmd = tokio::process::Command::new("squeue");
        cmd.args(["--noheader", "--states=RUNNING", "--format=%A"])
            .args(["--nodelist", node, "--user", &uid.to_string()])
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if let Some(c) = &self.conf {
            cmd.env("SLURM_CONF", c);
        }
        let out = tokio::time::timeout(ASK_TIMEOUT, cmd.output())
            .await
            .map_err(|_| {
                unanswered(format!(
                    "squeue had no answer in {} s",
                    ASK_TIMEOUT.as_secs()
                ))
            })?
            .map_err(|e| {
                unanswered(format!(
                    "cannot run squeue ({e}): install slurm-client on this node"
                ))
            })?;
        if !out.status.success() {
            return Err(unanswered(format!(
                "squeue failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        if held(&String::from_utf8_lossy(&out.stdout)) {
            Ok(())
        } else {
            Err(AgentError::NoSlurmAllocation {
                job,
                node: node.to_string(),
                uid,
            })
        }
    }
}

/// Whether squeue's answer (`--format=%A`, one job id a line) names a job.
fn held(answer: &str) -> bool {
    answer
        .lines()
        .map(str::trim)
        .any(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit() || b == b'_'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_answer_naming_a_job_admits() {
        assert!(held("42\n"));
        assert!(held("  7\n9\n"));
        assert!(!held(""));
        assert!(!held("\n"));
        assert!(!held("squeue: error: Invalid user: 12345\n"));
    }

    #[tokio::test]
    async fn a_node_that_does_not_enforce_does_not_ask() {
        let gate = SlurmGate::default();
        assert!(gate.admits(1, "n1", 1000).await.is_ok());
    }

    #[tokio::test]
    async fn a_node_that_cannot_ask_slurm_refuses_and_says_why() {
        // A slurm.conf that names no controller: squeue fails (or is missing here); either
        // way nothing runs, and the refusal says Slurm could not be asked.
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("slurm.conf");
        std::fs::write(&conf, "ClusterName=none\n").unwrap();
        let gate = SlurmGate {
            enforce: true,
            conf: Some(conf),
        };
        let e = gate.admits(3, "n1", 1000).await.unwrap_err();
        assert!(matches!(e, AgentError::SlurmUnanswered { .. }), "{e}");
        let m = e.to_string();
        assert!(
            m.contains("could not ask Slurm") && m.contains("nothing was started"),
            "{m}"
        );
    }
}
