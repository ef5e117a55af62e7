//! The CRIU engine: drives the `criu` binary.
//!
//! Flags, and why (each was needed by a real MPI job on this platform, see docs/operations.md):
//! * `--tcp-established` — ranks hold TCP connections (Open MPI to mpirun; MPICH over TCP).
//! * `--ext-unix-sk` — launchers keep Unix sockets to processes outside the tree.
//! * `--file-locks`, `--link-remap`, `--ghost-limit` — locked, unlinked and deleted-but-open files.
//! * `--freeze-cgroup` — the agent has frozen the job's cgroup; CRIU must use that freezer and
//!   leave the tree frozen (`--leave-running` keeps it alive), so the agent decides when to thaw.
//! * `--network-lock` — blocks the job's TCP while it is dumped and restored.
//! * `--external net[…]` / `--inherit-fd` — a job sandbox's network namespace is the agent's to
//!   make: left out of the images, and given to the restore freshly made (on any node).
//! * `--external mnt[]`, `--enable-external-masters`, `--root /` — a sandbox's mounts are slave
//!   copies of the node's: recorded as external, bound again from the node's on restore; its
//!   job directory mount (`mnt[/run/ckpt-job]`) is bound to the restoring node's job directory.
//! * `pre-dump`, `--track-mem`, `--prev-images-dir` — pre-copy (see `copies/precopy.rs`): memory copied
//!   while the job runs, then a dump of only the pages written since, on top of it.
//!
//! One file: the flags CRIU runs with, the dump, pre-dump and restore that pass them, and the
//! reading of what it answers, so that a flag and what it changes are read together.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use ckpt_proto::Engine;

use super::{DumpSpec, EngineError, EngineStop, RestoreSpec, SnapshotEngine};
use crate::config::CriuConfig;

/// Oldest CRIU that works on current kernels (4.1 fails on TCP sockets on kernels >= 6.16;
/// 3.17 fails on the vDSO layout).
pub const MIN_VERSION: (u32, u32) = (4, 2);
const MIN_VERSION_TEXT: &str = "4.2";
/// How long a dump told to stop (its epoch aborted, its job cancelled) may go without writing
/// to its log or images before it is taken as hung and killed ([`EngineStop::wait`]): CRIU at
/// `-v4` writes its log all through a dump, and its images as it copies memory.
const STOPPED_DUMP_STALL: std::time::Duration = std::time::Duration::from_secs(5);

/// Where `scripts/setup.sh` installs CRIU when the distribution's is too old.
pub const PRIVATE_PREFIX_BINARY: &str = "/opt/ckpt/criu/bin/criu";
/// Where the ckpt-daemons package puts its own CRIU (`scripts/package.sh`).
pub const PACKAGED_BINARY: &str = "/usr/lib/ckpt/criu/bin/criu";

/// The CRIU plugin that lets pre-dumps pass over verbs device mappings (crate
/// `ckpt-criu-plugin`), installed next to the agent.
pub const VERBS_PLUGIN_FILE: &str = "libckpt_criu_verbs.so";

/// A checked CRIU installation.
#[derive(Debug, Clone)]
pub struct Criu {
    path: String,
    version: String,
    cfg: CriuConfig,
    /// The directory of CRIU plugins given to pre-dumps (`-L`), holding only
    /// [`VERBS_PLUGIN_FILE`]: a directory of its own, since CRIU loads every `.so` in it.
    plugin_dir: Option<PathBuf>,
}

/// Copies the verbs plugin `src` (a file only root can replace) into `dir`, a directory of the
/// agent's own that holds nothing else, made if missing; both root's alone (CRIU runs as root).
/// Returns the plugin's path there.
pub fn install_plugin(src: &Path, dir: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    crate::config::trusted_file(src)?;
    match std::fs::symlink_metadata(dir) {
        Ok(m) if !m.is_dir() => {
            return Err(format!(
                "{} is not a directory (a link?): refused",
                dir.display()
            ))
        }
        Ok(_) => {}
        Err(_) => std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot make {}: {e}", dir.display()))?,
    }
    ckpt_store::trust::check_root(dir, &ckpt_store::trust::Owners::ROOT)
        .map_err(|e| e.to_string())?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot make {} private: {e}", dir.display()))?;
    let dst = dir.join(VERBS_PLUGIN_FILE);
    let tmp = dir.join(format!(".{VERBS_PLUGIN_FILE}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::fs::copy(src, &tmp)
        .and_then(|_| std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)))
        .and_then(|()| std::fs::rename(&tmp, &dst))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("cannot copy {} into {}: {e}", src.display(), dir.display())
        })?;
    Ok(dst)
}

impl Criu {
    /// Finds the binary, checks its version and runs `criu check`.
    pub fn detect(cfg: &CriuConfig) -> Result<Self, EngineError> {
        let path = resolve_path(&cfg.path);
        let text = super::version_text(
            Engine::Criu.as_str(),
            &path,
            "install CRIU >= 4.2 (scripts/setup.sh installs it into /opt/ckpt/criu) or set [criu] path in the agent config",
        )?;
        let version = parse_version(&text).ok_or_else(|| EngineError::CheckFailed {
            path: path.clone(),
            output: format!("unrecognised `--version` output: {:?}", text.trim()),
        })?;
        if !version_at_least(&version, MIN_VERSION) {
            return Err(EngineError::TooOld {
                path,
                version,
                min: MIN_VERSION_TEXT,
            });
        }
        let check = Command::new(&path)
            .arg("check")
            .stdin(Stdio::null())
            .output()
            .map_err(|source| EngineError::Spawn {
                path: path.clone(),
                source,
            })?;
        if !check.status.success() {
            let mut output = String::from_utf8_lossy(&check.stderr).into_owned();
            output.push_str(&String::from_utf8_lossy(&check.stdout));
            return Err(EngineError::CheckFailed {
                path,
                output: summarize(&output),
            });
        }
        Ok(Criu {
            path,
            version,
            cfg: cfg.clone(),
            plugin_dir: None,
        })
    }

    /// Gives pre-dumps the plugins in `dir` ([`install_plugin`]), once the plugin is there.
    pub fn with_plugin_dir(mut self, dir: PathBuf) -> Self {
        self.plugin_dir = Some(dir);
        self
    }

    /// Path of the binary in use.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What dumps and pre-dumps share: the tree, where its images and log go, its cgroup (CRIU
    /// freezes it for a pre-dump and thaws it after; a dump finds it frozen and leaves it so),
    /// the parent images and dirty-page tracking, a sandbox's namespaces.
    fn tree_args(&self, spec: &DumpSpec<'_>) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "-t".into(),
            spec.root_pid.to_string(),
            "-D".into(),
            spec.images_dir.display().to_string(),
            "-o".into(),
            spec.log_file.display().to_string(),
            "-v4".into(),
            "--freeze-cgroup".into(),
            spec.cgroup.display().to_string(),
        ];
        if spec.track_mem {
            args.push("--track-mem".into());
        }
        if let Some(parent) = spec.parent {
            args.extend(["--prev-images-dir".to_string(), parent.to_string()]);
        }
        if let Some(ino) = spec.external_netns {
            // A sandbox: its mounts are slave copies of the node's, restored as binds of
            // the new node's; its network namespace is the agent's.
            args.extend([
                "--external".to_string(),
                format!("net[{ino}]:{}", crate::os::sandbox::NETNS_KEY),
                "--external".to_string(),
                format!(
                    "mnt[{}]:{}",
                    crate::os::sandbox::JOB_DIR,
                    crate::os::sandbox::JOB_DIR_KEY
                ),
                "--external".to_string(),
                "mnt[]".to_string(),
                "--enable-external-masters".to_string(),
            ]);
        }
        args
    }

    /// The mount namespace to dump `spec`'s tree from: a tree outside a sandbox that lives in
    /// a mount namespace of its own is one a guarded restore made (`shim/guard.rs`, a slave
    /// copy of the node's with a user's directories bound onto themselves). Dumped from the
    /// node's namespace, CRIU would record that namespace and its restore would have to make it
    /// again (which fails); dumped from inside it, the tree shares CRIU's namespace, as a tree
    /// never restored does. None: the node's.
    ///
    /// Only the namespace the agent's own guarded restore made ([`DumpSpec::guarded_ns`]) is
    /// entered: in a mount namespace a user made (with a user namespace), the user could mount
    /// over the engine's binary or staging, and root would run or write what they put there.
    fn tree_mount_ns(spec: &DumpSpec<'_>) -> Option<std::fs::File> {
        if spec.external_netns.is_some() {
            return None;
        }
        let want = spec.guarded_ns?;
        let f = std::fs::File::open(format!("/proc/{}/ns/mnt", spec.root_pid)).ok()?;
        let m = f.metadata().ok()?;
        use std::os::unix::fs::MetadataExt;
        ((m.dev(), m.ino()) == want).then_some(f)
    }

    /// Runs `criu <args>` for `op` (in the mount namespace `ns`, if given); on failure, the
    /// reasons from its log (or its stderr when it failed before opening the log).
    fn run(
        &self,
        op: &'static str,
        args: &[String],
        log: &Path,
        ns: Option<std::fs::File>,
        stop: Option<(&EngineStop, &Path)>,
    ) -> Result<(), EngineError> {
        let mut cmd = Command::new(&self.path);
        if let Some(ns) = ns {
            use std::os::fd::AsRawFd;
            use std::os::unix::process::CommandExt;
            let fd = ns.as_raw_fd();
            // SAFETY: setns is async-signal-safe; `ns` stays open until the command has
            // started (it is moved into the closure).
            unsafe {
                cmd.pre_exec(move || {
                    let _keep = &ns;
                    if libc::setns(fd, libc::CLONE_NEWNS) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        // A process group of its own: a stop kills CRIU and whatever it forked.
        use std::os::unix::process::CommandExt;
        let spawn_err = |source| EngineError::Spawn {
            path: self.path.clone(),
            source,
        };
        let mut child = cmd
            .args(args)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_err)?;
        // Read beside the wait: a full pipe would stop CRIU.
        let reader = child.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = std::io::Read::read_to_end(&mut e, &mut v);
                v
            })
        });
        let status = match stop {
            Some((stop, images)) => {
                stop.started(child.id() as i32);
                let progress = || {
                    let bytes = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
                    let images: u64 = std::fs::read_dir(images)
                        .map(|rd| rd.flatten().map(|e| bytes(&e.path())).sum())
                        .unwrap_or(0);
                    bytes(log) + images
                };
                stop.wait(&mut child, progress, STOPPED_DUMP_STALL)
            }
            None => child.wait(),
        }
        .map_err(spawn_err)?;
        let stderr_bytes = reader.and_then(|t| t.join().ok()).unwrap_or_default();
        if status.success() {
            return Ok(());
        }
        if stop.is_some_and(|(s, _)| s.stopped()) {
            return Err(EngineError::Stopped {
                engine: Engine::Criu.as_str(),
                op,
                log: log.to_path_buf(),
            });
        }
        let log_text = std::fs::read_to_string(log).unwrap_or_default();
        let stderr = String::from_utf8_lossy(&stderr_bytes);
        let summary = match (log_text.trim().is_empty(), stderr.trim().is_empty()) {
            (false, _) => summarize(&log_text),
            (true, false) => summarize(&stderr),
            (true, true) => "criu printed nothing and wrote no log".to_string(),
        };
        Err(EngineError::Failed {
            engine: Engine::Criu.as_str(),
            op,
            status: status.to_string(),
            summary,
            log: log.to_path_buf(),
        })
    }

    fn common_args(&self) -> Vec<String> {
        let mut v: Vec<String> = ["--ext-unix-sk", "--file-locks", "--tcp-established"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        if self.cfg.network_lock != "skip" {
            v.push("--network-lock".into());
            v.push(self.cfg.network_lock.clone());
        }
        v
    }
}

fn resolve_path(configured: &str) -> String {
    if configured != "auto" {
        return configured.to_string();
    }
    [PACKAGED_BINARY, PRIVATE_PREFIX_BINARY]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("criu")
        .to_string()
}

/// The nftables tables of CRIU's network lock that a dump's log names (`inet CRIU-…`): CRIU
/// names its table after the dump, so these are this dump's alone.
fn lock_tables(log: &str) -> Vec<String> {
    let mut tables: Vec<String> = log
        .match_indices("inet CRIU-")
        .filter_map(|(at, _)| {
            let name: String = log[at + "inet ".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            (name.len() > "CRIU-".len()).then_some(name)
        })
        .collect();
    tables.sort();
    tables.dedup();
    tables
}

/// After a dump the agent stopped: CRIU, killed, did not remove the lock it had put on the
/// job's connections, which would drop the job's TCP for ever once thawed. Its tables are
/// deleted in the job's network namespace (entered through its root process) and in the
/// agent's own.
fn unlock_stopped(spec: &DumpSpec<'_>) {
    let tables = lock_tables(&std::fs::read_to_string(spec.log_file).unwrap_or_default());
    let netns = format!("/proc/{}/ns/net", spec.root_pid);
    for table in tables {
        for inside in [true, false] {
            let mut cmd = match inside {
                true => {
                    let mut c = Command::new("nsenter");
                    c.arg(format!("--net={netns}")).arg("nft");
                    c
                }
                false => Command::new("nft"),
            };
            let done = cmd
                .args(["delete", "table", "inet", &table])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if done {
                tracing::warn!(%table, "removed the network lock of a stopped dump");
            }
        }
    }
}

/// Extracts "4.2.1" from `criu --version` output ("Version: 4.2.1").
pub fn parse_version(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))
        .map(|v| v.trim().to_string())
        .filter(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
}

/// Whether a dotted version is at least `min` (major, minor).
pub fn version_at_least(version: &str, min: (u32, u32)) -> bool {
    let mut parts = version
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    (major, minor) >= min
}

/// The lines of a CRIU log or output that explain a failure (at most five).
pub fn summarize(log: &str) -> String {
    let errors: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("Error") || l.contains("error:"))
        .filter(|l| !l.contains("rlimit: Can't setup RLIMIT_NOFILE"))
        .collect();
    let picked: Vec<&str> = if errors.is_empty() {
        log.lines()
            .rev()
            .take(3)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect()
    } else {
        errors.iter().rev().take(5).rev().copied().collect()
    };
    picked
        .iter()
        .map(|l| l.trim())
        .collect::<Vec<_>>()
        .join(" | ")
}

fn log_summary(log: &Path) -> String {
    match std::fs::read_to_string(log) {
        Ok(text) => summarize(&text),
        Err(e) => format!("no log at {}: {e}", log.display()),
    }
}

impl SnapshotEngine for Criu {
    fn name(&self) -> &str {
        Engine::Criu.as_str()
    }

    fn version(&self) -> &str {
        &self.version
    }

    fn dump(&self, spec: &DumpSpec<'_>) -> Result<(), EngineError> {
        let mut args: Vec<String> = vec![
            "dump".into(),
            "--leave-running".into(),
            "--link-remap".into(),
            "--ghost-limit".into(),
            self.cfg.ghost_limit.clone(),
        ];
        args.extend(self.tree_args(spec));
        args.extend(self.common_args());
        args.extend(self.cfg.extra_dump_args.iter().cloned());
        let r = self.run(
            "dump",
            &args,
            spec.log_file,
            Self::tree_mount_ns(spec),
            spec.stop.map(|s| (s, spec.images_dir)),
        );
        if matches!(r, Err(EngineError::Stopped { .. })) {
            unlock_stopped(spec);
        }
        r
    }

    fn precopy_support(&self) -> Result<(), String> {
        let out = Command::new(&self.path)
            .args(["check", "--feature", "mem_dirty_track"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.path))?;
        if out.status.success() {
            return Ok(());
        }
        let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
        text.push_str(&String::from_utf8_lossy(&out.stdout));
        Err(format!(
            "this kernel does not track which pages a process wrote (`{} check --feature mem_dirty_track`: {}; it needs CONFIG_MEM_SOFT_DIRTY)",
            self.path,
            summarize(&text)
        ))
    }

    fn pre_dump(&self, spec: &DumpSpec<'_>) -> Result<(), EngineError> {
        let mut args: Vec<String> = vec!["pre-dump".into()];
        args.extend(self.tree_args(spec));
        // A process running over verbs maps its device: the plugin claims those mappings,
        // whose content a pre-dump never copies anyway.
        if let Some(dir) = self
            .plugin_dir
            .as_ref()
            .filter(|d| d.join(VERBS_PLUGIN_FILE).is_file())
        {
            args.extend(["-L".to_string(), dir.display().to_string()]);
        }
        self.run(
            "pre-dump",
            &args,
            spec.log_file,
            Self::tree_mount_ns(spec),
            spec.stop.map(|s| (s, spec.images_dir)),
        )
    }

    fn restore_argv(&self, spec: &RestoreSpec<'_>) -> Vec<String> {
        let mut v: Vec<String> = vec![
            self.path.clone(),
            "restore".into(),
            "-d".into(),
            "-D".into(),
            spec.images_dir.display().to_string(),
            "-o".into(),
            spec.log_file.display().to_string(),
            "-v4".into(),
            "--pidfile".into(),
            spec.pid_file.display().to_string(),
        ];
        if let Some(fd) = spec.netns_fd {
            v.extend([
                "--inherit-fd".to_string(),
                format!("fd[{fd}]:{}", crate::os::sandbox::NETNS_KEY),
                "--root".to_string(),
                "/".to_string(),
                "--external".to_string(),
                "mnt[]".to_string(),
            ]);
        }
        if let Some(dir) = spec.job_dir {
            v.push("--external".into());
            v.push(format!(
                "mnt[{}]:{}",
                crate::os::sandbox::JOB_DIR_KEY,
                dir.display()
            ));
        }
        for root in &spec.cgroup_roots {
            v.push("--cgroup-root".into());
            v.push(root.clone());
        }
        if let Some(gate) = spec.gate {
            // CRIU runs action scripts at each stage; "post-restore" comes after every page is
            // in place and before any task resumes, and a failure there kills the tree.
            v.push("--action-script".into());
            v.push(gate.display().to_string());
        }
        v.extend(self.common_args());
        v.extend(self.cfg.extra_restore_args.iter().cloned());
        v
    }

    fn memory_only(&self) -> Option<fn(&str) -> bool> {
        Some(is_page_data)
    }

    fn gate_min_bytes(&self) -> u64 {
        self.cfg.restore_gate_min_mb << 20
    }

    fn restore_failed(&self, status: String, log: &Path) -> EngineError {
        let mut summary = log_summary(log);
        if summary.contains("Too many levels of symbolic links") {
            // The restore's guard (`shim/guard.rs`) at work, or a link left in place.
            summary = format!(
                "a path of the job's, in a directory users control, is a symbolic link now (replaced since the checkpoint?); the restore does not follow links there: remove the link and restart. CRIU: {summary}"
            );
        }
        EngineError::Failed {
            engine: Engine::Criu.as_str(),
            op: "restore",
            status,
            summary,
            log: PathBuf::from(log),
        }
    }
}

/// A CRIU page data file of the node's image set (`images/pages-N.img`, or a pre-copy link's
/// `pre/<n>/pages-N.img`): raw memory contents, which CRIU reads into the restored processes.
/// Which pages go where is in the `pagemap-N.img` files beside them, which are not this.
pub fn is_page_data(rel: &str) -> bool {
    let mut parts = rel.split('/');
    let (dir, file) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(d), Some(f), None, None) => (d == ckpt_store::chain::IMAGES_DIR, f),
        (Some(d), Some(n), Some(f), None) => (
            d == ckpt_store::chain::LINKS_DIR
                && !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit()),
            f,
        ),
        _ => return false,
    };
    dir && file
        .strip_prefix("pages-")
        .and_then(|f| f.strip_suffix(".img"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree in a mount namespace of its own is dumped from inside it only when it is the one
    /// the agent's guarded restore recorded; one a user made (or any other) is never entered.
    #[test]
    fn only_the_recorded_guarded_namespace_is_entered() {
        if !nix::unistd::geteuid().is_root() || !Path::new("/usr/bin/unshare").exists() {
            eprintln!("SKIPPED: needs root and unshare(1)");
            return;
        }
        let mut child = Command::new("/usr/bin/unshare")
            .args(["--mount", "--propagation", "slave", "sleep", "30"])
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let ns = |p: i32| loop {
            let own = std::fs::metadata("/proc/self/ns/mnt").unwrap();
            let theirs = std::fs::metadata(format!("/proc/{p}/ns/mnt")).unwrap();
            use std::os::unix::fs::MetadataExt;
            if theirs.ino() != own.ino() {
                break (theirs.dev(), theirs.ino());
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        let theirs = ns(pid);
        let spec = |guarded_ns| DumpSpec {
            root_pid: pid,
            images_dir: Path::new("/nonexistent"),
            cgroup: Path::new("/nonexistent"),
            log_file: Path::new("/nonexistent"),
            external_netns: None,
            parent: None,
            track_mem: false,
            session: None,
            owner: None,
            guarded_ns,
            stop: None,
        };
        assert!(Criu::tree_mount_ns(&spec(None)).is_none(), "not recorded");
        assert!(Criu::tree_mount_ns(&spec(Some((theirs.0, theirs.1 + 1)))).is_none());
        assert!(Criu::tree_mount_ns(&spec(Some(theirs))).is_some());
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn a_stopped_dumps_lock_tables_are_found_in_its_log() {
        let log = "(00.05) net: Lock network\n\
            (00.07) \tRunning nftables [add element inet CRIU-e0ceb391-4d4f-43ce-a7 conns4 { 127.0.0.1 . 1 . 127.0.0.1 . 2 }]\n\
            (00.07) \tRunning nftables [add element inet CRIU-e0ceb391-4d4f-43ce-a7 conns4 { 127.0.0.1 . 2 . 127.0.0.1 . 1 }]\n\
            (00.08) inet CRIU- (no name)\n";
        assert_eq!(lock_tables(log), ["CRIU-e0ceb391-4d4f-43ce-a7"]);
        assert!(lock_tables("(00.01) Dumping processes").is_empty());
    }

    #[test]
    fn only_page_data_files_count_as_memory_contents() {
        for yes in [
            "images/pages-1.img",
            "images/pages-17.img",
            "pre/3/pages-2.img",
        ] {
            assert!(is_page_data(yes), "{yes}");
        }
        for no in [
            "images/pagemap-1.img",
            "images/core-1.img",
            "images/pages-.img",
            "images/pages-1.img.bak",
            "images/pages-x.img",
            "pages-1.img",
            "pre/pages-1.img",
            "pre/x/pages-1.img",
            "pre/1/2/pages-1.img",
            "files/pages-1.img",
            "images/sub/pages-1.img",
            "preserved/images/pages-1.img",
        ] {
            assert!(!is_page_data(no), "{no}");
        }
    }

    #[test]
    fn version_parsing_and_comparison() {
        assert_eq!(
            parse_version("Version: 4.2.1\nGitID: v4.2\n").as_deref(),
            Some("4.2.1")
        );
        assert_eq!(parse_version("criu, no version"), None);
        assert!(version_at_least("4.2.1", MIN_VERSION));
        assert!(version_at_least("5.0", MIN_VERSION));
        assert!(!version_at_least("4.1.1", MIN_VERSION));
        assert!(!version_at_least("3.17.1", MIN_VERSION));
    }

    #[test]
    fn summary_keeps_error_lines_and_drops_known_noise() {
        let log = "(00.1) rlimit: Can't setup RLIMIT_NOFILE Error\n(00.2) info\n(00.3) Error (criu/sk-inet.c:1): Can't dump\n";
        assert_eq!(
            summarize(log),
            "(00.3) Error (criu/sk-inet.c:1): Can't dump"
        );
        assert_eq!(summarize("a\nb\nc\nd\n"), "b | c | d");
    }

    #[test]
    fn missing_binary_is_reported_with_the_fix() {
        let cfg = CriuConfig {
            path: "/nonexistent/criu".into(),
            ..CriuConfig::default()
        };
        let err = Criu::detect(&cfg).unwrap_err();
        assert!(matches!(err, EngineError::NotFound { .. }));
        assert!(err.to_string().contains("setup.sh"), "{err}");
    }
}
