//! Synthetic image content and file set-ups for tests and benchmarks. Not part of the storage
//! format.

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

/// Sets a POSIX access ACL on `path`: its owner read and write, `user` with `perm` (4 read,
/// 2 write), no one else. For tests of what an ACL lets a user do.
pub fn set_access_acl(path: &std::path::Path, user: u32, perm: u16) -> std::io::Result<()> {
    let mut blob = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in [
        (0x01u16, 6u16, u32::MAX),
        (0x02, perm, user),
        (0x04, 0, u32::MAX),
        (0x10, perm, u32::MAX),
        (0x20, 0, u32::MAX),
    ] {
        blob.extend(tag.to_le_bytes());
        blob.extend(perm.to_le_bytes());
        blob.extend(id.to_le_bytes());
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(std::io::Error::other)?;
    // SAFETY: setxattr with NUL-terminated strings and a buffer of its stated length.
    let rc = unsafe {
        libc::setxattr(
            c.as_ptr(),
            c"system.posix_acl_access".as_ptr(),
            blob.as_ptr().cast(),
            blob.len(),
            0,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
