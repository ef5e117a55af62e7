//! A part's TCP connections, across a checkpoint and a restart, in one place:
//!
//! - at the dump, the ports and addresses of its sockets are noted in the manifest
//!   ([`noted_at_dump`]): the restart binds the ports again, and a part whose addresses are
//!   not the node's restores only where they are;
//! - a checkpoint that kills the part locks its connections before the dump, so that neither
//!   the kill nor the peers' words in between reach the other side
//!   ([`Node::lock_tcp_before_kill`]); an aborted one lifts the lock;
//! - at the restart, closing sockets of the killed incarnation are cleared
//!   ([`clear_stale_sockets`]), and nftables drops the restored job's TCP traffic until every
//!   node is restored ([`Node::hold_tcp`], [`Node::release_tcp`]); the kill's lock ends when
//!   the restored part runs ([`Node::unlock_killed_tcp`]).

use std::net::SocketAddr;

use tracing::{debug, warn};

use crate::error::AgentError;
use crate::jobs::NodeJob;
use crate::node::Node;
use crate::os::sockdiag;

/// The ports and addresses of the TCP sockets of `pids`, as a dump notes them.
pub(crate) fn noted_at_dump(pids: &[i32]) -> (Vec<u16>, Vec<String>) {
    let tcp = crate::os::procfs::tcp_endpoints(pids);
    (tcp.ports, tcp.addrs.iter().map(|a| a.to_string()).collect())
}

impl Node {
    /// Name of this node's nftables table `kind` (`hold`, `lock`) of a job.
    fn job_table(&self, kind: &str, job: u64) -> String {
        let node: String = self
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        format!("ckpt_{kind}_{node}_{job}")
    }

    /// Before a part is dumped for a checkpoint that kills it (`checkpoint --kill`, a drain,
    /// a preemption), or at the kill where the engine suspends the job itself: its TCP
    /// connections (those `pids` hold) are locked, each by its two ends, as the engine locks
    /// them while it dumps. The engine's own lock ended with the dump (the job was to run
    /// on); without this one the kill's FIN or reset reached the peers, and a peer outside the job (a client of
    /// a server) saw its connection end though the restart brings it back. Locked, the peer's
    /// packets go unanswered and TCP sends them again until the part is restored and runs
    /// ([`Node::unlock_killed_tcp`]). A sandbox is held whole, as for a restart (its namespace
    /// goes with the kill). A lock that cannot be made does not stop the kill: it is logged.
    /// Returns whether the part is locked.
    pub(crate) async fn lock_tcp_before_kill(&self, job: &mut NodeJob, pids: &[i32]) -> bool {
        let id = job.record.id;
        let connections = self.host.tcp_connections(pids);
        let r = if job.record.sandbox.is_some() {
            crate::os::sandbox::hold(&self.netns(id)).await
        } else if connections.is_empty() {
            return false;
        } else {
            let script = lock_script(&self.job_table("lock", id), &connections);
            crate::os::sandbox::run("nft", &["-f", "-"], Some(&script)).await
        };
        if let Err(e) = r {
            warn!(job = id, error = %e, "cannot lock the part's TCP connections before its kill: peers outside the job see them end");
            return false;
        }
        debug!(
            job = id,
            connections = connections.len(),
            "the part's TCP connections are locked for its kill"
        );
        if job.record.sandbox.is_none() {
            job.record.tcp_locked = true;
            if let Err(e) = job.save() {
                warn!(job = id, error = %e, "cannot record the lock on the part's TCP connections");
            }
        }
        true
    }

    /// Lifts the lock of [`Node::lock_tcp_before_kill`] from a part that was not killed after
    /// all (its epoch aborted): it runs on, and its connections with it.
    pub(crate) async fn unlock_tcp_after_abort(&self, job: &mut NodeJob) {
        if job.record.sandbox.is_some() {
            crate::os::sandbox::release(&self.netns(job.record.id)).await;
        }
        self.unlock_killed_tcp(job).await;
    }

    /// Lifts the lock of [`Node::lock_tcp_before_kill`], if there is one: the restored part
    /// is about to run.
    pub(crate) async fn unlock_killed_tcp(&self, job: &mut NodeJob) {
        if !job.record.tcp_locked {
            return;
        }
        let id = job.record.id;
        let table = self.job_table("lock", id);
        match crate::os::sandbox::run("nft", &["delete", "table", "inet", &table], None).await {
            Ok(()) => debug!(
                job = id,
                "the TCP connections locked since the part's kill are open again"
            ),
            // Gone already (deleted by hand, the node rebooted): nothing holds them.
            Err(e) => debug!(job = id, error = %e, "no lock on the part's TCP connections to lift"),
        }
        job.record.tcp_locked = false;
        if let Err(e) = job.save() {
            warn!(job = id, error = %e, "cannot record that the part's TCP connections are open");
        }
    }

    /// Drops TCP traffic on the job's ports in this node's network namespace, so that restored
    /// connections exchange nothing (and reset nothing) before every node is restored. Packets
    /// are dropped, not rejected: TCP retransmits them after the release.
    ///
    /// `sandboxed` comes from the part's record, never from the namespace's path existing:
    /// `/run/netns/ckpt-<node>-<job>` is a machine-wide name, where a leftover of another
    /// agent may sit, and a part held there would not be held at all.
    pub(crate) async fn hold_tcp(
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
        let table = self.job_table("hold", job);
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

    /// Removes the hold of [`Node::hold_tcp`], if any.
    pub(crate) async fn release_tcp(&self, job: u64, sandboxed: bool) {
        let netns = self.netns(job);
        if sandboxed {
            crate::os::sandbox::release(&netns).await;
            return;
        }
        let table = self.job_table("hold", job);
        let _ = crate::os::sandbox::run("nft", &["delete", "table", "inet", &table], None).await;
    }
}

/// The nftables script of a lock on `connections` (local, remote): packets of each, either way,
/// are dropped. A lock left by an earlier kill is replaced.
fn lock_script(table: &str, connections: &[(SocketAddr, SocketAddr)]) -> String {
    let mut sets = String::new();
    let (mut output, mut input) = (String::new(), String::new());
    for (set, ty, ip, v4) in [
        ("conns4", "ipv4_addr", "ip", true),
        ("conns6", "ipv6_addr", "ip6", false),
    ] {
        let elements: Vec<String> = connections
            .iter()
            .filter(|(l, r)| l.is_ipv4() == v4 && r.is_ipv4() == v4)
            .map(|(l, r)| format!("{} . {} . {} . {}", l.ip(), l.port(), r.ip(), r.port()))
            .collect();
        if elements.is_empty() {
            continue;
        }
        sets += &format!(
            "set {set} {{ type {ty} . inet_service . {ty} . inet_service; elements = {{ {} }}; }}\n",
            elements.join(", ")
        );
        output += &format!(" {ip} saddr . tcp sport . {ip} daddr . tcp dport @{set} drop;");
        input += &format!(" {ip} daddr . tcp dport . {ip} saddr . tcp sport @{set} drop;");
    }
    format!(
        "add table inet {table}\ndelete table inet {table}\n\
         table inet {table} {{\n{sets}\
         chain output {{ type filter hook output priority -10; policy accept;{output} }}\n\
         chain input {{ type filter hook input priority -10; policy accept;{input} }}\n\
         }}\n"
    )
}

/// Whether an address is configured on this node (in the agent's network namespace).
pub(crate) fn address_is_local(addr: &str) -> bool {
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
pub(crate) async fn clear_stale_sockets(ports: &[u16]) {
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
    fn a_lock_drops_each_connection_by_its_two_ends_either_way() {
        let c = |l: &str, r: &str| (l.parse().unwrap(), r.parse().unwrap());
        let script = lock_script(
            "ckpt_lock_n1_7",
            &[
                c("127.0.0.1:8880", "127.0.0.1:40000"),
                c("[fd00::1]:8880", "[fd00::2]:40001"),
            ],
        );
        assert!(
            script.starts_with("add table inet ckpt_lock_n1_7\ndelete table inet ckpt_lock_n1_7\n")
        );
        assert!(script.contains("elements = { 127.0.0.1 . 8880 . 127.0.0.1 . 40000 }"));
        assert!(script.contains("elements = { fd00::1 . 8880 . fd00::2 . 40001 }"));
        assert!(script.contains("ip saddr . tcp sport . ip daddr . tcp dport @conns4 drop;"));
        assert!(script.contains("ip6 daddr . tcp dport . ip6 saddr . tcp sport @conns6 drop;"));
        // Only the families it has.
        let v4 = lock_script("t", &[c("10.0.0.1:1", "10.0.0.2:2")]);
        assert!(!v4.contains("conns6"), "{v4}");
    }

    /// Real nftables: the script loads, and loads again over itself.
    #[test]
    fn a_lock_script_is_taken_by_nft() {
        if !nix::unistd::geteuid().is_root()
            || std::process::Command::new("nft")
                .arg("--version")
                .output()
                .is_err()
        {
            eprintln!("SKIPPED: needs root and nftables");
            return;
        }
        let table = format!("ckpt_lock_unit_{}", std::process::id());
        let c: (SocketAddr, SocketAddr) = (
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        );
        let load = || {
            let mut child = std::process::Command::new("nft")
                .args(["-f", "-"])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(lock_script(&table, &[c]).as_bytes())
                .unwrap();
            child.wait().unwrap().success()
        };
        assert!(load() && load(), "nft takes the lock, and again over it");
        let listed = std::process::Command::new("nft")
            .args(["list", "table", "inet", &table])
            .output()
            .unwrap();
        let _ = std::process::Command::new("nft")
            .args(["delete", "table", "inet", &table])
            .status();
        let text = String::from_utf8_lossy(&listed.stdout);
        assert!(text.contains("127.0.0.1 . 1 . 127.0.0.1 . 2"), "{text}");
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
