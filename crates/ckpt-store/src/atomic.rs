//! Crash-safe replacement of small files: write a temporary file beside the target, fsync it,
//! rename it over the target, fsync the directory. A crash leaves either the old or the new file,
//! never a torn one.
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::Path;

use crate::{Result, StoreError};

/// Atomically replaces `path` with `data`, readable by its owner only (0600): every file the
/// daemons keep is root's alone unless a user must read it.
pub fn write_file(path: &Path, data: &[u8]) -> Result<()> {
    write_file_mode(path, data, 0o600)
}

/// Atomically replaces `path` with `data`, the new file `mode` from its creation. The temporary
/// file is never opened through a symbolic link.
pub fn write_file_mode(path: &Path, data: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(|e| StoreError::io("create", &tmp, e))?;
    // The umask may have narrowed the mode (or, for a public file, must not have).
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| StoreError::io("chmod", &tmp, e))?;
    f.write_all(data)
        .map_err(|e| StoreError::io("write", &tmp, e))?;
    f.sync_all().map_err(|e| StoreError::io("fsync", &tmp, e))?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        StoreError::io("rename", path, e)
    })?;
    sync_dir(dir)
}

/// Fsyncs a directory so that renames and new entries in it are durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io("fsync directory", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_content_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state");
        write_file(&p, b"one").unwrap();
        write_file(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "temp files left behind: {names:?}");
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "private by default");
    }

    #[test]
    fn missing_directory_is_an_error_naming_the_file() {
        let err = write_file(Path::new("/nonexistent-ckpt-dir/x"), b"x").unwrap_err();
        assert!(err.to_string().contains("/nonexistent-ckpt-dir"), "{err}");
    }
}
