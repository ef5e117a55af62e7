//! ckptd, the global checkpoint coordinator, as a library.
//!
//! [`model`] holds jobs and epochs with their guarded transitions, [`registry`] persists them in
//! redb, [`driver`] runs the checkpoint protocol, restarts and the background work on committed
//! epochs over the registered [`agents`], and [`grpc`] serves it: the Control service to ckptctl
//! over a Unix socket, the Registry service to agents over TCP, with [`wire`] giving the forms
//! of jobs and epochs it sends; [`metrics`] counts what happens for Prometheus. [`server::run`] is the whole
//! daemon; the `ckptd` crate starts it.
//!
//! The modules depend on each other in one direction (`scripts/modgraph.py` checks that no two
//! reach each other): [`model`], [`clock`] and [`metrics`] at the bottom; [`config`] and
//! [`registry`] over the model; [`agents`] (which keeps links open between epochs); then
//! [`driver`]; [`grpc`] and [`server`] on top. [`failure`], [`link`] and [`relay`] come from
//! the `epoch-link` crate, which relay agents share.
#![warn(missing_docs)]

pub mod agents;
pub mod config;
pub mod driver;
pub mod grpc;
pub mod metrics;
pub mod model;
pub mod registry;
pub mod server;
pub mod wire;

pub use epoch_link::{failure, link, relay};
