//! What the kernel itself says of the process, past any interposed C library wrapper.

/// The process's PID as the kernel knows it, which the agent sees on the connection
/// (`SO_PEERCRED`) and in the job's cgroup: the system call instruction itself, since a
/// checkpointer that virtualizes PIDs (DMTCP) answers the C library's `getpid` and
/// `syscall(SYS_getpid)` with its own number, which a restart keeps while the kernel's changes.
#[cfg(target_arch = "x86_64")]
pub(crate) fn pid() -> i32 {
    let ret: i64;
    // SAFETY: getpid takes no arguments, cannot fail and touches no memory; the kernel
    // clobbers rcx and r11.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") libc::SYS_getpid => ret,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack, preserves_flags)
        );
    }
    ret as i32
}

#[cfg(target_arch = "aarch64")]
pub(crate) fn pid() -> i32 {
    let ret: i64;
    // SAFETY: getpid takes no arguments, cannot fail and touches no memory.
    unsafe {
        std::arch::asm!(
            "svc 0",
            in("x8") libc::SYS_getpid,
            lateout("x0") ret,
            options(nostack, preserves_flags)
        );
    }
    ret as i32
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub(crate) fn pid() -> i32 {
    std::process::id() as i32
}
