//! Partner copies (SCR's PARTNER redundancy): a node's sealed images streamed over gRPC into
//! another node's staging after commit, and streamed back when a restore finds its own copy
//! missing or damaged. Both directions use [`ckpt_store::stream`]: the sender checks every
//! file's digest as it reads, the receiver as it writes, and the manifest is written last.
use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use ckpt_proto::v1 as pb;
use ckpt_proto::v1::agent_client::AgentClient;
use ckpt_store::copy::CopyProgress;
use ckpt_store::manifest::NodeManifest;
use ckpt_store::stream::{self, Receiver};
use tokio::sync::mpsc;

use crate::error::AgentError;

/// How long connecting to a partner's agent may take.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn partner_err(job: u64, node: &str, message: impl std::fmt::Display) -> AgentError {
    AgentError::Partner {
        job,
        node: node.to_string(),
        message: message.to_string(),
    }
}

/// A client to another node's agent, over TLS with this node's credential; the server must
/// prove it is `node`.
pub async fn connect(
    job: u64,
    node: &str,
    address: &str,
    credential: Option<&ckpt_auth::tls::Credential>,
) -> Result<AgentClient<tonic::transport::Channel>, AgentError> {
    let dial = match credential {
        Some(c) => ckpt_auth::transport::Dial::Tls(
            c.client_config(ckpt_auth::Identity::Node(node.to_string()))
                .map_err(|e| partner_err(job, node, e))?,
        ),
        None => ckpt_auth::transport::Dial::LocalOnly,
    };
    let ch = ckpt_auth::transport::connect(address, dial, CONNECT_TIMEOUT)
        .await
        .map_err(|e| partner_err(job, node, format!("its agent: {e}")))?;
    Ok(AgentClient::new(ch)
        .max_decoding_message_size(stream::CHUNK * 2)
        .max_encoding_message_size(stream::CHUNK * 2))
}

/// Streams the images in `dir` (checked against `committed`) as chunks: the header first, then
/// every file in manifest order, waiting while `pause` is above zero. A damaged file ends the
/// stream with an error.
pub fn chunks(
    dir: PathBuf,
    header: pb::ChunkHeader,
    committed: String,
    pause: Arc<AtomicUsize>,
) -> mpsc::Receiver<Result<pb::ImageChunk, AgentError>> {
    let progress = CopyProgress::pausing_on(pause);
    let (tx, rx) = mpsc::channel(4);
    let job = header.job_id;
    tokio::task::spawn_blocking(move || {
        let store_err = |source| AgentError::Store { job, source };
        let (bytes, m) = match stream::open_source(&dir, &committed) {
            Ok(v) => v,
            Err(e) => {
                let _ = tx.blocking_send(Err(store_err(e)));
                return;
            }
        };
        let first = pb::ImageChunk {
            header: Some(pb::ChunkHeader {
                manifest: bytes,
                manifest_digest: committed,
                ..header
            }),
            file: 0,
            data: Vec::new(),
        };
        if tx.blocking_send(Ok(first)).is_err() {
            return;
        }
        let r = stream::send_files(&dir, &m, |file, data| {
            // Wait while a job on this node is frozen: a dump gets the CPU and the disk.
            progress.wait_unpaused();
            tx.blocking_send(Ok(pb::ImageChunk {
                header: None,
                file,
                data,
            }))
            .is_ok()
        });
        if let Err(e) = r {
            let _ = tx.blocking_send(Err(store_err(e)));
        }
    });
    rx
}

/// Writes a stream of chunks from node `sender`, whose header came first, into `dest`
/// (replaced), verifying as it goes; on any failure nothing usable is left at `dest`.
pub async fn receive<S>(
    job: u64,
    sender: &str,
    dest: PathBuf,
    header: pb::ChunkHeader,
    committed: &str,
    mut rest: S,
) -> Result<NodeManifest, AgentError>
where
    S: tokio_stream::Stream<Item = Result<pb::ImageChunk, tonic::Status>> + Unpin,
{
    use tokio_stream::StreamExt;
    let (tx, mut rx) = mpsc::channel::<Option<(u32, Vec<u8>)>>(4);
    let committed = committed.to_string();
    let d = dest.clone();
    let writer = tokio::task::spawn_blocking(move || {
        let mut r = Receiver::begin(&d, header.manifest, &committed)?;
        while let Some(msg) = rx.blocking_recv() {
            match msg {
                Some((file, data)) => r.write(file, &data)?,
                // The sender failed: what arrived is not a copy.
                None => return Err(None),
            }
        }
        r.finish().map_err(Some)
    });
    let mut sender_error = None;
    while let Some(msg) = rest.next().await {
        match msg {
            Ok(c) => {
                if tx.send(Some((c.file, c.data))).await.is_err() {
                    break; // the writer stopped on an error of its own
                }
            }
            Err(s) => {
                sender_error = Some(s.message().to_string());
                let _ = tx.send(None).await;
                break;
            }
        }
    }
    drop(tx);
    let r = writer.await.expect("receive task");
    let r = match (r, sender_error) {
        (Ok(m), None) => Ok(m),
        (_, Some(e)) => Err(partner_err(job, sender, e)),
        (Err(Some(source)), None) => Err(AgentError::Store { job, source }),
        (Err(None), None) => Err(partner_err(job, sender, "stream aborted")),
    };
    if r.is_err() {
        let _ = tokio::fs::remove_dir_all(&dest).await;
    }
    r
}

/// Receives a `Receive` call's stream: the first message must carry the header.
pub async fn split_header<S>(mut s: S) -> Result<(pb::ChunkHeader, S), tonic::Status>
where
    S: tokio_stream::Stream<Item = Result<pb::ImageChunk, tonic::Status>> + Unpin,
{
    use tokio_stream::StreamExt;
    match s.next().await {
        Some(Ok(pb::ImageChunk {
            header: Some(h), ..
        })) => Ok((h, s)),
        Some(Err(e)) => Err(e),
        _ => Err(tonic::Status::invalid_argument(
            "an image stream must start with its header",
        )),
    }
}
