//! Readiness and status for the service manager: systemd's notification protocol, for units of
//! `Type=notify`. systemd names a datagram socket in `$NOTIFY_SOCKET` (a path, or an abstract
//! name after `@`); a daemon sends it `READY=1` once it serves, `STATUS=<one line>` for
//! `systemctl status`, and `STOPPING=1` when it shuts down. Without `$NOTIFY_SOCKET` (started
//! by hand, or by a unit of another type) nothing is sent.
//!
//! The variable is taken out of the environment when read, before the daemon starts anything:
//! no process it starts (a job's shim, CRIU) inherits it.
use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The environment variable systemd sets for a `Type=notify` service.
pub const ENV: &str = "NOTIFY_SOCKET";

/// Where notifications go, if anywhere.
#[derive(Debug)]
pub struct Notifier {
    addr: Option<SocketAddr>,
}

impl Notifier {
    /// Takes `$NOTIFY_SOCKET` out of the environment. Call it in `main` before any thread
    /// starts. A value that is no socket address is ignored (a warning on stderr).
    pub fn from_env() -> Notifier {
        let Some(value) = std::env::var_os(ENV) else {
            return Notifier { addr: None };
        };
        std::env::remove_var(ENV);
        let addr = address(&value.to_string_lossy());
        if let Err(e) = &addr {
            eprintln!("ignoring {ENV}={}: {e}", value.to_string_lossy());
        }
        Notifier { addr: addr.ok() }
    }

    /// Nothing is sent (no service manager is listening).
    pub fn none() -> Notifier {
        Notifier { addr: None }
    }

    /// The daemon serves: `READY=1` with `status`.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// A new one-line status.
    pub fn status(&self, status: &str) {
        self.send(&format!("STATUS={}", one_line(status)));
    }

    /// The daemon is shutting down.
    pub fn stopping(&self) {
        self.send("STOPPING=1\nSTATUS=stopping");
    }

    /// Sends `message`; a failure is printed, never fatal (the daemon serves either way).
    fn send(&self, message: &str) {
        let Some(addr) = &self.addr else { return };
        let sent = UnixDatagram::unbound().and_then(|s| s.send_to_addr(message.as_bytes(), addr));
        if let Err(e) = sent {
            eprintln!("cannot notify the service manager ({ENV}): {e}");
        }
    }
}

/// The socket address `$NOTIFY_SOCKET` names: an absolute path, or `@name` in the abstract
/// namespace.
fn address(value: &str) -> io::Result<SocketAddr> {
    if let Some(name) = value.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        return SocketAddr::from_abstract_name(name.as_bytes());
    }
    if !value.starts_with('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "neither an absolute path nor an abstract name (@...)",
        ));
    }
    SocketAddr::from_pathname(value)
}

/// A status is one line: line breaks would start new assignments.
fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn listen(d: &std::path::Path) -> (UnixDatagram, Notifier) {
        let path = d.join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let n = Notifier {
            addr: Some(address(path.to_str().unwrap()).unwrap()),
        };
        (sock, n)
    }

    fn recv(sock: &UnixDatagram) -> String {
        let mut buf = [0u8; 512];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn ready_status_and_stopping_reach_the_socket_as_systemd_reads_them() {
        let d = tempfile::tempdir().unwrap();
        let (sock, n) = listen(d.path());
        n.ready("serving on /run/ckpt/ckptd.sock");
        assert_eq!(
            recv(&sock),
            "READY=1\nSTATUS=serving on /run/ckpt/ckptd.sock"
        );
        n.status("2 agents\nREADY=1");
        assert_eq!(recv(&sock), "STATUS=2 agents READY=1", "one line only");
        n.stopping();
        assert_eq!(recv(&sock), "STOPPING=1\nSTATUS=stopping");
    }

    #[test]
    fn no_socket_or_a_bad_one_sends_nothing_and_fails_nothing() {
        Notifier::none().ready("x");
        assert!(address("relative/path").is_err());
        assert!(address("@ckpt-test-abstract").is_ok());
        // A socket that went away: the daemon goes on.
        let d = tempfile::tempdir().unwrap();
        let (sock, n) = listen(d.path());
        drop(sock);
        n.ready("x");
    }
}
