//! Checkpoint, local dump of the frozen job: what it has open, the files the engine does not
//! save, and the engine's dump.
//!
//! One file: what the dump scans, preserves and hands the engine, in the order it happens while the
//! job is frozen.

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ckpt_store::chain;
use ckpt_store::manifest::{OpenFile, PreservedFile};
use tracing::info;

use crate::engine::{DumpSpec, EngineStop, SnapshotEngine};
use crate::error::{io_err, AgentError};
use crate::jobs::NodeJob;
use crate::os::modes::{ensure_dir, PRIVATE_DIR, PRIVATE_FILE};
use crate::os::procfs;
use crate::os::sandbox;
use crate::part::notes::PartNotes;
use crate::part::OUTPUTS_DIR;

/// Files under these prefixes are shared memory or session state that the engine does not put in
/// the image and that launchers delete when the job ends (Open MPI's `vader_segment.*` in
/// /dev/shm and its session directory in /tmp/ompi.*): the agent saves the ones the job uses.
const PRESERVE_PREFIXES: [&str; 2] = ["/dev/shm/", "/tmp/ompi."];

/// The job's owner, recorded in the epoch's notes. An older agent's record has no owner: the
/// job's root process says who it is.
fn note_owner(job: &mut NodeJob) -> Result<u32, AgentError> {
    let id = job.record.id;
    let root = job.work.as_ref().map(|w| w.root_pid).unwrap_or(0);
    let owner = job
        .record
        .owner
        .or_else(|| procfs::uid_of(root))
        .ok_or_else(|| AgentError::NotRunning {
            job: id,
            state: format!("its root process {root} is gone"),
        })?;
    job.record.owner = Some(owner);
    let w = job.work.as_mut().expect("checked by caller");
    PartNotes::write_owner(&mut w.notes, owner);
    Ok(owner)
}

/// The local checkpoint with an engine that suspends the running job itself and lets it run
/// on (DMTCP): it finds the processes, their files and connections on its own, and writes the
/// images into the epoch's staging; the time it took is the time the job was suspended.
pub(super) fn dump_running(
    job: &mut NodeJob,
    engine: &dyn SnapshotEngine,
    stop: &EngineStop,
) -> Result<(), AgentError> {
    let id = job.record.id;
    let owner = note_owner(job)?;
    let session = job.session_dir();
    let w = job.work.as_mut().expect("checked by caller");
    let images = w.node_dir.join(chain::IMAGES_DIR);
    fs::create_dir_all(&images).map_err(io_err(id, "create", &images))?;
    let log = job.dir.join("logs").join(format!("dump-{}.log", w.epoch));
    let begin = Instant::now();
    let r = engine.dump(&DumpSpec {
        root_pid: w.root_pid,
        images_dir: &images,
        cgroup: job.cgroup.path(),
        log_file: &log,
        external_netns: None,
        parent: None,
        track_mem: false,
        session: Some(&session),
        owner: Some(owner),
        guarded_ns: None,
        stop: Some(stop),
    });
    let took = begin.elapsed();
    w.suspended = Some(took);
    r.map_err(|source| AgentError::Engine { job: id, source })?;
    crate::metrics::metrics()
        .dump_seconds
        .with_label_values(&[engine.name()])
        .observe(took.as_secs_f64());
    // The ports of the job's TCP sockets: the engine's restart binds them again, which the
    // closing remains of a killed incarnation's connections would prevent.
    w.tcp_ports = crate::part::tcp::noted_at_dump(&w.pids).0;
    // What the engine's restart needs beside its images, saved while the job runs on.
    let beside = engine.beside(&images, &session);
    let mut files = Vec::new();
    for t in &beside.trees {
        // Never through a link: the owner's link elsewhere is not the job's tree.
        if fs::symlink_metadata(t).is_ok_and(|m| m.is_dir()) {
            collect_files(t, &mut files);
        }
    }
    files.retain(|f| !beside.skip.contains(f));
    files.sort();
    let (mut preserved, copied_bytes, copy_time) = copy_preserved(id, owner, &w.node_dir, &files)?;
    let gid = crate::os::owner::Identity::primary_gid(owner);
    preserved.extend(
        beside
            .put_back
            .into_iter()
            .map(|(rel, path)| PreservedFile {
                path: path.display().to_string(),
                saved_as: format!("{}/{rel}", chain::IMAGES_DIR),
                mode: 0o600,
                uid: owner,
                gid,
                fifo: false,
            }),
    );
    w.preserved = preserved;
    record_dump(w, None, took, (copy_time, copied_bytes));
    Ok(())
}

/// What the frozen job has open, found by [`scan_open`].
struct OpenScan {
    /// Files open for writing, with their sizes (a restore truncates them back).
    open: BTreeMap<String, u64>,
    /// Files the engine does not save, to copy (see [`PRESERVE_PREFIXES`]).
    preserve: Vec<PathBuf>,
    /// Directories the engine's restore creates files in by path (see `PartNotes::guard_paths`).
    guard: Vec<String>,
}

/// The local dump of a frozen job: what it has open, its sandbox's notes, then the engine's
/// dump beside the copy of the files the engine does not save.
pub(super) fn dump_frozen(
    job: &mut NodeJob,
    engine: &dyn SnapshotEngine,
    stop: &EngineStop,
) -> Result<(), AgentError> {
    let id = job.record.id;
    let owner = note_owner(job)?;
    let external_netns = note_sandbox(job)?;
    let begin = Instant::now();
    let w = job.work.as_mut().expect("checked by caller");
    let scan = scan_open(&w.pids, external_netns.is_some());
    PartNotes::write_guard_paths(&mut w.notes, &scan.guard);
    if external_netns.is_some() {
        // A sandbox's own /dev/shm is restored as the engine made it, not from the node's.
        let dirs: Vec<PathBuf> = PartNotes::read(&w.notes)
            .guards()
            .into_iter()
            .filter(|d| !d.starts_with("/dev/shm"))
            .collect();
        crate::shim::guard::make_mount_points(w.root_pid, &dirs).map_err(|e| AgentError::Io {
            job: id,
            what: "make the restore's guard mounts in the sandbox at",
            path: dirs.first().cloned().unwrap_or_default(),
            source: std::io::Error::other(e),
        })?;
    }
    // The part's own stdout and stderr travel with the images (see `OUTPUTS_DIR`).
    let own_dir = fs::canonicalize(&job.dir).unwrap_or_else(|_| job.dir.clone());
    let outputs: Vec<(String, u64)> = scan
        .open
        .iter()
        .filter_map(|(path, size)| {
            crate::os::owner::own_output(Path::new(path), &own_dir).map(|n| (n.to_string(), *size))
        })
        .collect();
    w.open_files = scan
        .open
        .into_iter()
        .map(|(path, size)| OpenFile { path, size })
        .collect();
    w.tids = procfs::thread_ids(&w.pids);
    (w.tcp_ports, w.tcp_addrs) = crate::part::tcp::noted_at_dump(&w.pids);
    let scanned = begin.elapsed();
    let images = w.node_dir.join(chain::IMAGES_DIR);
    fs::create_dir_all(&images).map_err(io_err(id, "create", &images))?;
    let parent = adopt_links(job)?;
    let w = job.work.as_ref().expect("checked by caller");
    let log = job.dir.join("logs").join(format!("dump-{}.log", w.epoch));
    let spec = DumpSpec {
        root_pid: w.root_pid,
        images_dir: &images,
        cgroup: job.cgroup.path(),
        log_file: &log,
        external_netns,
        parent: parent.as_deref(),
        track_mem: parent.is_some(),
        session: None,
        owner: Some(owner),
        guarded_ns: job.record.guarded_ns,
        stop: Some(stop),
    };
    let files = ToCopy {
        owner,
        node_dir: &w.node_dir,
        preserve: &scan.preserve,
        job_dir: &own_dir,
        outputs: &outputs,
    };
    let (engine_time, (mut preserved, copied_bytes, copy_time)) =
        dump_beside_copy(id, engine, &spec, &files)?;
    // Still frozen: the files the engine's restore opens through links it removed again.
    preserved.extend(save_linked_remaps(id, owner, &w.node_dir, &w.pids)?);
    let w = job.work.as_mut().expect("checked by caller");
    w.preserved = preserved;
    record_dump(w, Some(scanned), engine_time, (copy_time, copied_bytes));
    Ok(())
}

/// Logs what a dump took and records it in the epoch's notes: the scan of what the frozen job
/// has open (a dump of a running job has none), the engine's dump, and the copy beside it
/// (its time and bytes).
fn record_dump(
    w: &mut crate::jobs::EpochWork,
    scan: Option<Duration>,
    engine: Duration,
    (copy, bytes): (Duration, u64),
) {
    info!(
        scan_ms = scan.map(|d| d.as_millis() as u64),
        engine_dump_ms = engine.as_millis() as u64,
        preserve_copy_ms = copy.as_millis() as u64,
        preserved_bytes = bytes,
        "dumped"
    );
    let mut times: Vec<(&str, u128)> = scan
        .map(|d| ("scan_ms", d.as_millis()))
        .into_iter()
        .collect();
    times.extend([
        ("engine_dump_ms", engine.as_millis()),
        ("preserve_copy_ms", copy.as_millis()),
        ("preserved_bytes", bytes as u128),
    ]);
    note_times(w, &times);
}

/// A sandbox's network namespace is not in the images: its address is (in the epoch's
/// notes), so that a restore anywhere makes the same one. Returns the namespace's inode, for
/// the engine to treat as external.
fn note_sandbox(job: &mut NodeJob) -> Result<Option<u64>, AgentError> {
    let id = job.record.id;
    let Some(a) = &job.record.sandbox else {
        return Ok(None);
    };
    let w = job.work.as_mut().expect("checked by caller");
    PartNotes::write_sandbox(&mut w.notes, a);
    let root = w.root_pid;
    sandbox::netns_inode(root)
        .map(Some)
        .ok_or_else(|| AgentError::NotRunning {
            job: id,
            state: format!("its sandbox's process 1 ({root}) is gone"),
        })
}

/// What the frozen processes `pids` have open: files open for writing, files to preserve
/// (a sandboxed part's /dev/shm is its own and saved by the engine), and the directories
/// its restore creates in.
fn scan_open(pids: &[i32], sandboxed: bool) -> OpenScan {
    let mut open: BTreeMap<String, u64> = BTreeMap::new();
    let mut preserve: Vec<PathBuf> = Vec::new();
    let mut guard: std::collections::BTreeSet<PathBuf> = std::collections::BTreeSet::new();
    let mut sockets: Vec<u64> = Vec::new();
    for &pid in pids {
        for (path, size) in procfs::files_open_for_write(pid) {
            open.insert(path.display().to_string(), size);
        }
        let mut used: Vec<String> = procfs::mapped_paths(pid);
        used.extend(
            procfs::fd_paths(pid)
                .into_iter()
                .map(|p| p.display().to_string()),
        );
        // The directories the engine's restore creates in (see `PartNotes::guard_paths`).
        for p in &used {
            if let Some(ino) = procfs::socket_inode(Path::new(p)) {
                sockets.push(ino);
            } else {
                let file = Path::new(p.strip_suffix(" (deleted)").unwrap_or(p));
                if let Some(dir) = file.parent().filter(|_| file.is_absolute()) {
                    guard.insert(dir.to_path_buf());
                }
            }
        }
        if let Ok(cwd) = fs::read_link(format!("/proc/{pid}/cwd")) {
            // Where a socket bound by a relative name is.
            guard.insert(cwd);
        }
        for p in used {
            let in_own_shm = sandboxed && p.starts_with("/dev/shm/");
            if PRESERVE_PREFIXES.iter().any(|pre| p.starts_with(pre))
                && !p.ends_with(" (deleted)")
                && !in_own_shm
            {
                preserve.push(PathBuf::from(p));
            }
        }
    }
    // Whole Open MPI session directories (`/tmp/ompi.<host>.<uid>/pid.<launcher pid>`), since
    // processes find each other's files through them.
    let mut trees: Vec<PathBuf> = preserve
        .iter()
        .filter_map(|p| {
            let rest = p.strip_prefix("/tmp").ok()?;
            let mut comps = rest.components();
            let top = comps.next()?;
            let session = comps.next()?;
            Some(Path::new("/tmp").join(top).join(session))
        })
        // Never through a link: a user's link to another directory is not the job's session.
        .filter(|t| fs::symlink_metadata(t).is_ok_and(|m| m.is_dir()))
        .collect();
    trees.sort();
    trees.dedup();
    for t in &trees {
        collect_files(t, &mut preserve);
    }
    preserve.sort();
    preserve.dedup();
    if let (false, Some(&first)) = (sockets.is_empty(), pids.first()) {
        let names = procfs::unix_socket_names(first);
        for ino in sockets {
            if let Some(dir) = names.get(&ino).and_then(|p| p.parent()) {
                if dir.is_absolute() {
                    guard.insert(dir.to_path_buf());
                }
            }
        }
    }
    let guard: Vec<String> = guard
        .iter()
        .filter_map(|d| d.to_str())
        .filter(|d| !d.contains('\n'))
        .map(String::from)
        .collect();
    OpenScan {
        open,
        preserve,
        guard,
    }
}

/// The copy of [`ToCopy`]: the preserved files, the bytes copied, and its time.
type Copied = (Vec<PreservedFile>, u64, Duration);

/// The files a dump copies beside the engine's: those the engine does not save, and the
/// part's own outputs.
struct ToCopy<'a> {
    owner: u32,
    node_dir: &'a Path,
    preserve: &'a [PathBuf],
    job_dir: &'a Path,
    outputs: &'a [(String, u64)],
}

/// The engine's dump, with the copy of `files` beside it: both only read the frozen job and
/// write to different directories, so the job stays frozen for the longer of the two rather
/// than their sum. Returns the engine's time, and the preserved files, bytes and time of the
/// copy.
fn dump_beside_copy(
    id: u64,
    engine: &dyn SnapshotEngine,
    spec: &DumpSpec<'_>,
    files: &ToCopy<'_>,
) -> Result<(Duration, Copied), AgentError> {
    let (dumped, copied) = std::thread::scope(|scope| {
        let copier = scope.spawn(|| {
            let (preserved, bytes, took) =
                copy_preserved(id, files.owner, files.node_dir, files.preserve)?;
            let out_bytes = copy_outputs(id, files.job_dir, files.node_dir, files.outputs)?;
            Ok::<_, AgentError>((preserved, bytes + out_bytes, took))
        });
        let t = Instant::now();
        let dumped = engine
            .dump(spec)
            .map_err(|source| AgentError::Engine { job: id, source })
            .map(|()| t.elapsed());
        (dumped, copier.join().expect("copy thread panicked"))
    });
    let engine_time = dumped?;
    crate::metrics::metrics()
        .dump_seconds
        .with_label_values(&[engine.name()])
        .observe(engine_time.as_secs_f64());
    Ok((engine_time, copied?))
}

/// Where the files of [`save_linked_remaps`] are kept, in the node directory.
pub(crate) const REMAPS_DIR: &str = "remaps";

/// Saves what a restore of the images in `node_dir` opens through a link remap
/// ([`crate::engine::criu_images`]): each such file (deleted while open, still linked
/// elsewhere) is copied through a descriptor the frozen job holds, to be put back as its owner
/// at the link's path before the engine restores. Refused, naming the file, where none of the
/// job's processes holds it (the engine found it through a mapping only) or it is not the
/// owner's.
fn save_linked_remaps(
    job: u64,
    owner: u32,
    node_dir: &Path,
    pids: &[i32],
) -> Result<Vec<PreservedFile>, AgentError> {
    let images = node_dir.join(chain::IMAGES_DIR);
    let remaps = crate::engine::criu_images::linked_remaps(&images).map_err(io_err(
        job,
        "read the engine's file remaps in",
        &images,
    ))?;
    let mut out = Vec::new();
    for (i, r) in remaps.iter().enumerate() {
        let refused = |problem: String| AgentError::FileRefused {
            job,
            action: "save",
            path: r.path.clone(),
            uid: owner,
            problem,
        };
        let held = format!("{} (deleted)", r.path);
        let fd = pids.iter().find_map(|&pid| {
            fs::read_dir(format!("/proc/{pid}/fd"))
                .ok()?
                .flatten()
                .map(|e| e.path())
                .find(|p| fs::read_link(p).is_ok_and(|t| t.as_os_str() == held.as_str()))
        });
        let Some(fd) = fd else {
            return Err(refused(
                "it was deleted while open and is still linked elsewhere, and no process of the job holds it open (a mapping only): its restore would need a link the engine removes after the dump. Close or unmap it, or keep its name until the checkpoint".into(),
            ));
        };
        // The file itself, reopened through the process's descriptor (never by a path).
        let mut src = fs::File::open(&fd).map_err(io_err(job, "read", &fd))?;
        let meta = src.metadata().map_err(io_err(job, "stat", &fd))?;
        if meta.uid() != owner {
            return Err(refused(format!(
                "it was deleted while open, belongs to uid {} and not to the job's owner; a checkpoint saves only the owner's files",
                meta.uid()
            )));
        }
        let dir = node_dir.join(REMAPS_DIR);
        ensure_dir(&dir, PRIVATE_DIR).map_err(io_err(job, "create", &dir))?;
        let saved = format!("{REMAPS_DIR}/{i}");
        let dst_path = node_dir.join(&saved);
        let mut dst = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(PRIVATE_FILE)
            .open(&dst_path)
            .map_err(io_err(job, "create", &dst_path))?;
        std::io::copy(&mut src, &mut dst).map_err(io_err(job, "copy", &dst_path))?;
        info!(job, file = %r.path, link = %r.link, bytes = meta.len(), "saved a file deleted while open, for its restore's link");
        out.push(PreservedFile {
            path: r.link.clone(),
            saved_as: saved,
            mode: meta.mode() & 0o7777,
            uid: meta.uid(),
            gid: meta.gid(),
            fifo: false,
        });
    }
    Ok(out)
}

/// Refuses to seal an epoch whose restore would open a file through a link remap that the
/// epoch does not put back (see [`save_linked_remaps`]): committed, it could not be restored.
pub(crate) fn check_linked_remaps(
    node_dir: &Path,
    preserved: &[PreservedFile],
) -> Result<(), String> {
    let images = node_dir.join(chain::IMAGES_DIR);
    let remaps = crate::engine::criu_images::linked_remaps(&images).map_err(|e| e.to_string())?;
    for r in remaps {
        let kept = preserved
            .iter()
            .any(|p| p.path == r.link && node_dir.join(&p.saved_as).is_file());
        if !kept {
            return Err(format!(
                "its restore opens {} (deleted while open, still linked elsewhere) through {}, which the engine removed after the dump and the epoch does not hold",
                r.path, r.link
            ));
        }
    }
    Ok(())
}

/// Records what the dump took (times, bytes) in the epoch's notes.
fn note_times(w: &mut crate::jobs::EpochWork, values: &[(&str, u128)]) {
    w.notes
        .extend(values.iter().map(|(k, v)| (k.to_string(), v.to_string())));
}

/// Share of the resident memory written since the newest pre-dump above which a checkpoint
/// dumps everything instead of on top of the chain.
const FULL_DUMP_WRITTEN: f64 = 0.6;

/// Whether a dump with `written` bytes written since the newest pre-dump, of `resident`, is a
/// full one (the chain dropped) rather than one on top of the chain.
pub(super) fn full_dump(written: u64, resident: u64) -> bool {
    written as f64 >= resident as f64 * FULL_DUMP_WRITTEN
}

/// Moves the job's waiting pre-dumps (if they are of this incarnation) into the epoch's node
/// directory as its chain, and returns the dump's parent relative to its images directory.
/// Renames only, in the staging file system: the frozen job does not wait for copies.
fn adopt_links(job: &mut NodeJob) -> Result<Option<String>, AgentError> {
    let (id, incarnation) = (job.record.id, job.record.incarnation);
    let w = job.work.as_mut().expect("checked by caller");
    let Some(c) = w.chain.as_mut() else {
        return Ok(None);
    };
    if c.incarnation != incarnation || c.links.is_empty() {
        return Ok(None);
    }
    let links = c.take();
    // Where most of the memory was written since the newest pre-dump, a dump on top of the
    // chain writes nearly all of it anyway, and comparing against the chain makes it slower
    // than a full dump (measured: 1.5x at 100 % written): a full dump, the chain dropped.
    let (mut dirty, mut resident) = (0u64, 0u64);
    for &pid in &w.pids {
        dirty += procfs::soft_dirty_bytes(pid).unwrap_or(0);
        resident += procfs::rss_bytes(pid);
    }
    w.notes
        .insert("precopy_dirty_bytes".into(), dirty.to_string());
    if full_dump(dirty, resident) {
        for l in &links {
            let _ = fs::remove_dir_all(&l.dir);
        }
        w.notes.insert("precopy_links".into(), "0".into());
        info!(
            job = id,
            dirty, resident, "most memory written since the pre-dump: a full dump"
        );
        return Ok(None);
    }
    let base = w.node_dir.join(chain::LINKS_DIR);
    fs::create_dir_all(&base).map_err(io_err(id, "create", &base))?;
    let mut bytes = 0u64;
    for l in &links {
        let name = l.dir.file_name().expect("numbered").to_string_lossy();
        let to = base.join(name.as_ref());
        fs::rename(&l.dir, &to).map_err(io_err(id, "move pre-dump", &l.dir))?;
        w.links.push(format!("{}/{name}", chain::LINKS_DIR));
        bytes += l.bytes;
    }
    w.notes
        .insert("precopy_links".into(), links.len().to_string());
    w.notes.insert("precopy_bytes".into(), bytes.to_string());
    Ok(w.links.last().map(|l| format!("../{l}")))
}

/// The longest file outside the images a checkpoint saves (`extra/`): shared-memory segments
/// of MPI libraries are megabytes to a few GiB per node; a longer one (a user's sparse file of
/// terabytes) is refused, naming it, rather than read whole.
const PRESERVE_MAX_BYTES: u64 = 16 << 30;

/// Copies the first `size` bytes of each of the part's outputs (`stdout`, `stderr` in
/// `job_dir`, a directory of root's) into [`OUTPUTS_DIR`]; the bytes copied.
fn copy_outputs(
    job: u64,
    job_dir: &Path,
    node_dir: &Path,
    outputs: &[(String, u64)],
) -> Result<u64, AgentError> {
    use std::io::Read;
    if outputs.is_empty() {
        return Ok(0);
    }
    let dir = node_dir.join(OUTPUTS_DIR);
    fs::create_dir_all(&dir).map_err(io_err(job, "create", &dir))?;
    let mut bytes = 0;
    for (name, size) in outputs {
        let from = job_dir.join(name);
        let src =
            match crate::os::owner::open_no_symlinks(&from, libc::O_RDONLY | libc::O_NONBLOCK, 0) {
                Ok(f) => f,
                // Removed by hand since the scan: a restore recreates it as zeros, as before.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err(job, "open", &from)(e)),
            };
        if !src
            .metadata()
            .map_err(io_err(job, "stat", &from))?
            .is_file()
        {
            continue;
        }
        let to = dir.join(name);
        let mut dst = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&to)
            .map_err(io_err(job, "create", &to))?;
        bytes += std::io::copy(&mut src.take(*size), &mut dst).map_err(io_err(job, "copy", &to))?;
    }
    Ok(bytes)
}

/// Copies the files the engine does not save into `extra/` of the node directory (named pipes
/// are only recorded); returns what was saved, the bytes copied and the time taken. These files
/// are in directories users control (`/dev/shm`, `/tmp`): each is opened without following a
/// symbolic link anywhere on its path, and must belong to the job's owner `owner`; what the
/// open file is (type, owner, mode) is read from the open file.
fn copy_preserved(
    job: u64,
    owner: u32,
    node_dir: &Path,
    files: &[PathBuf],
) -> Result<(Vec<PreservedFile>, u64, Duration), AgentError> {
    let begin = Instant::now();
    let io = |what, path: &Path| io_err(job, what, path);
    let refused = |p: &Path, problem: String| AgentError::FileRefused {
        job,
        action: "save",
        path: p.display().to_string(),
        uid: owner,
        problem,
    };
    let extra = node_dir.join("extra");
    let mut out = Vec::new();
    let mut bytes = 0u64;
    for (i, p) in files.iter().enumerate() {
        const LINK: &str = "it is a symbolic link, or a directory on its path is; root does not follow a user's links (remove the link, or keep the job's files under their real path)";
        // O_PATH: no open of the file itself yet (a FIFO's reader would wake its writer). With
        // O_NOFOLLOW a final link is opened as the link itself, and refused below.
        let handle = match crate::os::owner::open_no_symlinks(p, libc::O_PATH, 0) {
            Ok(h) => h,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(refused(p, LINK.into())),
            // Gone since the scan.
            Err(_) => continue,
        };
        let meta = handle.metadata().map_err(io("stat", p))?;
        if meta.file_type().is_symlink() {
            return Err(refused(p, LINK.into()));
        }
        let fifo = meta.file_type().is_fifo();
        if !fifo && !meta.is_file() {
            continue;
        }
        if meta.uid() != owner {
            return Err(refused(
                p,
                format!(
                    "it belongs to uid {}, not to the job's owner; a checkpoint saves only the owner's files",
                    meta.uid()
                ),
            ));
        }
        let saved_as = if fifo {
            String::new()
        } else {
            ensure_dir(&extra, PRIVATE_DIR).map_err(io("create", &extra))?;
            let saved = format!("extra/{i}");
            // The same file, reopened for reading through the handle (not by its path again).
            let mut src = fs::File::open(format!("/proc/self/fd/{}", handle.as_raw_fd()))
                .map_err(io("read", p))?;
            let dst_path = node_dir.join(&saved);
            let mut dst = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(PRIVATE_FILE)
                .open(&dst_path)
                .map_err(io("create", &dst_path))?;
            if meta.len() > PRESERVE_MAX_BYTES {
                return Err(refused(
                    p,
                    format!(
                        "it is {} bytes long, more than the {PRESERVE_MAX_BYTES} a checkpoint saves of a file outside the images (a sparse file of that length would still be read whole to check it)",
                        meta.len()
                    ),
                ));
            }
            bytes += ckpt_store::copy::copy_sparse(&mut src, &mut dst).map_err(io("copy", p))?;
            saved
        };
        out.push(PreservedFile {
            path: p.display().to_string(),
            saved_as,
            mode: meta.mode() & 0o7777,
            uid: meta.uid(),
            gid: meta.gid(),
            fifo,
        });
    }
    Ok((out, bytes, begin.elapsed()))
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => collect_files(&p, out),
            Ok(t) if t.is_file() || t.is_fifo() => out.push(p),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each output is saved as it was at the checkpoint (its first `size` bytes, whatever came
    /// after), root's alone; one that is gone is skipped, and a link is never followed.
    #[test]
    fn outputs_are_saved_at_their_checkpoint_size() {
        let job_dir = tempfile::tempdir().unwrap();
        let node_dir = tempfile::tempdir().unwrap();
        fs::write(job_dir.path().join("stdout"), b"iter 1\niter 2\n").unwrap();
        let outputs = [("stdout".to_string(), 7), ("stderr".to_string(), 4)];
        let bytes = copy_outputs(1, job_dir.path(), node_dir.path(), &outputs).unwrap();
        assert_eq!(bytes, 7);
        let saved = node_dir.path().join(OUTPUTS_DIR);
        assert_eq!(fs::read(saved.join("stdout")).unwrap(), b"iter 1\n");
        assert!(
            !saved.join("stderr").exists(),
            "a missing output is skipped"
        );
        let mode = fs::metadata(saved.join("stdout")).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);

        let other = tempfile::tempdir().unwrap();
        fs::write(other.path().join("secret"), b"not the job's").unwrap();
        std::os::unix::fs::symlink(other.path().join("secret"), job_dir.path().join("stderr"))
            .unwrap();
        let node2 = tempfile::tempdir().unwrap();
        let e = copy_outputs(1, job_dir.path(), node2.path(), &outputs).unwrap_err();
        assert!(e.to_string().contains("stderr"), "{e}");
    }
}
