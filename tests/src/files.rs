//! Small file helpers: damaging an image, writing a script.
use std::path::Path;

/// Flips one bit in the middle of the largest file in `dir`; returns that file's name.
pub fn flip_byte_in_largest(dir: &Path) -> String {
    flip_byte_in_largest_named(dir, "")
}

/// [`flip_byte_in_largest`] among the files whose names start with `prefix`.
pub fn flip_byte_in_largest_named(dir: &Path, prefix: &str) -> String {
    let biggest = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .max_by_key(|e| e.metadata().unwrap().len())
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&biggest).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&biggest, bytes).unwrap();
    biggest.file_name().unwrap().to_string_lossy().into_owned()
}

/// Writes an executable shell script.
pub fn script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}
