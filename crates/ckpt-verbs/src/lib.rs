//! libckpt_verbs.so: the verbs layer of unmodified InfiniBand programs.
//!
//! The node agent preloads this library (`LD_PRELOAD`) into the processes of a job on a node
//! with RDMA devices. It defines libibverbs' exported calls, so the program, and the MPI and
//! communication libraries inside it (UCX's `rc_verbs` and `ud_verbs`), get *shadow* objects
//! ([`shadow`]) instead of libibverbs' own: a context whose operation table routes the inline
//! fast path (`ibv_post_send`, `ibv_poll_cq`...) through [`fastpath`], and QPs and memory
//! regions with virtual numbers and keys ([`xlate`]) that stay the same when the real objects
//! behind them are released before a snapshot and created again after it.
//!
//! What the layer cannot take through a checkpoint is hidden or refused, so libraries fall
//! back to what it can: the extended verbs (`ibv_create_cq_ex`, DEVX...) are absent from the
//! shadow context, except the newer post calls (`ibv_create_qp_ex`, `ibv_wr_*`), which
//! [`extended`] offers over the same fast path; imports, dmabuf regions and ECE answer
//! EOPNOTSUPP and are named in the status ([`status`]). Multicast, which a program cannot do without, goes through
//! to the real QP; while a group is attached the layer tells the agent, which then refuses to
//! checkpoint the process (nothing rebuilds the group). `docs/infiniband.md` lists what each
//! supported stack calls and how each call is handled.
#![warn(missing_docs)]

pub mod cycle;
pub mod events;
pub mod exports;
pub mod extended;
pub mod fastpath;
pub mod gate;
pub mod lookup;
pub mod real;
pub mod shadow;
pub mod status;
pub mod xlate;
