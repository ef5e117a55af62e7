//! Which endpoints a rebuilt channel is sent, and how it asks for more.
//!
//! An ib-quiesce channel names the peer QPs it connects to ([`Wants::Qps`]). The verbs layer
//! of an unmodified program cannot: after a restart the program may connect to a peer, or
//! send a datagram to one, that it never named before. So it names the addresses it knows
//! (its own, its connections' and its address handles'), is sent the endpoints of every QP
//! there ([`Wants::Addresses`]), and asks its node's agent for an address it meets later
//! ([`lookup`]). The agent keeps all of the job's endpoints once per node, from the last
//! reconnect, and answers from them: a process holds the endpoints of its peers, not of the
//! whole job.
use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use super::{
    read_line, FlagFor, LineBuf, ToAgent, ToChannel, MAX_ENDPOINTS_LINE, PROTOCOL_VERSION,
};
use crate::channel::{Endpoint, QpId};

/// Addresses one lookup may ask for: a rank meets its peers one at a time. Written out (at
/// most 21 bytes each), they fit in a line of [`super::MAX_LINE`].
pub const MAX_LOOKUP_ADDRESSES: usize = 1024;

/// Which peers' endpoints a rebuilt channel needs to reconnect.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Wants {
    /// Every endpoint of the job (a channel that cannot say).
    #[default]
    All,
    /// These QPs' (an ib-quiesce channel: its connections are all it has).
    Qps(Vec<QpId>),
    /// Those of every QP at these addresses (channel ids, [`address_id`]); the channel looks
    /// up others when it meets them, so its node keeps every endpoint of the job.
    Addresses(Vec<u64>),
}

impl Wants {
    /// As `rebuilt` carries it: `peers` and `addresses`.
    pub fn into_wire(self) -> (Option<Vec<QpId>>, Option<Vec<u64>>) {
        match self {
            Wants::All => (None, None),
            Wants::Qps(q) => (Some(q), None),
            Wants::Addresses(a) => (None, Some(a)),
        }
    }

    /// From a `rebuilt` answer's `peers` and `addresses`.
    pub fn from_wire(peers: Option<Vec<QpId>>, addresses: Option<Vec<u64>>) -> Self {
        match (addresses, peers) {
            (Some(a), _) => Wants::Addresses(a),
            (None, Some(q)) => Wants::Qps(q),
            (None, None) => Wants::All,
        }
    }

    /// Whether `e` is one of these (`All`: every one). The lists are sorted.
    pub fn covers(&self, e: &Endpoint) -> bool {
        match self {
            Wants::All => true,
            Wants::Qps(q) => q.binary_search(&e.id).is_ok(),
            Wants::Addresses(a) => addresses_of(e).any(|x| a.binary_search(&x).is_ok()),
        }
    }

    /// Sorts and deduplicates the lists, so that [`Wants::covers`] can search them.
    pub fn sorted(self) -> Self {
        match self {
            Wants::All => Wants::All,
            Wants::Qps(mut q) => {
                q.sort_unstable();
                q.dedup();
                Wants::Qps(q)
            }
            Wants::Addresses(mut a) => {
                a.sort_unstable();
                a.dedup();
                Wants::Addresses(a)
            }
        }
    }
}

/// The 64-bit id of a port address (a GID, or a LID in the last two bytes of an otherwise zero
/// value): FNV-1a of its bytes, never 0. The verbs layer names a process's channel by the id of
/// the address its peers know it by.
pub fn address_id(addr: &[u8; 16]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in addr {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}

/// The addresses endpoint `e` is at: the one its peers name it by (its channel id), and where
/// its port is now (its GID, and its LID on InfiniBand), which is what a datagram's completion
/// shows of its sender.
pub fn addresses_of(e: &Endpoint) -> impl Iterator<Item = u64> {
    let mut lid = [0u8; 16];
    lid[14..].copy_from_slice(&e.port.lid.to_be_bytes());
    let gid = (e.port.gid != [0; 16]).then(|| address_id(&e.port.gid));
    let lid = (e.port.lid != 0).then(|| address_id(&lid));
    std::iter::once(e.id.0).chain(gid).chain(lid)
}

/// Asks the agent at `socket` for the endpoints of the job's QPs at `addresses` ([`Wants`]),
/// on a connection of its own, within `timeout`. The agent knows the asking process by the
/// connection, as it knows a channel's, and answers from its job's endpoints only.
pub fn lookup(
    socket: &Path,
    addresses: &[u64],
    timeout: Duration,
) -> std::io::Result<Vec<Endpoint>> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let ask = ToAgent::Lookup {
        version: PROTOCOL_VERSION,
        pid: FlagFor::own().pid,
        addresses: addresses
            .iter()
            .copied()
            .take(MAX_LOOKUP_ADDRESSES)
            .collect(),
    };
    let mut line = serde_json::to_vec(&ask).map_err(std::io::Error::other)?;
    line.push(b'\n');
    s.write_all(&line)?;
    let mut r = BufReader::new(s);
    let answer =
        read_line(&mut r, &mut LineBuf::default(), MAX_ENDPOINTS_LINE)?.ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the agent closed the lookup without an answer",
            )
        })?;
    match ToChannel::decode(&answer) {
        Ok(ToChannel::Endpoints { endpoints }) => Ok(endpoints),
        Ok(other) => Err(std::io::Error::other(format!(
            "the agent answered a lookup with {other:?}"
        ))),
        Err(e) => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
    }
}
