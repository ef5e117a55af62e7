//! A job's cgroup that Slurm lends (`[slurm] adopt`): the extern step of the owner's Slurm
//! job, shared with Slurm's own processes, whose members of the job are its shim's descendants.
use std::fs;
use std::path::{Path, PathBuf};

/// A job's cgroup that Slurm made and owns: the extern step of the owner's Slurm job (cgroup
/// v1). The agent freezes it and lists, signals and kills the job's processes in it, but does
/// not make or remove it, and leaves Slurm's own processes there (the step's `sleep`) alone.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lent {
    /// Slurm's job.
    pub slurm_job: u64,
    /// Its extern step's slurmstepd socket.
    pub socket: PathBuf,
    /// The freezer cgroup (the job's cgroup).
    pub freezer: PathBuf,
    /// The step's cgroups in the other hierarchies (limits), which the job's processes join too.
    pub others: Vec<PathBuf>,
}

/// The processes of a job's cgroup whose `cgroup.procs` is `procs`, for its kill: every
/// member of the agent's own cgroup; of a cgroup Slurm lent (`of`: the job's shim), the shim's
/// descendants in it or below it.
pub fn members(procs: &Path, of: Option<(i32, Option<u64>)>) -> Vec<i32> {
    match (of, procs.parent()) {
        (Some(shim), Some(dir)) => {
            let mut v = Vec::new();
            listed_below(dir, 0, &mut v);
            v.retain(|&p| descends(p, shim));
            v
        }
        _ => listed(procs),
    }
}

/// The PIDs a `cgroup.procs` file lists.
fn listed(procs: &Path) -> Vec<i32> {
    fs::read_to_string(procs)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// How deep below a lent cgroup its members are looked for (a user may make cgroups there).
const LENT_DEPTH: usize = 8;

/// The members of cgroup `dir` and of the cgroups below it.
fn listed_below(dir: &Path, depth: usize, into: &mut Vec<i32>) {
    into.extend(listed(&dir.join("cgroup.procs")));
    if depth >= LENT_DEPTH {
        return;
    }
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            listed_below(&e.path(), depth + 1, into);
        }
    }
}

/// Whether `pid` descends from `ancestor` (PID, and its start time if known), by the parents
/// `/proc` shows.
fn descends(pid: i32, ancestor: (i32, Option<u64>)) -> bool {
    let mut p = pid;
    for _ in 0..256 {
        let Some(st) = crate::os::procfs::stat(p) else {
            return false;
        };
        if st.ppid == ancestor.0 {
            return ancestor.1.is_none_or(|start| {
                crate::os::procfs::stat(st.ppid).is_some_and(|a| a.start_ticks == start)
            });
        }
        if st.ppid <= 1 {
            return false;
        }
        p = st.ppid;
    }
    false
}
