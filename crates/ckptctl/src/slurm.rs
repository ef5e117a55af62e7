//! Inside a Slurm job: the allocation a resumed job restarts on (`run --resume`), read from
//! the environment Slurm gives every batch script and step (`SLURM_JOB_ID`,
//! `SLURM_JOB_NODELIST`); and `run --slurm`, what a requeueable batch job needs in one option.
use std::process::Command;

use ckpt_proto::v1 as pb;

use crate::cli::RunArgs;

/// More node names than a host list of a real allocation expands to: a guard against a list
/// like `n[0-999999999]`.
const MOST_NODES: usize = 1 << 20;

/// The allocation of the Slurm job this ckptctl runs in, or `None` outside one.
pub fn allocation() -> Result<Option<pb::Allocation>, String> {
    let (Ok(id), Ok(list)) = (
        std::env::var("SLURM_JOB_ID"),
        std::env::var("SLURM_JOB_NODELIST"),
    ) else {
        return Ok(None);
    };
    let nodes =
        expand(&list).map_err(|e| format!("SLURM_JOB_NODELIST={list:?} of Slurm job {id}: {e}"))?;
    Ok(Some(pb::Allocation {
        name: format!("Slurm job {id}"),
        nodes,
    }))
}

/// The Slurm batch job `run --slurm` runs in.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// `SLURM_JOB_ID`.
    pub job_id: String,
    /// Whether `--deadline` came from the job's end time (and may be dropped if too close).
    pub deadline_from_slurm: bool,
}

/// `run --slurm`: fills in what the batch job gives (the name, the batch host, the signals,
/// the deadline from the time limit) where the command line did not, and says what it set.
pub fn prepare(a: &mut RunArgs, json: bool) -> Result<Batch, String> {
    let job_id = std::env::var("SLURM_JOB_ID").map_err(|_| {
        "--slurm: not inside a Slurm job (SLURM_JOB_ID is not set): use it in a batch script \
         run by sbatch, or leave --slurm out"
            .to_string()
    })?;
    if job_id.is_empty() || !job_id.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "--slurm: SLURM_JOB_ID={job_id:?} is not a Slurm job id"
        ));
    }
    let name = a
        .name
        .get_or_insert_with(|| format!("slurm-{job_id}"))
        .clone();
    if a.node.is_none() {
        a.node = std::env::var("SLURMD_NODENAME")
            .ok()
            .filter(|n| !n.is_empty());
    }
    a.resume = true;
    if a.checkpoint_on.is_empty() {
        a.checkpoint_on = vec!["USR1".into(), "TERM".into()];
    }
    let mut deadline_from_slurm = false;
    if a.deadline.is_none() {
        a.deadline = end_time(&job_id)?;
        deadline_from_slurm = a.deadline.is_some();
    }
    if !json {
        let end = match (&a.deadline, deadline_from_slurm) {
            (Some(t), true) => format!("a final checkpoint before its time limit ({t})"),
            (Some(t), false) => format!("a final checkpoint before {t}"),
            (None, _) => "no time limit".into(),
        };
        say_err!(
            "ckptctl: Slurm job {job_id}: ckpt job {:?}, launched on {}; {} checkpoint and \
             stop it, {end}; requeued when stopped, unless by Slurm's TERM",
            crate::term::field(&name),
            a.node.as_deref().unwrap_or("the first node"),
            a.checkpoint_on.join(" or "),
        );
    }
    Ok(Batch {
        job_id,
        deadline_from_slurm,
    })
}

/// The end of Slurm job `job_id`'s time limit, as `--deadline` takes it; `None` without one.
fn end_time(job_id: &str) -> Result<Option<String>, String> {
    let out = Command::new("scontrol")
        .args(["show", "job", "-o", job_id])
        .output()
        .map_err(|e| {
            format!("--slurm: cannot run scontrol ({e}): is Slurm's client installed here?")
        })?;
    if !out.status.success() {
        return Err(format!(
            "--slurm: `scontrol show job {job_id}` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(end_of(&String::from_utf8_lossy(&out.stdout)))
}

/// From a line of `scontrol show job -o`: `EndTime` as `YYYY-MM-DD HH:MM:SS` (scontrol's local
/// time, as `--deadline` reads it), unless the job has no time limit or the end is unknown.
fn end_of(line: &str) -> Option<String> {
    match field(line, "TimeLimit") {
        None | Some("UNLIMITED" | "INFINITE" | "Partition_Limit") => return None,
        Some(_) => {}
    }
    let (date, clock) = field(line, "EndTime")?.split_once('T')?;
    let shaped = |s: &str, sep: u8, parts: usize| {
        s.split(sep as char).count() == parts && s.bytes().all(|b| b.is_ascii_digit() || b == sep)
    };
    (shaped(date, b'-', 3) && shaped(clock, b':', 3)).then(|| format!("{date} {clock}"))
}

/// A `KEY=VALUE` of a line of `scontrol show job -o`.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// Asks Slurm to requeue the batch job once ckpt stopped its program (`scontrol requeue`),
/// unless Slurm's TERM stopped it (`signal`): after a preemption or `scontrol requeue` Slurm
/// requeues the job itself, and after `scancel` (TERM too, and Slurm would still take a
/// requeue then) the job is to end. Slurm refusing is said, not an error.
pub fn requeue(b: &Batch, signal: Option<&str>) {
    let id = &b.job_id;
    if signal == Some("SIGTERM") {
        say_err!(
            "ckptctl: stopped on Slurm's TERM: not asking for a requeue (after a preemption or \
             `scontrol requeue` Slurm requeues job {id} itself; after scancel it ends)"
        );
        return;
    }
    say_err!("ckptctl: asking Slurm to requeue job {id} (`scontrol requeue {id}`)");
    match Command::new("scontrol").args(["requeue", id]).output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => say_err!(
            "ckptctl: scontrol requeue {id}: {} (a job Slurm preempted or requeued is requeued already)",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => say_err!("ckptctl: cannot run scontrol to requeue job {id}: {e}"),
    }
}

/// `ckptctl slurm-epilog`: the programs of the ended batch job SLURM_JOB_ID (named as `run
/// --slurm` names them, owned by SLURM_JOB_UID) that still run are checkpointed and stopped,
/// or cancelled if that fails.
pub async fn epilog(
    c: &mut ckpt_proto::v1::control_client::ControlClient<tonic::transport::Channel>,
    json: bool,
) -> Result<(), crate::Failure> {
    let env = |k: &str| {
        std::env::var(k).map_err(|_| crate::Failure {
            code: 2,
            message: format!(
                "slurm-epilog: {k} is not set: run it as Slurm's EpilogSlurmctld (docs/slurm.md)"
            ),
        })
    };
    let (id, uid) = (env("SLURM_JOB_ID")?, env("SLURM_JOB_UID")?);
    let uid: u32 = uid.parse().map_err(|_| crate::Failure {
        code: 2,
        message: format!("slurm-epilog: SLURM_JOB_UID={uid:?} is not a uid"),
    })?;
    let name = format!("slurm-{id}");
    let jobs = c
        .list(pb::ListRequest { all_users: true })
        .await?
        .into_inner()
        .jobs;
    use pb::JobStateKind as K;
    let live = jobs.into_iter().filter(|j| {
        j.name == name
            && j.owner_uid == uid
            && matches!(
                j.state_kind(),
                K::Starting | K::Running | K::Checkpointing | K::Restarting
            )
    });
    for j in live {
        say_err!(
            "ckptctl: Slurm job {id} ended with job {} ({name}) still running",
            j.id
        );
        // As on a signal: a checkpoint in progress (the batch job killed during its last one)
        // is waited for, not cut short.
        let why = format!("the end of Slurm job {id}");
        match crate::stop::checkpoint_and_stop(c, j.id, &why, json).await {
            Err(f) if f.code == crate::stop::STOPPED => {}
            Ok(()) => {}
            Err(f) => {
                say_err!("ckptctl: job {}: {}; cancelling it", j.id, f.message);
                if let Err(s) = c.cancel(pb::CancelRequest { job_id: j.id }).await {
                    say_err!("ckptctl: job {}: {}", j.id, s.message());
                }
            }
        }
    }
    Ok(())
}

/// Slurm's compressed host list (`n[1-3,07],login1`, as in `SLURM_JOB_NODELIST`) as names,
/// in its order, as `scontrol show hostnames` gives them: a range keeps the width of its first
/// bound (`n[08-10,3]`: n08, n09, n10, n3); a name may have several bracketed parts
/// (`r[1-2]n[1-2]`).
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for term in split_top(list, ',')? {
        let term = term.trim();
        if term.is_empty() {
            continue;
        }
        expand_term(term, &mut out)?;
    }
    if out.is_empty() {
        return Err("names no node".into());
    }
    Ok(out)
}

/// Splits `s` at `sep` outside brackets.
fn split_top(s: &str, sep: char) -> Result<Vec<&str>, String> {
    let (mut depth, mut start, mut parts) = (0usize, 0usize, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested '[' at byte {i}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("']' without '[' at byte {i}")),
            c if c == sep && depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '[' is not closed".into());
    }
    parts.push(&s[start..]);
    Ok(parts)
}

/// Appends the names of one host term (`n[1-3]x`, `login1`) to `out`.
fn expand_term(term: &str, out: &mut Vec<String>) -> Result<(), String> {
    let Some(open) = term.find('[') else {
        if out.len() >= MOST_NODES {
            return Err(format!("expands to more than {MOST_NODES} names"));
        }
        out.push(term.to_string());
        return Ok(());
    };
    let close = open + term[open..].find(']').ok_or("a '[' is not closed")?;
    let (prefix, ranges, rest) = (&term[..open], &term[open + 1..close], &term[close + 1..]);
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let (lo, hi) = (lo.trim(), hi.trim());
        let number = |s: &str| {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!(
                    "{range:?} in {term:?} is not a number or a range N-M"
                ));
            }
            s.parse::<u64>()
                .map_err(|e| format!("{s:?} in {term:?}: {e}"))
        };
        let (a, b) = (number(lo)?, number(hi)?);
        if a > b {
            return Err(format!("the range {range:?} in {term:?} runs backwards"));
        }
        if b - a >= MOST_NODES as u64 {
            return Err(format!("expands to more than {MOST_NODES} names"));
        }
        for i in a..=b {
            let name = format!("{prefix}{i:0width$}{rest}", width = lo.len());
            expand_term(&name, out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{end_of, expand};

    #[test]
    fn the_deadline_is_the_end_of_the_time_limit_and_none_without_one() {
        let line = |limit: &str, end: &str| {
            format!("JobId=42 JobName=heat UserId=ann(1000) JobState=RUNNING RunTime=00:00:05 TimeLimit={limit} TimeMin=N/A SubmitTime=2026-12-01T01:00:00 StartTime=2026-12-01T01:00:01 EndTime={end} Deadline=N/A Command=/home/ann/heat.sbatch")
        };
        assert_eq!(
            end_of(&line("00:30:00", "2026-12-01T01:30:01")).as_deref(),
            Some("2026-12-01 01:30:01")
        );
        for (limit, end) in [
            ("UNLIMITED", "2027-12-01T01:00:01"),
            ("INFINITE", "2027-12-01T01:00:01"),
            ("00:30:00", "Unknown"),
            ("00:30:00", "2026-12-01"),
            ("00:30:00", "2026-12-01T01:30"),
        ] {
            assert_eq!(end_of(&line(limit, end)), None, "{limit} {end}");
        }
        assert_eq!(
            end_of("JobId=42 EndTime=2026-12-01T01:30:01"),
            None,
            "no TimeLimit"
        );
    }

    fn names(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    #[test]
    fn a_host_list_expands_as_scontrol_show_hostnames_does() {
        assert_eq!(names("n1"), ["n1"]);
        assert_eq!(names("n[1-3]"), ["n1", "n2", "n3"]);
        assert_eq!(names("n[2-3],n7,login1"), ["n2", "n3", "n7", "login1"]);
        // Each range keeps the width of its own first bound.
        assert_eq!(names("n[08-10,3]"), ["n08", "n09", "n10", "n3"]);
        assert_eq!(names("n[001-003]"), ["n001", "n002", "n003"]);
        assert_eq!(names("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(names("a[1],b[5-5]"), ["a1", "b5"]);
    }

    #[test]
    fn a_host_list_that_is_not_one_is_refused_with_why() {
        for (list, why) in [
            ("", "names no node"),
            ("n[1-3", "not closed"),
            ("n1-3]", "without '['"),
            ("n[3-1]", "backwards"),
            ("n[a-c]", "not a number"),
            ("n[1-]", "not a number"),
            ("n[[1-2]]", "nested"),
            ("n[0-999999999]", "more than"),
        ] {
            let e = expand(list).expect_err(list);
            assert!(e.contains(why), "{list}: {e}");
        }
    }
}
