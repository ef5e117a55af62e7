//! ckptd, the global checkpoint coordinator, as a library.
//!
//! [`model`] holds jobs and epochs with their guarded transitions, [`registry`] persists them in
//! redb, [`driver`] runs the checkpoint protocol, restarts and the background work on committed
//! epochs over the registered [`agents`], and [`grpc`] serves it: the Control service to ckptctl
//! over a Unix socket, the Registry service to agents over TCP, with [`wire`] giving the forms
//! of jobs and epochs it sends; [`metrics`] counts what happens for Prometheus. [`server::run`] is the whole
//! daemon; the `ckptd` crate starts it.
#![warn(missing_docs)]

pub mod agents;
pub mod config;
pub mod driver;
pub mod grpc;
pub mod link;
pub mod metrics;
pub mod model;
pub mod registry;
pub mod relay;
pub mod server;
pub mod wire;
