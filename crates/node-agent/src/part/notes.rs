//! The notes a part's dump writes for its restore, typed. They travel in the node manifest's
//! `notes`, a map of strings (the committed format, which records written before still read
//! as they are); only this module knows their keys and how each value is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::os::sandbox::JobAddress;

/// The uid of the job's owner.
const OWNER: &str = "owner_uid";
/// The directories the engine's restore creates files in by path, one per line.
const GUARD_PATHS: &str = "guard_paths";
/// The part's job address (`ADDR/PREFIX`).
const SANDBOX_ADDRESS: &str = "sandbox_address";
/// The job network's gateway, if any.
const SANDBOX_GATEWAY: &str = "sandbox_gateway";
/// The processes whose verbs channels were down at the dump, comma-separated.
const CHANNELS: &str = "ibq_channels";

/// What a restore reads of a part's epoch notes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PartNotes {
    /// The job's owner at the dump: a restore puts files back as that user, and checks that
    /// the node still lets it run jobs. None in records that predate it.
    pub owner: Option<u32>,
    /// The directories the engine's restore creates files in by path (named sockets, files
    /// the job held and those beside them, working directories).
    pub guard_paths: Vec<PathBuf>,
    /// The part's job address and the job network's gateway (empty if none), where it ran in
    /// a sandbox.
    pub sandbox: Option<(String, String)>,
    /// The processes whose channels must be rebuilt after a restore.
    pub channels: Vec<i32>,
}

impl PartNotes {
    /// The notes of `notes` (a manifest's), each absent or unreadable one left at its default.
    pub(crate) fn read(notes: &BTreeMap<String, String>) -> PartNotes {
        PartNotes {
            owner: notes.get(OWNER).and_then(|v| v.parse().ok()),
            guard_paths: notes
                .get(GUARD_PATHS)
                .map(|t| {
                    t.lines()
                        .filter(|l| l.starts_with('/'))
                        .map(PathBuf::from)
                        .collect()
                })
                .unwrap_or_default(),
            sandbox: notes.get(SANDBOX_ADDRESS).map(|a| {
                let gateway = notes.get(SANDBOX_GATEWAY).cloned().unwrap_or_default();
                (a.clone(), gateway)
            }),
            channels: notes
                .get(CHANNELS)
                .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
                .unwrap_or_default(),
        }
    }

    /// Notes the job's owner.
    pub(crate) fn write_owner(notes: &mut BTreeMap<String, String>, uid: u32) {
        notes.insert(OWNER.into(), uid.to_string());
    }

    /// Notes the directories the engine's restore creates files in.
    pub(crate) fn write_guard_paths(notes: &mut BTreeMap<String, String>, dirs: &[String]) {
        notes.insert(GUARD_PATHS.into(), dirs.join("\n"));
    }

    /// Notes the part's job address and the network's gateway.
    pub(crate) fn write_sandbox(notes: &mut BTreeMap<String, String>, a: &JobAddress) {
        notes.insert(SANDBOX_ADDRESS.into(), a.cidr());
        if let Some(g) = a.gateway {
            notes.insert(SANDBOX_GATEWAY.into(), g.to_string());
        }
    }

    /// Notes the processes whose channels are down.
    pub(crate) fn write_channels(notes: &mut BTreeMap<String, String>, pids: &[i32]) {
        let text: Vec<String> = pids.iter().map(i32::to_string).collect();
        notes.insert(CHANNELS.into(), text.join(","));
    }

    /// The part's job address, where it ran in a sandbox.
    pub(crate) fn sandbox(&self) -> Result<Option<JobAddress>, String> {
        self.sandbox
            .as_ref()
            .map(|(cidr, gateway)| JobAddress::parse(cidr, gateway))
            .transpose()
    }

    /// The directories to guard against links during the engine's restore (`shim/guard.rs`):
    /// for each of [`PartNotes::guard_paths`], the first one on the way to it that a user
    /// controls; those below another are left out (its guard covers them).
    pub(crate) fn guards(&self) -> Vec<PathBuf> {
        let mut found: Vec<PathBuf> = self
            .guard_paths
            .iter()
            .filter_map(|d| ckpt_store::trust::untrusted_prefix(Path::new(d)))
            .collect();
        found.sort();
        found.dedup();
        let mut top: Vec<PathBuf> = Vec::new();
        for d in found {
            if !top.iter().any(|t| d.starts_with(t)) {
                top.push(d);
            }
        }
        top
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_dump_writes_its_restore_reads() {
        let mut notes = BTreeMap::new();
        PartNotes::write_owner(&mut notes, 1000);
        PartNotes::write_guard_paths(&mut notes, &["/tmp/a".into(), "/home/u/run".into()]);
        PartNotes::write_channels(&mut notes, &[41, 42]);
        let a = JobAddress::parse("10.9.0.5/24", "10.9.0.1").unwrap();
        PartNotes::write_sandbox(&mut notes, &a);
        let read = PartNotes::read(&notes);
        assert_eq!(read.owner, Some(1000));
        assert_eq!(
            read.guard_paths,
            [PathBuf::from("/tmp/a"), PathBuf::from("/home/u/run")]
        );
        assert_eq!(read.channels, [41, 42]);
        assert_eq!(read.sandbox().unwrap(), Some(a));
    }

    /// The keys and value formats are the committed ones: a manifest written before this type
    /// reads the same.
    #[test]
    fn a_record_of_an_older_agent_reads_as_it_was_written() {
        let notes: BTreeMap<String, String> = [
            ("owner_uid", "1001"),
            ("guard_paths", "/tmp/x\nnot-absolute\n/var/tmp/y"),
            ("sandbox_address", "10.9.0.7/24"),
            ("ibq_channels", "7, 8,x"),
            ("precopy_links", "2"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let read = PartNotes::read(&notes);
        assert_eq!(read.owner, Some(1001));
        assert_eq!(
            read.guard_paths,
            [PathBuf::from("/tmp/x"), PathBuf::from("/var/tmp/y")]
        );
        assert_eq!(read.sandbox, Some(("10.9.0.7/24".into(), String::new())));
        assert_eq!(read.channels, [7, 8]);
        assert_eq!(PartNotes::read(&BTreeMap::new()), PartNotes::default());
        let bad = PartNotes {
            sandbox: Some(("not an address".into(), String::new())),
            ..PartNotes::default()
        };
        assert!(bad.sandbox().is_err());
    }
}
