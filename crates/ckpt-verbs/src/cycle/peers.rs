//! Which peers' endpoints the layer asks for at a rebuild ([`ib_quiesce::control::Wants`]).
//!
//! A rebuild names the addresses the layer knows: its contexts' own (node-mates share them,
//! and a new QP's number must not be one they made known), its connections' peers and its
//! address handles'. The reconnect brings the endpoints of every QP at those addresses
//! ([`crate::lookup::learn`]); a peer met after it is looked up by itself
//! ([`crate::lookup::meet`]).
use std::sync::atomic::Ordering::Relaxed;

use ib_quiesce::control::Wants;

use super::{all, each};
use crate::shadow::{layer, lock, ShadowAh, ShadowCtx, ShadowQp};

/// The addresses to name at a rebuild, or every endpoint of the job when a context has none
/// yet (it made no connection and no address handle, so the layer does not know which of the
/// node's addresses its peers know it by).
pub(super) fn named() -> Wants {
    let l = layer();
    let mut out = Vec::new();
    // SAFETY: live shadows (the gate is closed while the layer rebuilds).
    unsafe {
        for c in each::<ShadowCtx>(&l.contexts) {
            match (*c).ident.load(Relaxed) {
                0 => return Wants::All,
                me => out.push(me),
            }
        }
        for qp in all::<ShadowQp>(&l.qps) {
            if let Some((peer, _)) = *lock(&qp.peer) {
                out.push(peer);
            }
        }
        for ah in all::<ShadowAh>(&l.ahs) {
            out.push(ah.dest);
        }
    }
    Wants::Addresses(out).sorted()
}
