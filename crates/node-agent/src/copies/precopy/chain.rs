//! A job's pre-copy state on this node: whether the node pre-copies ([`Mode`]) and the job's
//! chain of waiting pre-dumps ([`Chain`]). The jobs keep it; the pre-copy loop of `precopy.rs`
//! fills it and a checkpoint's dump takes it.
use std::fs;
use std::path::PathBuf;
use std::time::Instant;

use tracing::{info, warn};

use crate::config::PrecopyConfig;

/// Whether this node pre-copies.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Pre-dumps with these settings.
    On(PrecopyConfig),
    /// Full dumps, and why.
    Off(String),
}

impl Mode {
    /// The mode `cfg` asks for, given whether the engine can pre-copy here; says once (at
    /// start) when pre-copy was asked for and cannot be had.
    pub fn resolve(cfg: &PrecopyConfig, support: impl FnOnce() -> Result<(), String>) -> Mode {
        if !cfg.enabled {
            info!("pre-copy is off ([precopy] enabled = false): checkpoints are full dumps");
            return Mode::Off("pre-copy is off in agent.toml".into());
        }
        match support() {
            Ok(()) => {
                info!(
                    first_after = ?cfg.first_after,
                    target_frozen = ?cfg.target_frozen,
                    "pre-copy on: checkpoints dump only what changed since the last pre-dump"
                );
                Mode::On(cfg.clone())
            }
            Err(why) => {
                warn!("pre-copy is enabled in agent.toml but cannot run on this node, checkpoints are full dumps: {why}");
                Mode::Off(why)
            }
        }
    }
}

/// One pre-dump waiting for the next checkpoint.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) dir: PathBuf,
    /// Bytes it wrote.
    pub(crate) bytes: u64,
}

/// A job's pre-dumps on this node.
#[derive(Debug, Default)]
pub struct Chain {
    /// The incarnation the links are of: a restored job's memory is new.
    pub(crate) incarnation: u32,
    /// Waiting pre-dumps, oldest first.
    pub(crate) links: Vec<Link>,
    /// Number of the newest link's directory (the chain's links are 1, 2, ...).
    pub(super) next: u32,
    /// When the job started, was restored or checkpointed, or last pre-dumped.
    pub(crate) since: Option<Instant>,
    /// Bytes per second the last pre-dump wrote.
    pub(super) rate: f64,
    /// Written bytes counted at the last check.
    pub(crate) dirty: Option<u64>,
    /// Why pre-dumps of this incarnation stopped.
    pub(crate) failed: Option<String>,
}

impl Chain {
    /// Empties the chain (deleting its links) for `incarnation`, starting its clock now.
    pub(super) fn reset(&mut self, incarnation: u32) {
        for l in self.links.drain(..) {
            let _ = fs::remove_dir_all(&l.dir);
        }
        self.incarnation = incarnation;
        self.next = 0;
        self.since = Some(Instant::now());
        self.dirty = None;
        self.failed = None;
    }

    /// The end of an epoch that held the chain: if its dump took the links, the clock starts
    /// again now, so that `first_after` and each part's stagger count from the end of the
    /// checkpoint (sealing included), not from its dump. Counted from the dump, every node's
    /// first pre-dump falls due while the epoch is sealed, and all of them start together
    /// when it ends.
    pub(crate) fn epoch_ended(&mut self) {
        if self.links.is_empty() {
            self.since = Some(Instant::now());
        }
    }

    /// Hands the links to a checkpoint's dump, which moves them; the clock starts again.
    pub(crate) fn take(&mut self) -> Vec<Link> {
        self.since = Some(Instant::now());
        self.dirty = None;
        self.next = 0;
        std::mem::take(&mut self.links)
    }
}
