//! The fake agents and the cluster the phase tests drive: one scripted `Agent` service per
//! node on a Unix socket, and the real coordinator over them.
//!
//! One file: the scripted fake agent and the cluster of them the phase tests drive, whose scripts
//! and assertions name each other.
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_server::{Agent, AgentServer};
pub(crate) use coordinator::agents::Registration;
use coordinator::config::CoordinatorConfig;
use coordinator::driver::{Caller, Coordinator, DriveError, RunSpec};
use coordinator::model::{EpochState, JobState, Phase, Trigger};
use coordinator::registry::Registry;
use tokio::sync::mpsc;
use tonic::{Code, Request, Response, Status};

/// What a fake agent does in one call.
#[derive(Clone, Debug)]
pub(crate) enum Act {
    /// Answers with an error.
    Fail(Code),
    /// Answers with an error when the call's detail starts with the text (e.g. an epoch).
    FailIf(Code, &'static str),
    /// Never answers (the test's end drops it).
    Hang,
    /// Answers after the delay, as if unscripted.
    Delay(Duration),
}

/// The calls of every fake agent, and what they are told to do.
#[derive(Default)]
pub(crate) struct World {
    /// (node, call) -> act; calls not listed succeed.
    pub(crate) script: HashMap<(String, &'static str), Act>,
    /// (node, call, detail) in the order they arrived.
    pub(crate) log: Vec<(String, &'static str, String)>,
    /// ib-quiesce channels every node reports in initial synchronization.
    pub(crate) channels: u32,
    /// Verbs layers that node reports drained in its first quiesce round of an epoch.
    pub(crate) drained: HashMap<String, u32>,
    /// Quiesce rounds each (node, epoch) was asked for.
    pub(crate) quiesce_rounds: HashMap<(String, u32), u32>,
    /// Epoch streams opened, over all nodes.
    pub(crate) streams: u32,
    /// (node, detail) of every launch, kept when the log is cleared.
    pub(crate) launches: Vec<(String, String)>,
}

pub(crate) type Shared = Arc<Mutex<World>>;

#[derive(Clone)]
pub(crate) struct FakeAgent {
    pub(crate) node: String,
    pub(crate) world: Shared,
}

impl FakeAgent {
    /// Logs the call and plays the script for it.
    pub(crate) async fn enter(&self, call: &'static str, detail: String) -> Result<(), Status> {
        let act = {
            let mut w = self.world.lock().unwrap();
            w.log.push((self.node.clone(), call, detail));
            w.script.get(&(self.node.clone(), call)).cloned()
        };
        match act {
            None => Ok(()),
            Some(Act::FailIf(_, prefix))
                if !detail_of(&self.world, &self.node, call).starts_with(prefix) =>
            {
                Ok(())
            }
            Some(Act::Fail(code) | Act::FailIf(code, _)) => {
                Err(Status::new(code, format!("{call} refused by the script")))
            }
            Some(Act::Hang) => {
                std::future::pending::<()>().await;
                unreachable!()
            }
            Some(Act::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
        }
    }
}

impl FakeAgent {
    /// One phase of an epoch stream: logged under the phase's name and played like a call.
    pub(crate) async fn phase(&self, cmd: pb::EpochCommand) -> pb::EpochEvent {
        let phase = cmd.phase();
        let call = phase_call(phase);
        let detail = match phase {
            pb::Phase::Resume => format!("{} kill={}", cmd.epoch, cmd.kill),
            pb::Phase::InitialSync if !cmd.prune.is_empty() => {
                format!("{} prune={:?}", cmd.epoch, cmd.prune)
            }
            _ => cmd.epoch.to_string(),
        };
        let mut ev = pb::EpochEvent {
            phase: phase as i32,
            nodes: 1,
            ..Default::default()
        };
        if let Err(s) = self.enter(call, detail).await {
            ev.failure = Some(pb::PhaseFailure {
                node: self.node.clone(),
                code: s.code() as i32,
                message: s.message().to_string(),
            });
            return ev;
        }
        match phase {
            pb::Phase::InitialSync => {
                ev.processes = 2;
                ev.estimated_bytes = 1 << 20;
                ev.staging_free_bytes = 1 << 30;
                ev.channels = self.world.lock().unwrap().channels;
            }
            pb::Phase::Quiesce => {
                let mut w = self.world.lock().unwrap();
                let round = w
                    .quiesce_rounds
                    .entry((self.node.clone(), cmd.epoch))
                    .or_default();
                *round += 1;
                if *round == 1 {
                    ev.drained = w.drained.get(&self.node).copied().unwrap_or(0);
                }
            }
            pb::Phase::Resume => ev.frozen_us = 5_000,
            pb::Phase::Finalize => {
                ev.image_bytes = 1000;
                ev.image_files = 3;
                ev.manifests = [(self.node.clone(), digest(&self.node, cmd.epoch))].into();
            }
            _ => {}
        }
        ev
    }
}

/// The name the fakes log a phase under.
pub(crate) fn phase_call(p: pb::Phase) -> &'static str {
    match p {
        pb::Phase::InitialSync => "initial-sync",
        pb::Phase::Quiesce => "quiesce",
        pb::Phase::LocalCheckpoint => "local-checkpoint",
        pb::Phase::Resume => "resume",
        pb::Phase::Finalize => "finalize",
        pb::Phase::Unspecified => "unspecified",
    }
}

/// The detail of the last `call` that `node` got.
pub(crate) fn detail_of(world: &Shared, node: &str, call: &str) -> String {
    let w = world.lock().unwrap();
    w.log
        .iter()
        .rev()
        .find(|(n, c, _)| n == node && *c == call)
        .map(|(_, _, d)| d.clone())
        .unwrap_or_default()
}

pub(crate) type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Agent for FakeAgent {
    async fn launch(
        &self,
        r: Request<pb::LaunchRequest>,
    ) -> Result<Response<pb::LaunchReply>, Status> {
        // The job, and the UCX settings it was given (sorted).
        let r = r.get_ref();
        let mut ucx: Vec<String> = r
            .env
            .iter()
            .filter(|(k, _)| k.starts_with("UCX_"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        ucx.sort();
        let detail = format!("{} {}", r.job_id, ucx.join(" "));
        let who = (self.node.clone(), detail.clone());
        self.world.lock().unwrap().launches.push(who);
        self.enter("launch", detail).await?;
        Ok(Response::new(pb::LaunchReply {
            pid: 100,
            job_dir: String::new(),
            incarnation: 0,
        }))
    }
    type EpochStream = Stream<pb::EpochEvent>;
    async fn epoch(
        &self,
        r: Request<tonic::Streaming<pb::EpochCommand>>,
    ) -> Result<Response<Self::EpochStream>, Status> {
        self.world.lock().unwrap().streams += 1;
        let mut commands = r.into_inner();
        let me = self.clone();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            while let Ok(Some(cmd)) = commands.message().await {
                let ev = me.phase(cmd).await;
                if tx.send(Ok(ev)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
    async fn abort(
        &self,
        r: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        self.enter("abort", r.get_ref().epoch.to_string()).await?;
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn restore(
        &self,
        r: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreReply>, Status> {
        let r = r.into_inner();
        let from = if r.source_node.is_empty() {
            String::new()
        } else {
            format!(" from={}", r.source_node)
        };
        let partner = if r.partner.is_empty() {
            String::new()
        } else {
            format!(" partner={}", r.partner)
        };
        let group = if r.encoding.is_empty() {
            String::new()
        } else {
            let names: Vec<&str> = r.group.iter().map(|g| g.node.as_str()).collect();
            format!(" group={}", names.join(","))
        };
        self.enter(
            "restore",
            format!(
                "{} hold={} digest={}{partner}{group}{from}",
                r.epoch, r.hold, r.manifest_digest
            ),
        )
        .await?;
        Ok(Response::new(pb::RestoreReply {
            pid: 100,
            incarnation: 1,
            source: pb::CopyLocation::Local.into(),
            ..Default::default()
        }))
    }
    async fn signal(
        &self,
        _: Request<pb::SignalRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        self.enter("signal", String::new()).await?;
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn inspect(
        &self,
        _: Request<pb::InspectRequest>,
    ) -> Result<Response<pb::NodeJobInfo>, Status> {
        self.enter("inspect", String::new()).await?;
        Ok(Response::new(pb::NodeJobInfo {
            node: self.node.clone(),
            state: pb::PartState::Running.into(),
            ..Default::default()
        }))
    }
    async fn release(
        &self,
        r: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        self.enter("release", format!("kill={}", r.get_ref().kill))
            .await?;
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn poll(&self, _: Request<pb::PollRequest>) -> Result<Response<pb::PollReply>, Status> {
        Err(Status::unimplemented("poll"))
    }
    async fn verify(
        &self,
        req: Request<pb::VerifyNodeRequest>,
    ) -> Result<Response<pb::NodeVerify>, Status> {
        self.enter("verify", req.get_ref().epoch.to_string())
            .await?;
        Ok(Response::new(pb::NodeVerify {
            node: self.node.clone(),
            ok: true,
            ..Default::default()
        }))
    }
    async fn prune(
        &self,
        r: Request<pb::PruneRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        let r = r.into_inner();
        let detail = format!("{:?}{}", r.epochs, if r.shared { " shared" } else { "" });
        self.enter("prune", detail).await?;
        Ok(Response::new(pb::PhaseReply::default()))
    }
    type FlushStream = Stream<pb::FlushProgress>;
    async fn flush(
        &self,
        _: Request<pb::FlushRequest>,
    ) -> Result<Response<Self::FlushStream>, Status> {
        self.enter("flush", String::new()).await?;
        let done = pb::FlushProgress {
            done: true,
            ..Default::default()
        };
        Ok(Response::new(Box::pin(tokio_stream::iter([Ok(done)]))))
    }
    async fn allow_fetch(
        &self,
        r: Request<pb::AllowFetchRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        let r = r.into_inner();
        let what = if r.parity { " parity" } else { "" };
        self.enter(
            "allow-fetch",
            format!("{} {} {}->{}{what}", r.job_id, r.epoch, r.node, r.grantee),
        )
        .await?;
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn publish(
        &self,
        _: Request<pb::PublishRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        self.enter("publish", String::new()).await?;
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn replicate(
        &self,
        _: Request<pb::ReplicateRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        self.enter("replicate", String::new()).await?;
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn receive(
        &self,
        _: Request<tonic::Streaming<pb::ImageChunk>>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        Err(Status::unimplemented("receive"))
    }
    /// Every member's images are 10,000 bytes times its place in the group, plus 1; this node
    /// answers for the rows the layout gives it.
    async fn encode(
        &self,
        r: Request<pb::EncodeRequest>,
    ) -> Result<Response<pb::EncodeReply>, Status> {
        let r = r.into_inner();
        let names: Vec<&str> = r.members.iter().map(|m| m.node.as_str()).collect();
        self.enter(
            "encode",
            format!("{} {} {}", r.epoch, r.scheme, names.join(",")),
        )
        .await?;
        let scheme: ckpt_store::erasure::Scheme =
            r.scheme.parse().map_err(Status::invalid_argument)?;
        let lens: Vec<u64> = (1..=names.len() as u64).map(|i| i * 10_000 + 1).collect();
        let layout = ckpt_store::erasure::Layout::new(scheme.parity(), &lens)
            .map_err(Status::invalid_argument)?;
        let me = names
            .iter()
            .position(|n| *n == self.node)
            .expect("a member");
        let shards = (0..layout.members())
            .flat_map(|row| {
                let holders = layout.holders(row);
                let size = layout.row_size(row);
                holders
                    .into_iter()
                    .enumerate()
                    .filter(move |(_, h)| *h == me)
                    .map(move |(index, _)| pb::ParityShardInfo {
                        row: row as u32,
                        index: index as u32,
                        size,
                        digest: format!("p{row}.{index}"),
                    })
            })
            .collect();
        Ok(Response::new(pb::EncodeReply {
            shards,
            stream_lens: lens,
            manifest_lens: vec![100; names.len()],
            elapsed_us: 0,
        }))
    }
    type ReadSegmentStream = Stream<pb::SegmentChunk>;
    async fn read_segment(
        &self,
        _: Request<pb::SegmentRequest>,
    ) -> Result<Response<Self::ReadSegmentStream>, Status> {
        Err(Status::unimplemented("read_segment"))
    }
    type SendStream = Stream<pb::ImageChunk>;
    async fn send(
        &self,
        _: Request<pb::SendRequest>,
    ) -> Result<Response<Self::SendStream>, Status> {
        Err(Status::unimplemented("send"))
    }
    async fn rebuild(
        &self,
        r: Request<pb::RebuildRequest>,
    ) -> Result<Response<pb::RebuildReply>, Status> {
        self.enter("rebuild", r.get_ref().epoch.to_string()).await?;
        Ok(Response::new(pb::RebuildReply::default()))
    }
    async fn reconnect(
        &self,
        _: Request<pb::ReconnectRequest>,
    ) -> Result<Response<pb::PhaseReply>, Status> {
        self.enter("reconnect", String::new()).await?;
        Ok(Response::new(pb::PhaseReply::default()))
    }
}

/// The manifest digest the fake of `node` seals `epoch` with.
pub(crate) fn digest(node: &str, epoch: u32) -> String {
    format!("digest-{node}-{epoch}")
}

pub(crate) const NODES: [&str; 3] = ["n1", "n2", "n3"];
pub(crate) const OWNER: Caller = Caller {
    uid: 1000,
    gid: 1000,
    pid: None,
};
pub(crate) const ROOT: Caller = Caller {
    uid: 0,
    gid: 0,
    pid: None,
};

/// A coordinator and one fake agent per node of [`NODES`], with short deadlines.
pub(crate) struct Cluster {
    pub(crate) coord: Arc<Coordinator>,
    pub(crate) world: Shared,
    _dir: tempfile::TempDir,
}

impl Cluster {
    pub(crate) async fn start() -> Cluster {
        Self::start_with(|_| {}).await
    }

    /// [`Cluster::start`] with a changed configuration.
    pub(crate) async fn start_with(change: impl FnOnce(&mut CoordinatorConfig)) -> Cluster {
        Self::start_sharing(change, "").await
    }

    /// [`Cluster::start_with`], every node saying it flushes to `shared_dir` (none if empty).
    pub(crate) async fn start_sharing(
        change: impl FnOnce(&mut CoordinatorConfig),
        shared_dir: &str,
    ) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = CoordinatorConfig::default();
        cfg.redundancy.partner = false;
        change(&mut cfg);
        let d = &mut cfg.deadlines;
        for deadline in [
            &mut d.sync,
            &mut d.quiesce,
            &mut d.dump,
            &mut d.resume,
            &mut d.finalize,
        ] {
            *deadline = Duration::from_millis(300);
        }
        d.restore = Duration::from_millis(300);
        d.abort = Duration::from_secs(5);
        cfg.database = dir.path().join("ckptd.redb");
        let registry = Registry::open(&cfg.database).unwrap();
        let coord = Coordinator::new(registry, cfg, None).unwrap();
        let world = Shared::default();
        let c = Cluster {
            coord,
            world,
            _dir: dir,
        };
        for node in NODES {
            c.add_node_sharing(node, shared_dir).await;
        }
        c
    }

    /// Registers one more fake agent (a node that runs none of the job at first).
    pub(crate) async fn add_node(&self, node: &str) {
        self.add_node_sharing(node, "").await
    }

    /// Registers one more fake agent that says it flushes to `shared_dir` (its flushes
    /// succeed at once).
    pub(crate) async fn add_node_sharing(&self, node: &str, shared_dir: &str) {
        let (coord, world, dir) = (&self.coord, &self.world, &self._dir);
        {
            let sock = dir.path().join(format!("{node}.sock"));
            let listener = tokio::net::UnixListener::bind(&sock).unwrap();
            let fake = FakeAgent {
                node: node.into(),
                world: world.clone(),
            };
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(AgentServer::new(fake))
                    .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
            );
            coord
                .register_agent(
                    node,
                    Registration {
                        address: format!("unix:{}", sock.display()),
                        shared_dir: shared_dir.to_string(),
                        engines: vec![("criu".into(), "4.2".into())],
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
        }
    }

    /// A running job: launched on n1, with parts attached on n2 and n3.
    pub(crate) async fn job(&self) -> u64 {
        self.job_with_redundancy("").await
    }

    /// [`Cluster::job`] with `ckptctl run --redundancy` (empty: none given).
    pub(crate) async fn job_with_redundancy(&self, redundancy: &str) -> u64 {
        let spec = RunSpec {
            name: "fake".into(),
            argv: vec!["mpiexec".into()],
            cwd: "/".into(),
            env: HashMap::new(),
            node: "n1".into(),
            part_env: HashMap::from([("UCX_TLS".into(), "rc_verbs,ud_verbs,self".into())]),
            policy: Default::default(),
            engine: String::new(),
            on_failure: String::new(),
            redundancy: redundancy.into(),
        };
        let job = self.coord.run(OWNER, spec).await.unwrap();
        for host in &NODES[1..] {
            self.coord
                .attach(pb::AttachRequest {
                    job_id: job.id,
                    token: job.token.clone(),
                    host: host.to_string(),
                    command: "rank".into(),
                    cwd: "/".into(),
                    attempt: String::new(),
                })
                .await
                .unwrap();
        }
        self.world.lock().unwrap().log.clear();
        job.id
    }

    /// A stopped job with committed epochs 1 (kept running) and 2 (`--kill`).
    pub(crate) async fn stopped_job(&self) -> u64 {
        let job = self.job().await;
        self.checkpoint(job, false).await.unwrap();
        self.checkpoint(job, true).await.unwrap();
        assert_eq!(self.job_state(job), JobState::Stopped);
        self.world.lock().unwrap().log.clear();
        job
    }

    /// A running job of one node.
    pub(crate) async fn job_on(&self, node: &str) -> u64 {
        self.coord.run(OWNER, sleep_on(node)).await.unwrap().id
    }

    pub(crate) fn script(&self, node: &str, call: &'static str, act: Act) {
        self.world
            .lock()
            .unwrap()
            .script
            .insert((node.into(), call), act);
    }

    pub(crate) fn unscript(&self) {
        self.world.lock().unwrap().script.clear();
    }

    /// The nodes that got `call`, with its detail, in order.
    pub(crate) fn calls(&self, call: &str) -> Vec<(String, String)> {
        let w = self.world.lock().unwrap();
        w.log
            .iter()
            .filter(|(_, c, _)| *c == call)
            .map(|(n, _, d)| (n.clone(), d.clone()))
            .collect()
    }

    /// The nodes that got `call`, sorted.
    pub(crate) fn nodes_called(&self, call: &str) -> Vec<String> {
        let mut v: Vec<String> = self.calls(call).into_iter().map(|(n, _)| n).collect();
        v.sort();
        v
    }

    /// The nodes that got `call` with exactly `detail`, sorted.
    pub(crate) fn nodes_told(&self, call: &str, detail: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .calls(call)
            .into_iter()
            .filter(|(_, d)| d == detail)
            .map(|(n, _)| n)
            .collect();
        v.sort();
        v
    }

    /// Waits (bounded) until every node got `prune` (made in the background); returns the
    /// nodes told to delete `epochs` ("[1]").
    pub(crate) async fn pruned(&self, epochs: &str) -> Vec<String> {
        for n in NODES {
            self.wait_call(n, "prune").await;
        }
        self.nodes_told("prune", epochs)
    }

    /// The epochs a job's next epoch is to have its nodes delete.
    pub(crate) fn unpruned(&self, job: u64) -> Vec<u32> {
        self.coord.registry.job(job).unwrap().unwrap().unpruned
    }

    /// Waits (bounded) until `node` got `call`: for calls made in the background.
    pub(crate) async fn wait_call(&self, node: &str, call: &str) {
        for _ in 0..500 {
            if self.calls(call).iter().any(|(n, _)| n == node) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "{node} never got {call}: {:?}",
            self.world.lock().unwrap().log
        );
    }

    pub(crate) async fn checkpoint(&self, job: u64, kill: bool) -> Result<u32, DriveError> {
        let (job, epoch) = self
            .coord
            .begin_checkpoint(&OWNER, job, kill, Trigger::User)
            .await?;
        let (tx, _rx) = mpsc::unbounded_channel();
        self.coord
            .drive_checkpoint(job, epoch, tx)
            .await
            .map(|e| e.number)
    }

    pub(crate) async fn restart(&self, job: u64, epoch: u32) -> Result<u32, DriveError> {
        self.restart_on(job, epoch, &Default::default()).await
    }

    pub(crate) async fn restart_on(
        &self,
        job: u64,
        epoch: u32,
        placement: &coordinator::driver::Placement,
    ) -> Result<u32, DriveError> {
        let begun = self
            .coord
            .begin_restart(&OWNER, job, epoch, placement)
            .await?;
        let (tx, _rx) = mpsc::unbounded_channel();
        let record = begun.record(Trigger::User, "a test".into());
        self.coord
            .drive_restart(begun, true, record, tx)
            .await
            .map(|(_, e, _)| e.number)
    }

    pub(crate) fn job_state(&self, job: u64) -> JobState {
        self.coord
            .registry
            .job(job)
            .unwrap()
            .unwrap()
            .state()
            .clone()
    }

    pub(crate) fn epoch_state(&self, job: u64, epoch: u32) -> EpochState {
        self.coord
            .registry
            .epoch(job, epoch)
            .unwrap()
            .unwrap()
            .state
    }
}

/// The agent calls of each checkpoint phase, in order, with the phase's name.
pub(crate) const PHASES: [(&str, Phase); 5] = [
    ("initial-sync", Phase::InitialSync),
    ("quiesce", Phase::Quiesce),
    ("local-checkpoint", Phase::LocalCheckpoint),
    ("resume", Phase::Resume),
    ("finalize", Phase::Finalize),
];

pub(crate) fn all_nodes() -> Vec<String> {
    NODES.iter().map(|n| n.to_string()).collect()
}

/// What `run` gets for a job of one node (`sleep`).
pub(crate) fn sleep_on(node: &str) -> RunSpec {
    RunSpec {
        name: "other".into(),
        argv: vec!["sleep".into()],
        cwd: "/".into(),
        env: HashMap::new(),
        node: node.into(),
        part_env: HashMap::new(),
        policy: Default::default(),
        engine: String::new(),
        on_failure: String::new(),
        redundancy: String::new(),
    }
}
