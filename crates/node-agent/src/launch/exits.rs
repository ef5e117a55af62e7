//! Processes of jobs killed by a signal. An MPI launcher tells little of a rank that died: MPICH's
//! mpiexec ORs the wait statuses of every rank, so a rank killed by SIGKILL and the others it
//! then terminates end it with "exit 15". The kernel's process events connector (netlink
//! `NETLINK_CONNECTOR`, `CN_IDX_PROC`) says which process ended and how. The agent follows the
//! processes of its jobs (seeded from their cgroups at each heartbeat, their children from fork
//! events) and reports the first one of each part's incarnation killed by a signal that means
//! a failure (KILL, SEGV, BUS, ABRT, ILL, FPE); ckptd then restarts a job with
//! `--on-failure restart` that ended that way. Whether ckpt sent the signal itself (cancel, a
//! `--kill` checkpoint, a fence) ckptd knows from the job's state.
//!
//! The connector lives in the first network namespace only: an agent started in another one
//! (a container, the test hosts) opens its socket from a thread that enters the namespace of
//! its nearest ancestor where the connector answers. Without
//! the connector (not root there, a kernel without `CONFIG_PROC_EVENTS`) the agent warns once and
//! reports nothing: jobs restart on a lost node and on a launcher killed by a signal only.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tracing::{info, warn};

/// The processes followed and the deaths seen.
#[derive(Debug, Default)]
pub struct Exits {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Process (thread group) id → what it is.
    tracked: HashMap<i32, Tracked>,
    /// Job → the incarnation and what killed a process of it (the first one).
    killed: HashMap<u64, (u32, String)>,
}

/// A process followed.
#[derive(Debug, Clone, Copy)]
struct Tracked {
    job: u64,
    incarnation: u32,
    /// Its MPI rank, once seen in its environment: only a rank's death fails the job (a
    /// launcher kills its own helpers, Open MPI's its `ckpt-rsh`, as it ends).
    rank: Option<i32>,
}

impl Exits {
    /// Follows `pids`, processes of incarnation `incarnation` of `job`'s part; `rank_of` reads
    /// a process's MPI rank (asked again of those not known as ranks yet: a child is forked
    /// before it execs the rank).
    pub fn track(
        &self,
        job: u64,
        incarnation: u32,
        pids: &[i32],
        rank_of: impl Fn(i32) -> Option<i32>,
    ) {
        // /proc is read without the lock: a slow read must not hold up the event thread.
        let now: std::collections::HashSet<i32> = pids.iter().copied().collect();
        let (unknown, absent): (Vec<i32>, Vec<i32>) = {
            let i = self.inner.lock().expect("exits");
            let known = |p: &i32| {
                i.tracked.get(p).is_some_and(|t| {
                    t.job == job && t.incarnation == incarnation && t.rank.is_some()
                })
            };
            let absent = i
                .tracked
                .iter()
                .filter(|(p, t)| t.job == job && !now.contains(p));
            (
                pids.iter().copied().filter(|p| !known(p)).collect(),
                absent.map(|(p, _)| *p).collect(),
            )
        };
        let ranks: HashMap<i32, i32> = unknown
            .into_iter()
            .filter_map(|p| rank_of(p).map(|r| (p, r)))
            .collect();
        // Processes of the job gone without an event seen (one dropped under load): forgotten,
        // so that a reused PID is not taken for them.
        let gone: Vec<i32> = absent
            .into_iter()
            .filter(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
            .collect();
        let mut i = self.inner.lock().expect("exits");
        for p in gone {
            i.tracked.remove(&p);
        }
        for p in pids {
            let known = i
                .tracked
                .get(p)
                .filter(|t| t.job == job && t.incarnation == incarnation)
                .and_then(|t| t.rank);
            let rank = known.or_else(|| ranks.get(p).copied());
            i.tracked.insert(
                *p,
                Tracked {
                    job,
                    incarnation,
                    rank,
                },
            );
        }
    }

    /// What killed a process of this incarnation of `job`, if anything did.
    pub fn killed(&self, job: u64, incarnation: u32) -> Option<String> {
        let i = self.inner.lock().expect("exits");
        i.killed
            .get(&job)
            .filter(|(inc, _)| *inc == incarnation)
            .map(|(_, what)| what.clone())
    }

    /// A new process `child` of `parent`: followed if its parent is.
    fn forked(&self, parent: i32, child: i32) {
        let mut i = self.inner.lock().expect("exits");
        if let Some(owner) = i.tracked.get(&parent).copied() {
            i.tracked.insert(
                child,
                Tracked {
                    rank: None,
                    ..owner
                },
            );
        }
    }

    /// Process `pid` ended with wait status `status`; `comm` names it.
    fn exited(&self, pid: i32, status: u32, comm: impl FnOnce() -> String) {
        let mut i = self.inner.lock().expect("exits");
        let Some(Tracked {
            job,
            incarnation,
            rank: Some(rank),
        }) = i.tracked.remove(&pid)
        else {
            return;
        };
        let signal = (status & 0x7f) as i32;
        if !ckpt_proto::FAILURE_SIGNALS.contains(&signal) {
            return;
        }
        // The first death of the newest incarnation; a late one of an older does not count.
        let first = i.killed.get(&job).is_none_or(|(inc, _)| incarnation > *inc);
        if first {
            let what = format!(
                "rank {rank} ({}, pid {pid}) killed by signal {signal}",
                comm()
            );
            info!(job, %what, "a process of a job was killed");
            i.killed.insert(job, (incarnation, what));
        }
    }

    /// Applies one event of the connector.
    fn apply(&self, event: Event) {
        match event {
            Event::Fork { parent, child } => self.forked(parent, child),
            Event::Exit { pid, status } => self.exited(pid, status, || {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .map(|c| c.trim().to_string())
                    .unwrap_or_else(|_| "a process".into())
            }),
        }
    }
}

/// What the connector says, of what this module needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// A new process (not a thread).
    Fork { parent: i32, child: i32 },
    /// A process (its thread group leader) ended with this wait status.
    Exit { pid: i32, status: u32 },
}

const NETLINK_CONNECTOR: i32 = 11;
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const PROC_CN_MCAST_LISTEN: u32 = 1;
const PROC_EVENT_FORK: u32 = 0x1;
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
/// `struct nlmsghdr`, then `struct cn_msg` (its header), then `struct proc_event`.
const NLMSG_LEN: usize = 16;
const CN_MSG_LEN: usize = 20;
/// Where `proc_event.event_data` begins (after `what`, `cpu` and `timestamp_ns`).
const EVENT_DATA: usize = NLMSG_LEN + CN_MSG_LEN + 16;

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Reads one netlink message of the connector (`None`: not an event this module needs).
fn parse(msg: &[u8]) -> Option<Event> {
    let idx = u32_at(msg, NLMSG_LEN)?;
    let val = u32_at(msg, NLMSG_LEN + 4)?;
    if (idx, val) != (CN_IDX_PROC, CN_VAL_PROC) {
        return None;
    }
    let what = u32_at(msg, NLMSG_LEN + CN_MSG_LEN)?;
    let field = |n: usize| u32_at(msg, EVENT_DATA + 4 * n);
    match what {
        PROC_EVENT_FORK => {
            let (parent_tgid, child_pid, child_tgid) = (field(1)?, field(2)?, field(3)?);
            (child_pid == child_tgid).then_some(Event::Fork {
                parent: parent_tgid as i32,
                child: child_pid as i32,
            })
        }
        PROC_EVENT_EXIT => {
            let (pid, tgid, status) = (field(0)?, field(1)?, field(2)?);
            (pid == tgid).then_some(Event::Exit {
                pid: pid as i32,
                status,
            })
        }
        _ => None,
    }
}

/// The subscription message: `nlmsghdr` + `cn_msg` + `PROC_CN_MCAST_LISTEN`.
fn listen_message() -> Vec<u8> {
    let len = (NLMSG_LEN + CN_MSG_LEN + 4) as u32;
    let mut m = Vec::with_capacity(len as usize);
    m.extend_from_slice(&len.to_ne_bytes());
    m.extend_from_slice(&(libc::NLMSG_DONE as u16).to_ne_bytes());
    m.extend_from_slice(&0u16.to_ne_bytes()); // flags
    m.extend_from_slice(&0u32.to_ne_bytes()); // seq
    m.extend_from_slice(&std::process::id().to_ne_bytes());
    m.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
    m.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // seq
    m.extend_from_slice(&0u32.to_ne_bytes()); // ack
    m.extend_from_slice(&4u16.to_ne_bytes()); // len
    m.extend_from_slice(&0u16.to_ne_bytes()); // flags
    m.extend_from_slice(&PROC_CN_MCAST_LISTEN.to_ne_bytes());
    m
}

/// Opens the connector socket and subscribes: in this network namespace, else (the kernel
/// refuses a socket elsewhere than the first) in that of the nearest ancestor process where it
/// works, which this thread then stays in.
fn open() -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    let mut err = match subscribe() {
        Ok(fd) => return Ok(fd),
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => e,
        Err(e) => return Err(e),
    };
    let mut pid = std::process::id();
    for _ in 0..64 {
        pid = match parent_of(pid) {
            Some(p) if p > 0 => p,
            _ => break,
        };
        let Ok(ns) = std::fs::File::open(format!("/proc/{pid}/ns/net")) else {
            continue;
        };
        // SAFETY: setns(2) on a namespace file we opened; this thread is the watcher's own and
        // stays there.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            continue;
        }
        match subscribe() {
            Ok(fd) => return Ok(fd),
            Err(e) => err = e,
        }
    }
    Err(err)
}

/// The parent of process `pid`, from /proc/PID/stat.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A connector socket of this thread's network namespace, subscribed to process events.
fn subscribe() -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            NETLINK_CONNECTOR,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor socket(2) just returned, owned from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_nl is plain data; zero is a valid start.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as u16;
    addr.nl_groups = CN_IDX_PROC;
    // SAFETY: bind(2) with a sockaddr_nl of the right size.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            std::ptr::addr_of!(addr).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let m = listen_message();
    // SAFETY: send(2) of a buffer we own, its length.
    let r = unsafe { libc::send(fd.as_raw_fd(), m.as_ptr().cast(), m.len(), 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// Starts following process events for `exits`, in a thread of its own; warns and returns if
/// the connector cannot be opened.
pub fn watch(exits: Arc<Exits>) {
    let spawned = std::thread::Builder::new()
        .name("ckpt-exits".into())
        .spawn(move || {
            use std::os::fd::AsRawFd;
            let fd = match open() {
                Ok(fd) => fd,
                Err(e) => {
                    warn!(error = %e, "cannot follow process events (netlink connector): a job whose rank is killed by a signal restarts only if its launcher says so");
                    return;
                }
            };
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                // SAFETY: recv(2) into a buffer we own, its length.
                let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    // ENOBUFS: events were dropped under load (a death among them goes unseen;
                    // the next heartbeat forgets the processes gone).
                    if e.raw_os_error() == Some(libc::ENOBUFS) || e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    warn!(error = %e, "process events stopped");
                    return;
                }
                let mut at = 0usize;
                let n = n as usize;
                while at + NLMSG_LEN <= n {
                    let len = u32_at(&buf, at).unwrap_or(0) as usize;
                    if len < NLMSG_LEN || at + len > n {
                        break;
                    }
                    if let Some(ev) = parse(&buf[at..at + len]) {
                        exits.apply(ev);
                    }
                    at += (len + 3) & !3;
                }
            }
        });
    match spawned {
        Ok(_) => info!("following process events of jobs"),
        Err(e) => warn!(error = %e, "cannot start the process event thread"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connector message of `what` with `data` as its event data.
    fn message(what: u32, data: &[u32]) -> Vec<u8> {
        let mut m = vec![0u8; EVENT_DATA];
        m[NLMSG_LEN..NLMSG_LEN + 4].copy_from_slice(&CN_IDX_PROC.to_ne_bytes());
        m[NLMSG_LEN + 4..NLMSG_LEN + 8].copy_from_slice(&CN_VAL_PROC.to_ne_bytes());
        m[NLMSG_LEN + CN_MSG_LEN..NLMSG_LEN + CN_MSG_LEN + 4].copy_from_slice(&what.to_ne_bytes());
        for d in data {
            m.extend_from_slice(&d.to_ne_bytes());
        }
        m
    }

    #[test]
    fn reads_forks_of_processes_and_exits_of_leaders() {
        // fork: parent_pid, parent_tgid, child_pid, child_tgid
        assert_eq!(
            parse(&message(PROC_EVENT_FORK, &[10, 10, 11, 11])),
            Some(Event::Fork {
                parent: 10,
                child: 11
            })
        );
        assert_eq!(
            parse(&message(PROC_EVENT_FORK, &[10, 10, 12, 11])),
            None,
            "a new thread"
        );
        // exit: pid, tgid, exit_code, exit_signal
        assert_eq!(
            parse(&message(PROC_EVENT_EXIT, &[11, 11, 9, 17, 10, 10])),
            Some(Event::Exit { pid: 11, status: 9 })
        );
        assert_eq!(parse(&message(PROC_EVENT_EXIT, &[12, 11, 9, 17])), None);
        assert_eq!(parse(&message(PROC_EVENT_EXIT, &[11])), None, "short");
        assert_eq!(parse(&message(0x2, &[1, 2, 3, 4])), None, "exec");
        assert_eq!(listen_message().len(), 40);
    }

    /// The real connector: a child of a followed process (a shell), killed by SIGKILL, is
    /// reported. Skips, saying why, where the connector cannot be opened (not root).
    #[test]
    fn the_kernel_reports_a_followed_processs_child_killed() {
        if let Err(e) = open() {
            eprintln!("SKIPPED: no process events connector here: {e}");
            return;
        }
        let exits = Arc::new(Exits::default());
        watch(exits.clone());
        std::thread::sleep(std::time::Duration::from_millis(200));
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "read x"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        exits.track(9, 3, &[sh.id() as i32], |_| Some(0));
        // The shell's child, forked after the shell was followed.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "exec sleep 30"])
            .spawn()
            .unwrap();
        // (Spawned by this process, not the shell: followed by its PID like a seeded one.)
        exits.track(9, 3, &[child.id() as i32], |_| Some(1));
        child.kill().unwrap();
        child.wait().unwrap();
        let begin = std::time::Instant::now();
        while exits.killed(9, 3).is_none() && begin.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = sh.kill();
        let _ = sh.wait();
        let what = exits.killed(9, 3).expect("the kill reported");
        assert!(what.ends_with("killed by signal 9"), "{what}");
        assert!(what.starts_with("rank 1 ("), "{what}");
        assert!(what.contains(&format!("pid {})", child.id())), "{what}");
    }

    #[test]
    fn the_first_fatal_death_of_a_rank_is_kept_per_incarnation() {
        let e = Exits::default();
        let rank = |r| move |_| Some(r);
        e.track(7, 1, &[100], |_| None);
        e.apply(Event::Fork {
            parent: 100,
            child: 101,
        });
        e.apply(Event::Fork {
            parent: 999,
            child: 102,
        });
        // Not followed, not a rank (a launcher's helper), a normal exit, or SIGTERM: nothing.
        e.exited(102, 9, || "other".into());
        e.exited(100, 9, || "ckpt-rsh".into());
        e.track(7, 1, &[103, 104], rank(3));
        e.exited(103, 1 << 8, || "rank".into());
        e.exited(104, libc::SIGTERM as u32, || "rank".into());
        assert_eq!(e.killed(7, 1), None);
        // The child of a followed process, a rank once its environment says so, killed: kept,
        // and only the first.
        e.track(7, 1, &[101], rank(2));
        e.exited(101, libc::SIGKILL as u32, || "heat".into());
        e.track(7, 1, &[105], rank(4));
        e.exited(105, libc::SIGSEGV as u32 | 0x80, || "heat".into());
        assert_eq!(
            e.killed(7, 1).as_deref(),
            Some("rank 2 (heat, pid 101) killed by signal 9")
        );
        assert_eq!(e.killed(7, 2), None, "another incarnation");
        e.track(7, 2, &[106], rank(0));
        e.exited(106, libc::SIGSEGV as u32 | 0x80, || "heat".into());
        assert_eq!(
            e.killed(7, 2).as_deref(),
            Some("rank 0 (heat, pid 106) killed by signal 11")
        );
    }
}
