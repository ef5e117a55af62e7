//! The work requests a shadow QP notes between `ibv_wr_start` and `ibv_wr_complete`
//! ([`crate::extended`]'s builders), and the chain they are posted as.
use std::os::raw::c_int;
use std::ptr::null_mut;

use ibverbs_sys as ffi;
use smallvec::SmallVec;

/// One work request of a session: the request as `ibv_post_send` takes it (its list and link
/// set when posted), its scatter list and its inline data.
#[derive(Clone)]
pub(crate) struct Noted {
    pub(crate) wr: ffi::ibv_send_wr,
    pub(crate) sges: SmallVec<[ffi::ibv_sge; 2]>,
    pub(crate) inline: Vec<u8>,
}

/// The work requests of one QP since `ibv_wr_start`.
#[derive(Default)]
pub struct Session {
    noted: Vec<Noted>,
    /// The first error of a builder (posted nothing at `ibv_wr_complete`), 0 if none.
    pub(crate) error: c_int,
    /// The chain handed to the post, kept between sessions for its capacity.
    chain: Vec<ffi::ibv_send_wr>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("requests", &self.noted.len())
            .field("error", &self.error)
            .finish()
    }
}

impl Session {
    /// Starts over (`ibv_wr_start`, `ibv_wr_abort`).
    pub(crate) fn clear(&mut self) {
        self.noted.clear();
        self.error = 0;
    }

    /// A new request with the program's id and flags.
    pub(crate) fn begin(&mut self, wr_id: u64, flags: u32, opcode: u32) -> &mut ffi::ibv_send_wr {
        let mut wr: ffi::ibv_send_wr = crate::real::zeroed();
        wr.wr_id = wr_id;
        wr.send_flags = flags;
        wr.opcode = opcode;
        self.noted.push(Noted {
            wr,
            sges: SmallVec::new(),
            inline: Vec::new(),
        });
        &mut self.noted.last_mut().expect("just pushed").wr
    }

    /// The request a setter applies to: the last one begun (an error if none).
    pub(crate) fn last(&mut self) -> Option<&mut Noted> {
        if self.noted.is_empty() && self.error == 0 {
            self.error = libc::EINVAL;
        }
        self.noted.last_mut()
    }

    /// Links the noted requests into a chain for `ibv_post_send`: each with its own list, the
    /// inline ones pointing at their copied data. The chain points into the session, which
    /// must not change until the post returns.
    pub(crate) fn link(&mut self) -> *mut ffi::ibv_send_wr {
        let Session { noted, chain, .. } = self;
        chain.clear();
        for n in noted.iter_mut() {
            let mut wr = n.wr;
            if wr.send_flags & ffi::ibv_send_flags::IBV_SEND_INLINE.0 != 0 && !n.inline.is_empty() {
                n.sges.clear();
                n.sges.push(ffi::ibv_sge {
                    addr: n.inline.as_ptr() as u64,
                    length: n.inline.len() as u32,
                    lkey: 0,
                });
            }
            wr.sg_list = if n.sges.is_empty() {
                null_mut()
            } else {
                n.sges.as_mut_ptr()
            };
            wr.num_sge = n.sges.len() as c_int;
            chain.push(wr);
        }
        let base = chain.as_mut_ptr();
        let len = chain.len();
        for (i, w) in chain.iter_mut().enumerate() {
            w.next = if i + 1 < len {
                base.wrapping_add(i + 1)
            } else {
                null_mut()
            };
        }
        if len == 0 {
            null_mut()
        } else {
            base
        }
    }
}
