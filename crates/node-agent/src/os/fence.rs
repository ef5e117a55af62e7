//! The fence around DMTCP coordinators. DMTCP's coordinator listens on every address of the
//! node without authentication, and DMTCP 4.2 cannot bind it to one; anyone who reaches its
//! port can checkpoint, kill or stall the job. So each coordinator gets a port chosen here,
//! fenced before it starts by an nftables table of the agent's own: on that port, only
//! connections made on this node (through the loopback interface) by the job's owner pass. A
//! process of another user is reset, a packet from another host or network namespace dropped.
//!
//! ```text
//! table inet ckpt_dmtcp_<prefix> {
//!   set ports  { typeof tcp dport; }                 # fenced ports
//!   set owners { typeof tcp dport . meta skuid; }    # who may connect to each
//!   chain output { ... tcp dport . meta skuid @owners accept; tcp dport @ports reject with tcp reset }
//!   chain input  { ... iifname != "lo" tcp dport @ports drop }
//! }
//! ```
//!
//! The table is the agent's (named after its cgroup prefix, so agents sharing a network
//! namespace keep theirs apart) and made again at start with the ports of the jobs it finds.
//! A port stays fenced while a listener of its owner holds it; one that nobody listens on any
//! more (the job ended) is freed the next time a port is fenced.

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::{info, warn};

/// A port fenced less than this long ago stays fenced though nothing listens on it: its
/// coordinator may still be starting.
const STARTING: Duration = Duration::from_secs(120);

/// How a fence is set up.
#[derive(Debug)]
enum Mode {
    /// `[engines] dmtcp_fence = false`: coordinators listen unfenced.
    Off,
    /// The table exists.
    On,
    /// It could not be made: DMTCP jobs are refused, saying why.
    Broken(String),
}

/// The agent's fence (see the module's documentation).
#[derive(Debug)]
pub struct Fence {
    table: String,
    mode: Mode,
    ports: Mutex<HashMap<u16, Fenced>>,
}

#[derive(Debug, Clone, Copy)]
struct Fenced {
    uid: u32,
    since: Instant,
}

impl Fence {
    /// No fence: coordinators listen on a port DMTCP picks, reachable by anyone.
    pub fn off() -> Fence {
        Fence {
            table: String::new(),
            mode: Mode::Off,
            ports: Mutex::default(),
        }
    }

    /// Makes the table of the agent whose cgroup prefix is `prefix` (replacing one an earlier
    /// run of it left), with `keep` ((port, owner) of the coordinators of jobs still running)
    /// fenced again. A failure is kept and given to every DMTCP launch.
    pub fn start(prefix: &str, keep: &[(u16, u32)]) -> Fence {
        let table = format!(
            "ckpt_dmtcp_{}",
            prefix
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect::<String>()
        );
        let mut script = format!(
            "add table inet {table}\n\
             delete table inet {table}\n\
             table inet {table} {{\n\
             \x20 set ports {{ typeof tcp dport; }}\n\
             \x20 set owners {{ typeof tcp dport . meta skuid; }}\n\
             \x20 chain output {{\n\
             \x20   type filter hook output priority filter; policy accept;\n\
             \x20   tcp dport . meta skuid @owners accept\n\
             \x20   tcp dport @ports reject with tcp reset\n\
             \x20 }}\n\
             \x20 chain input {{\n\
             \x20   type filter hook input priority filter; policy accept;\n\
             \x20   iifname != \"lo\" tcp dport @ports drop\n\
             \x20 }}\n\
             }}\n"
        );
        let now = Instant::now();
        let mut ports = HashMap::new();
        for &(port, uid) in keep {
            script.push_str(&elements("add", &table, port, uid));
            ports.insert(port, Fenced { uid, since: now });
        }
        let mode = match nft(&script) {
            Ok(()) => {
                info!(table, fenced = keep.len(), "DMTCP coordinators fenced");
                Mode::On
            }
            Err(e) => {
                warn!(error = %e, "cannot fence DMTCP coordinators: DMTCP jobs are refused here (install nftables, or set [engines] dmtcp_fence = false)");
                Mode::Broken(e)
            }
        };
        Fence {
            table,
            mode,
            ports: Mutex::new(ports),
        }
    }

    /// A port for a new DMTCP coordinator of `uid`'s, fenced so that only `uid`'s processes on
    /// this node reach it; None without a fence (DMTCP then picks one).
    pub fn reserve(&self, uid: u32) -> Result<Option<u16>, String> {
        match &self.mode {
            Mode::Off => return Ok(None),
            Mode::Broken(e) => {
                return Err(format!(
                    "this node cannot fence the job's DMTCP coordinator ({e}): install nftables, or set [engines] dmtcp_fence = false in agent.toml to let it listen unfenced (see docs/dmtcp.md)"
                ))
            }
            Mode::On => {}
        }
        let mut ports = self.ports.lock().unwrap_or_else(|p| p.into_inner());
        self.free_unused(&mut ports);
        // A port free now; the coordinator binds it once fenced. Should another process bind
        // it first, the coordinator fails to start and so does the job, saying so.
        let port = (0..8)
            .find_map(|_| {
                let p = std::net::TcpListener::bind("0.0.0.0:0")
                    .ok()?
                    .local_addr()
                    .ok()?
                    .port();
                (!ports.contains_key(&p)).then_some(p)
            })
            .ok_or("no free TCP port for the job's DMTCP coordinator")?;
        nft(&elements("add", &self.table, port, uid)).map_err(|e| {
            format!("cannot fence port {port} for the job's DMTCP coordinator: {e}")
        })?;
        ports.insert(
            port,
            Fenced {
                uid,
                since: Instant::now(),
            },
        );
        Ok(Some(port))
    }

    /// Unfences the ports no listener of their owner holds any more (beyond their start).
    fn free_unused(&self, ports: &mut HashMap<u16, Fenced>) {
        let old: Vec<(u16, Fenced)> = ports
            .iter()
            .filter(|(_, f)| f.since.elapsed() >= STARTING)
            .map(|(p, f)| (*p, *f))
            .collect();
        if old.is_empty() {
            return;
        }
        let Ok(listening) = listeners() else {
            return;
        };
        for (port, f) in old {
            if listening.contains(&(port, f.uid)) {
                continue;
            }
            match nft(&elements("delete", &self.table, port, f.uid)) {
                Ok(()) => {
                    ports.remove(&port);
                }
                Err(e) => warn!(port, error = %e, "cannot unfence a DMTCP coordinator's port"),
            }
        }
    }
}

/// The nft commands that add or delete `port`'s elements.
fn elements(verb: &str, table: &str, port: u16, uid: u32) -> String {
    format!(
        "{verb} element inet {table} ports {{ {port} }}\n\
         {verb} element inet {table} owners {{ {port} . {uid} }}\n"
    )
}

/// (port, uid) of every listening TCP socket of this network namespace.
fn listeners() -> std::io::Result<std::collections::HashSet<(u16, u32)>> {
    const LISTEN: u8 = 10;
    let mut diag = crate::os::sockdiag::Diag::open()?;
    let mut found = std::collections::HashSet::new();
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        for s in diag.tcp_sockets(family, &[LISTEN])? {
            found.insert((s.local_port, s.uid));
        }
    }
    Ok(found)
}

/// Runs an nft script as one transaction.
fn nft(script: &str) -> Result<(), String> {
    let bin = ["/usr/sbin/nft", "/sbin/nft"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("nft");
    let mut child = Command::new(bin)
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run nft: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| format!("nft: {e}"))?;
    }
    let out = child.wait_with_output().map_err(|e| format!("nft: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "nft failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    /// Whether a process of `uid` connects to `port` on the loopback: a forked child that
    /// becomes `uid` and makes only system calls (no allocation after the fork).
    fn connects_as(uid: u32, port: u16) -> bool {
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: the child makes only async-signal-safe system calls and leaves with _exit.
        unsafe {
            let pid = libc::fork();
            assert!(pid >= 0);
            if pid == 0 {
                if libc::setgid(uid) != 0 || libc::setuid(uid) != 0 {
                    libc::_exit(2);
                }
                let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                let r = libc::connect(
                    fd,
                    (&addr as *const libc::sockaddr_in).cast(),
                    size_of::<libc::sockaddr_in>() as libc::socklen_t,
                );
                libc::_exit(if r == 0 { 0 } else { 1 });
            }
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            assert!(libc::WIFEXITED(status), "{status}");
            let code = libc::WEXITSTATUS(status);
            assert_ne!(code, 2, "cannot become uid {uid}");
            code == 0
        }
    }

    /// Real nftables on this machine's network namespace: the owner's processes reach a fenced
    /// port, another user's and root's do not, and a port its owner no longer listens on is
    /// unfenced later.
    #[test]
    fn only_the_owner_reaches_a_fenced_port() {
        if !nix::unistd::geteuid().is_root() || nft("list tables").is_err() {
            eprintln!("SKIPPED: needs root and nftables");
            return;
        }
        let prefix = format!("fence-test-{}", std::process::id());
        let fence = Fence::start(&prefix, &[]);
        assert!(matches!(fence.mode, Mode::On), "{:?}", fence.mode);
        let port = fence.reserve(65534).unwrap().unwrap();
        let listener = TcpListener::bind(("0.0.0.0", port)).unwrap();
        assert!(connects_as(65534, port), "the owner reaches its port");
        assert!(!connects_as(65533, port), "another user is refused");
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err(), "root too");
        drop(listener);
        // Once unused (and past its start), the next reservation frees it.
        fence.ports.lock().unwrap().get_mut(&port).unwrap().since -= STARTING;
        let next = fence.reserve(65534).unwrap().unwrap();
        assert_ne!(next, port);
        assert!(!fence.ports.lock().unwrap().contains_key(&port));
        let _ = nft(&format!("delete table inet {}", fence.table));
    }

    #[test]
    fn a_broken_fence_refuses_naming_the_way_out() {
        let f = Fence {
            table: "t".into(),
            mode: Mode::Broken("nft failed: no such file".into()),
            ports: Mutex::default(),
        };
        let e = f.reserve(1000).unwrap_err();
        assert!(
            e.contains("dmtcp_fence = false") && e.contains("no such file"),
            "{e}"
        );
        assert_eq!(Fence::off().reserve(1000), Ok(None));
    }
}
