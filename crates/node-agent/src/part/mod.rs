//! What a part of a job holds that its checkpoint saves and its restore brings back, one
//! module per kind of thing, its save and its restore side by side: the records a dump writes
//! for its restore ([`notes`]), so that `restore/` reads them without reaching into
//! `checkpoint/`, and the part's TCP connections ([`tcp`]: noted at the dump, locked for a
//! kill, held and cleared at a restart). `checkpoint/` and `restore/` call in; nothing here
//! calls them.

pub(crate) mod notes;
pub(crate) mod tcp;

/// Where an epoch's node directory keeps the part's own stdout and stderr as they were at the
/// checkpoint: a restore on a node whose job directory has none (the part moved, or its node's
/// disks were lost) puts them back from there, rather than as zeros of the same length.
pub(crate) const OUTPUTS_DIR: &str = "outputs";
