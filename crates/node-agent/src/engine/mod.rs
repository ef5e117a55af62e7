//! Snapshot engines: what turns a frozen process tree into image files and back.
//!
//! The agent speaks to an engine only through [`SnapshotEngine`]; [`criu::Criu`] drives the
//! `criu` binary. Dumps run in the agent (blocking; call from `spawn_blocking`); restores are
//! run by the job's shim, which must be the restored tree's ancestor to reap it, so the engine
//! only supplies the command line.
use std::fmt::Debug;
use std::path::{Path, PathBuf};

pub mod criu;
pub mod criu_rpc;

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
    /// The job's cgroup here, as the engine names it: the tree goes there whatever cgroup it
    /// was dumped from (a part moved from a node whose agent names cgroups differently).
    pub cgroup_root: Option<String>,
    /// A program the engine runs once every process is rebuilt and before any of them runs
    /// again; a non-zero exit makes the engine kill the tree and fail. The agent's restore gate
    /// ([`crate::restore::gate`]): it waits for the verification of the files the engine reads
    /// while the restore runs ([`SnapshotEngine::memory_only`]).
    pub gate: Option<&'a Path>,
}

/// Engine failures, each naming the binary or the log to read.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine binary is missing.
    #[error("criu not found at {path}: install CRIU >= {min} (scripts/setup.sh installs it into /opt/ckpt/criu) or set [criu] path in the agent config")]
    NotFound {
        /// Path tried.
        path: String,
        /// Minimum version.
        min: &'static str,
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
    #[error("criu {op} failed ({status}): {summary} (full log: {})", log.display())]
    Failed {
        /// "dump", "pre-dump" or "restore".
        op: &'static str,
        /// Exit status text.
        status: String,
        /// The log's error lines.
        summary: String,
        /// The log file.
        log: PathBuf,
    },
}

/// A snapshot engine.
pub trait SnapshotEngine: Send + Sync + Debug {
    /// Engine name recorded in manifests ("criu").
    fn name(&self) -> &str;
    /// Engine version recorded in manifests.
    fn version(&self) -> &str;
    /// Dumps a frozen tree, leaving it frozen. Blocking.
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
    /// The command line that restores a tree, detached, and writes the root PID to `pid_file`.
    fn restore_argv(&self, spec: &RestoreSpec<'_>) -> Vec<String>;
    /// Turns a failed restore's exit status and log into an error.
    fn restore_failed(&self, status: String, log: &Path) -> EngineError;
}
