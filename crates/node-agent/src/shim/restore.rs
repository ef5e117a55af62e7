//! The job shim's restore: the engine started in the job's cgroup with the part's network
//! namespace passed in, through CRIU's RPC service where the restore's options allow (the
//! restore gate then answers on a socket, [`crate::engine::criu_rpc`]), else as the command
//! line the engine built, with the gate as CRIU's action script.
use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use super::reap::{decode, wait_pid};
use super::{join_cgroup, Exit, RESTORE_NETNS_FD};
use crate::os::cgroup::Freezer;

/// Restores with `argv` (the engine's restore command), the part's network namespace at
/// `netns` and the restore gate's FIFO `gate`; the restored root's PID. `pid_file` is where
/// the command line restore writes it. `guard` is guarded against links while the engine
/// restores, with `exempt` below it following them ([`super::guard`]).
pub(super) fn start(
    engine: &Engine<'_>,
    run_dir: &Path,
    argv: &[String],
    pid_file: &Path,
    netns: Option<&Path>,
    gate: Option<&Path>,
    (guard, exempt): (&[std::path::PathBuf], &[std::path::PathBuf]),
) -> Result<i32, String> {
    // Through CRIU's RPC service where the options allow: the gate is then an answer
    // on a socket, not a script CRIU starts at each stage, and the guard goes on at the first.
    let plan = crate::engine::criu_rpc::Plan::from_argv(argv, gate.is_some())
        .filter(|_| run_dir.to_str().is_some());
    // A sandboxed part lives in the mount namespace the engine makes for it, never in this
    // one: the binds of the command line's guard do not show there, and its tmpfs is filled by
    // a program the engine starts once the restore is under way (`tar`).
    let guard = match (&plan, netns) {
        (Some(_), None) => super::guard::prepare(guard, exempt)?,
        _ => super::guard::bind_guard(guard, exempt)?,
    };
    let netns = match netns {
        Some(p) => Some(fs::File::open(p).map_err(|e| {
            format!(
                "cannot open the part's network namespace {}: {e}",
                p.display()
            )
        })?),
        None => None,
    };
    let netns_fd = netns.as_ref().map(|f| f.as_raw_fd());
    let pid = match &plan {
        Some(plan) => restore_rpc(engine, plan, netns_fd, gate, guard.as_ref(), run_dir)?,
        None => restore_command(engine, argv, pid_file, netns_fd, gate)?,
    };
    if let Some(Err(e)) = guard.map(|g| g.lift(pid)) {
        kill_cgroup(engine.cgroup_procs);
        return Err(e);
    }
    Ok(pid)
}

/// The command line restore: `argv` run with the gate as its action script.
fn restore_command(
    engine: &Engine<'_>,
    argv: &[String],
    pid_file: &Path,
    netns_fd: Option<i32>,
    gate: Option<&Path>,
) -> Result<i32, String> {
    let gate_env = gate.map(|g| (crate::restore::gate::ENV, g.as_os_str()));
    let pass: Vec<(i32, i32)> = netns_fd
        .map(|fd| (fd, RESTORE_NETNS_FD))
        .into_iter()
        .collect();
    let child = engine.spawn(argv, gate_env.into_iter().collect(), &pass)?;
    let status = wait_pid(child);
    if status
        != (Exit {
            code: Some(0),
            ..Exit::default()
        })
    {
        return Err(exit_text(&status));
    }
    let text = fs::read_to_string(pid_file).map_err(|e| format!("{}: {e}", pid_file.display()))?;
    text.trim()
        .parse()
        .map_err(|_| format!("{}: not a pid: {text:?}", pid_file.display()))
}

/// "killed by signal N" or "exit status N".
fn exit_text(status: &Exit) -> String {
    match status.signal {
        Some(s) => format!("killed by signal {s}"),
        None => format!("exit status {}", status.code.unwrap_or(-1)),
    }
}

/// How the shim starts the restore engine: in the job's cgroup, with its outputs.
pub(super) struct Engine<'a> {
    pub(super) cgroup_procs: &'a Path,
    /// `cgroup.procs` for joining (the job cgroup's first), made before any fork.
    pub(super) procs: &'a [CString],
    pub(super) stdout: &'a fs::File,
    pub(super) stderr: &'a fs::File,
}

impl Engine<'_> {
    /// Starts `argv` with `env` added and the descriptors `pass` (see
    /// [`crate::os::clone_into::Child::pass`]); its PID.
    fn spawn(
        &self,
        argv: &[String],
        env: Vec<(&str, &std::ffi::OsStr)>,
        pass: &[(i32, i32)],
    ) -> Result<i32, String> {
        let (prog, args) = argv.split_first().ok_or("empty restore command")?;
        // Born in the job's cgroup where the kernel can, else joining it before exec.
        let born = match self.cgroup_procs.parent() {
            Some(cgroup) if self.procs.len() == 1 => crate::os::clone_into::spawn(
                cgroup,
                &crate::os::clone_into::Child {
                    argv,
                    env: env.clone(),
                    stdout: self.stdout,
                    stderr: self.stderr,
                    pass,
                },
            )
            .map_err(|e| format!("cannot start {prog}: {e}"))?,
            _ => None,
        };
        if let Some(pid) = born {
            return Ok(pid);
        }
        let out = |f: &fs::File| {
            f.try_clone()
                .map_err(|e| format!("cannot start {prog}: {e}"))
        };
        let mut cmd = Command::new(prog);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(out(self.stdout)?)
            .stderr(out(self.stderr)?);
        cmd.envs(env);
        let procs = self.procs.to_vec();
        let pass = pass.to_vec();
        // SAFETY: async-signal-safe calls only, on memory allocated before the fork.
        unsafe {
            cmd.pre_exec(move || {
                join_cgroup(&procs)?;
                crate::os::clone_into::cloexec_from_3()?;
                for &(fd, to) in &pass {
                    crate::os::clone_into::pass_fd(fd, to)?;
                }
                Ok(())
            });
        }
        Ok(cmd
            .spawn()
            .map_err(|e| format!("cannot start {prog}: {e}"))?
            .id() as i32)
    }
}

/// A restore through CRIU's RPC service (see [`crate::engine::criu_rpc`]): `criu swrk` started
/// as the command would be, its configuration file in the run directory, and the gate's
/// verdict given at post-restore. The restored root's PID.
fn restore_rpc(
    engine: &Engine<'_>,
    plan: &crate::engine::criu_rpc::Plan,
    netns_fd: Option<i32>,
    gate: Option<&Path>,
    guard: Option<&super::guard::Guard>,
    run_dir: &Path,
) -> Result<i32, String> {
    use crate::engine::criu_rpc::{Session, POST_RESTORE, PRE_RESTORE};
    let config = run_dir.join("criu-restore.conf");
    write_private_file(&config, plan.config.as_bytes())
        .map_err(|e| format!("{}: {e}", config.display()))?;
    let pair_failed = |e: io::Error| format!("cannot make a socket pair for criu: {e}");
    let (session, theirs) = Session::pair().map_err(pair_failed)?;
    // Above every number the child is given otherwise (the network namespace goes to 3); the
    // pair's own descriptor is closed, so that CRIU alone holds its end.
    let theirs = crate::os::clone_into::high(theirs).map_err(pair_failed)?;
    let fd = theirs.as_raw_fd();
    let argv = [plan.program.clone(), "swrk".into(), fd.to_string()];
    let mut pass = vec![(fd, fd)];
    if let Some(ns) = netns_fd {
        pass.insert(0, (ns, RESTORE_NETNS_FD));
    }
    let child = engine.spawn(&argv, Vec::new(), &pass)?;
    drop(theirs);
    let mut status = None;
    let restored = session.restore(
        plan,
        config.to_str().expect("checked by the caller"),
        |stage| match (stage, guard) {
            // Nothing of the job is made before this stage; CRIU runs no program after it.
            (PRE_RESTORE, Some(g)) => g.arm(),
            (POST_RESTORE, Some(g)) if !g.armed() => Err(
                "the restore's guard against links was never put in place (CRIU sent no stage for it)"
                    .to_string(),
            ),
            // Every file of the job is made; its processes run once CRIU goes on.
            (POST_RESTORE, g) => gate
                .map_or(Ok(()), crate::restore::gate::wait_verdict)
                .and_then(|()| g.map_or(Ok(()), |g| g.disarm())),
            _ => Ok(()),
        },
        || {
            let mut raw = 0;
            // SAFETY: waitpid without blocking on our own child, into a local int.
            let rc = unsafe { libc::waitpid(child, &mut raw, libc::WNOHANG) };
            (rc == child).then(|| {
                let exit = decode(raw);
                let text = exit_text(&exit);
                status = Some(exit);
                text
            })
        },
        crate::restore::RESTORE_TIMEOUT,
    );
    // The service ends when the caller hangs up.
    drop(session);
    if restored.is_err() {
        // Nothing of a failed restore may be left: a CRIU that died half way leaves tasks it
        // had begun to restore, which wait for it for ever (the shim is not in the cgroup).
        kill_cgroup(engine.cgroup_procs);
    }
    let status = status.unwrap_or_else(|| wait_pid(child));
    match restored {
        Ok(pid) => Ok(pid),
        Err(e) if status.code == Some(0) => Err(e),
        Err(e) => Err(format!("{e}; criu: {}", exit_text(&status))),
    }
}

/// SIGKILLs every process listed in `cgroup.procs` at `procs` but Slurm's own (bounded: a few
/// rounds).
fn kill_cgroup(procs: &Path) {
    for _ in 0..20 {
        let pids = super::job_members(procs);
        if pids.is_empty() {
            return;
        }
        for p in pids {
            // SAFETY: kill(2) on a PID read from the job's own cgroup.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        // A frozen task dies only once thawed (CRIU restores the freezer state of dump time).
        if let Some(dir) = procs.parent() {
            let _ = fs::write(dir.join("freezer.state"), Freezer::Thawed.name());
            let _ = fs::write(dir.join("cgroup.freeze"), "0");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Writes `bytes` to a new file only its owner (root) can read, replacing any file there.
fn write_private_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.write_all(bytes)
}
