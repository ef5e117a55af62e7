//! The `Agent.Epoch` stream: this node's phases, one after the other as the caller sends
//! them ([`run_phase`]); for an epoch whose initial-sync carries a relay plan, the phases of
//! the plan's nodes too, driven through `relay.rs` with this node's own as one [`LocalLink`];
//! and, when the caller is another node's agent, the check of its grant on every command
//! before anything runs. The service's trait method in `grpc.rs` calls [`AgentHandler::epoch_stream`].
use std::collections::VecDeque;
use std::sync::Arc;

use ckpt_proto::v1 as pb;
use epoch_link::failure::{FailureKind, NodeFailure};
use epoch_link::link::{failure_event, failure_of, EpochLink};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::grpc::{to_status, us, AgentHandler};
use super::relay::{authorize, Relaying};
use crate::checkpoint::CheckpointRun;
use crate::error::AgentError;
use crate::jobs::Jobs;

impl AgentHandler {
    /// Serves one epoch stream: answers every command of `commands` in order; the stream
    /// ends when the caller closes its side (or goes away), or at the first command refused
    /// to `relay_caller` (a node's agent; `None`: the coordinator).
    pub(super) fn epoch_stream(
        &self,
        relay_caller: Option<String>,
        mut commands: tonic::Streaming<pb::EpochCommand>,
    ) -> ReceiverStream<Result<pb::EpochEvent, Status>> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let jobs = self.jobs.clone();
        tokio::spawn(async move {
            let mut job = None;
            let mut grant = None;
            let mut relaying: Option<Relaying> = None;
            while let Ok(Some(mut cmd)) = commands.message().await {
                if let Some(caller) = &relay_caller {
                    if let Err(s) = authorize(&jobs, caller, &mut grant, &cmd) {
                        let _ = tx.send(Err(s)).await;
                        break;
                    }
                }
                let ev = match cmd.relay.take() {
                    // The coordinator makes this node a relay for the epoch this begins.
                    Some(plan) if cmd.phase() == pb::Phase::InitialSync => {
                        let opened = match relaying.take().and_then(|r| r.reuse(&plan, &cmd)) {
                            Some(kept) => Ok(kept),
                            None => {
                                let local = Box::new(LocalLink {
                                    jobs: jobs.clone(),
                                    job: Some(cmd.job_id),
                                    queue: VecDeque::new(),
                                });
                                Relaying::open(&jobs, plan, &cmd, local).await
                            }
                        };
                        match opened {
                            Ok(mut r) => {
                                let ev = r.run(cmd).await;
                                relaying = Some(r);
                                ev
                            }
                            Err(f) => failure_event(cmd.phase(), &f),
                        }
                    }
                    _ => match &mut relaying {
                        Some(r) if r.carries(&cmd) => r.run(cmd).await,
                        _ => {
                            relaying = None;
                            run_phase(&jobs, cmd, &mut job).await
                        }
                    },
                };
                if tx.send(Ok(ev)).await.is_err() {
                    break;
                }
            }
        });
        ReceiverStream::new(rx)
    }
}

/// This node's own phases as one link of a relay.
struct LocalLink {
    jobs: Arc<Jobs>,
    job: Option<u64>,
    queue: VecDeque<pb::EpochCommand>,
}

impl std::fmt::Debug for LocalLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLink")
            .field("node", &self.jobs.node())
            .field("queue", &self.queue.len())
            .finish()
    }
}

#[tonic::async_trait]
impl EpochLink for LocalLink {
    fn node(&self) -> &str {
        self.jobs.node()
    }

    fn send(&mut self, cmd: pb::EpochCommand) -> Result<(), NodeFailure> {
        self.queue.push_back(cmd);
        Ok(())
    }

    fn reusable(&self) -> bool {
        self.queue.is_empty()
    }

    async fn next(&mut self) -> Result<pb::EpochEvent, NodeFailure> {
        let Some(cmd) = self.queue.pop_front() else {
            return Err(NodeFailure {
                node: self.jobs.node().to_string(),
                kind: FailureKind::Internal,
                message: "asked for the answer to a phase it was not sent".into(),
            });
        };
        let ev = run_phase(&self.jobs, cmd, &mut self.job).await;
        match failure_of(&ev) {
            Some(f) => Err(f),
            None => Ok(ev),
        }
    }
}

/// Runs one phase of an epoch stream; `stream_job` is the job the stream's first command
/// named: a stream carries the epochs of one job, one after the other.
///
/// An initial synchronization first deletes the images of the epochs it names as expired
/// (retention, see `EpochCommand.prune`).
async fn run_phase(
    jobs: &Jobs,
    cmd: pb::EpochCommand,
    stream_job: &mut Option<u64>,
) -> pb::EpochEvent {
    let phase = cmd.phase();
    let begin = std::time::Instant::now();
    let mut ev = pb::EpochEvent {
        phase: phase as i32,
        nodes: 1,
        ..Default::default()
    };
    let done = match (*stream_job.get_or_insert(cmd.job_id), cmd.epoch) {
        (j, _) if j != cmd.job_id => Err(Status::invalid_argument(format!(
            "this epoch stream carries job {j}, not job {}",
            cmd.job_id
        ))),
        (job, epoch) => {
            let run = CheckpointRun::of(jobs, job);
            match phase {
                // Retention's deletions come first: the free staging reported counts their room.
                // Never the epoch the command begins.
                pb::Phase::InitialSync => match prune_expired(jobs, job, epoch, &cmd.prune).await {
                    Ok(()) => run.initial_sync(epoch).await,
                    Err(e) => Err(e),
                }
                .map(|p| {
                    ev.processes = p.processes;
                    ev.estimated_bytes = p.estimated_bytes;
                    ev.staging_free_bytes = p.staging_free_bytes;
                    ev.channels = p.channels;
                }),
                pb::Phase::Quiesce => run
                    .quiesce(epoch)
                    .await
                    .map(|(_, drained)| ev.drained = drained),
                pb::Phase::LocalCheckpoint => run
                    .local_checkpoint(epoch, cmd.kill)
                    .await
                    .map(|(_, frozen)| ev.frozen_us = us(frozen)),
                pb::Phase::Resume => run
                    .resume(epoch, cmd.kill)
                    .await
                    .map(|(_, frozen)| ev.frozen_us = us(frozen)),
                pb::Phase::Finalize => run.finalize(epoch).await.map(|f| {
                    ev.image_bytes = f.image_bytes;
                    ev.image_files = f.image_files;
                    ev.manifests = [(jobs.node().to_string(), f.manifest_digest)].into();
                }),
                pb::Phase::Unspecified => {
                    return failed(
                        ev,
                        jobs,
                        &Status::invalid_argument("epoch command without a phase"),
                    )
                }
            }
            .map_err(to_status)
        }
    };
    match done {
        Ok(()) => {
            ev.elapsed_us = us(begin.elapsed());
            ev
        }
        Err(s) => failed(ev, jobs, &s),
    }
}

/// Deletes this node's images of the epochs retention expired (`EpochCommand.prune`), never
/// those of `epoch`, the one beginning.
async fn prune_expired(
    jobs: &Jobs,
    job: u64,
    epoch: u32,
    expired: &[u32],
) -> Result<(), AgentError> {
    let old: Vec<u32> = expired.iter().copied().filter(|&e| e != epoch).collect();
    if old.is_empty() {
        return Ok(());
    }
    jobs.node.prune(job, &old, false, false).await
}

/// The event of a phase that failed with `s`.
fn failed(ev: pb::EpochEvent, jobs: &Jobs, s: &Status) -> pb::EpochEvent {
    pb::EpochEvent {
        phase: ev.phase,
        failure: Some(pb::PhaseFailure {
            node: jobs.node().to_string(),
            code: s.code() as i32,
            message: s.message().to_string(),
        }),
        ..Default::default()
    }
}
