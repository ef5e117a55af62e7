//! The agent's own types as the wire protocol types them: a part's state and how it ended
//! ([`Observed`]), a process's state (the letter of `/proc/PID/stat`), where a copy of the
//! images is ([`Location`]), and ib-quiesce's QP endpoints.
//!
//! Endpoints are converted by functions rather than `From`/`TryFrom`: both types are foreign
//! to this crate (the orphan rule), and the coordinator, which only routes them, must not
//! depend on ib-quiesce.
use ckpt_proto::v1 as pb;
use ib_quiesce::verbs::Port;
use ib_quiesce::Endpoint;

use crate::copies::Location;
use crate::jobs::Observed;

impl Observed {
    /// The part's state on the wire, and how it ended when it did (`None`: not known).
    pub fn to_wire(&self) -> (pb::PartState, Option<pb::JobEnd>) {
        match self {
            Observed::Running => (pb::PartState::Running, None),
            Observed::Exited(e) => (
                pb::PartState::Exited,
                match (e.code, e.signal) {
                    (Some(c), _) => Some(pb::JobEnd::exited(c)),
                    (None, Some(s)) => Some(pb::JobEnd::killed(s)),
                    (None, None) => None,
                },
            ),
            Observed::Lost => (pb::PartState::Absent, None),
        }
    }
}

impl From<Location> for pb::CopyLocation {
    fn from(l: Location) -> Self {
        match l {
            Location::Local => pb::CopyLocation::Local,
            Location::Partner => pb::CopyLocation::Partner,
            Location::Shared => pb::CopyLocation::Shared,
            Location::Parity => pb::CopyLocation::Parity,
        }
    }
}

/// The one-letter process states of `/proc/PID/stat` (see proc(5)) and their wire values.
/// Letters not listed are [`pb::ProcessState::Other`].
pub const PROCESS_STATES: [(char, pb::ProcessState); 9] = [
    ('R', pb::ProcessState::Running),
    ('S', pb::ProcessState::Sleeping),
    ('D', pb::ProcessState::DiskSleep),
    ('T', pb::ProcessState::Stopped),
    ('t', pb::ProcessState::Traced),
    ('Z', pb::ProcessState::Zombie),
    ('X', pb::ProcessState::Dead),
    ('x', pb::ProcessState::Dead),
    ('I', pb::ProcessState::Idle),
];

/// The wire state of a process whose `/proc/PID/stat` state letter is `letter`.
pub fn process_state(letter: char) -> pb::ProcessState {
    PROCESS_STATES
        .iter()
        .find(|(l, _)| *l == letter)
        .map_or(pb::ProcessState::Other, |&(_, s)| s)
}

/// A QP endpoint from the coordinator that cannot be an ib-quiesce endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadEndpoint {
    /// No QP id: the coordinator could not have routed it.
    #[error("an endpoint without its QP id (is ckptd older than this agent?)")]
    NoId,
    /// The GID is not 16 bytes.
    #[error("endpoint of QP {qpn:#x} of channel {channel:#x}: GID of {len} bytes, not 16")]
    GidLength {
        /// The QP's channel.
        channel: u64,
        /// Its virtual QP number.
        qpn: u32,
        /// The GID's length.
        len: usize,
    },
    /// A field larger than its verbs type.
    #[error("endpoint of QP {qpn:#x} of channel {channel:#x}: {field} {value} is out of range")]
    OutOfRange {
        /// The QP's channel.
        channel: u64,
        /// Its virtual QP number.
        qpn: u32,
        /// Which field ("lid", "link_layer").
        field: &'static str,
        /// Its value.
        value: u32,
    },
}

/// An ib-quiesce endpoint on the wire.
pub fn endpoint_to_wire(e: &Endpoint) -> pb::QpEndpoint {
    pb::QpEndpoint {
        id: Some(pb::QpRef {
            channel: e.id.0,
            qpn: e.id.1,
        }),
        device: e.port.device.clone(),
        lid: e.port.lid.into(),
        gid: e.port.gid.to_vec(),
        link_layer: e.port.link_layer.into(),
        qpn: e.qpn,
        psn: e.psn,
        ctrl_addr: e.ctrl_addr,
        ctrl_rkey: e.ctrl_rkey,
        rkeys: e
            .rkeys
            .iter()
            .map(|&(virtual_rkey, real_rkey)| pb::MrKey {
                virtual_rkey,
                real_rkey,
            })
            .collect(),
    }
}

/// The ib-quiesce endpoint a wire endpoint describes, checked: it names its QP, its GID has 16
/// bytes, its LID and link layer fit their verbs types.
pub fn endpoint_from_wire(e: pb::QpEndpoint) -> Result<Endpoint, BadEndpoint> {
    let id = e.id.ok_or(BadEndpoint::NoId)?;
    let (channel, qpn) = (id.channel, id.qpn);
    let gid: [u8; 16] = e
        .gid
        .as_slice()
        .try_into()
        .map_err(|_| BadEndpoint::GidLength {
            channel,
            qpn,
            len: e.gid.len(),
        })?;
    let range = |field, value: u32| BadEndpoint::OutOfRange {
        channel,
        qpn,
        field,
        value,
    };
    Ok(Endpoint {
        id: (channel, qpn),
        port: Port {
            device: e.device,
            lid: u16::try_from(e.lid).map_err(|_| range("lid", e.lid))?,
            gid,
            link_layer: u8::try_from(e.link_layer)
                .map_err(|_| range("link_layer", e.link_layer))?,
        },
        qpn: e.qpn,
        psn: e.psn,
        ctrl_addr: e.ctrl_addr,
        ctrl_rkey: e.ctrl_rkey,
        rkeys: e
            .rkeys
            .iter()
            .map(|k| (k.virtual_rkey, k.real_rkey))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shim::Exit;

    #[test]
    fn every_proc_letter_has_its_state_and_others_are_other() {
        for (letter, state) in PROCESS_STATES {
            assert_eq!(process_state(letter), state, "{letter}");
            assert_ne!(state, pb::ProcessState::Other);
        }
        assert_eq!(process_state('R').name(), "running");
        assert_eq!(process_state('D').name(), "disk-wait");
        assert_eq!(process_state('t'), pb::ProcessState::Traced);
        assert_eq!(process_state('P'), pb::ProcessState::Other);
        assert_eq!(process_state('?'), pb::ProcessState::Other);
        // Every wire state but UNSPECIFIED and OTHER comes from some letter.
        for n in 1..=8 {
            let s = pb::ProcessState::try_from(n).unwrap();
            assert!(PROCESS_STATES.iter().any(|&(_, x)| x == s), "{s:?}");
        }
    }

    #[test]
    fn observed_states_and_ends_on_the_wire() {
        let exit = |code, signal| {
            Observed::Exited(Exit {
                code,
                signal,
                ended: 0,
            })
        };
        assert_eq!(Observed::Running.to_wire(), (pb::PartState::Running, None));
        assert_eq!(Observed::Lost.to_wire(), (pb::PartState::Absent, None));
        assert_eq!(
            exit(Some(3), None).to_wire(),
            (pb::PartState::Exited, Some(pb::JobEnd::exited(3)))
        );
        assert_eq!(
            exit(None, Some(9)).to_wire(),
            (pb::PartState::Exited, Some(pb::JobEnd::killed(9)))
        );
        assert_eq!(exit(None, None).to_wire(), (pb::PartState::Exited, None));
    }

    #[test]
    fn copy_locations_on_the_wire() {
        for l in [
            Location::Local,
            Location::Partner,
            Location::Shared,
            Location::Parity,
        ] {
            assert_eq!(pb::CopyLocation::from(l).name(), l.name());
        }
    }

    fn endpoint() -> Endpoint {
        Endpoint {
            id: (0x0123_4567_89ab_cdef, 0x710003),
            port: Port {
                device: "rxe0".into(),
                lid: 0xbeef,
                gid: std::array::from_fn(|i| i as u8 * 17),
                link_layer: ib_quiesce::verbs::LINK_ETHERNET,
            },
            qpn: 0x11,
            psn: 0xabcdef,
            ctrl_addr: 0x7fff_0000_1000,
            ctrl_rkey: 77,
            rkeys: vec![(1, 1001), (2, 1002)],
        }
    }

    #[test]
    fn an_endpoint_survives_the_wire_and_a_bad_one_is_refused() {
        let e = endpoint();
        let wire = endpoint_to_wire(&e);
        assert_eq!(wire.gid.len(), 16);
        assert_eq!(endpoint_from_wire(wire.clone()), Ok(e));

        let mut short = wire.clone();
        short.gid.truncate(4);
        let err = endpoint_from_wire(short).unwrap_err();
        assert_eq!(
            err,
            BadEndpoint::GidLength {
                channel: 0x0123_4567_89ab_cdef,
                qpn: 0x710003,
                len: 4
            }
        );
        assert!(err.to_string().contains("GID of 4 bytes, not 16"), "{err}");

        let mut no_id = wire.clone();
        no_id.id = None;
        assert_eq!(endpoint_from_wire(no_id), Err(BadEndpoint::NoId));

        let mut lid = wire;
        lid.lid = 70_000;
        let err = endpoint_from_wire(lid).unwrap_err();
        assert!(
            err.to_string().contains("lid 70000 is out of range"),
            "{err}"
        );
    }
}
