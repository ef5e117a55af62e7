//! Images and their copies: verification, shared storage (flush, publish, rebuild), partner
//! copies, retention, and the choice of the copy a restore uses. `precopy.rs` (with
//! `precopy/chain.rs`) makes the copies a checkpoint stands on: pre-dumps between checkpoints.
//!
//! What it may import: `os/`, the table (`jobs.rs`), the snapshot engines, the partner
//! streams' client (`rpc/partner.rs`), the crate's config and errors; none of the checkpoint
//! or restore steps and nothing else of `rpc/`. The restore steps, the Agent service and the
//! table (each job's pre-dump chain) import from here.

pub(crate) mod erasure;
pub(crate) mod precopy;
mod read_ahead;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ckpt_store::copy::CopyProgress;
use ckpt_store::digest::FileEntry;
use ckpt_store::layout::Staging;
use ckpt_store::manifest::{self, NodeManifest};
use tracing::{info, warn};

use crate::error::{io_err, AgentError};
use crate::node::Node;

/// Where a restore may find this node's images besides its own staging.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// The node keeping a partner copy, and its agent's host:port.
    pub partner: Option<(String, String)>,
    /// The epoch is complete in shared storage.
    pub shared_durable: bool,
    /// Retention deleted the local copies: do not look for them.
    pub local_pruned: bool,
    /// The node of the epoch whose images are wanted, when a part moves here; none: this
    /// node's. Its local copy here is a partner copy this node keeps for it.
    pub source_node: Option<String>,
    /// Under an erasure-coded scheme: the encoding record of the group of the images wanted
    /// (JSON) and its members' agents; tried after the partner copy.
    pub group: Option<(String, Vec<erasure::Member>)>,
}

/// A flush running in a blocking thread.
pub type FlushTask = tokio::task::JoinHandle<Result<ckpt_store::dedup::FlushStats, AgentError>>;

/// A copy of a node's images to restore from.
#[derive(Debug)]
pub(crate) struct Usable {
    /// Its manifest, matching the committed digest.
    pub manifest: NodeManifest,
    /// Where it is.
    pub source: Location,
    /// Why copies tried before it were not used (empty if none was).
    pub note: String,
    /// Files of the manifest not verified yet (see [`Node::usable_images`]).
    pub unverified: Vec<FileEntry>,
}

/// Where a copy of a node's images is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// Node-local staging.
    Local,
    /// Another node's staging.
    Partner,
    /// Shared storage.
    Shared,
    /// Rebuilt from the other members of its erasure-coded group and their parity.
    Parity,
}

impl Location {
    /// Name shown to users.
    pub fn name(self) -> &'static str {
        match self {
            Location::Local => "local",
            Location::Partner => "partner",
            Location::Shared => "shared",
            Location::Parity => "parity",
        }
    }
}

/// The outcome of checking one copy.
#[derive(Debug)]
pub struct CopyCheck {
    /// Which copy.
    pub location: Location,
    /// Its manifest if every file is intact.
    pub result: Result<NodeManifest, AgentError>,
}

/// Checks that shared storage is root's alone (`ckpt_store::trust`), on every use: a user who
/// may write there could plant links that a flush or a fetch would write through, or point a
/// removal at another user's checkpoint. On a file system that squashes root (NFS's default),
/// root's files belong to the squash uid, which is then accepted as the owner on that file
/// system only.
pub(crate) fn trusted_shared(root: &Path) -> Result<(), ckpt_store::trust::Untrusted> {
    use ckpt_store::trust::{check_root, squash_uid, Owners, Untrusted};
    let as_root = check_root(root, &Owners::ROOT).map(|_| ());
    if !matches!(as_root, Err(Untrusted::NotRoots { .. })) {
        return as_root;
    }
    match squash_uid(root) {
        Ok((uid, dev)) if uid != 0 => check_root(
            root,
            &Owners {
                squash: Some((uid, dev)),
            },
        )
        .map(|_| ()),
        _ => as_root,
    }
}

impl Node {
    /// The shared storage mount, if configured.
    pub fn shared_dir(&self) -> Option<&Path> {
        self.shared.as_ref().map(|s| s.root())
    }

    /// The shared store, if configured and mounted.
    fn shared(&self, job: u64) -> Result<Staging, AgentError> {
        let s = self.shared.clone().ok_or_else(|| AgentError::NoShared {
            job,
            problem: format!("node {} has no shared storage", self.name),
        })?;
        if !s.root().is_dir() {
            return Err(AgentError::NoShared {
                job,
                problem: format!(
                    "shared_dir {} does not exist on node {} (is the file system mounted?)",
                    s.root().display(),
                    self.name
                ),
            });
        }
        if let Err(e) = trusted_shared(s.root()) {
            return Err(AgentError::NoShared {
                job,
                problem: format!(
                    "shared_dir on node {}: {e}; make it root's (or, on NFS with root squashed, the squash user's) and not writable by other users",
                    self.name
                ),
            });
        }
        Ok(s)
    }

    /// Starts copying this node's images of a committed epoch to shared storage, in a blocking
    /// thread; returns its progress and the task. Does not touch the job: it may have moved
    /// on, or ended.
    pub fn flush(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
    ) -> Result<(Arc<CopyProgress>, FlushTask), AgentError> {
        let shared = self.shared(job_id)?;
        let src = self.staging.node_dir(job_id, epoch, &self.name);
        let progress = Arc::new(CopyProgress::pausing_on(self.frozen.clone()));
        let (p, opts, digest, node) = (
            progress.clone(),
            self.copy_opts.clone(),
            committed_digest.to_string(),
            self.name.clone(),
        );
        // A failpoint holds the copy back, not the call: progress is reported meanwhile.
        let held = self.failpoints.action("flush", &self.name);
        let copy = move || {
            let r = ckpt_store::dedup::flush(
                &src,
                &shared,
                target(job_id, epoch, &node),
                &digest,
                &opts,
                &p,
            );
            if r.is_err() {
                // An incomplete copy has no manifest and is never used; do not keep its bytes.
                let _ = fs::remove_dir_all(shared.node_dir(job_id, epoch, &node));
                let _ = ckpt_store::dedup::sweep(&shared, job_id, &node);
            }
            r.map_err(|source| AgentError::Store {
                job: job_id,
                source,
            })
        };
        let task = tokio::spawn(async move {
            match held {
                Some(crate::failpoint::Action::Error) => {
                    return Err(AgentError::Injected {
                        job: job_id,
                        phase: "flush",
                    })
                }
                Some(crate::failpoint::Action::Delay(d)) => tokio::time::sleep(d).await,
                None => {}
            }
            tokio::task::spawn_blocking(copy)
                .await
                .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
        });
        Ok((progress, task))
    }

    /// Writes an epoch's commit record into shared storage after checking that every node's
    /// flushed manifest there is the committed one.
    pub async fn publish(
        &self,
        record: ckpt_store::commit::CommitRecord,
    ) -> Result<(), AgentError> {
        let job = record.job_id;
        let shared = self.shared(job)?;
        tokio::task::spawn_blocking(move || -> Result<(), ckpt_store::StoreError> {
            for (node, want) in &record.manifests {
                let dir = shared.node_dir(job, record.epoch, node);
                let (_, found) = manifest::read(&dir)?;
                if &found != want {
                    return Err(ckpt_store::StoreError::NotCommitted {
                        path: dir.join(manifest::FILE_NAME),
                        found,
                        expected: want.clone(),
                    });
                }
            }
            ckpt_store::commit::write(&shared.epoch_dir(job, record.epoch), &record)
        })
        .await
        .expect("publish task")
        .map_err(|source| AgentError::Store { job, source })
    }

    /// Checks this node's images of an epoch: the manifest against the committed digest (if
    /// given), then every file against the manifest. Reads only.
    pub async fn verify(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
    ) -> Result<NodeManifest, AgentError> {
        self.verify_of(job_id, epoch, committed_digest, &self.name, None)
            .await
            .map(|(m, _)| m)
    }

    /// [`Node::verify`] of the images of `node` kept here. With `later`, the files it names
    /// are left out and returned (their entries) for the caller to verify.
    async fn verify_of(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        node: &str,
        later: Option<fn(&str) -> bool>,
    ) -> Result<(NodeManifest, Vec<FileEntry>), AgentError> {
        let nd = self.staging.node_dir(job_id, epoch, node);
        let committed = committed_digest.to_string();
        tokio::task::spawn_blocking(
            move || -> Result<(NodeManifest, Vec<FileEntry>), AgentError> {
                let store_err = |source| AgentError::Store {
                    job: job_id,
                    source,
                };
                if committed.is_empty() {
                    return Err(store_err(ckpt_store::StoreError::DigestRequired {
                        path: nd.join(ckpt_store::manifest::FILE_NAME),
                    }));
                }
                let (m, digest) = manifest::read(&nd).map_err(store_err)?;
                if digest != committed {
                    return Err(AgentError::ManifestMismatch {
                        job: job_id,
                        epoch,
                        found: digest,
                        committed,
                    });
                }
                let (left, now): (Vec<FileEntry>, Vec<FileEntry>) = m
                    .files
                    .iter()
                    .cloned()
                    .partition(|f| later.is_some_and(|later| later(&f.path)));
                ckpt_store::digest::verify_tree(&nd, &now).map_err(store_err)?;
                Ok((m, left))
            },
        )
        .await
        .expect("verify task")
    }

    /// Rebuilds this node's images of an epoch from shared storage into `dest` (removed again
    /// on failure), or with `None` only checks that they can be rebuilt intact.
    async fn rebuild_shared(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        dest: Option<PathBuf>,
        node: &str,
    ) -> Result<NodeManifest, AgentError> {
        let shared = self.shared(job_id)?;
        let (opts, digest, node) = (
            self.copy_opts.clone(),
            committed_digest.to_string(),
            node.to_string(),
        );
        tokio::task::spawn_blocking(move || {
            let t = target(job_id, epoch, &node);
            let r = ckpt_store::dedup::rebuild(&shared, t, &digest, dest.as_deref(), &opts);
            if let (Err(_), Some(d)) = (&r, &dest) {
                let _ = fs::remove_dir_all(d);
            }
            r
        })
        .await
        .expect("rebuild task")
        .map_err(|source| AgentError::Store {
            job: job_id,
            source,
        })
    }

    /// Checks every copy of this node's images of an epoch: the local one (unless retention
    /// deleted it), and the shared one when the coordinator says it is complete. Reads only.
    pub async fn verify_copies(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        local: bool,
        shared_durable: bool,
    ) -> Vec<CopyCheck> {
        let mut out = Vec::new();
        if local {
            out.push(CopyCheck {
                location: Location::Local,
                result: self.verify(job_id, epoch, committed_digest).await,
            });
        }
        if shared_durable {
            out.push(CopyCheck {
                location: Location::Shared,
                result: self
                    .rebuild_shared(job_id, epoch, committed_digest, None, &self.name)
                    .await,
            });
        }
        out
    }

    /// Images to restore from, in order: the local copy if intact, else a fresh local copy
    /// fetched from the partner node, else rebuilt from the node's erasure-coded group, else
    /// from shared storage (for a durable epoch), each
    /// verified as it is read. Returns the manifest, where the images came from and why the
    /// sources before it were not used.
    ///
    /// With `later`, the local copy's files it names are not verified but returned in
    /// [`Usable::unverified`] (copies fetched from elsewhere are verified whole).
    pub(crate) async fn usable_images(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        sources: &Sources,
        later: Option<fn(&str) -> bool>,
    ) -> Result<Usable, AgentError> {
        let node = sources.source_node.as_deref().unwrap_or(&self.name);
        let local_err = if sources.local_pruned {
            AgentError::Store {
                job: job_id,
                source: ckpt_store::StoreError::FileMissing {
                    path: self.staging.node_dir(job_id, epoch, node),
                },
            }
        } else {
            match self
                .verify_of(job_id, epoch, committed_digest, node, later)
                .await
            {
                Ok((manifest, unverified)) => {
                    return Ok(Usable {
                        manifest,
                        source: Location::Local,
                        note: String::new(),
                        unverified,
                    })
                }
                Err(e) => e,
            }
        };
        let mut tried = vec![if sources.local_pruned {
            "local copy deleted by retention".to_string()
        } else {
            format!("local copy unusable: {local_err}")
        }];
        let dest = self.staging.node_dir(job_id, epoch, node);
        let tmp = self
            .staging
            .epoch_dir(job_id, epoch)
            .join(format!(".{node}.fetch"));
        // For a part moving here, the partner keeping the copy serves it with the
        // coordinator's grant.
        if let Some((pn, pa)) = sources.partner.as_ref() {
            if node == self.name {
                warn!(job = job_id, epoch, partner = %pn, error = %local_err, "local images unusable; fetching the partner copy");
            } else {
                // A part that moved here has no local copy: nothing is wrong.
                info!(job = job_id, epoch, partner = %pn, source = %node, "fetching the partner copy of a part that moved here");
            }
            match self
                .fetch_from_partner(job_id, epoch, committed_digest, node, pn, pa, &tmp)
                .await
            {
                Ok(m) => {
                    install(job_id, &tmp, &dest).await?;
                    return Ok(Usable {
                        manifest: m,
                        source: Location::Partner,
                        note: tried.join("; "),
                        unverified: Vec::new(),
                    });
                }
                Err(e) => tried.push(format!("partner copy on {pn}: {e}")),
            }
        }
        if let Some((encoding, members)) = sources.group.as_ref() {
            info!(job = job_id, epoch, source = %node, "rebuilding the images from the other members of the group and their parity");
            match self
                .usable_from_group(
                    job_id,
                    epoch,
                    node,
                    committed_digest,
                    encoding,
                    members,
                    &tmp,
                    &dest,
                    tried.join("; "),
                )
                .await
            {
                Ok(u) => return Ok(u),
                Err(e) => tried.push(format!("rebuild from its group: {e}")),
            }
        }
        if sources.shared_durable {
            if node == self.name {
                warn!(job = job_id, epoch, "fetching the shared copy");
            } else {
                info!(job = job_id, epoch, source = %node, "fetching the shared copy of a part that moved here");
            }
            let fetched = self
                .rebuild_shared(job_id, epoch, committed_digest, Some(tmp.clone()), node)
                .await;
            match fetched {
                Ok(m) => {
                    install(job_id, &tmp, &dest).await?;
                    return Ok(Usable {
                        manifest: m,
                        source: Location::Shared,
                        note: tried.join("; "),
                        unverified: Vec::new(),
                    });
                }
                Err(e) => tried.push(format!("shared copy: {e}")),
            }
        }
        if tried.len() == 1 {
            return Err(local_err);
        }
        Err(AgentError::NoUsableCopy {
            job: job_id,
            epoch,
            node: node.to_string(),
            tried: tried.join("; "),
        })
    }

    /// Has the partner node send the copy of `node`'s images it keeps (this node's, or a moved
    /// part's), into `tmp`.
    #[allow(clippy::too_many_arguments)]
    async fn fetch_from_partner(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        node: &str,
        partner: &str,
        address: &str,
        tmp: &Path,
    ) -> Result<NodeManifest, AgentError> {
        let failed = |s: tonic::Status| AgentError::Partner {
            job: job_id,
            node: partner.to_string(),
            message: s.message().to_string(),
        };
        let mut c =
            crate::rpc::partner::connect(job_id, partner, address, self.credential.as_ref())
                .await?;
        let s = c
            .send(ckpt_proto::v1::SendRequest {
                job_id,
                epoch,
                node: node.to_string(),
                manifest_digest: committed_digest.to_string(),
            })
            .await
            .map_err(failed)?
            .into_inner();
        let (header, rest) = crate::rpc::partner::split_header(s).await.map_err(failed)?;
        crate::rpc::partner::receive(
            job_id,
            partner,
            tmp.to_path_buf(),
            header,
            committed_digest,
            rest,
        )
        .await
    }

    /// Sends this node's images of a committed epoch to the partner node's agent.
    pub async fn replicate(
        &self,
        job_id: u64,
        epoch: u32,
        committed_digest: &str,
        partner: &str,
        address: &str,
    ) -> Result<(), AgentError> {
        use tokio_stream::StreamExt;
        let mut c =
            crate::rpc::partner::connect(job_id, partner, address, self.credential.as_ref())
                .await?;
        let header = ckpt_proto::v1::ChunkHeader {
            job_id,
            epoch,
            node: self.name.clone(),
            ..Default::default()
        };
        let rx = crate::rpc::partner::chunks(
            self.staging.node_dir(job_id, epoch, &self.name),
            header,
            committed_digest.to_string(),
            self.frozen.clone(),
        );
        // A damaged local file ends the stream early; the partner then refuses the incomplete
        // copy, and the local error is the one worth reporting.
        let failed = Arc::new(std::sync::Mutex::new(None));
        let f = failed.clone();
        let s = tokio_stream::wrappers::ReceiverStream::new(rx).map_while(move |r| match r {
            Ok(c) => Some(c),
            Err(e) => {
                *f.lock().expect("lock") = Some(e);
                None
            }
        });
        let r = c.receive(s).await;
        if let Some(e) = failed.lock().expect("lock").take() {
            return Err(e);
        }
        r.map(|_| ()).map_err(|s| AgentError::Partner {
            job: job_id,
            node: partner.to_string(),
            message: s.message().to_string(),
        })
    }

    /// Where this node keeps its own or a partner's images of an epoch.
    pub fn node_dir(&self, job_id: u64, epoch: u32, node: &str) -> PathBuf {
        self.staging.node_dir(job_id, epoch, node)
    }

    /// Deletes this node's images of the given epochs (retention): the local copies (with the
    /// partner copies and parity kept here for the epoch's other nodes) unless `keep_local`,
    /// and with `shared` the shared copies (the epoch's commit record first, so a partly
    /// deleted epoch never looks complete). Missing ones are fine.
    pub async fn prune(
        &self,
        job_id: u64,
        epochs: &[u32],
        shared: bool,
        keep_local: bool,
    ) -> Result<(), AgentError> {
        let staging = self.staging.clone();
        let shared = if shared {
            Some(self.shared(job_id)?)
        } else {
            None
        };
        let node = self.name.clone();
        let epochs = epochs.to_vec();
        tokio::task::spawn_blocking(move || {
            let store_err = |source| AgentError::Store {
                job: job_id,
                source,
            };
            for e in epochs {
                if let Some(sh) = &shared {
                    let commit = sh.epoch_dir(job_id, e).join(ckpt_store::commit::FILE_NAME);
                    match fs::remove_file(&commit) {
                        Ok(()) => {}
                        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                        Err(err) => return Err(io_err(job_id, "remove", &commit)(err)),
                    }
                    sh.remove_node_dir(job_id, e, &node).map_err(store_err)?;
                    ckpt_store::dedup::sweep(sh, job_id, &node).map_err(store_err)?;
                }
                if !keep_local {
                    // Everything of the epoch here: this node's images, the partner copies and
                    // the parity it keeps for other nodes of the epoch (all pruned together).
                    staging.remove_epoch_dir(job_id, e).map_err(store_err)?;
                }
            }
            Ok(())
        })
        .await
        .expect("prune task")
    }
}

/// A node's copy of one epoch in shared storage.
fn target(job: u64, epoch: u32, node: &str) -> ckpt_store::dedup::Target<'_> {
    ckpt_store::dedup::Target { job, epoch, node }
}

/// Puts a fetched copy in place of the node's unusable one.
async fn install(job: u64, tmp: &Path, dest: &Path) -> Result<(), AgentError> {
    let (tmp, dest, path) = (tmp.to_path_buf(), dest.to_path_buf(), dest.to_path_buf());
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        if dest.exists() {
            fs::remove_dir_all(&dest)?;
        }
        fs::rename(&tmp, &dest)
    })
    .await
    .expect("install task")
    .map_err(|source| AgentError::Io {
        job,
        what: "install fetched images",
        path,
        source,
    })
}
