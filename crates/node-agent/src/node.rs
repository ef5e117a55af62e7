//! The node: what this agent has and runs its jobs with, shared by the table ([`crate::jobs`])
//! and every step. Its name and directories (state, staging, shared storage), the freezer
//! cgroups' parent, the snapshot engines, the shim's binary, the launch policy and environment,
//! the ib-quiesce channels, the DMTCP fence, the lease, the exit watcher and the [`Host`] the
//! steps reach the machine through. It is set up once at start (by [`crate::jobs::Jobs::open`]
//! and its `with_*` calls) and holds no job's state: that is the table's.
//!
//! The steps that need no job's entry are its methods, each in the file of its resource:
//! copies (`copies/`), the TCP hold and lock (`part/tcp.rs`), the channels
//! (`checkpoint/channels.rs`), a restore's owner, files, shim and sandbox (`restore/`,
//! `launch/`); here only failpoints, engines and the sandbox's namespace path.

use std::path::PathBuf;
use std::sync::Arc;

use ckpt_store::copy::CopyOptions;
use ckpt_store::layout::Staging;

use crate::engine::{Engines, SnapshotEngine};
use crate::error::AgentError;
use crate::failpoint::{Action, Failpoints};
use crate::ibq::Channels;
use crate::os::cgroup::CgroupParent;
use crate::os::host::Host;
use crate::os::owner::LaunchPolicy;

/// The services of this node that every step uses.
#[derive(Debug)]
pub(crate) struct Node {
    /// This node's name.
    pub(crate) name: String,
    /// Where jobs' records, logs and run directories, the lease and the ib-quiesce control
    /// socket are kept.
    pub(crate) state_dir: PathBuf,
    /// Local staging: the images of this node's checkpoints.
    pub(crate) staging: Staging,
    /// The parent of the jobs' freezer cgroups.
    pub(crate) cgroups: CgroupParent,
    /// The default snapshot engine.
    pub(crate) engine: Arc<dyn SnapshotEngine>,
    /// Every engine this node has, by name (the default `engine` among them).
    pub(crate) engines: Engines,
    /// The binary started as `shim SPEC` for each part.
    pub(crate) shim_exe: PathBuf,
    /// The interface job addresses go on (sandboxes); none: this node runs no sandboxes.
    pub(crate) job_link: Option<String>,
    /// Faults the phases inject (tests).
    pub(crate) failpoints: Failpoints,
    /// What launches add to jobs' environments.
    pub(crate) launch_env: LaunchEnv,
    /// This node's cluster credential, for partner copies to and from other agents; none when
    /// embedded in a standalone ckptd.
    pub(crate) credential: Option<ckpt_auth::tls::Credential>,
    /// Shared storage epochs are flushed to; none: not configured.
    pub(crate) shared: Option<Staging>,
    /// How copies to and from shared storage run.
    pub(crate) copy_opts: CopyOptions,
    /// Jobs frozen on this node right now: flushes and partner copies wait while above zero.
    pub(crate) frozen: Arc<std::sync::atomic::AtomicUsize>,
    /// The ib-quiesce channels of job processes.
    pub(crate) channels: Arc<Channels>,
    /// Who may run jobs here.
    pub(crate) policy: LaunchPolicy,
    /// Whether Slurm must have given a job's owner this node (`[slurm] enforce`).
    pub(crate) slurm: crate::os::slurm::SlurmGate,
    /// Whether jobs here are pre-copied.
    pub(crate) precopy: crate::copies::precopy::chain::Mode,
    /// The fence around the jobs' DMTCP coordinators.
    pub(crate) fence: crate::os::fence::Fence,
    /// The node's lease from ckptd: parts are fenced once it runs out.
    pub(crate) lease: crate::rpc::lease::Keeper,
    /// The highest fence of a ckptd seen (calls, grants, heartbeat answers): calls from a ckptd
    /// that another replaced are refused ([`ckpt_proto::FenceGuard`]).
    pub(crate) leader_fence: Arc<ckpt_proto::FenceGuard>,
    /// Processes of jobs killed by a signal ([`crate::launch::exits`]).
    pub(crate) exits: Arc<crate::launch::exits::Exits>,
    /// What the checkpoint and restore steps ask of the machine ([`crate::os::host`]).
    pub(crate) host: Arc<dyn Host>,
}

impl Node {
    /// The network namespace of the job's sandbox on this node.
    pub(crate) fn netns(&self, job: u64) -> PathBuf {
        crate::os::sandbox::netns_path(&self.name, job)
    }

    /// Runs the failpoint of `phase`, if one is set (tests only; see [`crate::failpoint`]).
    pub(crate) async fn failpoint(&self, job: u64, phase: &'static str) -> Result<(), AgentError> {
        match self.failpoints.action(phase, &self.name) {
            None => Ok(()),
            Some(Action::Error) => Err(AgentError::Injected { job, phase }),
            Some(Action::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
        }
    }

    /// The engine called `name` ("": the default), or an error naming what this node has.
    pub(crate) fn engine_named(
        &self,
        job: u64,
        name: &str,
    ) -> Result<Arc<dyn SnapshotEngine>, AgentError> {
        self.engines
            .get(name)
            .cloned()
            .map_err(|problem| AgentError::NoEngine {
                job,
                node: self.name.clone(),
                problem,
            })
    }
}

/// What the agent adds to every job's environment so that its MPI launcher reaches other
/// nodes through ckpt (`launch/mod.rs` applies it).
#[derive(Debug, Clone, Default)]
pub struct LaunchEnv {
    /// The coordinator's agent-facing address (`CKPT_COORDINATOR`).
    pub coordinator: String,
    /// `ckpt-rsh`, if installed.
    pub launcher: Option<PathBuf>,
    /// The cluster CA certificate `ckpt-rsh` checks the daemons against (`CKPT_TLS_CA`); none
    /// when the coordinator is reached over a local socket.
    pub ca: Option<PathBuf>,
    /// Point Hydra and Open MPI at `launcher` unless the job chose a launcher itself.
    pub set_mpi_env: bool,
    /// The verbs layer put in front of every job's `LD_PRELOAD` (none: preloading is off, or
    /// this node has no RDMA device).
    pub verbs_layer: Option<PathBuf>,
    /// The mount points a sandboxed part keeps following (`[job_network] follow_mounts`).
    pub follow_mounts: Vec<PathBuf>,
}
