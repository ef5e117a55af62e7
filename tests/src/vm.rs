//! Soft-RoCE test guests: `scripts/testvm.sh` boots Debian's kernel under QEMU with the host's
//! root file system read-only beneath a tmpfs, so a guest runs this build's binaries, creates the
//! soft-RoCE device `rxe0` and gives real InfiniBand verbs to a test on a host that has none.
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::workspace;

/// The harness script.
pub fn script() -> PathBuf {
    workspace().join("scripts/testvm.sh")
}

/// Why guests cannot run here, if they cannot (`scripts/setup.sh --vm` prepares them).
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root".into());
    }
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .map(|s| !s.success())
        .unwrap_or(true)
    {
        return Some("needs qemu-system-x86_64 (run scripts/setup.sh --vm)".into());
    }
    let dir = std::env::var_os("CKPT_VM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/ckpt-vm"));
    if !dir.join("abi").is_file() {
        return Some(format!(
            "no test VM prepared in {} (run scripts/setup.sh --vm)",
            dir.display()
        ));
    }
    None
}

/// What a guest run returned.
#[derive(Debug)]
pub struct GuestRun {
    /// The script's exit status (125: the guest gave none).
    pub status: i32,
    /// The guest console: the script's output, kernel messages.
    pub console: String,
}

/// Boots one guest, runs `body` (bash) in it as root, and returns its status and console.
/// `settings` are `testvm.sh run` KEY=VALUE settings (name, ip, mac, wire, timeout...).
pub fn run(body: &str, settings: &[&str]) -> GuestRun {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("guest.sh");
    std::fs::write(&file, body).expect("write guest script");
    let out = Command::new(script())
        .arg("run")
        .arg(&file)
        .args(settings)
        .stdin(Stdio::null())
        .output()
        .expect("run testvm.sh");
    GuestRun {
        status: out.status.code().unwrap_or(-1),
        console: String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr),
    }
}
