//! A checkpoint round's phases through a relay tree, simulated to 16,384 nodes.
//!
//! The coordinator's real phase code runs (`coordinator::link::barrier`, `send_all`, and
//! `coordinator::relay::Relay` with its deadlines and merges, in the tree shape of
//! `coordinator::relay::tree`) over simulated nodes, in
//! virtual time (a paused tokio clock): every node has one CPU, and every message costs the
//! process that sends or receives it `--per-message-us` of that CPU (encode or decode, TLS,
//! the syscall), plus `--hop-us` of network latency between two nodes. A relay handles its
//! links' messages one after another on its own CPU; different nodes work in parallel, as on a
//! cluster. The four barriers of a round (initial-sync, quiesce, local-checkpoint, resume with
//! finalize behind it) are timed; begin and commit (registry writes on the coordinator) are not.
//! The paused clock counts whole milliseconds, so the simulation runs 1,000 times slow: one
//! microsecond of the cluster is one millisecond of the clock (costs are whole microseconds).
//!
//! The per-message cost comes from the real flat round measured on this machine
//! (`benches/coordination_ab.sh` derives it from the coordination bench in the same run);
//! the default is that derivation's result on the 2-core test machine.
//!
//! Usage: `cargo bench -p ckpt-benches --bench relay_tree -- [--per-message-us C] [--hop-us H]`
use std::sync::Arc;
use std::time::Duration;

use ckpt_proto::v1 as pb;
use coordinator::agents::NodeFailure;
use coordinator::link::{barrier, send_all, EpochLink};
use coordinator::relay::{levels, Relay};
use tokio::sync::Mutex;
use tokio::time::{sleep, Instant};

/// One node's CPU: whoever holds it for `d` keeps the node busy that long.
#[derive(Clone, Debug, Default)]
struct Cpu(Arc<Mutex<()>>);

impl Cpu {
    async fn spend(&self, d: Duration) {
        let _busy = self.0.lock().await;
        sleep(d).await;
    }
}

#[derive(Clone, Copy, Debug)]
struct Costs {
    message: Duration,
    hop: Duration,
}

/// A simulated node answering every phase: receives the command, sends the answer.
#[derive(Debug)]
struct Node {
    name: String,
    cpu: Cpu,
    costs: Costs,
    queue: std::collections::VecDeque<pb::EpochCommand>,
}

#[tonic::async_trait]
impl EpochLink for Node {
    fn node(&self) -> &str {
        &self.name
    }
    fn send(&mut self, cmd: pb::EpochCommand) -> Result<(), NodeFailure> {
        self.queue.push_back(cmd);
        Ok(())
    }
    async fn next(&mut self) -> Result<pb::EpochEvent, NodeFailure> {
        let cmd = self.queue.pop_front().expect("a command was sent");
        sleep(self.costs.hop).await;
        // Decode the command, encode the answer.
        self.cpu.spend(self.costs.message * 2).await;
        sleep(self.costs.hop).await;
        Ok(pb::EpochEvent {
            phase: cmd.phase,
            nodes: 1,
            processes: 1,
            manifests: if cmd.phase() == pb::Phase::Finalize {
                [(self.name.clone(), "d".into())].into()
            } else {
                Default::default()
            },
            ..Default::default()
        })
    }
}

/// The end of a link in the process that holds it (the coordinator, or a relay on a node):
/// sending the command and reading the answer cost that process's CPU.
#[derive(Debug)]
struct Held {
    inner: Box<dyn EpochLink>,
    cpu: Cpu,
    costs: Costs,
    unsent: u32,
}

#[tonic::async_trait]
impl EpochLink for Held {
    fn node(&self) -> &str {
        self.inner.node()
    }
    fn send(&mut self, cmd: pb::EpochCommand) -> Result<(), NodeFailure> {
        self.unsent += 1;
        self.inner.send(cmd)
    }
    async fn next(&mut self) -> Result<pb::EpochEvent, NodeFailure> {
        // The encode of the command is paid before it leaves.
        if self.unsent > 0 {
            self.unsent -= 1;
            self.cpu.spend(self.costs.message).await;
        }
        let ev = self.inner.next().await;
        self.cpu.spend(self.costs.message).await;
        ev
    }
}

/// Wraps every link of a level in the CPU of the process holding it. Relays hold their
/// links on the CPU of the node they run on (their first node's).
fn hold(links: Vec<Box<dyn EpochLink>>, cpu: &Cpu, costs: Costs) -> Vec<Box<dyn EpochLink>> {
    links
        .into_iter()
        .map(|l| {
            Box::new(Held {
                inner: l,
                cpu: cpu.clone(),
                costs,
                unsent: 0,
            }) as Box<dyn EpochLink>
        })
        .collect()
}

/// One round over `n` simulated nodes with at most `fanout` links per process; returns the
/// virtual time of the four barriers.
async fn round(n: usize, fanout: usize, costs: Costs) -> Duration {
    let cpus: Vec<Cpu> = (0..n).map(|_| Cpu::default()).collect();
    let leaves: Vec<Box<dyn EpochLink>> = (0..n)
        .map(|i| {
            Box::new(Node {
                name: format!("n{i}"),
                cpu: cpus[i].clone(),
                costs,
                queue: Default::default(),
            }) as Box<dyn EpochLink>
        })
        .collect();
    // The tree as `coordinator::relay::tree` builds it, with every relay's links held on the
    // CPU of the node it runs on (its subtree's first).
    let mut level: Vec<(usize, Box<dyn EpochLink>)> = leaves.into_iter().enumerate().collect();
    while level.len() > fanout {
        let mut up = Vec::new();
        let mut it = level.into_iter().peekable();
        while it.peek().is_some() {
            let group: Vec<(usize, Box<dyn EpochLink>)> = it.by_ref().take(fanout).collect();
            let node = group[0].0;
            let held = hold(
                group.into_iter().map(|(_, l)| l).collect(),
                &cpus[node],
                costs,
            );
            up.push((
                node,
                Box::new(Relay::new(&format!("n{node}"), held)) as Box<dyn EpochLink>,
            ));
        }
        level = up;
    }
    let mut links: Vec<Box<dyn EpochLink>> = level.into_iter().map(|(_, l)| l).collect();
    let coordinator = Cpu::default();
    links = hold(links, &coordinator, costs);
    // A minute of the cluster (scaled); nothing comes near it.
    let deadline = Duration::from_secs(60_000);
    let t = Instant::now();
    for phase in [
        pb::Phase::InitialSync,
        pb::Phase::Quiesce,
        pb::Phase::LocalCheckpoint,
    ] {
        send_all(&mut links, command(phase, deadline)).expect("send");
        let ev = barrier(&mut links, phase, deadline).await.expect("phase");
        assert_eq!(ev.nodes as usize, n);
    }
    send_all(&mut links, command(pb::Phase::Resume, deadline)).expect("send");
    send_all(&mut links, command(pb::Phase::Finalize, deadline)).expect("send");
    barrier(&mut links, pb::Phase::Resume, deadline)
        .await
        .expect("resume");
    let sealed = barrier(&mut links, pb::Phase::Finalize, deadline)
        .await
        .expect("finalize");
    assert_eq!(sealed.manifests.len(), n);
    t.elapsed()
}

fn command(phase: pb::Phase, deadline: Duration) -> pb::EpochCommand {
    pb::EpochCommand {
        job_id: 1,
        epoch: 1,
        phase: phase as i32,
        kill: false,
        deadline_ms: deadline.as_millis() as u32,
        ..Default::default()
    }
}

fn arg(name: &str, default: f64) -> f64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() {
    // Scaled: a microsecond of the cluster is a millisecond of the clock.
    let costs = Costs {
        message: Duration::from_millis(arg("--per-message-us", 11.0).round() as u64),
        hop: Duration::from_millis(arg("--hop-us", 20.0).round() as u64),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    println!(
        "relay tree, simulated: {} us per message end, {} us per hop",
        costs.message.as_millis(),
        costs.hop.as_millis()
    );
    println!("| nodes | fan-out | relay levels | phases of one round (virtual) |");
    println!("|---|---|---|---|");
    for (n, fanouts) in [
        (1024usize, vec![1024usize, 32]),
        (16_384, vec![16_384, 128, 32]),
    ] {
        for f in fanouts {
            let t = rt.block_on(round(n, f, costs));
            let l = if f >= n { 0 } else { levels(n, f) };
            let flat = if f >= n { " (flat)" } else { "" };
            println!(
                "| {n} | {f}{flat} | {l} | {:.1} ms |",
                t.as_secs_f64() // scaled back: clock seconds are cluster milliseconds
            );
        }
    }
}
