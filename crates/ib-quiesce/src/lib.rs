//! ib-quiesce: the in-process library that makes InfiniBand jobs checkpointable.
//!
//! A process snapshot cannot contain HCA state. A communication layer that creates its verbs
//! objects through a [`Channel`] gets them back as virtual identifiers (QP numbers, memory keys)
//! that stay valid while the channel drains, flushes and releases every object before a
//! snapshot ([`Channel::quiesce`]) and recreates them afterwards ([`Channel::rebuild`],
//! [`Channel::reconnect`]), with new real identifiers exchanged between peers.
//!
//! The device operations are the [`verbs::Verbs`] trait; [`fake`] is a recording in-process
//! fabric for tests without a device. The rdma-core backend, the C ABI and the control socket to
//! the node agent are not built yet; until they are, the node agent refuses to checkpoint any
//! process that maps `/dev/infiniband/*`, naming it.
#![warn(missing_docs)]

pub mod channel;
pub mod fake;
pub mod verbs;

pub use channel::{Channel, Endpoint, Error, QuiesceReport, State};

/// Path prefix of the verbs device files whose mappings make a process unsnapshottable without
/// an ib-quiesce channel.
pub const VERBS_DEVICE_PREFIX: &str = "/dev/infiniband/";
