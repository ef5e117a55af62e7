//! Checkpoint and restart, ib-quiesce channels: quiesced before the freeze, rebuilt and
//! reconnected after the thaw or a restart's release.

use std::path::Path;
use std::time::Duration;

use tracing::info;

use ib_quiesce::control::Holdings;

use crate::error::AgentError;
use crate::ibq::{ChannelFailure, Rebuilt};
use crate::jobs::NodeJob;
use crate::node::Node;
use crate::os::procfs;

/// How long channels have to drain and flush before the freeze, and drained verbs layers to
/// release their objects.
const CHANNEL_QUIESCE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a channel has to answer `check` at initial sync: it reads a few of its own tables,
/// a millisecond's work; 5 s leaves room for a loaded node and keeps a hung process from holding
/// the initial sync long.
const CHANNEL_CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long channels have to come back, recreate their objects and connect.
const CHANNEL_REBUILD_TIMEOUT: Duration = Duration::from_secs(60);

/// The agent error for a channel that failed `step` in job `job`.
fn channel_error(job: u64, step: &'static str) -> impl Fn(ChannelFailure) -> AgentError {
    move |f| AgentError::Channel {
        job,
        pid: f.pid,
        message: format!("{step} failed: {}", f.message),
    }
}

/// Fails naming the first of `pids` that maps or holds a verbs device; when that process has
/// the verbs layer, says where the layer looked for the agent (`socket`).
pub(super) fn refuse_verbs_without_channel<'a>(
    job: u64,
    pids: impl IntoIterator<Item = &'a i32>,
    socket: &Path,
) -> Result<(), AgentError> {
    for &pid in pids {
        if let Some(device) = procfs::verbs_device(pid) {
            let comm = procfs::stat(pid).map(|s| s.comm).unwrap_or_default();
            if procfs::maps_file(pid, crate::config::VERBS_LAYER_FILE) {
                return Err(AgentError::LayerNotConnected {
                    job,
                    pid,
                    comm,
                    device,
                    found: procfs::environ_var(pid, ib_quiesce::control::SOCKET_ENV)
                        .unwrap_or_else(|| "unset".into()),
                    socket: socket.to_path_buf(),
                });
            }
            return Err(AgentError::VerbsWithoutChannel {
                job,
                pid,
                comm,
                device,
            });
        }
    }
    Ok(())
}

/// Fails naming the first of `pids` that holds the RDMA connection manager open.
pub(super) fn refuse_rdma_cm(job: u64, pids: &[i32]) -> Result<(), AgentError> {
    for &pid in pids {
        if let Some(fd) = procfs::fd_on(pid, procfs::RDMA_CM) {
            let comm = procfs::stat(pid).map(|s| s.comm).unwrap_or_default();
            return Err(AgentError::RdmaCmHeld {
                job,
                pid,
                comm,
                device: procfs::RDMA_CM.into(),
                fd,
            });
        }
    }
    Ok(())
}

/// What a process holds on verbs devices beyond its verbs library's reach (its layer's or
/// ib-quiesce channel's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Beyond {
    /// A descriptor on a verbs device file that is none of the library's.
    Fd {
        /// The descriptor.
        fd: i32,
        /// The device file.
        device: String,
    },
    /// A mapping of a verbs device file on which the library holds no descriptor.
    Mapping {
        /// The device file.
        device: String,
    },
    /// A feature in use that the library cannot rebuild, as it names it.
    Feature(String),
}

/// Compares what a process holds on verbs devices with what its library says it holds
/// (`held`, its answer to `check`): `fds` are the process's descriptors on files under
/// `/dev/infiniband/` (descriptor, path), `mapped` the paths it maps. The RDMA connection
/// manager is left out (refused on its own, [`refuse_rdma_cm`]). Mappings cannot be tied to a
/// descriptor (`/proc/PID/maps` names the file, not the descriptor), so a mapping counts as
/// the library's when one of its descriptors is open on the same device file. A library that
/// cannot tell its descriptors (`fds: None`) is not compared on them. Returns the first
/// finding: descriptors (lowest first), then mappings, then features.
pub(crate) fn beyond_library(
    fds: &[(i32, String)],
    mapped: &[String],
    held: &Holdings,
) -> Option<Beyond> {
    let verbs = |p: &str| p.starts_with(ib_quiesce::VERBS_DEVICE_PREFIX) && p != procfs::RDMA_CM;
    if let Some(known) = &held.fds {
        let mut fds: Vec<&(i32, String)> = fds.iter().filter(|(_, p)| verbs(p)).collect();
        fds.sort_unstable();
        if let Some((fd, device)) = fds.iter().find(|(fd, _)| !known.contains(fd)) {
            return Some(Beyond::Fd {
                fd: *fd,
                device: device.clone(),
            });
        }
        let devices: Vec<&String> = fds.iter().map(|(_, p)| p).collect();
        if let Some(device) = mapped.iter().find(|p| verbs(p) && !devices.contains(p)) {
            return Some(Beyond::Mapping {
                device: device.clone(),
            });
        }
    }
    held.unsupported.first().cloned().map(Beyond::Feature)
}

/// Fails naming the first process of `held` (pid and its answer to `check`) that holds on
/// verbs devices something its library does not know about, or uses a feature the library
/// cannot rebuild.
pub(super) fn refuse_beyond_library(job: u64, held: &[(i32, Holdings)]) -> Result<(), AgentError> {
    for (pid, h) in held {
        let pid = *pid;
        let fds = procfs::fds_under(pid, ib_quiesce::VERBS_DEVICE_PREFIX);
        let Some(found) = beyond_library(&fds, &procfs::mapped_paths(pid), h) else {
            continue;
        };
        let comm = procfs::stat(pid).map(|s| s.comm).unwrap_or_default();
        return Err(match found {
            Beyond::Fd { fd, device } => AgentError::VerbsFdOutsideLayer {
                job,
                pid,
                comm,
                device,
                fd,
            },
            Beyond::Mapping { device } => AgentError::VerbsMappedOutsideLayer {
                job,
                pid,
                comm,
                device,
            },
            Beyond::Feature(feature) => AgentError::UnsupportedVerbsFeature {
                job,
                pid,
                comm,
                feature,
            },
        });
    }
    Ok(())
}

/// Records in the epoch's manifest notes which processes' channels are down, so a restore
/// rebuilds them.
fn note_channels(job: &mut NodeJob) {
    if let Some(w) = job.work.as_mut() {
        crate::part::notes::PartNotes::write_channels(&mut w.notes, &job.ibq_down);
    }
}

impl Node {
    /// Initial sync: asks the channels of `channeled` (processes whose layer or channel is up)
    /// what they hold, and fails naming the first process that holds on verbs devices more
    /// than its library knows, or uses a feature it cannot rebuild. Changes nothing.
    pub(super) async fn check_channels(
        &self,
        job_id: u64,
        channeled: &[i32],
    ) -> Result<(), AgentError> {
        if channeled.is_empty() {
            return Ok(());
        }
        let held = self
            .channels
            .check(channeled, CHANNEL_CHECK_TIMEOUT)
            .await
            .map_err(channel_error(job_id, "check"))?;
        refuse_beyond_library(job_id, &held)
    }

    /// Pre-checkpoint, before the freeze: quiesce the ib-quiesce channels of the job's
    /// processes (all at once: their flush handshakes need each other), then check that no
    /// process still maps a verbs device. Verbs layers that drained (objects alive) are kept in
    /// `layer_drained` for [`Node::release_layers`], and skipped by that check until then.
    pub(super) async fn quiesce_channels(&self, job: &mut NodeJob) -> Result<(), AgentError> {
        let job_id = job.record.id;
        let pids = job
            .work
            .as_ref()
            .map(|w| w.pids.clone())
            .unwrap_or_default();
        let up = self.channels.up(&pids).await;
        if !up.is_empty() {
            let (done, failed) = self.channels.quiesce(&up, CHANNEL_QUIESCE_TIMEOUT).await;
            job.ibq_down.extend(&done.released);
            if let Some(f) = failed.into_iter().next() {
                // Channels still up, and drained layers, run on; those that quiesced wait for
                // the rebuild that follows the abort.
                self.channels.resume(&up).await;
                return Err(channel_error(job_id, "quiesce")(f));
            }
            job.layer_drained.extend(&done.drained);
            info!(
                channels = done.released.len(),
                drained_layers = done.drained.len(),
                qps = done.report.flushed_qps,
                kept_receives = done.report.kept_receives,
                slowest_us = done.slowest.as_micros() as u64,
                "ib-quiesce channels quiesced"
            );
            note_channels(job);
            let w = job.work.as_mut().expect("checked");
            w.notes.insert(
                "ibq_quiesce_us".into(),
                done.slowest.as_micros().to_string(),
            );
        }
        let drained = &job.layer_drained;
        refuse_verbs_without_channel(
            job_id,
            pids.iter().filter(|p| !drained.contains(p)),
            self.channels.socket(),
        )
    }

    /// Quiesce, second round, before the freeze: every node's processes drained (the
    /// coordinator's first round is that barrier), so the job's drained verbs layers release
    /// their objects, all at once; then no process may map a verbs device. Those that released are
    /// down (rebuilt after the snapshot, or after an abort); those that failed stay drained
    /// (an abort resumes them).
    pub(super) async fn release_layers(&self, job: &mut NodeJob) -> Result<(), AgentError> {
        let job_id = job.record.id;
        let (done, failed) = self
            .channels
            .release(&job.layer_drained, CHANNEL_QUIESCE_TIMEOUT)
            .await;
        job.layer_drained.retain(|p| !done.released.contains(p));
        job.ibq_down.extend(&done.released);
        note_channels(job);
        if let Some(f) = failed.into_iter().next() {
            return Err(channel_error(job_id, "release")(f));
        }
        info!(
            layers = done.released.len(),
            slowest_us = done.slowest.as_micros() as u64,
            "ib-quiesce verbs layers released"
        );
        let pids = job
            .work
            .as_ref()
            .map(|w| w.pids.as_slice())
            .unwrap_or_default();
        refuse_verbs_without_channel(job_id, pids, self.channels.socket())
    }

    /// Post-checkpoint (or after a restart's release): the job's channels that are down
    /// recreate their objects; returns their new endpoints (none without channels) and the
    /// peer QPs whose endpoints they need back.
    pub(crate) async fn rebuild_channels(&self, job: &mut NodeJob) -> Result<Rebuilt, AgentError> {
        let job_id = job.id();
        if job.ibq_restored > 0 {
            let found = self
                .find_restored_channels(job, job.ibq_restored)
                .await
                .map_err(channel_error(job_id, "rebuild"))?;
            job.ibq_down = found;
            job.ibq_restored = 0;
        }
        if job.ibq_down.is_empty() {
            return Ok((Vec::new(), Some(Vec::new())));
        }
        self.channels
            .rebuild(&job.ibq_down, CHANNEL_REBUILD_TIMEOUT)
            .await
            .map_err(channel_error(job_id, "rebuild"))
    }

    /// The processes of a tree restored with new PIDs that hold its `expected` channels: every
    /// process of the job is flagged, and those whose channel says hello (down) within the
    /// rebuild timeout are the ones; the others' flags are lowered.
    async fn find_restored_channels(
        &self,
        job: &NodeJob,
        expected: usize,
    ) -> Result<Vec<i32>, ChannelFailure> {
        let begin = std::time::Instant::now();
        let mut flagged = std::collections::HashSet::new();
        loop {
            let pids = job.cgroup.pids().unwrap_or_default();
            for &p in &pids {
                if flagged.insert(p) {
                    self.channels.raise_flag(p)?;
                }
            }
            let down = self.channels.down_among(&pids).await;
            if down.len() >= expected {
                // Every flag raised but the channels' own, those of processes gone since too.
                self.channels
                    .lower_flags(flagged.into_iter().filter(|p| !down.contains(p)));
                return Ok(down);
            }
            if begin.elapsed() > CHANNEL_REBUILD_TIMEOUT {
                self.channels.lower_flags(flagged);
                return Err(ChannelFailure {
                    pid: pids.first().copied().unwrap_or(0),
                    message: format!(
                        "{} of the {expected} channels of the restored processes came back within {CHANNEL_REBUILD_TIMEOUT:?}",
                        down.len()
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Connects the rebuilt channels to the job's endpoints (all nodes) and lets them run.
    pub(crate) async fn reconnect_channels(
        &self,
        job: &mut NodeJob,
        endpoints: &[ib_quiesce::Endpoint],
    ) -> Result<(), AgentError> {
        let job_id = job.id();
        if job.ibq_down.is_empty() {
            return Ok(());
        }
        self.channels
            .reconnect(&job.ibq_down, endpoints, CHANNEL_REBUILD_TIMEOUT)
            .await
            .map_err(channel_error(job_id, "reconnect"))?;
        job.ibq_down.clear();
        Ok(())
    }
}
