//! ib-quiesce: the in-process library that makes InfiniBand jobs checkpointable.
//!
//! Not implemented yet. Until it is, the node agent refuses to checkpoint any process that maps
//! `/dev/infiniband/*` (see `node-agent`'s initial synchronization), naming the process, because a
//! process snapshot cannot contain HCA state. The marker below is what the agent checks for.
#![warn(missing_docs)]

/// Path prefix of the verbs device files whose mappings make a process unsnapshottable without
/// an ib-quiesce channel.
pub const VERBS_DEVICE_PREFIX: &str = "/dev/infiniband/";
