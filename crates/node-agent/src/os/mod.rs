//! The machine under the agent: what a step asks of the kernel and the node, with no protocol in
//! it. The freezer cgroups (`cgroup.rs`), `/proc` scans (`procfs.rs`), TCP sockets
//! (`sockdiag.rs`), a child born in a cgroup (`clone_into.rs`), a part's namespaces
//! (`sandbox.rs`, `sandbox/job_dir.rs`), acting as the job's owner and private modes
//! (`owner.rs`, `modes.rs`), the grants that let a moved part fetch a partner copy
//! (`grants.rs`), the nftables fence around DMTCP coordinators (`fence.rs`), background work at
//! the lowest CPU priority (`background.rs`), whether Slurm admits a job's owner to this node
//! (`slurm.rs`), and the `Host`
//! trait that the checkpoint and restore steps reach the machine through (`host.rs`, with a
//! recording fake in `host/fake.rs` for tests).
//!
//! Nothing here imports a layer above it: only other files of this folder and the crate's
//! error type (`error.rs`). Everything else in the crate may import from here.

pub(crate) mod background;
pub(crate) mod cgroup;
pub(crate) mod clone_into;
pub(crate) mod fence;
pub(crate) mod grants;
pub(crate) mod host;
pub(crate) mod modes;
pub(crate) mod owner;
pub(crate) mod procfs;
pub(crate) mod sandbox;
pub(crate) mod slurm;
pub(crate) mod sockdiag;
