//! The C interface (`include/ib_quiesce.h`): one channel per process over the rdma-core
//! backend, behind the process-wide [`Shared`] that the control thread also drives.
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Arc, OnceLock};

use crate::channel::{Channel, Endpoint};
use crate::control::{self, Shared};
use crate::rdma::Rdma;
use crate::verbs::{Opcode, QpCaps, RecvWr, SendOp, SendWr, Sge};

static CHANNEL: OnceLock<Arc<Shared<Rdma>>> = OnceLock::new();

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// `struct ibq_wc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbqWc {
    wr_id: u64,
    status: u32,
    opcode: u32,
    byte_len: u32,
    qpn: u32,
}

fn fail(message: impl std::fmt::Display) -> c_int {
    let text = CString::new(message.to_string().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
    -1
}

/// Runs `f` on the open channel, turning errors and panics into -1 and the last error.
fn with<F>(f: F) -> c_int
where
    F: FnOnce(&Shared<Rdma>) -> Result<c_int, String>,
{
    let Some(ch) = CHANNEL.get() else {
        return fail("ibq_open has not been called");
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(ch))) {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => fail(e),
        Err(_) => fail("internal error (panic) in ib-quiesce"),
    }
}

/// Opens the device and starts the control thread under a ckpt agent.
///
/// # Safety
/// `device` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ibq_open(device: *const c_char) -> c_int {
    if CHANNEL.get().is_some() {
        return fail("ibq_open: the channel is already open");
    }
    let name = if device.is_null() {
        String::new()
    } else {
        // SAFETY: the caller passes a NUL-terminated string.
        unsafe { CStr::from_ptr(device) }
            .to_string_lossy()
            .into_owned()
    };
    let r = std::panic::catch_unwind(|| Channel::open(Rdma::new(), &name));
    match r {
        Ok(Ok(ch)) => {
            let shared = Shared::new(ch);
            if CHANNEL.set(shared.clone()).is_err() {
                return fail("ibq_open: the channel is already open");
            }
            control::start(&shared);
            0
        }
        Ok(Err(e)) => fail(e),
        Err(_) => fail("internal error (panic) in ib-quiesce"),
    }
}

/// # Safety
/// `addr` points at `len` bytes the caller keeps; `key` is writable.
#[no_mangle]
pub unsafe extern "C" fn ibq_reg_mr(
    addr: *mut c_void,
    len: usize,
    access: c_int,
    key: *mut u32,
) -> c_int {
    with(|s| {
        let k = s
            .call(|c| c.reg_mr(addr as u64, len, access as u32))
            .map_err(|e| e.to_string())?;
        // SAFETY: the caller passes a writable pointer.
        unsafe { *key = k };
        Ok(0)
    })
}

/// # Safety
/// `cq` is writable.
#[no_mangle]
pub unsafe extern "C" fn ibq_create_cq(cqe: c_int, cq: *mut u32) -> c_int {
    with(|s| {
        let id = s
            .call(|c| c.create_cq(cqe.max(1) as u32))
            .map_err(|e| e.to_string())?;
        // SAFETY: the caller passes a writable pointer.
        unsafe { *cq = id };
        Ok(0)
    })
}

/// # Safety
/// `qpn` is writable.
#[no_mangle]
pub unsafe extern "C" fn ibq_create_qp(
    send_cq: u32,
    recv_cq: u32,
    max_send_wr: u32,
    max_recv_wr: u32,
    qpn: *mut u32,
) -> c_int {
    with(|s| {
        let caps = QpCaps {
            max_send_wr,
            max_recv_wr,
            max_sge: 1,
        };
        let q = s
            .call(|c| c.create_qp(send_cq, recv_cq, caps))
            .map_err(|e| e.to_string())?;
        // SAFETY: the caller passes a writable pointer.
        unsafe { *qpn = q };
        Ok(0)
    })
}

/// # Safety
/// `buf` has room for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ibq_endpoint(qpn: u32, buf: *mut c_char, len: usize) -> c_int {
    with(|s| {
        let ep = s.call(|c| c.endpoint(qpn)).map_err(|e| e.to_string())?;
        let text = serde_json::to_string(&ep).map_err(|e| e.to_string())?;
        if text.len() + 1 > len {
            return Err(format!(
                "ibq_endpoint: the endpoint needs {} bytes, the buffer has {len}",
                text.len() + 1
            ));
        }
        // SAFETY: checked that text and its NUL fit in `len` bytes at `buf`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, text.len());
            *buf.add(text.len()) = 0;
        }
        Ok(0)
    })
}

/// # Safety
/// `peer` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ibq_connect(qpn: u32, peer: *const c_char) -> c_int {
    with(|s| {
        if peer.is_null() {
            return Err("ibq_connect: no peer endpoint".into());
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(peer) }.to_string_lossy();
        let ep: Endpoint = serde_json::from_str(&text)
            .map_err(|e| format!("ibq_connect: not an ibq_endpoint text: {e}"))?;
        s.call(|c| c.connect(qpn, ep)).map_err(|e| e.to_string())?;
        Ok(0)
    })
}

/// # Safety
/// `addr`..`addr + len` lies in memory registered under `lkey`.
#[no_mangle]
pub unsafe extern "C" fn ibq_post_send(
    qpn: u32,
    wr_id: u64,
    op: c_int,
    addr: *const c_void,
    len: u32,
    lkey: u32,
    remote_addr: u64,
    rkey: u32,
    signaled: c_int,
) -> c_int {
    with(|s| {
        let op = match op {
            0 => SendOp::Send,
            1 => SendOp::Write { remote_addr, rkey },
            other => return Err(format!("ibq_post_send: unknown operation {other}")),
        };
        let wr = SendWr {
            wr_id,
            op,
            sges: vec![Sge {
                addr: addr as u64,
                len,
                lkey,
            }],
            signaled: signaled != 0,
        };
        s.call(|c| c.post_send(qpn, &wr))
            .map_err(|e| e.to_string())?;
        Ok(0)
    })
}

/// # Safety
/// `addr`..`addr + len` lies in memory registered under `lkey`.
#[no_mangle]
pub unsafe extern "C" fn ibq_post_recv(
    qpn: u32,
    wr_id: u64,
    addr: *mut c_void,
    len: u32,
    lkey: u32,
) -> c_int {
    with(|s| {
        let wr = RecvWr {
            wr_id,
            sges: vec![Sge {
                addr: addr as u64,
                len,
                lkey,
            }],
        };
        s.call(|c| c.post_recv(qpn, &wr))
            .map_err(|e| e.to_string())?;
        Ok(0)
    })
}

/// # Safety
/// `wc` has room for `max` entries.
#[no_mangle]
pub unsafe extern "C" fn ibq_poll_cq(cq: u32, max: c_int, wc: *mut IbqWc) -> c_int {
    with(|s| {
        let got = s
            .call(|c| c.poll_cq(cq, max.max(0) as usize))
            .map_err(|e| e.to_string())?;
        for (i, c) in got.iter().enumerate() {
            // SAFETY: at most `max` entries, which the caller has room for.
            unsafe {
                *wc.add(i) = IbqWc {
                    wr_id: c.wr_id,
                    status: c.status,
                    opcode: match c.opcode {
                        Opcode::Send => 0,
                        Opcode::Recv => 1,
                    },
                    byte_len: c.byte_len,
                    qpn: c.qpn,
                }
            };
        }
        Ok(got.len() as c_int)
    })
}

/// The real QP number behind a virtual one, 0 if unknown.
#[no_mangle]
pub extern "C" fn ibq_real_qpn(qpn: u32) -> u32 {
    CHANNEL
        .get()
        .and_then(|s| s.peek(|c| c.real_qpn(qpn).ok()))
        .unwrap_or(0)
}

/// The real rkey behind a virtual key, 0 if unknown.
#[no_mangle]
pub extern "C" fn ibq_real_rkey(key: u32) -> u32 {
    CHANNEL
        .get()
        .and_then(|s| s.peek(|c| c.real_rkey(key).ok()))
        .unwrap_or(0)
}

/// Rebuilds completed since the process started.
#[no_mangle]
pub extern "C" fn ibq_rebuilds() -> u64 {
    CHANNEL.get().map(|s| s.rebuilds()).unwrap_or(0)
}

/// The last error of this thread, valid until its next failing call.
#[no_mangle]
pub extern "C" fn ibq_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
