//! Test hosts on one machine: N network namespaces joined by a private bridge, each with one
//! veth and a private address, plus a coordinator in the root namespace reachable at the bridge
//! address. Each node also has its own UTS namespace, so its host name differs like a real
//! node's (MPI libraries tell nodes apart by host name, and Open MPI names its session files
//! after it). Agents run inside the namespaces, entered with `nsenter --net --uts` (never
//! `ip netns exec`, whose private mount namespace breaks CRIU). Everything is removed on drop,
//! also when a test fails. Traffic stays on this machine: the bridge has no uplink.
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// One test host.
#[derive(Debug, Clone)]
pub struct NodeNs {
    /// Node name (`n1`, ...), also the agent's node name.
    pub name: String,
    /// Namespace name under /run/netns.
    pub netns: String,
    /// Address of the node on the bridge (the one MPI jobs use).
    pub ip: String,
    /// A second address on the same link, where the node's agent listens (like a management
    /// network): the node stays reachable when a test removes `ip`.
    pub mgmt_ip: String,
    /// Host-side end of the node's veth (down = node unreachable).
    pub veth: String,
    /// The node's persistent UTS namespace (a bind mount); its host name is `netns`.
    pub uts: PathBuf,
}

/// Where the test hosts' UTS namespaces are bound.
const UTS_DIR: &str = "/run/ckpt-uts";

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A set of test hosts.
#[derive(Debug)]
pub struct Cluster {
    /// Bridge name.
    pub bridge: String,
    /// The bridge's address: the coordinator as the nodes see it.
    pub host_ip: String,
    /// The nodes.
    pub nodes: Vec<NodeNs>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

impl Cluster {
    /// Whether this machine can host namespaces (root, iproute2, nsenter).
    pub fn unavailable() -> Option<String> {
        for tool in ["ip", "nsenter", "unshare"] {
            let runs = Command::new(tool)
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if runs.is_err() {
                return Some(format!("needs {tool}"));
            }
        }
        None
    }

    /// Creates `n` nodes on a fresh bridge. Names and the /24 subnet are derived from this
    /// process's PID, so concurrent test runs do not collide.
    pub fn create(n: usize) -> Result<Self, String> {
        let tag = std::process::id() % 100_000;
        let subnet = format!("10.{}.{}", 100 + (tag / 250) % 100, tag % 250);
        let mut c = Cluster {
            bridge: format!("ckb{tag}"),
            host_ip: format!("{subnet}.254"),
            nodes: Vec::new(),
        };
        ip(&["link", "add", &c.bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", c.host_ip),
            "dev",
            &c.bridge,
        ])?;
        ip(&["link", "set", &c.bridge, "up"])?;
        for i in 1..=n {
            let node = NodeNs {
                name: format!("n{i}"),
                netns: format!("ckpt{tag}n{i}"),
                ip: format!("{subnet}.{i}"),
                mgmt_ip: format!("{subnet}.{}", 100 + i),
                veth: format!("ckv{tag}n{i}"),
                uts: PathBuf::from(UTS_DIR).join(format!("ckpt{tag}n{i}")),
            };
            let peer = format!("ckp{tag}n{i}");
            ip(&["netns", "add", &node.netns])?;
            c.nodes.push(node.clone());
            ip(&[
                "link", "add", &node.veth, "type", "veth", "peer", "name", &peer,
            ])?;
            ip(&["link", "set", &peer, "netns", &node.netns])?;
            ip(&["link", "set", &node.veth, "master", &c.bridge, "up"])?;
            let inns = |args: &[&str]| {
                let mut v = vec!["-n", node.netns.as_str()];
                v.extend_from_slice(args);
                ip(&v)
            };
            inns(&["link", "set", &peer, "name", "eth0"])?;
            // Removing the job address (the primary) must keep the agent's secondary one.
            run(
                "nsenter",
                &[
                    &format!("--net=/run/netns/{}", node.netns),
                    "sh",
                    "-c",
                    "for c in all eth0; do echo 1 > /proc/sys/net/ipv4/conf/$c/promote_secondaries; done",
                ],
            )?;
            inns(&["addr", "add", &format!("{}/24", node.ip), "dev", "eth0"])?;
            inns(&[
                "addr",
                "add",
                &format!("{}/24", node.mgmt_ip),
                "dev",
                "eth0",
            ])?;
            inns(&["link", "set", "eth0", "up"])?;
            inns(&["link", "set", "lo", "up"])?;
            std::fs::create_dir_all(UTS_DIR).map_err(|e| format!("{UTS_DIR}: {e}"))?;
            std::fs::File::create(&node.uts).map_err(|e| format!("{}: {e}", node.uts.display()))?;
            let uts = format!("--uts={}", node.uts.display());
            run("unshare", &[&uts, "hostname", &node.netns])?;
        }
        Ok(c)
    }

    /// A node by name.
    pub fn node(&self, name: &str) -> &NodeNs {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .expect("known node")
    }

    /// Takes a node's link down (unreachable) or up again.
    pub fn set_link(&self, name: &str, up: bool) {
        ip(&[
            "link",
            "set",
            &self.node(name).veth,
            if up { "up" } else { "down" },
        ])
        .expect("set link");
    }

    /// Removes a node's job address (`ip`), or puts it back.
    pub fn set_job_address(&self, name: &str, present: bool) {
        let n = self.node(name);
        ip(&[
            "-n",
            &n.netns,
            "addr",
            if present { "add" } else { "del" },
            &format!("{}/24", n.ip),
            "dev",
            "eth0",
        ])
        .expect("change address");
    }

    /// A command that runs `program` inside the node's network and UTS namespaces.
    pub fn command_in(&self, name: &str, program: &PathBuf) -> Command {
        let n = self.node(name);
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", n.netns))
            .arg(format!("--uts={}", n.uts.display()))
            .arg("--")
            .arg(program);
        c
    }
}

/// The network namespaces (by inode) some process of this machine is in.
pub(crate) fn namespaces_in_use() -> std::collections::HashSet<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| std::fs::metadata(e.path().join("ns/net")).ok())
                .map(|m| m.ino())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether the namespace named by `path` (under /run/netns) is one of `in_use`.
pub(crate) fn is_in_use(path: &std::path::Path, in_use: &std::collections::HashSet<u64>) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).is_ok_and(|m| in_use.contains(&m.ino()))
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Sandboxes of jobs (`ckpt-<node>-<job>`) an agent killed by the test left behind, no
        // process in them any more: another instance on this machine names its test hosts'
        // sandboxes the same way (n1, n2...), and one with a process in it is a live part.
        let in_use = namespaces_in_use();
        let sandboxes: Vec<String> = std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|e| {
                self.nodes.iter().any(|n| {
                    e.strip_prefix(&format!("ckpt-{}-", n.name))
                        .is_some_and(|job| job.bytes().all(|b| b.is_ascii_digit()))
                }) && !is_in_use(&std::path::Path::new("/run/netns").join(e), &in_use)
            })
            .collect();
        for s in sandboxes {
            let _ = ip(&["-n", &s, "link", "del", "eth0"]);
            let _ = ip(&["netns", "del", &s]);
        }
        for n in &self.nodes {
            let _ = ip(&["netns", "del", &n.netns]);
            let _ = ip(&["link", "del", &n.veth]);
            let _ = run("umount", &[&n.uts.display().to_string()]);
            let _ = std::fs::remove_file(&n.uts);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}
