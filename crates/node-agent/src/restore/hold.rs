//! Restart, TCP hold: nftables drops a restored job's TCP traffic until every node is restored;
//! closing sockets of the killed incarnation are cleared first.

use tracing::warn;

use crate::error::AgentError;
use crate::jobs::Jobs;

impl Jobs {
    /// Name of the nftables table that holds a job's TCP traffic during a restart.
    fn hold_table(&self, job: u64) -> String {
        let node: String = self
            .node
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
            return crate::sandbox::hold(&netns)
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
        crate::sandbox::run("nft", &["-f", "-"], Some(&script))
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
            crate::sandbox::release(&netns).await;
            return;
        }
        let table = self.hold_table(job);
        let _ = crate::sandbox::run("nft", &["delete", "table", "inet", &table], None).await;
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
const STALE_TCP_STATES: [(&str, &str); 5] = [
    // ss's name, and the number /proc/net/tcp gives it
    ("time-wait", "06"),
    ("fin-wait-1", "04"),
    ("fin-wait-2", "05"),
    ("closing", "0B"),
    ("last-ack", "09"),
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
    // Reading the kernel's tables costs far less than running ss, which is needed only if
    // there is something to destroy (or the tables cannot be read).
    // Without IPv6 there is no tcp6 table.
    let mut tables = Vec::new();
    for path in ["/proc/net/tcp", "/proc/net/tcp6"] {
        match tokio::fs::read_to_string(path).await {
            Ok(t) => tables.push(Ok(t)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && path.ends_with('6') => {}
            Err(e) => tables.push(Err(e)),
        }
    }
    if tables.iter().all(Result::is_ok)
        && !tables.iter().flatten().any(|t| has_stale_socket(t, ports))
    {
        return;
    }
    let filter = ports
        .iter()
        .map(|p| format!("sport = :{p}"))
        .collect::<Vec<_>>()
        .join(" or ");
    let r = tokio::process::Command::new("ss")
        .args(["-K", "-t", "-a", "-n"])
        .args(STALE_TCP_STATES.iter().flat_map(|(s, _)| ["state", s]))
        .arg(format!("( {filter} )"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output()
        .await;
    match r {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            warn!(stderr = %String::from_utf8_lossy(&o.stderr), "cannot clear stale TCP sockets")
        }
        Err(e) => warn!(error = %e, "cannot run ss (iproute2) to clear stale TCP sockets"),
    }
}

/// Whether a `/proc/net/tcp` or `/proc/net/tcp6` table lists a socket on one of `ports` (local
/// side) in one of the [`STALE_TCP_STATES`]. A line it cannot read counts as such a socket.
fn has_stale_socket(table: &str, ports: &[u16]) -> bool {
    table.lines().skip(1).any(|line| {
        let mut fields = line.split_whitespace().skip(1);
        let (Some(local), Some(_remote), Some(state)) =
            (fields.next(), fields.next(), fields.next())
        else {
            return true;
        };
        let Some(port) = local
            .rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
        else {
            return true;
        };
        ports.contains(&port) && STALE_TCP_STATES.iter().any(|(_, code)| *code == state)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_sockets_on_the_job_ports_are_found_in_the_kernel_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1145 1\n\
   1: 0100007F:A1B2 0100007F:07E8 06 00000000:00000000 03:00000E5A 00000000     0        0 0 3\n";
        // 0xA1B2 = 41394 is in TIME_WAIT; 0x07E8 = 2024 listens.
        assert!(has_stale_socket(table, &[41394]));
        assert!(!has_stale_socket(table, &[2024]), "a listener is not stale");
        assert!(!has_stale_socket(table, &[5000]));
        let v6 = "  sl  local_address                         remote_address                        st\n\
   0: 00000000000000000000000001000000:A1B2 00000000000000000000000001000000:07E8 04 0\n";
        assert!(has_stale_socket(v6, &[41394]), "FIN_WAIT1 over IPv6");
        assert!(
            has_stale_socket("header\ngarbage\n", &[1]),
            "unreadable: ss decides"
        );
        assert!(!has_stale_socket("header only\n", &[1]));
    }

    #[test]
    fn addresses_not_on_this_node_are_told_apart() {
        assert!(address_is_local("127.0.0.1"));
        // TEST-NET-1 (RFC 5737) is never configured on a host.
        assert!(!address_is_local("192.0.2.1"));
        // What cannot be parsed is not ours to refuse.
        assert!(address_is_local("not-an-address"));
    }
}
