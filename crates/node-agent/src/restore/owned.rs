//! Restore with an engine that restores as the job's owner (DMTCP): no PIDs or addresses to
//! put back, since the engine virtualizes PIDs, reconnects sockets and truncates files itself.
//! The verified images are linked (not copied, where staging and the job directory share a file
//! system) into a fresh session, which becomes the owner's; the files saved beside them
//! ([`crate::engine::Beside`]) are put back as the owner, and the shim starts the engine's
//! restart as the owner, as it starts a job.
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_store::manifest::NodeManifest;
use tokio::sync::MutexGuard;
use tracing::info;

use super::{check_pages, check_restored, Restored, RESTORE_TIMEOUT};
use crate::copies::Location;
use crate::engine::{RestoreSpec, SnapshotEngine, SESSION_IMAGES as IMAGES};
use crate::error::{io_err, AgentError};
use crate::jobs::NodeJob;
use crate::launch::make_session;
use crate::node::Node;
use crate::part::notes::PartNotes;
use crate::shim::ShimMode;

/// What [`Node::restore_as_owner`] needs of the restore so far.
pub(super) struct Verified<'a> {
    pub(super) job_id: u64,
    pub(super) epoch: u32,
    pub(super) manifest: &'a NodeManifest,
    pub(super) images: &'a Path,
    pub(super) pages: Option<tokio::task::JoinHandle<ckpt_store::Result<Duration>>>,
    pub(super) hold: bool,
    pub(super) token: &'a str,
    pub(super) may_move: bool,
    pub(super) source: Location,
    pub(super) note: String,
    pub(super) fetch_ms: u64,
}

/// Links (or, across file systems, copies) every file of `from` into `to`, readable: root's
/// files, in a directory only the job's owner will reach.
fn link_images(from: &Path, to: &Path) -> std::io::Result<()> {
    fs::create_dir(to)?;
    for e in fs::read_dir(from)?.flatten() {
        if !e.file_type()?.is_file() {
            continue;
        }
        let src = e.path();
        let dst = to.join(e.file_name());
        fs::set_permissions(&src, fs::Permissions::from_mode(0o644))?;
        match fs::hard_link(&src, &dst) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                fs::copy(&src, &dst)?;
            }
            Err(e) => return Err(e),
        }
    }
    fs::set_permissions(to, fs::Permissions::from_mode(0o755))
}

impl Node {
    pub(super) async fn restore_as_owner(
        &self,
        mut job: MutexGuard<'_, NodeJob>,
        engine: Arc<dyn SnapshotEngine>,
        v: Verified<'_>,
    ) -> Result<Restored, AgentError> {
        let job_id = v.job_id;
        let pages_ms = match v.pages {
            Some(check) => Some(check_pages(job_id, check).await?.as_millis() as u64),
            None => None,
        };
        let owner = self.restored_owner(&mut job, v.manifest, v.epoch).await?;
        let begin = Instant::now();
        job.record.engine = v.manifest.engine.clone();
        job.record.sandbox = None;
        if !v.token.is_empty() {
            job.record.token = v.token.to_string();
        }
        job.record.may_move = v.may_move;
        job.remove_empty_cgroup();
        let inc = job.record.incarnation + 1;
        let session = make_session(&job, &owner, engine.session_subdirs(), |dir| {
            link_images(v.images, &dir.join(IMAGES))
        })
        .map_err(io_err(
            job_id,
            "link the images into the session of",
            &job.dir,
        ))?;
        let node_dir = v.images.parent().unwrap_or(v.images);
        self.put_back_files(&job, &owner, v.manifest, node_dir)
            .await?;
        // The engine binds the sockets' ports again; every process of the job is gone.
        crate::part::tcp::clear_stale_sockets(&v.manifest.tcp_ports).await;
        let log = job
            .dir
            .join("logs")
            .join(format!("restore-{}-{inc}.log", v.epoch));
        let argv = engine.restore_argv(&RestoreSpec {
            images_dir: &session.join(IMAGES),
            log_file: &log,
            pid_file: &session.join("restored.pid"),
            netns_fd: None,
            job_dir: None,
            cgroup_roots: Vec::new(),
            gate: None,
            session: Some(&session),
            coordinator_port: self.coordinator_port(&mut job, engine.as_ref(), owner.uid)?,
        });
        let env = [("PATH", "/usr/local/bin:/usr/bin:/bin")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mode = ShimMode::Launch {
            argv,
            cwd: session.clone(),
            env,
            uid: owner.uid,
            gid: owner.gid,
            groups: owner.groups.clone(),
            sandbox: None,
        };
        let pid = match self
            .start_shim(&mut job, mode, &owner, RESTORE_TIMEOUT)
            .await
        {
            Ok(pid) => pid,
            Err(AgentError::Start { message, .. }) => {
                return Err(AgentError::Engine {
                    job: job_id,
                    source: engine.restore_failed(message, &log),
                })
            }
            Err(e) => return Err(e),
        };
        // Held frozen until the release where the coordinator asked.
        check_restored(self.host.as_ref(), &job, &owner, v.hold)?;
        if !v.hold {
            self.unlock_killed_tcp(&mut job).await;
        }
        info!(
            pid,
            engine = engine.name(),
            source = v.source.name(),
            held = v.hold,
            pages_verify_ms = pages_ms,
            engine_ms = begin.elapsed().as_millis() as u64,
            "job restored"
        );
        // The restored processes' channels come back down, waiting for a rebuild flag named
        // by their new PIDs: found at the rebuild.
        let channels = PartNotes::read(&v.manifest.notes).channels.len();
        job.ibq_down.clear();
        job.ibq_restored = channels;
        job.layer_drained.clear();
        Ok(Restored {
            pid,
            incarnation: job.record.incarnation,
            source: v.source,
            note: v.note,
            channels: channels as u32,
            fetch_ms: v.fetch_ms,
        })
    }
}
