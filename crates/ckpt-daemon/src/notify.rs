//! Readiness and status for the service manager: systemd's notification protocol, for units of
//! `Type=notify`. systemd names a datagram socket in `$NOTIFY_SOCKET` (a path, or an abstract
//! name after `@`); a daemon sends it `READY=1` once it serves, `STATUS=<one line>` for
//! `systemctl status`, and `STOPPING=1` when it shuts down. Without `$NOTIFY_SOCKET` (started
//! by hand, or by a unit of another type) nothing is sent.
//!
//! With `WatchdogSec=` in the unit, systemd also sets `$WATCHDOG_USEC`: the daemon then sends
//! `WATCHDOG=1` at half that interval from a task of its runtime, and systemd restarts it when
//! the pings stop (a runtime that no longer runs tasks).
//!
//! The variables are taken out of the environment when read, before the daemon starts anything:
//! no process it starts (a job's shim, CRIU) inherits them.
use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The environment variable systemd sets for a `Type=notify` service.
pub const ENV: &str = "NOTIFY_SOCKET";

/// Where notifications go, if anywhere, and how often the watchdog wants to hear from us.
#[derive(Debug, Clone)]
pub struct Notifier {
    addr: Option<SocketAddr>,
    watchdog: Option<std::time::Duration>,
}

impl Notifier {
    /// Takes `$NOTIFY_SOCKET` (and the watchdog's `$WATCHDOG_USEC`, `$WATCHDOG_PID`) out of
    /// the environment. Call it in `main` before any thread starts. A value that is no socket
    /// address is ignored (a warning on stderr).
    pub fn from_env() -> Notifier {
        let usec = std::env::var("WATCHDOG_USEC").ok();
        let pid = std::env::var("WATCHDOG_PID").ok();
        std::env::remove_var("WATCHDOG_USEC");
        std::env::remove_var("WATCHDOG_PID");
        let Some(value) = std::env::var_os(ENV) else {
            return Notifier::none();
        };
        std::env::remove_var(ENV);
        let addr = address(&value.to_string_lossy());
        if let Err(e) = &addr {
            eprintln!("ignoring {ENV}={}: {e}", value.to_string_lossy());
        }
        // The watchdog is ours unless it names another process (systemd sets the main PID).
        let ours = pid.is_none_or(|p| p.parse() == Ok(std::process::id()));
        let watchdog = usec
            .and_then(|u| u.parse::<u64>().ok())
            .filter(|&u| u > 0 && ours)
            .map(std::time::Duration::from_micros);
        Notifier {
            addr: addr.ok(),
            watchdog,
        }
    }

    /// Nothing is sent (no service manager is listening).
    pub fn none() -> Notifier {
        Notifier {
            addr: None,
            watchdog: None,
        }
    }

    /// How often to [`Notifier::watchdog`]: half the unit's `WatchdogSec=`, if it has one.
    pub fn watchdog_interval(&self) -> Option<std::time::Duration> {
        self.addr.as_ref()?;
        self.watchdog.map(|w| w / 2)
    }

    /// `WATCHDOG=1`: the daemon is alive (its runtime still runs tasks).
    pub fn watchdog(&self) {
        self.send("WATCHDOG=1");
    }

    /// Sends `WATCHDOG=1` every [`Notifier::watchdog_interval`] from a task of the current
    /// tokio runtime, if the unit has a watchdog: a daemon whose runtime stops running tasks is
    /// restarted by systemd.
    pub fn spawn_watchdog(&self) {
        if let Some(every) = self.watchdog_interval() {
            let n = self.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    n.watchdog();
                }
            });
        }
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
            watchdog: None,
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
    fn the_watchdog_pings_at_half_its_interval_and_only_for_its_process() {
        let d = tempfile::tempdir().unwrap();
        let (sock, n) = listen(d.path());
        assert_eq!(n.watchdog_interval(), None, "no WatchdogSec: no pings");
        let n = Notifier {
            watchdog: Some(Duration::from_secs(30)),
            ..n
        };
        assert_eq!(n.watchdog_interval(), Some(Duration::from_secs(15)));
        n.watchdog();
        assert_eq!(recv(&sock), "WATCHDOG=1");
        // From the environment, as systemd sets it; another process's watchdog is not ours.
        let path = d.path().join("notify.sock");
        for (pid, want) in [
            (
                std::process::id().to_string(),
                Some(Duration::from_millis(200)),
            ),
            ("1".to_string(), None),
        ] {
            std::env::set_var(ENV, &path);
            std::env::set_var("WATCHDOG_USEC", "400000");
            std::env::set_var("WATCHDOG_PID", &pid);
            let n = Notifier::from_env();
            assert_eq!(n.watchdog_interval(), want, "WATCHDOG_PID={pid}");
            for v in [ENV, "WATCHDOG_USEC", "WATCHDOG_PID"] {
                assert!(
                    std::env::var_os(v).is_none(),
                    "{v} taken out of the environment"
                );
            }
        }
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
