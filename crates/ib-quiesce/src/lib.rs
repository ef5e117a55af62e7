//! ib-quiesce: the in-process library that makes InfiniBand jobs checkpointable.
//!
//! A process snapshot cannot contain HCA state. A communication layer that creates its verbs
//! objects through a [`Channel`] gets them back as virtual identifiers (QP numbers, memory keys)
//! that stay valid while the channel drains, flushes and releases every object before a
//! snapshot ([`Channel::quiesce`]) and recreates them afterwards ([`Channel::rebuild`],
//! [`Channel::reconnect`]), with new real identifiers exchanged between peers.
//!
//! The device operations are the [`verbs::Verbs`] trait: [`rdma::Rdma`] is the rdma-core
//! backend, [`fake`] a recording in-process fabric for tests without a device. Under a ckpt
//! agent, [`control`] connects a process's channel to the agent, which drives quiesce and
//! rebuild around each checkpoint. C, C++ and Fortran code use the C interface ([`capi`],
//! `include/ib_quiesce.h`, `libib_quiesce.so`).
//!
//! The node agent refuses to checkpoint a process that maps `/dev/infiniband/*` without a
//! channel, naming it.
#![warn(missing_docs)]

pub mod capi;
pub mod channel;
pub mod control;
pub mod dirty;
pub mod fake;
mod kernel;
pub mod rdma;
pub mod verbs;

pub use channel::{Channel, Endpoint, Error, QuiesceReport, State};

/// Path prefix of the verbs device files whose mappings make a process unsnapshottable without
/// an ib-quiesce channel.
pub const VERBS_DEVICE_PREFIX: &str = "/dev/infiniband/";
