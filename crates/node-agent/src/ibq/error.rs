//! Why a call on a registered channel failed ([`ChannelError`]), and why a new connection's
//! hello was refused ([`HelloError`]). Their texts are what the coordinator and the agent's log
//! show (a [`ChannelFailure`](super::ChannelFailure) carries the first's).
use std::path::PathBuf;
use std::time::Duration;

use ib_quiesce::control::{DecodeError, ToAgent, PROTOCOL_VERSION};

/// A call on a registered channel that failed: the connection, the answer, or the channel's own
/// refusal.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// The process closed its end of the connection.
    #[error("the process closed its channel (did it exit?)")]
    Closed,
    /// No answer came in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The answer was longer than the cap; the agent closed the connection.
    #[error("its answer is longer than the {cap}-byte cap; the agent closed the connection")]
    TooLong {
        /// The cap, in bytes.
        cap: usize,
    },
    /// The agent had closed this connection before (after an over-long line).
    #[error("the agent closed the connection after an over-long line")]
    ShutByAgent,
    /// The command could not be written.
    #[error("cannot reach the channel: {0}")]
    Send(#[source] std::io::Error),
    /// Reading the answer failed.
    #[error("connection failed: {0}")]
    Io(#[source] std::io::Error),
    /// The answer is no message of the protocol.
    #[error("unreadable answer: {0}")]
    Malformed(#[source] DecodeError),
    /// The channel answered `failed`, with its reason.
    #[error("{0}")]
    Failed(String),
    /// The channel answered something other than what the command asks for.
    #[error("unexpected answer {0:?}")]
    Unexpected(Box<ToAgent>),
    /// `release` to a channel that did not answer `drained`.
    #[error("its channel is not drained; only a drained verbs layer is released")]
    NotDrained,
    /// The channel answered `quiesced` but did not then close its connection.
    #[error("quiesced but did not disconnect: {0}")]
    NotDisconnected(Box<ChannelError>),
    /// The channel answered `quiesced` and then sent another message instead of closing.
    #[error("quiesced but then said {0:?}")]
    SaidAfterQuiesced(Box<ToAgent>),
    /// The pid has no channel (its process exited, or it never registered).
    #[error("its channel is gone (did the process exit?)")]
    Gone,
    /// The pid has no channel to quiesce or release.
    #[error("no channel")]
    Missing,
    /// After its rebuild flag was raised, no hello came back in time.
    #[error("its channel did not come back within {0:?} (is the process alive?)")]
    NotBack(Duration),
    /// The rebuild flag could not be made.
    #[error("cannot raise the rebuild flag {}: {source}", path.display())]
    Flag {
        /// The flag's path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl ChannelError {
    /// Whether the channel failed the command because it cannot read it: a library built before
    /// the command existed (it answers `failed` with "unreadable command: ...").
    pub fn is_unknown_command(&self) -> bool {
        matches!(self, ChannelError::Failed(e) if e.starts_with("unreadable command"))
    }
}

/// Why a new connection was not registered as a channel: its hello, or what it said there.
#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    /// Nothing came within the hello's time.
    #[error("pid {pid} said nothing within {wait:?}")]
    Silent {
        /// The connecting process.
        pid: i32,
        /// How long it had.
        wait: Duration,
    },
    /// The first line was longer than the cap.
    #[error("pid {pid} sent a line longer than the {cap}-byte cap; connection closed")]
    TooLong {
        /// The connecting process.
        pid: i32,
        /// The cap, in bytes.
        cap: usize,
    },
    /// Reading the hello failed.
    #[error("pid {pid}: {source}")]
    Io {
        /// The connecting process.
        pid: i32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The connection ended before a hello.
    #[error("pid {pid} closed without a hello")]
    Closed {
        /// The connecting process.
        pid: i32,
    },
    /// The first line is no message of the protocol.
    #[error("pid {pid}: {source}")]
    Malformed {
        /// The connecting process.
        pid: i32,
        /// What the decoder said.
        #[source]
        source: DecodeError,
    },
    /// The first message is another one than a hello.
    #[error("pid {pid}: first message is not a hello: {excerpt}")]
    NotHello {
        /// The connecting process.
        pid: i32,
        /// The line's start.
        excerpt: String,
    },
    /// A lookup asked for more addresses than one may.
    #[error("pid {pid} looked up {asked} addresses; a lookup holds at most {max}")]
    LookupTooLarge {
        /// The connecting process.
        pid: i32,
        /// How many it asked for.
        asked: usize,
        /// [`ib_quiesce::control::MAX_LOOKUP_ADDRESSES`].
        max: usize,
    },
    /// The hello names another pid than the kernel gave for the connection.
    #[error("pid {pid} claims to be pid {claimed}")]
    Impostor {
        /// The connecting process (the kernel's word).
        pid: i32,
        /// The pid its hello says.
        claimed: i32,
    },
    /// The hello says a protocol version this agent does not speak.
    #[error(
        "pid {pid} speaks version {layer} of the ib-quiesce control protocol, but this agent \
         speaks version {agent}: rebuild or reinstall libckpt_verbs.so (or the program's \
         ib-quiesce library) on this node from the same ckpt release as the agent, and restart \
         the job; until then the process runs without a channel, and a checkpoint of its job is \
         refused while it uses verbs"
    )]
    Version {
        /// The connecting process.
        pid: i32,
        /// The version its hello says.
        layer: u32,
        /// The version this agent speaks ([`PROTOCOL_VERSION`]).
        agent: u32,
    },
    /// The pid already has a live channel of another job.
    #[error("pid {pid} of job {job} has a channel of job {other} already")]
    OtherJob {
        /// The connecting process.
        pid: i32,
        /// The job it was identified in.
        job: u64,
        /// The job of the channel registered for the pid.
        other: u64,
    },
}

impl HelloError {
    /// A refusal of the hello of `pid`, which says protocol version `layer`.
    pub(super) fn version(pid: i32, layer: u32) -> Self {
        HelloError::Version {
            pid,
            layer,
            agent: PROTOCOL_VERSION,
        }
    }
}
