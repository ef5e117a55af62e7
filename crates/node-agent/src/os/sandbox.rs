//! Job sandboxes: each part of a job that ckptd gave a job address runs in its own PID, IPC, UTS
//! and mount namespaces (made by the shim, with `ckpt-init` as process 1) and in a network namespace
//! the agent makes here, whose one interface (`eth0`, a macvlan on the node's job-network
//! interface) carries the job address and a MAC address derived from it.
//!
//! Nothing of the part's network identity belongs to the node: a restore, on this node or any
//! other, makes a fresh namespace with the same address and MAC and gives it to the engine,
//! which restores the part's connections into it. The namespace is named after the node and the
//! job (`/run/netns/ckpt-<node>-<job>`) and removed when the part ends.
pub(crate) mod job_dir;
pub(crate) mod mounts;

use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use job_dir::{JOB_DIR, JOB_DIR_KEY};

/// The key under which the engine is given the part's network namespace.
pub const NETNS_KEY: &str = "ckpt-job-net";
/// The interface name inside the sandbox.
pub const JOB_INTERFACE: &str = "eth0";
const NETNS_DIR: &str = "/run/netns";

/// A part's address on the job network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobAddress {
    /// The address.
    pub address: IpAddr,
    /// Its prefix length on the job network.
    pub prefix: u8,
    /// The job network's gateway, if it has one.
    #[serde(default)]
    pub gateway: Option<IpAddr>,
}

impl JobAddress {
    /// Parses `ADDR/PREFIX` and an optional gateway, as ckptd sends them and manifests keep them.
    pub fn parse(cidr: &str, gateway: &str) -> Result<Self, String> {
        let (a, p) = cidr
            .split_once('/')
            .ok_or_else(|| format!("job address {cidr:?} is not ADDRESS/PREFIX"))?;
        let address: IpAddr = a
            .parse()
            .map_err(|_| format!("job address {cidr:?}: {a:?} is not an IP address"))?;
        let max = if address.is_ipv4() { 32 } else { 128 };
        let prefix: u8 = p
            .parse()
            .ok()
            .filter(|&n: &u8| (1..=max).contains(&n))
            .ok_or_else(|| format!("job address {cidr:?}: bad prefix length {p:?}"))?;
        if address.is_loopback() || address.is_unspecified() || address.is_multicast() {
            return Err(format!(
                "job address {cidr:?} is not a unicast address of a network"
            ));
        }
        let gateway = match gateway.trim() {
            "" => None,
            g => Some(
                g.parse()
                    .map_err(|_| format!("job network gateway {g:?} is not an IP address"))?,
            ),
        };
        Ok(JobAddress {
            address,
            prefix,
            gateway,
        })
    }

    /// `ADDR/PREFIX`.
    pub fn cidr(&self) -> String {
        format!("{}/{}", self.address, self.prefix)
    }

    /// A locally administered unicast MAC derived from the address, so that the part keeps it
    /// wherever it runs (peers' neighbour caches stay right; switches relearn the port).
    pub fn mac(&self) -> String {
        let o = match self.address {
            IpAddr::V4(a) => a.octets(),
            IpAddr::V6(a) => {
                let b = a.octets();
                [b[12], b[13], b[14], b[15]]
            }
        };
        format!("02:c7:{:02x}:{:02x}:{:02x}:{:02x}", o[0], o[1], o[2], o[3])
    }
}

/// The network namespace of a job's part on a node.
pub fn netns_path(node: &str, job: u64) -> PathBuf {
    let node: String = node
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    PathBuf::from(NETNS_DIR).join(format!("ckpt-{node}-{job}"))
}

/// Runs `program args` (with `stdin`); the error is its message.
pub(crate) async fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<(), String> {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {program} (is it installed?): {e}"))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .await
            .map_err(|e| format!("{program}: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}`: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The interface that carries `ip` on this node, or else that of the default route.
pub fn interface_for(ip: Option<IpAddr>) -> Option<String> {
    let text = |args: &[&str]| {
        std::process::Command::new("ip")
            .args(args)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    if let Some(ip) = ip.filter(|i| !i.is_unspecified() && !i.is_loopback()) {
        // `2: eth0    inet 10.1.2.3/24 brd ... scope global eth0`
        let found = text(&["-o", "addr", "show"])?.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            let dev = w.nth(1)?;
            let _family = w.next()?;
            let addr = w.next()?.split('/').next()?;
            (addr.parse::<IpAddr>().ok()? == ip).then(|| dev.trim_end_matches(':').to_string())
        });
        if found.is_some() {
            return found;
        }
    }
    // `default via 10.1.2.254 dev eth0 ...`
    let routes = text(&["-o", "route", "show", "default"])?;
    let mut w = routes.split_whitespace();
    w.find(|&t| t == "dev")?;
    w.next().map(str::to_string)
}

/// Makes the part's network namespace: a macvlan of `link` named `eth0` inside, with the job
/// address, its MAC and the gateway as default route; loopback up. A namespace left from an
/// earlier incarnation is removed first.
pub async fn create(
    node: &str,
    job: u64,
    link: &str,
    addr: &JobAddress,
) -> Result<PathBuf, String> {
    let path = netns_path(node, job);
    remove(&path).await;
    let name = path
        .file_name()
        .expect("named")
        .to_string_lossy()
        .into_owned();
    let tmp = format!("ckj{job}");
    let tmp = &tmp[..tmp.len().min(15)];
    let _ = run("ip", &["link", "del", tmp], None).await;
    // The interface of a namespace just deleted (a part killed a moment ago) holds the
    // address until the kernel has finished tearing the namespace down, asynchronously:
    // bounded retries while the address is in use.
    let begin = std::time::Instant::now();
    loop {
        let made = attempt(&name, tmp, link, addr).await;
        match made {
            Ok(()) => return Ok(path),
            Err(e) => {
                let _ = run("ip", &["link", "del", tmp], None).await;
                remove(&path).await;
                if transient(&e) && begin.elapsed() < ADDRESS_RELEASE {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    continue;
                }
                return Err(format!(
                    "cannot give the part its job address {} on interface {link}: {e}",
                    addr.cidr()
                ));
            }
        }
    }
}

/// Whether a failed [`attempt`] may succeed when tried again: the address is still held by a
/// namespace being torn down, or another `ip netns add` on this host (another agent's, on a
/// test host) was making `/run/netns` a mount point at the same moment and hid the new file.
fn transient(e: &str) -> bool {
    e.contains("Address already in use")
        || (e.contains("/run/netns/") && e.contains("No such file or directory"))
}

/// How long a job address may stay held by a namespace being torn down.
const ADDRESS_RELEASE: std::time::Duration = std::time::Duration::from_secs(10);

/// One try of [`create`]: the namespace `name` with the macvlan `tmp` of `link` as
/// [`JOB_INTERFACE`].
async fn attempt(name: &str, tmp: &str, link: &str, addr: &JobAddress) -> Result<(), String> {
    {
        run("ip", &["netns", "add", name], None).await?;
        run(
            "ip",
            &[
                "link",
                "add",
                tmp,
                "link",
                link,
                "address",
                &addr.mac(),
                "type",
                "macvlan",
                "mode",
                "bridge",
            ],
            None,
        )
        .await?;
        run("ip", &["link", "set", tmp, "netns", name], None).await?;
        let inns = |args: &[&str]| {
            let mut v = vec!["-n", name];
            v.extend_from_slice(args);
            v.iter().map(|s| s.to_string()).collect::<Vec<String>>()
        };
        for args in [
            inns(&["link", "set", tmp, "name", JOB_INTERFACE]),
            inns(&["addr", "add", &addr.cidr(), "dev", JOB_INTERFACE]),
            inns(&["link", "set", JOB_INTERFACE, "up"]),
            inns(&["link", "set", "lo", "up"]),
        ] {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            run("ip", &a, None).await?;
        }
        if let Some(gw) = addr.gateway {
            let gw = gw.to_string();
            let a = inns(&["route", "add", "default", "via", &gw]);
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            run("ip", &a, None).await?;
        }
        Ok::<(), String>(())
    }
}

/// Removes a part's network namespace (its interface and address go with the last process in
/// it). Nothing happens if there is none.
pub async fn remove(path: &std::path::Path) {
    if !path.exists() {
        return;
    }
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    // The job interface goes first: sockets of killed processes that still wait for a peer
    // (a lost node never answers their FIN) keep the namespace alive for minutes after its
    // name is gone, and with it an interface holding the part's MAC address, which a restart
    // needs again.
    let _ = run("ip", &["-n", &name, "link", "del", JOB_INTERFACE], None).await;
    if run("ip", &["netns", "del", &name], None).await.is_err() {
        // `ip netns del` refuses a name it did not make: unmount and unlink it directly.
        if let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) {
            // SAFETY: umount2 on a valid C string.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_file(path);
    }
}

const HOLD_TABLE: &str = "ckpt_hold";

/// Drops every TCP packet on the sandbox's job interface until [`release`]: restored
/// connections then exchange nothing (and reset nothing) before every part is restored.
/// Traffic inside the part (loopback) is not held.
pub async fn hold(netns: &std::path::Path) -> Result<(), String> {
    let script = format!(
        "table inet {HOLD_TABLE} {{\n\
         chain input {{ type filter hook input priority -10; policy accept; iifname \"{JOB_INTERFACE}\" meta l4proto tcp drop; }}\n\
         chain output {{ type filter hook output priority -10; policy accept; oifname \"{JOB_INTERFACE}\" meta l4proto tcp drop; }}\n\
         }}\n"
    );
    let net = format!("--net={}", netns.display());
    run("nsenter", &[&net, "nft", "-f", "-"], Some(&script)).await
}

/// Ends the hold of [`hold`], if any.
pub async fn release(netns: &std::path::Path) {
    let net = format!("--net={}", netns.display());
    let _ = run(
        "nsenter",
        &[&net, "nft", "delete", "table", "inet", HOLD_TABLE],
        None,
    )
    .await;
}

/// The inode of a process's network namespace (how the engine names it in its images).
pub fn netns_inode(pid: i32) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .ok()
        .map(|m| m.ino())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_namespace_file_hidden_by_a_concurrent_netns_add_is_tried_again() {
        let raced = "`ip netns add ckpt-n3-1`: Bind /proc/self/ns/net -> /run/netns/ckpt-n3-1 failed: No such file or directory";
        assert!(super::transient(raced));
        assert!(super::transient(
            "RTNETLINK answers: Address already in use"
        ));
        assert!(!super::transient("`ip netns add x`: Permission denied"));
    }

    use super::*;

    #[test]
    fn job_addresses_parse_and_keep_their_mac() {
        let a = JobAddress::parse("10.1.2.150/24", "10.1.2.254").unwrap();
        assert_eq!(a.cidr(), "10.1.2.150/24");
        assert_eq!(a.mac(), "02:c7:0a:01:02:96");
        assert_eq!(a.gateway, Some("10.1.2.254".parse().unwrap()));
        assert_eq!(
            JobAddress::parse("10.1.2.150/24", "").unwrap().gateway,
            None
        );
        for bad in [
            "10.1.2.150",
            "10.1.2.150/33",
            "10.1.2.150/0",
            "x/24",
            "127.0.0.1/8",
            "0.0.0.0/8",
        ] {
            assert!(JobAddress::parse(bad, "").is_err(), "{bad}");
        }
        assert!(JobAddress::parse("10.1.2.150/24", "gw").is_err());
    }

    #[test]
    fn namespace_names_are_safe() {
        assert_eq!(netns_path("n1", 7), PathBuf::from("/run/netns/ckpt-n1-7"));
        assert_eq!(
            netns_path("../x y", 7),
            PathBuf::from("/run/netns/ckpt-___x_y-7")
        );
    }
}
