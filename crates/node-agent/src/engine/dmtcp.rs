//! The DMTCP engine: a job runs under `dmtcp_launch` with a DMTCP coordinator of its own, which
//! `dmtcp_launch --new-coordinator` starts as the job's owner inside the job's cgroup (so it
//! ends with the job, and a cancel or kill takes it too). DMTCP needs no root: its processes
//! write their own images, as the job's owner, into the job's session directory on this node.
//!
//! * Checkpoint: `dmtcp_command -c` to the job's coordinator. DMTCP suspends the job's threads
//!   itself (a frozen cgroup could not checkpoint itself), writes one `ckpt_*.dmtcp` per
//!   process, then the coordinator writes `dmtcp_restart_script_<id>.sh`, makes it executable,
//!   links `dmtcp_restart_script.sh` to it, and the job runs on. That link's appearance is the
//!   end of the checkpoint: DMTCP 4.2's `dmtcp_command -bc` returns before the checkpoint ends,
//!   and the script itself appears before the coordinator is done with it (it dies if the
//!   script is gone before its `chmod`, and the job then hangs): the scripts are left until the
//!   next checkpoint. The images then move, without being copied, from the session
//!   directory (the owner's) into the epoch's staging (root's): each is opened without
//!   following links, must be a regular file of the owner's with one link, is renamed by
//!   descriptor, is checked to be the same file after the move, and becomes root's (0644: the
//!   restore reads it as the owner, through a link in a directory only the owner reaches).
//! * Restart: `dmtcp_restart --new-coordinator` on the images, started by the shim as the job's
//!   owner; that process becomes the job's root again (DMTCP virtualizes PIDs, so the old ones
//!   need not be free).
//!   Each process's saved files (`ckpt_*_files/`, copies of the shared files it mapped) move
//!   into staging the same way; the restore puts them back, as the owner, at the path the
//!   process recorded, which is why the session's path is the same in every incarnation.
//! * Settings a job did not set itself (each needed under DMTCP 4.2 on this platform): for
//!   MPICH 4.0 over UCX, `UCX_TLS=^sysv,cma` (UCX's SysV segments fail in DMTCP's SysV plugin;
//!   CMA reaches peers by real PID, which a restart changes), `UCX_MEM_EVENTS=no`,
//!   `HWLOC_COMPONENTS=-linuxio`; for Open MPI 4.1, TCP on the loopback between ranks (its
//!   shared-memory transport hangs after a restart), `mmap` shared memory (its SysV probe
//!   crashes DMTCP's SysV plugin), and its session directory in the job's session.
//!
//! What it cannot do: pre-copy (no pre-dumps), InfiniBand verbs (DMTCP's plugin was removed
//! upstream; such a job is refused at checkpoint as with CRIU), and, in this version, a job
//! whose parts run on several nodes (refused at the second node's launch).
//!
//! One file: DMTCP's launch, coordinator, checkpoint and restart, which each rely on how the others
//! name and own the session directory.
use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_proto::Engine;

use super::{Beside, DumpSpec, EngineError, RestoreSpec, SnapshotEngine, SESSION_IMAGES};
use crate::config::EnginesConfig;

/// File in the session directory where `dmtcp_launch` and `dmtcp_restart` write the port of
/// the coordinator they start.
pub const PORT_FILE: &str = "coordinator.port";
/// What the images of a DMTCP checkpoint are called (`ckpt_<program>_<id>.dmtcp`).
const IMAGE_PREFIX: &str = "ckpt_";
const IMAGE_SUFFIX: &str = ".dmtcp";
/// The coordinator writes `dmtcp_restart_script_<id>.sh` once every image of a checkpoint is
/// written, and this link to it last.
const RESTART_SCRIPT_LINK: &str = "dmtcp_restart_script.sh";
/// What the scripts' names start with.
const RESTART_SCRIPT_PREFIX: &str = "dmtcp_restart_script";
/// What DMTCP calls the directory where a process saves the files it checkpoints
/// (`ckpt_<program>_<id>_files`), beside its image.
const FILES_SUFFIX: &str = "_files";
/// The file in such a directory that maps each saved copy to the file it is of
/// (`<copy>:<path>` lines).
const FD_INFO: &str = "fd-info.txt";
/// The session's directory for the job's temporary session files (Open MPI's session
/// directory tree), the owner's.
const TMP: &str = "tmp";
/// Environment a job gets unless it set the variable itself; see the module text.
const JOB_ENV: [(&str, &str); 7] = [
    ("UCX_TLS", "^sysv,cma"),
    ("UCX_MEM_EVENTS", "no"),
    ("HWLOC_COMPONENTS", "-linuxio"),
    ("OMPI_MCA_btl", "self,tcp"),
    ("OMPI_MCA_btl_tcp_if_include", "lo"),
    ("OMPI_MCA_pml", "ob1"),
    ("OMPI_MCA_shmem", "mmap"),
];

/// A checked DMTCP installation.
#[derive(Debug, Clone)]
pub struct Dmtcp {
    bin: PathBuf,
    version: String,
    timeout: Duration,
}

/// Whether `name` is a DMTCP image file name.
pub fn is_image(name: &str) -> bool {
    name.starts_with(IMAGE_PREFIX) && name.ends_with(IMAGE_SUFFIX) && !name.contains('/')
}

/// Whether `name` is the name of the directory of a process's saved files.
fn is_files_dir(name: &str) -> bool {
    name.starts_with(IMAGE_PREFIX) && name.ends_with(FILES_SUFFIX) && !name.contains('/')
}

impl Dmtcp {
    /// Finds DMTCP as `[engines] dmtcp` says (`auto`: the prefix `scripts/setup.sh` recorded,
    /// else `dmtcp_launch` on PATH, else under /opt/dmtcp or /usr/local) and reads its version. None: not installed (or `off`); an
    /// error: installed where configured but unusable.
    pub fn detect(cfg: &EnginesConfig) -> Result<Option<Self>, EngineError> {
        let bin = match cfg.dmtcp.as_str() {
            "off" => return Ok(None),
            "auto" => match find_auto() {
                Some(b) => b,
                None => return Ok(None),
            },
            p => {
                let p = Path::new(p);
                // A prefix (its bin/) or the directory of the binaries.
                if p.join("bin").join("dmtcp_launch").exists() {
                    p.join("bin")
                } else {
                    p.to_path_buf()
                }
            }
        };
        let launch = bin.join("dmtcp_launch");
        let text = super::version_text(
            Engine::Dmtcp.as_str(),
            &launch.display().to_string(),
            "install DMTCP (see docs/dmtcp.md) or set [engines] dmtcp in the agent config (\"off\": no DMTCP)",
        )?;
        let version = parse_version(&text).ok_or_else(|| EngineError::CheckFailed {
            path: launch.display().to_string(),
            output: format!("unrecognised `--version` output: {:?}", text.trim()),
        })?;
        for tool in ["dmtcp_command", "dmtcp_restart", "dmtcp_coordinator"] {
            if !bin.join(tool).exists() {
                return Err(EngineError::CheckFailed {
                    path: bin.display().to_string(),
                    output: format!("{tool} is missing beside dmtcp_launch"),
                });
            }
        }
        Ok(Some(Dmtcp {
            bin,
            version,
            timeout: cfg.dmtcp_checkpoint_timeout,
        }))
    }

    /// Directory of the DMTCP binaries.
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    fn tool(&self, name: &str) -> String {
        self.bin.join(name).display().to_string()
    }

    /// Runs `dmtcp_command -p PORT ARG` as `owner`; its output, or why it failed.
    fn command(&self, port: u16, arg: &str, owner: u32) -> Result<String, String> {
        let gid = crate::os::owner::Identity::primary_gid(owner);
        let out = Command::new(self.tool("dmtcp_command"))
            .args(["--coord-host", "127.0.0.1", "--coord-port"])
            .arg(port.to_string())
            .arg(arg)
            .uid(owner)
            .gid(gid)
            .env_remove("DMTCP_COORD_HOST")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.tool("dmtcp_command")))?;
        let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        if out.status.success() {
            Ok(text)
        } else {
            Err(one_line(&text))
        }
    }
}

/// Where `scripts/setup.sh --dmtcp PREFIX` records the prefix it was given or found.
const SETUP_RECORD: &str = "/etc/ckpt/dmtcp-path";

fn find_auto() -> Option<PathBuf> {
    let recorded = fs::read_to_string(SETUP_RECORD)
        .ok()
        .map(|p| Path::new(p.trim()).join("bin"));
    let path = std::env::var_os("PATH").unwrap_or_default();
    recorded
        .into_iter()
        .chain(std::env::split_paths(&path))
        .chain([
            PathBuf::from("/opt/dmtcp/bin"),
            PathBuf::from("/usr/local/bin"),
        ])
        .find(|d| d.join("dmtcp_launch").is_file())
}

/// "4.2.0" from `dmtcp_launch --version` ("dmtcp_launch (DMTCP) 4.2.0").
pub fn parse_version(text: &str) -> Option<String> {
    text.lines()
        .find(|l| l.contains("DMTCP"))
        .and_then(|l| l.split_whitespace().last())
        .filter(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(str::to_string)
}

fn one_line(text: &str) -> String {
    let t: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    if t.is_empty() {
        "it printed nothing".into()
    } else {
        t.join(" ")
    }
}

/// A directory opened without following a link anywhere on its path.
fn open_dir(path: &Path) -> std::io::Result<fs::File> {
    crate::os::owner::open_no_symlinks(path, libc::O_RDONLY | libc::O_DIRECTORY, 0)
}

/// `name` in the directory open on `dir`, opened with `flags` (and `O_NOFOLLOW`, `O_CLOEXEC`).
fn openat_in(dir: &fs::File, name: &str, flags: libc::c_int) -> std::io::Result<fs::File> {
    let c = CString::new(name).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: openat on a live directory descriptor and a NUL-terminated name.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened and owned by nobody else.
    Ok(fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// `name` in the directory open on `dir`, opened for reading without following a link and
/// without blocking (a FIFO planted there does not hang the agent).
fn open_in(dir: &fs::File, name: &str) -> std::io::Result<fs::File> {
    openat_in(dir, name, libc::O_RDONLY | libc::O_NONBLOCK)
}

/// Entry names of the directory open on `dir`.
fn names(dir: &fs::File) -> std::io::Result<Vec<String>> {
    let mut v: Vec<String> = fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    Ok(v)
}

fn unlink_in(dir: &fs::File, name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: unlinkat on a live directory descriptor and a NUL-terminated name.
        unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) };
    }
}

/// The directory `name` in the directory open on `dir`, opened without following a link.
fn open_dir_in(dir: &fs::File, name: &str) -> std::io::Result<fs::File> {
    openat_in(dir, name, libc::O_RDONLY | libc::O_DIRECTORY)
}

/// Removes the directory `name` of the directory open on `dir` with the files in it (one
/// level: what DMTCP and the restore make), through descriptors only: whatever the owner
/// put there, nothing outside it is touched.
fn remove_flat_dir(dir: &fs::File, name: &str) {
    if let Ok(d) = open_dir_in(dir, name) {
        for n in names(&d).unwrap_or_default() {
            unlink_in(&d, &n);
        }
    }
    if let Ok(c) = CString::new(name) {
        // SAFETY: unlinkat on a live directory descriptor and a NUL-terminated name.
        unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), libc::AT_REMOVEDIR) };
    }
}

/// Moves a process's saved files (the directory `name` of the session, the owner's) into a
/// directory of the same name in staging, each as [`adopt_image`] moves an image; the bytes.
fn adopt_files_dir(
    session: &fs::File,
    images: &fs::File,
    name: &str,
    owner: u32,
) -> Result<u64, String> {
    let from = open_dir_in(session, name).map_err(|e| format!("{name}: {e}"))?;
    let m = from.metadata().map_err(|e| format!("{name}: {e}"))?;
    if m.uid() != owner {
        return Err(format!(
            "{name} is not a directory of the job's owner (uid {}): refused",
            m.uid()
        ));
    }
    let c = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: mkdirat on a live directory descriptor and a NUL-terminated name.
    if unsafe { libc::mkdirat(images.as_raw_fd(), c.as_ptr(), 0o755) } != 0 {
        return Err(format!(
            "create {name} in staging: {}",
            std::io::Error::last_os_error()
        ));
    }
    let to = open_dir_in(images, name).map_err(|e| format!("{name}: {e}"))?;
    let mut bytes = 0;
    for n in names(&from).map_err(|e| format!("{name}: {e}"))? {
        bytes += adopt_image(&from, &to, &n, owner).map_err(|e| format!("{name}/{e}"))?;
    }
    remove_flat_dir(session, name);
    Ok(bytes)
}

/// The files a process's saved-files directory in staging holds copies of, from its
/// `fd-info.txt`.
fn saved_originals(files_dir: &Path) -> Vec<PathBuf> {
    let text = fs::read_to_string(files_dir.join(FD_INFO)).unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(_, path)| PathBuf::from(path))
        .filter(|p| p.is_absolute())
        .collect()
}

fn rename_between(from: &fs::File, to: &fs::File, name: &str) -> std::io::Result<()> {
    let c = CString::new(name).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: renameat on live directory descriptors and a NUL-terminated name.
    let r = unsafe { libc::renameat(from.as_raw_fd(), c.as_ptr(), to.as_raw_fd(), c.as_ptr()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The coordinator port the session's `dmtcp_launch` or `dmtcp_restart` wrote.
fn read_port(session: &fs::File, owner: u32) -> Result<u16, String> {
    let mut f = open_in(session, PORT_FILE).map_err(|e| {
        format!("no {PORT_FILE} in the job's DMTCP session ({e}): did the job start under dmtcp_launch?")
    })?;
    let m = f.metadata().map_err(|e| e.to_string())?;
    if !m.is_file() || m.uid() != owner || m.len() > 64 {
        return Err(format!(
            "{PORT_FILE} in the job's DMTCP session is not a small file of the job's owner"
        ));
    }
    let mut s = String::new();
    f.read_to_string(&mut s).map_err(|e| e.to_string())?;
    s.trim()
        .parse()
        .map_err(|_| format!("{PORT_FILE} holds {:?}, not a port", s.trim()))
}

/// Moves one image from the owner's session into root's staging (see the module text).
fn adopt_image(
    session: &fs::File,
    images: &fs::File,
    name: &str,
    owner: u32,
) -> Result<u64, String> {
    let f = open_in(session, name).map_err(|e| format!("{name}: {e}"))?;
    let before = f.metadata().map_err(|e| format!("{name}: {e}"))?;
    if !before.is_file() || before.uid() != owner || before.nlink() != 1 {
        return Err(format!(
            "{name} is not a regular file of the job's owner with one link (uid {}, {} links): refused",
            before.uid(),
            before.nlink()
        ));
    }
    rename_between(session, images, name).map_err(|e| format!("move {name}: {e}"))?;
    let after = open_in(images, name)
        .and_then(|g| g.metadata())
        .map_err(|e| format!("{name}: {e}"))?;
    if (after.dev(), after.ino()) != (before.dev(), before.ino()) {
        unlink_in(images, name);
        return Err(format!("{name} was replaced while it was moved: refused"));
    }
    // Root's from now on; readable, for the owner's restore through a private link.
    nix::unistd::fchown(&f, Some(0.into()), Some(0.into())).map_err(|e| format!("{name}: {e}"))?;
    f.set_permissions(fs::Permissions::from_mode(0o644))
        .map_err(|e| format!("{name}: {e}"))?;
    Ok(before.len())
}

impl Dmtcp {
    fn checkpoint(&self, spec: &DumpSpec<'_>, log: &mut String) -> Result<(), String> {
        let (Some(session), Some(owner)) = (spec.session, spec.owner) else {
            return Err(
                "the job has no DMTCP session on this node: it was not started with --engine dmtcp"
                    .into(),
            );
        };
        let dir = open_dir(session).map_err(|e| format!("{}: {e}", session.display()))?;
        if dir.metadata().map(|m| m.uid()).ok() != Some(owner) {
            return Err(format!("{} is not the job owner's", session.display()));
        }
        let images =
            open_dir(spec.images_dir).map_err(|e| format!("{}: {e}", spec.images_dir.display()))?;
        // The scripts of the checkpoint before, what an abandoned one left, and the images
        // and saved files the last restore read (the saved files are rewritten in place).
        for n in names(&dir).map_err(|e| e.to_string())? {
            if is_image(&n) || n.starts_with(RESTART_SCRIPT_PREFIX) {
                unlink_in(&dir, &n);
            } else if is_files_dir(&n) || n == SESSION_IMAGES {
                remove_flat_dir(&dir, &n);
            }
        }
        let port = read_port(&dir, owner)?;
        let begin = Instant::now();
        let said = self.command(port, "--checkpoint", owner).map_err(|e| {
            format!("dmtcp_command --checkpoint to the job's coordinator (port {port}) failed: {e}")
        })?;
        log.push_str(&format!(
            "dmtcp_command --checkpoint (port {port}): {}\n",
            one_line(&said)
        ));
        loop {
            let done = names(&dir)
                .map_err(|e| e.to_string())?
                .iter()
                .any(|n| n == RESTART_SCRIPT_LINK);
            if done {
                break;
            }
            if begin.elapsed() > self.timeout {
                return Err(format!(
                    "DMTCP wrote no restart script within {:?} of the checkpoint request ([engines] dmtcp_checkpoint_timeout); its processes may have died, see the job's stderr",
                    self.timeout
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        log.push_str(&format!(
            "checkpoint written in {} ms\n",
            begin.elapsed().as_millis()
        ));
        let mut moved = 0;
        for n in names(&dir).map_err(|e| e.to_string())? {
            if is_image(&n) {
                let bytes = adopt_image(&dir, &images, &n, owner)?;
                log.push_str(&format!("{n}: {bytes} bytes\n"));
                moved += 1;
            }
        }
        if moved == 0 {
            return Err("DMTCP finished the checkpoint but wrote no image here".into());
        }
        for n in names(&dir).map_err(|e| e.to_string())? {
            if is_files_dir(&n) {
                let bytes = adopt_files_dir(&dir, &images, &n, owner)?;
                log.push_str(&format!("{n}/: {bytes} bytes\n"));
            }
        }
        Ok(())
    }
}

impl SnapshotEngine for Dmtcp {
    fn name(&self) -> &str {
        Engine::Dmtcp.as_str()
    }

    fn version(&self) -> &str {
        &self.version
    }

    fn freezes(&self) -> bool {
        false
    }

    fn has_coordinator(&self) -> bool {
        true
    }

    fn launch_argv(
        &self,
        argv: Vec<String>,
        env: &mut BTreeMap<String, String>,
        session: &Path,
        port: Option<u16>,
    ) -> Vec<String> {
        for (k, v) in JOB_ENV {
            env.entry(k.into()).or_insert_with(|| v.into());
        }
        // Open MPI's session directory in the job's session, rather than /tmp: a restart
        // needs its files, and every DMTCP job's launcher has the same virtual PID (40000),
        // after which Open MPI names it.
        env.entry("OMPI_MCA_orte_tmpdir_base".into())
            .or_insert_with(|| session.join(TMP).display().to_string());
        let mut v = vec![
            self.tool("dmtcp_launch"),
            "--new-coordinator".into(),
            "--coord-port".into(),
            port.unwrap_or(0).to_string(),
            "--port-file".into(),
            session.join(PORT_FILE).display().to_string(),
            "--no-gzip".into(),
            "--ckptdir".into(),
            session.display().to_string(),
            "--quiet".into(),
        ];
        v.extend(argv);
        v
    }

    fn session_subdirs(&self) -> &'static [&'static str] {
        &[TMP]
    }

    /// DMTCP's restart reads each process's saved files (copies of the shared files it
    /// mapped, such as Open MPI's PMIx segments) at the path they had in the session at
    /// checkpoint time, and expects the files the job had open (Open MPI's session tree) where
    /// they were, but for those it saved itself.
    fn beside(&self, images_dir: &Path, session: &Path) -> Beside {
        let mut b = Beside {
            trees: vec![session.join(TMP)],
            ..Beside::default()
        };
        let mut dirs: Vec<String> = fs::read_dir(images_dir)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| is_files_dir(n))
                    .collect()
            })
            .unwrap_or_default();
        dirs.sort();
        for d in dirs {
            let dir = images_dir.join(&d);
            b.skip.extend(saved_originals(&dir));
            let mut files: Vec<String> = fs::read_dir(&dir)
                .map(|rd| {
                    rd.flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            files.sort();
            for f in files {
                b.put_back
                    .push((format!("{d}/{f}"), session.join(&d).join(&f)));
            }
        }
        b
    }

    fn running(&self, session: &Path, owner: u32) -> Result<(), String> {
        let dir = open_dir(session).map_err(|e| format!("{}: {e}", session.display()))?;
        let port = read_port(&dir, owner)?;
        let status = self.command(port, "--status", owner).map_err(|e| {
            format!("the job's DMTCP coordinator (port {port}) does not answer: {e}")
        })?;
        if status.lines().any(|l| l.trim() == "RUNNING=yes") {
            Ok(())
        } else {
            Err("not every process of the job runs under DMTCP yet (it is starting, or a checkpoint is under way): try again in a few seconds".into())
        }
    }

    fn dump(&self, spec: &DumpSpec<'_>) -> Result<(), EngineError> {
        let mut log = String::new();
        let r = self.checkpoint(spec, &mut log);
        if let Err(e) = &r {
            log.push_str(&format!("error: {e}\n"));
        }
        let _ = fs::write(spec.log_file, &log);
        r.map_err(|summary| EngineError::Failed {
            engine: Engine::Dmtcp.as_str(),
            op: "checkpoint",
            status: "dmtcp".into(),
            summary,
            log: spec.log_file.to_path_buf(),
        })
    }

    fn restores_as_owner(&self) -> bool {
        true
    }

    fn restore_argv(&self, spec: &RestoreSpec<'_>) -> Vec<String> {
        let session = spec.session.unwrap_or(spec.images_dir);
        let mut v = vec![
            self.tool("dmtcp_restart"),
            "--new-coordinator".into(),
            "--coord-port".into(),
            spec.coordinator_port.unwrap_or(0).to_string(),
            "--port-file".into(),
            session.join(PORT_FILE).display().to_string(),
            "--ckptdir".into(),
            session.display().to_string(),
            "--quiet".into(),
        ];
        let mut images: Vec<String> = fs::read_dir(spec.images_dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| is_image(n))
                    .map(|n| spec.images_dir.join(n).display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        images.sort();
        v.extend(images);
        v
    }

    fn restore_failed(&self, status: String, log: &Path) -> EngineError {
        EngineError::Failed {
            engine: Engine::Dmtcp.as_str(),
            op: "restart",
            status,
            summary: "dmtcp_restart failed: see the job's stderr".into(),
            log: log.to_path_buf(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process's saved files move into staging under their directory's name, and the restore
    /// is told to put each back where the process will read it; the files DMTCP saved itself
    /// are not saved again from the job's tree; a job's own Open MPI settings stay.
    #[test]
    fn saved_files_move_into_staging_and_are_put_back_at_their_session_path() {
        let t = tempfile::tempdir().unwrap();
        let (session, images) = (t.path().join("session"), t.path().join("images"));
        fs::create_dir(&session).unwrap();
        fs::create_dir(&images).unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let files = session.join("ckpt_heat_98ff-41000-1_files");
        fs::create_dir(&files).unwrap();
        let seg = session.join("tmp/ompi.n1.0/pid.40000/smseg-1");
        fs::write(files.join("smseg-1_99"), "segment").unwrap();
        fs::write(
            files.join(FD_INFO),
            format!("smseg-1_99:{}\n", seg.display()),
        )
        .unwrap();
        let s = open_dir(&session).unwrap();
        let i = open_dir(&images).unwrap();
        if me == 0 {
            let bytes = adopt_files_dir(&s, &i, "ckpt_heat_98ff-41000-1_files", 0).unwrap();
            assert!(bytes > 7);
            assert!(
                !files.exists(),
                "the owner's directory is gone from the session"
            );
            let moved = images.join("ckpt_heat_98ff-41000-1_files/smseg-1_99");
            assert_eq!(fs::read_to_string(&moved).unwrap(), "segment");
        } else {
            // Without root the move is refused at the chown; the rest does not need it.
            fs::create_dir(images.join("ckpt_heat_98ff-41000-1_files")).unwrap();
            for f in ["smseg-1_99", FD_INFO] {
                fs::rename(
                    files.join(f),
                    images.join("ckpt_heat_98ff-41000-1_files").join(f),
                )
                .unwrap();
            }
        }
        let engine = Dmtcp {
            bin: PathBuf::from("/nonexistent"),
            version: "4.2.0".into(),
            timeout: Duration::from_secs(1),
        };
        let b = engine.beside(&images, &session);
        assert_eq!(b.trees, vec![session.join(TMP)]);
        assert!(b.skip.contains(&seg), "{b:?}");
        let back: Vec<(String, PathBuf)> = ["smseg-1_99", FD_INFO]
            .iter()
            .map(|f| {
                (
                    format!("ckpt_heat_98ff-41000-1_files/{f}"),
                    session.join("ckpt_heat_98ff-41000-1_files").join(f),
                )
            })
            .collect();
        let mut got = b.put_back.clone();
        got.sort();
        let mut want = back;
        want.sort();
        assert_eq!(got, want);
        let env = &mut BTreeMap::new();
        env.insert("OMPI_MCA_btl".to_string(), "self,vader".to_string());
        engine.launch_argv(vec!["/bin/true".into()], env, &session, None);
        assert_eq!(
            env["OMPI_MCA_btl"], "self,vader",
            "a job's own setting stays"
        );
        assert_eq!(
            Path::new(&env["OMPI_MCA_orte_tmpdir_base"]),
            session.join(TMP)
        );
    }

    #[test]
    fn versions_and_image_names() {
        assert_eq!(
            parse_version("dmtcp_launch (DMTCP) 4.2.0\nLicense LGPLv3+\n").as_deref(),
            Some("4.2.0")
        );
        assert_eq!(parse_version("something else"), None);
        assert!(is_image("ckpt_heat.mpich_98ff-42000-b5ae4a4a20b.dmtcp"));
        assert!(!is_image("dmtcp_restart_script.sh"));
        assert!(!is_image("ckpt_x.dmtcp.temp"));
    }

    /// What the job's owner leaves in the session is moved into staging only if it is a
    /// regular file of the owner's with one link: links, FIFOs and other users' files are
    /// refused, without root following or blocking on them, and what they point to is untouched.
    #[test]
    fn only_the_owners_regular_images_move_into_staging() {
        let t = tempfile::tempdir().unwrap();
        let (session, images) = (t.path().join("session"), t.path().join("images"));
        fs::create_dir(&session).unwrap();
        fs::create_dir(&images).unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let secret = t.path().join("secret");
        fs::write(&secret, "root's").unwrap();
        std::os::unix::fs::symlink(&secret, session.join("ckpt_link.dmtcp")).unwrap();
        fs::hard_link(&secret, session.join("ckpt_hard.dmtcp")).unwrap();
        nix::unistd::mkfifo(
            &session.join("ckpt_fifo.dmtcp"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        fs::write(session.join("ckpt_good.dmtcp"), "image").unwrap();
        std::os::unix::fs::symlink(&secret, session.join(PORT_FILE)).unwrap();
        let s = open_dir(&session).unwrap();
        let i = open_dir(&images).unwrap();
        for bad in ["ckpt_link.dmtcp", "ckpt_hard.dmtcp", "ckpt_fifo.dmtcp"] {
            assert!(adopt_image(&s, &i, bad, me).is_err(), "{bad} refused");
            assert!(!images.join(bad).exists(), "{bad} not moved");
        }
        assert!(read_port(&s, me).is_err(), "a linked port file is refused");
        assert_eq!(fs::read_to_string(&secret).unwrap(), "root's");
        // Someone else's file, though regular and alone.
        assert!(adopt_image(&s, &i, "ckpt_good.dmtcp", me + 1).is_err());
        // A saved-files directory that is a link is not followed, and one holding a link is
        // refused at that file.
        std::os::unix::fs::symlink(t.path(), session.join("ckpt_a_files")).unwrap();
        assert!(adopt_files_dir(&s, &i, "ckpt_a_files", me).is_err());
        assert!(!images.join("ckpt_a_files").exists());
        fs::create_dir(session.join("ckpt_b_files")).unwrap();
        std::os::unix::fs::symlink(&secret, session.join("ckpt_b_files/x_1")).unwrap();
        assert!(adopt_files_dir(&s, &i, "ckpt_b_files", me).is_err());
        assert_eq!(fs::read_to_string(&secret).unwrap(), "root's");
        // Removing what a restore or checkpoint left never follows a link out of the session.
        remove_flat_dir(&s, "ckpt_a_files");
        remove_flat_dir(&s, "ckpt_b_files");
        assert!(secret.exists() && !session.join("ckpt_b_files").exists());
        if me == 0 {
            assert_eq!(adopt_image(&s, &i, "ckpt_good.dmtcp", 0).unwrap(), 5);
            assert!(!session.join("ckpt_good.dmtcp").exists());
            let m = fs::metadata(images.join("ckpt_good.dmtcp")).unwrap();
            assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o644));
        }
    }
}
