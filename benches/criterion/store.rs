//! Storage throughput, each measured side by side with its plain counterpart on the same device:
//!
//! * staging: writing an image and sealing it (BLAKE3 digest + fsync, what an epoch costs on a
//!   node before it can commit) vs writing it and fsyncing it;
//! * flush: the first (nothing to deduplicate against) flush to shared storage
//!   (`ckpt_store::dedup::flush`, 4 streams: content-defined chunking, digests checked while
//!   reading, packs fsynced, recipe and manifest last) vs `cp -r` followed by `sync -f` of the
//!   destination.
//!
//! Set `CKPT_BENCH_DIR` to put the files on the device of interest (default: /var/tmp).
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use ckpt_store::copy::{CopyOptions, CopyProgress};
use ckpt_store::layout::Staging;
use ckpt_store::manifest::{self, NodeManifest};
use ckpt_store::testdata::noise;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn base() -> PathBuf {
    std::env::var_os("CKPT_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp"))
}

/// Page-like content: not compressible, not constant.
fn data(bytes: usize) -> Vec<u8> {
    noise(bytes, 0x9e3779b97f4a7c15)
}

fn write_files(dir: &Path, buf: &[u8], files: usize) {
    std::fs::create_dir_all(dir.join("images")).unwrap();
    let per = buf.len() / files;
    for i in 0..files {
        let mut f = std::fs::File::create(dir.join(format!("images/pages-{i}.img"))).unwrap();
        f.write_all(&buf[i * per..(i + 1) * per]).unwrap();
        f.sync_all().unwrap();
    }
}

fn sealed(dir: &Path, buf: &[u8]) -> String {
    write_files(dir, buf, 8);
    let files = ckpt_store::digest::seal_tree(dir, &[manifest::FILE_NAME]).unwrap();
    let m = NodeManifest::new(1, 1, "bench", files);
    manifest::write(dir, &m).unwrap()
}

fn bench(c: &mut Criterion) {
    let root = tempfile::tempdir_in(base()).unwrap();
    let mut g = c.benchmark_group("staging");
    g.sample_size(10);
    for mib in [64usize, 256] {
        let buf = data(mib << 20);
        g.throughput(Throughput::Bytes(buf.len() as u64));
        let dir = root.path().join(format!("stage-{mib}"));
        g.bench_with_input(
            BenchmarkId::new("write+fsync (raw)", mib),
            &buf,
            |b, buf| {
                b.iter(|| {
                    let _ = std::fs::remove_dir_all(&dir);
                    write_files(&dir, buf, 8)
                })
            },
        );
        g.bench_with_input(
            BenchmarkId::new("write+fsync+seal (staging)", mib),
            &buf,
            |b, buf| {
                b.iter(|| {
                    let _ = std::fs::remove_dir_all(&dir);
                    write_files(&dir, buf, 8);
                    ckpt_store::digest::seal_tree(&dir, &[manifest::FILE_NAME]).unwrap()
                })
            },
        );
    }
    g.finish();

    let mut g = c.benchmark_group("flush");
    g.sample_size(10);
    for mib in [64usize, 256] {
        let buf = data(mib << 20);
        let src = root.path().join(format!("src-{mib}"));
        let digest = sealed(&src, &buf);
        drop(buf);
        let dest = root.path().join(format!("dest-{mib}"));
        g.throughput(Throughput::Bytes((mib as u64) << 20));
        g.bench_with_input(BenchmarkId::new("cp -r + sync -f", mib), &src, |b, src| {
            b.iter(|| {
                let _ = std::fs::remove_dir_all(&dest);
                let ok = Command::new("cp").arg("-r").arg(src).arg(&dest).status();
                assert!(ok.unwrap().success());
                let ok = Command::new("sync").arg("-f").arg(&dest).status();
                assert!(ok.unwrap().success());
            })
        });
        g.bench_with_input(
            BenchmarkId::new("dedup::flush (first epoch, 4 streams)", mib),
            &src,
            |b, src| {
                b.iter(|| {
                    // A fresh store each time: nothing to deduplicate against.
                    let _ = std::fs::remove_dir_all(&dest);
                    let shared = Staging::open(&dest).unwrap();
                    ckpt_store::dedup::flush(
                        src,
                        &shared,
                        ckpt_store::dedup::Target {
                            job: 1,
                            epoch: 1,
                            node: "bench",
                        },
                        &digest,
                        &CopyOptions::default(),
                        &CopyProgress::default(),
                    )
                    .unwrap()
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
