//! How a call to a node failed: the [`NodeFailure`] that names the node, its [`FailureKind`],
//! and the kind a node's error status means. Both ends of the driver's talk with the nodes
//! report failures so: the coordinator's unary calls and [`crate::link`] (epoch streams).

/// How an agent call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The agent could not be reached.
    Unreachable,
    /// It did not answer within the deadline.
    Deadline,
    /// It refused: wrong state, unknown job, verbs without channel.
    Refused,
    /// It refused the job's owner: root or a system account, a user Slurm did not give the
    /// node (`[slurm] enforce`), a file that is not theirs.
    Denied,
    /// The job is unknown there.
    NotFound,
    /// Images are corrupt or missing.
    DataLoss,
    /// Staging is full.
    NoRoom,
    /// Anything else (engine failure, I/O).
    Internal,
}

/// A failed call to one agent.
#[derive(Debug, Clone, thiserror::Error)]
#[error("node {node}: {message}")]
pub struct NodeFailure {
    /// Node name.
    pub node: String,
    /// Category.
    pub kind: FailureKind,
    /// What the agent said, or what happened.
    pub message: String,
}

/// What to do about an agent that cannot be reached, after the error.
pub const UNREACHABLE_FIX: &str =
    "is ckpt-agent running there? `ckptctl nodes` shows when it was last heard from";

impl FailureKind {
    /// The kind of failure a status code means.
    pub fn of(code: tonic::Code) -> FailureKind {
        use tonic::Code;
        match code {
            Code::Unavailable | Code::Unknown | Code::Cancelled => FailureKind::Unreachable,
            Code::DeadlineExceeded => FailureKind::Deadline,
            Code::FailedPrecondition | Code::InvalidArgument => FailureKind::Refused,
            Code::PermissionDenied => FailureKind::Denied,
            Code::NotFound => FailureKind::NotFound,
            Code::DataLoss => FailureKind::DataLoss,
            Code::ResourceExhausted => FailureKind::NoRoom,
            _ => FailureKind::Internal,
        }
    }

    /// The status code that carries this kind, the one table from kind to code: a relay
    /// passing a failure up, and ckptd answering its clients about a node's failure (a
    /// restart's; an epoch's failure is the epoch aborted, see `coordinator::grpc::to_status`).
    /// [`FailureKind::of`] gives the kind back. `Internal` (an engine failed, an I/O error) is
    /// `Aborted`: the step was tried and failed, which `ckptctl` exits 6 for.
    pub fn code(self) -> tonic::Code {
        use tonic::Code;
        match self {
            FailureKind::Unreachable => Code::Unavailable,
            FailureKind::Deadline => Code::DeadlineExceeded,
            FailureKind::Refused => Code::FailedPrecondition,
            FailureKind::Denied => Code::PermissionDenied,
            FailureKind::NotFound => Code::NotFound,
            FailureKind::DataLoss => Code::DataLoss,
            FailureKind::NoRoom => Code::ResourceExhausted,
            FailureKind::Internal => Code::Aborted,
        }
    }
}

/// The failure a node's error status means; `what` names the step.
pub fn from_status(node: &str, what: &str, s: &tonic::Status) -> NodeFailure {
    let kind = FailureKind::of(s.code());
    let message = if kind == FailureKind::Unreachable {
        format!(
            "agent unreachable during {what} ({}); {UNREACHABLE_FIX}",
            s.message()
        )
    } else {
        s.message().to_string()
    };
    NodeFailure {
        node: node.into(),
        kind,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_survives_its_status_code() {
        use FailureKind::*;
        for k in [
            Unreachable,
            Deadline,
            Refused,
            Denied,
            NotFound,
            DataLoss,
            NoRoom,
            Internal,
        ] {
            assert_eq!(FailureKind::of(k.code()), k);
        }
    }
}
