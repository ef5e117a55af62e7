//! The erasure layout and codes: any `M` lost members of a group rebuilt byte for byte, for
//! uneven, empty and unaligned streams; too many lost or damaged shards refused by name; a
//! flipped parity byte found; and a lost node directory rebuilt and verified from its group.
use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::testdata::noise;

fn cand(node: &str, domain: Option<&str>) -> Candidate {
    Candidate {
        node: node.into(),
        domain: domain.map(Into::into),
    }
}

#[test]
fn schemes_parse_and_print_and_bad_ones_say_what_a_scheme_is() {
    for (s, want) in [
        ("partner", Scheme::Partner),
        ("xor", Scheme::Xor { group: 8 }),
        ("xor:4", Scheme::Xor { group: 4 }),
        ("rs:8+2", Scheme::Rs { data: 8, parity: 2 }),
    ] {
        assert_eq!(s.parse::<Scheme>(), Ok(want));
    }
    assert_eq!(Scheme::Rs { data: 4, parity: 2 }.to_string(), "rs:4+2");
    assert_eq!(Scheme::Xor { group: 8 }.to_string(), "xor:8");
    for bad in [
        "xor:1", "xor:65", "rs:0+2", "rs:4+0", "rs:4-2", "rs:40+30", "raid6", "xor:x",
    ] {
        let e = bad.parse::<Scheme>().unwrap_err();
        assert!(e.contains(bad) && e.contains("`rs:K+M`"), "{e}");
    }
    assert!((Scheme::Xor { group: 8 }.stored_per_image_byte() - 8.0 / 7.0).abs() < 1e-9);
    assert!((Scheme::Rs { data: 8, parity: 2 }.stored_per_image_byte() - 1.25).abs() < 1e-9);
}

#[test]
fn groups_are_balanced_spread_over_failure_domains_and_never_too_small() {
    let nodes: Vec<Candidate> = (0..20).map(|i| cand(&format!("n{i}"), None)).collect();
    let sizes = |scheme, n: usize| -> Vec<usize> {
        groups(scheme, &nodes[..n])
            .unwrap()
            .iter()
            .map(Vec::len)
            .collect()
    };
    let xor8 = Scheme::Xor { group: 8 };
    // Never fewer than G a group (but for a job smaller than G): the rest shared out.
    assert_eq!(sizes(xor8, 10), [10]);
    assert_eq!(sizes(xor8, 17), [9, 8]);
    assert_eq!(sizes(xor8, 5), [5]);
    assert_eq!(sizes(Scheme::Rs { data: 4, parity: 2 }, 7), [7]);
    let g = groups(xor8, &nodes[..16]).unwrap();
    assert_eq!(
        g[0],
        ["n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"],
        "node order without domains"
    );

    // Two racks: each group takes from both, alternately.
    let racked: Vec<Candidate> = (0..8)
        .map(|i| cand(&format!("n{i}"), Some(if i < 4 { "r1" } else { "r2" })))
        .collect();
    let g = groups(Scheme::Xor { group: 4 }, &racked).unwrap();
    assert_eq!(g, [["n0", "n4", "n1", "n5"], ["n2", "n6", "n3", "n7"]]);

    // rs:1+4 over 6 nodes: one group of 6.
    let six = &nodes[..6];
    assert_eq!(
        groups(Scheme::Rs { data: 1, parity: 4 }, six)
            .unwrap()
            .len(),
        1
    );
    let e = groups(Scheme::Rs { data: 4, parity: 2 }, &nodes[..2]).unwrap_err();
    assert!(e.contains("at least 3 nodes") && e.contains("has 2"), "{e}");
    assert!(groups(Scheme::Partner, &nodes).is_err());
}

#[test]
fn every_member_holds_parity_of_m_rows_and_none_of_a_row_it_gives_data_to() {
    for n in 2..=12 {
        for m in 1..n {
            let lens: Vec<u64> = (0..n as u64).map(|i| i * 1000 + 1).collect();
            let l = Layout::new(m, &lens).unwrap();
            for (member, &len) in lens.iter().enumerate() {
                let holds = (0..n).filter(|&r| l.holders(r).contains(&member)).count();
                assert_eq!(holds, m, "n {n} m {m} member {member}");
                let segs: Vec<usize> = (0..n)
                    .flat_map(|r| l.contributors(r))
                    .filter(|c| c.member == member)
                    .map(|c| c.segment)
                    .collect();
                assert_eq!(
                    segs,
                    (0..n - m).collect::<Vec<_>>(),
                    "each segment once, in order"
                );
                // Its segments cover its stream exactly.
                let covered: u64 = segs
                    .iter()
                    .map(|&s| l.segment_in_stream(Contribution { member, segment: s }).1)
                    .sum();
                assert_eq!(covered, len);
            }
            for r in 0..n {
                let holders = l.holders(r);
                assert!(l
                    .contributors(r)
                    .iter()
                    .all(|c| !holders.contains(&c.member)));
                assert_eq!(l.contributors(r).len(), n - m);
            }
        }
    }
    assert!(Layout::new(2, &[1, 2]).is_err(), "no data left in a row");
}

type Parity = HashMap<(usize, usize), Vec<u8>>;

fn encode_all(code: Code, layout: &Layout, streams: &[Vec<u8>]) -> (Vec<ParityShard>, Parity) {
    let mut coder = Coder::new(code);
    let mut shards = Vec::new();
    let mut parity: Parity = HashMap::new();
    for row in 0..layout.members() {
        let mut read = |m: usize, at: u64, buf: &mut [u8]| {
            buf.copy_from_slice(&streams[m][at as usize..at as usize + buf.len()]);
            Ok(())
        };
        let mut write = |j: usize, b: &[u8]| {
            parity.entry((row, j)).or_default().extend_from_slice(b);
            Ok(())
        };
        shards.extend(encode_row(&mut coder, layout, row, &mut read, &mut write).unwrap());
    }
    (shards, parity)
}

/// Rebuilds the lost members' streams from the others and the parity left.
fn rebuild_lost(
    code: Code,
    layout: &Layout,
    streams: &[Vec<u8>],
    parity: &Parity,
    losses: &Losses,
) -> Result<HashMap<usize, Vec<u8>>, CodeError> {
    rebuild_wanted(code, layout, streams, parity, losses, &losses.members)
}

/// Rebuilds the `wanted` lost members; writing any other member's bytes fails the test.
fn rebuild_wanted(
    code: Code,
    layout: &Layout,
    streams: &[Vec<u8>],
    parity: &Parity,
    losses: &Losses,
    wanted: &[usize],
) -> Result<HashMap<usize, Vec<u8>>, CodeError> {
    let mut out: HashMap<usize, Vec<u8>> = wanted
        .iter()
        .map(|&m| (m, vec![0xee; layout.len(m) as usize]))
        .collect();
    let mut read = |m: usize, at: u64, buf: &mut [u8]| {
        assert!(!losses.members.contains(&m), "read a lost member");
        buf.copy_from_slice(&streams[m][at as usize..at as usize + buf.len()]);
        Ok(())
    };
    let mut read_parity = |r: usize, j: usize, at: u64, buf: &mut [u8]| {
        buf.copy_from_slice(&parity[&(r, j)][at as usize..at as usize + buf.len()]);
        Ok(())
    };
    let mut write = |m: usize, at: u64, b: &[u8]| {
        let o = out.get_mut(&m).expect("only wanted members are written");
        o[at as usize..at as usize + b.len()].copy_from_slice(b);
        Ok(())
    };
    rebuild(
        &mut Coder::new(code),
        layout,
        losses,
        wanted,
        &mut read,
        &mut read_parity,
        &mut write,
    )?;
    Ok(out)
}

fn streams_of(lens: &[u64], seed: u64) -> Vec<Vec<u8>> {
    lens.iter()
        .enumerate()
        .map(|(i, &l)| noise(l as usize, seed + i as u64))
        .collect()
}

fn subsets(n: usize, k: usize) -> Vec<Vec<usize>> {
    (0u64..1 << n)
        .filter(|b| b.count_ones() as usize == k)
        .map(|b| (0..n).filter(|i| b & 1 << i != 0).collect())
        .collect()
}

#[test]
fn any_m_lost_members_are_rebuilt_byte_for_byte_with_uneven_empty_and_unaligned_streams() {
    // Lengths: uneven, one empty, one of a single byte, others not multiples of anything.
    let lens = [100_003u64, 0, 1, 77_777, 4_096, 250_001];
    let streams = streams_of(&lens, 7);
    for (code, m) in [
        (Code::Xor, 1),
        (Code::Rs { parity: 1 }, 1),
        (Code::Rs { parity: 2 }, 2),
        (Code::Rs { parity: 3 }, 3),
    ] {
        let layout = Layout::new(m, &lens).unwrap();
        let (shards, parity) = encode_all(code, &layout, &streams);
        assert_eq!(shards.len(), lens.len() * m);
        let stored: u64 = (0..lens.len()).map(|x| layout.parity_bytes_of(x)).sum();
        assert_eq!(stored, shards.iter().map(|s| s.size).sum::<u64>());
        for k in 1..=m {
            for lost in subsets(lens.len(), k) {
                let losses = Losses {
                    members: lost.clone(),
                    damaged: vec![],
                };
                let got = rebuild_lost(code, &layout, &streams, &parity, &losses)
                    .unwrap_or_else(|e| panic!("{code:?} lost {lost:?}: {e}"));
                for (mbr, bytes) in got {
                    assert!(
                        bytes == streams[mbr],
                        "{code:?} lost {lost:?}: member {mbr} differs"
                    );
                }
            }
        }
        // One more than the scheme survives: refused, naming the row and what is gone.
        let lost: Vec<usize> = (0..=m).collect();
        let e = rebuild_lost(
            code,
            &layout,
            &streams,
            &parity,
            &Losses {
                members: lost,
                damaged: vec![],
            },
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("cannot be rebuilt") && msg.contains("lost member"),
            "{msg}"
        );
    }
}

#[test]
fn stripes_code_as_the_whole_shard_does() {
    // Rows longer than a stripe: the parity is the crate's over the whole padded shards.
    let lens = [
        3 * STRIPE as u64 + 5,
        2 * STRIPE as u64,
        3 * STRIPE as u64 - 64,
        100,
    ];
    let streams = streams_of(&lens, 11);
    let layout = Layout::new(2, &lens).unwrap();
    let (_, parity) = encode_all(Code::Rs { parity: 2 }, &layout, &streams);
    for row in 0..4 {
        let size = layout.row_size(row) as usize;
        assert!(size > STRIPE);
        let shards: Vec<Vec<u8>> = layout
            .contributors(row)
            .iter()
            .map(|&c| {
                let (start, real) = layout.segment_in_stream(c);
                let mut s = streams[c.member][start as usize..(start + real) as usize].to_vec();
                s.resize(size, 0);
                s
            })
            .collect();
        let whole = reed_solomon_simd::encode(2, 2, &shards).unwrap();
        assert!(
            whole[0] == parity[&(row, 0)] && whole[1] == parity[&(row, 1)],
            "row {row}"
        );
    }
}

#[test]
fn a_flipped_parity_byte_is_found_and_the_rebuild_uses_other_shards_or_is_refused() {
    let lens = [40_000u64, 30_000, 50_000, 45_000, 10_000];
    let streams = streams_of(&lens, 3);
    let layout = Layout::new(2, &lens).unwrap();
    let code = Code::Rs { parity: 2 };
    let (shards, mut parity) = encode_all(code, &layout, &streams);
    // Row 0's parity 1 (on member 1) gets one byte flipped.
    parity.get_mut(&(0, 1)).unwrap()[1234] ^= 0x10;
    let mut read_parity = |r: usize, j: usize, at: u64, buf: &mut [u8]| {
        buf.copy_from_slice(&parity[&(r, j)][at as usize..at as usize + buf.len()]);
        Ok(())
    };
    let damaged = verify_parity(&layout, &shards, &[4], &mut read_parity);
    assert_eq!(damaged, [(0, 1)]);

    // Member 4 lost (it gives row 0 data): row 0 has one parity shard left, enough.
    let losses = Losses {
        members: vec![4],
        damaged: damaged.clone(),
    };
    let got = rebuild_lost(code, &layout, &streams, &parity, &losses).unwrap();
    assert!(got[&4] == streams[4]);
    // Members 3 and 4 lost: row 0 needs both parity shards, one is damaged: refused.
    let losses = Losses {
        members: vec![3, 4],
        damaged,
    };
    let e = rebuild_lost(code, &layout, &streams, &parity, &losses).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("row 0 cannot be rebuilt") && msg.contains("damaged, on member 1"),
        "{msg}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_groups_and_losses_rebuild(
        lens in proptest::collection::vec(0u64..20_000, 2..9),
        m_seed in 0usize..8,
        lost_seed in any::<u64>(),
        xor in any::<bool>(),
    ) {
        let n = lens.len();
        let m = if xor { 1 } else { 1 + m_seed % (n - 1) };
        let code = if xor { Code::Xor } else { Code::Rs { parity: m } };
        let streams = streams_of(&lens, lost_seed);
        let layout = Layout::new(m, &lens).unwrap();
        let (_, parity) = encode_all(code, &layout, &streams);
        let k = 1 + (lost_seed as usize) % m;
        let mut lost: Vec<usize> = (0..n).collect();
        // A pseudo-random choice of k members.
        let mut x = lost_seed | 1;
        for i in (1..n).rev() {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            lost.swap(i, (x % (i as u64 + 1)) as usize);
        }
        lost.truncate(k);
        let got = rebuild_lost(code, &layout, &streams, &parity, &Losses { members: lost, damaged: vec![] }).unwrap();
        for (mbr, bytes) in got {
            prop_assert!(bytes == streams[mbr]);
        }
    }
}

mod on_disk {
    use std::fs;
    use std::path::Path;

    use super::*;
    use crate::digest::seal_tree;
    use crate::manifest::{self, NodeManifest};

    /// A sealed node directory with a few image files of `seed`'s content; its committed digest.
    fn sealed(dir: &Path, node: &str, seed: u64) -> String {
        fs::create_dir_all(dir.join("images")).unwrap();
        fs::write(
            dir.join("images/pages-1.img"),
            noise(300_000 + seed as usize * 1_000, seed),
        )
        .unwrap();
        fs::write(dir.join("images/empty.img"), b"").unwrap();
        fs::write(dir.join("images/core-1.img"), noise(999, seed + 100)).unwrap();
        let files = seal_tree(dir, &[manifest::FILE_NAME]).unwrap();
        manifest::write(dir, &NodeManifest::new(1, 3, node, files)).unwrap()
    }

    #[test]
    fn a_lost_node_directory_is_rebuilt_from_its_group_and_verified_and_a_wrong_one_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let nodes = ["a", "b", "c", "d"];
        let mut streams = Vec::new();
        let mut members = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            let dir = tmp.path().join(n);
            let committed = sealed(&dir, n, i as u64 + 1);
            let s = NodeStream::open(&dir, &committed).unwrap();
            s.verify().unwrap();
            members.push(s.member(n, &committed));
            streams.push(s);
        }
        let lens: Vec<u64> = streams.iter().map(NodeStream::len).collect();
        let layout = Layout::new(1, &lens).unwrap();
        // Parity of every row, as files on their holders.
        let mut coder = Coder::new(Code::Xor);
        let mut shards = Vec::new();
        for row in 0..nodes.len() {
            let holder = layout.holders(row)[0];
            let path = tmp.path().join(format!("parity-{row}-{holder}"));
            let mut out = fs::File::create(&path).unwrap();
            let mut read = |m: usize, at: u64, buf: &mut [u8]| streams[m].read_at(at, buf);
            let mut write = |_: usize, b: &[u8]| std::io::Write::write_all(&mut out, b);
            shards.extend(encode_row(&mut coder, &layout, row, &mut read, &mut write).unwrap());
        }
        let record = Encoding {
            scheme: "xor:4".into(),
            members: members.clone(),
            parity: shards.clone(),
        };
        let json = serde_json::to_string(&record).unwrap();
        let back: Encoding = serde_json::from_str(&json).unwrap();
        assert_eq!(back.layout().unwrap().1, layout);

        // Node c is gone, disks and all.
        fs::remove_dir_all(tmp.path().join("c")).unwrap();
        streams.remove(2);
        let mut rebuilt = vec![0u8; layout.len(2) as usize];
        let parity_of = |r: usize| {
            tmp.path()
                .join(format!("parity-{r}-{}", layout.holders(r)[0]))
        };
        let mut read_parity = |r: usize, _: usize, at: u64, buf: &mut [u8]| {
            use std::os::unix::fs::FileExt;
            fs::File::open(parity_of(r))?.read_exact_at(buf, at)
        };
        assert!(verify_parity(&layout, &shards, &[2], &mut read_parity).is_empty());
        let mut read = |m: usize, at: u64, buf: &mut [u8]| {
            let i = if m > 2 { m - 1 } else { m };
            streams[i].read_at(at, buf)
        };
        let mut write = |_: usize, at: u64, b: &[u8]| {
            rebuilt[at as usize..at as usize + b.len()].copy_from_slice(b);
            Ok(())
        };
        let losses = Losses {
            members: vec![2],
            damaged: vec![],
        };
        rebuild(
            &mut Coder::new(Code::Xor),
            &layout,
            &losses,
            &[2],
            &mut read,
            &mut read_parity,
            &mut write,
        )
        .unwrap();
        let dest = tmp.path().join("c-rebuilt");
        let mut from = |at: u64, buf: &mut [u8]| {
            buf.copy_from_slice(&rebuilt[at as usize..at as usize + buf.len()]);
            Ok(())
        };
        let m = files::unpack(&mut from, &members[2], &dest).unwrap();
        assert_eq!(m.node, "c");
        let (_, digest) = manifest::read(&dest).unwrap();
        assert_eq!(digest, members[2].manifest_digest);
        crate::digest::verify_tree(&dest, &m.files).unwrap();

        // One wrong byte in the middle of a rebuilt image: the unpack refuses it by digest.
        let at = members[2].manifest_len as usize + 1_000;
        rebuilt[at] ^= 1;
        let mut from = |o: u64, buf: &mut [u8]| {
            buf.copy_from_slice(&rebuilt[o as usize..o as usize + buf.len()]);
            Ok(())
        };
        let e = files::unpack(&mut from, &members[2], &tmp.path().join("c-bad")).unwrap_err();
        assert!(e.to_string().contains("pages-1.img"), "{e}");
    }
}

#[test]
fn rows_longer_than_a_stripe_are_rebuilt_too() {
    // Several stripes a row, the last one short: both codes, every loss the scheme survives.
    let lens = [
        5 * STRIPE as u64 + 777,
        4 * STRIPE as u64,
        6 * STRIPE as u64 - 64,
        3 * STRIPE as u64 + 1,
        5 * STRIPE as u64,
        2 * STRIPE as u64 + 5,
    ];
    let streams = streams_of(&lens, 21);
    for (code, m) in [(Code::Xor, 1), (Code::Rs { parity: 2 }, 2)] {
        let layout = Layout::new(m, &lens).unwrap();
        let (_, parity) = encode_all(code, &layout, &streams);
        for lost in subsets(lens.len(), m) {
            let losses = Losses {
                members: lost.clone(),
                damaged: vec![],
            };
            let got = rebuild_lost(code, &layout, &streams, &parity, &losses).unwrap();
            for (mbr, bytes) in got {
                assert!(
                    bytes == streams[mbr],
                    "{code:?} lost {lost:?}: member {mbr} differs"
                );
            }
        }
    }
}

#[test]
fn one_of_two_lost_members_is_rebuilt_without_the_others_bytes_handed_out() {
    // A node restores one lost member's part; the other lost member's segments are decoded
    // where the code needs them, but only the wanted member's bytes are written.
    let lens = [300_001u64, 200_000, 250_000, 280_003, 260_000, 240_000];
    let streams = streams_of(&lens, 5);
    let code = Code::Rs { parity: 2 };
    let layout = Layout::new(2, &lens).unwrap();
    let (_, parity) = encode_all(code, &layout, &streams);
    let losses = Losses {
        members: vec![1, 4],
        damaged: vec![],
    };
    let out = rebuild_wanted(code, &layout, &streams, &parity, &losses, &[1]).unwrap();
    assert_eq!(out.len(), 1);
    assert!(out[&1] == streams[1]);
}
