//! How the layer learns where its peers are after a reconnect: the endpoints a rebuild
//! brought ([`learn`]), and those of a peer at an address it meets afterwards ([`meet`]).
//!
//! After a reconnect, a program that connects to, or sends a datagram to, a peer at another
//! address (UCX does when a restarted rank meets a peer for the first time), or receives one
//! from such a peer, makes the layer ask its node's agent for that address once; the agent
//! keeps the whole job's endpoints once per node.
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use ib_quiesce::control::SOCKET_ENV;
use ib_quiesce::Endpoint;

use crate::shadow::{layer, stage, Stage};
use crate::xlate::PeerPort;

/// How long a lookup may take. The agent answers from memory; a layer without an answer
/// goes on untranslated for that address rather than hold the program.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// Learns peers' new endpoints: where their ports are now, their QPs' real numbers and their
/// memory's real keys.
pub fn learn(eps: &[Endpoint]) {
    let t = &layer().tables;
    for e in eps {
        let peer = e.id.0;
        t.set_peer(
            peer,
            PeerPort {
                gid: e.port.gid,
                lid: e.port.lid,
            },
        );
        t.set_remote_qpn(peer, e.id.1, e.qpn);
        for &(v, r) in &e.rkeys {
            t.set_remote_rkey(peer, v, r);
        }
    }
}

/// The program meets address `id` (one it names a peer by, or where a datagram came from)
/// after a reconnect: if the layer holds no endpoints there, it asks the agent, once until the
/// next reconnect. Without an agent or an answer, the address is not asked again and its
/// numbers go through as the program gave them (the status names the failure).
pub fn meet(id: u64) {
    let t = &layer().tables;
    if !t.needs_lookup(id) || stage() != Stage::Up {
        return;
    }
    static SOCKET: OnceLock<Option<PathBuf>> = OnceLock::new();
    if let Some(socket) = SOCKET.get_or_init(|| std::env::var_os(SOCKET_ENV).map(PathBuf::from)) {
        match ib_quiesce::control::lookup(socket, &[id], LOOKUP_TIMEOUT) {
            Ok(eps) => {
                learn(&eps);
                crate::status::looked_up(id, eps.len(), None);
            }
            Err(e) => crate::status::looked_up(id, 0, Some(e.to_string())),
        }
    }
    t.know(id);
}
