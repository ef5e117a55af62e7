//! Generated types and gRPC stubs of the ckpt wire protocol (`proto/ckpt.proto`, package `ckpt.v1`),
//! and the words users see for the protocol's enums (the same on every side: agent, ckptd, ckptctl).

/// Version 1 of the protocol.
#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod v1 {
    tonic::include_proto!("ckpt.v1");
}

use v1::CopyLocation;

impl CopyLocation {
    /// Name shown to users: "local", "partner", "shared", or "unknown" (unspecified).
    pub fn name(self) -> &'static str {
        match self {
            CopyLocation::Unspecified => "unknown",
            CopyLocation::Local => "local",
            CopyLocation::Partner => "partner",
            CopyLocation::Shared => "shared",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::v1::*;

    #[test]
    fn enum_names_are_words_and_unknown_numbers_read_as_unspecified() {
        assert_eq!(CopyLocation::Partner.name(), "partner");
        // A number from a newer peer decodes as the default.
        let r = RestoreReply {
            source: 99,
            ..Default::default()
        };
        assert_eq!(r.source(), CopyLocation::Unspecified);
    }
}
