//! One ckptctl call's result.
use std::process::{Child, Output};
use std::time::{Duration, Instant};

/// Result of one ckptctl call.
#[derive(Debug)]
pub struct Ctl {
    /// Exit code.
    pub code: i32,
    /// Stdout.
    pub stdout: String,
    /// Stderr.
    pub stderr: String,
}

impl Ctl {
    pub(crate) fn from(o: Output) -> Self {
        Ctl {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }

    /// Waits (bounded) for a ckptctl started by [`Ckptd::ctl_spawn`] and collects what it
    /// printed; kills it at `limit`.
    #[track_caller]
    pub fn finish(mut child: Child, limit: Duration) -> Ctl {
        if !wait_child(&mut child, limit) {
            let _ = child.kill();
            panic!(
                "ckptctl still running after {limit:?}: {:?}",
                Ctl::from(child.wait_with_output().expect("collect ckptctl"))
            );
        }
        Ctl::from(child.wait_with_output().expect("collect ckptctl"))
    }

    /// Asserts success and returns stdout.
    #[track_caller]
    pub fn ok(&self) -> &str {
        assert_eq!(self.code, 0, "ckptctl failed: {self:?}");
        &self.stdout
    }
}

/// Waits (bounded by `limit`) until `c` ends; whether it did.
pub(crate) fn wait_child(c: &mut Child, limit: Duration) -> bool {
    let begin = Instant::now();
    while begin.elapsed() < limit {
        if matches!(c.try_wait(), Ok(Some(_))) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}
