//! A CRIU plugin that lets a **pre-dump** pass over a process's InfiniBand verbs mappings.
//!
//! A process running over verbs (through `libckpt_verbs.so` or an ib-quiesce channel) maps its
//! device file (`/dev/infiniband/uverbsN`): doorbell pages and queue rings that live in the
//! adapter and the kernel. CRIU refuses any device mapping no plugin claims, so pre-copy
//! (`criu pre-dump`, which copies memory while the job runs) failed for every verbs job. A
//! pre-dump copies private and anonymous shared memory only, never the content of a file or
//! device mapping, so all it needs is to be told the mapping is known: this plugin claims
//! mappings of verbs devices in the pre-dump stage and nothing else.
//!
//! A **dump** is never helped: by then the layer has released every verbs object and the
//! device is no longer mapped; a process that still maps it is refused as before (and would
//! be restored without the adapter's state).
//!
//! What the adapter wrote by DMA since a pre-dump is invisible to the soft-dirty bits CRIU
//! tracks changes with; the layer marks those pages itself before the dump
//! (`ib_quiesce::dirty`).
//!
//! The ABI is CRIU's `criu-plugin.h`, version 0.2: a descriptor `CR_PLUGIN_DESC` with an
//! init, an exit and a table of hooks indexed by hook number.
use std::sync::atomic::{AtomicI32, Ordering};

/// `CR_PLUGIN_HOOK__HANDLE_DEVICE_VMA`.
const HOOK_HANDLE_DEVICE_VMA: usize = 7;
/// Hooks in our table: up to the one we serve (CRIU refuses a table larger than its own).
const HOOKS: usize = HOOK_HANDLE_DEVICE_VMA + 1;
/// `CR_PLUGIN_STAGE__PRE_DUMP`.
const STAGE_PRE_DUMP: i32 = 1;
/// CRIU's plugin ABI 0.2.0.
const VERSION: u32 = 2 << 8;

/// `cr_plugin_desc_t`.
#[repr(C)]
#[derive(Debug)]
pub struct PluginDesc {
    name: *const libc::c_char,
    init: extern "C" fn(i32) -> i32,
    exit: extern "C" fn(i32, i32),
    version: u32,
    max_hooks: u32,
    /// `void *hooks[]`: an absent hook is NULL (`None`); the only one set has this type.
    hooks: [Option<DeviceVmaHook>; HOOKS],
}

/// `CR_PLUGIN_HOOK__HANDLE_DEVICE_VMA_t`.
type DeviceVmaHook = extern "C" fn(i32, *const libc::stat) -> i32;

// SAFETY: the descriptor is immutable; CRIU only reads it.
unsafe impl Sync for PluginDesc {}

/// The stage CRIU runs (−1 before init).
static STAGE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn init(stage: i32) -> i32 {
    STAGE.store(stage, Ordering::Relaxed);
    0
}

extern "C" fn exit(_stage: i32, _ret: i32) {}

/// Whether the character device `rdev` is a verbs device: its sysfs class is
/// `infiniband_verbs` (`uverbsN`; not `umad`, `issm` or `rdma_cm`).
fn is_verbs_device(rdev: libc::dev_t) -> bool {
    let link = format!("/sys/dev/char/{}:{}", libc::major(rdev), libc::minor(rdev));
    std::fs::read_link(link)
        .map(|t| t.components().any(|c| c.as_os_str() == "infiniband_verbs"))
        .unwrap_or(false)
}

/// `HANDLE_DEVICE_VMA(fd, stat)`: 0 claims the mapping, `-ENOTSUP` passes it on.
extern "C" fn handle_device_vma(_fd: i32, st: *const libc::stat) -> i32 {
    if st.is_null() || STAGE.load(Ordering::Relaxed) != STAGE_PRE_DUMP {
        return -libc::ENOTSUP;
    }
    // SAFETY: CRIU passes the mapping's stat.
    let st = unsafe { &*st };
    if st.st_mode & libc::S_IFMT == libc::S_IFCHR && is_verbs_device(st.st_rdev) {
        0
    } else {
        -libc::ENOTSUP
    }
}

const fn hooks() -> [Option<DeviceVmaHook>; HOOKS] {
    let mut h: [Option<DeviceVmaHook>; HOOKS] = [None; HOOKS];
    h[HOOK_HANDLE_DEVICE_VMA] = Some(handle_device_vma);
    h
}

/// What CRIU looks up (`dlsym(h, "CR_PLUGIN_DESC")`).
#[no_mangle]
pub static CR_PLUGIN_DESC: PluginDesc = PluginDesc {
    name: c"ckpt_verbs".as_ptr(),
    init,
    exit,
    version: VERSION,
    max_hooks: HOOKS as u32,
    hooks: hooks(),
};

#[cfg(test)]
mod tests {
    use super::*;

    fn stat_of(path: &str) -> libc::stat {
        let c = std::ffi::CString::new(path).unwrap();
        // SAFETY: an all-zero stat is a valid value of the plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a NUL-terminated path and a stat to fill.
        let rc = unsafe { libc::stat(c.as_ptr(), &mut st) };
        assert_eq!(rc, 0, "{path}");
        st
    }

    #[test]
    fn only_verbs_devices_and_only_in_a_pre_dump_are_claimed() {
        let null = stat_of("/dev/null");
        let file = stat_of("/proc/self/exe");
        for stage in [0, 1, 2] {
            init(stage);
            assert_eq!(handle_device_vma(3, &null), -libc::ENOTSUP);
            assert_eq!(handle_device_vma(3, &file), -libc::ENOTSUP);
            assert_eq!(handle_device_vma(3, std::ptr::null()), -libc::ENOTSUP);
        }
        assert!(!is_verbs_device(null.st_rdev));
        // A verbs device where this host has one (the QEMU guests do; rdma tests there).
        if let Ok(st) = std::fs::metadata("/dev/infiniband/uverbs0") {
            use std::os::unix::fs::MetadataExt;
            let rdev = st.rdev();
            assert!(is_verbs_device(rdev));
            let mut s = stat_of("/dev/infiniband/uverbs0");
            s.st_rdev = rdev;
            init(STAGE_PRE_DUMP);
            assert_eq!(handle_device_vma(3, &s), 0);
            init(0);
            assert_eq!(handle_device_vma(3, &s), -libc::ENOTSUP, "never in a dump");
        } else {
            eprintln!("no /dev/infiniband/uverbs0 here: the claim itself is tested in the guests");
        }
    }

    #[test]
    fn the_descriptor_is_criu_abi_0_2_with_the_device_hook_only() {
        let d = &CR_PLUGIN_DESC;
        assert_eq!(d.version, 0x200);
        assert_eq!(d.max_hooks, 8);
        assert!(d.hooks[..7].iter().all(Option::is_none));
        assert!(d.hooks[7].is_some());
        assert_eq!(
            std::mem::size_of::<PluginDesc>(),
            8 + 8 + 8 + 4 + 4 + 8 * 8,
            "laid out as cr_plugin_desc_t with 8 hooks"
        );
        // SAFETY: a static C string.
        let name = unsafe { std::ffi::CStr::from_ptr(d.name) };
        assert_eq!(name.to_str().unwrap(), "ckpt_verbs");
    }
}
