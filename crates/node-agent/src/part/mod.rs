//! What a part of a job holds that its checkpoint saves and its restore brings back, one
//! module per kind of thing. The records a dump writes for its restore ([`notes`]) are here,
//! so that `restore/` reads them without reaching into `checkpoint/`. Imports `os/` and
//! `ckpt-store` only.

pub(crate) mod notes;

/// Where an epoch's node directory keeps the part's own stdout and stderr as they were at the
/// checkpoint: a restore on a node whose job directory has none (the part moved, or its node's
/// disks were lost) puts them back from there, rather than as zeros of the same length.
pub(crate) const OUTPUTS_DIR: &str = "outputs";
