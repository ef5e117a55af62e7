//! Proxies for the descriptors a program waits on: a context's `async_fd` and a completion
//! channel's `fd`.
//!
//! Libraries put these descriptors into their own epoll sets (UCX's async thread does) and
//! keep their numbers. A real one cannot go through a snapshot (CRIU refuses the verbs device
//! files), and closing it drops it from every epoll set. So the program is handed an eventfd
//! instead, which lives as long as the shadow: the layer's watcher thread raises it when the
//! real descriptor becomes readable, and the layer's `ibv_get_cq_event` /
//! `ibv_get_async_event` lower it again when the real one has nothing more. Across a release
//! and a rebuild the eventfd stays, at the same number and in the same epoll sets; only the
//! real descriptor behind it changes.
use std::io;
use std::os::raw::c_int;
use std::sync::atomic::AtomicI32;
use std::sync::atomic::Ordering::{Acquire, Release};
use std::sync::OnceLock;

/// A descriptor handed to the program in place of a real one.
#[derive(Debug)]
pub struct Proxy {
    fd: c_int,
    real: AtomicI32,
}

/// The watcher's epoll descriptor (the thread is started with it).
fn watcher() -> Option<c_int> {
    static EPOLL: OnceLock<Option<c_int>> = OnceLock::new();
    *EPOLL.get_or_init(|| {
        // SAFETY: plain system call.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return None;
        }
        std::thread::Builder::new()
            .name("ckpt-verbs-events".into())
            .spawn(move || watch(ep))
            .ok()?;
        Some(ep)
    })
}

/// The watcher thread: a real descriptor that became readable raises its proxy (the epoll
/// data), once; the proxy's reader arms it again when it has taken everything.
fn watch(ep: c_int) {
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 16];
    loop {
        // SAFETY: `evs` has room for 16 events.
        let n = unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), evs.len() as c_int, -1) };
        for e in evs.iter().take(n.max(0) as usize) {
            raise(e.u64 as c_int);
        }
    }
}

fn raise(fd: c_int) {
    let one: u64 = 1;
    // SAFETY: 8 bytes from a live u64 to an eventfd.
    unsafe { libc::write(fd, &one as *const u64 as *const libc::c_void, 8) };
}

fn set_nonblocking(fd: c_int) {
    // SAFETY: plain fcntl calls on a descriptor the caller owns.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 && fl & libc::O_NONBLOCK == 0 {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
}

impl Proxy {
    /// A new proxy (an eventfd, close-on-exec, lowered).
    pub fn new() -> io::Result<Proxy> {
        // SAFETY: plain system call.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Proxy {
            fd,
            real: AtomicI32::new(-1),
        })
    }

    /// The descriptor the program holds.
    pub fn fd(&self) -> c_int {
        self.fd
    }

    /// The real descriptor behind it now (−1: none, released).
    pub fn real(&self) -> c_int {
        self.real.load(Acquire)
    }

    /// Puts the real descriptor `real` behind the proxy: made non-blocking (the layer's reads
    /// never block unless the program's would), and watched.
    pub fn attach(&self, real: c_int) {
        set_nonblocking(real);
        self.real.store(real, Release);
        if let Some(ep) = watcher() {
            let mut e = libc::epoll_event {
                events: (libc::EPOLLIN | libc::EPOLLONESHOT) as u32,
                u64: self.fd as u64,
            };
            // SAFETY: a live epoll descriptor and event.
            unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, real, &mut e) };
        }
    }

    /// Stops watching the real descriptor, before it is closed.
    pub fn detach(&self) {
        let real = self.real.swap(-1, Release);
        if let (Some(ep), true) = (watcher(), real >= 0) {
            // SAFETY: a live epoll descriptor; `real` is still open.
            unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_DEL, real, std::ptr::null_mut()) };
        }
    }

    /// Raises the proxy (an event the layer owes the program).
    pub fn raise(&self) {
        raise(self.fd);
    }

    /// The real descriptor has nothing more: lowers the proxy and watches the real one again
    /// (if something came in between, the watcher raises the proxy at once).
    pub fn settle(&self) {
        let mut p = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut count: u64 = 0;
        // SAFETY: one pollfd; a read of 8 bytes into a u64 only when the eventfd is readable
        // (the program may have made it blocking).
        unsafe {
            if libc::poll(&mut p, 1, 0) == 1 {
                libc::read(self.fd, &mut count as *mut u64 as *mut libc::c_void, 8);
            }
        }
        let real = self.real();
        if let (Some(ep), true) = (watcher(), real >= 0) {
            let mut e = libc::epoll_event {
                events: (libc::EPOLLIN | libc::EPOLLONESHOT) as u32,
                u64: self.fd as u64,
            };
            // SAFETY: a live epoll descriptor watching `real`.
            unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, real, &mut e) };
        }
    }

    /// Whether the program made its descriptor non-blocking (then a read with nothing to
    /// read fails with EAGAIN instead of waiting).
    pub fn nonblocking(&self) -> bool {
        // SAFETY: plain fcntl on our descriptor.
        let fl = unsafe { libc::fcntl(self.fd, libc::F_GETFL) };
        fl >= 0 && fl & libc::O_NONBLOCK != 0
    }

    /// Waits up to `ms` milliseconds for the real descriptor (or, released, for the proxy).
    pub fn wait(&self, ms: c_int) {
        let real = self.real();
        let mut p = libc::pollfd {
            fd: if real >= 0 { real } else { self.fd },
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        unsafe { libc::poll(&mut p, 1, ms) };
    }

    /// Closes the proxy (its shadow is destroyed).
    pub fn close(&self) {
        self.detach();
        // SAFETY: our descriptor, not used again.
        unsafe { libc::close(self.fd) };
    }
}

/// Whether a failed read of a non-blocking real descriptor only found nothing.
pub fn nothing_yet(rc: c_int) -> bool {
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: c_int) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        unsafe { libc::poll(&mut p, 1, 2000) == 1 }
    }

    #[test]
    fn a_proxy_follows_its_real_descriptor_and_outlives_it() {
        let proxy = Proxy::new().expect("eventfd");
        let mut pipe = [0; 2];
        // SAFETY: room for two descriptors.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        proxy.attach(pipe[0]);
        assert!(!proxy.nonblocking(), "the program's flags are its own");
        // The real descriptor becomes readable: the watcher raises the proxy.
        // SAFETY: one byte into a pipe.
        unsafe { libc::write(pipe[1], b"x".as_ptr() as *const libc::c_void, 1) };
        assert!(readable(proxy.fd()), "raised");
        // The reader took everything and settles: lowered, then raised again at once because
        // the real descriptor is still readable.
        proxy.settle();
        assert!(
            readable(proxy.fd()),
            "raised again: the real one still has data"
        );
        let mut b = [0u8; 1];
        // SAFETY: one byte out of the pipe.
        unsafe { libc::read(pipe[0], b.as_mut_ptr() as *mut libc::c_void, 1) };
        proxy.settle();
        let mut p = libc::pollfd {
            fd: proxy.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        assert_eq!(unsafe { libc::poll(&mut p, 1, 100) }, 0, "lowered");
        // Released: the real descriptor goes, the proxy stays and can be raised by the layer.
        proxy.detach();
        // SAFETY: our pipe.
        unsafe {
            libc::close(pipe[0]);
            libc::close(pipe[1]);
        }
        assert_eq!(proxy.real(), -1);
        proxy.raise();
        assert!(readable(proxy.fd()));
        proxy.close();
    }
}
