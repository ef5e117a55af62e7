//! `[slurm] enforce`: a node that Slurm schedules runs a job's part (a launch, an attached
//! part, a restore) only for a user who holds a running Slurm job on it, as Slurm's own
//! `pam_slurm_adopt` admits to a node only such users. Slurm answers (`squeue`): the node's
//! name must be Slurm's name for it. With `adopt` (the default), the part's processes then go
//! into that Slurm job's extern step ([`extern_step`]), where Slurm's accounting, limits and
//! `scancel` reach them.
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use crate::error::AgentError;

pub mod extern_step;
pub use extern_step::{ExternStep, StepCgroups};

/// How long Slurm may take to answer: slurmctld answers in milliseconds, and squeue gives up on
/// it after its `MessageTimeout` (10 s by default), once tried again.
const ASK_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether and how this node asks Slurm (`[slurm]` in agent.toml).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SlurmGate {
    /// Run a job's part (a launch, an attached part, a restore) only for a user who holds a
    /// running Slurm job on this node; `node_name` must be Slurm's name for it.
    pub enforce: bool,
    /// The slurm.conf that squeue reads (`SLURM_CONF`); Slurm's own default when `None`.
    pub conf: Option<PathBuf>,
    /// With `enforce`: put the part's processes into the user's Slurm job on this node (its
    /// extern step: slurm.conf needs `PrologFlags=contain` and `ProctrackType=proctrack/cgroup`
    /// on cgroup v1), so that Slurm accounts, limits and cancels them as its own.
    pub adopt: bool,
}

impl Default for SlurmGate {
    fn default() -> Self {
        SlurmGate {
            enforce: false,
            conf: None,
            adopt: true,
        }
    }
}

/// Where a part's processes go on a node that adopts them into Slurm: the extern step of the
/// owner's Slurm job, and its cgroups.
#[derive(Debug, Clone)]
pub struct SlurmPlace {
    /// The step (its slurmstepd).
    pub step: ExternStep,
    /// Its cgroups.
    pub cgroups: StepCgroups,
}

impl SlurmGate {
    /// Whether uid `uid` may run job `job`'s part on `node` (with `enforce`, only if Slurm has
    /// a running job of that user on the node), and, with `adopt`, where its processes go.
    pub async fn place(
        &self,
        job: u64,
        node: &str,
        uid: u32,
    ) -> Result<Option<SlurmPlace>, AgentError> {
        let held = self.admits(job, node, uid).await?;
        if !self.enforce || !self.adopt {
            return Ok(None);
        }
        let refuse = |why: String| AgentError::SlurmAdoption {
            job,
            node: node.to_string(),
            uid,
            why,
        };
        let slurm_job = match held.as_slice() {
            [one] => *one,
            many => {
                return Err(refuse(format!(
                    "uid {uid} holds {} Slurm jobs on this node ({}), and a part goes into one: run one Slurm job per node, or set [slurm] adopt = false",
                    many.len(),
                    many.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
                )))
            }
        };
        if !crate::os::cgroup::v1_freezer_mounted() {
            tracing::warn!(
                job,
                slurm_job,
                "[slurm] adopt: this node has no cgroup v1 freezer (cgroup v2 is not supported yet): the part runs beside its Slurm job"
            );
            return Ok(None);
        }
        let conf = self.conf.clone();
        let node_name = node.to_string();
        let asked = tokio::task::spawn_blocking(move || {
            let step = ExternStep::locate(conf.as_deref(), &node_name, slurm_job)?;
            let cgroups = step.cgroups(uid)?;
            Ok(SlurmPlace { step, cgroups })
        });
        // Bounded as a whole: slurmstepd answers in microseconds; a hung one must not hold the
        // job (its lock is held meanwhile).
        match tokio::time::timeout(ASK_TIMEOUT, asked).await {
            Ok(done) => done
                .map_err(|e| refuse(e.to_string()))?
                .map(Some)
                .map_err(refuse),
            Err(_) => Err(refuse(format!(
                "Slurm job {slurm_job}'s slurmstepd had no answer in {} s",
                ASK_TIMEOUT.as_secs()
            ))),
        }
    }

    /// The running Slurm jobs uid `uid` holds on `node` (none asked for without `enforce`);
    /// refused if it holds none.
    pub async fn admits(&self, job: u64, node: &str, uid: u32) -> Result<Vec<u64>, AgentError> {
        if !self.enforce {
            return Ok(Vec::new());
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
        let jobs = held(&String::from_utf8_lossy(&out.stdout));
        if !jobs.is_empty() {
            Ok(jobs)
        } else {
            Err(AgentError::NoSlurmAllocation {
                job,
                node: node.to_string(),
                uid,
            })
        }
    }
}

/// The jobs squeue's answer names (`--format=%A`: one job id a line, an array's element by
/// its own id).
fn held(answer: &str) -> Vec<u64> {
    let mut jobs: Vec<u64> = answer
        .lines()
        .filter_map(|id| id.trim().parse().ok())
        .collect();
    jobs.sort_unstable();
    jobs.dedup();
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_answer_naming_a_job_admits() {
        assert_eq!(held("42\n"), vec![42]);
        assert_eq!(held("  9\n7\n9\n"), vec![7, 9]);
        assert!(held("").is_empty());
        assert!(held("\n").is_empty());
        assert!(held("squeue: error: Invalid user: 12345\n").is_empty());
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
            ..Default::default()
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
