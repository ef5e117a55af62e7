//! Tests of [`super`]: what a restore checks and locks, on real files and real ACLs.
use super::*;
use crate::os::owner::{has_acl, owner_may};

const NOBODY: u32 = 65534;

/// A root file with an ACL (as the system journal has on most distributions) is no longer
/// let through: the kernel, asked by a process that is the owner, decides. One whose ACL
/// names the owner passes; one whose ACL names someone else is refused, for reading and
/// for writing.
#[test]
fn a_file_with_an_acl_is_judged_by_the_kernel_as_its_owner_would_open_it() {
    use crate::os::owner::owner_opens;
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root (to act as another user)");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let (granted, other) = (t.path().join("granted"), t.path().join("other"));
    for f in [&granted, &other] {
        fs::write(f, b"root's").unwrap();
        fs::set_permissions(f, fs::Permissions::from_mode(0o600)).unwrap();
    }
    if let Err(e) = ckpt_store::testdata::set_access_acl(&granted, NOBODY, 4) {
        eprintln!("SKIPPED: this file system takes no ACL: {e}");
        return;
    }
    ckpt_store::testdata::set_access_acl(&other, 1234, 4).unwrap();
    assert!(has_acl(&granted) && has_acl(&other));
    let nobody = Identity {
        uid: NOBODY,
        gid: NOBODY,
        groups: vec![NOBODY],
    };
    let held = |p: &Path, read: bool, write: bool| procfs::Held {
        path: p.to_path_buf(),
        handle: p.to_path_buf(),
        meta: fs::metadata(p).unwrap(),
        access: procfs::Access {
            read,
            write,
            search: false,
        },
    };
    let v = owner_opens(
        &nobody,
        &[
            held(&granted, true, false),
            held(&granted, false, true),
            held(&other, true, false),
            held(&other, false, true),
        ],
    )
    .unwrap();
    assert_eq!(v, [true, false, false, false]);
    assert_eq!(fs::read(&other).unwrap(), b"root's", "nothing was written");
}

#[test]
fn the_restore_lock_is_taken_only_in_a_directory_of_roots() {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root (directories owned by root and by others)");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let dir = t.path().join("ckpt");
    let held = open_restore_lock(&dir, 7).unwrap();
    assert!(held.metadata().unwrap().is_file());
    drop(held);
    // A directory every user may write, as /run/lock is: refused.
    let open = t.path().join("lock");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, fs::Permissions::from_mode(0o1777)).unwrap();
    assert!(open_restore_lock(&open, 7).is_err());
    // A lock a user made first, or a link in its place: refused (the link not followed).
    let users = t.path().join("users");
    fs::create_dir(&users).unwrap();
    std::os::unix::fs::chown(&users, Some(65534), Some(65534)).unwrap();
    assert!(open_restore_lock(&users, 7).is_err());
    fs::write(dir.join("target"), b"").unwrap();
    fs::remove_file(dir.join(restore_lock_name(7))).unwrap();
    std::os::unix::fs::symlink(dir.join("target"), dir.join(restore_lock_name(7))).unwrap();
    assert!(open_restore_lock(&dir, 7).is_err());
}

/// One job's restore holding its lock (a hung restore holds it up to the restore's timeout)
/// does not hold another job's: restores of other jobs go on. A second restore of the same job
/// on the machine (another agent's part of it) waits.
#[test]
fn one_jobs_restore_lock_does_not_hold_another_jobs() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root (a directory of root's)");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("ckpt");
    let held = open_restore_lock(&dir, 1).unwrap();
    let take = |job: u64| {
        let dir = dir.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let lock = open_restore_lock(&dir, job);
            let _ = tx.send(lock.is_ok());
        });
        rx
    };
    assert_eq!(
        take(2).recv_timeout(std::time::Duration::from_secs(10)),
        Ok(true),
        "another job's restore takes its lock at once"
    );
    let same = take(1);
    assert!(
        same.recv_timeout(std::time::Duration::from_millis(300))
            .is_err(),
        "the same job's second restore waits"
    );
    drop(held);
    assert_eq!(
        same.recv_timeout(std::time::Duration::from_secs(10)),
        Ok(true)
    );
}
use std::os::unix::fs::PermissionsExt;

#[test]
fn restored_files_are_judged_by_what_the_owner_may_do() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("f");
    fs::write(&f, b"x").unwrap();
    let me = nix::unistd::getuid().as_raw();
    let owner = Identity {
        uid: me.wrapping_add(1),
        gid: 4242,
        groups: vec![4242, 4343],
    };
    let read = procfs::Access {
        read: true,
        ..Default::default()
    };
    let write = procfs::Access {
        write: true,
        ..Default::default()
    };
    let judge = |mode: u32, gid: u32, access| {
        fs::set_permissions(&f, fs::Permissions::from_mode(mode)).unwrap();
        std::os::unix::fs::chown(&f, None, Some(gid)).unwrap();
        owner_may(&owner, &fs::metadata(&f).unwrap(), access)
    };
    assert!(judge(0o644, 0, read), "others may read");
    assert!(!judge(0o640, 0, read), "another user's group-only file");
    assert!(judge(0o640, 4343, read), "a supplementary group's file");
    assert!(!judge(0o644, 4343, write), "not writable by the group");
    assert!(judge(0o664, 4242, write), "writable by the primary group");
    assert!(!judge(0o600, 0, read), "another user's private file");
    let mine = Identity { uid: me, ..owner };
    assert!(
        owner_may(&mine, &fs::metadata(&f).unwrap(), write),
        "the owner's own file"
    );
    assert!(!has_acl(&f));
}
