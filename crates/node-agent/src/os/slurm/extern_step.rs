//! A Slurm job's extern step on this node: where its slurmstepd listens, the cgroups it keeps,
//! and how a process is adopted into it, as Slurm's own `pam_slurm_adopt` does for a login.
//!
//! slurmstepd listens on `<SlurmdSpoolDir>/<node>_<job>.4294967292` (the extern step's id) for
//! root and SlurmUser. A client sends its protocol version as a native `int` and reads the
//! step's back; each request is then an `int` code and its arguments. Two are used here, whose
//! codes are the same from Slurm 22.05 to 25.11: `REQUEST_STEP_LIST_PIDS` (15; the answer is a
//! `u32` count and that many `u32` pids) and `REQUEST_ADD_EXTERN_PID` (22, with a `pid_t`; the
//! answer is an `int`, 0 on success). An adopted pid is added to the step's process tracking
//! (its cgroups), its task containment (limits) and its accounting, so `scontrol listpids`,
//! `sstat` and `scancel` see it as they see the step's own processes.
//!
//! What the agent trusts: the peer of the socket must be root (slurmstepd; `SO_PEERCRED`), and
//! the step's cgroups are taken only from that slurmstepd's own child (its `sleep`), only if
//! every hierarchy's path ends in `uid_<owner>/job_<job>/step_extern` under one prefix. Slurm
//! 22.05 gives the job's user the step's directories: a path the user made
//! (`.../step_extern/x/step_extern`) or a process the user moved is not taken.
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The extern step's step id (`SLURM_EXTERN_CONT`).
const EXTERN_STEP: u32 = 0xffff_fffc;
/// `REQUEST_STEP_LIST_PIDS`.
const LIST_PIDS: i32 = 15;
/// `REQUEST_ADD_EXTERN_PID`.
const ADD_EXTERN_PID: i32 = 22;
/// The protocol version sent: Slurm 25.11's (22.05 is 38, each release one more). slurmstepd
/// accepts any version from its oldest supported one up (two releases back: 24.05 for 25.11),
/// with no upper bound, and the two requests above read no version.
const PROTOCOL_VERSION: i32 = 44 << 8;
/// How long slurmstepd may take to answer one request (it answers in microseconds).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a step just started may take to listen: squeue says RUNNING before slurmd has
/// started the extern step.
const LISTEN_WAIT: Duration = Duration::from_secs(10);
/// Where slurmd keeps its sockets when slurm.conf does not say.
const DEFAULT_SPOOL: &str = "/var/spool/slurmd";
/// Where Slurm reads its configuration when neither `[slurm] conf` nor `SLURM_CONF` says.
const DEFAULT_CONF: &str = "/etc/slurm/slurm.conf";
/// Most pids one answer may list (a step's processes on one node).
const MAX_PIDS: u32 = 1 << 16;

/// One Slurm job's extern step on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternStep {
    /// Slurm's job id.
    pub job: u64,
    socket: PathBuf,
}

/// The cgroups (v1) that hold an extern step's processes, one per hierarchy Slurm uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepCgroups {
    /// The freezer's: what Slurm lists, signals and accounts, and what ckpt freezes.
    pub freezer: PathBuf,
    /// The others (memory, cpuset, devices, ...): the limits.
    pub others: Vec<PathBuf>,
}

impl ExternStep {
    /// What went wrong talking to slurmstepd.
    fn said(&self, e: std::io::Error) -> String {
        match e.kind() {
            std::io::ErrorKind::UnexpectedEof => format!(
                "slurmstepd at {} closed the connection: Slurm job {} is ending",
                self.socket.display(),
                self.job
            ),
            _ => format!("slurmstepd at {}: {e}", self.socket.display()),
        }
    }

    /// The extern step of Slurm job `job` whose slurmstepd listens on `socket`.
    pub fn at(job: u64, socket: PathBuf) -> Self {
        ExternStep { job, socket }
    }

    /// Its slurmstepd's socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The extern step of Slurm job `job` on `node` (Slurm's name for this node), its socket
    /// found from slurm.conf's `SlurmdSpoolDir` (`conf`, else `SLURM_CONF`, else Slurm's
    /// default).
    pub fn locate(conf: Option<&Path>, node: &str, job: u64) -> Result<Self, String> {
        let conf = conf
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("SLURM_CONF").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CONF));
        let text = std::fs::read_to_string(&conf)
            .map_err(|e| format!("cannot read {}: {e}", conf.display()))?;
        let spool = spool_dir(&text, node, &host_name());
        let socket = spool.join(format!("{node}_{job}.{EXTERN_STEP}"));
        // sockaddr_un holds 108 bytes with the terminating NUL.
        if socket.as_os_str().len() >= 108 {
            return Err(format!(
                "slurmstepd's socket path {} is longer than a Unix socket path may be",
                socket.display()
            ));
        }
        Ok(ExternStep { job, socket })
    }

    /// A connection to the step's slurmstepd (root's, or it is refused), after the version
    /// handshake; and slurmstepd's pid.
    fn connect(&self) -> Result<(UnixStream, i32), String> {
        let begin = std::time::Instant::now();
        let mut s = loop {
            match UnixStream::connect(&self.socket) {
                Ok(s) => break s,
                Err(e)
                    if begin.elapsed() < LISTEN_WAIT
                        && matches!(
                            e.kind(),
                            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                        ) =>
                {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(format!(
                        "cannot reach Slurm job {}'s extern step at {} ({e}): slurm.conf needs PrologFlags=contain, which makes one on every node of a job, and the socket is in slurm.conf's SlurmdSpoolDir (set [slurm] conf if slurmd reads another slurm.conf)",
                        self.job,
                        self.socket.display()
                    ))
                }
            }
        };
        let peer = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
            .map_err(|e| format!("slurmstepd at {}: who is it? {e}", self.socket.display()))?;
        // Root's (the agent runs as root; its tests as whoever runs them).
        if peer.uid() != 0 && peer.uid() != nix::unistd::geteuid().as_raw() {
            return Err(format!(
                "{} is served by uid {}, not by root's slurmstepd",
                self.socket.display(),
                peer.uid()
            ));
        }
        s.set_read_timeout(Some(ANSWER_TIMEOUT))
            .map_err(|e| self.said(e))?;
        s.set_write_timeout(Some(ANSWER_TIMEOUT))
            .map_err(|e| self.said(e))?;
        s.write_all(&PROTOCOL_VERSION.to_ne_bytes())
            .map_err(|e| self.said(e))?;
        let theirs = read_i32(&mut s).map_err(|e| self.said(e))?;
        if theirs < 0 {
            return Err(format!(
                "slurmstepd at {} refused protocol version {}.{} (Slurm older than 22.05?)",
                self.socket.display(),
                PROTOCOL_VERSION >> 8,
                PROTOCOL_VERSION & 0xff
            ));
        }
        Ok((s, peer.pid()))
    }

    /// Adopts `pid` into the step: its cgroups, limits and accounting.
    pub fn adopt(&self, pid: i32) -> Result<(), String> {
        let (mut s, _) = self.connect()?;
        let mut req = ADD_EXTERN_PID.to_ne_bytes().to_vec();
        req.extend_from_slice(&pid.to_ne_bytes());
        s.write_all(&req).map_err(|e| self.said(e))?;
        match read_i32(&mut s).map_err(|e| self.said(e))? {
            0 => Ok(()),
            rc => Err(format!(
                "Slurm job {}'s extern step did not adopt pid {pid} (code {rc}; see slurmd's log)",
                self.job
            )),
        }
    }

    /// The pids the step tracks, and slurmstepd's own.
    pub fn pids(&self) -> Result<(Vec<i32>, i32), String> {
        let (mut s, stepd) = self.connect()?;
        s.write_all(&LIST_PIDS.to_ne_bytes())
            .map_err(|e| self.said(e))?;
        let n = read_i32(&mut s).map_err(|e| self.said(e))? as u32;
        if n > MAX_PIDS {
            return Err(format!(
                "slurmstepd at {} answered {n} pids",
                self.socket.display()
            ));
        }
        let mut raw = vec![0u8; n as usize * 4];
        s.read_exact(&mut raw).map_err(|e| self.said(e))?;
        let pids = raw
            .chunks_exact(4)
            .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok((pids, stepd))
    }

    /// The step's cgroups, from those of slurmstepd's own child in it (its `sleep`), for a part
    /// of uid `owner`.
    pub fn cgroups(&self, owner: u32) -> Result<StepCgroups, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let (pids, stepd) = self.pids()?;
        let suffix = format!("/uid_{owner}/job_{}/step_extern", self.job);
        for pid in pids {
            let slurms = || {
                crate::os::procfs::stat(pid)
                    .filter(|s| s.ppid == stepd)
                    .map(|s| s.start_ticks)
            };
            let Some(start) = slurms() else {
                continue; // not slurmstepd's own, or gone
            };
            let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
                continue;
            };
            // Still the same process, still slurmstepd's: what was read is its.
            if slurms() != Some(start) {
                continue;
            }
            if let Some(found) = step_cgroups(&text, &mountinfo, &suffix) {
                return Ok(found);
            }
        }
        Err(format!(
            "Slurm job {}'s extern step has no cgroup v1 freezer of its own on this node (ending in {suffix}): slurm.conf needs ProctrackType=proctrack/cgroup, on cgroup v1; or set [slurm] adopt = false in agent.toml to run parts beside the Slurm job",
            self.job
        ))
    }
}

fn read_i32(s: &mut UnixStream) -> std::io::Result<i32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(i32::from_ne_bytes(b))
}

fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .map(|h| h.split('.').next().unwrap_or_default().to_string())
        .unwrap_or_default()
}

/// slurm.conf's `SlurmdSpoolDir` with `%n` (the node) and `%h` (the host) expanded; Slurm's
/// default if it is not set. Keys are case-insensitive; `#` starts a comment.
fn spool_dir(conf: &str, node: &str, host: &str) -> PathBuf {
    let set = conf.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or_default().trim();
        let (k, v) = line.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("SlurmdSpoolDir")
            .then(|| v.trim().to_string())
    });
    let dir = set.unwrap_or_else(|| DEFAULT_SPOOL.into());
    PathBuf::from(dir.replace("%n", node).replace("%h", host))
}

/// The cgroup v1 directories of a step's process (`/proc/PID/cgroup`) whose path ends in
/// `suffix` (`/uid_U/job_J/step_extern`) under one prefix in every hierarchy: the freezer's,
/// and every other hierarchy's cgroup of the same step.
fn step_cgroups(proc_cgroup: &str, mountinfo: &str, suffix: &str) -> Option<StepCgroups> {
    let mut freezer = None;
    let mut others = Vec::new();
    let mut prefix: Option<&str> = None;
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let Some(here) = path.strip_suffix(suffix) else {
            continue; // cgroup v2's line, or a hierarchy the step does not use
        };
        if controllers.is_empty() || here.contains("/step_") || *prefix.get_or_insert(here) != here
        {
            return None; // not where Slurm makes a step's cgroups
        }
        let Some(mount) = crate::os::cgroup::v1_mount(mountinfo, controllers) else {
            continue;
        };
        let dir = mount.join(path.trim_start_matches('/'));
        if controllers.split(',').any(|c| c == "freezer") {
            freezer = Some(dir);
        } else {
            others.push(dir);
        }
    }
    Some(StepCgroups {
        freezer: freezer?,
        others,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUFFIX: &str = "/uid_0/job_7/step_extern";

    const MOUNTINFO: &str = "\
30 25 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/systemd rw shared:10 - cgroup cgroup rw,xattr,name=systemd
33 30 0:29 / /sys/fs/cgroup/freezer rw shared:14 - cgroup cgroup rw,freezer
34 30 0:30 / /sys/fs/cgroup/memory rw shared:15 - cgroup cgroup rw,memory
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw shared:16 - cgroup cgroup rw,cpu,cpuacct
36 30 0:32 / /sys/fs/cgroup/cpuset rw shared:17 - cgroup cgroup rw,cpuset
";

    #[test]
    fn the_spool_dir_comes_from_slurm_conf_expanded_else_slurms_default() {
        let conf = "# SlurmdSpoolDir=/nope\nClusterName=c\nslurmdspooldir = /var/spool/slurm/%n-%h # per node\n";
        assert_eq!(
            spool_dir(conf, "n7", "host7"),
            Path::new("/var/spool/slurm/n7-host7")
        );
        assert_eq!(
            spool_dir("ClusterName=c\n", "n7", "h"),
            Path::new(DEFAULT_SPOOL)
        );
    }

    #[test]
    fn a_steps_cgroups_are_its_processs_step_extern_dirs_freezer_apart() {
        let proc_cgroup = "\
9:name=systemd:/
6:freezer:/slurm_n1/uid_0/job_7/step_extern
5:cpu,cpuacct:/
4:memory:/slurm_n1/uid_0/job_7/step_extern
3:cpuset:/slurm_n1/uid_0/job_7/step_extern
0::/
";
        let c = step_cgroups(proc_cgroup, MOUNTINFO, SUFFIX).unwrap();
        assert_eq!(
            c.freezer,
            Path::new("/sys/fs/cgroup/freezer/slurm_n1/uid_0/job_7/step_extern")
        );
        assert_eq!(
            c.others,
            vec![
                PathBuf::from("/sys/fs/cgroup/memory/slurm_n1/uid_0/job_7/step_extern"),
                PathBuf::from("/sys/fs/cgroup/cpuset/slurm_n1/uid_0/job_7/step_extern"),
            ]
        );
        // Each hierarchy at its own mount, not the first cgroup mount listed.
        let split = MOUNTINFO.replace(
            "/sys/fs/cgroup/cpu,cpuacct rw shared:16 - cgroup cgroup rw,cpu,cpuacct",
            "/sys/fs/cgroup/cpu rw shared:16 - cgroup cgroup rw,cpu",
        );
        let c = step_cgroups("6:freezer:/slurm/uid_0/job_7/step_extern\n", &split, SUFFIX).unwrap();
        assert_eq!(
            c.freezer,
            Path::new("/sys/fs/cgroup/freezer/slurm/uid_0/job_7/step_extern")
        );
        // A process of a batch step, or one outside Slurm, gives none.
        let none = |c: &str| step_cgroups(c, MOUNTINFO, SUFFIX).is_none();
        assert!(none("6:freezer:/slurm_n1/uid_0/job_7/step_batch\n"));
        assert!(none("6:freezer:/\n0::/\n"));
        // Nor one the job's user put elsewhere: below the step, another job's or user's, or
        // another prefix in one hierarchy.
        assert!(none(
            "6:freezer:/slurm_n1/uid_0/job_7/step_extern/x/uid_0/job_7/step_extern\n"
        ));
        assert!(none("6:freezer:/slurm_n1/uid_0/job_8/step_extern\n"));
        assert!(none("6:freezer:/slurm_n1/uid_5/job_7/step_extern\n"));
        assert!(none(
            "6:freezer:/slurm_n1/uid_0/job_7/step_extern\n4:memory:/other/uid_0/job_7/step_extern\n"
        ));
    }

    /// A listener that answers as slurmstepd does: the version, then one request.
    fn stepd(dir: &Path, answer: Vec<u8>) -> (ExternStep, std::thread::JoinHandle<Vec<u8>>) {
        let socket = dir.join(format!("n1_5.{EXTERN_STEP}"));
        let l = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut v = [0u8; 4];
            s.read_exact(&mut v).unwrap();
            s.write_all(&(39i32 << 8).to_ne_bytes()).unwrap();
            let mut req = vec![0u8; 4];
            s.read_exact(&mut req).unwrap();
            if i32::from_ne_bytes(req[..4].try_into().unwrap()) == ADD_EXTERN_PID {
                let mut pid = [0u8; 4];
                s.read_exact(&mut pid).unwrap();
                req.extend_from_slice(&pid);
            }
            s.write_all(&answer).unwrap();
            let mut all = v.to_vec();
            all.extend(req);
            all
        });
        (ExternStep { job: 5, socket }, t)
    }

    #[test]
    fn adopting_sends_the_version_then_the_request_and_reads_the_code() {
        let d = tempfile::tempdir().unwrap();
        let (step, t) = stepd(d.path(), 0i32.to_ne_bytes().to_vec());
        step.adopt(4242).unwrap();
        let sent = t.join().unwrap();
        let ints: Vec<i32> = sent
            .chunks(4)
            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(ints, vec![PROTOCOL_VERSION, ADD_EXTERN_PID, 4242]);

        let d = tempfile::tempdir().unwrap();
        let (step, t) = stepd(d.path(), (-1i32).to_ne_bytes().to_vec());
        let e = step.adopt(1).unwrap_err();
        assert!(e.contains("did not adopt pid 1"), "{e}");
        t.join().unwrap();

        // A slurmstepd that refuses the version.
        let d = tempfile::tempdir().unwrap();
        let socket = d.path().join(format!("n1_5.{EXTERN_STEP}"));
        let l = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut v = [0u8; 4];
            s.read_exact(&mut v).unwrap();
            s.write_all(&(-1i32).to_ne_bytes()).unwrap();
        });
        let e = ExternStep { job: 5, socket }.adopt(1).unwrap_err();
        assert!(e.contains("refused protocol version 44.0"), "{e}");
        t.join().unwrap();

        let missing = ExternStep {
            job: 5,
            socket: d.path().join("n1_6.4294967292"),
        };
        let e = missing.adopt(1).unwrap_err();
        assert!(e.contains("PrologFlags=contain"), "{e}");
    }

    #[test]
    fn listing_reads_a_count_then_the_pids() {
        let d = tempfile::tempdir().unwrap();
        let mut answer = 2u32.to_ne_bytes().to_vec();
        answer.extend(77u32.to_ne_bytes());
        answer.extend(78u32.to_ne_bytes());
        let (step, t) = stepd(d.path(), answer);
        let (pids, stepd) = step.pids().unwrap();
        assert_eq!(pids, vec![77, 78]);
        assert_eq!(
            stepd,
            std::process::id() as i32,
            "the listener's pid, from the socket"
        );
        t.join().unwrap();
    }
}
