//! Coordination cost of one checkpoint epoch: the real coordinator (phase driver, redb registry,
//! gRPC clients) drives a job spanning N nodes whose agents answer every phase at once (a no-op
//! snapshot engine). What is measured is the protocol: five barriers over N agents plus the
//! commit. Target: at most 50 ms at 1024 agents.
//!
//! Two groups: `coordination_round/N`, flat (ckptd holds a stream to every agent), and
//! `coordination_relayed/N`, with relays deployed as `[relays] fanout = 32` deploys them: the
//! coordinator signs a grant per group and drives the group's first agent, which checks nothing
//! of its own but relays with the real `Relay` and `GrpcLink` over epoch streams to the others,
//! each of which checks the grant's signature against the cluster CA as an agent does. After
//! the run, each group's coordinator CPU per round (the bench process's user + system time: the
//! agents run in the child) is printed to stderr as `cpu GROUP/N: X ms per round, Y ms more
//! for the partner copies`.
//!
//! After each commit ckptd starts the partner copies of the default `[redundancy]` in the
//! background (one `Replicate` call per node). The bench waits for them to be recorded before
//! the next round, outside the timed part, as the minutes between a job's epochs would; their
//! CPU is the second figure.
//!
//! The N agents run in one child process (this binary again, with `CKPT_BENCH_AGENTS=N`), on
//! loopback. With `CKPT_BENCH_PIN=1` the coordinator is pinned to CPU 0 and the agents to CPU 1,
//! closer to a cluster where agents do not share the coordinator's cores.
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_server::{Agent, AgentServer};
use coordinator::config::CoordinatorConfig;
use coordinator::driver::{Caller, Coordinator, RunSpec};
use coordinator::failure::NodeFailure;
use coordinator::link::{EpochLink, GrpcLink};
use coordinator::registry::Registry;
use coordinator::relay::{Authorized, Relay, ShownGrant};
use std::io::{BufRead, Write};

use criterion::{BenchmarkId, Criterion};
use tonic::{Request, Response, Status};

/// An agent whose every phase succeeds immediately; it relays when a plan tells it to.
#[derive(Debug, Clone)]
struct NoopAgent {
    node: String,
    cred: Arc<ckpt_auth::tls::Credential>,
}

/// The no-op answer of `node` to `cmd`.
fn noop_answer(node: &str, cmd: &pb::EpochCommand) -> pb::EpochEvent {
    let mut ev = pb::EpochEvent {
        phase: cmd.phase,
        nodes: 1,
        ..Default::default()
    };
    if cmd.phase() == pb::Phase::Finalize {
        ev.manifests = [(node.to_string(), "noop".to_string())].into();
    }
    ev
}

/// A relay's own node.
#[derive(Debug)]
struct NoopLink {
    node: String,
    queue: std::collections::VecDeque<pb::EpochCommand>,
}

#[tonic::async_trait]
impl EpochLink for NoopLink {
    fn node(&self) -> &str {
        &self.node
    }
    fn send(&mut self, cmd: pb::EpochCommand) -> Result<(), NodeFailure> {
        self.queue.push_back(cmd);
        Ok(())
    }
    async fn next(&mut self) -> Result<pb::EpochEvent, NodeFailure> {
        let cmd = self.queue.pop_front().expect("a command");
        Ok(noop_answer(&self.node, &cmd))
    }
}

/// A relay over a group: its nodes, the grant its links show, the relay.
struct Relaying {
    children: Vec<String>,
    authority: ShownGrant,
    relay: Relay,
}

impl NoopAgent {
    /// A relay over the plan's nodes, dialled at once with this agent's credential; or the
    /// last epoch's, when it had the same nodes (its streams stay open, as ckptd's do), with
    /// this epoch's grant.
    async fn relay(&self, plan: pb::RelayPlan, last: Option<Relaying>) -> Relaying {
        let children: Vec<String> = plan.children.iter().map(|c| c.node.clone()).collect();
        if let Some(r) = last.filter(|r| r.children == children) {
            *r.authority.lock().expect("grant") = plan.authority;
            return r;
        }
        let authority: ShownGrant = Arc::new(std::sync::Mutex::new(plan.authority));
        let dials: Vec<_> = plan
            .children
            .iter()
            .map(|c| {
                let cfg = self
                    .cred
                    .client_config(ckpt_auth::Identity::Node(c.node.clone()))
                    .expect("client config");
                let address = c.address.clone();
                tokio::spawn(async move {
                    ckpt_auth::transport::connect(
                        &address,
                        ckpt_auth::transport::Dial::Tls(cfg),
                        Duration::from_secs(10),
                    )
                    .await
                })
            })
            .collect();
        let mut links: Vec<Box<dyn EpochLink>> = vec![Box::new(NoopLink {
            node: self.node.clone(),
            queue: Default::default(),
        })];
        for (c, dial) in plan.children.iter().zip(dials) {
            let ch = dial.await.expect("dial task").expect("dial a child");
            links.push(Box::new(Authorized::new(
                GrpcLink::open(&c.node, ckpt_proto::fenced_agent(ch, None)),
                authority.clone(),
            )));
        }
        Relaying {
            children,
            authority,
            relay: Relay::new(&self.node, links),
        }
    }
}

type R<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl Agent for NoopAgent {
    async fn launch(&self, _: Request<pb::LaunchRequest>) -> R<pb::LaunchReply> {
        Ok(Response::new(pb::LaunchReply {
            pid: 1,
            job_dir: "/nonexistent".into(),
            incarnation: 1,
        }))
    }
    type EpochStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::EpochEvent, Status>> + Send>>;
    async fn epoch(&self, r: Request<tonic::Streaming<pb::EpochCommand>>) -> R<Self::EpochStream> {
        let mut commands = r.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let me = self.clone();
        tokio::spawn(async move {
            let mut relaying: Option<Relaying> = None;
            while let Ok(Some(mut c)) = commands.message().await {
                // Below a relay: its grant is checked once per epoch, as an agent does.
                if let (Some(a), pb::Phase::InitialSync) = (&c.authority, c.phase()) {
                    me.cred
                        .check_signed(
                            &a.issuer,
                            &a.grant,
                            &a.signature,
                            &ckpt_auth::Identity::Coordinator,
                        )
                        .expect("a valid grant");
                }
                if let Some(plan) = c.relay.take() {
                    relaying = Some(me.relay(plan, relaying.take()).await);
                }
                let ev = match relaying.as_mut() {
                    Some(r) => {
                        r.relay.send(c).expect("relay");
                        r.relay.next().await.expect("relayed answer")
                    }
                    None => noop_answer(&me.node, &c),
                };
                if tx.send(Ok(ev)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
    async fn abort(&self, _: Request<pb::AbortRequest>) -> R<pb::PhaseReply> {
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn restore(&self, _: Request<pb::RestoreRequest>) -> R<pb::RestoreReply> {
        Ok(Response::new(pb::RestoreReply::default()))
    }
    async fn signal(&self, _: Request<pb::SignalRequest>) -> R<pb::PhaseReply> {
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn inspect(&self, _: Request<pb::InspectRequest>) -> R<pb::NodeJobInfo> {
        Ok(Response::new(pb::NodeJobInfo {
            state: pb::PartState::Running.into(),
            ..Default::default()
        }))
    }
    async fn release(&self, _: Request<pb::ReleaseRequest>) -> R<pb::PhaseReply> {
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn poll(&self, _: Request<pb::PollRequest>) -> R<pb::PollReply> {
        Ok(Response::new(pb::PollReply::default()))
    }
    async fn prune(&self, _: Request<pb::PruneRequest>) -> R<pb::PhaseReply> {
        Ok(Response::new(pb::PhaseReply::default()))
    }
    type FlushStream = tokio_stream::Empty<Result<pb::FlushProgress, Status>>;
    async fn flush(&self, _: Request<pb::FlushRequest>) -> R<Self::FlushStream> {
        Err(Status::unimplemented("this agent has no shared storage"))
    }
    async fn rebuild(&self, _: Request<pb::RebuildRequest>) -> R<pb::RebuildReply> {
        Ok(Response::new(pb::RebuildReply::default()))
    }
    async fn reconnect(&self, _: Request<pb::ReconnectRequest>) -> R<pb::PhaseReply> {
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn publish(&self, _: Request<pb::PublishRequest>) -> R<pb::PhaseReply> {
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn replicate(&self, _: Request<pb::ReplicateRequest>) -> R<pb::PhaseReply> {
        Ok(Response::new(pb::PhaseReply::default()))
    }
    async fn allow_fetch(&self, _: Request<pb::AllowFetchRequest>) -> R<pb::PhaseReply> {
        Err(Status::unimplemented("this agent keeps no partner copies"))
    }
    async fn receive(&self, _: Request<tonic::Streaming<pb::ImageChunk>>) -> R<pb::PhaseReply> {
        Err(Status::unimplemented("this agent keeps no partner copies"))
    }
    async fn encode(&self, _: Request<pb::EncodeRequest>) -> R<pb::EncodeReply> {
        Err(Status::unimplemented("this agent encodes no parity"))
    }
    type ReadSegmentStream = tokio_stream::Empty<Result<pb::SegmentChunk, Status>>;
    async fn read_segment(&self, _: Request<pb::SegmentRequest>) -> R<Self::ReadSegmentStream> {
        Err(Status::unimplemented("this agent keeps no images"))
    }
    type SendStream = tokio_stream::Empty<Result<pb::ImageChunk, Status>>;
    async fn send(&self, _: Request<pb::SendRequest>) -> R<Self::SendStream> {
        Err(Status::unimplemented("this agent keeps no partner copies"))
    }
    async fn verify(&self, _: Request<pb::VerifyNodeRequest>) -> R<pb::NodeVerify> {
        Ok(Response::new(pb::NodeVerify {
            ok: true,
            ..Default::default()
        }))
    }
}

/// Lets this process hold a few thousand sockets (two per agent).
fn raise_fd_limit() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit write/read a valid local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// Pins the calling process (all its threads made after this) to one CPU.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes within it; sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Child mode: serves `n` no-op agents, prints their addresses, runs until stdin closes.
fn serve_agents(n: usize) {
    raise_fd_limit();
    if std::env::var_os("CKPT_BENCH_PIN").is_some() {
        pin_to(1);
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut out = String::new();
        // Each agent serves TLS with a credential of its own (node a<i>), as a real one does.
        let ca = std::path::PathBuf::from(std::env::var_os("CKPT_BENCH_CA").expect("CA dir"));
        for i in 0..n {
            let bundle = ckpt_auth::ca::issue(&ca, &format!("a{i}")).expect("issue");
            let cred = ckpt_auth::tls::Credential::from_bundle(
                &ckpt_auth::ca::Bundle::parse(&bundle).expect("bundle"),
            )
            .expect("credential");
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            out.push_str(&format!("{}\n", l.local_addr().expect("addr")));
            let tls = cred.server_config().expect("server config");
            let agent = NoopAgent {
                node: format!("a{i}"),
                cred: Arc::new(cred),
            };
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(AgentServer::new(agent))
                    .serve_with_incoming(ckpt_auth::transport::tls_incoming(l, tls)),
            );
        }
        let mut so = std::io::stdout();
        so.write_all(out.as_bytes()).expect("stdout");
        so.flush().expect("stdout");
        // Until the parent goes away.
        let _ = tokio::task::spawn_blocking(|| {
            let mut s = String::new();
            let _ = std::io::stdin().read_line(&mut s);
        })
        .await;
    });
}

struct Setup {
    coord: Arc<Coordinator>,
    job: u64,
    agents: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = self.agents.kill();
        let _ = self.agents.wait();
    }
}

/// Starts `n` no-op agents (in a child process), a coordinator that knows them, and a job with
/// a part on each; with `fanout`, the coordinator relays every epoch through groups of it.
async fn setup(n: usize, fanout: Option<usize>) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let registry = Registry::open(&dir.path().join("ckptd.redb")).expect("registry");
    let ca = dir.path().join("tls");
    ckpt_auth::ca::init(&ca).expect("cluster CA");
    let cred = ckpt_auth::tls::Credential::load(&ca, &ckpt_auth::Identity::Coordinator)
        .expect("coordinator credential");
    let mut cfg = CoordinatorConfig::default();
    cfg.relays.above = if fanout.is_some() { 1 } else { 0 };
    cfg.relays.fanout = fanout.unwrap_or(2);
    let coord = Coordinator::new(registry, cfg, Some(cred)).expect("coordinator");
    let mut agents = std::process::Command::new(std::env::current_exe().expect("exe"))
        .env("CKPT_BENCH_AGENTS", n.to_string())
        .env("CKPT_BENCH_CA", &ca)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start agents");
    let mut lines = std::io::BufReader::new(agents.stdout.take().expect("stdout")).lines();
    for i in 0..n {
        let addr = lines.next().expect("agent address").expect("read");
        coord
            .register_agent(
                &format!("a{i}"),
                coordinator::agents::Registration {
                    address: addr,
                    ..Default::default()
                },
            )
            .await
            .expect("register");
    }
    let root = Caller {
        uid: 0,
        gid: 0,
        pid: None,
    };
    let job = coord
        .run(
            root,
            RunSpec {
                name: "bench".into(),
                argv: vec!["mpiexec".into()],
                cwd: "/".into(),
                env: Default::default(),
                node: "a0".into(),
                part_env: Default::default(),
                policy: Default::default(),
                engine: String::new(),
                on_failure: String::new(),
                redundancy: String::new(),
            },
        )
        .await
        .expect("run");
    for i in 1..n {
        coord
            .attach(pb::AttachRequest {
                job_id: job.id,
                token: job.token.clone(),
                host: format!("a{i}"),
                command: "proxy".into(),
                cwd: "/".into(),
                attempt: String::new(),
            })
            .await
            .expect("attach");
    }
    Setup {
        coord,
        job: job.id,
        agents,
        _dir: dir,
    }
}

/// One full protocol round: begin the epoch, run every phase on every node, commit. Returns
/// how long it took and the epoch's number.
async fn one_round(s: &Setup) -> (Duration, u32) {
    let root = Caller {
        uid: 0,
        gid: 0,
        pid: None,
    };
    let t = Instant::now();
    let (job, epoch) = s
        .coord
        .begin_checkpoint(&root, s.job, false, coordinator::model::Trigger::User)
        .await
        .expect("begin");
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let e = s
        .coord
        .drive_checkpoint(job, epoch, tx)
        .await
        .expect("epoch");
    assert!(e.is_restorable());
    (t.elapsed(), e.number)
}

/// Waits until the partner copies ckptd starts after `epoch`'s commit are recorded (the
/// default `[redundancy]`; 1,024 `Replicate` calls at 1,024 agents). On a cluster the next
/// epoch begins minutes later; run back to back, they would share the next round's cores.
async fn partner_copies_done(s: &Setup, epoch: u32) {
    for _ in 0..2000 {
        let e = s.coord.registry.epoch(s.job, epoch).expect("registry");
        if e.is_some_and(|e| !e.partners.is_empty()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the partner copies of epoch {epoch} were not recorded within 10 s");
}

/// CPU time (user + system) of this process so far.
fn cpu_time() -> Duration {
    // SAFETY: a zeroed rusage is valid (plain integers); getrusage writes into it.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn coordination(c: &mut Criterion) {
    raise_fd_limit();
    if std::env::var_os("CKPT_BENCH_PIN").is_some() {
        pin_to(0);
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mut cpu = Vec::new();
    for (group, fanout, sizes) in [
        ("coordination_round", None, &[16usize, 64, 256, 1024][..]),
        ("coordination_relayed", Some(32), &[256, 1024][..]),
    ] {
        let mut g = c.benchmark_group(group);
        g.sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(5));
        for &n in sizes {
            let s = rt.block_on(setup(n, fanout));
            let (mut spent, mut copies, mut rounds) = (Duration::ZERO, Duration::ZERO, 0u64);
            g.bench_with_input(BenchmarkId::from_parameter(n), &s, |b, s| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let before = cpu_time();
                            let (took, epoch) = one_round(s).await;
                            let committed = cpu_time();
                            partner_copies_done(s, epoch).await;
                            total += took;
                            spent += committed - before;
                            copies += cpu_time() - committed;
                        }
                        rounds += iters;
                        total
                    })
                })
            });
            let per = |d: Duration| d.as_secs_f64() * 1e3 / rounds.max(1) as f64;
            cpu.push(format!(
                "cpu {group}/{n}: {:.1} ms per round, {:.1} ms more for the partner copies",
                per(spent),
                per(copies)
            ));
        }
        g.finish();
    }
    for line in cpu {
        eprintln!("{line}");
    }
}

fn main() {
    if let Some(n) = std::env::var("CKPT_BENCH_AGENTS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        serve_agents(n);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    coordination(&mut c);
    c.final_summary();
}
