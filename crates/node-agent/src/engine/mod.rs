//! Snapshot engines: what turns a job's process tree into image files and back.
//!
//! The agent speaks to an engine only through [`SnapshotEngine`]; [`criu::Criu`] drives the
//! `criu` binary on a tree the agent froze, [`dmtcp::Dmtcp`] the job's own DMTCP coordinator
//! (DMTCP suspends the processes itself). Dumps run in the agent (blocking; call from
//! `spawn_blocking`); restores are run by the job's shim, which must be the restored tree's
//! ancestor to reap it, so the engine only supplies the command line.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ckpt_proto::Engine;

pub mod criu;
pub mod criu_images;
pub mod criu_rpc;
pub mod dmtcp;
pub mod stop;

pub use stop::EngineStop;

/// What to dump.
#[derive(Debug, Clone)]
pub struct DumpSpec<'a> {
    /// Root of the process tree.
    pub root_pid: i32,
    /// Empty directory for the images.
    pub images_dir: &'a Path,
    /// Cgroup holding the (already frozen) tree.
    pub cgroup: &'a Path,
    /// Where the engine writes its log.
    pub log_file: &'a Path,
    /// Inode of the tree's own network namespace (a job sandbox's): the engine leaves it out
    /// of the images, the restore is given a new one.
    pub external_netns: Option<u64>,
    /// The pre-dump below this dump, relative to `images_dir` (e.g. `../pre/2`): only pages
    /// written since it are dumped. None: every page.
    pub parent: Option<&'a str>,
    /// Reset the kernel's dirty-page tracking after the dump, so that the next pre-dump or
    /// dump on top of this one finds the pages written since.
    pub track_mem: bool,
    /// The job's session directory on this node (engines that need one, see
    /// [`SnapshotEngine::launch_argv`]): its owner's, never followed through a link.
    pub session: Option<&'a Path>,
    /// The uid the job runs as.
    pub owner: Option<u32>,
    /// The mount namespace (device, inode) a guarded restore made for the tree
    /// (`shim/guard.rs`), which the engine enters to dump it; a namespace the tree is in that is
    /// not this one (one a user made) is never entered.
    pub guarded_ns: Option<(u64, u64)>,
    /// How an abort or a cancel ends this dump while it runs (None: it cannot be ended).
    pub stop: Option<&'a EngineStop>,
}

/// What to restore.
#[derive(Debug, Clone)]
pub struct RestoreSpec<'a> {
    /// Directory with verified images.
    pub images_dir: &'a Path,
    /// Where the engine writes its log.
    pub log_file: &'a Path,
    /// Where the engine writes the PID of the restored root.
    pub pid_file: &'a Path,
    /// The tree goes into the network namespace open on this descriptor (a job sandbox's).
    pub netns_fd: Option<i32>,
    /// A sandbox's job directory mount is bound to this directory of the node.
    pub job_dir: Option<&'a Path>,
    /// The job's cgroups here, as the engine names them (the freezer's first; a cgroup Slurm
    /// lent has one in each hierarchy it uses): the tree goes there whatever cgroups it was
    /// dumped from (a part moved from a node whose agent names cgroups differently, or from
    /// another Slurm job).
    pub cgroup_roots: Vec<String>,
    /// A program the engine runs once every process is rebuilt and before any of them runs
    /// again; a non-zero exit makes the engine kill the tree and fail. The agent's restore gate
    /// ([`crate::restore::gate`]): it waits for the verification of the files the engine reads
    /// while the restore runs ([`SnapshotEngine::memory_only`]).
    pub gate: Option<&'a Path>,
    /// The restored job's session directory (engines that restore as the job's owner).
    pub session: Option<&'a Path>,
    /// The port of the engine's own coordinator (engines that have one; None: any).
    pub coordinator_port: Option<u16>,
}

/// The standard output of `<path> --version`; a missing binary is [`EngineError::NotFound`]
/// with `hint` (what to install or configure).
fn version_text(
    engine: &'static str,
    path: &str,
    hint: &'static str,
) -> Result<String, EngineError> {
    let out = std::process::Command::new(path)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => {
                EngineError::NotFound {
                    engine,
                    path: path.to_string(),
                    hint,
                }
            }
            _ => EngineError::Spawn {
                path: path.to_string(),
                source,
            },
        })?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Engine failures, each naming the binary or the log to read.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine binary is missing.
    #[error("{engine} not found at {path}: {hint}")]
    NotFound {
        /// Engine.
        engine: &'static str,
        /// Path tried.
        path: String,
        /// What to do.
        hint: &'static str,
    },
    /// The engine is older than supported.
    #[error("criu at {path} is version {version}, ckpt needs >= {min} (older versions fail on this kernel): run scripts/setup.sh or set [criu] path to a newer criu")]
    TooOld {
        /// Binary.
        path: String,
        /// Version found.
        version: String,
        /// Minimum version.
        min: &'static str,
    },
    /// `criu check` failed.
    #[error("`{path} check` failed: {output}")]
    CheckFailed {
        /// Binary.
        path: String,
        /// What it printed.
        output: String,
    },
    /// The binary could not be started.
    #[error("cannot run {path}: {source}")]
    Spawn {
        /// Binary.
        path: String,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A dump, pre-dump or restore failed.
    #[error("{engine} {op} failed ({status}): {summary} (full log: {})", log.display())]
    Failed {
        /// "criu" or "dmtcp".
        engine: &'static str,
        /// "dump", "pre-dump", "restore" (CRIU); "checkpoint", "restart" (DMTCP).
        op: &'static str,
        /// Exit status text.
        status: String,
        /// The log's error lines.
        summary: String,
        /// The log file.
        log: PathBuf,
    },
    /// A dump was ended by the agent: its epoch was aborted or its job cancelled.
    #[error("{engine} {op} was stopped: its epoch was aborted (a phase deadline passed, or another node failed) or the job was cancelled (log so far: {})", log.display())]
    Stopped {
        /// "criu" or "dmtcp".
        engine: &'static str,
        /// "dump".
        op: &'static str,
        /// The log file.
        log: PathBuf,
    },
}

impl EngineError {
    /// Whether it failed for lack of room where it wrote (ENOSPC): a failed run of the engine
    /// says so only in its log's words (`strerror(ENOSPC)`, which its summary carries), so
    /// that is read here, once, for every caller.
    pub fn no_room(&self) -> bool {
        let enospc = std::io::Error::from_raw_os_error(libc::ENOSPC).to_string();
        match self {
            EngineError::Failed { summary, .. } => {
                // "No space left on device (os error 28)": the words before the number.
                let words = enospc.split(" (os error").next().unwrap_or(&enospc);
                summary.contains(words)
            }
            EngineError::Spawn { source, .. } => source.raw_os_error() == Some(libc::ENOSPC),
            _ => false,
        }
    }
}

/// The directory of an engine's session that a restore links the images into, for an
/// engine that restores as the job's owner.
pub const SESSION_IMAGES: &str = "images";

/// What the agent saves beside the images of an engine that lets the job run on
/// ([`SnapshotEngine::beside`]); every file is put back as the job's owner.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Beside {
    /// Image files (relative to the images directory) that the engine's restart reads at the
    /// absolute path given, where the job's processes recorded them.
    pub put_back: Vec<(String, PathBuf)>,
    /// Directories of the job's own files (the owner's) to save as they are after the dump.
    pub trees: Vec<PathBuf>,
    /// Files in those directories that the engine saved itself, at the dump: not saved again.
    pub skip: BTreeSet<PathBuf>,
}

/// A snapshot engine.
pub trait SnapshotEngine: Send + Sync + Debug {
    /// Engine name recorded in manifests ("criu", "dmtcp").
    fn name(&self) -> &str;
    /// Engine version recorded in manifests.
    fn version(&self) -> &str;
    /// Whether the agent freezes the job's cgroup for the dump (true), or the engine suspends
    /// the processes itself and lets them run on when it is done (false).
    fn freezes(&self) -> bool {
        true
    }
    /// The command line that starts `argv` as a job under this engine, with `session` (a
    /// directory of the job's owner's on this node) for its own files and `port` for its own
    /// coordinator, if it has one (None: any); may add to `env`. Engines that snapshot any
    /// tree leave it as it is.
    fn launch_argv(
        &self,
        argv: Vec<String>,
        env: &mut BTreeMap<String, String>,
        session: &Path,
        port: Option<u16>,
    ) -> Vec<String> {
        let _ = (env, session, port);
        argv
    }
    /// Whether the engine runs a coordinator of its own for each job, on a TCP port.
    fn has_coordinator(&self) -> bool {
        false
    }
    /// Subdirectories of the session that the job's owner gets at launch and at restore, for
    /// the job's own files beside the engine's.
    fn session_subdirs(&self) -> &'static [&'static str] {
        &[]
    }
    /// After a dump that let the job run on: what the agent saves beside the images it
    /// wrote into `images_dir`, and what a restore puts back into `session` before the
    /// engine starts. Blocking.
    fn beside(&self, images_dir: &Path, session: &Path) -> Beside {
        let _ = (images_dir, session);
        Beside::default()
    }
    /// Whether this engine's job with `session` can be snapshot now (every process running
    /// under it); the reason if not. Blocking.
    fn running(&self, session: &Path, owner: u32) -> Result<(), String> {
        let _ = (session, owner);
        Ok(())
    }
    /// Dumps the tree: frozen by the agent, and left frozen, if [`SnapshotEngine::freezes`];
    /// else the engine suspends and resumes it. Blocking.
    fn dump(&self, spec: &DumpSpec<'_>) -> Result<(), EngineError>;
    /// Why this engine cannot pre-copy on this node (no pre-dumps, or the kernel does not
    /// track which pages were written); `Ok` if it can. Runs the engine: call once, at start.
    fn precopy_support(&self) -> Result<(), String> {
        Err(format!("the {} engine has no pre-dumps", self.name()))
    }
    /// Copies the memory of a running tree (its cgroup unfrozen) into `spec.images_dir`: the
    /// engine stops it only while it collects the pages, and resets dirty-page tracking, so a
    /// later pre-dump or dump with this one as its parent writes only what changed. Blocking.
    fn pre_dump(&self, spec: &DumpSpec<'_>) -> Result<(), EngineError> {
        Err(EngineError::Failed {
            engine: Engine::Criu.as_str(),
            op: "pre-dump",
            status: "not run".into(),
            summary: self.precopy_support().err().unwrap_or_default(),
            log: spec.log_file.to_path_buf(),
        })
    }
    /// Which image files (paths relative to the node's image set) hold nothing but the
    /// contents of process memory: the engine copies them into the restored processes and
    /// takes no other action on them, so a restore may start while they are still being
    /// verified, if it runs [`RestoreSpec::gate`] before any restored process runs. None: the
    /// engine cannot gate, every file is verified first.
    fn memory_only(&self) -> Option<fn(&str) -> bool> {
        None
    }
    /// Memory-only files totalling fewer bytes than this are verified before the restore all
    /// the same: gating has a cost of its own, which verifying that little does not exceed.
    fn gate_min_bytes(&self) -> u64 {
        0
    }
    /// Whether the restore command runs as the job's owner, in the foreground, and becomes
    /// the job's root (true), or as root, detached, writing the root's PID (false).
    fn restores_as_owner(&self) -> bool {
        false
    }
    /// The command line that restores a tree (see [`SnapshotEngine::restores_as_owner`]).
    fn restore_argv(&self, spec: &RestoreSpec<'_>) -> Vec<String>;
    /// Turns a failed restore's exit status and log into an error.
    fn restore_failed(&self, status: String, log: &Path) -> EngineError;
}

/// The engines a node has, by name.
#[derive(Debug, Clone)]
pub struct Engines {
    default: Arc<dyn SnapshotEngine>,
    by_name: BTreeMap<String, Arc<dyn SnapshotEngine>>,
}

impl Engines {
    /// The node's engines: the default (CRIU), and the others it found.
    pub fn new(default: Arc<dyn SnapshotEngine>, others: Vec<Arc<dyn SnapshotEngine>>) -> Self {
        let mut by_name = BTreeMap::new();
        for e in std::iter::once(default.clone()).chain(others) {
            by_name.insert(e.name().to_string(), e);
        }
        Engines { default, by_name }
    }

    /// The engine called `name` ("" is the default), or what this node has instead.
    pub fn get(&self, name: &str) -> Result<&Arc<dyn SnapshotEngine>, String> {
        if name.is_empty() {
            return Ok(&self.default);
        }
        self.by_name.get(name).ok_or_else(|| {
            format!(
                "this node has no {name} engine (it has {})",
                self.by_name.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })
    }

    /// (name, version) of every engine.
    pub fn list(&self) -> Vec<(String, String)> {
        self.by_name
            .values()
            .map(|e| (e.name().to_string(), e.version().to_string()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(summary: &str) -> EngineError {
        EngineError::Failed {
            engine: "criu",
            op: "pre-dump",
            status: "exit status 1".into(),
            summary: summary.into(),
            log: PathBuf::from("/dev/null"),
        }
    }

    /// A full disk is told apart from other failures, whether the engine's log or the
    /// system call that started it says so.
    #[test]
    fn a_full_disk_is_told_apart() {
        assert!(failed(
            "Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device"
        )
        .no_room());
        assert!(
            !failed("Error (criu/proc_parse.c:663): Can't handle non-regular mapping").no_room()
        );
        let spawn = |errno| EngineError::Spawn {
            path: "criu".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        assert!(spawn(libc::ENOSPC).no_room());
        assert!(!spawn(libc::ENOENT).no_room());
    }
}
