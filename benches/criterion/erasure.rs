//! Erasure coding of a group's images on one core (`ckpt_store::erasure`): parity encoding of
//! every row of a group, and the rebuild of one lost member, per image byte of the group, for
//! `xor:8`, `rs:4+2` and `rs:8+2`. Streams are in memory (the disk and network are measured
//! elsewhere); 16 MiB a member, of page-like content.
use ckpt_store::erasure::{encode_row, rebuild, Coder, Layout, Losses, Scheme};
use ckpt_store::testdata::noise;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const PER_MEMBER: usize = 16 << 20;

fn group(scheme: Scheme) -> (Layout, Vec<Vec<u8>>) {
    let n = scheme.group_size().expect("a group");
    let streams: Vec<Vec<u8>> = (0..n).map(|i| noise(PER_MEMBER, i as u64 + 1)).collect();
    let lens: Vec<u64> = streams.iter().map(|s| s.len() as u64).collect();
    (Layout::new(scheme.parity(), &lens).unwrap(), streams)
}

fn encode_all(scheme: Scheme, layout: &Layout, streams: &[Vec<u8>]) -> Vec<Vec<Vec<u8>>> {
    let mut coder = Coder::new(scheme.code().unwrap());
    (0..layout.members())
        .map(|row| {
            let mut parity = vec![Vec::new(); layout.parity()];
            let mut read = |m: usize, at: u64, buf: &mut [u8]| {
                buf.copy_from_slice(&streams[m][at as usize..at as usize + buf.len()]);
                Ok(())
            };
            let mut write = |j: usize, b: &[u8]| {
                parity[j].extend_from_slice(b);
                Ok(())
            };
            encode_row(&mut coder, layout, row, &mut read, &mut write).unwrap();
            parity
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let schemes = ["xor:8", "rs:4+2", "rs:8+2"].map(|s| s.parse::<Scheme>().unwrap());
    let mut g = c.benchmark_group("erasure");
    g.sample_size(10);
    for scheme in schemes {
        let (layout, streams) = group(scheme);
        let bytes: u64 = streams.iter().map(|s| s.len() as u64).sum();
        g.throughput(Throughput::Bytes(bytes));
        g.bench_function(BenchmarkId::new("encode group", scheme.to_string()), |b| {
            b.iter(|| encode_all(scheme, &layout, &streams))
        });
        let parity = encode_all(scheme, &layout, &streams);
        // One member lost: what its rebuild reads is the rest of the group's rows it is in.
        g.throughput(Throughput::Bytes(PER_MEMBER as u64));
        g.bench_function(
            BenchmarkId::new("rebuild one member", scheme.to_string()),
            |b| {
                b.iter(|| {
                    let mut out = vec![0u8; PER_MEMBER];
                    let losses = Losses {
                        members: vec![0],
                        damaged: vec![],
                    };
                    let mut read = |m: usize, at: u64, buf: &mut [u8]| {
                        buf.copy_from_slice(&streams[m][at as usize..at as usize + buf.len()]);
                        Ok(())
                    };
                    let mut read_parity = |r: usize, j: usize, at: u64, buf: &mut [u8]| {
                        buf.copy_from_slice(&parity[r][j][at as usize..at as usize + buf.len()]);
                        Ok(())
                    };
                    let mut write = |_: usize, at: u64, b: &[u8]| {
                        out[at as usize..at as usize + b.len()].copy_from_slice(b);
                        Ok(())
                    };
                    let mut coder = Coder::new(scheme.code().unwrap());
                    rebuild(
                        &mut coder,
                        &layout,
                        &losses,
                        &[0],
                        &mut read,
                        &mut read_parity,
                        &mut write,
                    )
                    .unwrap();
                    out
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
