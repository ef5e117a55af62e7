//! The command line: every subcommand, its flags and the help that teaches them.
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::client;

const AFTER_HELP: &str = "\
Examples:
  JOB=$(ckptctl run --name heat -- mpiexec -n 4 ./heat 512 4000)
  ckptctl checkpoint $JOB --wait        # consistent snapshot; the job keeps running
  ckptctl checkpoint $JOB --kill        # snapshot, then stop the job (preemption)
  ckptctl restart $JOB                  # from the latest committed epoch
  ckptctl restart $JOB --epoch 1        # from an older one
  ckptctl run --every 30m -- mpiexec …  # a checkpoint every 30 minutes (or --every auto)
  ckptctl policy $JOB --every off       # stop periodic checkpoints
  ckptctl status $JOB · ckptctl epochs $JOB · ckptctl list
  ckptctl status · ckptctl nodes         # the cluster: nodes up and down, spares, jobs

Exit codes:
  0 success            1 internal error          2 bad arguments
  3 job not found      4 not allowed in the job's current state
  5 permission denied  6 checkpoint or restart failed (epoch aborted; job unharmed)
  7 ckptd or an agent unreachable                 8 image corrupt or missing
  9 a deadline passed  10 out of room: staging full, no spare free, or a [limits] reached";

/// Checkpoint and restart MPI jobs with ckpt.
///
/// Talks to ckptd over its Unix socket; you may act on your own jobs (root on all).
#[derive(Parser, Debug)]
#[command(version, about, long_about, after_help = AFTER_HELP)]
pub struct Cli {
    /// ckptd's control socket; a comma-separated list tries each in turn (an active ckptd
    /// and its standbys on this machine: only the active one serves).
    #[arg(long, global = true, env = "CKPT_SOCKET", default_value = client::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Print machine-readable JSON on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Start a job under ckpt (or resume it); prints its JOBID on stdout.
    ///
    /// The command runs on a node's agent with your uid, environment and working directory;
    /// its stdout and stderr go to files in the job directory (shown on stderr).
    ///
    /// In a batch script (docs/operations.md, "Batch jobs"): `ckptctl run --name NAME --resume
    /// --checkpoint-on USR1,TERM -- mpiexec ...` starts the job, or restarts it from its latest
    /// checkpoint when the script was requeued; it waits for the job's end and exits with its
    /// status, or checkpoints and stops the job on those signals and exits 75.
    Run(RunArgs),
    /// Take a coordinated checkpoint of a running job.
    Checkpoint {
        /// Job id.
        job: u64,
        /// Wait until the epoch is committed (or failed) and show progress.
        #[arg(long)]
        wait: bool,
        /// Stop the job once the snapshot is taken (implies --wait).
        #[arg(long)]
        kill: bool,
    },
    /// Restart a job whose processes are gone from a committed epoch.
    Restart {
        /// Job id.
        job: u64,
        /// Epoch to restart from (default: the latest committed).
        #[arg(long)]
        epoch: Option<u32>,
        /// Restart on these nodes: the epoch's nodes, in the order `ckptctl status` lists
        /// them, are replaced one for one (e.g. `--nodes n4,n2,n3`). Only a job that ran in
        /// sandboxes (a job network, docs/operations.md) can move; exit 2 for a wrong count,
        /// 3 for a node without an agent, 4 for a node that cannot take the part.
        #[arg(long, value_delimiter = ',', conflicts_with = "map")]
        nodes: Vec<String>,
        /// Move single parts: `--map n3=n4` restarts n3's part on n4, the others where they
        /// ran (repeat for more).
        #[arg(long, value_name = "OLD=NEW")]
        map: Vec<String>,
        /// Put the part of every node of the epoch that is down (no heartbeat for
        /// ckptd.toml `node_timeout`) on a free spare (ckptd.toml `[spares]`); the others
        /// restart where they ran. With spares configured, a restart without --nodes or --map
        /// does this too. Exit 10 when too few spares are free.
        #[arg(long, conflicts_with_all = ["nodes", "map"])]
        on_spares: bool,
        /// Nodes you know are down for good (powered off, or their ckpt-agent and the job's
        /// processes stopped). A job run without `--on-failure restart` is not fenced: a node
        /// cut off from ckptd keeps running its part, so ckptd moves a part off a node it
        /// cannot reach only when that node is named here (exit 4 otherwise).
        #[arg(long, value_delimiter = ',', value_name = "NODE")]
        down: Vec<String>,
    },
    /// Empty a node being reclaimed: checkpoint and stop its jobs, or move them (root only).
    ///
    /// Checkpoints and stops every running job with a part on NODE (as `checkpoint --kill`
    /// does); with --migrate, restarts each at once with that part on a free spare (ckptd.toml
    /// `[spares]`). A job that cannot be checkpointed keeps running; one that cannot be
    /// migrated stays stopped and restorable. Exit 0 when every job was handled, else the code
    /// of the first failure.
    Drain {
        /// The node to empty.
        node: String,
        /// Restart the jobs on spares at once.
        #[arg(long)]
        migrate: bool,
    },
    /// Show or change when ckptd checkpoints a job by itself.
    ///
    /// Without options, shows the job's policy: the interval, how `auto` chose it, and when the
    /// next checkpoint is due. Periodic checkpoints are skipped while another checkpoint or a
    /// restart of the job runs, and survive a ckptd restart.
    Policy {
        /// Job id.
        job: u64,
        /// Checkpoint every INTERVAL (`30m`, `2h`, `90s`), `auto`, or `off`.
        #[arg(long, value_name = "INTERVAL")]
        every: Option<String>,
        /// Take a final checkpoint and stop the job so that it is durable before TIME
        /// (`08:00`, `tomorrow 08:00`, `2026-11-25 08:00`, `+90m`), or `off`. Refused when
        /// TIME is too close for a checkpoint (see `ckptctl estimate`).
        #[arg(long, value_name = "TIME")]
        deadline: Option<String>,
    },
    /// Predict how long a checkpoint of a job takes now: frozen, to commit, to durable.
    ///
    /// From the job's resident memory per node now and the times of its earlier checkpoints
    /// (or, for a job with fewer than two, recent checkpoints of any job); shows how far off
    /// the same prediction was on the job's last epochs, and how long before a deadline its
    /// final checkpoint would start.
    Estimate {
        /// Job id.
        job: u64,
    },
    /// Show a job, its nodes and processes; without a job, the cluster in a few lines.
    ///
    /// Without a job: nodes up, down and absent, spares free, your live and ended jobs (root:
    /// everyone's). With one: its state, epochs, restarts by itself, and each node's part.
    Status {
        /// Job id.
        job: Option<u64>,
    },
    /// List every node ckptd knows, with its state, spare, staging space and jobs.
    ///
    /// State: up; down since its last heartbeat, after ckptd.toml `node_timeout`; absent: a
    /// spare or a job's node whose agent has not registered. Also spare and free, heartbeat
    /// age, agent version, snapshot engines, RDMA devices, free staging space, the live jobs
    /// with a part there (yours by id, others' counted; root sees all), and the agent's
    /// address. Any user may list nodes.
    Nodes,
    /// List jobs (yours; root sees all).
    List,
    /// Show a job's checkpoint epochs and the restarts from each.
    ///
    /// For each epoch: state, storage (local, flushing with progress, durable = also in shared
    /// storage, shared-only, flush-failed), which copies exist (local, partner, shared), frozen
    /// time, size, who asked, failure reason; under it, every restart from it (by hand, by a
    /// drain, by ckptd itself) with its trigger, moves and outcome.
    Epochs {
        /// Job id.
        job: u64,
    },
    /// Kill a running job (SIGTERM, then SIGKILL). Its checkpoints stay restorable.
    ///
    /// A job that is stopped, killed or lost (one `ckptctl restart` would bring back, or ckptd
    /// is about to restart by itself) is given up instead: it gives back its job addresses and
    /// is not restarted by itself. It can still be restarted by hand from its checkpoints.
    Cancel {
        /// Job id.
        job: u64,
    },
    /// Slurm's epilog: stop what is left of an ended batch job's `run --slurm` program.
    ///
    /// For `EpilogSlurmctld` in slurm.conf (run by slurmctld as root, with SLURM_JOB_ID and
    /// SLURM_JOB_UID set; docs/slurm.md): a program of that batch job that still runs (its
    /// ckptctl was killed outright, or its batch host died) is checkpointed and stopped, so
    /// that a requeued batch job resumes it and a cancelled one leaves no processes; if the
    /// checkpoint fails, it is cancelled. Does nothing for a program that already ended.
    SlurmEpilog,
    /// Check a committed checkpoint's images on every node against their digests.
    ///
    /// Reads only: the local copy, and the shared one for a durable epoch. Exit 0 if every
    /// node has an intact copy (a damaged one is reported), 8 if a node has none, 7 if a node
    /// could not be reached.
    Verify {
        /// Job id.
        job: u64,
        /// Epoch to check (default: the latest committed).
        #[arg(long)]
        epoch: Option<u32>,
    },
    /// Print ckptctl's tab completion for a shell (bash, zsh, fish, elvish, powershell).
    ///
    /// The ckpt-client package installs them. By hand, for bash:
    /// `ckptctl completions bash > /etc/bash_completion.d/ckptctl` (or source it from
    /// ~/.bashrc); zsh: a file `_ckptctl` in a directory of `$fpath`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write ckptctl's manual pages (ckptctl.1, ckptctl-run.1, ...) into DIR, for packaging.
    #[command(hide = true)]
    Manual {
        /// Where to write the pages (made if missing).
        dir: PathBuf,
    },
}

/// `ckptctl run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Job name (default: the command's file name).
    #[arg(long)]
    pub name: Option<String>,
    /// Node to start the command on (default: the first registered).
    #[arg(long)]
    pub node: Option<String>,
    /// Snapshot engine: `criu` (the default: any job, InfiniBand included, on any number of
    /// nodes) or `dmtcp` (DMTCP must be installed on the node; the job runs under
    /// `dmtcp_launch` with a DMTCP coordinator of its own, on one node, over TCP or shared
    /// memory). Refused at once when the node lacks it; see docs/dmtcp.md.
    #[arg(long, value_name = "ENGINE")]
    pub engine: Option<String>,
    /// Run MPI over InfiniBand/RoCE verbs in a way ckpt can checkpoint: sets, unless your
    /// environment has them, OMPI_MCA_pml=ucx OMPI_MCA_pml_ucx_devices=any
    /// OMPI_MCA_pml_ucx_tls=any OMPI_MCA_btl=^openib,ofi OMPI_MCA_mtl=^ofi OMPI_MCA_osc=^ucx
    /// UCX_TLS=rc_verbs,ud_verbs,sm,self UCX_UD_VERBS_ETH_DGID_CHECK=n UCX_MODULES=^rdmacm,
    /// and gives them to the job's processes on other nodes too. The agents preload the
    /// verbs layer on nodes with RDMA devices either way (docs/infiniband.md).
    #[arg(long)]
    pub rdma: bool,
    /// Checkpoint the job every INTERVAL while it runs (`30m`, `2h`, `90s`), counted from
    /// its start and from the end of its last checkpoint; `auto` derives the interval from
    /// the cost of its checkpoints and the nodes' MTBF (ckptd.toml `[policy]`). Change it
    /// later with `ckptctl policy`.
    #[arg(long, value_name = "INTERVAL")]
    pub every: Option<String>,
    /// Take a final checkpoint and stop the job so that it is durable before TIME (`08:00`,
    /// `tomorrow 08:00`, `2026-11-25 08:00`, `+90m`): it starts 1.5 times the estimated time
    /// to durable plus ckptd.toml `policy.deadline_margin` before TIME. Resume the job later
    /// with `--resume`.
    #[arg(long, value_name = "TIME")]
    pub deadline: Option<String>,
    /// When the job fails (a node of it lost, a process of it killed by a signal ckpt did not
    /// send): `stop` (it waits for you to `ckptctl restart` it), `restart` or `restart:N` (ckptd
    /// restarts it from its latest committed checkpoint by itself, the parts of lost nodes on
    /// free spares, at most N times, 3 by default, waiting longer before each; never again once
    /// it fails before a checkpoint commits after such a restart). Needs job sandboxes
    /// (ckptd.toml `[job_network]`). Default: ckptd.toml `[recovery] on_failure`.
    #[arg(long, value_name = "POLICY")]
    pub on_failure: Option<String>,
    /// How the job's checkpoints survive lost nodes before shared storage has them: `partner`
    /// (a full copy on the next node), `xor:G` (XOR parity over groups of G nodes: one lost
    /// node per group), `rs:K+M` (Reed-Solomon: any M lost nodes per group of K+M) or `none`.
    /// Default: ckptd.toml `[redundancy] scheme` (docs/operations.md, "Choosing a redundancy
    /// scheme").
    #[arg(long, value_name = "SCHEME")]
    pub redundancy: Option<String>,
    /// Follow the job to its end and exit with its status: its exit code, 128+N when signal
    /// N killed it, 75 (EX_TEMPFAIL: try again later) when ckpt stopped it after a checkpoint
    /// (`checkpoint --kill`, `drain`, `--checkpoint-on`) or its node was lost, so that a
    /// batch script requeues itself; 143 when it was cancelled.
    #[arg(long)]
    pub wait: bool,
    /// Restart your latest job called NAME (`--name`) from its latest committed checkpoint
    /// when its processes are gone; start it fresh when it has none. Refused (exit 4) while
    /// that job still runs, and (exit 5) when NAME is another user's job. Inside a Slurm job
    /// (SLURM_JOB_ID and SLURM_JOB_NODELIST set) the job restarts on that allocation: a part
    /// that ran on one of its nodes stays there, the others take its unused nodes in order
    /// (this needs a job that ran in sandboxes; refused, exit 2, when the allocation has fewer
    /// nodes than the job has parts).
    #[arg(long, requires = "name")]
    pub resume: bool,
    /// On any of these signals (`USR1`, `TERM`, ...; comma-separated), checkpoint the job and
    /// stop it (as `checkpoint --kill`), then exit 75. Implies --wait. With Slurm:
    /// `#SBATCH --signal=B:USR1@120` warns two minutes before the time limit; preemption and
    /// `scontrol requeue` send TERM.
    #[arg(long, value_delimiter = ',', value_name = "SIGNALS")]
    pub checkpoint_on: Vec<String>,
    /// Inside a Slurm batch script, what a requeueable job needs, in one option
    /// (docs/slurm.md): the job is called `slurm-$SLURM_JOB_ID` (unless --name), its command
    /// starts on the batch host ($SLURMD_NODENAME, unless --node) and resumes from its latest
    /// checkpoint when the batch job runs again (as --resume, on the new allocation); USR1 or
    /// TERM checkpoint and stop it (unless --checkpoint-on); a final checkpoint makes it
    /// durable before the job's time limit (as --deadline, from `scontrol show job`'s EndTime,
    /// unless --deadline); and once ckpt has stopped it (exit 75) on anything but Slurm's own
    /// TERM (USR1, the deadline, a drain), ckptctl asks Slurm to requeue the batch job
    /// (`scontrol requeue`): after a preemption or `scontrol requeue` Slurm requeues it
    /// itself, and after `scancel` it ends. Start it with `exec`, so that the signals of
    /// `#SBATCH --signal=B:USR1@120`, Slurm's preemption and scancel reach it.
    #[arg(long)]
    pub slurm: bool,
    /// The command, usually `mpiexec ...`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}
