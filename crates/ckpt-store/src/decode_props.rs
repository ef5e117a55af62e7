//! Property tests of the decoders of the files this crate reads from disk and peers (MANIFEST,
//! RECIPE, COMMIT): whatever the bytes, a decoder returns `Ok` or a clean `Err`, never panics
//! or allocates by a forged length, and what it accepts passes the path and name checks.
//!
//! Damage is tried at two depths: on the whole file (where the checksum catches nearly all of
//! it) and on the body re-framed with a valid checksum (so the JSON or binary body decoder
//! itself sees the damage, as it would in a file forged by someone who can write the store).
//! Case counts are bounded so the whole set stays well under a second in release mode.
use std::collections::BTreeMap;
use std::path::Path;

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;

use crate::commit::{self, CommitRecord};
use crate::dedup::{ChunkRef, FileRecipe, Recipe};
use crate::digest::FileEntry;
use crate::manifest::{self, encode_framed, NodeManifest, OpenFile, PreservedFile};
use crate::validate;

const CASES: u32 = 384;

/// One change to a byte string; positions wrap around its length.
#[derive(Debug, Clone)]
enum Edit {
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Truncate { at: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Remove { at: usize, len: usize },
}

fn edit() -> impl Strategy<Value = Edit> {
    // Bytes that matter to the decoders: JSON punctuation, digits, path characters, NUL.
    let byte = prop_oneof![
        any::<u8>(),
        prop::sample::select(b"{}[]\":,./\\0-9\x00\xff".to_vec()),
    ];
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Edit::Flip { at, bit }),
        (any::<usize>(), byte.clone()).prop_map(|(at, byte)| Edit::Set { at, byte }),
        any::<usize>().prop_map(|at| Edit::Truncate { at }),
        (any::<usize>(), vec(byte, 1..8)).prop_map(|(at, bytes)| Edit::Insert { at, bytes }),
        (any::<usize>(), 1usize..16).prop_map(|(at, len)| Edit::Remove { at, len }),
    ]
}

fn apply(mut b: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let pos = |at: usize, b: &Vec<u8>| at % (b.len() + 1);
        match e {
            Edit::Flip { at, bit } if !b.is_empty() => {
                let i = at % b.len();
                b[i] ^= 1 << bit;
            }
            Edit::Set { at, byte } if !b.is_empty() => {
                let i = at % b.len();
                b[i] = *byte;
            }
            Edit::Truncate { at } => b.truncate(pos(*at, &b)),
            Edit::Insert { at, bytes } => {
                let i = pos(*at, &b);
                b.splice(i..i, bytes.iter().copied());
            }
            Edit::Remove { at, len } => {
                let i = pos(*at, &b);
                let end = (i + len).min(b.len());
                b.drain(i..end);
            }
            _ => {}
        }
    }
    b
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    vec(edit(), 1..5)
}

/// The body of a framed file (between the 16-byte header and the 32-byte checksum).
fn body(framed: &[u8]) -> Vec<u8> {
    framed[16..framed.len() - 32].to_vec()
}

/// Mostly valid path-like strings, with the pieces a path check must catch mixed in.
fn path_like() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z0-9_-]{1,6}(/[a-z0-9._-]{1,6}){0,2}",
        1 => vec(
            prop_oneof![
                Just("/"),
                Just("."),
                Just(".."),
                Just("a"),
                Just("\0"),
                Just("")
            ],
            0..6
        )
        .prop_map(|v| v.concat()),
        1 => any::<String>(),
    ]
}

fn node_like() -> impl Strategy<Value = String> {
    prop_oneof![4 => "[A-Za-z0-9._-]{1,10}", 1 => path_like()]
}

fn digest_like() -> impl Strategy<Value = String> {
    prop_oneof![4 => "[0-9a-f]{64}", 1 => ".{0,70}"]
}

fn manifest() -> impl Strategy<Value = NodeManifest> {
    let file = (path_like(), any::<u64>(), digest_like())
        .prop_map(|(path, size, blake3)| FileEntry { path, size, blake3 });
    let open = (path_like(), any::<u64>()).prop_map(|(p, size)| OpenFile {
        path: format!("/{p}"),
        size,
    });
    let preserved =
        (path_like(), path_like(), any::<bool>()).prop_map(|(p, saved_as, fifo)| PreservedFile {
            path: format!("/{p}"),
            saved_as: if fifo { String::new() } else { saved_as },
            mode: 0o600,
            uid: 0,
            gid: 0,
            fifo,
        });
    (
        node_like(),
        vec(file, 0..5),
        vec(open, 0..3),
        vec(preserved, 0..3),
        btree_map(".{0,6}", ".{0,6}", 0..3),
    )
        .prop_map(|(node, files, open_files, preserved, notes)| {
            let mut m = NodeManifest::new(7, 3, &node, files);
            m.open_files = open_files;
            m.preserved = preserved;
            m.pids = vec![100, 101];
            m.notes = notes;
            m
        })
}

fn recipe() -> impl Strategy<Value = Recipe> {
    let packs = prop_oneof![4 => "[0-9]{1,3}-[0-9]{1,2}\\.pack", 1 => path_like()];
    (
        vec(packs, 1..4),
        vec((path_like(), vec(any::<u64>(), 0..8)), 0..4),
    )
        .prop_map(|(packs, files)| {
            let n = packs.len() as u64;
            Recipe {
                files: files
                    .into_iter()
                    .map(|(path, seeds)| FileRecipe {
                        path,
                        chunks: seeds
                            .into_iter()
                            .map(|s| ChunkRef {
                                pack: (s % n) as u32,
                                offset: s >> 8,
                                len: 1 + (s % (128 << 10)) as u32,
                                digest: [s as u8; 32],
                                compressed: s & (1 << 40) != 0,
                            })
                            .collect(),
                    })
                    .collect(),
                packs,
            }
        })
}

fn commit_record() -> impl Strategy<Value = CommitRecord> {
    (btree_map(node_like(), digest_like(), 0..5), any::<u64>()).prop_map(|(manifests, bytes)| {
        CommitRecord {
            job_id: 3,
            epoch: 4,
            manifests,
            image_bytes: bytes,
            committed_unix_ms: 5,
        }
    })
}

/// What an accepted manifest must satisfy.
fn manifest_is_safe(m: &NodeManifest) -> Result<(), TestCaseError> {
    prop_assert!(validate::node_name(&m.node).is_ok());
    for f in &m.files {
        prop_assert!(validate::relative_path(&f.path).is_ok(), "{:?}", f.path);
    }
    for f in &m.open_files {
        prop_assert!(validate::absolute_path(&f.path).is_ok(), "{:?}", f.path);
    }
    for p in &m.preserved {
        prop_assert!(validate::absolute_path(&p.path).is_ok(), "{:?}", p.path);
        prop_assert!(p.fifo || validate::relative_path(&p.saved_as).is_ok());
    }
    Ok(())
}

fn recipe_is_safe(r: &Recipe) -> Result<(), TestCaseError> {
    for p in &r.packs {
        prop_assert!(validate::file_name(p).is_ok(), "{p:?}");
    }
    for f in &r.files {
        prop_assert!(validate::relative_path(&f.path).is_ok(), "{:?}", f.path);
        for c in &f.chunks {
            prop_assert!((c.pack as usize) < r.packs.len());
            prop_assert!(c.len >= 1 && c.len <= 128 << 10);
        }
    }
    Ok(())
}

fn commit_is_safe(r: &CommitRecord) -> Result<(), TestCaseError> {
    for (node, digest) in &r.manifests {
        prop_assert!(validate::node_name(node).is_ok(), "{node:?}");
        prop_assert!(digest.len() == 64, "{digest:?}");
    }
    Ok(())
}

fn decode_manifest(b: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(m) = manifest::decode(Path::new("MANIFEST"), b) {
        manifest_is_safe(&m)?;
    }
    Ok(())
}

fn decode_recipe(b: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(r) = Recipe::decode(Path::new("RECIPE"), b) {
        recipe_is_safe(&r)?;
    }
    Ok(())
}

fn decode_commit(b: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(r) = commit::decode(Path::new("COMMIT"), b) {
        commit_is_safe(&r)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn random_bytes_never_panic_a_decoder(raw in vec(any::<u8>(), 0..1024)) {
        decode_manifest(&raw)?;
        decode_recipe(&raw)?;
        decode_commit(&raw)?;
        // Framed with each magic, so each body decoder sees the bytes.
        decode_manifest(&encode_framed(manifest::MAGIC, &raw))?;
        decode_recipe(&encode_framed(crate::dedup::MAGIC, &raw))?;
        decode_commit(&encode_framed(commit::MAGIC, &raw))?;
    }

    #[test]
    fn a_manifest_decodes_to_itself_or_is_refused(m in manifest()) {
        let b = manifest::encode(&m);
        match manifest::decode(Path::new("MANIFEST"), &b) {
            Ok(d) => {
                prop_assert_eq!(&d, &m);
                manifest_is_safe(&d)?;
            }
            Err(e) => prop_assert!(manifest::check(Path::new("M"), &m).is_err(), "{}", e),
        }
    }

    #[test]
    fn a_damaged_manifest_never_panics_the_decoder(m in manifest(), e in edits()) {
        let b = manifest::encode(&m);
        decode_manifest(&apply(b.clone(), &e))?;
        decode_manifest(&encode_framed(manifest::MAGIC, &apply(body(&b), &e)))?;
    }

    #[test]
    fn a_recipe_decodes_to_itself_or_is_refused(r in recipe()) {
        let safe = r.packs.iter().all(|p| validate::file_name(p).is_ok())
            && r.files.iter().all(|f| validate::relative_path(&f.path).is_ok());
        match Recipe::decode(Path::new("RECIPE"), &r.encode()) {
            Ok(d) => prop_assert_eq!(d, r),
            Err(e) => prop_assert!(!safe, "{}", e),
        }
    }

    #[test]
    fn a_damaged_recipe_never_panics_the_decoder(r in recipe(), e in edits()) {
        let b = r.encode();
        decode_recipe(&apply(b.clone(), &e))?;
        decode_recipe(&encode_framed(crate::dedup::MAGIC, &apply(body(&b), &e)))?;
    }

    #[test]
    fn a_commit_record_decodes_to_itself_or_is_refused(r in commit_record()) {
        match commit::decode(Path::new("COMMIT"), &commit::encode(&r)) {
            Ok(d) => {
                prop_assert_eq!(&d, &r);
                commit_is_safe(&d)?;
            }
            Err(e) => prop_assert!(commit::check(Path::new("C"), &r).is_err(), "{}", e),
        }
    }

    #[test]
    fn a_damaged_commit_record_never_panics_the_decoder(r in commit_record(), e in edits()) {
        let b = commit::encode(&r);
        decode_commit(&apply(b.clone(), &e))?;
        decode_commit(&encode_framed(commit::MAGIC, &apply(body(&b), &e)))?;
    }
}

/// A recipe body whose counts promise far more than it holds is refused without allocating
/// for them, and one within limits but for a chunk too long is refused by name.
#[test]
fn forged_recipe_counts_and_lengths_are_refused() {
    let path = Path::new("RECIPE");
    let le = |n: u32| n.to_le_bytes().to_vec();
    for body in [
        // 4 billion packs, 4 billion files, 4 billion chunks of one file, in a few bytes.
        le(u32::MAX),
        [le(0), le(u32::MAX)].concat(),
        [le(0), le(1), le(1), b"a".to_vec(), le(u32::MAX)].concat(),
    ] {
        let err = Recipe::decode(path, &encode_framed(crate::dedup::MAGIC, &body)).unwrap_err();
        assert!(
            matches!(err, crate::StoreError::ChecksumMismatch { .. }),
            "{err}"
        );
    }
    let long = Recipe {
        packs: vec!["1-0.pack".into()],
        files: vec![FileRecipe {
            path: "images/x".into(),
            chunks: vec![ChunkRef {
                pack: 0,
                offset: 0,
                // The largest length below the compression flag.
                len: u32::MAX >> 1,
                digest: [0; 32],
                compressed: true,
            }],
        }],
    };
    let err = Recipe::decode(path, &long.encode()).unwrap_err();
    assert!(
        err.to_string()
            .contains("chunk length 2147483647 is above the limit of 131072"),
        "{err}"
    );
    for (pack, file) in [("../../x.pack", "images/x"), ("1-0.pack", "../../etc/x")] {
        let mut r = long.clone();
        r.packs[0] = pack.into();
        r.files[0].path = file.into();
        r.files[0].chunks[0].len = 5;
        let err = Recipe::decode(path, &r.encode()).unwrap_err();
        assert!(
            matches!(err, crate::StoreError::UnsafePath { .. }) && err.to_string().contains(".."),
            "{err}"
        );
    }
}

#[test]
fn manifests_with_unsafe_paths_or_names_are_neither_read_nor_written() {
    let ok_file = || FileEntry {
        path: "images/core-1.img".into(),
        size: 4,
        blake3: "00".repeat(32),
    };
    let base = NodeManifest::new(1, 1, "n1", vec![ok_file()]);
    let mut cases: Vec<(&str, NodeManifest)> = Vec::new();
    let mut m = base.clone();
    m.node = "..".into();
    cases.push(("node name", m));
    let mut m = base.clone();
    m.files[0].path = "/etc/shadow".into();
    cases.push(("absolute", m));
    let mut m = base.clone();
    m.files.push(FileEntry {
        path: "images/../../x".into(),
        ..ok_file()
    });
    cases.push(("..", m));
    let mut m = base.clone();
    m.open_files.push(OpenFile {
        path: "relative/out".into(),
        size: 1,
    });
    cases.push(("relative", m));
    let mut m = base.clone();
    m.preserved.push(PreservedFile {
        path: "/dev/shm/x".into(),
        saved_as: "../x".into(),
        mode: 0,
        uid: 0,
        gid: 0,
        fifo: false,
    });
    cases.push(("..", m));
    let mut m = base.clone();
    m.files = vec![
        FileEntry {
            size: u64::MAX,
            ..ok_file()
        },
        FileEntry {
            path: "images/b".into(),
            size: 2,
            ..ok_file()
        },
    ];
    cases.push(("total image bytes", m));
    for (what, m) in cases {
        let err = manifest::decode(Path::new("M"), &manifest::encode(&m)).unwrap_err();
        assert!(err.to_string().contains(what), "{what}: {err}");
        let d = tempfile::tempdir().unwrap();
        assert!(manifest::write(d.path(), &m).is_err(), "{what}");
        assert!(!d.path().join(manifest::FILE_NAME).exists(), "{what}");
    }
    // A named pipe has no saved copy.
    let mut m = base;
    m.preserved.push(PreservedFile {
        path: "/tmp/ompi/fifo".into(),
        saved_as: String::new(),
        mode: 0o600,
        uid: 0,
        gid: 0,
        fifo: true,
    });
    assert_eq!(
        manifest::decode(Path::new("M"), &manifest::encode(&m)).unwrap(),
        m
    );
}

#[test]
fn commit_records_with_bad_nodes_or_digests_are_neither_read_nor_written() {
    for (node, digest, what) in [
        ("..", "ab".repeat(32), "node name \"..\""),
        ("a/b", "ab".repeat(32), "node name \"a/b\""),
        ("n1", String::new(), "not a BLAKE3 digest"),
        ("n1", "AB".repeat(32), "not a BLAKE3 digest"),
    ] {
        let r = CommitRecord {
            job_id: 1,
            epoch: 1,
            manifests: BTreeMap::from([(node.to_string(), digest)]),
            image_bytes: 0,
            committed_unix_ms: 0,
        };
        let err = commit::decode(Path::new("C"), &commit::encode(&r)).unwrap_err();
        assert!(err.to_string().contains(what), "{what}: {err}");
        let d = tempfile::tempdir().unwrap();
        assert!(commit::write(d.path(), &r).is_err());
        assert!(!d.path().join(commit::FILE_NAME).exists());
    }
}
