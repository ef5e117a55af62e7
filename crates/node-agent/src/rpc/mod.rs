//! The agent's transport: what crosses the network to the coordinator and to other agents.
//! The Agent gRPC service (`grpc.rs`; the calls that move images and parity between nodes in
//! `images.rs`) and the agent's types on the wire (`wire.rs`);
//! registration and heartbeats (`heartbeat.rs`) and the lease the coordinator grants with them
//! (`lease.rs`), which the shims fence on; partner copies streamed between agents
//! (`partner.rs`); the epoch stream (`epoch.rs`), and epochs relayed by one agent to others
//! under the coordinator's grant (`relay.rs`).
//!
//! What it may import: `grpc.rs`, `wire.rs` and `heartbeat.rs` sit on top of the crate and may
//! import anything below them (the table, the steps, `launch/`, `copies/`, `os/`); nothing but
//! `lib.rs` imports them. `partner.rs` and `lease.rs` are the clients the steps and the shim
//! use: they import only `os/` and the crate's error type.

mod epoch;
pub(crate) mod fence;
pub(crate) mod grpc;
pub(crate) mod heartbeat;
mod images;
pub(crate) mod lease;
pub(crate) mod partner;
mod relay;
pub(crate) mod wire;
