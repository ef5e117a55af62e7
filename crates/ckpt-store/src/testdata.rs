//! Synthetic image content for tests and benchmarks. Not part of the storage format.

/// `n` bytes of page-like content (not compressible, not constant): a xorshift stream started
/// from `seed` (made odd), the same bytes for the same seed every time.
pub fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
