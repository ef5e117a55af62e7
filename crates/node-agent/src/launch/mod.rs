//! Launch: starting a job's processes on this node under a shim, and what `ckpt-rsh` and the
//! coordinator ask of a running part (output, token, signals, processes). `exits.rs` follows
//! those processes and reports the ones killed by a signal.
//!
//! What it may import: `os/`, the table (`jobs.rs`), the snapshot engines, the shim's spec and
//! the crate's config and errors; none of the checkpoint, restore or copy steps, and nothing
//! of `rpc/`. `exits.rs` imports nothing of the crate. The shim itself (`shim.rs`) stays
//! beside `lib.rs`: it is a process of its own with a public path (`node_agent::shim`), and its
//! restore half imports `restore/`.
//!
//! One file: a part's start under its shim and the calls a running part answers, which all read the
//! files its shim writes.

pub(crate) mod exits;
mod part;

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tracing::{info, instrument, warn};

use crate::error::{io_err, AgentError};
use crate::jobs::{Jobs, NodeJob, Observed};
use crate::node::{LaunchEnv, Node};
use crate::os::modes::{ensure_dir, write_private, PRIVATE_DIR, PRIVATE_FILE};
use crate::os::owner::Identity;
use crate::shim::{self, ShimMode, ShimSpec, Started};

pub use part::PartRun;

/// How long a newly started shim may take to report the job's root running. Exec of a
/// launcher is milliseconds; 30 s covers a loaded node.
pub const LAUNCH_TIMEOUT: Duration = Duration::from_secs(30);

/// What a launch needs.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Job id.
    pub job: u64,
    /// Command.
    pub argv: Vec<String>,
    /// Working directory.
    pub cwd: PathBuf,
    /// Environment.
    pub env: BTreeMap<String, String>,
    /// User. The request's gid and groups are not taken: the job gets the uid's primary
    /// group and supplementary groups from this node's own databases.
    pub uid: u32,
    /// The job's secret.
    pub token: String,
    /// 0: the job's command; >0: a part started through `ckpt-rsh`.
    pub part: u32,
    /// Run the part in a sandbox with this job address.
    pub sandbox: Option<crate::os::sandbox::JobAddress>,
    /// The snapshot engine ("": the default).
    pub engine: String,
    /// ckptd may restart the part elsewhere by itself: it is fenced when the lease runs out.
    pub may_move: bool,
}

/// A job whose environment sets this to `off` is started without the verbs layer.
pub const VERBS_LAYER_ENV: &str = "CKPT_VERBS_LAYER";

/// Puts `layer` first in `env`'s `LD_PRELOAD` (before libibverbs is loaded by anyone), unless
/// the job turned it off or preloads a verbs layer itself.
fn preload_layer(env: &mut BTreeMap<String, String>, layer: &Path) {
    if env.get(VERBS_LAYER_ENV).is_some_and(|v| v == "off") {
        return;
    }
    let cur = env.get("LD_PRELOAD").map(String::as_str).unwrap_or("");
    // ld.so separates LD_PRELOAD entries by colons or spaces.
    let theirs = cur.split([':', ' ']).any(|e| {
        Path::new(e)
            .file_name()
            .is_some_and(|n| n == crate::config::VERBS_LAYER_FILE)
    });
    if theirs {
        return;
    }
    let v = match cur.trim() {
        "" => layer.display().to_string(),
        rest => format!("{}:{rest}", layer.display()),
    };
    env.insert("LD_PRELOAD".into(), v);
}

impl LaunchEnv {
    /// Adds the job's identity and the launcher settings to `env`.
    pub fn apply(&self, env: &mut BTreeMap<String, String>, job: u64, token: &str, node: &str) {
        env.insert("CKPT_JOB_ID".into(), job.to_string());
        env.insert("CKPT_JOB_TOKEN".into(), token.into());
        env.insert("CKPT_NODE".into(), node.into());
        if !self.coordinator.is_empty() {
            env.insert("CKPT_COORDINATOR".into(), self.coordinator.clone());
        }
        if let Some(ca) = &self.ca {
            env.insert("CKPT_TLS_CA".into(), ca.display().to_string());
        }
        if let Some(layer) = &self.verbs_layer {
            preload_layer(env, layer);
        }
        let Some(l) = &self.launcher else { return };
        let l = l.display().to_string();
        env.insert("CKPT_RSH".into(), l.clone());
        if self.set_mpi_env {
            for (k, v) in [
                ("HYDRA_LAUNCHER", "ssh"),
                ("HYDRA_LAUNCHER_EXEC", l.as_str()),
                ("OMPI_MCA_plm", "rsh"),
                ("OMPI_MCA_plm_rsh_agent", l.as_str()),
            ] {
                env.entry(k.into()).or_insert_with(|| v.into());
            }
        }
    }
}

/// Where the PIDs of a job's sandbox start: a slot of 1000 per job, within the node's
/// `pid_max`, so that parts of different jobs on one node rarely share PIDs.
fn pid_base(job: u64) -> u32 {
    let pid_max: u64 = fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(32_768);
    let slots = (pid_max / 1000).saturating_sub(1).max(1);
    ((job % slots) * 1000) as u32
}

/// The end of a shim's log, for an error message.
fn shim_log_tail(log: &str) -> String {
    let tail: Vec<&str> = log.lines().rev().take(3).collect();
    if tail.is_empty() {
        "it printed nothing".into()
    } else {
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }
}

/// Makes the session directory of `job` ([`NodeJob::session_dir`]) afresh, with the owner's
/// subdirectories `subdirs` in it, and the owner's, once `fill` has put into it what the
/// engine needs. Everything under `<job dir>/session` is root's until then, so root never
/// works inside a directory the owner controls; the owner gets only these, through
/// descriptors. What an earlier incarnation left there is gone: its processes are.
pub(crate) fn make_session(
    job: &NodeJob,
    owner: &Identity,
    subdirs: &[&str],
    fill: impl FnOnce(&Path) -> std::io::Result<()>,
) -> std::io::Result<PathBuf> {
    let base = job.dir.join("session");
    ensure_dir(&base, crate::os::modes::TRAVERSE_ONLY)?;
    // This one, and the per-incarnation sessions of older agents.
    for e in fs::read_dir(&base)?.flatten() {
        if e.file_type()?.is_dir() {
            fs::remove_dir_all(e.path())?;
        } else {
            fs::remove_file(e.path())?;
        }
    }
    let dir = job.session_dir();
    fs::create_dir(&dir)?;
    fill(&dir)?;
    let give = |path: &Path| -> std::io::Result<()> {
        let d = crate::os::owner::open_no_symlinks(path, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        nix::unistd::fchown(&d, Some(owner.uid.into()), Some(owner.gid.into()))
            .map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
        d.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(PRIVATE_DIR))
    };
    for s in subdirs {
        let sub = dir.join(s);
        fs::create_dir(&sub)?;
        give(&sub)?;
    }
    give(&dir)?;
    Ok(dir)
}

/// Starts a job's command on this node: admitted by the node first, so that a refused launch
/// leaves no entry behind, then started in the entry the table makes for it.
pub async fn launch(jobs: &Jobs, spec: LaunchSpec) -> Result<(i32, u32), AgentError> {
    let admitted = jobs.node.admit(&spec).await?;
    let j = jobs.get_or_create(spec.job)?;
    let mut job = j.lock().await;
    jobs.node.launch(&mut job, spec, admitted).await
}

/// What a launch checked: who the job runs as, where Slurm put it, its engine.
pub(crate) struct Admitted {
    owner: Identity,
    place: Option<crate::os::slurm::SlurmPlace>,
    engine: Arc<dyn crate::engine::SnapshotEngine>,
}

impl Node {
    /// Starts a job's command on this node.
    /// Admits a launch: its owner may run jobs here (the request's gid and groups are not
    /// used), Slurm gave them this node if it must, and the engine can run it. Checked before
    /// the job's entry is made: a refused launch leaves nothing behind.
    pub(crate) async fn admit(&self, spec: &LaunchSpec) -> Result<Admitted, AgentError> {
        let owner = self.policy.authorize(spec.job, &self.name, spec.uid)?;
        let place = self.slurm.place(spec.job, &self.name, owner.uid).await?;
        self.step_free(spec.job, owner.uid, place.as_ref())?;
        let engine = self.engine_named(spec.job, &spec.engine)?;
        if !engine.freezes() && (spec.part > 0 || spec.sandbox.is_some()) {
            return Err(AgentError::NoEngine {
                job: spec.job,
                node: self.name.clone(),
                problem: format!(
                    "the {} engine runs a job on one node, in the node's namespaces: its MPI launcher may not start parts on other nodes, nor may the job have a sandbox (use the criu engine for that)",
                    engine.name()
                ),
            });
        }
        Ok(Admitted {
            owner,
            place,
            engine,
        })
    }

    /// Starts a job's command on this node, in its (locked) entry, once [`Node::admit`]ted.
    #[instrument(skip_all, fields(job = spec.job))]
    pub(crate) async fn launch(
        &self,
        job: &mut NodeJob,
        spec: LaunchSpec,
        admitted: Admitted,
    ) -> Result<(i32, u32), AgentError> {
        let Admitted {
            owner,
            place,
            engine,
        } = admitted;
        if job.observe(self.host.as_ref()) == Observed::Running {
            return Err(AgentError::StillRunning {
                job: spec.job,
                pids: job.cgroup.pids().unwrap_or_default(),
            });
        }
        job.settle_cgroup(&self.cgroups, place.as_ref());
        let mut env = spec.env;
        self.launch_env
            .apply(&mut env, spec.job, &spec.token, &self.name);
        env.insert(
            ib_quiesce::control::SOCKET_ENV.into(),
            self.channels.socket().display().to_string(),
        );
        job.record.token = spec.token;
        job.record.part = spec.part;
        job.record.may_move = spec.may_move;
        job.record.owner = Some(owner.uid);
        let sandbox = match &spec.sandbox {
            Some(addr) => {
                // Hydra tells its proxies to call back on its host name, which names the node,
                // not the sandbox: have it give the job address instead.
                env.entry("HYDRA_IFACE".into())
                    .or_insert_with(|| crate::os::sandbox::JOB_INTERFACE.into());
                // UCX's shared memory as named files in the sandbox's own /dev/shm, which
                // the images carry, rather than descriptors reached through /proc/<pid>/fd.
                env.entry("UCX_POSIX_USE_PROC_LINK".into())
                    .or_insert_with(|| "n".into());
                Some(self.make_sandbox(spec.job, addr).await?)
            }
            None => None,
        };
        job.record.sandbox = spec.sandbox.clone();
        job.record.engine = spec.engine.clone();
        let argv = if engine.freezes() {
            spec.argv
        } else {
            let session = make_session(job, &owner, engine.session_subdirs(), |_| Ok(()))
                .map_err(io_err(spec.job, "create the engine session of", &job.dir))?;
            let port = self.coordinator_port(job, engine.as_ref(), owner.uid)?;
            engine.launch_argv(spec.argv, &mut env, &session, port)
        };
        let mode = ShimMode::Launch {
            argv,
            cwd: spec.cwd,
            env,
            uid: owner.uid,
            gid: owner.gid,
            groups: owner.groups.clone(),
            sandbox,
        };
        let pid = match self.start_shim(job, mode, &owner, LAUNCH_TIMEOUT).await {
            Ok(pid) => pid,
            Err(e) => {
                if job.record.sandbox.is_some() {
                    crate::os::sandbox::remove(&self.netns(spec.job)).await;
                }
                return Err(e);
            }
        };
        match &spec.sandbox {
            Some(a) => info!(pid, address = %a.cidr(), "job started in a sandbox"),
            None => info!(pid, "job started"),
        }
        Ok((pid, job.record.incarnation))
    }

    pub(crate) async fn start_shim(
        &self,
        job: &mut NodeJob,
        mode: ShimMode,
        owner: &Identity,
        timeout: Duration,
    ) -> Result<i32, AgentError> {
        let id = job.record.id;
        if let Some((since, lease)) = self.lease.overdue() {
            return Err(AgentError::Fenced {
                job: id,
                node: self.name.clone(),
                since,
                lease,
            });
        }
        job.record.incarnation += 1;
        job.record.root_pid = None;
        let run_dir = job.run_dir();
        let io = |what, path: &Path| io_err(id, what, path);
        ensure_dir(&job.dir.join("run"), PRIVATE_DIR)
            .and_then(|()| ensure_dir(&run_dir, PRIVATE_DIR))
            .map_err(io("create", &run_dir))?;
        job.cgroup
            .create()
            .map_err(|source| AgentError::Cgroup { job: id, source })?;
        let (ready, ready_w) =
            crate::os::clone_into::pipe_cloexec().map_err(io("create a pipe for", &run_dir))?;
        let ready_fd = ready_w.as_raw_fd();
        let spec = ShimSpec {
            mode,
            cgroup_procs: job.cgroup.procs_file(),
            also_join: job.cgroup.other_procs_files(),
            lent: job.cgroup.lender().is_some(),
            stdout: job.dir.join("stdout"),
            stderr: job.dir.join("stderr"),
            run_dir: run_dir.clone(),
            output_owner: Some((owner.uid, owner.gid)),
            ready_fd: Some(ready_fd),
            lease: job.record.may_move.then(|| self.lease.path().to_path_buf()),
        };
        let spec_path = run_dir.join(shim::SPEC);
        // It holds the job's secret and whole environment.
        write_private(
            &spec_path,
            &serde_json::to_vec_pretty(&spec).expect("serializable"),
        )
        .map_err(io("write", &spec_path))?;
        job.save()?;
        let log = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(PRIVATE_FILE)
            .open(run_dir.join("shim.log"))
            .map_err(io("create", &run_dir))?;
        let log2 = log.try_clone().map_err(io("create", &run_dir))?;
        job.record.shim = self
            .host
            .spawn_shim(&self.shim_exe, &spec_path, (log, log2), ready_fd)
            .map_err(|e| AgentError::Start {
                job: id,
                message: format!("cannot start shim {}: {e}", self.shim_exe.display()),
            })?;
        job.cgroup.set_tree(job.record.shim);
        // Only the shim holds the write end now: its byte, or its end-of-file if it dies.
        drop(ready_w);
        let started_file = run_dir.join(shim::STARTED);
        let mut ready =
            tokio::net::unix::pipe::Receiver::from_owned_fd(ready).map_err(io("read", &run_dir))?;
        let mut byte = [0u8; 1];
        let told = tokio::time::timeout(timeout, ready.read(&mut byte)).await;
        let started = match told {
            Err(_) => {
                return Err(AgentError::Timeout {
                    job: id,
                    what: "job start",
                    waited: timeout,
                })
            }
            Ok(_) => shim::read_json::<Started>(&started_file).ok_or_else(|| {
                let log = fs::read_to_string(run_dir.join("shim.log")).unwrap_or_default();
                AgentError::Start {
                    job: id,
                    message: format!(
                        "the job shim ended before it wrote {}: {}",
                        started_file.display(),
                        shim_log_tail(&log)
                    ),
                }
            })?,
        };
        match started {
            Started::Running { root_pid } => {
                job.record.root_pid = Some(root_pid);
                job.save()?;
                if let Some(lent) = job.cgroup.lender() {
                    // Already in the step's cgroups; this adds it to Slurm's accounting.
                    let step =
                        crate::os::slurm::ExternStep::at(lent.slurm_job, lent.socket.clone());
                    let adopted = tokio::task::spawn_blocking(move || step.adopt(root_pid)).await;
                    match adopted.map_err(|e| e.to_string()).and_then(|r| r) {
                        Ok(()) => info!(root_pid, slurm_job = lent.slurm_job, "adopted by Slurm"),
                        Err(e) => {
                            warn!(root_pid, error = %e, "Slurm does not account for the part")
                        }
                    }
                }
                Ok(root_pid)
            }
            Started::Failed { error } => Err(AgentError::Start {
                job: id,
                message: error,
            }),
        }
    }

    /// A fenced port for the coordinator of `job`'s next incarnation, if `engine` runs one
    /// ([`crate::os::fence`]), recorded in the job's record.
    pub(crate) fn coordinator_port(
        &self,
        job: &mut NodeJob,
        engine: &dyn crate::engine::SnapshotEngine,
        owner: u32,
    ) -> Result<Option<u16>, AgentError> {
        if !engine.has_coordinator() {
            return Ok(None);
        }
        let port = self
            .fence
            .reserve(owner)
            .map_err(|message| AgentError::Start {
                job: job.record.id,
                message,
            })?;
        job.record.coordinator_port = port;
        Ok(port)
    }

    /// Makes the network namespace of a part's sandbox with its job address; the shim makes
    /// the rest when it starts the part.
    pub(crate) async fn make_sandbox(
        &self,
        job: u64,
        addr: &crate::os::sandbox::JobAddress,
    ) -> Result<shim::Sandbox, AgentError> {
        let link = self.job_link.as_deref().ok_or_else(|| AgentError::Start {
            job,
            message: format!(
                "node {} has no job network interface: set [job_network] interface in its agent.toml (see docs/operations.md, \"Job sandboxes\")",
                self.name
            ),
        })?;
        let init = self.shim_exe.with_file_name("ckpt-init");
        if !init.is_file() {
            return Err(AgentError::Start {
                job,
                message: format!(
                    "{} is missing: install it next to ckpt-agent",
                    init.display()
                ),
            });
        }
        // The mount point of the job directory inside sandboxes (empty, root's).
        std::fs::create_dir_all(crate::os::sandbox::JOB_DIR).map_err(|e| AgentError::Start {
            job,
            message: format!("cannot make {}: {e}", crate::os::sandbox::JOB_DIR),
        })?;
        let netns = crate::os::sandbox::create(&self.name, job, link, addr)
            .await
            .map_err(|message| AgentError::Start { job, message })?;
        Ok(shim::Sandbox {
            init,
            netns,
            pid_base: pid_base(job),
            follow: self.launch_env.follow_mounts.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::owner::LaunchPolicy;

    #[test]
    fn launch_policy_refuses_root_system_accounts_and_unknown_users() {
        let strict = LaunchPolicy::default();
        let e = strict.authorize(7, "n1", 0).unwrap_err();
        assert!(matches!(e, AgentError::RootRefused { .. }), "{e}");
        assert!(e.to_string().contains("allow_root_jobs"), "{e}");
        let e = strict.authorize(7, "n1", 1).unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::UidBelowMinimum {
                    uid: 1,
                    min_uid: 1000,
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("uid 1") && e.to_string().contains("min_uid"),
            "{e}"
        );
        let e = strict.authorize(7, "n1", u32::MAX - 7).unwrap_err();
        assert!(matches!(e, AgentError::UnknownUser { .. }), "{e}");
        assert!(e.to_string().contains("no passwd entry"), "{e}");
        let open = LaunchPolicy {
            allow_root: true,
            min_uid: 1000,
        };
        let root = open.authorize(7, "n1", 0).unwrap();
        assert_eq!((root.uid, root.gid), (0, 0), "gid from passwd");
        assert!(matches!(
            crate::rpc::grpc::to_status(strict.authorize(7, "n1", 0).unwrap_err()).code(),
            tonic::Code::PermissionDenied
        ));
    }

    #[test]
    fn launch_env_names_the_job_and_keeps_the_jobs_own_launcher() {
        let le = LaunchEnv {
            coordinator: "10.0.0.1:7600".into(),
            launcher: Some("/usr/lib/ckpt/ckpt-rsh".into()),
            set_mpi_env: true,
            ca: Some("/etc/ckpt/tls/ca.pem".into()),
            verbs_layer: None,
            follow_mounts: Vec::new(),
        };
        let mut env = BTreeMap::from([("OMPI_MCA_plm_rsh_agent".to_string(), "ssh".to_string())]);
        le.apply(&mut env, 7, "secret", "n1");
        assert_eq!(env["CKPT_TLS_CA"], "/etc/ckpt/tls/ca.pem");
        assert_eq!(env["CKPT_JOB_ID"], "7");
        assert_eq!(env["CKPT_JOB_TOKEN"], "secret");
        assert_eq!(env["CKPT_COORDINATOR"], "10.0.0.1:7600");
        assert_eq!(env["HYDRA_LAUNCHER_EXEC"], "/usr/lib/ckpt/ckpt-rsh");
        assert_eq!(
            env["OMPI_MCA_plm_rsh_agent"], "ssh",
            "the job's choice wins"
        );
        let mut env = BTreeMap::new();
        LaunchEnv {
            set_mpi_env: false,
            ..le
        }
        .apply(&mut env, 7, "secret", "n1");
        assert!(!env.contains_key("HYDRA_LAUNCHER_EXEC"));
        assert_eq!(env["CKPT_RSH"], "/usr/lib/ckpt/ckpt-rsh");
    }

    #[test]
    fn the_verbs_layer_goes_first_in_ld_preload_unless_the_job_says_otherwise() {
        let le = LaunchEnv {
            verbs_layer: Some("/usr/lib/ckpt/libckpt_verbs.so".into()),
            ..LaunchEnv::default()
        };
        let with = |pairs: &[(&str, &str)]| {
            let mut env: BTreeMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            le.apply(&mut env, 7, "secret", "n1");
            env.get("LD_PRELOAD").cloned()
        };
        assert_eq!(with(&[]).as_deref(), Some("/usr/lib/ckpt/libckpt_verbs.so"));
        assert_eq!(
            with(&[("LD_PRELOAD", "libfoo.so")]).as_deref(),
            Some("/usr/lib/ckpt/libckpt_verbs.so:libfoo.so"),
            "before the job's own preloads, so it is found before libibverbs"
        );
        assert_eq!(
            with(&[("LD_PRELOAD", "/home/u/libckpt_verbs.so libfoo.so")]).as_deref(),
            Some("/home/u/libckpt_verbs.so libfoo.so"),
            "a job that preloads a layer itself keeps it, and gets no second one"
        );
        assert_eq!(
            with(&[(VERBS_LAYER_ENV, "off"), ("LD_PRELOAD", "libfoo.so")]).as_deref(),
            Some("libfoo.so"),
            "turned off by the job"
        );
        let mut env = BTreeMap::new();
        LaunchEnv::default().apply(&mut env, 7, "secret", "n1");
        assert!(!env.contains_key("LD_PRELOAD"), "no layer on this node");
    }
}
