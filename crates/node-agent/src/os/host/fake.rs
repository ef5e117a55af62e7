//! A recording fake of [`Host`] for tests: one job's cgroup held in memory (its members and
//! whether it is frozen), every call noted in order in a [`Log`] that a fake engine may share,
//! and answers a test scripts (a freeze that fails or hangs, a process outside the tree, a
//! privileged process, a restore the engine fails). Its shim does what the real one reports:
//! a restore's root joins the cgroup, frozen, and `started.json` says so; behind a gate it
//! waits for the agent's verdict first.

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::Host;
use crate::os::cgroup::{CgroupError, Freezer, JobCgroup};
use crate::os::procfs::ProcStat;
use crate::shim::{self, ShimMode, ShimSpec, Started};

/// One thing asked of the host (or, [`Call::Dump`] and [`Call::RestoreArgv`], of a fake
/// engine sharing the log), in the order asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    /// The cgroup's members were listed.
    Pids,
    /// Whether the cgroup exists was asked.
    Exists,
    /// The freezer state was read.
    State,
    /// The cgroup was frozen (a restored tree's check, a held part).
    Freeze,
    /// The cgroup was frozen for a snapshot.
    FreezeForSnapshot,
    /// The cgroup was thawed.
    Thaw,
    /// Every process of the cgroup was killed.
    KillAll,
    /// The processes outside the tree below this root were looked for.
    OutsideTree(i32),
    /// Whether this process has more rights than its owner was asked.
    PrivilegeOf(i32),
    /// This process's resident size was read.
    Rss(i32),
    /// The job's processes were looked at for a stopped one.
    Stopped,
    /// A shim was started: a restore's (behind a gate or not) or a launch's.
    SpawnShim {
        /// It runs the engine's restore.
        restore: bool,
        /// The restore waits at a gate for the agent's verdict.
        gated: bool,
    },
    /// A fake engine dumped the tree.
    Dump,
    /// A fake engine was asked for its restore command.
    RestoreArgv,
}

impl Call {
    /// Whether the call changes the job (a freeze, thaw, kill, dump, or a shim started): the
    /// calls order-of-steps tests compare, without the reads between them.
    pub(crate) fn acts(&self) -> bool {
        matches!(
            self,
            Call::Freeze
                | Call::FreezeForSnapshot
                | Call::Thaw
                | Call::KillAll
                | Call::SpawnShim { .. }
                | Call::Dump
                | Call::RestoreArgv
        )
    }
}

/// The calls, in order, shared by the fake host and a fake engine.
pub(crate) type Log = Arc<Mutex<Vec<Call>>>;

/// A door a scripted call waits at until the test opens it.
#[derive(Debug, Default)]
pub(crate) struct Latch {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Latch {
    /// Lets every waiter through, now and later.
    pub(crate) fn open(&self) {
        *self.open.lock().expect("latch lock") = true;
        self.opened.notify_all();
    }

    /// Whether the latch is open.
    pub(crate) fn is_open(&self) -> bool {
        *self.open.lock().expect("latch lock")
    }

    /// Waits until the latch is open (at most a minute, so that a failed test ends).
    pub(crate) fn wait(&self) {
        let open = self.open.lock().expect("latch lock");
        let _ = self
            .opened
            .wait_timeout_while(open, Duration::from_secs(60), |o| !*o)
            .expect("latch lock");
    }
}

/// What a scripted step does.
#[derive(Debug, Clone, Default)]
pub(crate) enum Step {
    /// It succeeds at once.
    #[default]
    Succeed,
    /// It fails, as a freeze does that is still not done after the cgroup's timeout.
    Stuck,
    /// It waits at the latch, then succeeds.
    Hang(Arc<Latch>),
}

/// What the fake's host looks like, and how its steps answer.
#[derive(Debug)]
struct State {
    /// The job cgroup's members.
    members: Vec<i32>,
    /// Whether the cgroup is frozen.
    frozen: bool,
    /// How freezes for a snapshot answer.
    freeze: Step,
    /// How thaws answer.
    thaw: Step,
    /// Processes outside the tree.
    outside: Vec<ProcStat>,
    /// Processes with more rights than their owner, and why.
    privileged: BTreeMap<i32, String>,
    /// Processes stopped (state T).
    stopped: Vec<i32>,
    /// Resident bytes of each process.
    rss: u64,
    /// The PID the shim's restores report, or why the engine failed.
    restores: Result<i32, String>,
}

/// The PID a restore reports by default: above any PID the kernel gives (its limit is
/// 4,194,304), so no real process is ever taken for it.
pub(crate) const RESTORED_PID: i32 = 5_000_100;

/// The recording fake (see the module's documentation).
#[derive(Debug)]
pub(crate) struct FakeHost {
    log: Log,
    state: Arc<Mutex<State>>,
}

impl FakeHost {
    /// A host whose job has no processes, noting calls into `log`.
    pub(crate) fn new(log: Log) -> Self {
        FakeHost {
            log,
            state: Arc::new(Mutex::new(State {
                members: Vec::new(),
                frozen: false,
                freeze: Step::Succeed,
                thaw: Step::Succeed,
                outside: Vec::new(),
                privileged: BTreeMap::new(),
                stopped: Vec::new(),
                rss: 1 << 20,
                restores: Ok(RESTORED_PID),
            })),
        }
    }

    fn note(&self, call: Call) {
        self.log.lock().expect("log lock").push(call);
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().expect("fake host lock"))
    }

    /// Makes `pids` the job cgroup's members (thawed).
    pub(crate) fn run(&self, pids: &[i32]) {
        self.with(|s| {
            s.members = pids.to_vec();
            s.frozen = false;
        });
    }

    /// The job cgroup's members.
    pub(crate) fn members(&self) -> Vec<i32> {
        self.with(|s| s.members.clone())
    }

    /// Whether the job's cgroup is frozen.
    pub(crate) fn frozen(&self) -> bool {
        self.with(|s| s.frozen)
    }

    /// Sets how freezes for a snapshot answer.
    pub(crate) fn script_freeze(&self, step: Step) {
        self.with(|s| s.freeze = step);
    }

    /// Sets how thaws answer.
    pub(crate) fn script_thaw(&self, step: Step) {
        self.with(|s| s.thaw = step);
    }

    /// Puts process `pid` (`comm`) outside the job's tree.
    pub(crate) fn script_outside(&self, pid: i32, comm: &str) {
        self.with(|s| {
            s.outside.push(ProcStat {
                pid,
                comm: comm.into(),
                state: 'S',
                ppid: 1,
                start_ticks: 1,
            })
        });
    }

    /// Gives process `pid` more rights than its owner, for `why`.
    pub(crate) fn script_privileged(&self, pid: i32, why: &str) {
        self.with(|s| s.privileged.insert(pid, why.into()));
    }

    /// Stops process `pid` (state T), or continues it (`false`).
    pub(crate) fn script_stopped(&self, pid: i32, stopped: bool) {
        self.with(|s| {
            s.stopped.retain(|&p| p != pid);
            if stopped {
                s.stopped.push(pid);
            }
        });
    }

    /// Makes the engine's restores fail with `why`.
    pub(crate) fn script_restore_fails(&self, why: &str) {
        self.with(|s| s.restores = Err(why.into()));
    }

    /// The calls so far, in order.
    pub(crate) fn calls(&self) -> Vec<Call> {
        self.log.lock().expect("log lock").clone()
    }

    /// The calls so far that change the job ([`Call::acts`]), in order.
    pub(crate) fn actions(&self) -> Vec<Call> {
        self.actions_since(0)
    }

    /// How many calls were made so far: a mark for [`FakeHost::actions_since`].
    pub(crate) fn mark(&self) -> usize {
        self.log.lock().expect("log lock").len()
    }

    /// The calls that change the job made since `mark`, in order.
    pub(crate) fn actions_since(&self, mark: usize) -> Vec<Call> {
        let calls = self.calls();
        calls
            .get(mark..)
            .unwrap_or_default()
            .iter()
            .filter(|c| c.acts())
            .cloned()
            .collect()
    }

    /// A failure of the freezer on `cgroup`, as the cgroup's timeout reports it.
    fn stuck(cgroup: &JobCgroup, wanted: Freezer) -> CgroupError {
        let state = match wanted {
            Freezer::Thawed => Freezer::Frozen,
            _ => Freezer::Freezing,
        };
        CgroupError::Stuck {
            path: cgroup.path().to_path_buf(),
            state: state.name().into(),
            wanted: wanted.name(),
            waited: crate::os::cgroup::FREEZE_TIMEOUT,
            tasks: "pid 1 (fake) state D in fake_wait".into(),
        }
    }
}

impl Host for FakeHost {
    fn pids(&self, _cgroup: &JobCgroup) -> Result<Vec<i32>, CgroupError> {
        self.note(Call::Pids);
        Ok(self.members())
    }

    fn cgroup_exists(&self, _cgroup: &JobCgroup) -> bool {
        self.note(Call::Exists);
        true
    }

    fn freezer_state(&self, _cgroup: &JobCgroup) -> Result<Freezer, CgroupError> {
        self.note(Call::State);
        Ok(if self.frozen() {
            Freezer::Frozen
        } else {
            Freezer::Thawed
        })
    }

    fn freeze(&self, _cgroup: &JobCgroup) -> Result<(), CgroupError> {
        self.note(Call::Freeze);
        self.with(|s| s.frozen = true);
        Ok(())
    }

    fn freeze_for_snapshot(&self, cgroup: &JobCgroup) -> Result<u32, CgroupError> {
        self.note(Call::FreezeForSnapshot);
        // A freeze that does not finish leaves the cgroup freezing, not thawed.
        self.with(|s| s.frozen = true);
        match self.with(|s| s.freeze.clone()) {
            Step::Succeed => Ok(0),
            Step::Stuck => Err(Self::stuck(cgroup, Freezer::Frozen)),
            Step::Hang(latch) => {
                latch.wait();
                Ok(0)
            }
        }
    }

    fn thaw(&self, cgroup: &JobCgroup) -> Result<(), CgroupError> {
        self.note(Call::Thaw);
        match self.with(|s| s.thaw.clone()) {
            Step::Succeed => {}
            Step::Stuck => return Err(Self::stuck(cgroup, Freezer::Thawed)),
            Step::Hang(latch) => latch.wait(),
        }
        self.with(|s| s.frozen = false);
        Ok(())
    }

    fn kill_all(&self, _cgroup: &JobCgroup) -> Result<(), CgroupError> {
        self.note(Call::KillAll);
        self.with(|s| {
            s.members.clear();
            s.frozen = false;
        });
        Ok(())
    }

    fn outside_tree(&self, root: i32, pids: &[i32]) -> Vec<ProcStat> {
        self.note(Call::OutsideTree(root));
        self.with(|s| {
            s.outside
                .iter()
                .filter(|p| pids.contains(&p.pid))
                .cloned()
                .collect()
        })
    }

    fn privilege_of(&self, pid: i32, _owner: u32) -> Option<String> {
        self.note(Call::PrivilegeOf(pid));
        self.with(|s| s.privileged.get(&pid).cloned())
    }

    fn stopped(&self, pids: &[i32]) -> Option<ProcStat> {
        self.note(Call::Stopped);
        self.with(|s| {
            pids.iter()
                .find(|p| s.stopped.contains(p))
                .map(|&pid| ProcStat {
                    pid,
                    comm: "stopped".into(),
                    state: 'T',
                    ppid: 1,
                    start_ticks: 1,
                })
        })
    }

    fn rss_bytes(&self, pid: i32) -> u64 {
        self.note(Call::Rss(pid));
        self.with(|s| s.rss)
    }

    fn tcp_connections(&self, _pids: &[i32]) -> Vec<(std::net::SocketAddr, std::net::SocketAddr)> {
        Vec::new()
    }

    fn spawn_shim(
        &self,
        _exe: &Path,
        spec: &Path,
        _output: (fs::File, fs::File),
        ready_fd: RawFd,
    ) -> std::io::Result<Option<(i32, u64)>> {
        let spec: ShimSpec = shim::read_json(spec).ok_or_else(|| {
            std::io::Error::other(format!("unreadable shim spec {}", spec.display()))
        })?;
        let gate = match &spec.mode {
            ShimMode::Restore { gate, .. } => gate.clone(),
            ShimMode::Launch { .. } => None,
        };
        let restore = matches!(spec.mode, ShimMode::Restore { .. });
        self.note(Call::SpawnShim {
            restore,
            gated: gate.is_some(),
        });
        let outcome = self.with(|s| s.restores.clone());
        let Some(gate) = gate else {
            // Written before the agent closes its end of the pipe: its end-of-file finds it.
            report(&self.state, &spec.run_dir, outcome);
            return Ok(None);
        };
        // Behind the gate, as the engine's action script: the agent's verdict first, in a
        // thread of its own (the agent decides while it waits for the shim). The pipe's write
        // end stays open in this "shim" until it has reported.
        // SAFETY: dup of a descriptor the agent holds open across this call; the copy is ours.
        let held = unsafe { libc::dup(ready_fd) };
        if held < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the descriptor just returned by dup, owned by nothing else.
        let held = unsafe { OwnedFd::from_raw_fd(held) };
        let state = Arc::clone(&self.state);
        std::thread::spawn(move || {
            let outcome = match crate::restore::gate::wait_verdict(&gate) {
                Ok(()) => outcome,
                Err(e) => Err(format!("the restore gate refused: {e}")),
            };
            report(&state, &spec.run_dir, outcome);
            drop(held);
        });
        Ok(None)
    }
}

/// What the shim reports in `run_dir`: the restored root (the cgroup's one member, frozen, as
/// the engine leaves it), or why the engine failed.
fn report(state: &Mutex<State>, run_dir: &Path, outcome: Result<i32, String>) {
    let started = match outcome {
        Ok(pid) => {
            let mut s = state.lock().expect("fake host lock");
            s.members = vec![pid];
            s.frozen = true;
            Started::Running { root_pid: pid }
        }
        Err(error) => Started::Failed { error },
    };
    let bytes = serde_json::to_vec(&started).expect("serializable");
    fs::write(run_dir.join(shim::STARTED), bytes).expect("write started.json");
}
