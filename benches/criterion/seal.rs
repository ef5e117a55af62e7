//! Sealing an epoch on a node: BLAKE3 digest and fsync of every image file, then the manifest.
//! This runs after the job is thawed, so it sets how soon an epoch can commit, not how long the
//! job is frozen. Compared side by side with a plain sequential read of the same files (the
//! floor for anything that must look at every byte).
use std::io::Read;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn tree(bytes: usize, files: usize) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("images")).unwrap();
    // Page-like content: not compressible, not constant.
    let per = bytes / files;
    let data = ckpt_store::testdata::noise(per * files, 0x9e3779b97f4a7c15);
    for i in 0..files {
        let part = &data[i * per..(i + 1) * per];
        std::fs::write(d.path().join(format!("images/pages-{i}.img")), part).unwrap();
    }
    d
}

fn read_all(root: &std::path::Path) -> u64 {
    let mut n = 0;
    let mut buf = vec![0u8; 1 << 20];
    for e in std::fs::read_dir(root.join("images")).unwrap().flatten() {
        let mut f = std::fs::File::open(e.path()).unwrap();
        loop {
            let k = f.read(&mut buf).unwrap();
            if k == 0 {
                break;
            }
            n += k as u64;
        }
    }
    n
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("seal");
    g.sample_size(10);
    for mib in [16usize, 64, 256] {
        let bytes = mib << 20;
        let d = tree(bytes, 8);
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_with_input(BenchmarkId::new("read (floor)", mib), &d, |b, d| {
            b.iter(|| read_all(d.path()))
        });
        g.bench_with_input(
            BenchmarkId::new("seal_tree (blake3+fsync)", mib),
            &d,
            |b, d| b.iter(|| ckpt_store::digest::seal_tree(d.path(), &["MANIFEST"]).unwrap()),
        );
        let entries = ckpt_store::digest::seal_tree(d.path(), &["MANIFEST"]).unwrap();
        g.bench_with_input(BenchmarkId::new("verify_tree", mib), &d, |b, d| {
            b.iter(|| ckpt_store::digest::verify_tree(d.path(), &entries).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
