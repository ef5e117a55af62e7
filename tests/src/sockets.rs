//! What a process listens on, read from the kernel's own tables (`/proc/<pid>/fd` and
//! `/proc/<pid>/net/{tcp,tcp6,unix}`), so the security tests aim at every port a daemon really
//! opened instead of the ones its configuration names.
use std::collections::HashSet;

/// A socket a process listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listening {
    /// `ip:port` (an unspecified address as the kernel shows it: `0.0.0.0` or `::`).
    Tcp(std::net::SocketAddr),
    /// A Unix socket's path.
    Unix(String),
}

fn socket_inodes(pid: u32) -> HashSet<u64> {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return HashSet::new();
    };
    rd.flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            let s = l.to_string_lossy().into_owned();
            s.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

fn parse_tcp_addr(hex: &str) -> Option<std::net::SocketAddr> {
    let (ip, port) = hex.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip: std::net::IpAddr = match ip.len() {
        8 => {
            let v = u32::from_str_radix(ip, 16).ok()?;
            std::net::Ipv4Addr::from(v.to_le_bytes()).into()
        }
        32 => {
            let mut b = [0u8; 16];
            for (i, w) in (0..4).map(|i| &ip[i * 8..i * 8 + 8]).enumerate() {
                let v = u32::from_str_radix(w, 16).ok()?;
                b[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
            }
            std::net::Ipv6Addr::from(b).into()
        }
        _ => return None,
    };
    Some(std::net::SocketAddr::new(ip, port))
}

/// Every TCP and Unix socket `pid` listens on (in its own network namespace).
pub fn listening(pid: u32) -> Vec<Listening> {
    let inodes = socket_inodes(pid);
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address rem_address st ... inode (field 9); 0A is LISTEN.
            if f.len() > 9 && f[3] == "0A" && f[9].parse().is_ok_and(|i: u64| inodes.contains(&i)) {
                if let Some(a) = parse_tcp_addr(f[1]) {
                    out.push(Listening::Tcp(a));
                }
            }
        }
    }
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap_or_default();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // Num RefCount Protocol Flags Type St Inode Path; flag 0x10000 is "accepts connections".
        if f.len() > 7
            && u32::from_str_radix(f[3], 16).is_ok_and(|fl| fl & 0x10000 != 0)
            && f[6].parse().is_ok_and(|i: u64| inodes.contains(&i))
        {
            out.push(Listening::Unix(f[7].to_string()));
        }
    }
    out
}
