//! Who may connect to the control socket: a connection's `SO_PEERCRED` places its process in a
//! job by its cgroup, and its uid must be that job's owner.
use std::path::{Path, PathBuf};

/// A job as the control socket needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobOwner {
    /// Job id.
    pub job: u64,
    /// The user the job's processes run as.
    pub uid: u32,
}

/// How [`Channels`] learns the node's jobs. The job table injects one at construction; a
/// closure `Fn(&Path) -> Option<JobOwner>` is one.
pub trait JobLookup: Send + Sync {
    /// The job whose cgroup is the directory `cgroup` (an absolute path, compared with the
    /// job's `JobCgroup::path`), if this node has one.
    fn job_in(&self, cgroup: &Path) -> Option<JobOwner>;
}

impl<F: Fn(&Path) -> Option<JobOwner> + Send + Sync> JobLookup for F {
    fn job_in(&self, cgroup: &Path) -> Option<JobOwner> {
        self(cgroup)
    }
}

/// Where a connecting process sits in the cgroup hierarchies: the OS side of [`authorize`].
/// [`ProcCgroups`] is the real one; a closure `Fn(i32) -> io::Result<Vec<PathBuf>>` is one.
pub trait PeerCgroups: Send + Sync {
    /// The cgroup directories (absolute paths) process `pid` is in.
    fn cgroups_of(&self, pid: i32) -> std::io::Result<Vec<PathBuf>>;
}

impl<F: Fn(i32) -> std::io::Result<Vec<PathBuf>> + Send + Sync> PeerCgroups for F {
    fn cgroups_of(&self, pid: i32) -> std::io::Result<Vec<PathBuf>> {
        self(pid)
    }
}

/// Reads `/proc/<pid>/cgroup` and places each entry under its hierarchy's mount point, from
/// this process's `/proc/self/mountinfo`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcCgroups;

impl PeerCgroups for ProcCgroups {
    fn cgroups_of(&self, pid: i32) -> std::io::Result<Vec<PathBuf>> {
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
        Ok(cgroup_dirs(&cgroups, &mounts))
    }
}

/// The directories of the cgroups listed in `proc_cgroup` (the text of a `/proc/<pid>/cgroup`),
/// under the cgroup mounts listed in `mountinfo` (of the reader's mount namespace). A v2 entry
/// (`0::/path`) goes under each `cgroup2` mount, a v1 entry (`N:freezer:/path`) under each
/// `cgroup` mount whose options name all its controllers. Entries outside a mount's root are
/// skipped.
pub fn cgroup_dirs(proc_cgroup: &str, mountinfo: &str) -> Vec<PathBuf> {
    struct Mount<'a> {
        root: &'a str,
        at: &'a str,
        v2: bool,
        options: Vec<&'a str>,
    }
    let mounts: Vec<Mount> = mountinfo
        .lines()
        .filter_map(|l| {
            let (head, tail) = l.split_once(" - ")?;
            let head: Vec<&str> = head.split(' ').collect();
            let mut tail = tail.split(' ');
            let (fstype, _source, options) = (tail.next()?, tail.next()?, tail.next()?);
            let v2 = match fstype {
                "cgroup2" => true,
                "cgroup" => false,
                _ => return None,
            };
            Some(Mount {
                root: head.get(3)?,
                at: head.get(4)?,
                v2,
                options: options.split(',').collect(),
            })
        })
        .collect();
    let mut dirs = Vec::new();
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let v2 = id == "0" && controllers.is_empty();
        for m in &mounts {
            let fits = if v2 {
                m.v2
            } else {
                !m.v2
                    && !controllers.is_empty()
                    && controllers.split(',').all(|c| m.options.contains(&c))
            };
            let Ok(rel) = Path::new(path).strip_prefix(m.root) else {
                continue;
            };
            if fits && !rel.components().any(|c| c.as_os_str() == "..") {
                let dir = Path::new(m.at).join(rel);
                if !dirs.contains(&dir) {
                    dirs.push(dir);
                }
            }
        }
    }
    dirs
}

/// Who connected: the credentials the kernel recorded when the process called `connect`
/// (`SO_PEERCRED`), so a process cannot change them afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Process id.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// Why a connection to the control socket was refused (and closed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The process is in no job's cgroup.
    #[error("pid {} (uid {}) is in no job's cgroup (its cgroups: {cgroups})", peer.pid, peer.uid)]
    NotInJob {
        /// Who connected.
        peer: Peer,
        /// Its cgroup directories.
        cgroups: String,
    },
    /// The process's cgroups could not be read (it may have exited).
    #[error("cannot read the cgroups of pid {} (uid {}): {error}", peer.pid, peer.uid)]
    Cgroups {
        /// Who connected.
        peer: Peer,
        /// Why.
        error: String,
    },
    /// The process is in a job's cgroup but runs as another user than the job's.
    #[error("pid {} runs as uid {}, but job {job} belongs to uid {owner}", peer.pid, peer.uid)]
    NotOwner {
        /// Who connected.
        peer: Peer,
        /// The job whose cgroup holds it.
        job: u64,
        /// The job's user.
        owner: u32,
    },
    /// The job holds its maximum of connections.
    #[error("pid {} (uid {}) of job {job}: the job already holds {limit} connections", peer.pid, peer.uid)]
    JobFull {
        /// Who connected.
        peer: Peer,
        /// Its job.
        job: u64,
        /// The bound.
        limit: usize,
    },
    /// Too many connections are waiting to be identified.
    #[error("pid {} (uid {}): {limit} connections are already waiting to be identified", peer.pid, peer.uid)]
    Busy {
        /// Who connected.
        peer: Peer,
        /// The bound.
        limit: usize,
    },
}

/// Whether `peer`, whose cgroup directories are `cgroups`, may talk to the agent: one of them
/// must be a job's cgroup, and the peer's uid that job's owner. Returns the job.
pub fn authorize(
    peer: Peer,
    cgroups: &[PathBuf],
    jobs: &dyn JobLookup,
) -> Result<JobOwner, Refused> {
    let Some(owner) = cgroups.iter().find_map(|c| jobs.job_in(c)) else {
        return Err(Refused::NotInJob {
            peer,
            cgroups: format!("{cgroups:?}"),
        });
    };
    if owner.uid != peer.uid {
        return Err(Refused::NotOwner {
            peer,
            job: owner.job,
            owner: owner.uid,
        });
    }
    Ok(owner)
}
