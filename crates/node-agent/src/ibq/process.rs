//! The process at the other end of a control connection, held by a pidfd, so that a channel is
//! the process that connected and not whichever process has its PID later. Without it, a
//! user's process could connect, hand its socket to a sibling and exit; once its PID went to a
//! process of another user's restored job, the agent would send that job's rebuild, and every
//! endpoint of the job, down the sibling's socket.
//!
//! Where the kernel gives the connecting process's pidfd (`SO_PEERPIDFD`, Linux 6.5), that is
//! the process; elsewhere the agent opens one by the PID the kernel recorded at `connect` and
//! refuses it if that process started after the connection was accepted (then the PID was
//! reused in between). A connection is dropped as soon as its process exits
//! ([`PeerProcess::exited`]), and every lookup checks that it is still alive.
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;

/// `SO_PEERPIDFD` (include/uapi/asm-generic/socket.h).
const SO_PEERPIDFD: libc::c_int = 77;

/// A connecting process, by pidfd.
#[derive(Debug)]
pub(super) struct PeerProcess {
    pidfd: OwnedFd,
}

impl PeerProcess {
    /// The process that connected `socket`, whose PID the kernel recorded as `pid`; the
    /// connection was accepted at `accepted` (ticks of the boot clock, [`boot_ticks`]).
    pub(super) fn of(socket: &impl AsRawFd, pid: i32, accepted: u64) -> io::Result<Self> {
        if let Some(p) = Self::from_socket(socket)? {
            return Ok(p);
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let p = PeerProcess {
            // SAFETY: a descriptor the kernel just returned, owned by nothing else.
            pidfd: unsafe { OwnedFd::from_raw_fd(fd as i32) },
        };
        let started = crate::os::procfs::stat(pid)
            .ok_or_else(|| io::Error::other(format!("pid {pid} is gone")))?
            .start_ticks;
        if started > accepted {
            return Err(io::Error::other(format!(
                "pid {pid} started after its connection was accepted: the process that connected exited and its PID was reused"
            )));
        }
        Ok(p)
    }

    fn from_socket(socket: &impl AsRawFd) -> io::Result<Option<Self>> {
        let mut fd: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `fd`, which lives on this stack.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERPIDFD,
                (&mut fd as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                // Older kernels do not know the option.
                Some(libc::ENOPROTOOPT) | Some(libc::EINVAL) => Ok(None),
                _ => Err(e),
            };
        }
        Ok(Some(PeerProcess {
            // SAFETY: a descriptor the kernel just returned, owned by nothing else.
            pidfd: unsafe { OwnedFd::from_raw_fd(fd) },
        }))
    }

    /// Whether the process still runs (its pidfd is not readable yet).
    pub(super) fn alive(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd of ours, without waiting.
        let rc = unsafe { libc::poll(&mut p, 1, 0) };
        rc == 0
    }

    /// Resolves when the process has exited.
    pub(super) async fn exited(&self) {
        let Ok(dup) = self.pidfd.try_clone() else {
            return;
        };
        // SAFETY: `dup` is an open descriptor that the AsyncFd owns, and so keeps open and
        // unchanged, for its whole life.
        let registered =
            unsafe { AsyncFd::register_with_interest(dup, tokio::io::Interest::READABLE) };
        let Ok(fd) = registered else {
            // Cannot be watched: looked at on every use instead.
            std::future::pending::<()>().await;
            return;
        };
        let _ = fd.readable().await;
    }
}

/// Now, in ticks of the boot clock (the unit of a process's start time in `/proc`).
pub(super) fn boot_ticks() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which lives on this stack.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    let hz = clock_ticks();
    // Rounded up: a process started within this tick is not after it.
    ts.tv_sec as u64 * hz + (ts.tv_nsec as u64 * hz).div_ceil(1_000_000_000)
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as u64
    } else {
        100
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_started_before_now_and_is_alive() {
        let me = std::process::id() as i32;
        assert!(crate::os::procfs::stat(me).unwrap().start_ticks <= boot_ticks());
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let p = PeerProcess::of(&a, me, boot_ticks()).unwrap();
        assert!(p.alive());
    }

    #[test]
    fn an_exited_process_is_not_alive() {
        let mut child = std::process::Command::new("/bin/true").spawn().unwrap();
        let pid = child.id() as i32;
        // SAFETY: pidfd_open on our own child, before it is reaped.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        assert!(fd >= 0);
        let p = PeerProcess {
            // SAFETY: the descriptor just returned.
            pidfd: unsafe { OwnedFd::from_raw_fd(fd as i32) },
        };
        child.wait().unwrap();
        assert!(!p.alive());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(5), p.exited())
                .await
                .expect("exited() resolves for a process that exited");
        });
    }

    #[test]
    fn a_process_that_started_after_the_accept_is_refused() {
        let me = std::process::id() as i32;
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        // SO_PEERPIDFD (where the kernel has it) names the process that connected, whatever
        // the time; without it the start time decides.
        if PeerProcess::from_socket(&a).unwrap().is_none() {
            assert!(PeerProcess::of(&a, me, 0).is_err());
        }
    }
}
