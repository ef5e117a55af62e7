//! Errors of the agent's job operations. Each names the job, and where it helps the epoch, the
//! process or the file, and says what to do. The gRPC handler maps them to status codes.
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::engine::EngineError;
use crate::os::cgroup::CgroupError;

/// A failed agent operation.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The job is not known on this node.
    #[error("job {job} is not known on this node")]
    UnknownJob {
        /// Job id.
        job: u64,
    },
    /// A phase call arrived out of order.
    #[error("job {job} epoch {epoch}: {call} is not allowed now ({state})")]
    WrongPhase {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// The call.
        call: &'static str,
        /// What the node is doing instead.
        state: String,
    },
    /// The job is not running on this node.
    #[error("job {job} is not running on this node ({state})")]
    NotRunning {
        /// Job id.
        job: u64,
        /// What it is instead.
        state: String,
    },
    /// The job still has live processes.
    #[error("job {job} still has running processes on this node ({pids:?}); cancel it first")]
    StillRunning {
        /// Job id.
        job: u64,
        /// Its processes.
        pids: Vec<i32>,
    },
    /// PIDs needed by a restore are taken by other processes.
    #[error("job {job}: cannot restore, process or thread IDs {pids:?} are in use by other processes on this node (wait for them to exit, or restore on another node)")]
    PidsTaken {
        /// Job id.
        job: u64,
        /// Taken PIDs.
        pids: Vec<i32>,
    },
    /// Not enough room in staging.
    #[error("job {job}: staging {dir} has {free} bytes free but the checkpoint needs about {need}; free space or set local_dir to a larger file system")]
    NoRoom {
        /// Job id.
        job: u64,
        /// Staging directory.
        dir: PathBuf,
        /// Estimated need.
        need: u64,
        /// Available.
        free: u64,
    },
    /// A process uses InfiniBand verbs without an ib-quiesce channel.
    #[error("job {job}: process {pid} ({comm}) has {device} open or mapped but no ib-quiesce channel; a snapshot cannot contain HCA state. Run it with the verbs layer preloaded (LD_PRELOAD=libckpt_verbs.so, docs/infiniband.md), link its communication layer with ib-quiesce, or run it over TCP/shared memory (e.g. UCX_TLS=tcp,self,sm or OMPI_MCA_btl=tcp,self,vader)")]
    VerbsWithoutChannel {
        /// Job id.
        job: u64,
        /// Process.
        pid: i32,
        /// Its name.
        comm: String,
        /// Device path.
        device: String,
    },
    /// A process has the verbs layer, which did not reach this node's agent.
    #[error("job {job}: process {pid} ({comm}) has {device} open or mapped through the verbs layer, but the layer is not connected to this node's agent: its CKPT_IBQ_SOCKET is {found}, this agent's socket is {}. {}", .socket.display(), layer_hint(.found, .socket))]
    LayerNotConnected {
        /// Job id.
        job: u64,
        /// Process.
        pid: i32,
        /// Its name.
        comm: String,
        /// Device path.
        device: String,
        /// What the process has in CKPT_IBQ_SOCKET (or "unset").
        found: String,
        /// The agent's control socket.
        socket: PathBuf,
    },
    /// A process holds the RDMA connection manager, which nothing rebuilds after a snapshot.
    #[error("job {job}: process {pid} ({comm}) holds {device} as fd {fd}: connections of the RDMA connection manager cannot be taken through a checkpoint (neither ib-quiesce nor the verbs layer rebuilds them). For UCX set UCX_MODULES=^rdmacm (ckpt's RDMA settings in docs/infiniband.md do); the job runs on")]
    RdmaCmHeld {
        /// Job id.
        job: u64,
        /// Process.
        pid: i32,
        /// Its name.
        comm: String,
        /// Device path.
        device: String,
        /// The descriptor.
        fd: i32,
    },
    /// A process whose verbs layer (or ib-quiesce channel) answers holds a verbs device
    /// descriptor that the library did not open.
    #[error("job {job}: process {pid} ({comm}) holds {device} as fd {fd}, which its verbs layer (or ib-quiesce channel) did not open: the snapshot would contain HCA state that nothing releases before it or rebuilds after it. Open verbs devices only through libibverbs with the layer preloaded (no direct open of the device file, no second copy of libibverbs); the job runs on")]
    VerbsFdOutsideLayer {
        /// Job id.
        job: u64,
        /// Process.
        pid: i32,
        /// Its name.
        comm: String,
        /// Device path.
        device: String,
        /// The descriptor.
        fd: i32,
    },
    /// A process whose verbs layer (or ib-quiesce channel) answers maps a verbs device on which
    /// the library holds no descriptor.
    #[error("job {job}: process {pid} ({comm}) maps {device}, but its verbs layer (or ib-quiesce channel) holds no descriptor on that device: the mapping was made outside the layer (a second copy of libibverbs?), and the snapshot would contain HCA state that nothing releases or rebuilds; the job runs on")]
    VerbsMappedOutsideLayer {
        /// Job id.
        job: u64,
        /// Process.
        pid: i32,
        /// Its name.
        comm: String,
        /// Device path.
        device: String,
    },
    /// A process uses a verbs feature through the layer that nothing rebuilds after a snapshot.
    #[error("job {job}: process {pid} ({comm}) uses {feature} through the verbs layer, which cannot rebuild it after a snapshot; checkpoint when it is no longer in use (for multicast: after ibv_detach_mcast) or run without it (docs/infiniband.md); the job runs on")]
    UnsupportedVerbsFeature {
        /// Job id.
        job: u64,
        /// Process.
        pid: i32,
        /// Its name.
        comm: String,
        /// The feature, with the call that took it into use.
        feature: String,
    },
    /// An ib-quiesce channel failed a quiesce, rebuild or reconnect.
    #[error("job {job}: ib-quiesce channel of process {pid}: {message}")]
    Channel {
        /// Job id.
        job: u64,
        /// Process.
        pid: i32,
        /// What failed.
        message: String,
    },
    /// The snapshot engine failed.
    #[error("job {job}: {source}")]
    Engine {
        /// Job id.
        job: u64,
        /// Engine error.
        #[source]
        source: EngineError,
    },
    /// Freezing, thawing or killing failed.
    #[error("job {job}: {source}")]
    Cgroup {
        /// Job id.
        job: u64,
        /// Cgroup error.
        #[source]
        source: CgroupError,
    },
    /// Image storage failed (including a corrupt image).
    #[error("job {job}: {source}")]
    Store {
        /// Job id.
        job: u64,
        /// Storage error.
        #[source]
        source: ckpt_store::StoreError,
    },
    /// No shared storage to flush to or fetch from.
    #[error("job {job}: {problem}; set `shared_dir` in the agent config to the shared file system's mount")]
    NoShared {
        /// Job id.
        job: u64,
        /// What is missing.
        problem: String,
    },
    /// The node has not reached ckptd for longer than its lease: it starts no part (ckptd may
    /// be restarting its parts elsewhere) until it does.
    #[error("job {job}: node {node} has not reached ckptd for {}, past its lease of {} (ckptd.toml fence_lease): it starts no part until it does; see that it reaches ckptd", humantime::format_duration(*.since), humantime::format_duration(*.lease))]
    Fenced {
        /// Job id.
        job: u64,
        /// This node.
        node: String,
        /// Since ckptd last answered.
        since: std::time::Duration,
        /// The lease.
        lease: std::time::Duration,
    },
    /// Copying images to or from a partner node failed.
    #[error("job {job}: partner copy with node {node} failed: {message}")]
    Partner {
        /// Job id.
        job: u64,
        /// The other node.
        node: String,
        /// What happened.
        message: String,
    },
    /// Encoding a group's parity, or rebuilding a member's images from it, failed.
    #[error("job {job} epoch {epoch}: erasure-coded copy: {message}")]
    Erasure {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// What happened.
        message: String,
    },
    /// No copy of a node's images of an epoch can be restored: each source tried, and why not.
    #[error("job {job} epoch {epoch}: no usable copy of node {node}'s images ({tried}); restart from an earlier epoch (`ckptctl epochs {job}`)")]
    NoUsableCopy {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// This node.
        node: String,
        /// "local: <error>; shared: <error>".
        tried: String,
    },
    /// The manifest on this node is not the one the coordinator committed.
    #[error("job {job} epoch {epoch}: node manifest digest {found} does not match the committed {committed}; the images were replaced or damaged")]
    ManifestMismatch {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// Digest found.
        found: String,
        /// Digest committed.
        committed: String,
    },
    /// Starting the job or its shim failed.
    #[error("job {job}: {message}")]
    Start {
        /// Job id.
        job: u64,
        /// What failed.
        message: String,
    },
    /// A local file operation failed.
    #[error("job {job}: {what} {path}: {source}")]
    Io {
        /// Job id.
        job: u64,
        /// Step.
        what: &'static str,
        /// File.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A failpoint made the phase fail (see `failpoint`).
    #[error("job {job}: failure injected in phase {phase} (CKPT_FAILPOINTS)")]
    Injected {
        /// Job id.
        job: u64,
        /// Phase.
        phase: &'static str,
    },
    /// Something did not happen in time.
    #[error("job {job}: {what} did not finish within {waited:?}")]
    Timeout {
        /// Job id.
        job: u64,
        /// What was awaited.
        what: &'static str,
        /// How long.
        waited: Duration,
    },
    /// An address the job's connections used is not configured on this node.
    #[error("job {job}: cannot restore on node {node}: address {addr} used by the job's TCP connections is not configured here; restore on the node that had it at checkpoint time, or configure the address first")]
    AddressMissing {
        /// Job id.
        job: u64,
        /// This node.
        node: String,
        /// The address.
        addr: String,
    },
    /// A process of the job left the job's process tree, so the engine cannot reach it.
    #[error("job {job}: process {pid} ({comm}) is in the job but not below its root process {root} (it daemonized); the snapshot would miss it. For Open MPI, do not set plm_rsh_no_tree_spawn, or set OMPI_MCA_orte_leave_session_attached=1")]
    OutsideTree {
        /// Job id.
        job: u64,
        /// The process.
        pid: i32,
        /// Its command name.
        comm: String,
        /// The job's root on this node.
        root: i32,
    },
    /// A process of a user's job holds more than its user's rights: dumped, it would be
    /// restored with them.
    #[error("job {job}: process {pid} ({comm}) {why}; a checkpoint would restore those privileges, so it is refused: end that process before checkpointing (or run it outside the job)")]
    Privileged {
        /// Job id.
        job: u64,
        /// The process.
        pid: i32,
        /// Its command name.
        comm: String,
        /// What it holds.
        why: String,
    },
    /// A process of the job is stopped: the engine cannot seize it in the frozen cgroup.
    #[error("job {job}: process {pid} ({comm}) is {how}; a stopped process cannot be checkpointed (the engine would wait for it for ever inside the frozen job), so the checkpoint is refused and the job is left as it was: continue it (`kill -CONT {pid}`, or `scontrol resume` for a job Slurm suspended) and checkpoint again")]
    Stopped {
        /// Job id.
        job: u64,
        /// The process.
        pid: i32,
        /// Its command name.
        comm: String,
        /// "stopped (SIGSTOP or SIGTSTP)" or "stopped by a debugger or tracer".
        how: &'static str,
    },
    /// The epoch's images could not be restored: it is not sealed, so never committed.
    #[error("job {job}: epoch {epoch} is not committed: {why}. The job runs on, and the last committed checkpoint stays the restart point")]
    Unrestorable {
        /// Job id.
        job: u64,
        /// The epoch.
        epoch: u32,
        /// What its restore would miss.
        why: String,
    },
    /// A caller presented the wrong job secret.
    #[error("job {job}: wrong job token, or no such job on this node")]
    BadToken {
        /// Job id.
        job: u64,
    },
    /// A job (a launch, an attached part or a restore) would run as root, which this node
    /// does not allow.
    #[error("job {job}: node {node} refuses to run jobs as root (uid 0); run the job as an ordinary user, or set `allow_root_jobs = true` in the agent config")]
    RootRefused {
        /// Job id.
        job: u64,
        /// This node.
        node: String,
    },
    /// A job would run as a system account.
    #[error("job {job}: node {node} refuses to run jobs as uid {uid}: uids below {min_uid} are system accounts; run the job as an ordinary user, or lower `min_uid` in the agent config")]
    UidBelowMinimum {
        /// Job id.
        job: u64,
        /// This node.
        node: String,
        /// The job's uid.
        uid: u32,
        /// The configured `min_uid`.
        min_uid: u32,
    },
    /// `[slurm] enforce`: the job's owner holds no running Slurm job on this node.
    #[error("job {job}: node {node} runs jobs only for users with a running Slurm job on it ([slurm] enforce in its agent.toml), and uid {uid} has none there; run it from a Slurm batch job or allocation (sbatch, salloc) that includes {node}")]
    NoSlurmAllocation {
        /// Job id.
        job: u64,
        /// This node.
        node: String,
        /// The job's uid.
        uid: u32,
    },
    /// `[slurm] enforce`: Slurm could not be asked whether the owner holds a job here.
    #[error("job {job}: node {node} could not ask Slurm whether uid {uid} has a running job on it ([slurm] enforce in its agent.toml): {why}; nothing was started")]
    SlurmUnanswered {
        /// Job id.
        job: u64,
        /// This node.
        node: String,
        /// The job's uid.
        uid: u32,
        /// What went wrong.
        why: String,
    },
    /// `[slurm] adopt`: the part's processes cannot go into the owner's Slurm job here.
    #[error("job {job}: node {node} cannot put uid {uid}'s part into its Slurm job ([slurm] adopt in its agent.toml): {why}; nothing was started")]
    SlurmAdoption {
        /// Job id.
        job: u64,
        /// This node.
        node: String,
        /// The job's uid.
        uid: u32,
        /// What went wrong, and what to do.
        why: String,
    },
    /// The job's uid has no passwd entry on this node, so its groups are unknown.
    #[error("job {job}: uid {uid} has no passwd entry on node {node} (its groups come from there); add the user to this node (or its directory service)")]
    UnknownUser {
        /// Job id.
        job: u64,
        /// This node.
        node: String,
        /// The job's uid.
        uid: u32,
    },
    /// A checkpoint does not say whose job it is, and this node has no record of it.
    #[error("job {job} epoch {epoch}: the checkpoint does not record the job's owner (it was taken by an older agent) and node {node} has no record of the job; restart from a newer epoch")]
    OwnerUnknown {
        /// Job id.
        job: u64,
        /// Epoch.
        epoch: u32,
        /// This node.
        node: String,
    },
    /// A file of the job that a checkpoint saves or a restore puts back is not what it was
    /// (a symbolic link now, or another user's file): root does not touch it.
    #[error("job {job}: cannot {action} {path} as uid {uid}: {problem}")]
    FileRefused {
        /// Job id.
        job: u64,
        /// "save" (checkpoint) or "put back" (restore).
        action: &'static str,
        /// The file.
        path: String,
        /// The job's owner.
        uid: u32,
        /// What is wrong, and what to do.
        problem: String,
    },
    /// The job asks for a snapshot engine this node does not have, or its engine cannot do
    /// what was asked.
    #[error("job {job}: node {node}: {problem}")]
    NoEngine {
        /// Job id.
        job: u64,
        /// This node.
        node: String,
        /// What is missing, and what to do.
        problem: String,
    },
}

/// What to do about a verbs layer that is not connected: where it has this agent's socket, the
/// agent refused it (or it has not connected yet); else it was given another node's.
fn layer_hint(found: &str, socket: &std::path::Path) -> &'static str {
    if std::path::Path::new(found) == socket {
        "The agent refused its connection (its log says why, at \"ib-quiesce channel refused\"), or the process has not connected yet: if the job just started, try again in a few seconds"
    } else {
        "MPI launchers that copy the environment to other nodes (MPICH's Hydra does) need every agent to use the same state_dir (the default, /var/lib/ckpt/agent)"
    }
}

/// Maps an I/O error of step `what` on `path` to [`AgentError::Io`].
pub(crate) fn io_err(
    job: u64,
    what: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> AgentError {
    let path = path.to_path_buf();
    move |source| AgentError::Io {
        job,
        what,
        path,
        source,
    }
}

#[cfg(test)]
mod layer_tests {
    use super::*;

    /// The refusal of a verbs layer that is not connected says what to check: the agent's
    /// log when the layer has this agent's socket, the state_dir when it has another.
    #[test]
    fn a_layer_not_connected_is_told_what_to_check() {
        let e = |found: &str| {
            AgentError::LayerNotConnected {
                job: 1,
                pid: 2,
                comm: "a.out".into(),
                device: "/dev/infiniband/uverbs0".into(),
                found: found.into(),
                socket: PathBuf::from("/var/lib/ckpt/agent/ibq/control.sock"),
            }
            .to_string()
        };
        let same = e("/var/lib/ckpt/agent/ibq/control.sock");
        assert!(same.contains("ib-quiesce channel refused") && !same.contains("state_dir"));
        let other = e("/srv/ckpt/ibq/control.sock");
        assert!(other.contains("same state_dir") && !other.contains("refused"));
    }
}
