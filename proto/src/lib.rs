//! Generated types and gRPC stubs of the ckpt wire protocol (`proto/ckpt.proto`, package `ckpt.v1`),
//! the words users see for the protocol's enums, and the snapshot [`Engine`]s: the same on every
//! side (agent, ckptd, ckptctl).

mod engine;
mod fence;
pub use engine::{Engine, UnknownEngine};
pub use fence::{
    fence_of, fenced_agent, Fence, FenceGuard, FencedAgentClient, FencedChannel, FENCE_KEY,
};

/// Version 1 of the protocol.
#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod v1 {
    tonic::include_proto!("ckpt.v1");
}

use v1::{job_end::How, CopyLocation, JobEnd, PartState, ProcessState};

/// The wall clock as the protocol carries it (every `*_unix_ms` field): milliseconds since
/// the Unix epoch, 0 if the clock is before it.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The metadata key on a ckptd status that names what kind of refusal it is, for a client that
/// acts on the kind (the message is for people, and may change).
pub const REFUSAL_KEY: &str = "ckpt-refusal";
/// A `RunRequest.deadline_unix_ms` (or a policy's deadline) too close for a final checkpoint:
/// an `InvalidArgument` status carrying this under [`REFUSAL_KEY`].
pub const REFUSAL_DEADLINE_TOO_CLOSE: &str = "deadline-too-close";

/// Signals whose death of a process is a failure of its job, not a stop someone asked for (as
/// TERM and INT are): what `JobReport.killed` reports, and what a launcher's exit status 128+N
/// means.
pub const FAILURE_SIGNALS: [i32; 6] = [
    libc::SIGKILL,
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGABRT,
    libc::SIGILL,
    libc::SIGFPE,
];

impl v1::Phase {
    /// The phase's name, the one table of them: the agent's and ckptd's log lines (`phase`),
    /// their errors, failpoints, ckptd's own phases (`coordinator::model::Phase`) and what
    /// users read.
    pub fn name(self) -> &'static str {
        use v1::Phase;
        match self {
            Phase::InitialSync => "initial-sync",
            Phase::Quiesce => "quiesce",
            Phase::LocalCheckpoint => "local-checkpoint",
            Phase::Resume => "resume",
            Phase::Finalize => "finalize",
            Phase::Unspecified => "unspecified phase",
        }
    }
}

impl PartState {
    /// Name shown to users: "running", "exited", "frozen", "absent", or "unknown" (unspecified).
    pub fn name(self) -> &'static str {
        match self {
            PartState::Unspecified => "unknown",
            PartState::Running => "running",
            PartState::Exited => "exited",
            PartState::Frozen => "frozen",
            PartState::Absent => "absent",
        }
    }
}

impl ProcessState {
    /// Name shown to users ("running", "sleeping", "disk-wait", ...).
    pub fn name(self) -> &'static str {
        match self {
            ProcessState::Unspecified => "unknown",
            ProcessState::Running => "running",
            ProcessState::Sleeping => "sleeping",
            ProcessState::DiskSleep => "disk-wait",
            ProcessState::Stopped => "stopped",
            ProcessState::Traced => "traced",
            ProcessState::Zombie => "zombie",
            ProcessState::Dead => "dead",
            ProcessState::Idle => "idle",
            ProcessState::Other => "other",
        }
    }
}

impl CopyLocation {
    /// Name shown to users: "local", "partner", "shared", "parity", or "unknown" (unspecified).
    pub fn name(self) -> &'static str {
        match self {
            CopyLocation::Unspecified => "unknown",
            CopyLocation::Local => "local",
            CopyLocation::Partner => "partner",
            CopyLocation::Shared => "shared",
            CopyLocation::Parity => "parity",
        }
    }
}

impl JobEnd {
    /// An exit with `code`.
    pub fn exited(code: i32) -> Self {
        JobEnd {
            how: Some(How::ExitCode(code)),
        }
    }

    /// A death by `signal`.
    pub fn killed(signal: i32) -> Self {
        JobEnd {
            how: Some(How::Signal(signal)),
        }
    }

    /// The exit code, if the process exited.
    pub fn code(&self) -> Option<i32> {
        match self.how {
            Some(How::ExitCode(c)) => Some(c),
            _ => None,
        }
    }

    /// The signal, if one killed the process.
    pub fn signal(&self) -> Option<i32> {
        match self.how {
            Some(How::Signal(s)) => Some(s),
            _ => None,
        }
    }

    /// Words for the end: "exited with code N", "killed by signal N" (or "ended": not known).
    pub fn text(&self) -> String {
        match self.how {
            Some(How::ExitCode(c)) => format!("exited with code {c}"),
            Some(How::Signal(s)) => format!("killed by signal {s}"),
            None => "ended".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::v1::*;

    #[test]
    fn job_end_says_how_and_reads_back() {
        let e = JobEnd::exited(3);
        assert_eq!(
            (e.code(), e.signal(), e.text().as_str()),
            (Some(3), None, "exited with code 3")
        );
        let k = JobEnd::killed(9);
        assert_eq!(
            (k.code(), k.signal(), k.text().as_str()),
            (None, Some(9), "killed by signal 9")
        );
        let unknown = JobEnd::default();
        assert_eq!(
            (unknown.code(), unknown.signal(), unknown.text().as_str()),
            (None, None, "ended")
        );
    }

    #[test]
    fn enum_names_are_words_and_unknown_numbers_read_as_unspecified() {
        assert_eq!(PartState::Exited.name(), "exited");
        assert_eq!(CopyLocation::Partner.name(), "partner");
        assert_eq!(ProcessState::DiskSleep.name(), "disk-wait");
        // A number from a newer peer decodes as the default.
        let r = JobReport {
            state: 99,
            ..Default::default()
        };
        assert_eq!(r.state(), PartState::Unspecified);
    }
}
