//! Pages an HCA wrote, made visible to a pre-copy.
//!
//! A pre-copy (CRIU's pre-dump) copies a running process's memory and then finds what changed
//! since through the kernel's soft-dirty bits, which the MMU sets when the CPU writes a page.
//! An adapter writes registered memory by DMA (a receive, an RDMA write or read response from a
//! peer) and sets no such bit, so a page the adapter wrote after the last pre-dump would be
//! left out of the checkpoint and restored stale. Before the memory is deregistered (after the
//! last DMA into it), [`mark_written`] writes every page of every region the adapter could
//! write with an atomic no-op: the page is soft-dirty again, and a program thread writing the
//! same byte at the same moment loses nothing. Pages of a mapping that is not writable now are
//! left alone (a write would fault); their content cannot have changed since registration
//! through the CPU, and an adapter cannot write through a read-only mapping's registration.
use std::sync::atomic::{AtomicU8, Ordering};

/// Access flags under which the adapter may write the memory: `IBV_ACCESS_LOCAL_WRITE` (receives,
/// RDMA read responses, atomics' results) and `IBV_ACCESS_REMOTE_WRITE`/`REMOTE_ATOMIC`.
pub const WRITE_ACCESS: u32 = 1 | 2 | 8;

/// A writable mapping of this process: `[start, end)`.
fn writable_ranges(maps: &str) -> Vec<(u64, u64)> {
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_ascii_whitespace();
            let range = f.next()?;
            let perms = f.next()?;
            if perms.as_bytes().get(1) != Some(&b'w') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect()
}

/// The page-aligned addresses of `regions` (start, length) that lie in `writable` mappings,
/// each once.
fn pages_to_mark(regions: &[(u64, usize)], writable: &[(u64, u64)], page: u64) -> Vec<u64> {
    let mut out = Vec::new();
    for &(addr, len) in regions {
        if len == 0 {
            continue;
        }
        let end = addr.saturating_add(len as u64);
        for &(s, e) in writable {
            let (lo, hi) = (addr.max(s), end.min(e));
            if lo >= hi {
                continue;
            }
            let mut p = lo & !(page - 1);
            while p < hi {
                out.push(p);
                p += page;
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Makes every page of `regions` (start, length: memory registered with [`WRITE_ACCESS`])
/// soft-dirty; returns how many pages. Call it after the last DMA into them and before the
/// snapshot.
pub fn mark_written(regions: &[(u64, usize)]) -> usize {
    if regions.is_empty() {
        return 0;
    }
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return 0;
    };
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let pages = pages_to_mark(regions, &writable_ranges(&maps), page);
    for &p in &pages {
        // SAFETY: `p` is the first byte of a page inside a writable mapping of this process
        // (read just now; the regions are registered, so pinned and not unmapped while the
        // layer holds them). An atomic add of zero changes no value.
        unsafe { (*(p as *const AtomicU8)).fetch_add(0, Ordering::Relaxed) };
    }
    pages.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_writable_mappings_count_and_each_page_once() {
        let maps = "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/app\n\
                    7f0000000000-7f0000004000 rw-p 00000000 00:00 0 \n\
                    7f0000004000-7f0000006000 r--p 00000000 00:00 0 \n\
                    7f0000006000-7f0000008000 rw-s 00000000 00:05 12 /dev/shm/seg\n";
        let w = writable_ranges(maps);
        assert_eq!(
            w,
            vec![
                (0x7f00_0000_0000, 0x7f00_0000_4000),
                (0x7f00_0000_6000, 0x7f00_0000_8000)
            ]
        );
        // A region across all three, and an overlapping one: pages of the read-only mapping
        // are skipped, a page shared by two regions is marked once, an unaligned start counts
        // its page.
        let regions = [(0x7f00_0000_1010, 0x7000), (0x7f00_0000_3000, 0x10)];
        let p = pages_to_mark(&regions, &w, 0x1000);
        assert_eq!(
            p,
            vec![
                0x7f00_0000_1000,
                0x7f00_0000_2000,
                0x7f00_0000_3000,
                0x7f00_0000_6000,
                0x7f00_0000_7000
            ]
        );
        assert!(pages_to_mark(&[(0x400000, 0x1000)], &w, 0x1000).is_empty());
        assert!(pages_to_mark(&[(0x7f00_0000_0000, 0)], &w, 0x1000).is_empty());
    }

    #[test]
    fn marking_keeps_the_memory_as_it_was() {
        let mut buf = vec![7u8; 3 * 4096 + 5];
        buf[4096] = 42;
        let n = mark_written(&[(buf.as_ptr() as u64, buf.len())]);
        assert!((4..=5).contains(&n), "{n} pages");
        assert_eq!(buf[4096], 42);
        assert!(buf
            .iter()
            .enumerate()
            .all(|(i, &b)| b == if i == 4096 { 42 } else { 7 }));
    }
}
