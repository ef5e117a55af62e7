//! Whether a directory that root writes into is root's. Staging (`local_dir`), shared storage
//! (`shared_dir`) and the agent's `state_dir` are trees root creates files in, and removes
//! trees from, by path. That is safe only while no user can put a name there: a user who owns
//! the root (made `/dev/shm/ckpt` first after a reboot) or may write into it or into a
//! directory above it (other than a sticky one, whose entries only their owners may rename)
//! could plant links that root then writes through (`extra -> /etc/cron.d`) or point a removal
//! at another user's files. [`check_root`] refuses such a tree before anything is written.
//!
//! Shared storage exported with root squashed shows root's files under the squash uid (often
//! 65534): [`squash_uid`] finds that uid by making a file, and a caller may accept it as an
//! owner of the tree on that file system only.
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

/// How many symbolic links on the way to a root are followed before giving up.
const MAX_LINKS: usize = 16;

/// Why a tree is not trusted.
#[derive(Debug, thiserror::Error)]
pub enum Untrusted {
    /// The path or a directory on the way cannot be read.
    #[error("{path}: {source}")]
    Io {
        /// The path that failed.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A directory on the way (or the root) belongs to someone else than root.
    #[error("{path} belongs to uid {uid}, not root: a user who owns it can plant links there that root would write through")]
    NotRoots {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        uid: u32,
    },
    /// A directory on the way (or the root) may be written by other users.
    #[error("{path} (mode {mode:04o}) may be written by users other than root, who could plant links there that root would write through")]
    Writable {
        /// The directory.
        path: PathBuf,
        /// Its mode bits.
        mode: u32,
    },
    /// Something on the way is not a directory or a link.
    #[error("{path} is not a directory")]
    NotADirectory {
        /// The path.
        path: PathBuf,
    },
    /// Too many links on the way.
    #[error("{path}: more than {MAX_LINKS} symbolic links on the way")]
    TooManyLinks {
        /// The path.
        path: PathBuf,
    },
}

/// Who may own a trusted tree's directories.
#[derive(Debug, Clone, Copy)]
pub struct Owners {
    /// Besides root: a squash uid, accepted on the file system (`st_dev`) of the tree's root
    /// only.
    pub squash: Option<(u32, u64)>,
}

impl Owners {
    /// Root alone.
    pub const ROOT: Owners = Owners { squash: None };

    fn allows(&self, m: &fs::Metadata) -> bool {
        m.uid() == 0
            || self
                .squash
                .is_some_and(|(uid, dev)| m.uid() == uid && m.dev() == dev)
    }

    fn group_ok(&self, m: &fs::Metadata) -> bool {
        m.gid() == 0
            || self
                .squash
                .is_some_and(|(uid, dev)| m.gid() == uid && m.dev() == dev)
    }
}

fn meta(path: &Path) -> Result<fs::Metadata, Untrusted> {
    fs::symlink_metadata(path).map_err(|source| Untrusted::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Checks the directory `dir` on the way to a trusted root: owned by an allowed owner, and
/// written only by it (group root may write too); a sticky directory (`/tmp`, `/dev/shm`) may
/// be written by others on the way, since only an entry's owner may rename or remove it.
fn check_dir(path: &Path, m: &fs::Metadata, owners: &Owners, leaf: bool) -> Result<(), Untrusted> {
    if !m.is_dir() {
        return Err(Untrusted::NotADirectory {
            path: path.to_path_buf(),
        });
    }
    if !owners.allows(m) {
        return Err(Untrusted::NotRoots {
            path: path.to_path_buf(),
            uid: m.uid(),
        });
    }
    let mode = m.mode() & 0o7777;
    let others = mode & 0o002 != 0 || (mode & 0o020 != 0 && !owners.group_ok(m));
    let sticky = mode & 0o1000 != 0;
    if others && (leaf || !sticky) {
        return Err(Untrusted::Writable {
            path: path.to_path_buf(),
            mode,
        });
    }
    Ok(())
}

/// Walks from `/` to `path` one name at a time without trusting a link it does not check:
/// each directory on the way goes to `visit` (which may stop the walk by returning false), a
/// link must be root's (its directory was visited) and is followed. Returns where the walk
/// ended.
fn walk(
    path: &Path,
    mut visit: impl FnMut(&Path, &fs::Metadata) -> Result<bool, Untrusted>,
) -> Result<PathBuf, Untrusted> {
    let mut links = 0;
    let mut done = PathBuf::from("/");
    if !visit(&done, &meta(&done)?)? {
        return Ok(done);
    }
    // Components still to walk, last first.
    let mut rest: Vec<std::ffi::OsString> = Vec::new();
    let push_components = |rest: &mut Vec<std::ffi::OsString>, p: &Path| {
        let mut comps: Vec<std::ffi::OsString> = p
            .components()
            .filter_map(|c| match c {
                Component::Normal(n) => Some(n.to_os_string()),
                Component::ParentDir => Some("..".into()),
                _ => None,
            })
            .collect();
        comps.reverse();
        rest.extend(comps);
    };
    push_components(&mut rest, path);
    while let Some(name) = rest.pop() {
        if name == ".." {
            done.pop();
            continue;
        }
        let next = done.join(&name);
        let m = meta(&next)?;
        if m.file_type().is_symlink() {
            // The link's directory was visited. It must also be root's (a squash uid does
            // not make links that matter here).
            if m.uid() != 0 {
                return Err(Untrusted::NotRoots {
                    path: next,
                    uid: m.uid(),
                });
            }
            links += 1;
            if links > MAX_LINKS {
                return Err(Untrusted::TooManyLinks {
                    path: path.to_path_buf(),
                });
            }
            let target = fs::read_link(&next).map_err(|source| Untrusted::Io {
                path: next.clone(),
                source,
            })?;
            if target.is_absolute() {
                done = PathBuf::from("/");
            }
            push_components(&mut rest, &target);
            continue;
        }
        if !visit(&next, &m)? {
            return Ok(next);
        }
        done = next;
    }
    Ok(done)
}

/// Checks that `root` (an absolute path to an existing directory) and every directory on the
/// way to it, through any symbolic links, belong to root (or to `owners`' squash uid) and
/// that no other user may write into them (see [`check_dir`]); a link on the way must be
/// root's. Returns the directory's canonical path.
pub fn check_root(root: &Path, owners: &Owners) -> Result<PathBuf, Untrusted> {
    let done = walk(root, |p, m| check_dir(p, m, owners, false).map(|()| true))?;
    // The root itself, whatever the walk ended on (a root of "/" or one ending in "..").
    check_dir(&done, &meta(&done)?, owners, true)?;
    Ok(done)
}

/// The first directory on the way to `path` (itself included) that is not root's alone: owned
/// by someone else, or one others may add names to (a sticky one too). Below it, a user can
/// replace any name by a link at any moment, so root must not act by path there. None when
/// every directory on the way is root's alone, or the way cannot be walked (a name missing:
/// nothing is made there).
pub fn untrusted_prefix(path: &Path) -> Option<PathBuf> {
    let mut found = None;
    let _ = walk(path, |p, m| {
        if m.is_dir() && check_dir(p, m, &Owners::ROOT, true).is_ok() {
            return Ok(true);
        }
        found = Some(p.to_path_buf());
        Ok(false)
    });
    found
}

/// The uid that root's new files get in `dir` (not 0 where the file system squashes root,
/// as NFS does by default), with the file system's device; found by making a file there and
/// removing it.
pub fn squash_uid(dir: &Path) -> io::Result<(u32, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let probe = dir.join(format!(".ckpt-owner-probe-{}", std::process::id()));
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&probe)?;
    let m = f.metadata();
    let _ = fs::remove_file(&probe);
    let m = m?;
    Ok((m.uid(), m.dev()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// A directory of root's (0755) under /tmp, or None (with the reason printed) if this is
    /// not root, who alone can make directories of root's and of others.
    fn root_scratch() -> Option<tempfile::TempDir> {
        if !is_root() {
            eprintln!("SKIPPED: needs root (directories owned by root and by others)");
            return None;
        }
        let t = tempfile::tempdir().unwrap();
        fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
        Some(t)
    }

    fn dir_with(parent: &Path, name: &str, mode: u32) -> PathBuf {
        let p = parent.join(name);
        fs::create_dir(&p).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn roots_private_directory_under_a_sticky_one_is_trusted() {
        let Some(t) = root_scratch() else { return };
        let sticky = dir_with(t.path(), "shm", 0o1777);
        let local = dir_with(&sticky, "ckpt", 0o700);
        let canonical = check_root(&local, &Owners::ROOT).unwrap();
        assert_eq!(canonical, fs::canonicalize(&local).unwrap());
        // Through a link of root's.
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&local, &link).unwrap();
        assert_eq!(check_root(&link, &Owners::ROOT).unwrap(), canonical);
        let rel = t.path().join("rel");
        std::os::unix::fs::symlink("shm/../shm/ckpt", &rel).unwrap();
        assert_eq!(check_root(&rel, &Owners::ROOT).unwrap(), canonical);
    }

    #[test]
    fn a_root_a_user_owns_or_others_may_write_is_refused() {
        let Some(t) = root_scratch() else { return };
        let sticky = dir_with(t.path(), "shm", 0o1777);
        // A user made it first.
        let users = dir_with(&sticky, "ckpt", 0o700);
        std::os::unix::fs::chown(&users, Some(65534), Some(65534)).unwrap();
        let e = check_root(&users, &Owners::ROOT).unwrap_err();
        assert!(matches!(e, Untrusted::NotRoots { uid: 65534, .. }), "{e}");
        assert!(e.to_string().contains("belongs to uid 65534"), "{e}");
        // The shared directory itself as the root: anyone may add names to it.
        let e = check_root(&sticky, &Owners::ROOT).unwrap_err();
        assert!(matches!(e, Untrusted::Writable { mode: 0o1777, .. }), "{e}");
        // Under a directory others may write (not sticky): they could rename it away.
        let open = dir_with(t.path(), "open", 0o777);
        let inner = dir_with(&open, "ckpt", 0o700);
        let e = check_root(&inner, &Owners::ROOT).unwrap_err();
        assert!(matches!(e, Untrusted::Writable { .. }), "{e}");
        // Group-writable for a group other than root's.
        let grp = dir_with(t.path(), "grp", 0o770);
        std::os::unix::fs::chown(&grp, None, Some(65534)).unwrap();
        assert!(matches!(
            check_root(&grp, &Owners::ROOT).unwrap_err(),
            Untrusted::Writable { .. }
        ));
        // A link a user made, in a directory of root's.
        let good = dir_with(t.path(), "good", 0o700);
        let link = t.path().join("users-link");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
        assert!(matches!(
            check_root(&link, &Owners::ROOT).unwrap_err(),
            Untrusted::NotRoots { uid: 65534, .. }
        ));
        // A directory under the user's: the user can swap it for a link.
        let below = users.join("deeper");
        fs::create_dir(&below).unwrap();
        assert!(matches!(
            check_root(&below, &Owners::ROOT).unwrap_err(),
            Untrusted::NotRoots { uid: 65534, .. }
        ));
    }

    #[test]
    fn the_first_directory_a_user_controls_is_found() {
        if !is_root() {
            eprintln!("SKIPPED: needs root (directories owned by root and by others)");
            return;
        }
        // Under a directory of root's alone (not /tmp, which others may write).
        let Ok(t) = tempfile::tempdir_in("/run") else {
            eprintln!("SKIPPED: cannot make a directory in /run");
            return;
        };
        fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let sticky = dir_with(t.path(), "tmp", 0o1777);
        let users = dir_with(&sticky, "u", 0o755);
        std::os::unix::fs::chown(&users, Some(65534), Some(65534)).unwrap();
        let deep = dir_with(&users, "d", 0o755);
        let canonical = |p: &Path| fs::canonicalize(p).unwrap();
        assert_eq!(untrusted_prefix(&deep.join("s")), Some(canonical(&sticky)));
        let home = dir_with(t.path(), "home", 0o755);
        let own = dir_with(&home, "u", 0o700);
        std::os::unix::fs::chown(&own, Some(65534), Some(65534)).unwrap();
        assert_eq!(untrusted_prefix(&own.join("x/y")), Some(canonical(&own)));
        let roots = dir_with(t.path(), "etc", 0o755);
        assert_eq!(untrusted_prefix(&roots), None);
        assert_eq!(untrusted_prefix(Path::new("/")), None);
    }

    #[test]
    fn a_squash_uid_is_accepted_on_its_own_file_system_only() {
        let Some(t) = root_scratch() else { return };
        let shared = dir_with(t.path(), "shared", 0o700);
        std::os::unix::fs::chown(&shared, Some(65534), Some(65534)).unwrap();
        let dev = fs::metadata(&shared).unwrap().dev();
        let squashed = Owners {
            squash: Some((65534, dev)),
        };
        check_root(&shared, &squashed).unwrap();
        let elsewhere = Owners {
            squash: Some((65534, dev + 1)),
        };
        assert!(check_root(&shared, &elsewhere).is_err());
        let (uid, probe_dev) = squash_uid(t.path()).unwrap();
        assert_eq!((uid, probe_dev), (0, dev), "root's files are root's here");
        assert_eq!(fs::read_dir(t.path()).unwrap().count(), 1, "probe removed");
    }
}
