//! Where a sandbox sees its job directory. Kept apart from the rest of [`crate::os::sandbox`], which
//! uses the shim's mount helpers (`shim/guard.rs`), because the shim, which mounts it, and the
//! put-back of `owner.rs`, which finds the part's outputs there, name it too.

/// Where a sandbox sees its job directory (a bind mount of the node's, which holds the part's
/// stdout and stderr): the same path on every node, so that a part's open outputs are found
/// again wherever it is restored.
pub const JOB_DIR: &str = "/run/ckpt-job";
/// [`JOB_DIR`] for system calls.
pub const JOB_DIR_C: &std::ffi::CStr = c"/run/ckpt-job";
/// The engine's name for that mount, which a restore binds to the node's job directory.
pub const JOB_DIR_KEY: &str = "ckpt-job-dir";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_directory_has_one_path() {
        assert_eq!(JOB_DIR_C.to_str().unwrap(), JOB_DIR);
    }
}
