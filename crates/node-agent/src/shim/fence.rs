//! The shim's side of fencing ([`crate::rpc::lease`]): a part whose node lost ckptd for longer than
//! its lease is taken off the network and killed, by its shim, whatever the agent does.
use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use super::write_json;
use crate::os::cgroup::Freezer;

/// Takes the part's job address off the network: sets the job interface of the network
/// namespace `netns` down (held open since the shim began, so never a later incarnation's
/// namespace of the same name). The shim does it when its part ends, and when it fences it:
/// the agent, which removes the namespace otherwise, may be dead, and an interface left up
/// there answers for the address (and the MAC derived from it) that the part's next
/// incarnation holds on another node, resetting its connections.
///
/// The calling thread enters `netns` for good, and it makes neither a child nor a thread:
/// once the part's process 1 has died, its PID namespace takes no new process, and a shim
/// that made it can start no thread.
pub(super) fn unplug(netns: &fs::File) {
    if let Err(e) = link_down(netns.as_raw_fd()) {
        eprintln!(
            "ckpt shim: cannot take the part's job address off the network ({} down): {e}",
            crate::os::sandbox::JOB_INTERFACE
        );
    }
}

/// In the calling thread: enters the network namespace `netns` and sets its job interface
/// down. A namespace without one (already removed) is not an error.
fn link_down(netns: RawFd) -> std::io::Result<()> {
    use std::io::Error;
    // SAFETY: setns on a descriptor the caller keeps open; it moves this thread only.
    if unsafe { libc::setns(netns, libc::CLONE_NEWNET) } != 0 {
        return Err(Error::last_os_error());
    }
    // SAFETY: socket takes integers; the descriptor is owned from here.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(Error::last_os_error());
    }
    // SAFETY: a descriptor just made, owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    // SAFETY: ifreq is plain data, valid all zero.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, b) in req
        .ifr_name
        .iter_mut()
        .zip(crate::os::sandbox::JOB_INTERFACE.bytes())
    {
        *d = b as libc::c_char;
    }
    // SAFETY: ioctls on our socket with a valid ifreq.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) != 0 {
            let e = Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENODEV) => Ok(()),
                _ => Err(e),
            };
        }
        req.ifr_ifru.ifru_flags &= !(libc::IFF_UP as libc::c_short);
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) != 0 {
            return Err(Error::last_os_error());
        }
    }
    Ok(())
}

/// Watches the node's lease from a thread of its own for as long as the shim lives; once it has
/// run out, records why in `fenced`, takes the sandbox's job address off the network (in
/// `netns`, if the part has one: ckptd gives it to the part's next incarnation, wherever that
/// runs, and the sockets of killed processes would go on answering for it), kills every
/// process of the part's cgroup, and goes on killing whatever a restore still puts there.
pub(super) fn fence_on_expiry(
    expiry: crate::rpc::lease::Expiry,
    procs: PathBuf,
    netns: Option<fs::File>,
    fenced: PathBuf,
) {
    std::thread::spawn(move || loop {
        std::thread::sleep(crate::rpc::lease::SHIM_TICK);
        let Some(why) = expiry.check() else { continue };
        if !fenced.exists() {
            if let Some(ns) = &netns {
                unplug(ns);
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
    let thawed = Freezer::Thawed.name();
    if fs::read_to_string(&state).is_ok_and(|s| s.trim() != thawed) {
        let _ = fs::write(&state, thawed);
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
    use std::process::Command;

    /// A part's job interface is set down through the namespace the shim holds; a namespace
    /// without one is no error.
    #[test]
    fn unplug_sets_the_job_interface_down() {
        let name = format!("ckpt-unplug-test-{}", std::process::id());
        let ip = |args: &[&str]| Command::new("ip").args(args).output();
        if !nix::unistd::geteuid().is_root() || ip(&["netns", "add", &name]).is_err() {
            eprintln!("SKIPPED: needs root and ip(8)");
            return;
        }
        let r#in = |args: &[&str]| {
            let mut a = vec!["-n", name.as_str()];
            a.extend_from_slice(args);
            let out = ip(&a).unwrap();
            assert!(out.status.success(), "ip {a:?}: {out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        r#in(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
        ]);
        r#in(&["link", "set", "eth0", "up"]);
        assert!(r#in(&["-o", "link", "show", "eth0"]).contains(",UP"));
        // In threads of their own: each enters the namespace for good.
        let ns = fs::File::open(format!("/run/netns/{name}")).unwrap();
        let held = ns.try_clone().unwrap();
        std::thread::spawn(move || unplug(&held)).join().unwrap();
        let after = r#in(&["-o", "link", "show", "eth0"]);
        r#in(&["link", "del", "eth0"]);
        let fd = ns.as_raw_fd();
        let gone = std::thread::spawn(move || link_down(fd).ok())
            .join()
            .unwrap();
        assert_eq!(gone, Some(()), "no interface: no error");
        let _ = ip(&["netns", "del", &name]);
        assert!(!after.contains(",UP"), "{after}");
    }

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
