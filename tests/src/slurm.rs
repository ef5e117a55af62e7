//! A real Slurm on the test hosts: munged with a fresh key, slurmctld in the root network
//! namespace (in a UTS namespace of its own named `head`, the controller's host name), and one
//! slurmd per test host in the host's network and UTS namespaces, with the host's name as its
//! node name. Two partitions over all hosts: `low` (the default) and `high`, whose jobs preempt
//! `low`'s by requeueing them. Every daemon is stopped by PID on drop.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::netns;

/// TCP ports of this Slurm (slurmd's in each host's own namespace).
const CTLD_PORT: u16 = 16817;
const SLURMD_PORT: u16 = 16818;

/// A running Slurm.
#[derive(Debug)]
pub struct Slurm {
    /// Its directory: configuration, state, logs, job output.
    pub dir: PathBuf,
    /// `slurm.conf`.
    pub conf: PathBuf,
    children: Vec<Child>,
    /// Slurm's node names, whose cgroup trees (`slurm_<node>`) are removed on drop.
    nodes: Vec<String>,
}

fn which(prog: &str) -> bool {
    ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .any(|d| Path::new(d).join(prog).is_file())
}

impl Slurm {
    /// Why Slurm cannot run here, if it cannot (its packages are installed by
    /// scripts/setup.sh).
    pub fn unavailable() -> Option<String> {
        for p in [
            "munged",
            "slurmctld",
            "slurmd",
            "sbatch",
            "scontrol",
            "squeue",
        ] {
            if !which(p) {
                return Some(format!(
                    "{p} not found (install slurmctld slurmd slurm-client munge: scripts/setup.sh)"
                ));
            }
        }
        None
    }

    /// Starts munged, slurmctld and a slurmd on every host of `cluster`, in `dir`; waits
    /// (bounded) until every node is idle.
    pub fn start(cluster: &netns::Cluster, dir: &Path) -> Result<Slurm, String> {
        Slurm::start_with(cluster, dir, "")
    }

    /// [`Slurm::start`] with `more` (lines of slurm.conf, e.g. `EpilogSlurmctld=...`).
    pub fn start_with(cluster: &netns::Cluster, dir: &Path, more: &str) -> Result<Slurm, String> {
        Slurm::start_configured(cluster, dir, more, "")
    }

    /// [`Slurm::start_with`], and `low` (words, e.g. `GraceTime=120`) added to the `low`
    /// partition's line.
    pub fn start_configured(
        cluster: &netns::Cluster,
        dir: &Path,
        more: &str,
        low: &str,
    ) -> Result<Slurm, String> {
        let dir = dir.to_path_buf();
        let munge = dir.join("munge");
        for d in [&munge, &dir.join("state"), &dir.join("log")] {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        let key: Vec<u8> = (0..1024).map(|_| rand_byte()).collect();
        std::fs::write(munge.join("munge.key"), key).map_err(|e| e.to_string())?;
        let run = |args: &[&str]| {
            Command::new(args[0])
                .args(&args[1..])
                .status()
                .map_err(|e| format!("{}: {e}", args[0]))
        };
        let m = munge.display().to_string();
        run(&["chown", "-R", "munge:munge", &m])?;
        run(&["chmod", "600", &format!("{m}/munge.key")])?;
        run(&["chmod", "755", &m])?;
        let mut s = Slurm {
            conf: dir.join("slurm.conf"),
            dir: dir.clone(),
            children: Vec::new(),
            nodes: cluster.nodes.iter().map(|n| n.name.clone()).collect(),
        };
        let log = |name: &str| -> Result<Stdio, String> {
            std::fs::File::create(dir.join("log").join(name))
                .map(Stdio::from)
                .map_err(|e| e.to_string())
        };
        let mut munged = Command::new("setpriv");
        munged
            .args(["--reuid=munge", "--regid=munge", "--init-groups", "munged"])
            .args(["--force", "--foreground"])
            .arg(format!("--socket={m}/munge.sock"))
            .arg(format!("--key-file={m}/munge.key"))
            .arg(format!("--log-file={m}/munged.log"))
            .arg(format!("--pid-file={m}/munged.pid"))
            .arg(format!("--seed-file={m}/seed"))
            .stdout(log("munged.out")?)
            .stderr(log("munged.err")?);
        s.spawn(munged)?;
        let socket = munge.join("munge.sock");
        wait_for(|| socket.exists(), "munged's socket")?;

        let mut nodes = String::new();
        for n in &cluster.nodes {
            nodes.push_str(&format!(
                "NodeName={} NodeAddr={} NodeHostname={} CPUs=2 RealMemory=1000 State=UNKNOWN\n",
                n.name, n.ip, n.netns
            ));
        }
        let names: Vec<&str> = cluster.nodes.iter().map(|n| n.name.as_str()).collect();
        let d = dir.display();
        // Slurm as sites run it: its jobs' processes tracked, confined and counted in cgroups
        // (v1 here; each slurmd of the test keeps its own tree, `slurm_<node>`), and an extern
        // step on every node of a job (`PrologFlags=contain`).
        std::fs::write(
            dir.join("cgroup.conf"),
            "CgroupPlugin=autodetect\nConstrainCores=yes\nConstrainRAMSpace=yes\n",
        )
        .map_err(|e| e.to_string())?;
        std::fs::write(
            &s.conf,
            format!(
                "ClusterName=ckpttest\nSlurmctldHost=head({host})\n\
                 SlurmctldPort={CTLD_PORT}\nSlurmdPort={SLURMD_PORT}\n\
                 AuthType=auth/munge\nAuthInfo=socket={m}/munge.sock\nCredType=cred/munge\n\
                 SlurmUser=root\nSlurmdUser=root\nStateSaveLocation={d}/state\n\
                 SlurmdSpoolDir={d}/spool/%n\nSlurmctldPidFile={d}/slurmctld.pid\n\
                 SlurmdPidFile={d}/slurmd.%n.pid\nSlurmctldLogFile={d}/log/slurmctld.log\n\
                 SlurmdLogFile={d}/log/slurmd.%n.log\nMailProg=/bin/true\n\
                 ProctrackType=proctrack/cgroup\nTaskPlugin=task/cgroup\nPrologFlags=contain\n\
                 JobAcctGatherType=jobacct_gather/linux\nJobAcctGatherFrequency=task=2\n\
                 SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 SchedulerType=sched/backfill\nSchedulerParameters=sched_interval=2,bf_interval=2\n\
                 JobRequeue=1\nReturnToService=2\nMpiDefault=none\nSwitchType=switch/none\n\
                 JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n\
                 PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE\nKillWait=60\n\
                 {more}{nodes}\
                 PartitionName=low Nodes={list} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 {low}\n\
                 PartitionName=high Nodes={list} MaxTime=INFINITE State=UP PriorityTier=10\n",
                host = cluster.host_ip,
                list = names.join(","),
            ),
        )
        .map_err(|e| e.to_string())?;
        let conf = s.conf.display().to_string();
        let mut ctld = Command::new("unshare");
        ctld.args(["--uts", "sh", "-c"])
            .arg(format!("hostname head && exec slurmctld -D -f {conf}"))
            .env("SLURM_CONF", &conf)
            .stdout(log("slurmctld.out")?)
            .stderr(log("slurmctld.err")?);
        s.spawn(ctld)?;
        for n in &cluster.nodes {
            std::fs::create_dir_all(dir.join("spool").join(&n.name)).map_err(|e| e.to_string())?;
            let mut slurmd = cluster.command_in(&n.name, &PathBuf::from("slurmd"));
            slurmd
                .args(["-D", "-N", &n.name, "-f", &conf])
                .env("SLURM_CONF", &conf)
                .stdout(log(&format!("slurmd-{}.out", n.name))?)
                .stderr(log(&format!("slurmd-{}.err", n.name))?);
            s.spawn(slurmd)?;
        }
        let all = cluster.nodes.len();
        wait_for(
            || {
                let out = s
                    .command("sinfo")
                    .args(["-h", "-p", "low", "-o", "%D %t"])
                    .output();
                out.is_ok_and(|o| {
                    String::from_utf8_lossy(&o.stdout).trim() == format!("{all} idle")
                })
            },
            "every slurmd to register idle",
        )
        .map_err(|e| format!("{e}: {}", s.logs()))?;
        Ok(s)
    }

    fn spawn(&mut self, mut cmd: Command) -> Result<(), String> {
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("{cmd:?}: {e}"))?;
        self.children.push(child);
        Ok(())
    }

    /// A Slurm command (`sbatch`, `scontrol`, ...) against this Slurm.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf).stdin(Stdio::null());
        c
    }

    /// What Slurm says of job `id` and its nodes, and the end of slurmctld's log: for the
    /// message of a test that waited for it in vain.
    pub fn explain(&self, id: u64) -> String {
        let run = |program: &str, args: &[&str]| {
            self.command(program)
                .args(args)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_else(|e| format!("{program}: {e}"))
        };
        let log = std::fs::read_to_string(self.dir.join("log/slurmctld.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        format!(
            "scontrol show job {id}:\n{}\nsinfo:\n{}\nslurmctld.log (end):\n{}",
            run("scontrol", &["show", "job", &id.to_string()]),
            run("sinfo", &["-N", "-o", "%N %T %E"]),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    /// `sbatch ARGS`; the job id.
    pub fn sbatch(&self, args: &[&str]) -> Result<u64, String> {
        let out = self
            .command("sbatch")
            .arg("--parsable")
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim()
            .split(';')
            .next()
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| {
                format!(
                    "sbatch {args:?}: {text} {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })
    }

    /// A field of `scontrol show job ID` (e.g. `JobState`, `Restarts`).
    pub fn job_field(&self, id: u64, field: &str) -> String {
        let out = self
            .command("scontrol")
            .args(["show", "job", &id.to_string()])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        out.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{field}=")))
            .unwrap_or_default()
            .to_string()
    }

    /// Waits (bounded) until the job's state is `state`.
    #[track_caller]
    pub fn wait_job(&self, id: u64, state: &str, limit: Duration) {
        let begin = Instant::now();
        loop {
            let s = self.job_field(id, "JobState");
            if s == state {
                return;
            }
            assert!(
                begin.elapsed() < limit,
                "Slurm job {id} is {s:?} after {limit:?}, wanted {state}: {}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The processes Slurm's extern step of job `id` tracks on `node` (`scontrol listpids`, run
    /// on that node), with their command lines.
    pub fn extern_pids(&self, cluster: &netns::Cluster, node: &str, id: u64) -> Vec<(i32, String)> {
        let o = cluster
            .command_in(node, &std::path::PathBuf::from("scontrol"))
            .args(["listpids", &id.to_string()])
            .env("SLURM_CONF", &self.conf)
            .output()
            .expect("scontrol listpids");
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.split_whitespace().nth(2) == Some("extern"))
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .filter(|&p: &i32| p > 0)
            .map(|p| {
                let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                (p, String::from_utf8_lossy(&cmd).replace('\0', " "))
            })
            .collect()
    }

    /// Whether Slurm's extern step of job `id` on `node` tracks a process whose command line
    /// contains `what`; waits for it (bounded) and says what it saw if not.
    #[track_caller]
    pub fn tracks(&self, cluster: &netns::Cluster, node: &str, id: u64, what: &str) {
        let begin = Instant::now();
        loop {
            let seen = self.extern_pids(cluster, node, id);
            if seen.iter().any(|(_, cmd)| cmd.contains(what)) {
                return;
            }
            assert!(
                begin.elapsed() < Duration::from_secs(30),
                "Slurm's job {id} tracks no {what} on {node}: {seen:?}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The largest resident size (bytes) of a task of job `id`'s extern step, as `sstat` reports
    /// it from Slurm's accounting of the running job; 0 if it reports none.
    pub fn extern_max_rss(&self, id: u64) -> u64 {
        let begin = Instant::now();
        loop {
            let o = self
                .command("sstat")
                .args([
                    "-a",
                    "-n",
                    "-P",
                    "--noconvert",
                    "-o",
                    "JobID,MaxRSS,AveCPU",
                    "-j",
                ])
                .arg(id.to_string())
                .output()
                .expect("sstat");
            let text = String::from_utf8_lossy(&o.stdout).to_string();
            let rss = text
                .lines()
                .find(|l| l.starts_with(&format!("{id}.extern|")))
                .and_then(|l| l.split('|').nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            // Slurm samples every 2 s (JobAcctGatherFrequency): wait for a sample with the parts.
            if rss > ACCOUNTED || begin.elapsed() > Duration::from_secs(20) {
                println!("sstat of job {id}:\n{text}");
                return rss;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Runs Slurm's `program ARGS`, which must succeed.
    #[track_caller]
    pub fn run_ok(&self, program: &str, args: &[&str]) {
        let st = self.command(program).args(args).status().unwrap();
        assert!(st.success(), "{program} {args:?}: {st}");
    }

    /// The tails of the daemons' logs, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for f in ["slurmctld.log", "slurmctld.err"] {
            let text = std::fs::read_to_string(self.dir.join("log").join(f)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!(
                "\n--- {f}\n{}",
                lines[lines.len().saturating_sub(15)..].join("\n")
            ));
        }
        out
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        // Batch steps first (a batch script's `ckptctl run` waits for its job as long as ckptd
        // is unreachable), while slurmd can still end them.
        let _ = self
            .command("scancel")
            .args(["--full", "--signal=KILL", "--user=root"])
            .status();
        let begin = Instant::now();
        while begin.elapsed() < Duration::from_secs(10) {
            let out = self.command("squeue").args(["-h", "-t", "R,CG"]).output();
            if out.is_ok_and(|o| o.stdout.is_empty()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        // slurmd and slurmctld end their jobs' steps on SIGTERM; the unshare/nsenter wrappers
        // exec them, so these are the daemons' own PIDs.
        for c in self.children.iter_mut().rev() {
            // SAFETY: kill(2) on our own child's PID.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        for c in self.children.iter_mut().rev() {
            let begin = Instant::now();
            while begin.elapsed() < Duration::from_secs(10) {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        // Each slurmd's cgroup tree, in every hierarchy: the processes Slurm left there (a
        // job's slurmstepd outlives its slurmd) are killed first.
        let trees: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|h| {
                let h = h.path();
                self.nodes.iter().map(move |n| h.join(format!("slurm_{n}")))
            })
            .filter(|t| t.is_dir())
            .collect();
        let begin = Instant::now();
        while trees.iter().any(|t| kill_cgroup_tree(t) > 0)
            && begin.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        for t in &trees {
            remove_cgroup_tree(t);
        }
    }
}

/// SIGKILLs every process in a cgroup and its children (thawing frozen ones); how many it
/// found.
fn kill_cgroup_tree(dir: &Path) -> usize {
    let mut found = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            found += kill_cgroup_tree(&e.path());
        }
    }
    let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
    for pid in std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse::<i32>().ok())
    {
        found += 1;
        // SAFETY: kill(2) on a process of the test Slurm's own cgroup tree.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    found
}

/// Removes a cgroup directory and its children, deepest first; a cgroup still holding a
/// process stays.
fn remove_cgroup_tree(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup_tree(&e.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Whether agents here can put parts into Slurm jobs (a cgroup v1 freezer: adoption on cgroup
/// v2 is not built); says so when not.
pub fn adoption_here() -> bool {
    let here = std::path::Path::new("/sys/fs/cgroup/freezer/cgroup.procs").exists();
    if !here {
        eprintln!("SKIPPED (the checks of parts inside Slurm jobs): no cgroup v1 freezer here");
    }
    here
}

/// More resident memory than the extern step's own `sleep` has (about 1.5 MB).
pub const ACCOUNTED: u64 = 8 << 20;

fn wait_for(mut ok: impl FnMut() -> bool, what: &str) -> Result<(), String> {
    let begin = Instant::now();
    while !ok() {
        if begin.elapsed() > Duration::from_secs(30) {
            return Err(format!("no {what} after 30 s"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn rand_byte() -> u8 {
    let mut b = [0u8; 1];
    // SAFETY: getrandom(2) into a buffer we own.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), 1, 0) };
    b[0]
}
