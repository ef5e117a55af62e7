//! Pre-copy chains: a node's images of an epoch as the engine's final dump (`images/`) on top
//! of the pre-dumps taken while the job ran (`pre/1`, `pre/2`, ... oldest first). The dump
//! holds only the pages written since the newest pre-dump; each pre-dump after the first only
//! those written since the one before. The engine finds the link below each one through a
//! `parent` symbolic link in it.
//!
//! Every link is inside the epoch's node directory, so an epoch never needs another epoch's
//! files: retention deletes epochs whole, copies (partner, shared storage) carry the links as
//! ordinary files. Symbolic links are not image files (digests cover files only, copies carry
//! files only): the manifest records the chain ([`crate::manifest::NodeManifest::chain`]) and
//! [`relink`] makes the `parent` links again from it, wherever the images are restored.
use std::fs;
use std::path::Path;

use crate::{Result, StoreError};

/// Directory of the final dump inside a node directory.
pub const IMAGES_DIR: &str = "images";
/// Directory of the pre-dump links inside a node directory.
pub const LINKS_DIR: &str = "pre";
/// Name of the engine's link to the images below.
pub const PARENT: &str = "parent";
/// Most links a chain may have.
pub const MAX_LINKS: usize = 64;

/// The chain entry of link `n` (1-based): `pre/<n>`.
pub fn link(n: u32) -> String {
    format!("{LINKS_DIR}/{n}")
}

/// The number of a chain entry `pre/<n>`, `n` from 1 to 999999 without leading zeros.
fn number(entry: &str) -> Option<u32> {
    let n = entry.strip_prefix(LINKS_DIR)?.strip_prefix('/')?;
    let ok = !n.is_empty() && n.len() <= 6 && !n.starts_with('0');
    ok.then(|| n.parse().ok())?
}

/// Checks a chain read from a manifest at `path`: at most [`MAX_LINKS`] entries, each `pre/<n>`,
/// numbers strictly increasing. Nothing else can make [`relink`] write outside the node
/// directory or link a directory to itself.
pub fn check(path: &Path, chain: &[String]) -> Result<()> {
    if chain.len() > MAX_LINKS {
        return Err(StoreError::LimitExceeded {
            path: path.to_path_buf(),
            what: "pre-copy chain length",
            value: chain.len() as u64,
            limit: MAX_LINKS as u64,
        });
    }
    let mut last = 0;
    for entry in chain {
        match number(entry) {
            Some(n) if n > last => last = n,
            _ => {
                return Err(StoreError::BadChain {
                    path: path.to_path_buf(),
                    entry: entry.chars().take(80).collect(),
                })
            }
        }
    }
    Ok(())
}

/// Makes the `parent` links of `node_dir`'s images for `chain` (checked by [`check`]):
/// `images/parent` to the newest link, each link's to the one before it; the oldest link and,
/// without a chain, the images get none. Replaces links already there; refuses a `parent` that
/// is not a symbolic link, and a chain directory that is missing or is itself a link.
pub fn relink(node_dir: &Path, chain: &[String]) -> Result<()> {
    check(&node_dir.join(crate::layout::MANIFEST_FILE), chain)?;
    let dirs: Vec<&str> = chain
        .iter()
        .map(String::as_str)
        .chain([IMAGES_DIR])
        .collect();
    for (i, dir) in dirs.iter().enumerate() {
        let at = node_dir.join(dir);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(not_a_dir(&at)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StoreError::FileMissing { path: at })
            }
            Err(e) => return Err(StoreError::io("stat", &at, e)),
        }
        let parent = at.join(PARENT);
        match fs::symlink_metadata(&parent) {
            Ok(m) if m.file_type().is_symlink() => {
                fs::remove_file(&parent).map_err(|e| StoreError::io("remove", &parent, e))?
            }
            Ok(_) => return Err(not_a_dir(&parent)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::io("stat", &parent, e)),
        }
        if i == 0 {
            continue;
        }
        // Relative, so that the node directory can move (a fetched copy is renamed into place).
        let up = "../".repeat(dir.split('/').count());
        let target = format!("{up}{}", dirs[i - 1]);
        std::os::unix::fs::symlink(&target, &parent)
            .map_err(|e| StoreError::io("link", &parent, e))?;
    }
    Ok(())
}

fn not_a_dir(path: &Path) -> StoreError {
    StoreError::BadChain {
        path: path.to_path_buf(),
        entry: "not what a pre-copy chain has there (a directory, or a parent symbolic link)"
            .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn only_increasing_numbered_links_pass() {
        let p = Path::new("MANIFEST");
        assert!(check(p, &[]).is_ok());
        assert!(check(p, &chain(&["pre/1", "pre/2", "pre/7"])).is_ok());
        for bad in [
            &["pre/2", "pre/1"][..],
            &["pre/1", "pre/1"],
            &["images"],
            &["pre/0"],
            &["pre/01"],
            &["pre/../images"],
            &["pre/1/x"],
            &["/pre/1"],
            &["pre/"],
            &["pre/1234567"],
        ] {
            let e = check(p, &chain(bad)).unwrap_err();
            assert!(matches!(e, StoreError::BadChain { .. }), "{bad:?}: {e}");
        }
        let long: Vec<String> = (1..=MAX_LINKS as u32 + 1).map(link).collect();
        assert!(matches!(
            check(p, &long),
            Err(StoreError::LimitExceeded { .. })
        ));
    }

    #[test]
    fn relink_points_each_directory_at_the_one_below_and_replaces_old_links() {
        let d = tempfile::tempdir().unwrap();
        for sub in ["images", "pre/1", "pre/3"] {
            fs::create_dir_all(d.path().join(sub)).unwrap();
        }
        // A stale link, as the engine left it in staging, pointing elsewhere.
        std::os::unix::fs::symlink("/etc", d.path().join("images/parent")).unwrap();
        relink(d.path(), &chain(&["pre/1", "pre/3"])).unwrap();
        let target = |p: &str| fs::read_link(d.path().join(p)).unwrap();
        assert_eq!(target("images/parent"), Path::new("../pre/3"));
        assert_eq!(target("pre/3/parent"), Path::new("../../pre/1"));
        assert!(fs::symlink_metadata(d.path().join("pre/1/parent")).is_err());
        // They resolve to the directories below.
        assert_eq!(
            fs::canonicalize(d.path().join("images/parent/parent")).unwrap(),
            fs::canonicalize(d.path().join("pre/1")).unwrap()
        );
        // Without a chain, the images stand alone.
        relink(d.path(), &[]).unwrap();
        assert!(fs::symlink_metadata(d.path().join("images/parent")).is_err());
    }

    #[test]
    fn relink_refuses_missing_links_and_files_in_the_way() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("images")).unwrap();
        let e = relink(d.path(), &chain(&["pre/1"])).unwrap_err();
        assert!(matches!(e, StoreError::FileMissing { .. }), "{e}");
        fs::create_dir_all(d.path().join("pre")).unwrap();
        std::os::unix::fs::symlink("/tmp", d.path().join("pre/1")).unwrap();
        let e = relink(d.path(), &chain(&["pre/1"])).unwrap_err();
        assert!(matches!(e, StoreError::BadChain { .. }), "{e}");
        fs::remove_file(d.path().join("pre/1")).unwrap();
        fs::create_dir_all(d.path().join("pre/1")).unwrap();
        fs::write(d.path().join("images/parent"), b"a file").unwrap();
        let e = relink(d.path(), &chain(&["pre/1"])).unwrap_err();
        assert!(matches!(e, StoreError::BadChain { .. }), "{e}");
    }
}
