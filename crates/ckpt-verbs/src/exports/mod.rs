//! The exported libibverbs calls this layer defines. A program's references to them (through
//! any version: an unversioned definition in a preloaded object satisfies `name@IBVERBS_1.x`)
//! bind here; each call is passed on to libibverbs with the real objects behind the shadows.
//!
//! Every exported call that takes a verbs object is defined, not only those UCX uses: a
//! shadow handed to libibverbs would be read as its private context and crash. libibverbs and
//! the providers call some of these functions with their *real* objects too (rxe asks for a
//! GID while creating an AH); a call whose object is not a shadow passes straight through.
//!
//! - `device.rs`: contexts, asynchronous events, queries, PDs, memory regions, and the calls
//!   refused (`ibv_import_*`, `ibv_reg_dmabuf_mr`, `ibv_rereg_mr`).
//! - `queues.rs`: completion channels and queues, SRQs and address handles.
//! - `qps.rs`: QPs, the QP calls refused (ECE), and multicast, passed through and reported in
//!   use; the extended QP's `create_qp_ex` and `ibv_qp_to_qp_ex` (its builders are
//!   [`crate::extended`]'s).
// Each function here is libibverbs' call of the same name, with the contract verbs.h and its
// manual page give it; they are not restated per function.
#![allow(clippy::missing_safety_doc)]

mod device;
mod qps;
mod queues;

#[cfg(test)]
pub(crate) use qps::create_qp_ex;
pub(crate) use queues::real_channel;

pub(crate) use crate::real::set_errno;

/// The real function, or `errno = ENOSYS` and `$fail` when this libibverbs lacks it.
macro_rules! real_or {
    ($name:ident) => {
        match crate::real::real().$name {
            Some(f) => f,
            None => {
                crate::exports::set_errno(libc::ENOSYS);
                return;
            }
        }
    };
    ($name:ident, $fail:expr) => {
        match crate::real::real().$name {
            Some(f) => f,
            None => {
                crate::exports::set_errno(libc::ENOSYS);
                return $fail;
            }
        }
    };
}
pub(crate) use real_or;

#[cfg(test)]
mod tests;
