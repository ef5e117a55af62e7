//! Cluster credentials of the ckpt daemons.
//!
//! ckptd and every ckpt-agent authenticate each other with mutual TLS under a cluster CA that
//! the site creates once on the head node (`ckptd ca init`). Every certificate the CA issues
//! names exactly one [`Identity`] in its subject common name: the coordinator, or one node by
//! name. A node's name is therefore bound to its credential: the agent holding n2's key is n2
//! and nothing else.
//!
//! - [`ca`] creates the CA, issues node credentials as one bundle, and installs a bundle on a
//!   node (`ckpt-agent enroll`).
//! - [`tls`] loads a daemon's credential and builds the rustls configurations: servers verify
//!   a client certificate when one is presented (callers without one, such as `ckpt-rsh` in a
//!   job, reach only the calls a job token authorizes); clients verify that the server holds
//!   the identity they meant to reach, not merely some certificate of the cluster.
//! - [`cert`] reads certificates (PEM to DER, the subject common name, the identity it names)
//!   for both.
//! - [`transport`] puts this under tonic: an incoming stream of authenticated connections whose
//!   [`PeerInfo`] every handler can read, and channels that dial `host:port` over TLS or
//!   `unix:/path` (the standalone daemon's private sockets).
//!
//! Callers over Unix sockets are identified by the kernel (`SO_PEERCRED`), taken when they
//! connect: only uid 0 counts as a daemon there, and such sockets live in root-only directories.
#![warn(missing_docs)]

pub mod ca;
pub mod cert;
pub mod sign;
pub mod tls;
pub mod transport;

use std::fmt;
use std::path::PathBuf;

/// Who a certificate of the cluster CA names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// ckptd, the coordinator.
    Coordinator,
    /// The agent of the named node.
    Node(String),
}

/// Common name of the coordinator's certificate.
const COORDINATOR_CN: &str = "ckptd";
/// Prefix of a node certificate's common name (`node:<name>`); `:` is never part of a node
/// name, so the two kinds cannot be confused.
const NODE_CN_PREFIX: &str = "node:";

impl Identity {
    /// The subject common name that carries this identity.
    pub fn common_name(&self) -> String {
        match self {
            Identity::Coordinator => COORDINATOR_CN.into(),
            Identity::Node(n) => format!("{NODE_CN_PREFIX}{n}"),
        }
    }

    /// The identity a common name carries, if it is one of ours.
    pub fn from_common_name(cn: &str) -> Option<Identity> {
        if cn == COORDINATOR_CN {
            return Some(Identity::Coordinator);
        }
        let name = cn.strip_prefix(NODE_CN_PREFIX)?;
        valid_node_name(name).then(|| Identity::Node(name.to_string()))
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Coordinator => f.write_str("the coordinator (ckptd)"),
            Identity::Node(n) => write!(f, "node {n}"),
        }
    }
}

/// Whether `name` may name a node: `[A-Za-z0-9._-]{1,64}`, not `.` or `..` (the one rule of
/// ckpt-store, which also guards every directory named after a node).
pub fn valid_node_name(name: &str) -> bool {
    ckpt_store::validate::node_name(name).is_ok()
}

/// Who is calling, as the connection proved it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// A TLS client that presented a certificate of the cluster CA.
    Daemon(Identity),
    /// A root process over a Unix socket of this machine (the standalone daemon's own agent,
    /// or an administrator).
    LocalRoot,
    /// Anyone else: a TLS client without a certificate, or a non-root local user. Such a caller
    /// may use only the calls a job token authorizes.
    Anonymous,
}

impl Peer {
    /// Whether this caller is the coordinator (or root on this machine).
    pub fn is_coordinator(&self) -> bool {
        matches!(self, Peer::Daemon(Identity::Coordinator) | Peer::LocalRoot)
    }

    /// Whether this caller is the agent of `node` (or root on this machine).
    pub fn is_node(&self, node: &str) -> bool {
        match self {
            Peer::Daemon(Identity::Node(n)) => n == node,
            Peer::LocalRoot => true,
            _ => false,
        }
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Daemon(i) => i.fmt(f),
            Peer::LocalRoot => f.write_str("root on this machine"),
            Peer::Anonymous => f.write_str("a caller without a cluster credential"),
        }
    }
}

/// What a connection proved about its caller; tonic hands it to every request as an extension.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// The caller.
    pub peer: Peer,
    /// Its address, for logs.
    pub addr: Option<std::net::SocketAddr>,
}

/// The caller of a request: from the TLS handshake of its connection, or from the kernel's
/// credentials of a Unix socket peer. A request whose connection proved nothing is anonymous.
pub fn peer_of<T>(req: &tonic::Request<T>) -> Peer {
    if let Some(i) = req.extensions().get::<PeerInfo>() {
        return i.peer.clone();
    }
    if let Some(cred) = req
        .extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
    {
        if cred.uid() == 0 {
            return Peer::LocalRoot;
        }
    }
    Peer::Anonymous
}

/// The refusal every handler returns to a caller that may not make a call: names the call, who
/// asked and who may.
pub fn refuse<T>(req: &tonic::Request<T>, call: &str, allowed: &str) -> tonic::Status {
    let peer = peer_of(req);
    let addr = req
        .extensions()
        .get::<PeerInfo>()
        .and_then(|i| i.addr)
        .or_else(|| req.remote_addr());
    tracing::warn!(call, %peer, addr = ?addr, "refused a call from a caller not allowed to make it");
    let status = format!("{call} is only for {allowed}; the caller is {peer}");
    match peer {
        Peer::Anonymous => tonic::Status::unauthenticated(status),
        _ => tonic::Status::permission_denied(status),
    }
}

/// Whether a job token presented by a caller is the job's: never for an empty token, and in
/// time that does not depend on where the two first differ.
pub fn token_eq(expected: &str, presented: &str) -> bool {
    let (a, b) = (expected.as_bytes(), presented.as_bytes());
    if a.is_empty() || a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Errors loading, creating or using credentials. Each names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// A credential file cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A file is not what it should be (no certificate, no key, unparsable).
    #[error("{path}: {problem}")]
    Bad {
        /// The file.
        path: PathBuf,
        /// What is wrong, and what to do.
        problem: String,
    },
    /// The credential names another identity than the daemon needs.
    #[error("{path} is the credential of {found}, not of {wanted}: {hint}")]
    WrongIdentity {
        /// The certificate.
        path: PathBuf,
        /// Whose it is.
        found: Identity,
        /// Whose it should be.
        wanted: Identity,
        /// What to do.
        hint: String,
    },
    /// A CA already exists where one is to be created.
    #[error("a cluster CA already exists in {dir}: refusing to replace it (every node's credential depends on it); remove it first if you really mean to start over")]
    CaExists {
        /// Its directory.
        dir: PathBuf,
    },
    /// A node name is not valid.
    #[error(
        "{name:?} is not a valid node name: use letters, digits, '.', '_' and '-' (at most 64)"
    )]
    BadNodeName {
        /// The name.
        name: String,
    },
    /// Certificate generation failed.
    #[error("cannot create a certificate: {0}")]
    Generate(String),
    /// rustls refused a configuration.
    #[error("TLS configuration: {0}")]
    Tls(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_round_trip_through_common_names() {
        for id in [
            Identity::Coordinator,
            Identity::Node("n1".into()),
            Identity::Node("node_0.a-b".into()),
        ] {
            assert_eq!(Identity::from_common_name(&id.common_name()), Some(id));
        }
        for cn in [
            "", "node:", "node:..", "node:a/b", "node:a:b", "ckptd2", "n1",
        ] {
            assert_eq!(Identity::from_common_name(cn), None, "{cn:?}");
        }
    }

    #[test]
    fn tokens_compare_whole_and_never_empty() {
        assert!(token_eq("abc", "abc"));
        assert!(!token_eq("abc", "abd"));
        assert!(!token_eq("abc", "ab"));
        assert!(!token_eq("", ""));
        assert!(!token_eq("abc", ""));
    }

    #[test]
    fn node_names_are_checked() {
        for ok in ["n1", "node_0.a-b", "a"] {
            assert!(valid_node_name(ok), "{ok}");
        }
        let long = "a".repeat(65);
        for bad in ["", ".", "..", "a/b", "a b", "a:b", "é", long.as_str()] {
            assert!(!valid_node_name(bad), "{bad:?}");
        }
    }
}
