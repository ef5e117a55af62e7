//! One checkpoint epoch of one job as ckptd records it: its state (in progress, committed,
//! failed, expired), where its images are, its flush to shared storage, and its guarded
//! transitions (the job's own are in `mod.rs`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Phase, Recovery, TransitionError, Trigger};

/// State of an epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EpochState {
    /// Running the given phase.
    InProgress(Phase),
    /// Restorable: every node's manifest is recorded.
    Committed,
    /// Aborted; never offered for restart.
    Failed {
        /// Phase that failed.
        phase: Phase,
        /// Why.
        reason: String,
    },
    /// Was committed; its images were deleted by retention. Never offered for restart.
    Expired {
        /// Why (the retention rule).
        reason: String,
    },
}

/// Where a committed epoch's images are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// In node-local staging only.
    Local,
    /// Being copied to shared storage.
    Flushing,
    /// Also complete in shared storage.
    Durable,
    /// In shared storage only: retention deleted the local copies.
    SharedOnly,
    /// Local only: the copy to shared storage failed.
    FlushFailed,
}

impl Storage {
    /// Name shown to users: `local`, `flushing`, `durable`, `shared-only`, `flush-failed`.
    pub fn name(self) -> &'static str {
        match self {
            Storage::Local => "local",
            Storage::Flushing => "flushing",
            Storage::Durable => "durable",
            Storage::SharedOnly => "shared-only",
            Storage::FlushFailed => "flush-failed",
        }
    }
}

/// The shared-storage copy of a committed epoch (SCR's flush).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum FlushState {
    /// No shared copy: no shared storage on some node, or not a flush epoch (`flush.every`).
    #[default]
    NotPlanned,
    /// Queued or being copied.
    Flushing,
    /// Complete in shared storage, with its commit record.
    Durable {
        /// How long the copy took, in ms.
        flush_ms: u64,
        /// Bytes it wrote: chunks not already in shared storage.
        #[serde(default)]
        written_bytes: u64,
        /// When it became durable (0 in records older than this field). From the epoch's
        /// start this spans the partner copies and the wait behind earlier flushes too.
        #[serde(default)]
        durable_unix_ms: u64,
    },
    /// The copy failed; the epoch has only its local copies.
    Failed {
        /// Why.
        reason: String,
    },
}

fn yes() -> bool {
    true
}

/// One checkpoint epoch of one job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Epoch {
    /// Job id.
    pub job_id: u64,
    /// Epoch number (1, 2, ...).
    pub number: u32,
    /// State.
    pub state: EpochState,
    /// Whether the job was stopped after the snapshot.
    pub kill: bool,
    /// Nodes taking part.
    pub nodes: Vec<String>,
    /// Node manifest digest per node (set at commit).
    #[serde(default)]
    pub manifests: BTreeMap<String, String>,
    /// Start time (ms since the Unix epoch).
    pub started_unix_ms: u64,
    /// End time (ms since the Unix epoch), once terminal.
    #[serde(default)]
    pub finished_unix_ms: u64,
    /// Longest time any node was frozen, in ms.
    #[serde(default)]
    pub frozen_ms: u64,
    /// Total image bytes.
    #[serde(default)]
    pub image_bytes: u64,
    /// Total image files.
    #[serde(default)]
    pub image_files: u32,
    /// The shared copy.
    #[serde(default)]
    pub flush: FlushState,
    /// Node holding a partner copy of each node's images (set once the copy is complete).
    #[serde(default)]
    pub partners: BTreeMap<String, String>,
    /// Whether the nodes still hold their local copies (retention deletes them once the epoch
    /// is durable and older than `keep_local`).
    #[serde(default = "yes")]
    pub local_copy: bool,
    /// Who asked for it (stored as "" for a user's request, "periodic", "drain", "deadline").
    #[serde(default)]
    pub trigger: Trigger,
    /// Resident memory of the job's processes at the initial synchronization, over all nodes
    /// (what `ckptctl estimate` relates checkpoint times to).
    #[serde(default)]
    pub resident_bytes: u64,
    /// Every restart from this epoch, oldest first (the last [`MAX_RESTARTS_KEPT`]).
    #[serde(default)]
    pub restarts: Vec<Recovery>,
    /// Under an erasure-coded scheme: each group's encoding record, once all its parity is
    /// held (`[redundancy] scheme`).
    #[serde(default)]
    pub encodings: Vec<ckpt_store::erasure::Encoding>,
}

/// Restarts an epoch's record keeps: a job restarted that often from one epoch has a problem
/// that the last ones show.
pub const MAX_RESTARTS_KEPT: usize = 16;

impl Epoch {
    /// A new epoch at the first phase.
    pub fn begin(job_id: u64, number: u32, kill: bool, nodes: Vec<String>, now_ms: u64) -> Self {
        Epoch {
            job_id,
            number,
            state: EpochState::InProgress(Phase::InitialSync),
            kill,
            nodes,
            manifests: BTreeMap::new(),
            started_unix_ms: now_ms,
            finished_unix_ms: 0,
            frozen_ms: 0,
            image_bytes: 0,
            image_files: 0,
            flush: FlushState::NotPlanned,
            partners: BTreeMap::new(),
            local_copy: true,
            trigger: Trigger::User,
            resident_bytes: 0,
            restarts: Vec::new(),
            encodings: Vec::new(),
        }
    }

    fn refuse(&self, action: &str) -> TransitionError {
        TransitionError {
            what: format!("job {} epoch {}", self.job_id, self.number),
            from: self.state_name(),
            action: action.into(),
        }
    }

    /// Moves to the next phase; only the phase right after the current one is allowed.
    pub fn enter(&mut self, next: Phase) -> Result<(), TransitionError> {
        match self.state {
            EpochState::InProgress(cur) if next as u8 == cur as u8 + 1 => {
                self.state = EpochState::InProgress(next);
                Ok(())
            }
            _ => Err(self.refuse(&format!("enter phase {}", next.name()))),
        }
    }

    /// Commits; only from the commit phase, with a manifest for every node.
    pub fn commit(
        &mut self,
        manifests: BTreeMap<String, String>,
        now_ms: u64,
    ) -> Result<(), TransitionError> {
        if self.state != EpochState::InProgress(Phase::Commit) {
            return Err(self.refuse("commit"));
        }
        if let Some(missing) = self
            .nodes
            .iter()
            .find(|n| manifests.get(*n).is_none_or(|d| d.is_empty()))
        {
            return Err(TransitionError {
                what: format!("job {} epoch {}", self.job_id, self.number),
                from: self.state_name(),
                action: format!("commit without the manifest of node {missing}"),
            });
        }
        self.manifests = manifests;
        self.state = EpochState::Committed;
        self.finished_unix_ms = now_ms;
        Ok(())
    }

    /// Fails the epoch in its current phase; only an epoch in progress can fail.
    pub fn fail(&mut self, reason: impl Into<String>, now_ms: u64) -> Result<(), TransitionError> {
        match self.state {
            EpochState::InProgress(phase) => {
                self.state = EpochState::Failed {
                    phase,
                    reason: reason.into(),
                };
                self.finished_unix_ms = now_ms;
                Ok(())
            }
            _ => Err(self.refuse("fail")),
        }
    }

    /// Retires a committed epoch whose images are to be deleted; only a committed epoch.
    pub fn expire(&mut self, reason: impl Into<String>) -> Result<(), TransitionError> {
        if self.state != EpochState::Committed {
            return Err(self.refuse("expire"));
        }
        self.state = EpochState::Expired {
            reason: reason.into(),
        };
        Ok(())
    }

    /// Whether the epoch has a complete copy in shared storage.
    pub fn is_durable(&self) -> bool {
        matches!(self.flush, FlushState::Durable { .. })
    }

    /// From the start of the epoch until it was durable (partner copies, any wait behind an
    /// earlier flush, and the flush); None while not durable and in records from before ckpt
    /// recorded when.
    pub fn durable_ms(&self) -> Option<u64> {
        match self.flush {
            FlushState::Durable {
                durable_unix_ms, ..
            } if durable_unix_ms > self.started_unix_ms => {
                Some(durable_unix_ms - self.started_unix_ms)
            }
            _ => None,
        }
    }

    /// Where a committed epoch's images are; None for other states.
    pub fn storage(&self) -> Option<Storage> {
        if self.state != EpochState::Committed {
            return None;
        }
        Some(match (&self.flush, self.local_copy) {
            (FlushState::Durable { .. }, true) => Storage::Durable,
            (FlushState::Durable { .. }, false) => Storage::SharedOnly,
            (FlushState::Flushing, _) => Storage::Flushing,
            (FlushState::Failed { .. }, _) => Storage::FlushFailed,
            (FlushState::NotPlanned, _) => Storage::Local,
        })
    }

    /// [`Epoch::storage`] as users see it: `local`, `flushing`, `durable`, `shared-only` or
    /// `flush-failed`; empty for other states.
    pub fn storage_name(&self) -> &'static str {
        self.storage().map_or("", Storage::name)
    }

    /// Whether every node's images have a partner copy on another node.
    pub fn has_partner_copies(&self) -> bool {
        self.local_copy && self.nodes.iter().all(|n| self.partners.contains_key(n))
    }

    /// The encoding of the group `node`'s images are in, if they are protected by parity.
    pub fn encoding_of(&self, node: &str) -> Option<&ckpt_store::erasure::Encoding> {
        if !self.local_copy {
            return None;
        }
        self.encodings
            .iter()
            .find(|g| g.members.iter().any(|m| m.node == node))
    }

    /// The scheme protecting every node's images by parity (`None` unless all are).
    pub fn encoded_scheme(&self) -> Option<&str> {
        let first = self.encodings.first()?;
        self.nodes
            .iter()
            .all(|n| self.encoding_of(n).is_some())
            .then_some(first.scheme.as_str())
    }

    /// Whether this epoch may be restored.
    pub fn is_restorable(&self) -> bool {
        self.state == EpochState::Committed
    }

    /// The phase in progress, if any.
    pub fn phase(&self) -> Option<Phase> {
        match self.state {
            EpochState::InProgress(p) => Some(p),
            _ => None,
        }
    }

    /// Name shown to users.
    pub fn state_name(&self) -> String {
        match &self.state {
            EpochState::InProgress(p) => format!("in-progress ({})", p.name()),
            EpochState::Committed => "committed".into(),
            EpochState::Failed { .. } => "failed".into(),
            EpochState::Expired { .. } => "expired".into(),
        }
    }
}
