//! Storage for checkpoint images.
//!
//! This crate owns everything about how an epoch's images sit on disk and how their integrity is
//! proven: the node-local staging layout ([`layout`]), the per-node manifest format
//! ([`manifest`], documented in `docs/formats.md`), crash-safe file replacement ([`atomic`]), and
//! digesting and verifying image trees ([`digest`]), verified copies between stores ([`copy`]:
//! flush to shared storage and fetch back), the global commit record ([`commit`]) and the
//! erasure-coded parity of groups of nodes ([`erasure`]).
//! Every path and node name read from a file or a peer is checked ([`validate`]) before it is
//! joined onto a directory.
//!
//! Nothing here knows about processes or the protocol; the node agent writes images into a
//! directory given by [`layout::Staging`] and asks this crate to seal and verify them.
#![warn(missing_docs)]

pub mod atomic;
pub mod chain;
pub mod commit;
pub mod copy;
pub mod dedup;
pub mod digest;
pub mod erasure;
pub mod layout;
pub mod manifest;
pub mod stream;
#[doc(hidden)]
pub mod testdata;
pub mod trust;
pub mod validate;

#[cfg(test)]
mod decode_props;
mod error;
pub use error::StoreError;

/// Result type of this crate.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
