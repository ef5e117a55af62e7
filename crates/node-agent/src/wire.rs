//! The agent's own types as the wire protocol types them: where a copy of the images is
//! ([`Location`]).
use ckpt_proto::v1 as pb;

use crate::copies::Location;

impl From<Location> for pb::CopyLocation {
    fn from(l: Location) -> Self {
        match l {
            Location::Local => pb::CopyLocation::Local,
            Location::Partner => pb::CopyLocation::Partner,
            Location::Shared => pb::CopyLocation::Shared,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_locations_on_the_wire() {
        for l in [Location::Local, Location::Partner, Location::Shared] {
            assert_eq!(pb::CopyLocation::from(l).name(), l.name());
        }
    }
}
