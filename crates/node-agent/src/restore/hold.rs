//! Restart, TCP hold: nftables drops a restored job's TCP traffic until every node is restored;
//! closing sockets of the killed incarnation are cleared first.

use tracing::{debug, warn};

use crate::error::AgentError;
use crate::jobs::Jobs;
use crate::os::sockdiag;

impl Jobs {
    /// Name of the nftables table that holds a job's TCP traffic during a restart.
    fn hold_table(&self, job: u64) -> String {
        let node: String = self
            .node
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        format!("ckpt_hold_{node}_{job}")
    }

    /// Drops TCP traffic on the job's ports in this node's network namespace, so that restored
    /// connections exchange nothing (and reset nothing) before every node is restored. Packets
    /// are dropped, not rejected: TCP retransmits them after the release.
    ///
    /// `sandboxed` comes from the part's record, never from the namespace's path existing:
    /// `/run/netns/ckpt-<node>-<job>` is a machine-wide name, where a leftover of another
    /// agent may sit, and a part held there would not be held at all.
    pub(super) async fn hold_tcp(
        &self,
        job: u64,
        sandboxed: bool,
        ports: &[u16],
    ) -> Result<(), AgentError> {
        let netns = self.netns(job);
        if sandboxed {
            // A sandbox: all of its TCP on the job interface, in its own namespace.
            return crate::os::sandbox::hold(&netns)
                .await
                .map_err(|message| AgentError::Start {
                    job,
                    message: format!("cannot block the part's TCP during restore: {message}"),
                });
        }
        if ports.is_empty() {
            return Ok(());
        }
        let set = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let table = self.hold_table(job);
        // One transaction: a hold left by an earlier attempt is replaced (the table is added
        // first so that deleting it cannot fail).
        let script = format!(
            "add table inet {table}\ndelete table inet {table}\n\
             table inet {table} {{\n\
             chain input {{ type filter hook input priority -10; policy accept; tcp dport {{ {set} }} drop; }}\n\
             chain output {{ type filter hook output priority -10; policy accept; tcp sport {{ {set} }} drop; }}\n\
             }}\n"
        );
        crate::os::sandbox::run("nft", &["-f", "-"], Some(&script))
            .await
            .map_err(|message| AgentError::Start {
                job,
                message: format!("cannot block the job's TCP ports during restore: {message}"),
            })
    }

    /// Removes the hold of [`Jobs::hold_tcp`], if any.
    pub(super) async fn release_tcp(&self, job: u64, sandboxed: bool) {
        let netns = self.netns(job);
        if sandboxed {
            crate::os::sandbox::release(&netns).await;
            return;
        }
        let table = self.hold_table(job);
        let _ = crate::os::sandbox::run("nft", &["delete", "table", "inet", &table], None).await;
    }
}

/// Whether an address is configured on this node (in the agent's network namespace).
pub(super) fn address_is_local(addr: &str) -> bool {
    let Ok(ip) = addr.parse::<std::net::IpAddr>() else {
        return true;
    };
    match std::net::TcpListener::bind((ip, 0)) {
        Ok(_) => true,
        Err(e) => e.raw_os_error() != Some(libc::EADDRNOTAVAIL),
    }
}

/// TCP states of connections their owner has closed.
const STALE_TCP_STATES: [u8; 5] = [
    sockdiag::TCP_TIME_WAIT,
    sockdiag::TCP_FIN_WAIT1,
    sockdiag::TCP_FIN_WAIT2,
    sockdiag::TCP_CLOSING,
    sockdiag::TCP_LAST_ACK,
];

/// Destroys the closing remains of the job's TCP connections on its ports. When a job is killed
/// its connections linger for up to a minute (TIME_WAIT; FIN_WAIT and LAST_ACK when the peer
/// was killed too, or a failed restart dropped its packets), and the restored sockets, which
/// reuse the same addresses, could not bind or connect. Only sockets in closing states are
/// touched, never an open one, and only after every process of the job is gone and the hold
/// is in place: destroying a socket sends a reset with the sequence numbers of the checkpoint,
/// which a peer part restored already would accept.
pub(super) async fn clear_stale_sockets(ports: &[u16]) {
    if ports.is_empty() {
        return;
    }
    let ports = ports.to_vec();
    let r = tokio::task::spawn_blocking(move || destroy_stale(&ports)).await;
    match r {
        Ok(Ok(n)) if n > 0 => debug!(sockets = n, "stale TCP sockets of the job destroyed"),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            warn!(error = %e, "cannot clear stale TCP sockets of the job (socket diagnostics; the kernel needs CONFIG_INET_DIAG_DESTROY); a restored connection may fail to bind")
        }
        Err(e) => warn!(error = %e, "cannot clear stale TCP sockets of the job"),
    }
}

/// [`clear_stale_sockets`], blocking: how many sockets went.
fn destroy_stale(ports: &[u16]) -> std::io::Result<usize> {
    let mut diag = sockdiag::Diag::open()?;
    let mut destroyed = 0;
    for family in [libc::AF_INET, libc::AF_INET6] {
        let found = match diag.tcp_sockets(family as u8, &STALE_TCP_STATES) {
            Ok(f) => f,
            // A kernel without IPv6 has no IPv6 sockets to list.
            Err(e)
                if family == libc::AF_INET6
                    && matches!(
                        e.raw_os_error(),
                        Some(libc::ENOENT | libc::EAFNOSUPPORT | libc::EINVAL)
                    ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        };
        for s in found.iter().filter(|s| ports.contains(&s.local_port)) {
            diag.destroy(s)?;
            destroyed += 1;
        }
    }
    Ok(destroyed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_not_on_this_node_are_told_apart() {
        assert!(address_is_local("127.0.0.1"));
        // TEST-NET-1 (RFC 5737) is never configured on a host.
        assert!(!address_is_local("192.0.2.1"));
        // What cannot be parsed is not ours to refuse.
        assert!(address_is_local("not-an-address"));
    }
}
