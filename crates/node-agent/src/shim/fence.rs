//! The shim's side of fencing ([`crate::rpc::lease`]): a part whose node lost ckptd for longer than
//! its lease is taken off the network and killed, by its shim, whatever the agent does.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::write_json;

/// Watches the node's lease from a thread of its own for as long as the shim lives; once it has
/// run out, records why in `fenced`, takes the sandbox's job address off the network (in
/// `netns`, if the part has one: ckptd gives it to the part's next incarnation, wherever that
/// runs, and the sockets of killed processes would go on answering for it), kills every
/// process of the part's cgroup, and goes on killing whatever a restore still puts there.
pub(super) fn fence_on_expiry(
    expiry: crate::rpc::lease::Expiry,
    procs: PathBuf,
    netns: Option<PathBuf>,
    fenced: PathBuf,
) {
    std::thread::spawn(move || loop {
        std::thread::sleep(crate::rpc::lease::SHIM_TICK);
        let Some(why) = expiry.check() else { continue };
        if !fenced.exists() {
            if let Some(name) = netns.as_deref().and_then(Path::file_name) {
                let _ = Command::new("ip")
                    .arg("-n")
                    .arg(name)
                    .args(["link", "del", crate::os::sandbox::JOB_INTERFACE])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
            write_json(&fenced, &why);
            eprintln!(
                "ckpt shim: the node has not reached ckptd for {} ms, past its lease of {} ms: the part is killed",
                why.after_ms, why.lease_ms
            );
        }
        kill_cgroup(&procs);
    });
}

/// SIGKILLs every member of the cgroup whose `cgroup.procs` is `procs`: through `cgroup.kill`
/// where the kernel has it, else one by one; then thaws it, since a part fenced while frozen
/// (its agent gone in the middle of a checkpoint) dies only once thawed. Thawed after the kill,
/// it runs no instruction of its own before it dies.
pub(super) fn kill_cgroup(procs: &Path) {
    let dir = procs.parent().unwrap_or(Path::new("/"));
    if fs::write(dir.join("cgroup.kill"), b"1").is_err() {
        kill_each(procs);
    }
    // cgroup v1's freezer holds a frozen task's SIGKILL until it thaws (v2's lets it through).
    let state = dir.join("freezer.state");
    if fs::read_to_string(&state).is_ok_and(|s| s.trim() != "THAWED") {
        let _ = fs::write(&state, b"THAWED");
        // A process put there between the kill and the thaw was not killed: now it is.
        kill_each(procs);
    }
}

/// SIGKILLs every process `procs` (a `cgroup.procs`) lists, but Slurm's own.
fn kill_each(procs: &Path) {
    for pid in super::job_members(procs) {
        // SAFETY: kill takes integers only.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shim whose node's lease ran out kills its part, says why, and keeps the part dead;
    /// a process outside the part's cgroup lives on.
    #[test]
    fn a_part_is_fenced_once_the_lease_runs_out() {
        let Some(parent) = crate::os::cgroup::test_parent("fence") else {
            return;
        };
        let cg = parent.job(3);
        cg.create().unwrap();
        let d = tempfile::tempdir().unwrap();
        let lease = crate::rpc::lease::Keeper::open(d.path());
        lease.renew(crate::rpc::lease::boottime_ms(), 60_000);
        let sleep = || Command::new("sleep").arg("30").spawn().unwrap();
        let (mut part, mut other) = (sleep(), sleep());
        fs::write(cg.procs_file(), part.id().to_string()).unwrap();
        // Frozen, as in the middle of a checkpoint whose agent died.
        cg.freeze().unwrap();
        let fenced = d.path().join(crate::rpc::lease::FENCED);
        fence_on_expiry(
            crate::rpc::lease::Expiry::new(lease.path().to_path_buf()),
            cg.procs_file(),
            None,
            fenced.clone(),
        );
        std::thread::sleep(crate::rpc::lease::SHIM_TICK * 3);
        assert!(part.try_wait().unwrap().is_none(), "the lease holds");
        assert!(!fenced.exists());
        // As a restarted agent would find it: ckptd answered last a minute and a bit ago.
        write_json(
            lease.path(),
            &crate::rpc::lease::Lease {
                boot: crate::rpc::lease::boot(),
                contact_ms: crate::rpc::lease::boottime_ms().saturating_sub(61_000),
                lease_ms: 60_000,
            },
        );
        let begin = std::time::Instant::now();
        let st = loop {
            if let Some(st) = part.try_wait().unwrap() {
                break st;
            }
            assert!(begin.elapsed().as_secs() < 10, "the frozen part never died");
            std::thread::sleep(crate::rpc::lease::SHIM_TICK);
        };
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&st),
            Some(libc::SIGKILL)
        );
        let why: crate::rpc::lease::Fenced = crate::shim::read_json(&fenced).expect("fenced.json");
        assert_eq!(why.lease_ms, 60_000);
        assert!(why.after_ms > 60_000, "{why:?}");
        let mut late = sleep();
        fs::write(cg.procs_file(), late.id().to_string()).unwrap();
        let st = late.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&st),
            Some(libc::SIGKILL),
            "what a restore puts there later dies too"
        );
        assert!(other.try_wait().unwrap().is_none(), "outside: untouched");
        let _ = other.kill();
        let _ = other.wait();
        let _ = cg.remove();
    }
}
