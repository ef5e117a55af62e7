//! The modes of what the agent keeps: root's alone (0700 directories, 0600 files), except the
//! way to a job's stdout and stderr, which users pass through (0711) to files that are theirs
//! (0600). Directories are given their mode also when they already exist, so an agent upgraded
//! from one that used the umask's modes fixes them at start (a job directory's files, which
//! may be the owner's, with `owner::fix_job_dir_modes`). Its files are written 0600 from the
//! start ([`write_private`]); the JSON ones are read back with [`read_json`].
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use serde::Deserialize;
use tracing::warn;

/// Mode of the directories on the way to a job's stdout and stderr (`<state_dir>`, `jobs/`,
/// `jobs/<id>/`): users pass through to their own files; nobody lists them.
pub(crate) const TRAVERSE_ONLY: u32 = 0o711;

/// Mode of every other directory the agent keeps.
pub(crate) const PRIVATE_DIR: u32 = 0o700;

/// Mode of the files the agent keeps (a job's stdout and stderr too, owned by its user).
pub(crate) const PRIVATE_FILE: u32 = 0o600;

/// Creates `dir` if missing (missing parents 0755, like `/var/lib`) and gives it `mode`, also
/// when it existed: an older agent made its directories with the umask's modes.
pub(crate) fn ensure_dir(dir: &Path, mode: u32) -> std::io::Result<()> {
    let mut missing: Vec<&Path> = dir
        .ancestors()
        .skip(1)
        .take_while(|a| !a.exists())
        .collect();
    missing.reverse();
    for a in missing {
        match fs::create_dir(a) {
            Ok(()) => fs::set_permissions(a, fs::Permissions::from_mode(0o755))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    set_mode(dir, mode)
}

/// Sets the permission bits of `path` (not following a final symbolic link) if they differ.
pub(crate) fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    if meta.file_type().is_symlink() || meta.mode() & 0o7777 == mode {
        return Ok(());
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
}

/// Replaces `path` with `data`, 0600 from its creation (job records sit in a directory users
/// pass through, and hold the job's secret).
pub(crate) fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    ckpt_store::atomic::write_file(path, data).map_err(std::io::Error::other)
}

/// Reads a JSON file the shim or the agent wrote, if present and complete.
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    serde_json::from_slice(&fs::read(path).ok()?).ok()
}

/// Keeps node-local staging root's alone: its root 0700. The agent refuses to start on a root
/// that is not root's or that others may write (`ckpt_store::trust`), so this only narrows a
/// root's own 0755.
pub(crate) fn protect_staging(root: &Path) {
    if let Err(e) = set_mode(root, PRIVATE_DIR) {
        warn!(local_dir = %root.display(), error = %e, "cannot make staging private");
    }
}
