//! Rebuild flags: how the agent tells a released channel to come back (a file in [`flag_dir`]
//! named for the process as it knows itself).
use std::path::{Path, PathBuf};

/// Where the agent puts rebuild flags for the channels of its control socket `socket`.
pub fn flag_dir(socket: &Path) -> PathBuf {
    socket
        .parent()
        .unwrap_or(Path::new("/"))
        .join("ibq-rebuild")
}

/// Whom a rebuild flag is for: a process as it knows itself, by its PID in its own PID
/// namespace and that namespace (the inode of `/proc/self/ns/pid`). A process in a job sandbox
/// sees only its sandbox's PIDs; the agent names it the same way from outside
/// ([`FlagFor::of_process`]), and two sandboxes' processes with one PID stay apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlagFor {
    /// The PID namespace's inode (0: unknown).
    pub pidns: u64,
    /// The PID in it.
    pub pid: i32,
}

impl FlagFor {
    /// This process (the kernel's PID, as DMTCP's virtual one would mislead).
    pub fn own() -> Self {
        use std::os::unix::fs::MetadataExt;
        FlagFor {
            pidns: std::fs::metadata("/proc/self/ns/pid")
                .map(|m| m.ino())
                .unwrap_or(0),
            pid: crate::kernel::pid(),
        }
    }

    /// Process `pid` of this PID namespace (the agent's view) as it knows itself: its PID in
    /// its innermost namespace (the last of `NSpid` in its status). `None` once it is gone.
    pub fn of_process(pid: i32) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let pidns = std::fs::metadata(format!("/proc/{pid}/ns/pid")).ok()?.ino();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let inner = innermost_pid(&status).unwrap_or(pid);
        Some(FlagFor { pidns, pid: inner })
    }
}

/// The last PID of the `NSpid:` line of a `/proc/PID/status`.
fn innermost_pid(status: &str) -> Option<i32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The rebuild flag of the channel in process `who`.
pub fn flag_path(socket: &Path, who: FlagFor) -> PathBuf {
    flag_dir(socket).join(format!("{}-{}", who.pidns, who.pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_flagged_by_its_pid_in_its_own_namespace() {
        let status = "Name:\theat\nTgid:\t418\nNSpid:\t418\t3\nPPid:\t1\n";
        assert_eq!(innermost_pid(status), Some(3), "in a sandbox");
        assert_eq!(
            innermost_pid("NSpid:\t77\n"),
            Some(77),
            "in the node's namespace"
        );
        assert_eq!(innermost_pid("Name:\tx\n"), None);
        let me = FlagFor::own();
        assert_eq!(FlagFor::of_process(std::process::id() as i32), Some(me));
        assert!(me.pidns > 0);
        let p = flag_path(Path::new("/s/ibq/control.sock"), me);
        assert_eq!(
            p,
            PathBuf::from(format!("/s/ibq/ibq-rebuild/{}-{}", me.pidns, me.pid))
        );
    }
}
