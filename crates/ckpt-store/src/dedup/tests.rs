//! Tests of [`super`] (dedup.rs).
use super::*;
use crate::digest::seal_tree;
use crate::testdata::noise;

/// A sealed node directory with one 4 MiB "pages" file and a small one.
fn sealed(dir: &Path, pages: &[u8]) -> String {
    if dir.exists() {
        fs::remove_dir_all(dir).unwrap();
    }
    fs::create_dir_all(dir.join("images")).unwrap();
    fs::write(dir.join("images/pages-1.img"), pages).unwrap();
    fs::write(dir.join("images/core-1.img"), b"core").unwrap();
    let files = seal_tree(dir, &[manifest::FILE_NAME]).unwrap();
    let m = NodeManifest::new(1, 1, "n1", files);
    manifest::write(dir, &m).unwrap()
}

fn tgt(epoch: u32) -> Target<'static> {
    Target {
        job: 1,
        epoch,
        node: "n1",
    }
}

/// Flushes `src`, sealed with `digest`, to `shared` as node n1's images of job 1, `epoch`.
fn flush_epoch(
    src: &Path,
    shared: &Staging,
    epoch: u32,
    digest: &str,
    opts: &CopyOptions,
) -> Result<FlushStats> {
    flush(
        src,
        shared,
        tgt(epoch),
        digest,
        opts,
        &CopyProgress::default(),
    )
}

#[test]
fn chunks_are_content_defined_and_bounded() {
    let data = noise(3 << 20, 7);
    let mut at = 0;
    let mut cuts = Vec::new();
    while at < data.len() {
        let n = cut(&data[at..]);
        assert!(n >= MIN_CHUNK.min(data.len() - at) && n <= MAX_CHUNK);
        at += n;
        cuts.push(at);
    }
    let avg = data.len() / cuts.len();
    assert!((12 << 10..=48 << 10).contains(&avg), "average chunk {avg}");
    // Inserting bytes at the front moves the boundaries with the content.
    let mut shifted = vec![1u8; 1000];
    shifted.extend_from_slice(&data);
    let mut at = 0;
    let mut cuts2 = BTreeSet::new();
    while at < shifted.len() {
        at += cut(&shifted[at..]);
        cuts2.insert(at - 1000);
    }
    let same = cuts.iter().filter(|c| cuts2.contains(c)).count();
    assert!(
        same * 10 >= cuts.len() * 9,
        "{same} of {} cuts survived",
        cuts.len()
    );
}

#[test]
fn second_flush_stores_only_what_changed_and_both_rebuild() {
    let d = tempfile::tempdir().unwrap();
    let shared = Staging::open(d.path().join("shared")).unwrap();
    let src = d.path().join("local");
    let mut pages = noise(4 << 20, 1);
    let opts = CopyOptions::default();
    let digest1 = sealed(&src, &pages);
    let s1 = flush_epoch(&src, &shared, 1, &digest1, &opts).unwrap();
    assert_eq!(
        s1.written_bytes, s1.image_bytes,
        "nothing to reuse at first"
    );
    // Rewrite 10 % of the memory in one region, and shift the rest by one page.
    let region = noise(400 << 10, 2);
    pages[1 << 20..(1 << 20) + region.len()].copy_from_slice(&region);
    pages.splice(0..0, vec![0u8; 4096]);
    let digest2 = sealed(&src, &pages);
    let s2 = flush_epoch(&src, &shared, 2, &digest2, &opts).unwrap();
    assert!(
        s2.written_bytes * 100 <= s2.image_bytes * 15,
        "second flush wrote {} of {} bytes",
        s2.written_bytes,
        s2.image_bytes
    );
    let out = d.path().join("rebuilt");
    let m = rebuild(&shared, tgt(2), &digest2, Some(&out), &opts).unwrap();
    assert_eq!(fs::read(out.join("images/pages-1.img")).unwrap(), pages);
    assert_eq!(manifest::read(&out).unwrap().0, m);
    rebuild(&shared, tgt(1), &digest1, None, &opts).unwrap();

    // Deleting epoch 1 keeps the packs epoch 2 still uses.
    fs::remove_dir_all(shared.node_dir(1, 1, "n1")).unwrap();
    sweep(&shared, 1, "n1").unwrap();
    rebuild(&shared, tgt(2), &digest2, None, &opts).unwrap();
    // Deleting epoch 2 too frees every pack.
    fs::remove_dir_all(shared.node_dir(1, 2, "n1")).unwrap();
    assert!(sweep(&shared, 1, "n1").unwrap() > 0);
    assert_eq!(
        fs::read_dir(packs_dir(&shared, 1, "n1")).unwrap().count(),
        0
    );
}

#[test]
fn damage_is_found_and_named() {
    let d = tempfile::tempdir().unwrap();
    let shared = Staging::open(d.path().join("shared")).unwrap();
    let src = d.path().join("local");
    let opts = CopyOptions::default();
    let digest = sealed(&src, &noise(1 << 20, 3));
    // A damaged local file fails the flush, naming it.
    let p = src.join("images/pages-1.img");
    let mut b = fs::read(&p).unwrap();
    b[5000] ^= 1;
    fs::write(&p, &b).unwrap();
    let err = flush_epoch(&src, &shared, 1, &digest, &opts).unwrap_err();
    assert!(
        matches!(err, StoreError::FileDigest { .. }) && err.to_string().contains("pages-1"),
        "{err}"
    );
    b[5000] ^= 1;
    fs::write(&p, &b).unwrap();
    flush_epoch(&src, &shared, 1, &digest, &opts).unwrap();
    // A flipped byte in a pack fails the rebuild, naming the pack.
    let pack = packs_dir(&shared, 1, "n1").join("1-1.pack");
    let mut pb = fs::read(&pack).unwrap();
    pb[100] ^= 1;
    fs::write(&pack, &pb).unwrap();
    let err = rebuild(&shared, tgt(1), &digest, None, &opts).unwrap_err();
    assert!(err.to_string().contains("1-1.pack"), "{err}");
    // A missing pack, a torn recipe, another attempt's manifest.
    fs::remove_file(&pack).unwrap();
    let err = rebuild(&shared, tgt(1), &digest, None, &opts).unwrap_err();
    assert!(matches!(err, StoreError::FileMissing { .. }), "{err}");
    let rp = shared.node_dir(1, 1, "n1").join(RECIPE);
    let r = fs::read(&rp).unwrap();
    for len in [0, 10, r.len() - 1] {
        assert!(Recipe::decode(&rp, &r[..len]).is_err());
    }
    assert!(matches!(
        rebuild(&shared, tgt(1), &"00".repeat(32), None, &opts).unwrap_err(),
        StoreError::NotCommitted { .. }
    ));
}

#[test]
fn recipes_round_trip_and_reject_bad_references() {
    let r = Recipe {
        packs: vec!["1-0.pack".into()],
        files: vec![FileRecipe {
            path: "images/x".into(),
            chunks: vec![ChunkRef {
                pack: 0,
                offset: 9,
                len: 3,
                digest: [7; 32],
                compressed: false,
            }],
        }],
    };
    let b = r.encode();
    assert_eq!(Recipe::decode(Path::new("R"), &b).unwrap(), r);
    let mut bad = r.clone();
    bad.files[0].chunks[0].pack = 5;
    assert!(Recipe::decode(Path::new("R"), &bad.encode()).is_err());
    let mut packed = r.clone();
    packed.files[0].chunks[0].compressed = true;
    let b = packed.encode();
    assert_eq!(Recipe::decode(Path::new("R"), &b).unwrap(), packed);
    assert_ne!(b, r.encode(), "the flag is in the recipe");
}

/// Page-like data that compresses about 3:1: runs of zeros and small counters between
/// stretches of noise, as in a job's heap.
fn compressible(n: usize, seed: u64) -> Vec<u8> {
    let noise = noise(n, seed);
    (0..n)
        .map(|i| match (i / 4096) % 4 {
            0 => noise[i],
            1 => 0,
            _ => (i / 8) as u8,
        })
        .collect()
}

#[test]
fn compressed_chunks_rebuild_byte_for_byte_and_mix_with_plain_ones() {
    let d = tempfile::tempdir().unwrap();
    let shared = Staging::open(d.path().join("shared")).unwrap();
    let src = d.path().join("local");
    let zstd = CopyOptions {
        compress: Some(3),
        ..CopyOptions::default()
    };
    let plain = CopyOptions::default();
    let mut pages = compressible(4 << 20, 4);
    // Noise does not compress: those chunks stay as they are.
    pages.extend_from_slice(&noise(1 << 20, 5));
    let digest1 = sealed(&src, &pages);
    let s1 = flush_epoch(&src, &shared, 1, &digest1, &zstd).unwrap();
    assert_eq!(s1.new_bytes, s1.image_bytes);
    assert!(
        s1.written_bytes * 2 < s1.new_bytes,
        "stored {} of {} bytes",
        s1.written_bytes,
        s1.new_bytes
    );
    let r1 = Recipe::read(&shared.node_dir(1, 1, "n1")).unwrap();
    let chunks: Vec<_> = r1.files.iter().flat_map(|f| &f.chunks).collect();
    assert!(chunks.iter().any(|c| c.compressed) && chunks.iter().any(|c| !c.compressed));
    let out = d.path().join("rebuilt");
    rebuild(&shared, tgt(1), &digest1, Some(&out), &zstd).unwrap();
    assert_eq!(fs::read(out.join("images/pages-1.img")).unwrap(), pages);

    // Compression turned off: the next flush stores new chunks plain and still refers to the
    // compressed ones it finds.
    pages[1 << 20..(1 << 20) + 4096].copy_from_slice(&noise(4096, 6));
    let digest2 = sealed(&src, &pages);
    let s2 = flush_epoch(&src, &shared, 2, &digest2, &plain).unwrap();
    assert_eq!(s2.written_bytes, s2.new_bytes);
    assert!(s2.new_bytes < s2.image_bytes / 4, "{s2:?}");
    rebuild(&shared, tgt(2), &digest2, Some(&out), &plain).unwrap();
    assert_eq!(fs::read(out.join("images/pages-1.img")).unwrap(), pages);

    // A flipped byte inside a compressed chunk fails the rebuild, naming the pack.
    let c = chunks.iter().find(|c| c.compressed).unwrap();
    let pack = packs_dir(&shared, 1, "n1").join(&r1.packs[c.pack as usize]);
    let mut pb = fs::read(&pack).unwrap();
    pb[(c.offset + u64::from(c.len) / 2) as usize] ^= 0x10;
    fs::write(&pack, &pb).unwrap();
    let err = rebuild(&shared, tgt(1), &digest1, None, &zstd).unwrap_err();
    assert!(
        matches!(err, StoreError::FileDigest { .. }) && err.to_string().contains(".pack"),
        "{err}"
    );
}
