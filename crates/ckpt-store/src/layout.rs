//! Where an epoch's images live in node-local staging:
//!
//! ```text
//! <local_dir>/<job>/<epoch>/<node>/            images as the engine wrote them
//! <local_dir>/<job>/<epoch>/<node>/MANIFEST    per-node manifest (written last)
//! ```
//!
//! Shared storage (`shared_dir`) uses the same layout, plus `<shared_dir>/<job>/<epoch>/COMMIT`
//! (see [`crate::commit`]).
use std::fs;
use std::path::{Path, PathBuf};

use crate::{Result, StoreError};

/// File name of the manifest inside a node's image directory, re-exported as
/// [`crate::manifest::FILE_NAME`]. It lives here, below both, so that [`crate::chain`] can name
/// the manifest in its errors without importing the module that checks chains with it.
pub const MANIFEST_FILE: &str = "MANIFEST";

/// Node-local staging area rooted at `local_dir`.
#[derive(Debug, Clone)]
pub struct Staging {
    root: PathBuf,
}

impl Staging {
    /// Staging rooted at `root` (created if missing).
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        fs::create_dir_all(&root).map_err(|e| StoreError::io("create", &root, e))?;
        Ok(Staging { root })
    }

    /// A store rooted at `root`, which is not created: for shared storage, whose mount must
    /// not be replaced by an empty local directory when it is missing.
    pub fn at(root: impl Into<PathBuf>) -> Self {
        Staging { root: root.into() }
    }

    /// The staging root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Directory of all epochs of a job.
    pub fn job_dir(&self, job: u64) -> PathBuf {
        self.root.join(job.to_string())
    }

    /// Directory of one epoch (all nodes).
    pub fn epoch_dir(&self, job: u64, epoch: u32) -> PathBuf {
        self.job_dir(job).join(epoch.to_string())
    }

    /// Directory of one node's images of one epoch. `node` is joined as it is: a name from a
    /// peer or a file goes through [`Staging::checked_node_dir`] instead.
    pub fn node_dir(&self, job: u64, epoch: u32, node: &str) -> PathBuf {
        self.epoch_dir(job, epoch).join(node)
    }

    /// [`Staging::node_dir`] for a node name that [`crate::validate::node_name`] accepts: never
    /// the epoch directory itself, its parent or anything outside it.
    pub fn checked_node_dir(&self, job: u64, epoch: u32, node: &str) -> Result<PathBuf> {
        let epoch_dir = self.epoch_dir(job, epoch);
        crate::error::check_node(&epoch_dir, node)?;
        Ok(epoch_dir.join(node))
    }

    /// Creates an empty node directory for a new epoch, removing leftovers of an earlier
    /// attempt with the same number. Refuses an invalid node name.
    pub fn create_node_dir(&self, job: u64, epoch: u32, node: &str) -> Result<PathBuf> {
        let dir = self.checked_node_dir(job, epoch, node)?;
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(|e| StoreError::io("remove", &dir, e))?;
        }
        fs::create_dir_all(&dir).map_err(|e| StoreError::io("create", &dir, e))?;
        Ok(dir)
    }

    /// Deletes one node's images of one epoch (and the epoch directory once empty). Refuses an
    /// invalid node name.
    pub fn remove_node_dir(&self, job: u64, epoch: u32, node: &str) -> Result<()> {
        let dir = self.checked_node_dir(job, epoch, node)?;
        match fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::io("remove", &dir, e)),
        }
        let _ = fs::remove_dir(self.epoch_dir(job, epoch));
        Ok(())
    }

    /// Deletes everything of one epoch in this store: this node's images and the copies it
    /// keeps for partner nodes.
    pub fn remove_epoch_dir(&self, job: u64, epoch: u32) -> Result<()> {
        let dir = self.epoch_dir(job, epoch);
        match fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io("remove", &dir, e)),
        }
    }

    /// Bytes available to an unprivileged writer on the staging file system.
    pub fn free_bytes(&self) -> Result<u64> {
        free_bytes(&self.root)
    }

    /// The staging file system's (available, total) bytes.
    pub fn space(&self) -> Result<(u64, u64)> {
        space(&self.root)
    }
}

/// Bytes available to an unprivileged writer on the file system holding `path`.
pub fn free_bytes(path: &Path) -> Result<u64> {
    space(path).map(|(free, _)| free)
}

/// Bytes available to an unprivileged writer on the file system holding `path`, and its size.
pub fn space(path: &Path) -> Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| StoreError::io("statvfs", path, std::io::Error::other(e)))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid NUL-terminated string and `st` points to writable memory of the
    // right type; statvfs initialises it on success, which is checked before reading it.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(StoreError::io(
            "statvfs",
            path,
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: statvfs returned 0, so the struct is initialised.
    let st = unsafe { st.assume_init() };
    Ok((st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_paths_and_cleanup() {
        let d = tempfile::tempdir().unwrap();
        let s = Staging::open(d.path().join("stage")).unwrap();
        let n = s.create_node_dir(3, 2, "n1").unwrap();
        assert_eq!(n, d.path().join("stage/3/2/n1"));
        fs::write(n.join("x"), b"1").unwrap();
        s.create_node_dir(3, 2, "n1").unwrap();
        assert!(
            !n.join("x").exists(),
            "leftovers of an earlier attempt are removed"
        );
        s.remove_node_dir(3, 2, "n1").unwrap();
        assert!(!s.epoch_dir(3, 2).exists());
        s.remove_node_dir(3, 2, "n1").unwrap();
        assert!(s.free_bytes().unwrap() > 0);
    }

    #[test]
    fn node_names_that_lead_elsewhere_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let s = Staging::open(d.path().join("stage")).unwrap();
        let keep = s.create_node_dir(3, 2, "n1").unwrap().join("keep");
        fs::write(&keep, b"1").unwrap();
        for bad in ["..", ".", "", "a/b", "../../x"] {
            let err = s.remove_node_dir(3, 2, bad).unwrap_err();
            assert!(
                matches!(err, StoreError::UnsafeName { .. }),
                "{bad:?}: {err}"
            );
            assert!(s.create_node_dir(3, 2, bad).is_err(), "{bad:?}");
            assert!(s.checked_node_dir(3, 2, bad).is_err(), "{bad:?}");
        }
        assert!(keep.exists(), "nothing was removed");
        assert_eq!(
            s.checked_node_dir(3, 2, "n1").unwrap(),
            s.node_dir(3, 2, "n1")
        );
    }
}
