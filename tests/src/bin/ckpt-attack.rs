//! `ckpt-attack`: what a local user or a foreign host would try against the daemons, for the
//! security end-to-end tests. Calls every RPC of the Registry and Agent services at one address
//! and prints one line per call: `RPC <service>.<call> <gRPC code> <message>`.
//!
//! Usage: `ckpt-attack ADDRESS [--ca CA_PEM] [--cred DIR NODE] [--target NODE] [--job ID]
//!         [--grants DIR] [--replaced-ckptd DIR FENCE]`
//! - ADDRESS: `host:port` (TLS when `--ca` is given, else plain HTTP/2) or `unix:/path`.
//! - `--ca`: trust this CA (what any user can read) and present no certificate.
//! - `--cred DIR NODE`: present node NODE's credential from DIR (a compromised node).
//! - `--target NODE`: the identity the server must prove (default: the coordinator).
//! - `--job ID`: the job to aim at (default 1).
//! - `--grants DIR`: the coordinator's credential directory, to make relay grants with. It
//!   stands for the grants a compromised relay node keeps from real epochs: each is shown to
//!   the target outside what it covers (another job, another epoch, expired, another relay,
//!   another node), next to one the node signed itself and a relay plan of its own.
//! - `--replaced-ckptd DIR FENCE`: instead of all that, one call to the target agent
//!   (`Agent.Inspect` of the job) with the coordinator's credential from DIR and fence FENCE:
//!   a ckptd that another replaced, continued (`RPC Agent.InspectFenced <code> <message>`).
//!
//! Every call asks for something harmful: run a command as root (creating
//! `/tmp/ckpt-attack-pwned`), take over a node name, stream a job's images, write `/etc/x` or
//! `../../x` through a partner copy, signal or release a job, and so on.
use std::time::Duration;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_client::AgentClient;
use ckpt_proto::v1::registry_client::RegistryClient;
use tonic::transport::{Channel, Endpoint};

/// The file a successful `Launch` would create.
const PWNED: &str = "/tmp/ckpt-attack-pwned";

fn usage() -> ! {
    eprintln!(
        "usage: ckpt-attack ADDRESS [--ca CA_PEM] [--cred DIR NODE] [--target NODE] [--job ID] [--grants DIR] [--replaced-ckptd DIR FENCE]"
    );
    std::process::exit(2)
}

async fn channel(addr: &str, dial: Option<ckpt_auth::transport::Dial>) -> Result<Channel, String> {
    match dial {
        Some(d) => ckpt_auth::transport::connect(addr, d, Duration::from_secs(5)).await,
        None => Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .map_err(|e| format!("cannot connect: {e}")),
    }
}

/// Reports an epoch stream by its first answer: a refusal ends the stream there.
async fn report_epoch(
    name: &str,
    r: Result<tonic::Response<tonic::Streaming<pb::EpochEvent>>, tonic::Status>,
) {
    let first = match r {
        Ok(resp) => resp.into_inner().message().await,
        Err(s) => Err(s),
    };
    match first {
        Ok(Some(ev)) => match ev.failure {
            Some(f) => println!(
                "RPC {name} {:?} {}",
                tonic::Code::from_i32(f.code),
                f.message.replace('\n', " ")
            ),
            None => println!("RPC {name} Ok -"),
        },
        Ok(None) => println!("RPC {name} Ok (stream ended)"),
        Err(s) => println!(
            "RPC {name} {:?} {}",
            s.code(),
            s.message().replace('\n', " ")
        ),
    }
}

/// A relay grant over `target` for `relay`, signed with `by`.
fn grant(by: &ckpt_auth::tls::Credential, g: pb::Delegation) -> Option<pb::DelegatedAuthority> {
    use prost::Message;
    let grant = g.encode_to_vec();
    let (signature, issuer) = by.sign(&grant).expect("sign");
    Some(pb::DelegatedAuthority {
        grant,
        signature,
        issuer,
    })
}

fn report<T>(name: &str, r: Result<tonic::Response<T>, tonic::Status>) {
    match r {
        Ok(_) => println!("RPC {name} Ok -"),
        Err(s) => println!(
            "RPC {name} {:?} {}",
            s.code(),
            s.message().replace('\n', " ")
        ),
    }
}

/// Sends `client.call(pb::Request { fields })`, every field not named left at its default, and
/// prints the line of `name` (see [`report`]).
macro_rules! attack {
    ($name:literal, $client:ident.$call:ident($req:ident { $($field:ident: $value:expr),* $(,)? })) => {{
        // Some requests name every field; the rest is then empty.
        #[allow(clippy::needless_update)]
        let request = pb::$req {
            $($field: $value,)*
            ..Default::default()
        };
        report($name, $client.$call(request).await)
    }};
}

/// A partner copy whose manifest names `path`, sent as `node`.
fn evil_stream(job: u64, node: &str, path: &str) -> Vec<pb::ImageChunk> {
    let data = b"owned\n".to_vec();
    let m = ckpt_store::manifest::NodeManifest::new(
        job,
        1,
        node,
        vec![ckpt_store::digest::FileEntry {
            path: path.into(),
            size: data.len() as u64,
            blake3: blake3::hash(&data).to_hex().to_string(),
        }],
    );
    let manifest = ckpt_store::manifest::encode(&m);
    let digest = blake3::hash(&manifest).to_hex().to_string();
    vec![
        pb::ImageChunk {
            header: Some(pb::ChunkHeader {
                job_id: job,
                epoch: 1,
                node: node.into(),
                manifest,
                manifest_digest: digest,
            }),
            ..Default::default()
        },
        pb::ImageChunk {
            header: None,
            file: 0,
            data,
        },
    ]
}

/// One call to an agent as a ckptd that another replaced: the coordinator's own credential,
/// an old fence.
async fn as_replaced_ckptd(
    addr: &str,
    server: ckpt_auth::Identity,
    dir: &str,
    fence: u64,
    job: u64,
) {
    let coord = ckpt_auth::tls::Credential::load(
        std::path::Path::new(dir),
        &ckpt_auth::Identity::Coordinator,
    )
    .expect("the coordinator's credential");
    let dial = ckpt_auth::transport::Dial::Tls(coord.client_config(server).expect("client config"));
    let ch = match channel(addr, Some(dial)).await {
        Ok(c) => c,
        Err(e) => {
            println!("CONNECT refused {}", e.replace('\n', " "));
            return;
        }
    };
    let mut ag = ckpt_proto::fenced_agent(ch, Some(fence));
    attack!(
        "Agent.InspectFenced",
        ag.inspect(InspectRequest { job_id: job })
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(addr) = args.first().cloned() else {
        usage()
    };
    let (mut ca, mut cred, mut target, mut job) = (None, None, None, 1u64);
    let mut grants = None;
    let mut replaced: Option<(String, u64)> = None;
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--ca" => {
                ca = args.get(i + 1).cloned();
                i += 2;
            }
            "--cred" => {
                cred = Some((
                    args.get(i + 1).cloned().unwrap_or_else(|| usage()),
                    args.get(i + 2).cloned().unwrap_or_else(|| usage()),
                ));
                i += 3;
            }
            "--target" => {
                target = args.get(i + 1).cloned();
                i += 2;
            }
            "--grants" => {
                grants = args.get(i + 1).cloned();
                i += 2;
            }
            "--replaced-ckptd" => {
                replaced = Some((
                    args.get(i + 1).cloned().unwrap_or_else(|| usage()),
                    args.get(i + 2)
                        .and_then(|f| f.parse().ok())
                        .unwrap_or_else(|| usage()),
                ));
                i += 3;
            }
            "--job" => {
                job = args
                    .get(i + 1)
                    .and_then(|j| j.parse().ok())
                    .unwrap_or_else(|| usage());
                i += 2;
            }
            _ => usage(),
        }
    }
    let server = match &target {
        Some(n) => ckpt_auth::Identity::Node(n.clone()),
        None => ckpt_auth::Identity::Coordinator,
    };
    if let Some((dir, fence)) = replaced {
        return as_replaced_ckptd(&addr, server, &dir, fence, job).await;
    }
    let me = cred.as_ref().map(|(_, n)| n.clone());
    let dial = if addr.starts_with("unix:") {
        Some(ckpt_auth::transport::Dial::LocalOnly)
    } else if let Some((dir, node)) = &cred {
        let c = ckpt_auth::tls::Credential::load(
            std::path::Path::new(dir),
            &ckpt_auth::Identity::Node(node.clone()),
        )
        .expect("credential");
        Some(ckpt_auth::transport::Dial::Tls(
            c.client_config(server).expect("client config"),
        ))
    } else if let Some(ca) = &ca {
        let roots = ckpt_auth::tls::load_roots(std::path::Path::new(ca)).expect("CA");
        Some(ckpt_auth::transport::Dial::Tls(
            ckpt_auth::tls::anonymous_client_config(&roots, server).expect("client config"),
        ))
    } else {
        None
    };
    let ch = match channel(&addr, dial).await {
        Ok(c) => c,
        Err(e) => {
            println!("CONNECT refused {}", e.replace('\n', " "));
            return;
        }
    };
    let mut reg = RegistryClient::new(ch.clone());
    let mut ag = AgentClient::new(ch);
    // Pose as another node (or as any name), and report that every job ended.
    let victim = "n3".to_string();
    attack!(
        "Registry.Register",
        reg.register(RegisterRequest {
            node: victim.clone(),
            address: "127.0.0.1:1".into(),
        })
    );
    attack!(
        "Registry.RegisterLocal",
        reg.register(RegisterRequest {
            node: me.clone().unwrap_or_else(|| "evil".into()),
            address: "unix:/run/ckpt/ckptd.sock".into(),
        })
    );
    attack!(
        "Registry.Heartbeat",
        reg.heartbeat(HeartbeatRequest {
            node: victim.clone(),
            jobs: vec![pb::JobReport {
                job_id: job,
                state: pb::PartState::Exited.into(),
                end: Some(pb::JobEnd::exited(0)),
                ..Default::default()
            }],
        })
    );
    attack!(
        "Registry.Attach",
        reg.attach(AttachRequest {
            job_id: job,
            token: String::new(),
            host: victim.clone(),
            command: format!("touch {PWNED}"),
            cwd: "/".into(),
        })
    );
    attack!(
        "Registry.Locate",
        reg.locate(LocateRequest {
            job_id: job,
            token: "guess".into(),
            node: victim.clone(),
        })
    );
    // The epoch stream, its first command a dump (or a kill, with resume, or the deletion of
    // the job's images with initial-sync).
    let epoch_cmd = |phase: pb::Phase| pb::EpochCommand {
        job_id: job,
        epoch: 1,
        phase: phase as i32,
        kill: true,
        deadline_ms: 1000,
        prune: vec![1, 2, 3],
        ..Default::default()
    };
    attack!(
        "Agent.Launch",
        ag.launch(LaunchRequest {
            job_id: 999_999,
            argv: vec!["/bin/sh".into(), "-c".into(), format!("touch {PWNED}")],
            cwd: "/".into(),
            uid: 0,
            gid: 0,
            token: "t".into(),
        })
    );
    report_epoch(
        "Agent.EpochDump",
        ag.epoch(tokio_stream::iter(vec![epoch_cmd(
            pb::Phase::LocalCheckpoint,
        )]))
        .await,
    )
    .await;
    report_epoch(
        "Agent.EpochKill",
        ag.epoch(tokio_stream::iter(vec![epoch_cmd(pb::Phase::Resume)]))
            .await,
    )
    .await;
    report_epoch(
        "Agent.EpochPrune",
        ag.epoch(tokio_stream::iter(vec![epoch_cmd(pb::Phase::InitialSync)]))
            .await,
    )
    .await;
    // A relay's grants shown outside what they cover (see `--grants`).
    if let (Some(dir), Some(me), Some(victim)) = (&grants, &me, &target) {
        let coord = ckpt_auth::tls::Credential::load(
            std::path::Path::new(dir),
            &ckpt_auth::Identity::Coordinator,
        )
        .expect("the coordinator's credential");
        let mine = ckpt_auth::tls::Credential::load(
            std::path::Path::new(&cred.as_ref().expect("--cred").0),
            &ckpt_auth::Identity::Node(me.clone()),
        )
        .expect("credential");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let covering = pb::Delegation {
            job_id: job,
            epoch: 1,
            relay: me.clone(),
            nodes: vec![victim.clone()],
            phases: vec![
                pb::Phase::InitialSync as i32,
                pb::Phase::Quiesce as i32,
                pb::Phase::LocalCheckpoint as i32,
                pb::Phase::Resume as i32,
                pb::Phase::Finalize as i32,
            ],
            not_after_ms: now + 60_000,
            fence: 0,
        };
        let cases = [
            (
                "Agent.EpochGrantOtherJob",
                grant(
                    &coord,
                    pb::Delegation {
                        job_id: job + 1,
                        ..covering.clone()
                    },
                ),
                1,
            ),
            (
                "Agent.EpochGrantOtherEpoch",
                grant(&coord, covering.clone()),
                2,
            ),
            (
                "Agent.EpochGrantExpired",
                grant(
                    &coord,
                    pb::Delegation {
                        not_after_ms: now - 1000,
                        ..covering.clone()
                    },
                ),
                1,
            ),
            (
                "Agent.EpochGrantOtherRelay",
                grant(
                    &coord,
                    pb::Delegation {
                        relay: "n9".into(),
                        ..covering.clone()
                    },
                ),
                1,
            ),
            (
                "Agent.EpochGrantOtherNode",
                grant(
                    &coord,
                    pb::Delegation {
                        nodes: vec!["n9".into()],
                        ..covering.clone()
                    },
                ),
                1,
            ),
            ("Agent.EpochGrantForged", grant(&mine, covering.clone()), 1),
        ];
        for (name, authority, epoch) in cases {
            let cmd = pb::EpochCommand {
                epoch,
                authority,
                ..epoch_cmd(pb::Phase::InitialSync)
            };
            report_epoch(name, ag.epoch(tokio_stream::iter(vec![cmd])).await).await;
        }
        // A relay plan from a node: it would make the target dial and drive others.
        let cmd = pb::EpochCommand {
            authority: grant(&coord, covering.clone()),
            relay: Some(pb::RelayPlan {
                authority: grant(&coord, covering.clone()),
                children: vec![pb::RelayChild {
                    node: "n9".into(),
                    address: "127.0.0.1:1".into(),
                }],
            }),
            ..epoch_cmd(pb::Phase::InitialSync)
        };
        report_epoch(
            "Agent.EpochRelayPlan",
            ag.epoch(tokio_stream::iter(vec![cmd])).await,
        )
        .await;
    }
    attack!(
        "Agent.Abort",
        ag.abort(AbortRequest {
            job_id: job,
            epoch: 1,
            reason: "attack".into()
        })
    );
    attack!(
        "Agent.Restore",
        ag.restore(RestoreRequest {
            job_id: job,
            epoch: 1,
            partner: "n9".into(),
            partner_address: "127.0.0.1:1".into(),
        })
    );
    attack!(
        "Agent.Signal",
        ag.signal(SignalRequest {
            job_id: job,
            signal: 9,
            token: String::new()
        })
    );
    attack!("Agent.Inspect", ag.inspect(InspectRequest { job_id: job }));
    attack!(
        "Agent.Release",
        ag.release(ReleaseRequest {
            job_id: job,
            kill: true
        })
    );
    attack!(
        "Agent.Poll",
        ag.poll(PollRequest {
            job_id: job,
            token: "guess".into()
        })
    );
    attack!(
        "Agent.Verify",
        ag.verify(VerifyNodeRequest {
            job_id: job,
            epoch: 1
        })
    );
    attack!(
        "Agent.Prune",
        ag.prune(PruneRequest {
            job_id: job,
            epochs: vec![1]
        })
    );
    attack!(
        "Agent.Flush",
        ag.flush(FlushRequest {
            job_id: job,
            epoch: 1,
            manifest_digest: String::new()
        })
    );
    attack!(
        "Agent.Publish",
        ag.publish(PublishRequest {
            job_id: job,
            epoch: 1
        })
    );
    attack!(
        "Agent.Replicate",
        ag.replicate(ReplicateRequest {
            job_id: job,
            epoch: 1,
            partner: "n9".into(),
            partner_address: "127.0.0.1:1".into(),
        })
    );
    attack!(
        "Agent.Rebuild",
        ag.rebuild(RebuildRequest {
            job_id: job,
            epoch: 1
        })
    );
    attack!(
        "Agent.Reconnect",
        ag.reconnect(ReconnectRequest { job_id: job })
    );
    // Grant itself the fetch of another node's images.
    attack!(
        "Agent.AllowFetch",
        ag.allow_fetch(AllowFetchRequest {
            job_id: job,
            epoch: 1,
            node: victim.clone(),
            grantee: me.clone().unwrap_or_else(|| "n9".into()),
            manifest_digest: "0".repeat(64),
            ttl_ms: 60_000,
        })
    );
    // Grant itself the parity another node holds; encode as if the coordinator asked; read
    // another node's images and parity by range (erasure coding).
    attack!(
        "Agent.AllowFetchParity",
        ag.allow_fetch(AllowFetchRequest {
            job_id: job,
            epoch: 1,
            node: victim.clone(),
            grantee: me.clone().unwrap_or_else(|| "n9".into()),
            ttl_ms: 60_000,
            parity: true,
        })
    );
    attack!(
        "Agent.Encode",
        ag.encode(EncodeRequest {
            job_id: job,
            epoch: 1,
            scheme: "xor:2".into(),
        })
    );
    for (name, parity) in [
        ("Agent.ReadSegment", false),
        ("Agent.ReadSegmentParity", true),
    ] {
        let r = ag
            .read_segment(pb::SegmentRequest {
                job_id: job,
                epoch: 1,
                node: victim.clone(),
                manifest_digest: "0".repeat(64),
                parity,
                length: 4096,
                ..Default::default()
            })
            .await;
        match r {
            Ok(r) => match r.into_inner().message().await {
                Ok(_) => println!("RPC {name} Ok -"),
                Err(e) => println!("RPC {name} {:?} {}", e.code(), e.message()),
            },
            Err(e) => report::<()>(name, Err(e)),
        }
    }
    // Stream someone's images out, with no digest to check against.
    let send = ag
        .send(pb::SendRequest {
            job_id: job,
            epoch: 1,
            node: victim.clone(),
            manifest_digest: String::new(),
        })
        .await;
    match send {
        Ok(r) => {
            // The refusal may come as the stream's first message.
            let mut s = r.into_inner();
            match s.message().await {
                Ok(Some(_)) => println!("RPC Agent.Send Ok -"),
                Ok(None) => println!("RPC Agent.Send Ok empty"),
                Err(e) => println!("RPC Agent.Send {:?} {}", e.code(), e.message()),
            }
        }
        Err(e) => report::<()>("Agent.Send", Err(e)),
    }
    // Partner copies that would write outside the staging directory, as this node (when it
    // has a credential) and as another node.
    let sender = me.clone().unwrap_or_else(|| victim.clone());
    for (name, node, path) in [
        ("Agent.ReceiveAbsolute", sender.as_str(), "/etc/x"),
        ("Agent.ReceiveDotDot", sender.as_str(), "../../x"),
        ("Agent.ReceiveForOther", victim.as_str(), "pages-1.img"),
    ] {
        let stream = tokio_stream::iter(evil_stream(job, node, path));
        report(name, ag.receive(stream).await);
    }
}
