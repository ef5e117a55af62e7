//! Generated types and gRPC stubs of the ckpt wire protocol (`proto/ckpt.proto`, package `ckpt.v1`).
#![allow(missing_docs, missing_debug_implementations, clippy::all)]

/// Version 1 of the protocol.
pub mod v1 {
    tonic::include_proto!("ckpt.v1");
}
