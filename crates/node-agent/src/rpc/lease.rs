//! The node's lease from the coordinator, and the fence it keeps: no part of a job runs on a
//! node cut off from ckptd once ckptd may restart it elsewhere.
//!
//! ckptd grants a lease (`fence_lease` in ckptd.toml) with every answered registration and
//! heartbeat. The agent writes the time of the last call ckptd answered, as it was when the call
//! was *sent*, with the lease, to `lease.json` in its state directory. Every job's shim reads that
//! file and kills its part once the lease has run out ([`Expiry::check`]); the agent starts no
//! part while it has. ckptd declares a node lost only after `node_timeout` without a heartbeat,
//! and `fence_lease` < `node_timeout` (checked when ckptd starts), so:
//!
//! ```text
//!   ckptd's last heartbeat from the node   R >= S   (the call's send time, S, on the node)
//!   the node's parts are dead by           S + fence_lease + SHIM_TICK + the kill
//!   ckptd may restart them elsewhere at    R + node_timeout >= S + node_timeout
//! ```
//!
//! A part is therefore dead before ckptd can restart it elsewhere as long as `node_timeout -
//! fence_lease` exceeds the shims' tick and the time a kill takes (milliseconds). The times are
//! `CLOCK_BOOTTIME`, which neither a clock change nor a suspend bends, and which the shims share
//! with the agent: a restarted agent, or a dead one, leaves the fence standing. The file names the
//! boot it was written in; a lease from an earlier boot is no lease (its parts died with it).
//!
//! A part fenced writes `fenced.json` in its run directory; the heartbeat reports it, and ckptd
//! takes the job to `lost` as for a node that is down.
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The lease file, in the agent's state directory.
pub const FILE: &str = "lease.json";
/// Written in a part's run directory by the shim that fenced it.
pub const FENCED: &str = "fenced.json";
/// How often a shim reads the lease.
pub const SHIM_TICK: Duration = Duration::from_millis(100);

/// What `lease.json` holds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Lease {
    /// The boot it was written in (`/proc/sys/kernel/random/boot_id`, as a hash).
    pub boot: u64,
    /// When the last call ckptd answered was sent (`CLOCK_BOOTTIME`, ms).
    pub contact_ms: u64,
    /// The lease ckptd granted; 0: none (the part is never fenced).
    pub lease_ms: u64,
}

/// What a shim writes when it fenced its part.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Fenced {
    /// How long the node had not reached ckptd.
    pub after_ms: u64,
    /// The lease it had.
    pub lease_ms: u64,
}

/// `CLOCK_BOOTTIME` in milliseconds.
pub fn boottime_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to a valid local.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// This boot, as a number.
pub fn boot() -> u64 {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    // FNV-1a: stable across processes and builds, unlike the std hasher.
    id.trim().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Lease {
    /// How long past its lease the node is at `now_ms`; None while the lease holds, when there
    /// is none, or when it is from another boot.
    pub fn overdue(&self, boot: u64, now_ms: u64) -> Option<Duration> {
        if self.lease_ms == 0 || self.boot != boot {
            return None;
        }
        let since = now_ms.saturating_sub(self.contact_ms);
        (since > self.lease_ms).then(|| Duration::from_millis(since))
    }
}

/// The agent's side: records each answered call, and tells whether the lease has run out.
#[derive(Debug)]
pub struct Keeper {
    path: PathBuf,
    boot: u64,
    last: std::sync::Mutex<Option<Lease>>,
}

impl Keeper {
    /// The keeper of `state_dir`'s lease, with what an earlier agent run of this boot recorded.
    pub fn open(state_dir: &Path) -> Self {
        let path = state_dir.join(FILE);
        let boot = boot();
        let last = crate::os::modes::read_json::<Lease>(&path).filter(|l| l.boot == boot);
        Keeper {
            path,
            boot,
            last: std::sync::Mutex::new(last),
        }
    }

    /// The lease file the shims read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// ckptd answered a call sent at `sent_ms`, granting `lease_ms`. Returns how long the
    /// lease had run unrenewed when the answer came, if that was more than half of it: a node
    /// this close to fencing its parts says so.
    pub fn renew(&self, sent_ms: u64, lease_ms: u64) -> Option<Duration> {
        let answered = boottime_ms();
        let lease = Lease {
            boot: self.boot,
            contact_ms: sent_ms,
            lease_ms,
        };
        let mut last = self.last.lock().expect("lease lock");
        if last.is_some_and(|l| l.contact_ms > sent_ms) {
            return None;
        }
        let close = last
            .filter(|l| l.lease_ms > 0)
            .map(|l| (answered.saturating_sub(l.contact_ms), l.lease_ms))
            .filter(|&(unrenewed, lease)| unrenewed * 2 > lease)
            .map(|(unrenewed, _)| Duration::from_millis(unrenewed));
        *last = Some(lease);
        let bytes = serde_json::to_vec(&lease).expect("serializable");
        if let Err(e) = crate::os::modes::write_private(&self.path, &bytes) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot record the lease");
        }
        close
    }

    /// The lease granted last, if any.
    pub fn granted(&self) -> Option<Duration> {
        self.last
            .lock()
            .expect("lease lock")
            .filter(|l| l.lease_ms > 0)
            .map(|l| Duration::from_millis(l.lease_ms))
    }

    /// How long since ckptd last answered, when that is past the lease.
    pub fn overdue(&self) -> Option<(Duration, Duration)> {
        let l = (*self.last.lock().expect("lease lock"))?;
        l.overdue(self.boot, boottime_ms())
            .map(|d| (d, Duration::from_millis(l.lease_ms)))
    }
}

/// The shim's side: reads the lease each tick.
#[derive(Debug)]
pub struct Expiry {
    path: PathBuf,
    boot: u64,
}

impl Expiry {
    /// Watches the lease at `path`.
    pub fn new(path: PathBuf) -> Self {
        Expiry { path, boot: boot() }
    }

    /// Whether the part must be fenced now, and why.
    pub fn check(&self) -> Option<Fenced> {
        let l = crate::os::modes::read_json::<Lease>(&self.path)?;
        l.overdue(self.boot, boottime_ms()).map(|d| Fenced {
            after_ms: d.as_millis() as u64,
            lease_ms: l.lease_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_runs_out_after_its_length_and_only_in_its_boot() {
        let l = Lease {
            boot: 7,
            contact_ms: 1_000,
            lease_ms: 500,
        };
        assert_eq!(l.overdue(7, 1_400), None);
        assert_eq!(l.overdue(7, 1_500), None);
        assert_eq!(l.overdue(7, 1_501), Some(Duration::from_millis(501)));
        assert_eq!(l.overdue(8, 9_000), None, "a lease of another boot");
        let none = Lease { lease_ms: 0, ..l };
        assert_eq!(none.overdue(7, 9_000), None, "no lease granted");
    }

    #[test]
    fn the_keeper_records_the_newest_answer_for_the_shims() {
        let d = tempfile::tempdir().unwrap();
        let k = Keeper::open(d.path());
        assert_eq!(k.overdue(), None);
        assert_eq!(Expiry::new(k.path().to_path_buf()).check(), None);
        let now = boottime_ms();
        assert_eq!(k.renew(now - 50_000, 60_000), None, "the first lease");
        // The next answer comes 50 s into the 60 s lease: said.
        let close = k.renew(now, 60_000).expect("over half of the lease");
        assert!(close >= Duration::from_secs(50), "{close:?}");
        assert_eq!(k.renew(now, 60_000), None, "renewed well within");
        // An answer to an older call, arriving late, does not move the contact back.
        assert_eq!(k.renew(now - 40_000, 60_000), None);
        let l: Lease = crate::os::modes::read_json(k.path()).unwrap();
        assert_eq!(l.contact_ms, now);
        assert_eq!(k.overdue(), None);
        // A call answered long ago: the shims fence, and a new keeper (a restarted agent)
        // knows it too.
        k.renew(now + 1, 1);
        std::thread::sleep(Duration::from_millis(5));
        let fenced = Expiry::new(k.path().to_path_buf()).check().unwrap();
        assert_eq!(fenced.lease_ms, 1);
        assert!(fenced.after_ms > 1);
        assert!(Keeper::open(d.path()).overdue().is_some());
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(k.path()).unwrap().mode() & 0o777, 0o600);
    }
}
