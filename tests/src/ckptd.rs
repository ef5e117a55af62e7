//! [`Ckptd`]: one coordinator and its agent (embedded, separate, or on test hosts), started
//! for a test in temporary directories and cleaned up by PID when dropped.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::ctl::wait_child;
use crate::*;

/// How long one ckptctl call may take before the test fails naming it. The longest a test
/// waits on (a restart or drain of several nodes) takes well under a minute.
const CTL_LIMIT: Duration = Duration::from_secs(300);

/// How to start a coordinator.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Run the agent as its own `ckpt-agent` process instead of embedded.
    pub separate_agent: bool,
    /// `[agent.criu] path` (default: auto).
    pub criu: Option<PathBuf>,
    /// Extra TOML appended to ckptd.toml (e.g. a `[deadlines]` table).
    pub extra_toml: String,
    /// Start the daemons with failpoints enabled (see [`Ckptd::set_failpoints`]).
    pub failpoints: bool,
    /// Start no agent: the test starts its own (e.g. in network namespaces), and ckptd listens
    /// on every address so that they can reach it.
    pub no_agent: bool,
    /// Put the embedded agent's `local_dir` on its own tmpfs of this size (e.g. `"96m"`), to
    /// fill it up.
    pub local_size: Option<String>,
    /// Give the agent a `shared_dir` on a file system of its own: an ext4 image of this size
    /// (e.g. `"512M"`) loop-mounted at `<dir>/shared`, standing in for the NFS mount.
    pub shared_size: Option<String>,
    /// Extra TOML for the agent's table (e.g. `"[agent.flush]\nbandwidth_mb = 5\n"`).
    pub agent_toml: String,
    /// `NOTIFY_SOCKET` for the daemons, as systemd sets it for a `Type=notify` unit.
    pub notify_socket: Option<PathBuf>,
    /// `WATCHDOG_USEC` for the daemons, as systemd sets it for a unit with `WatchdogSec=`.
    pub watchdog_usec: Option<u64>,
    /// Extra keys of the `[agent]` table itself (e.g. `"allow_root_jobs = false\nmin_uid = 500\n"`).
    /// Without `allow_root_jobs` among them, the harness allows root jobs (the tests run as root).
    pub agent_keys: String,
    /// Keep the registry in the etcd cluster these `[registry]` keys reach
    /// ([`crate::etcd::Etcd::registry_keys`]), under a prefix of this instance's own.
    pub etcd: Option<String>,
    /// With `etcd`: start a second ckptd, standing by ([`Ckptd::start_standby`] is called once
    /// the first serves). Agents and ckptctl are given both addresses and sockets.
    pub standby: bool,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// One coordinator and its agent, with everything they need in a temporary directory.
#[derive(Debug)]
pub struct Ckptd {
    /// Temporary directory.
    pub dir: tempfile::TempDir,
    /// Control socket.
    pub socket: PathBuf,
    /// Job cgroup prefix.
    pub prefix: String,
    /// Config file.
    pub config: PathBuf,
    opts: Options,
    daemon: Option<Child>,
    agent: Option<Child>,
    agent_port: u16,
    node_agents: Vec<(String, Child)>,
    coord_port: u16,
    /// The second ckptd (`standby`): its process, config, socket and port.
    standby: Option<Child>,
    standby_config: PathBuf,
    standby_socket: PathBuf,
    standby_port: u16,
    /// Where `ckptd.log` ended when ckptd last started: what its agents said before is not
    /// what they said to it.
    daemon_log_from: usize,
}

/// A TCP port free on loopback now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Ckptd {
    /// Starts a coordinator with `opts` and waits until its agent has registered.
    pub fn start(opts: Options) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("ckpt-e2e-")
            .tempdir()
            .expect("tempdir");
        let prefix = format!(
            "ckpt-t{}-{}-job-",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        );
        let socket = dir.path().join("ckptd.sock");
        let config = dir.path().join("ckptd.toml");
        let coord_port = free_port();
        let criu = opts
            .criu
            .as_ref()
            .map(|p| format!("path = \"{}\"\n", p.display()))
            .unwrap_or_default();
        let d = dir.path().display();
        let listen = if opts.no_agent {
            "0.0.0.0"
        } else {
            "127.0.0.1"
        };
        // Jobs of these tests run as root unless a test says otherwise in its agent table.
        let root_jobs = if opts.agent_keys.contains("allow_root_jobs") {
            opts.agent_keys.clone()
        } else {
            format!("allow_root_jobs = true\n{}", opts.agent_keys)
        };
        let text = format!(
            "listen = \"{listen}:{coord_port}\"\nsocket = \"{}\"\ndatabase = \"{d}/ckptd.redb\"\n\
             tls_dir = \"{d}/tls\"\n{}\n\
             [agent]\nnode_name = \"node0\"\nstate_dir = \"{d}/state\"\nlocal_dir = \"{d}/local\"\n\
             heartbeat_interval = \"200ms\"\ncoordinator = \"127.0.0.1:{coord_port}\"\n{root_jobs}\
             {shared}[agent.cgroup]\nprefix = \"{prefix}\"\n[agent.criu]\n{criu}{}",
            socket.display(),
            opts.extra_toml,
            opts.agent_toml,
            shared = if opts.shared_size.is_some() {
                format!("shared_dir = \"{d}/shared\"\n")
            } else {
                String::new()
            },
        );
        let text = match &opts.etcd {
            // A table of its own, before [agent].
            Some(etcd) => text.replacen(
                "\n[agent]\n",
                &format!(
                    "\n[registry]\nbackend = \"etcd\"\nprefix = \"/{prefix}/\"\n{etcd}[agent]\n"
                ),
                1,
            ),
            None => text,
        };
        std::fs::write(&config, &text).expect("write config");
        let standby_socket = dir.path().join("ckptd-b.sock");
        let standby_config = dir.path().join("ckptd-b.toml");
        let standby_port = free_port();
        if opts.standby {
            assert!(
                opts.etcd.is_some(),
                "a standby ckptd needs the etcd registry"
            );
            let b = text
                .replacen(
                    &format!("socket = \"{}\"", socket.display()),
                    &format!("socket = \"{}\"", standby_socket.display()),
                    1,
                )
                .replacen(
                    &format!(":{coord_port}\"\nsocket"),
                    &format!(":{standby_port}\"\nsocket"),
                    1,
                );
            std::fs::write(&standby_config, b).expect("write the standby's config");
        }
        if opts.separate_agent || opts.no_agent {
            // Agents on TCP: a cluster CA, as a site creates it (`ckptd ca init`); each agent is
            // enrolled when it starts. A standalone ckptd alone gets none and opens no TCP port.
            let out = Command::new(bin_dir().join("ckptd"))
                .args(["--config"])
                .arg(&config)
                .args(["ca", "init"])
                .output()
                .expect("run ckptd ca init");
            assert!(out.status.success(), "ckptd ca init: {out:?}");
        }
        if let Some(size) = &opts.local_size {
            let local = dir.path().join("local");
            std::fs::create_dir_all(&local).expect("local dir");
            let st = Command::new("mount")
                .args([
                    "-t",
                    "tmpfs",
                    "-o",
                    &format!("size={size},mode=0700"),
                    "ckpt-test",
                ])
                .arg(&local)
                .status()
                .expect("run mount");
            assert!(st.success(), "mount a {size} tmpfs on {}", local.display());
        }
        if let Some(size) = &opts.shared_size {
            mount_loop_ext4(dir.path(), size);
        }
        let mut me = Ckptd {
            dir,
            socket,
            prefix,
            config,
            opts,
            daemon: None,
            agent: None,
            agent_port: free_port(),
            node_agents: Vec::new(),
            coord_port,
            standby: None,
            standby_config,
            standby_socket,
            standby_port,
            daemon_log_from: 0,
        };
        me.start_daemon();
        if me.opts.no_agent {
            me.wait_agents(&[]);
            if me.opts.standby {
                me.start_standby();
            }
            return me;
        }
        if me.opts.separate_agent {
            me.start_agent();
        }
        me.wait_registered();
        me
    }

    fn log(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(name))
            .expect("log file")
    }

    /// The failpoint file the daemons read when started with `failpoints`.
    pub fn failpoint_file(&self) -> PathBuf {
        self.dir.path().join("failpoints")
    }

    /// Sets the failpoints (`phase=error`, `phase=delay:5s`, one per line; empty: none).
    pub fn set_failpoints(&self, text: &str) {
        std::fs::write(self.failpoint_file(), text).expect("write failpoints");
    }

    fn apply_env(&self, cmd: &mut Command) {
        if self.opts.failpoints {
            cmd.env("CKPT_FAILPOINTS", self.failpoint_file());
        }
        if let Some(s) = &self.opts.notify_socket {
            cmd.env("NOTIFY_SOCKET", s);
        }
        if let Some(u) = self.opts.watchdog_usec {
            cmd.env("WATCHDOG_USEC", u.to_string());
        }
    }

    /// Spawns a daemon's command `cmd` with the tests' environment (failpoints, `CKPT_LOG=info`),
    /// no standard input, and its output appended to the log file `log`; a failure to start
    /// panics with `what`.
    fn spawn_logged(&self, cmd: &mut Command, log: &str, what: &str) -> Child {
        self.apply_env(cmd);
        cmd.env("CKPT_LOG", "info")
            .stdin(Stdio::null())
            .stdout(self.log(log))
            .stderr(self.log(log))
            .spawn()
            .expect(what)
    }

    /// Starts (or restarts) the ckptd process.
    pub fn start_daemon(&mut self) {
        let mut cmd = Command::new(bin_dir().join("ckptd"));
        cmd.arg("--config").arg(&self.config);
        if !self.opts.separate_agent {
            cmd.arg("--standalone");
        }
        self.daemon_log_from = std::fs::metadata(self.dir.path().join("ckptd.log"))
            .map(|m| m.len() as usize)
            .unwrap_or(0);
        self.daemon = Some(self.spawn_logged(&mut cmd, "ckptd.log", "start ckptd"));
    }

    /// Starts (or restarts) the second ckptd, which stands by while the first is active.
    pub fn start_standby(&mut self) {
        let mut cmd = Command::new(bin_dir().join("ckptd"));
        cmd.arg("--config").arg(&self.standby_config);
        if !self.opts.separate_agent {
            // As the first: its embedded agent (the same node0) starts once it is active.
            cmd.arg("--standalone");
        }
        self.standby = Some(self.spawn_logged(&mut cmd, "ckptd-b.log", "start the standby ckptd"));
    }

    /// What ckptctl is given: the control socket, or both with a standby.
    pub fn ctl_socket(&self) -> PathBuf {
        if self.opts.standby {
            format!(
                "{},{}",
                self.socket.display(),
                self.standby_socket.display()
            )
            .into()
        } else {
            self.socket.clone()
        }
    }

    /// SIGKILLs the first ckptd (`standby == false`) or the second, as a lost head node would
    /// stop it; returns whether it was running.
    pub fn kill_daemon_hard(&mut self, standby: bool) -> bool {
        let child = if standby {
            self.standby.take()
        } else {
            self.daemon.take()
        };
        match child {
            Some(mut c) => {
                let running = matches!(c.try_wait(), Ok(None));
                let _ = c.kill();
                let _ = c.wait();
                running
            }
            None => false,
        }
    }

    /// Sends `signal` to the first ckptd (`standby == false`) or the second: SIGSTOP stands for
    /// a head node that hangs, SIGCONT for one that comes back.
    pub fn signal_daemon(&self, standby: bool, signal: i32) {
        let child = if standby {
            self.standby.as_ref()
        } else {
            self.daemon.as_ref()
        };
        if let Some(c) = child {
            // SAFETY: kill(2) on our own child's PID.
            unsafe { libc::kill(c.id() as i32, signal) };
        }
    }

    /// The exit code of the first ckptd or the second, once it has exited.
    pub fn daemon_exit(&mut self, standby: bool) -> Option<i32> {
        let child = if standby {
            self.standby.as_mut()
        } else {
            self.daemon.as_mut()
        };
        child?.try_wait().ok().flatten().and_then(|st| st.code())
    }

    /// Starts (or restarts) the separate ckpt-agent process.
    pub fn start_agent(&mut self) {
        let agent_cfg = self.dir.path().join("agent.toml");
        // The agent reads the [agent] table of ckptd.toml as its own file.
        let text = std::fs::read_to_string(&self.config).unwrap();
        let table = text
            .split("[agent]\n")
            .nth(1)
            .unwrap()
            .replace("[agent.", "[");
        std::fs::write(
            &agent_cfg,
            format!(
                "listen = \"127.0.0.1:{}\"\ntls_dir = \"{}\"\n{table}",
                self.agent_port,
                self.dir.path().join("tls-node0").display()
            ),
        )
        .unwrap();
        self.enroll(&agent_cfg, "node0");
        let mut cmd = Command::new(bin_dir().join("ckpt-agent"));
        cmd.arg("--config").arg(&agent_cfg);
        self.agent = Some(self.spawn_logged(&mut cmd, "agent.log", "start ckpt-agent"));
    }

    /// Starts an agent for `node` inside its network namespace, with its own directories and
    /// cgroup prefix, pointed at this coordinator through the bridge.
    pub fn start_agent_in(&mut self, cluster: &netns::Cluster, node: &str) {
        self.start_agent_in_with(cluster, node, "");
    }

    /// [`Ckptd::start_agent_in`] with `tables` (TOML tables, e.g. `"[engines]\ndmtcp = \"off\"\n"`)
    /// appended to its agent.toml.
    pub fn start_agent_in_with(&mut self, cluster: &netns::Cluster, node: &str, tables: &str) {
        let n = cluster.node(node);
        let d = self.dir.path().join(node);
        std::fs::create_dir_all(&d).unwrap();
        let cfg = d.join("agent.toml");
        std::fs::write(
            &cfg,
            format!(
                "node_name = \"{node}\"\nlisten = \"{ip}:7601\"\ncoordinator = \"{coordinator}\"\n\
                 state_dir = \"{d}/state\"\nlocal_dir = \"{d}/local\"\nheartbeat_interval = \"200ms\"\n\
                 tls_dir = \"{d}/tls\"\nallow_root_jobs = true\n{shared}\
                 [cgroup]\nprefix = \"{prefix}{node}-\"\n{tables}",
                ip = n.mgmt_ip,
                coordinator = if self.opts.standby {
                    format!(
                        "{h}:{},{h}:{}",
                        self.coord_port,
                        self.standby_port,
                        h = cluster.host_ip
                    )
                } else {
                    format!("{}:{}", cluster.host_ip, self.coord_port)
                },
                d = d.display(),
                prefix = self.prefix,
                // One shared file system for every test host, as NFS would be.
                shared = if self.opts.shared_size.is_some() {
                    format!("shared_dir = \"{}/shared\"\n", self.dir.path().display())
                } else {
                    String::new()
                },
            ),
        )
        .unwrap();
        self.enroll(&cfg, node);
        let mut cmd = cluster.command_in(node, &bin_dir().join("ckpt-agent"));
        cmd.arg("--config").arg(&cfg);
        let log = format!("agent-{node}.log");
        let child = self.spawn_logged(&mut cmd, &log, "start ckpt-agent in namespace");
        self.node_agents.push((node.to_string(), child));
    }

    /// Enrolls the agent configured by `agent_cfg` as `node`, as an admin does:
    /// `ckptd ca issue NODE | ckpt-agent enroll -` (once per configuration).
    pub fn enroll(&self, agent_cfg: &Path, node: &str) {
        let text = std::fs::read_to_string(agent_cfg).expect("agent config");
        if text
            .lines()
            .find_map(|l| l.strip_prefix("tls_dir = \""))
            .map(|d| Path::new(d.trim_end_matches('"')).join("node.key").exists())
            .unwrap_or(false)
        {
            return;
        }
        let bundle = Command::new(bin_dir().join("ckptd"))
            .arg("--config")
            .arg(&self.config)
            .args(["ca", "issue", node])
            .output()
            .expect("run ckptd ca issue");
        assert!(bundle.status.success(), "ckptd ca issue {node}: {bundle:?}");
        let mut enroll = Command::new(bin_dir().join("ckpt-agent"))
            .arg("--config")
            .arg(agent_cfg)
            .args(["enroll", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run ckpt-agent enroll");
        use std::io::Write as _;
        enroll
            .stdin
            .take()
            .expect("stdin")
            .write_all(&bundle.stdout)
            .expect("write bundle");
        let out = enroll.wait_with_output().expect("ckpt-agent enroll");
        assert!(out.status.success(), "ckpt-agent enroll ({node}): {out:?}");
    }

    /// The daemons this test started, by name (`ckptd`, `agent`, or a namespace node's name),
    /// with their pids.
    pub fn daemon_pids(&self) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        if let Some(d) = &self.daemon {
            out.push(("ckptd".to_string(), d.id()));
        }
        if let Some(a) = &self.agent {
            out.push(("agent".to_string(), a.id()));
        }
        for (n, a) in &self.node_agents {
            out.push((n.clone(), a.id()));
        }
        out
    }

    /// Kills (SIGKILL) the agent of a namespace node, as a crash would.
    pub fn kill_agent_on(&mut self, node: &str) {
        if let Some(i) = self.node_agents.iter().position(|(n, _)| n == node) {
            let (_, mut a) = self.node_agents.remove(i);
            let _ = a.kill();
            let _ = a.wait();
        }
    }

    /// Stops (SIGSTOP) or continues (SIGCONT) the agent on a namespace node, as a node that
    /// is slow to answer.
    pub fn pause_agent_on(&self, node: &str, pause: bool) {
        if let Some((_, a)) = self.node_agents.iter().find(|(n, _)| n == node) {
            let sig = if pause { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: kill(2) on the PID of a child this harness started.
            unsafe { libc::kill(a.id() as i32, sig) };
        }
    }

    /// SIGKILLs every process of a job on the given namespace nodes and waits (bounded) until
    /// none is left.
    pub fn kill_job_on(&self, nodes: &[&str], job: u64) {
        let begin = Instant::now();
        loop {
            let pids: Vec<i32> = nodes
                .iter()
                .flat_map(|n| self.job_pids_on(n, job))
                .collect();
            if pids.is_empty() {
                return;
            }
            assert!(
                begin.elapsed() < Duration::from_secs(60),
                "job {job} survives SIGKILL: {pids:?}"
            );
            for p in pids {
                // SAFETY: kill(2) on a PID read from the job's own cgroup.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (bounded) until ckptd answers and every named node's agent registered with the
    /// ckptd running now (a registration with the one before a restart is not one).
    pub fn wait_agents(&mut self, nodes: &[&str]) {
        let begin = Instant::now();
        loop {
            let log = std::fs::read(self.dir.path().join("ckptd.log")).unwrap_or_default();
            let since =
                String::from_utf8_lossy(log.get(self.daemon_log_from..).unwrap_or_default());
            let log = String::from_utf8_lossy(&log);
            let registered = |n: &&str| {
                since
                    .lines()
                    .any(|l| l.contains("agent registered") && l.contains(&format!("\"{n}\"")))
            };
            if self.socket.exists() && nodes.iter().all(registered) && self.ctl(&["list"]).code == 0
            {
                return;
            }
            if let Some(Ok(Some(st))) = self.daemon.as_mut().map(|d| d.try_wait()) {
                panic!("ckptd exited ({st}): {log}");
            }
            assert!(
                begin.elapsed() < Duration::from_secs(30),
                "agents {nodes:?} did not all register: {log}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits (bounded by `limit`) until `ckptctl nodes` shows every one of `nodes` in `state`
    /// (`up`, `down`, ...).
    pub fn wait_nodes_in(&self, nodes: &[&str], state: &str, limit: Duration) {
        let begin = Instant::now();
        loop {
            let v: serde_json::Value =
                serde_json::from_str(self.ctl(&["nodes", "--json"]).ok().trim())
                    .expect("nodes --json");
            let listed = v["nodes"].as_array().expect("nodes");
            let is = |n: &&str| {
                listed
                    .iter()
                    .any(|x| x["name"] == *n && x["state"] == state)
            };
            if nodes.iter().all(is) {
                return;
            }
            assert!(begin.elapsed() < limit, "not all of {nodes:?} {state}: {v}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The directory of a job on a namespace node.
    pub fn job_dir_on(&self, node: &str, job: u64) -> PathBuf {
        self.dir
            .path()
            .join(node)
            .join("state/jobs")
            .join(job.to_string())
    }

    /// The last lines of a job's stdout and stderr on a namespace node, for failure messages.
    pub fn job_output_on(&self, node: &str, job: u64) -> String {
        output_tails(&self.job_dir_on(node, job), node)
    }

    /// The last lines of a job's stdout and stderr wherever it ran (the one node, or each
    /// namespace node that has its directory), for failure messages.
    pub fn job_output(&self, job: u64) -> String {
        let mut out = Vec::new();
        if self.job_dir(job).is_dir() {
            out.push(output_tails(&self.job_dir(job), "node"));
        }
        let nodes = std::fs::read_dir(self.dir.path())
            .into_iter()
            .flatten()
            .flatten();
        for node in nodes {
            let name = node.file_name().to_string_lossy().into_owned();
            if self.job_dir_on(&name, job).is_dir() {
                out.push(self.job_output_on(&name, job));
            }
        }
        out.join("\n")
    }

    /// The cgroup of a job on a namespace node.
    pub fn cgroup_on(&self, node: &str, job: u64) -> PathBuf {
        let parent = if Path::new("/sys/fs/cgroup/freezer/cgroup.procs").exists() {
            "/sys/fs/cgroup/freezer"
        } else {
            "/sys/fs/cgroup"
        };
        Path::new(parent).join(format!("{}{node}-{job}", self.prefix))
    }

    /// PIDs of a job on a namespace node.
    pub fn job_pids_on(&self, node: &str, job: u64) -> Vec<i32> {
        std::fs::read_to_string(self.cgroup_on(node, job).join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Waits (bounded) until ckptd answers and its agent (`node0`) has registered.
    pub fn wait_registered(&mut self) {
        self.wait_agents(&["node0"]);
    }

    /// Lets other users reach the control socket (the test's directory is private to root).
    pub fn open_to_users(&self) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(self.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// Runs ckptctl with `args` as another user (uid and gid), as `setpriv` would.
    pub fn ctl_as(&self, uid: u32, args: &[&str]) -> Ctl {
        let mut cmd = Command::new(bin_dir().join("ckptctl"));
        cmd.arg("--socket")
            .arg(self.ctl_socket())
            .args(args)
            .stdin(Stdio::null())
            .current_dir("/");
        as_user(&mut cmd, uid);
        Ctl::run(&mut cmd, CTL_LIMIT)
    }

    /// Runs ckptctl with `args`.
    pub fn ctl(&self, args: &[&str]) -> Ctl {
        Ctl::run(
            Command::new(bin_dir().join("ckptctl"))
                .arg("--socket")
                .arg(self.ctl_socket())
                .args(args)
                .stdin(Stdio::null()),
            CTL_LIMIT,
        )
    }

    /// Starts ckptctl in the background (for operations interrupted by the test).
    pub fn ctl_spawn(&self, args: &[&str]) -> Child {
        Command::new(bin_dir().join("ckptctl"))
            .arg("--socket")
            .arg(self.ctl_socket())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run ckptctl")
    }

    /// `ckptctl run -- argv`; returns the job id.
    pub fn run_job(&self, name: &str, argv: &[String]) -> u64 {
        let mut args = vec!["run", "--name", name, "--"];
        args.extend(argv.iter().map(String::as_str));
        let out = self.ctl(&args);
        out.ok()
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("run printed no job id: {out:?}"))
    }

    /// The job's `ckptctl status --json`.
    pub fn status(&self, job: u64) -> serde_json::Value {
        let out = self.ctl(&["status", &job.to_string(), "--json"]);
        serde_json::from_str(out.ok()).expect("status json")
    }

    /// The job's epochs (`ckptctl epochs --json`).
    pub fn epochs(&self, job: u64) -> Vec<serde_json::Value> {
        let out = self.ctl(&["epochs", &job.to_string(), "--json"]);
        serde_json::from_str::<serde_json::Value>(out.ok())
            .expect("epochs json")
            .as_array()
            .unwrap()
            .clone()
    }

    /// Waits (bounded) until the job's state starts with `prefix`; returns the state.
    #[track_caller]
    pub fn wait_state(&self, job: u64, prefix: &str, limit: Duration) -> String {
        let begin = Instant::now();
        loop {
            let s = self.status(job)["state"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if s.starts_with(prefix) {
                return s;
            }
            assert!(
                begin.elapsed() < limit,
                "job {job} still {s:?} after {limit:?}, wanted {prefix:?}\n{}",
                self.job_output(job)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Job directory on the (only) node.
    pub fn job_dir(&self, job: u64) -> PathBuf {
        self.dir.path().join("state/jobs").join(job.to_string())
    }

    /// The job's stdout so far.
    pub fn output(&self, job: u64) -> String {
        std::fs::read_to_string(self.job_dir(job).join("stdout")).unwrap_or_default()
    }

    /// Waits (bounded) until the job printed at least `n` progress lines.
    #[track_caller]
    pub fn wait_progress(&self, job: u64, n: usize, limit: Duration) {
        let begin = Instant::now();
        while self.output(job).matches("iter ").count() < n {
            assert!(
                begin.elapsed() < limit,
                "job {job} made no progress: {}",
                self.output(job)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Node-local image directory of an epoch.
    pub fn images(&self, job: u64, epoch: u32) -> PathBuf {
        self.dir
            .path()
            .join("local")
            .join(job.to_string())
            .join(epoch.to_string())
            .join("node0")
    }

    /// The job's cgroup directory.
    pub fn cgroup(&self, job: u64) -> PathBuf {
        let parent = if Path::new("/sys/fs/cgroup/freezer/cgroup.procs").exists() {
            "/sys/fs/cgroup/freezer"
        } else {
            "/sys/fs/cgroup"
        };
        Path::new(parent).join(format!("{}{job}", self.prefix))
    }

    /// PIDs in the job's cgroup.
    pub fn job_pids(&self, job: u64) -> Vec<i32> {
        std::fs::read_to_string(self.cgroup(job).join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// SIGKILLs every process of the job, as a node crash or an OOM kill would, until none is
    /// left (bounded).
    #[track_caller]
    pub fn kill_job(&self, job: u64) {
        let begin = Instant::now();
        loop {
            let pids = self.job_pids(job);
            if pids.is_empty() {
                return;
            }
            for p in pids {
                // SAFETY: kill(2) on a PID read from the job's own cgroup.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            assert!(
                begin.elapsed() < Duration::from_secs(30),
                "job {job} survives SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (bounded) until the job has finished and returns its checksum.
    #[track_caller]
    pub fn wait_checksum(&self, job: u64, limit: Duration) -> String {
        self.wait_state(job, "exited", limit);
        // How long the job took from its last output (its result) to its end (MPI_Finalize,
        // the launcher's teardown), printed when it is long: a slow end is every restart
        // test's cost.
        let quiet = std::fs::metadata(self.job_dir(job).join("stdout"))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok());
        if let Some(q) = quiet.filter(|q| *q > Duration::from_secs(2)) {
            eprintln!("job {job} exited about {q:.1?} after its last output");
        }
        checksum_in(&self.output(job))
            .unwrap_or_else(|| panic!("job {job} printed no checksum: {}", self.output(job)))
    }

    /// SIGKILLs the separate agent process.
    pub fn kill_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
    }

    /// Stops ckptd with SIGTERM (as systemd would) and waits for it.
    pub fn stop_daemon(&mut self) {
        for mut d in [self.daemon.take(), self.standby.take()]
            .into_iter()
            .flatten()
        {
            // SAFETY: kill(2) on our own child's PID.
            unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
            if !wait_child(&mut d, Duration::from_secs(10)) {
                let _ = d.kill();
                let _ = d.wait();
            }
        }
    }
}

impl Ckptd {
    /// The end of every daemon log of this instance, on stderr: a failed test shows why
    /// (`CKPT_KEEP_DIR=1` keeps the whole directory instead of removing it).
    fn print_log_tails(&mut self) {
        const LINES: usize = 40;
        let Ok(rd) = std::fs::read_dir(self.dir.path()) else {
            return;
        };
        let mut logs: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
            .collect();
        logs.sort();
        for log in logs {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LINES)..];
            eprintln!("---- last {} lines of {} ----", tail.len(), log.display());
            for l in tail {
                eprintln!("{l}");
            }
        }
        if std::env::var_os("CKPT_KEEP_DIR").is_some() {
            let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
            eprintln!("kept {}", dir.keep().display());
        }
    }
}

impl Drop for Ckptd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.print_log_tails();
        }
        self.stop_daemon();
        self.kill_agent();
        let nodes: Vec<String> = self.node_agents.iter().map(|(n, _)| n.clone()).collect();
        for (_, mut a) in self.node_agents.drain(..) {
            let _ = a.kill();
            let _ = a.wait();
        }
        // Kill what is left in this instance's job cgroups, by PID, then remove the cgroups.
        for parent in [
            "/sys/fs/cgroup/freezer",
            "/sys/fs/cgroup/unified",
            "/sys/fs/cgroup",
        ] {
            let Ok(rd) = std::fs::read_dir(parent) else {
                continue;
            };
            for e in rd.flatten() {
                if !e.file_name().to_string_lossy().starts_with(&self.prefix) {
                    continue;
                }
                let cg = e.path();
                let _ = std::fs::write(cg.join("freezer.state"), "THAWED");
                let _ = std::fs::write(cg.join("cgroup.freeze"), "0");
                for _ in 0..100 {
                    let pids: Vec<i32> = std::fs::read_to_string(cg.join("cgroup.procs"))
                        .unwrap_or_default()
                        .lines()
                        .filter_map(|l| l.trim().parse().ok())
                        .collect();
                    if pids.is_empty() {
                        break;
                    }
                    for p in pids {
                        // SAFETY: kill(2) on a PID read from this test's own cgroup.
                        unsafe { libc::kill(p, libc::SIGKILL) };
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = std::fs::remove_dir(&cg);
            }
        }
        // The sandboxes' network namespaces of this instance's test hosts (named
        // ckpt-<node>-<job>), which its killed agents could not remove: those no process is
        // in any more. Another instance on this machine names its test hosts' sandboxes the
        // same way (n1, n2...); one with a process in it is a live part of that instance's.
        if let Ok(rd) = std::fs::read_dir("/run/netns") {
            let in_use = crate::netns::namespaces_in_use();
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let ours = nodes.iter().any(|n| {
                    name.strip_prefix(&format!("ckpt-{n}-")).is_some_and(|job| {
                        !job.is_empty() && job.bytes().all(|b| b.is_ascii_digit())
                    })
                });
                if ours && !crate::netns::is_in_use(&e.path(), &in_use) {
                    let _ = Command::new("ip")
                        .args(["netns", "del", &name])
                        .stdin(Stdio::null())
                        .status();
                }
            }
        }
        if self.opts.local_size.is_some() {
            let _ = Command::new("umount")
                .arg(self.dir.path().join("local"))
                .status();
        }
        if self.opts.shared_size.is_some() {
            // The loop device was set up with autoclear: it goes with the unmount.
            let _ = Command::new("umount")
                .arg(self.dir.path().join("shared"))
                .status();
        }
        if std::env::var_os("CKPT_E2E_KEEP").is_some() {
            let p = self.dir.path().to_path_buf();
            eprintln!("keeping {}", p.display());
            std::mem::forget(std::mem::replace(
                &mut self.dir,
                tempfile::tempdir().unwrap(),
            ));
        }
    }
}

/// Makes an ext4 file system in `<dir>/shared.img` of `size` and loop-mounts it on
/// `<dir>/shared`.
fn mount_loop_ext4(dir: &Path, size: &str) {
    let img = dir.join("shared.img");
    let mnt = dir.join("shared");
    std::fs::create_dir_all(&mnt).expect("shared dir");
    let st = Command::new("truncate")
        .args(["-s", size])
        .arg(&img)
        .status()
        .expect("run truncate");
    assert!(st.success(), "truncate {}", img.display());
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "lazy_itable_init=0,nodiscard"])
        .arg(&img)
        .stdout(Stdio::null())
        .status()
        .expect("run mkfs.ext4");
    assert!(st.success(), "mkfs.ext4 {}", img.display());
    let st = Command::new("mount")
        .args(["-o", "loop"])
        .arg(&img)
        .arg(&mnt)
        .status()
        .expect("run mount");
    assert!(
        st.success(),
        "loop-mount {} on {}",
        img.display(),
        mnt.display()
    );
}

/// The last 20 lines of the stdout and stderr in a job directory, headed by `node`.
fn output_tails(dir: &Path, node: &str) -> String {
    ["stdout", "stderr"]
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(dir.join(f)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(20)..].join("\n");
            format!("--- {node} {f} (last 20 lines)\n{tail}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}
