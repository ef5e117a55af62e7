//! Tests of [`super`] (owner.rs).
use super::*;
#[test]
fn identity_comes_from_the_user_databases() {
    let root = Identity::of_uid(0)
        .unwrap()
        .expect("root has a passwd entry");
    assert_eq!((root.uid, root.gid), (0, 0));
    assert!(root.groups.contains(&0), "{root:?}");
    assert_eq!(
        Identity::of_uid(u32::MAX - 7).unwrap(),
        None,
        "an unknown uid has no identity"
    );
}
#[test]
fn opening_refuses_symbolic_links_anywhere_on_the_path() {
    let d = tempfile::tempdir().unwrap();
    let real = d.path().join("real");
    fs::create_dir(&real).unwrap();
    fs::write(real.join("f"), b"x").unwrap();
    std::os::unix::fs::symlink(&real, d.path().join("dirlink")).unwrap();
    std::os::unix::fs::symlink(real.join("f"), d.path().join("filelink")).unwrap();
    assert!(open_no_symlinks(&real.join("f"), libc::O_RDONLY, 0).is_ok());
    for p in [d.path().join("filelink"), d.path().join("dirlink/f")] {
        let e = open_no_symlinks(&p, libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{}", p.display());
    }
}
#[test]
fn put_back_truncates_recreates_and_refuses_links_and_strangers() {
    let d = tempfile::tempdir().unwrap();
    let me = Identity {
        uid: unsafe_free_uid(),
        gid: nix::unistd::getgid().as_raw(),
        groups: vec![],
    };
    let grown = d.path().join("grown");
    fs::write(&grown, b"0123456789").unwrap();
    put_back_output(&OpenFile {
        path: grown.display().to_string(),
        size: 4,
    })
    .unwrap();
    assert_eq!(fs::read(&grown).unwrap(), b"0123");
    let gone = d.path().join("sub/gone");
    put_back_output(&OpenFile {
        path: gone.display().to_string(),
        size: 3,
    })
    .unwrap();
    assert_eq!(fs::metadata(&gone).unwrap().len(), 3);
    let shrunk = put_back_output(&OpenFile {
        path: grown.display().to_string(),
        size: 99,
    })
    .unwrap_err();
    assert!(shrunk.1.unwrap().contains("was 99"));
    let victim = d.path().join("victim");
    fs::write(&victim, b"precious").unwrap();
    let link = d.path().join("link");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let e = put_back_output(&OpenFile {
        path: link.display().to_string(),
        size: 1,
    })
    .unwrap_err();
    assert_eq!(e.0.raw_os_error(), Some(libc::ELOOP));
    assert!(problem(me.uid, &link, &e.0).contains("symbolic link"));
    let saved = d.path().join("saved");
    fs::write(&saved, b"shm").unwrap();
    let pf = PreservedFile {
        path: link.display().to_string(),
        saved_as: String::new(),
        mode: 0o600,
        uid: me.uid,
        gid: me.gid,
        fifo: false,
    };
    let e = put_back_preserved(&pf, Some(fs::File::open(&saved).unwrap())).unwrap_err();
    assert_eq!(e.0.raw_os_error(), Some(libc::ELOOP));
    assert_eq!(
        fs::read(&victim).unwrap(),
        b"precious",
        "the link was not followed"
    );
    let own = PreservedFile {
        path: d.path().join("shm/seg").display().to_string(),
        uid: nix::unistd::getuid().as_raw(),
        ..pf
    };
    put_back_preserved(&own, Some(fs::File::open(&saved).unwrap())).unwrap();
    let m = fs::metadata(&own.path).unwrap();
    assert_eq!(
        (fs::read(&own.path).unwrap(), m.mode() & 0o777),
        (b"shm".to_vec(), 0o600)
    );
    let stranger = put_back(&PutBack {
        owner: me,
        open_files: vec![],
        preserved: vec![PreservedFile { uid: 12345, ..own }],
        saved_dir: d.path().into(),
    })
    .unwrap_err();
    assert!(stranger.problem.contains("uid 12345"), "{stranger:?}");
}
/// A uid that is not the caller's (for preserved files that must be refused).
fn unsafe_free_uid() -> u32 {
    nix::unistd::getuid().as_raw().wrapping_add(1)
}

/// A part's output on a node it ran on before it moved away: shorter than at the checkpoint it
/// comes back from. The epoch's copy replaces it; without a copy the restore is refused, naming
/// the file.
#[test]
fn an_older_output_is_replaced_by_the_epochs_copy_or_refused() {
    let d = tempfile::tempdir().unwrap();
    let me = Identity {
        uid: nix::unistd::geteuid().as_raw(),
        gid: nix::unistd::getegid().as_raw(),
        groups: Vec::new(),
    };
    let out = d.path().join("stdout");
    let saved = d.path().join("saved-stdout");
    fs::write(&out, "ready 1\nready 2\n").unwrap();
    let at_checkpoint = "ready 1\nready 2\nbatch 1: 9 qps\nbatch 1: 9 qps\n";
    fs::write(&saved, at_checkpoint).unwrap();
    let f = OpenFile {
        path: out.display().to_string(),
        size: at_checkpoint.len() as u64,
    };
    let e = put_back_own_output(7, &f, &me, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("was truncated or replaced"), "{e}");
    put_back_own_output(7, &f, &me, Some(&saved)).unwrap();
    assert_eq!(fs::read_to_string(&out).unwrap(), at_checkpoint);
    // A copy of another size is not the checkpoint's.
    fs::write(&out, "x").unwrap();
    fs::write(&saved, "short").unwrap();
    assert!(put_back_own_output(7, &f, &me, Some(&saved)).is_err());
}
