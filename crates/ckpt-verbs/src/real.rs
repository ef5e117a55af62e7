//! libibverbs' own functions, found behind this library with `dlvsym(RTLD_NEXT)`.
//!
//! This library defines the exported verbs calls itself, so a call by name from here would
//! come back here. Every real call goes through [`real()`], resolved once, in libibverbs
//! itself and by symbol version (the versions libibverbs exports them under; a missing one is
//! `None` and the wrapper answers "not supported").
//!
//! The lookup goes through a handle of libibverbs, not `RTLD_NEXT`: UCX loads its verbs
//! transport with `dlopen(RTLD_LOCAL)`, and libibverbs, that module's dependency, is then
//! outside the global scope `RTLD_NEXT` searches.
use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use ibverbs_sys as ffi;

macro_rules! real_fns {
    ($( $name:ident ( $($arg:ty),* ) -> $ret:ty = $ver:literal; )*) => {
        /// The real functions this layer wraps.
        #[allow(missing_docs, clippy::type_complexity)]
        #[derive(Debug)]
        pub struct Real {
            $( pub $name: Option<unsafe extern "C" fn($($arg),*) -> $ret>, )*
        }

        impl Real {
            fn resolve() -> Real {
                Real {
                    $( $name: {
                        let p = lookup(
                            concat!(stringify!($name), "\0"),
                            concat!($ver, "\0"),
                        );
                        // SAFETY: a non-null symbol of this name and version is libibverbs'
                        // function with this C signature (verbs.h); null becomes None.
                        (!p.is_null()).then(|| unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> $ret>(p)
                        })
                    }, )*
                }
            }
        }
    };
}

/// libibverbs' soname.
pub const LIBIBVERBS: &str = "libibverbs.so.1";

fn lookup(name: &'static str, version: &'static str) -> *mut c_void {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    let handle = *HANDLE.get_or_init(|| {
        let so = std::ffi::CString::new(LIBIBVERBS).expect("no nul");
        // SAFETY: a nul-terminated soname. Loading it again only takes a reference; the
        // handle is kept for the life of the process.
        unsafe { libc::dlopen(so.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) as usize }
    });
    if handle == 0 {
        return std::ptr::null_mut();
    }
    let name = CStr::from_bytes_with_nul(name.as_bytes()).expect("nul-terminated");
    let version = CStr::from_bytes_with_nul(version.as_bytes()).expect("nul-terminated");
    // SAFETY: a handle from dlopen and nul-terminated strings; the search covers libibverbs
    // and its dependencies only, never this library.
    unsafe { libc::dlvsym(handle as *mut c_void, name.as_ptr(), version.as_ptr()) }
}

type Ctx = *mut ffi::ibv_context;

real_fns! {
    ibv_get_device_list(*mut c_int) -> *mut *mut ffi::ibv_device = "IBVERBS_1.1";
    ibv_free_device_list(*mut *mut ffi::ibv_device) -> () = "IBVERBS_1.1";
    ibv_open_device(*mut ffi::ibv_device) -> Ctx = "IBVERBS_1.1";
    ibv_close_device(Ctx) -> c_int = "IBVERBS_1.1";
    ibv_get_async_event(Ctx, *mut ffi::ibv_async_event) -> c_int = "IBVERBS_1.1";
    ibv_ack_async_event(*mut ffi::ibv_async_event) -> () = "IBVERBS_1.1";
    ibv_query_device(Ctx, *mut ffi::ibv_device_attr) -> c_int = "IBVERBS_1.1";
    ibv_query_port(Ctx, u8, *mut ffi::_compat_ibv_port_attr) -> c_int = "IBVERBS_1.1";
    ibv_query_gid(Ctx, u8, c_int, *mut ffi::ibv_gid) -> c_int = "IBVERBS_1.1";
    ibv_query_pkey(Ctx, u8, c_int, *mut u16) -> c_int = "IBVERBS_1.1";
    ibv_get_pkey_index(Ctx, u8, u16) -> c_int = "IBVERBS_1.5";
    _ibv_query_gid_ex(Ctx, u32, u32, *mut ffi::ibv_gid_entry, u32, usize) -> c_int = "IBVERBS_1.11";
    _ibv_query_gid_table(Ctx, *mut ffi::ibv_gid_entry, usize, u32, usize) -> isize = "IBVERBS_1.11";
    ibv_resolve_eth_l2_from_gid(Ctx, *mut ffi::ibv_ah_attr, *mut u8, *mut u16) -> c_int = "IBVERBS_1.1";
    ibv_alloc_pd(Ctx) -> *mut ffi::ibv_pd = "IBVERBS_1.1";
    ibv_dealloc_pd(*mut ffi::ibv_pd) -> c_int = "IBVERBS_1.1";
    ibv_reg_mr(*mut ffi::ibv_pd, *mut c_void, usize, c_int) -> *mut ffi::ibv_mr = "IBVERBS_1.1";
    ibv_reg_mr_iova(*mut ffi::ibv_pd, *mut c_void, usize, u64, c_int) -> *mut ffi::ibv_mr = "IBVERBS_1.7";
    ibv_reg_mr_iova2(*mut ffi::ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ffi::ibv_mr = "IBVERBS_1.8";
    ibv_dereg_mr(*mut ffi::ibv_mr) -> c_int = "IBVERBS_1.1";
    ibv_create_comp_channel(Ctx) -> *mut ffi::ibv_comp_channel = "IBVERBS_1.0";
    ibv_destroy_comp_channel(*mut ffi::ibv_comp_channel) -> c_int = "IBVERBS_1.0";
    ibv_create_cq(Ctx, c_int, *mut c_void, *mut ffi::ibv_comp_channel, c_int) -> *mut ffi::ibv_cq = "IBVERBS_1.1";
    ibv_resize_cq(*mut ffi::ibv_cq, c_int) -> c_int = "IBVERBS_1.1";
    ibv_destroy_cq(*mut ffi::ibv_cq) -> c_int = "IBVERBS_1.1";
    ibv_get_cq_event(*mut ffi::ibv_comp_channel, *mut *mut ffi::ibv_cq, *mut *mut c_void) -> c_int = "IBVERBS_1.1";
    ibv_ack_cq_events(*mut ffi::ibv_cq, c_uint) -> () = "IBVERBS_1.1";
    ibv_create_srq(*mut ffi::ibv_pd, *mut ffi::ibv_srq_init_attr) -> *mut ffi::ibv_srq = "IBVERBS_1.1";
    ibv_modify_srq(*mut ffi::ibv_srq, *mut ffi::ibv_srq_attr, c_int) -> c_int = "IBVERBS_1.1";
    ibv_query_srq(*mut ffi::ibv_srq, *mut ffi::ibv_srq_attr) -> c_int = "IBVERBS_1.1";
    ibv_destroy_srq(*mut ffi::ibv_srq) -> c_int = "IBVERBS_1.1";
    ibv_create_qp(*mut ffi::ibv_pd, *mut ffi::ibv_qp_init_attr) -> *mut ffi::ibv_qp = "IBVERBS_1.1";
    ibv_modify_qp(*mut ffi::ibv_qp, *mut ffi::ibv_qp_attr, c_int) -> c_int = "IBVERBS_1.1";
    ibv_query_qp(*mut ffi::ibv_qp, *mut ffi::ibv_qp_attr, c_int, *mut ffi::ibv_qp_init_attr) -> c_int = "IBVERBS_1.1";
    ibv_destroy_qp(*mut ffi::ibv_qp) -> c_int = "IBVERBS_1.1";
    ibv_query_qp_data_in_order(*mut ffi::ibv_qp, c_uint, u32) -> c_int = "IBVERBS_1.14";
    ibv_create_ah(*mut ffi::ibv_pd, *mut ffi::ibv_ah_attr) -> *mut ffi::ibv_ah = "IBVERBS_1.1";
    ibv_destroy_ah(*mut ffi::ibv_ah) -> c_int = "IBVERBS_1.1";
    ibv_init_ah_from_wc(Ctx, u8, *mut ffi::ibv_wc, *mut ffi::ibv_grh, *mut ffi::ibv_ah_attr) -> c_int = "IBVERBS_1.1";
    ibv_qp_to_qp_ex(*mut ffi::ibv_qp) -> *mut ffi::ibv_qp_ex = "IBVERBS_1.6";
    ibv_attach_mcast(*mut ffi::ibv_qp, *const ffi::ibv_gid, u16) -> c_int = "IBVERBS_1.1";
    ibv_detach_mcast(*mut ffi::ibv_qp, *const ffi::ibv_gid, u16) -> c_int = "IBVERBS_1.1";
    ibv_query_ece(*mut ffi::ibv_qp, *mut ffi::ibv_ece) -> c_int = "IBVERBS_1.10";
    ibv_set_ece(*mut ffi::ibv_qp, *mut ffi::ibv_ece) -> c_int = "IBVERBS_1.10";
    ibv_import_pd(Ctx, u32) -> *mut ffi::ibv_pd = "IBVERBS_1.10";
    ibv_import_mr(*mut ffi::ibv_pd, u32) -> *mut ffi::ibv_mr = "IBVERBS_1.10";
    ibv_unimport_pd(*mut ffi::ibv_pd) -> () = "IBVERBS_1.10";
    ibv_unimport_mr(*mut ffi::ibv_mr) -> () = "IBVERBS_1.10";
}

/// libibverbs' functions. Resolved at the first call; a program that never touches verbs
/// never pays for it.
pub fn real() -> &'static Real {
    static REAL: OnceLock<Real> = OnceLock::new();
    REAL.get_or_init(Real::resolve)
}

/// The name of a device, for messages.
///
/// # Safety
/// `dev` is null or a device of libibverbs' list.
pub unsafe fn device_name(dev: *mut ffi::ibv_device) -> String {
    if dev.is_null() {
        return "?".into();
    }
    // SAFETY: `name` is a nul-terminated array inside the device (verbs.h).
    unsafe { CStr::from_ptr((*dev).name.as_ptr() as *const c_char) }
        .to_string_lossy()
        .into_owned()
}

/// A zeroed plain-data verbs struct (all of them are valid zeroed, mutexes included: glibc's
/// static initializer is all zeros).
pub fn zeroed<T>() -> T {
    // SAFETY: used only for libibverbs' plain C structs, for which all-zero is valid.
    unsafe { std::mem::zeroed() }
}

/// Sets `errno` for the program.
pub fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno.
    unsafe { *libc::__errno_location() = e };
}
