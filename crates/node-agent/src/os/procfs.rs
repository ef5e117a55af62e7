//! What the agent reads about a job's processes from `/proc`: names and states, resident size
//! (for the staging-room estimate), regular files open for writing (their sizes are recorded at
//! checkpoint and restored before a restore), shared-memory files the engine does not save, and
//! verbs device mappings (which need an ib-quiesce channel).
//!
//! One file: every reader of `/proc` the agent has, sharing one set of parsers (maps, fd info,
//! sockets, status).
use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// One process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcStat {
    /// PID.
    pub pid: i32,
    /// Command name.
    pub comm: String,
    /// One-letter state (R, S, D, T, Z, ...).
    pub state: char,
    /// Parent PID.
    pub ppid: i32,
    /// Start time in clock ticks after boot (tells a reused PID apart).
    pub start_ticks: u64,
}

/// Reads `/proc/<pid>/stat`; `None` if the process is gone.
pub fn stat(pid: i32) -> Option<ProcStat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text[open + 1..close].to_string();
    let rest: Vec<&str> = text[close + 2..].split_whitespace().collect();
    Some(ProcStat {
        pid,
        comm,
        state: rest.first()?.chars().next()?,
        ppid: rest.get(1)?.parse().ok()?,
        start_ticks: rest.get(19)?.parse().ok()?,
    })
}

/// Whether `pid` exists (zombies count: their PID is still taken).
pub fn pid_taken(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Resident set size in bytes.
pub fn rss_bytes(pid: i32) -> u64 {
    let page = page_size();
    fs::read_to_string(format!("/proc/{pid}/statm"))
        .ok()
        .and_then(|t| t.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map(|pages| pages * page)
        .unwrap_or(0)
}

/// Bytes of `pid`'s writable memory written since the kernel's dirty-page tracking was last
/// reset for it (by a pre-dump or a dump with memory tracking): pages marked soft-dirty in
/// `/proc/<pid>/pagemap` (bit 55) that are present or swapped (bits 63, 62), in private or
/// anonymous mappings, which are what a dump copies. `None` if the process is gone.
pub fn soft_dirty_bytes(pid: i32) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    const SOFT_DIRTY: u64 = 1 << 55;
    const PRESENT_OR_SWAPPED: u64 = (1 << 63) | (1 << 62);
    // Entries read at once (512 KiB of pagemap, 256 MiB of memory with 4 KiB pages).
    const BATCH: u64 = 1 << 16;
    let page = page_size();
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let pagemap = fs::File::open(format!("/proc/{pid}/pagemap")).ok()?;
    let mut buf = vec![0u8; (BATCH * 8) as usize];
    let mut pages = 0u64;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let path = f.nth(3).unwrap_or("");
        let shared_file = perms.ends_with('s') && path.starts_with('/');
        if !perms.contains('w') || shared_file || path.starts_with("[v") {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let mut at = start / page;
        let last = end / page;
        while at < last {
            let n = (last - at).min(BATCH);
            let bytes = &mut buf[..(n * 8) as usize];
            if pagemap.read_exact_at(bytes, at * 8).is_err() {
                break;
            }
            pages += bytes
                .chunks_exact(8)
                .map(|e| u64::from_le_bytes(e.try_into().expect("8 bytes")))
                .filter(|e| e & SOFT_DIRTY != 0 && e & PRESENT_OR_SWAPPED != 0)
                .count() as u64;
            at += n;
        }
    }
    Some(pages * page)
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v > 0 {
        v as u64
    } else {
        4096
    }
}

/// Regular files the process has open with write access: (path, size now).
pub fn files_open_for_write(pid: i32) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return out;
    };
    for ent in rd.flatten() {
        let fd = ent.file_name().to_string_lossy().into_owned();
        let Ok(target) = fs::read_link(ent.path()) else {
            continue;
        };
        if !target.is_absolute() || target.to_string_lossy().ends_with(" (deleted)") {
            continue;
        }
        let Ok(info) = fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")) else {
            continue;
        };
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
            .unwrap_or(0);
        let access = flags & libc::O_ACCMODE as u32;
        if access != libc::O_WRONLY as u32 && access != libc::O_RDWR as u32 {
            continue;
        }
        // The open file itself, not whatever its path names now.
        if let Ok(meta) = fs::metadata(ent.path()) {
            if meta.is_file() {
                out.push((target, meta.len()));
            }
        }
    }
    out
}

/// Paths the process maps (from `/proc/<pid>/maps`), deduplicated.
pub fn mapped_paths(pid: i32) -> Vec<String> {
    let Ok(text) = fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return Vec::new();
    };
    let mut v: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5).map(str::to_string))
        .filter(|p| p.starts_with('/'))
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Paths of the process's open file descriptors.
pub fn fd_paths(pid: i32) -> Vec<PathBuf> {
    fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| fs::read_link(e.path()).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The named (not abstract) Unix sockets of the network namespace `pid` is in, by inode:
/// what `/proc/<pid>/net/unix` lists with a path.
pub fn unix_socket_names(pid: i32) -> std::collections::HashMap<u64, PathBuf> {
    let text = fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap_or_default();
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let inode = f.nth(6)?.parse().ok()?;
            let path = f.next()?;
            (!path.starts_with('@')).then(|| (inode, PathBuf::from(path)))
        })
        .collect()
}

/// The inode of a socket descriptor's link text (`socket:[12345]`).
pub fn socket_inode(link: &Path) -> Option<u64> {
    link.to_str()?
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// The RDMA connection manager's device file.
pub const RDMA_CM: &str = "/dev/infiniband/rdma_cm";

/// The lowest descriptor of the process open on `path`, if any.
pub fn fd_on(pid: i32, path: &str) -> Option<i32> {
    let rd = fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    rd.flatten()
        .filter(|e| fs::read_link(e.path()).is_ok_and(|p| p.as_os_str() == path))
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .min()
}

/// The descriptors the process holds open on files under `prefix`: (descriptor, path),
/// lowest first.
pub fn fds_under(pid: i32, prefix: &str) -> Vec<(i32, String)> {
    let Ok(rd) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let mut v: Vec<(i32, String)> = rd
        .flatten()
        .filter_map(|e| {
            let fd = e.file_name().to_str()?.parse().ok()?;
            let path = fs::read_link(e.path()).ok()?.to_string_lossy().into_owned();
            path.starts_with(prefix).then_some((fd, path))
        })
        .collect();
    v.sort_unstable();
    v
}

/// The first verbs device the process maps or holds open, if any.
pub fn verbs_device(pid: i32) -> Option<String> {
    let prefix = ib_quiesce::VERBS_DEVICE_PREFIX;
    mapped_paths(pid)
        .into_iter()
        .find(|p| p.starts_with(prefix))
        .or_else(|| {
            fd_paths(pid)
                .into_iter()
                .map(|p| p.to_string_lossy().into_owned())
                .find(|p| p.starts_with(prefix))
        })
}

/// The local endpoints of the TCP sockets some processes hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TcpEndpoints {
    /// Local ports.
    pub ports: Vec<u16>,
    /// Local addresses other than loopback and the wildcard.
    pub addrs: Vec<std::net::IpAddr>,
    /// The connections (every socket but a listening one): local and remote end. An IPv6
    /// socket's IPv4-mapped ends are given as the IPv4 addresses its packets carry.
    pub connections: Vec<(std::net::SocketAddr, std::net::SocketAddr)>,
}

/// `/proc/net/tcp`'s state of a listening socket.
const TCP_LISTEN: &str = "0A";

/// An `ADDR:PORT` of `/proc/net/tcp{,6}`.
fn proc_net_endpoint(text: &str) -> Option<(std::net::IpAddr, u16)> {
    let (addr, port) = text.rsplit_once(':')?;
    Some((proc_net_addr(addr)?, u16::from_str_radix(port, 16).ok()?))
}

/// Decodes an address of `/proc/net/tcp{,6}`: 32-bit words in host (little-endian) order.
fn proc_net_addr(hex: &str) -> Option<std::net::IpAddr> {
    let words: Vec<u32> = (0..hex.len() / 8)
        .map(|i| u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16).ok())
        .collect::<Option<_>>()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    match bytes.len() {
        4 => Some(std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?)),
        16 => {
            let v6 = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?);
            Some(v6.to_ipv4_mapped().map_or(v6.into(), Into::into))
        }
        _ => None,
    }
}

/// Local endpoints of the TCP sockets the processes hold (from their network namespace's
/// `/proc/<pid>/net/tcp{,6}`, matched by socket inode).
pub fn tcp_endpoints(pids: &[i32]) -> TcpEndpoints {
    let mut inodes = std::collections::HashSet::new();
    for &pid in pids {
        for p in fd_paths(pid) {
            let s = p.to_string_lossy();
            if let Some(ino) = s.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                inodes.insert(ino.to_string());
            }
        }
    }
    let mut out = TcpEndpoints::default();
    let mut tables_seen = std::collections::HashSet::new();
    for &pid in pids {
        for table in ["tcp", "tcp6"] {
            let path = format!("/proc/{pid}/net/{table}");
            // Processes in one network namespace share the table; read it once per namespace.
            let ns = fs::read_link(format!("/proc/{pid}/ns/net")).ok();
            if !tables_seen.insert((ns, table)) {
                continue;
            }
            let Ok(text) = fs::read_to_string(&path) else {
                continue;
            };
            for line in text.lines().skip(1) {
                let f: Vec<&str> = line.split_whitespace().collect();
                let (Some(local), Some(remote), Some(state), Some(inode)) =
                    (f.get(1), f.get(2), f.get(3), f.get(9))
                else {
                    continue;
                };
                if !inodes.contains(*inode) {
                    continue;
                }
                let Some((addr, port)) = proc_net_endpoint(local) else {
                    continue;
                };
                out.ports.push(port);
                if !addr.is_loopback() && !addr.is_unspecified() {
                    out.addrs.push(addr);
                }
                if *state != TCP_LISTEN {
                    if let Some(peer) = proc_net_endpoint(remote) {
                        out.connections.push(((addr, port).into(), peer.into()));
                    }
                }
            }
        }
    }
    out.ports.sort_unstable();
    out.ports.dedup();
    out.addrs.sort_unstable();
    out.addrs.dedup();
    out.connections.sort_unstable();
    out.connections.dedup();
    out
}

/// Thread IDs of the processes, other than their main threads (PIDs and TIDs share one
/// number space, and a restore needs both back).
pub fn thread_ids(pids: &[i32]) -> Vec<i32> {
    let mut out: Vec<i32> = pids
        .iter()
        .flat_map(|&pid| {
            fs::read_dir(format!("/proc/{pid}/task"))
                .map(|rd| {
                    rd.flatten()
                        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                        .filter(|&t| t != pid)
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default()
        })
        .collect();
    out.sort_unstable();
    out
}

/// Addresses of this network namespace's interfaces (loopback excluded).
pub fn local_addresses() -> Vec<std::net::IpAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we walk read-only and free once.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return out;
        }
        let mut cur = head;
        while !cur.is_null() {
            let a = (*cur).ifa_addr;
            if !a.is_null() {
                match i32::from((*a).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(a as *const libc::sockaddr_in);
                        out.push(std::net::IpAddr::from(
                            u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                        ));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(a as *const libc::sockaddr_in6);
                        out.push(std::net::IpAddr::from(sin6.sin6_addr.s6_addr));
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(head);
    }
    out.retain(|a| !a.is_loopback());
    out.sort_unstable();
    out.dedup();
    out
}

/// The value of variable `key` in the environment a process started with.
pub fn environ_var(pid: i32, key: &str) -> Option<String> {
    let env = fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|kv| {
        let kv = std::str::from_utf8(kv).ok()?;
        Some(kv.strip_prefix(key)?.strip_prefix('=')?.to_string())
    })
}

/// Whether the process maps a file named `name` (a shared library, say).
pub fn maps_file(pid: i32, name: &str) -> bool {
    mapped_paths(pid)
        .iter()
        .any(|p| Path::new(p).file_name().is_some_and(|n| n == name))
}

/// The MPI rank of a process, from the variables MPICH's Hydra (`PMI_RANK`) and Open MPI
/// (`OMPI_COMM_WORLD_RANK`) put in each rank's environment.
pub fn mpi_rank(pid: i32) -> Option<i32> {
    let env = fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|kv| {
        let kv = std::str::from_utf8(kv).ok()?;
        let v = kv
            .strip_prefix("PMI_RANK=")
            .or_else(|| kv.strip_prefix("OMPI_COMM_WORLD_RANK="))?;
        v.parse().ok()
    })
}

/// The processes of `pids` that do not descend from `root` through parents within `pids`.
pub fn outside_tree(root: i32, pids: &[i32]) -> Vec<ProcStat> {
    let stats: std::collections::HashMap<i32, ProcStat> = pids
        .iter()
        .filter_map(|&p| stat(p).map(|s| (p, s)))
        .collect();
    stats
        .values()
        .filter(|s| {
            let mut cur = s.pid;
            // Bounded walk: a chain cannot be longer than the set.
            for _ in 0..=stats.len() {
                if cur == root {
                    return false;
                }
                match stats.get(&cur) {
                    Some(st) => cur = st.ppid,
                    None => return true,
                }
            }
            true
        })
        .cloned()
        .collect()
}

/// Access a process has to a file it holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Access {
    /// Reads it (a descriptor open for reading, a readable mapping, a listed directory).
    pub read: bool,
    /// Writes it (a descriptor open for writing, a shared writable mapping).
    pub write: bool,
    /// Looks names up in it (the working directory).
    pub search: bool,
}

/// A file a process holds by a path.
#[derive(Debug, Clone)]
pub struct Held {
    /// Its path as the kernel shows it.
    pub path: PathBuf,
    /// The `/proc` entry that reaches the held file itself (not whatever its path names now).
    pub handle: PathBuf,
    /// The held file's metadata.
    pub meta: fs::Metadata,
    /// What the process does with it.
    pub access: Access,
}

/// The files a process holds by a path (regular files, directories, devices, named pipes),
/// and how: its open descriptors (not `O_PATH` ones), its file mappings and its
/// working directory.
pub fn held_files(pid: i32) -> Vec<Held> {
    let mut out = Vec::new();
    let mut hold = |handle: PathBuf, access: Access| {
        let (Ok(meta), Ok(path)) = (fs::metadata(&handle), fs::read_link(&handle)) else {
            return;
        };
        // What a path reaches (files, directories, devices, named pipes); not sockets, pipes
        // or anonymous inodes (`socket:[…]`, `pipe:[…]`, `anon_inode:…`), which no one can
        // reopen by a path.
        if path.is_absolute() && !meta.file_type().is_socket() {
            out.push(Held {
                path,
                handle,
                meta,
                access,
            });
        }
    };
    if let Ok(rd) = fs::read_dir(format!("/proc/{pid}/fd")) {
        for ent in rd.flatten() {
            let fd = ent.file_name().to_string_lossy().into_owned();
            let flags = fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
                .ok()
                .and_then(|info| {
                    let v = info.lines().find_map(|l| l.strip_prefix("flags:"))?;
                    u32::from_str_radix(v.trim(), 8).ok()
                })
                .unwrap_or(0);
            if flags & libc::O_PATH as u32 != 0 {
                continue;
            }
            let mode = flags & libc::O_ACCMODE as u32;
            hold(
                ent.path(),
                Access {
                    read: mode != libc::O_WRONLY as u32,
                    write: mode != libc::O_RDONLY as u32,
                    search: false,
                },
            );
        }
    }
    if let Ok(text) = fs::read_to_string(format!("/proc/{pid}/maps")) {
        let mut seen = std::collections::HashSet::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(range), Some(perms), Some(path)) = (f.first(), f.get(1), f.get(5)) else {
                continue;
            };
            if !path.starts_with('/') || !seen.insert((*range).to_string()) {
                continue;
            }
            let p = perms.as_bytes();
            let shared_write = p.get(1) == Some(&b'w') && p.get(3) == Some(&b's');
            hold(
                PathBuf::from(format!("/proc/{pid}/map_files/{range}")),
                Access {
                    read: p.first() == Some(&b'r'),
                    write: shared_write,
                    search: false,
                },
            );
        }
    }
    hold(
        PathBuf::from(format!("/proc/{pid}/cwd")),
        Access {
            search: true,
            ..Access::default()
        },
    );
    out
}

/// Real uid of a process (from `/proc/<pid>/status`).
pub fn uid_of(pid: i32) -> Option<u32> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Why a process of a job that `owner` (not root) runs holds more than that user's rights, from
/// the text of its `/proc/<pid>/status`: uids other than the owner's (a set-user-ID program),
/// group ids that differ among themselves (a set-group-ID one), or capabilities permitted,
/// effective or ambient (a file-capability program, or one given them). None: it holds only
/// the owner's rights. Such a process would be dumped and restored with its privileges.
pub fn privilege_in_status(status: &str, owner: u32) -> Option<String> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    let ids = |name: &str| -> Vec<u32> {
        field(name)
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect()
    };
    let uids = ids("Uid:");
    if uids.is_empty() || uids.iter().any(|&u| u != owner) {
        return Some(format!(
            "runs with uids {uids:?}, not only the owner's {owner} (a set-user-ID program)"
        ));
    }
    let gids = ids("Gid:");
    if gids.windows(2).any(|w| w[0] != w[1]) {
        return Some(format!(
            "runs with group ids {gids:?} (a set-group-ID program)"
        ));
    }
    for cap in ["CapPrm:", "CapEff:", "CapAmb:"] {
        let v = field(cap).and_then(|v| u64::from_str_radix(v, 16).ok());
        match v {
            Some(0) => {}
            Some(bits) => {
                return Some(format!(
                    "holds capabilities ({} {bits:016x})",
                    cap.trim_end_matches(':')
                ))
            }
            None => return Some(format!("its {cap} cannot be read")),
        }
    }
    None
}

/// [`privilege_in_status`] of a live process; None also when it is gone.
pub fn privilege_of(pid: i32, owner: u32) -> Option<String> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    privilege_in_status(&status, owner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn named_unix_sockets_of_this_process_are_found_by_inode() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s");
        let _l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let me = std::process::id() as i32;
        let names = unix_socket_names(me);
        let ino = fd_paths(me)
            .iter()
            .filter_map(|l| socket_inode(l))
            .find(|i| names.get(i) == Some(&path));
        assert!(ino.is_some(), "{names:?}");
        assert_eq!(socket_inode(Path::new("socket:[42]")), Some(42));
        assert_eq!(socket_inode(Path::new("/tmp/socket:[42]")), None);
    }

    #[test]
    fn privileged_processes_are_told_apart_from_the_owners() {
        let plain = "Name:\tsleep\nUid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\n\
                     CapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\n\
                     CapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000000\n";
        assert_eq!(privilege_in_status(plain, 1000), None);
        let setuid = plain.replace("Uid:\t1000\t1000\t1000\t1000", "Uid:\t1000\t0\t0\t0");
        assert!(privilege_in_status(&setuid, 1000)
            .unwrap()
            .contains("set-user-ID"));
        let setgid = plain.replace("Gid:\t1000\t1000\t1000\t1000", "Gid:\t1000\t42\t42\t42");
        assert!(privilege_in_status(&setgid, 1000)
            .unwrap()
            .contains("set-group-ID"));
        let caps = plain.replace("CapPrm:\t0000000000000000", "CapPrm:\t0000000000003000");
        assert!(privilege_in_status(&caps, 1000).unwrap().contains("CapPrm"));
        let amb = plain.replace("CapAmb:\t0000000000000000", "CapAmb:\t0000000000000400");
        assert!(privilege_in_status(&amb, 1000).unwrap().contains("CapAmb"));
        assert!(privilege_in_status(plain, 1001).is_some(), "another user's");
    }

    #[test]
    fn reads_a_childs_environment_and_mapped_libraries() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("CKPT_IBQ_SOCKET", "/elsewhere/control.sock")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        // Until exec and the dynamic loader are done the child has the parent's image.
        let mut libc = false;
        for _ in 0..200 {
            libc = maps_file(pid, "libc.so.6");
            if libc {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let env = environ_var(pid, "CKPT_IBQ_SOCKET");
        let other = maps_file(pid, "libckpt_verbs.so");
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(env.as_deref(), Some("/elsewhere/control.sock"));
        assert_eq!(environ_var(pid, "CKPT_IBQ"), None, "whole names only");
        assert!(libc && !other);
    }

    #[test]
    fn reads_own_stat_and_open_files() {
        let me = std::process::id() as i32;
        let s = stat(me).unwrap();
        assert_eq!(s.pid, me);
        assert!(s.start_ticks > 0);
        assert!(rss_bytes(me) > 0);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.log");
        let mut f = fs::File::create(&p).unwrap();
        f.write_all(b"12345").unwrap();
        let open = files_open_for_write(me);
        assert!(
            open.iter().any(|(q, size)| q == &p && *size == 5),
            "{open:?}"
        );
        assert!(verbs_device(me).is_none());
        assert!(!pid_taken(i32::MAX - 1));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (accepted, _) = l.accept().unwrap();
        let (here, there) = (c.local_addr().unwrap(), c.peer_addr().unwrap());
        let tcp = tcp_endpoints(&[me]);
        assert!(tcp.ports.contains(&port), "own listening port found");
        // Both ends of the connection are this process's; the listener is none.
        assert!(
            tcp.connections.contains(&(here, there)) && tcp.connections.contains(&(there, here)),
            "{tcp:?}"
        );
        assert!(tcp.connections.iter().all(|(_, peer)| peer.port() != 0));
        drop((c, accepted));
        assert!(outside_tree(me, &[me]).is_empty());
        assert_eq!(uid_of(me), Some(nix::unistd::getuid().as_raw()));
        assert_eq!(uid_of(i32::MAX - 1), None);
        let held = held_files(me);
        let out_log = held
            .iter()
            .find(|h| h.path == p)
            .expect("the open output file is held");
        assert!(out_log.access.write && !out_log.access.read, "{out_log:?}");
        assert!(
            held.iter().any(|h| h.access.search && h.meta.is_dir()),
            "the working directory is held"
        );
        let exe = std::env::current_exe().unwrap();
        assert!(
            held.iter()
                .any(|h| h.path == exe && h.access.read && !h.access.write),
            "the mapped executable is held for reading"
        );
        assert!(local_addresses().iter().all(|a| !a.is_loopback()));
        let t = std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_millis(300)));
        assert!(!thread_ids(&[me]).is_empty(), "a running thread is listed");
        assert!(!thread_ids(&[me]).contains(&me), "the main thread is not");
        t.join().unwrap();
        assert_eq!(
            outside_tree(1, &[me]).len(),
            1,
            "not below PID 1's subtree within the set"
        );
    }

    #[test]
    fn finds_the_descriptor_open_on_a_path() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("held");
        let f = std::fs::File::create(&path).unwrap();
        let me = std::process::id() as i32;
        let p = path.to_str().unwrap();
        assert_eq!(fd_on(me, p), Some(f.as_raw_fd()));
        drop(f);
        assert_eq!(fd_on(me, p), None);
        assert_eq!(fd_on(me, RDMA_CM), None, "no RDMA connection manager here");
    }

    #[test]
    fn decodes_proc_net_addresses() {
        assert_eq!(
            proc_net_addr("0100007F"),
            Some("127.0.0.1".parse().unwrap())
        );
        assert_eq!(
            proc_net_addr("0264A80A"),
            Some("10.168.100.2".parse().unwrap())
        );
        assert_eq!(
            proc_net_addr("0000000000000000FFFF00000264A80A"),
            Some("10.168.100.2".parse().unwrap())
        );
        assert_eq!(
            proc_net_addr("000080FE000000000000000001000000"),
            Some("fe80::1".parse().unwrap())
        );
    }
}
