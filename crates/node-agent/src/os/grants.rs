//! Grants from the coordinator for restarts that move a part: the node a part moved to may
//! fetch, for a while, the partner copy this node keeps of the images of the node the part ran
//! on. Without one, a node fetches only its own images back. Under an erasure-coded scheme the
//! members of a group read each other's images by range, and a node rebuilding a lost member
//! reads the parity the others hold, each with a grant of its own.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The longest a grant lasts, whatever the coordinator asks.
pub const MAX_TTL: Duration = Duration::from_secs(3600);

/// The most grants kept at once; the oldest go first.
const MAX_GRANTS: usize = 1024;

#[derive(Debug)]
struct Grant {
    job: u64,
    epoch: u32,
    node: String,
    grantee: String,
    digest: String,
    /// A grant for the parity this node holds of the epoch (`node` and `digest` empty).
    parity: bool,
    until: Instant,
}

/// Live grants of one agent (in memory: an agent restart forgets them, and the restore then
/// falls back to shared storage).
#[derive(Debug, Default)]
pub struct Grants {
    list: Mutex<Vec<Grant>>,
}

impl Grants {
    /// Lets `grantee` fetch `node`'s images of one epoch, with that committed digest, for
    /// `ttl` (at most [`MAX_TTL`]).
    pub fn allow(
        &self,
        job: u64,
        epoch: u32,
        node: &str,
        grantee: &str,
        digest: &str,
        ttl: Duration,
    ) {
        self.push(job, epoch, node, grantee, digest, false, ttl);
    }

    /// Lets `grantee` read the parity this node holds of one epoch, for `ttl` (at most
    /// [`MAX_TTL`]).
    pub fn allow_parity(&self, job: u64, epoch: u32, grantee: &str, ttl: Duration) {
        self.push(job, epoch, "", grantee, "", true, ttl);
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &self,
        job: u64,
        epoch: u32,
        node: &str,
        grantee: &str,
        digest: &str,
        parity: bool,
        ttl: Duration,
    ) {
        let now = Instant::now();
        let mut l = self.list.lock().expect("grants lock");
        l.retain(|g| g.until > now);
        if l.len() >= MAX_GRANTS {
            l.remove(0);
        }
        l.push(Grant {
            job,
            epoch,
            node: node.into(),
            grantee: grantee.into(),
            digest: digest.into(),
            parity,
            until: now + ttl.min(MAX_TTL),
        });
    }

    /// Whether `grantee` may fetch `node`'s images of that epoch, with that digest, now.
    pub fn permits(&self, grantee: &str, job: u64, epoch: u32, node: &str, digest: &str) -> bool {
        let now = Instant::now();
        !digest.is_empty()
            && self.list.lock().expect("grants lock").iter().any(|g| {
                g.until > now
                    && g.job == job
                    && g.epoch == epoch
                    && g.node == node
                    && g.grantee == grantee
                    && g.digest == digest
                    && !g.parity
            })
    }

    /// Whether `grantee` may read the parity this node holds of that epoch, now.
    pub fn permits_parity(&self, grantee: &str, job: u64, epoch: u32) -> bool {
        let now = Instant::now();
        self.list.lock().expect("grants lock").iter().any(|g| {
            g.until > now && g.parity && g.job == job && g.epoch == epoch && g.grantee == grantee
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_covers_one_grantee_one_copy_and_expires() {
        let g = Grants::default();
        g.allow(7, 2, "n3", "n4", "d1", Duration::from_millis(200));
        assert!(g.permits("n4", 7, 2, "n3", "d1"));
        for (grantee, job, epoch, node, digest) in [
            ("n2", 7, 2, "n3", "d1"),
            ("n4", 8, 2, "n3", "d1"),
            ("n4", 7, 1, "n3", "d1"),
            ("n4", 7, 2, "n1", "d1"),
            ("n4", 7, 2, "n3", "d2"),
            ("n4", 7, 2, "n3", ""),
        ] {
            assert!(
                !g.permits(grantee, job, epoch, node, digest),
                "{grantee} {job} {epoch} {node} {digest:?}"
            );
        }
        // A grant for images is none for parity, and the other way round.
        assert!(!g.permits_parity("n4", 7, 2));
        g.allow_parity(7, 2, "n5", Duration::from_millis(200));
        assert!(g.permits_parity("n5", 7, 2));
        assert!(!g.permits_parity("n5", 7, 1) && !g.permits_parity("n4", 7, 2));
        assert!(
            !g.permits("n5", 7, 2, "", ""),
            "a parity grant reads no images"
        );
        std::thread::sleep(Duration::from_millis(250));
        assert!(!g.permits("n4", 7, 2, "n3", "d1"), "expired");
        assert!(!g.permits_parity("n5", 7, 2), "expired");
    }

    #[test]
    fn grants_are_bounded_and_capped_in_time() {
        let g = Grants::default();
        for j in 0..(MAX_GRANTS as u64 + 10) {
            g.allow(j, 1, "n3", "n4", "d", Duration::from_secs(u64::MAX / 4));
        }
        assert_eq!(g.list.lock().unwrap().len(), MAX_GRANTS);
        assert!(!g.permits("n4", 0, 1, "n3", "d"), "the oldest went first");
        let until = g.list.lock().unwrap()[0].until;
        assert!(until <= Instant::now() + MAX_TTL);
    }
}
