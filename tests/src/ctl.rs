//! One ckptctl call's result.
use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
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

    /// Runs `cmd` (a ckptctl) and collects what it printed; kills it and fails the test at
    /// `limit`, naming the call, so that a ckptctl that waits on an answer never hangs a suite.
    #[track_caller]
    pub fn run(cmd: &mut Command, limit: Duration) -> Ctl {
        let child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run ckptctl");
        let what = format!("{:?}", cmd.get_args().collect::<Vec<_>>());
        match collect(child, limit) {
            Ok(c) => c,
            Err(c) => panic!("ckptctl {what} still running after {limit:?}, killed: {c:?}"),
        }
    }

    /// Waits (bounded) for a ckptctl started by [`Ckptd::ctl_spawn`] and collects what it
    /// printed; kills it at `limit`.
    #[track_caller]
    pub fn finish(child: Child, limit: Duration) -> Ctl {
        match collect(child, limit) {
            Ok(c) => c,
            Err(c) => panic!("ckptctl still running after {limit:?}: {c:?}"),
        }
    }

    /// Asserts success and returns stdout.
    #[track_caller]
    pub fn ok(&self) -> &str {
        assert_eq!(self.code, 0, "ckptctl failed: {self:?}");
        &self.stdout
    }
}

/// Waits (bounded by `limit`) for `child`, reading its output as it comes (a full pipe would
/// stop it); `Err` with what it printed if it had to be killed.
fn collect(mut child: Child, limit: Duration) -> Result<Ctl, Ctl> {
    fn drain(r: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    }
    let (out, err) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let ended = wait_child(&mut child, limit);
    if !ended {
        let _ = child.kill();
    }
    let status = child.wait().expect("reap ckptctl");
    let c = Ctl::from(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    });
    if ended {
        Ok(c)
    } else {
        Err(c)
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
