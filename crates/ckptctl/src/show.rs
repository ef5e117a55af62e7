//! Replies in words and as JSON.
use ckpt_proto::v1 as pb;
use serde_json::{json, Value};

use crate::term::{command, field};

/// A job's part on a node in words: "running", "exited with code 0", "killed by signal 9",
/// "absent", or "unknown (why)" when ckptd could not ask the node.
pub fn node_state(n: &pb::NodeJobInfo) -> String {
    match n.state() {
        pb::PartState::Exited => n.end.unwrap_or_default().text(),
        pb::PartState::Unspecified => format!("unknown ({})", n.detail),
        s => s.name().to_string(),
    }
}

pub fn job_json(j: &pb::JobInfo) -> Value {
    json!({
        "id": j.id, "name": j.name, "owner_uid": j.owner_uid, "state": j.state,
        "argv": j.argv, "cwd": j.cwd, "created_unix_ms": j.created_unix_ms,
        "exit_code": j.exit_code, "exit_signal": j.exit_signal,
        "last_epoch": j.last_epoch, "latest_committed_epoch": j.latest_committed_epoch,
        "job_dir": j.job_dir, "flush": j.flush, "engine": j.engine, "detail": j.detail,
        "on_failure": j.on_failure, "recovery_note": j.recovery_note, "recovering": j.recovering,
        "recoveries": j.recoveries.iter().map(restart_json).collect::<Vec<_>>(),
        "lost": j.lost.as_ref().map(|l| json!({
            "node": l.node, "since_unix_ms": l.since_unix_ms, "noticed_unix_ms": l.noticed_unix_ms,
        })),
        "unreachable": j.unreachable.iter().map(|l| json!({
            "node": l.node, "since_unix_ms": l.since_unix_ms, "noticed_unix_ms": l.noticed_unix_ms,
        })).collect::<Vec<_>>(),
        "policy": j.policy.as_ref().map(|p| json!({
            "every": p.every, "interval_s": p.interval_s, "why": p.why,
            "next_checkpoint_unix_ms": p.next_checkpoint_unix_ms,
            "deadline_unix_ms": (p.deadline_unix_ms > 0).then_some(p.deadline_unix_ms),
        })),
        "nodes": j.nodes.iter().map(|n| json!({
            "node": n.node, "state": n.state().name(), "role": n.role, "address": n.address,
            "moved_from": n.moved_from, "snapshot_mode": n.snapshot_mode,
            "exit_code": n.end.as_ref().and_then(pb::JobEnd::code),
            "exit_signal": n.end.as_ref().and_then(pb::JobEnd::signal),
            "detail": n.detail,
            "ranks": n.processes.iter().filter_map(|p| p.rank).collect::<Vec<_>>(),
            "processes": n.processes.iter().map(|p| json!({"pid": p.pid, "comm": p.comm, "state": p.state().name(), "rank": p.rank})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// Prints the job a reply carries (an empty one if it carries none): as JSON under `--json`, else
/// as `text` words it.
pub fn print_job(job: Option<pb::JobInfo>, json: bool, text: impl FnOnce(&pb::JobInfo)) {
    let j = job.unwrap_or_default();
    if json {
        println!("{}", job_json(&j));
    } else {
        text(&j);
    }
}

/// `ckptctl status` in words: the job, then each node and its processes.
pub fn print_status(j: &pb::JobInfo) {
    say!("job {} ({}): {}", j.id, field(&j.name), j.state);
    say!(
        "  owner uid {}, engine {}, command: {}",
        j.owner_uid,
        j.engine,
        command(&j.argv)
    );
    say!(
        "  epochs: {} taken, latest committed {}",
        j.last_epoch,
        j.latest_committed_epoch
    );
    if !j.detail.is_empty() {
        say!("  {}", j.detail);
    }
    say!("  output: {}/stdout", field(&j.job_dir));
    if !j.flush.is_empty() {
        say!("  flushing: {}", j.flush);
    }
    if let Some(p) = &j.policy {
        say!("  {}", policy_text(p));
    }
    if j.on_failure_max_restarts > 0 {
        say!(
            "  on failure: {} ({} automatic restarts so far)",
            j.on_failure,
            j.recoveries.len()
        );
    }
    for r in &j.recoveries {
        say!("  restarted by itself {}", restart_text(r));
    }
    if !j.recovery_note.is_empty() {
        say!("  {}", j.recovery_note);
    }
    for n in &j.nodes {
        let mut ranks: Vec<i32> = n.processes.iter().filter_map(|p| p.rank).collect();
        ranks.sort_unstable();
        let ranks = if ranks.is_empty() {
            String::new()
        } else {
            format!(
                ", ranks {}",
                ranks
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )
        };
        let address = if n.address.is_empty() {
            String::new()
        } else {
            format!(", job address {}", n.address)
        };
        let moved = if n.moved_from.is_empty() {
            String::new()
        } else {
            format!(", moved here from {}", n.moved_from)
        };
        say!(
            "  node {} ({}): {}, {} processes{ranks}{address}{moved}",
            n.node,
            n.role,
            node_state(n),
            n.processes.len()
        );
        if !n.snapshot_mode.is_empty() {
            say!("    checkpoints: {}", n.snapshot_mode);
        }
        say!("    {:>8} {:>5} {:<16} STATE", "PID", "RANK", "COMMAND");
        for p in &n.processes {
            let rank = p.rank.map(|r| r.to_string()).unwrap_or_else(|| "-".into());
            say!(
                "    {:>8} {:>5} {:<16} {}",
                p.pid,
                rank,
                field(&p.comm),
                p.state().name()
            );
        }
    }
}

/// A restart's record as JSON (times in ms; 0 where not reached).
fn restart_json(r: &pb::RecoveryInfo) -> Value {
    json!({
        "at_unix_ms": r.at_unix_ms, "trigger": r.trigger, "epoch": r.epoch,
        "moves": r.moves, "outcome": r.outcome, "failed_unix_ms": r.failed_unix_ms,
        "noticed_unix_ms": r.noticed_unix_ms, "restored_unix_ms": r.restored_unix_ms,
        "running_unix_ms": r.running_unix_ms, "fetch_ms": r.fetch_ms, "restore_ms": r.restore_ms,
    })
}

/// A restart in words: "at 03:12:09 (node n3 lost): epoch 2, moving n3=n4: running again from
/// epoch 2, 4.1 s after the node was last heard from".
fn restart_text(r: &pb::RecoveryInfo) -> String {
    let moves = if r.moves.is_empty() {
        "in place".to_string()
    } else {
        format!("moving {}", r.moves.join(", "))
    };
    let since = match (r.running_unix_ms, r.failed_unix_ms) {
        (0, _) => String::new(),
        (run, 0) => format!(
            ", in {:.1} s",
            run.saturating_sub(r.at_unix_ms) as f64 / 1e3
        ),
        (run, failed) => format!(
            ", {:.1} s after the node was last heard from",
            run.saturating_sub(failed) as f64 / 1e3
        ),
    };
    format!(
        "at {} ({}): epoch {}, {moves}: {}{since}",
        crate::when::clock(r.at_unix_ms),
        r.trigger,
        r.epoch,
        r.outcome
    )
}

pub fn epoch_json(e: &pb::EpochInfo) -> Value {
    json!({
        "job_id": e.job_id, "epoch": e.epoch, "state": e.state, "failed_phase": e.failed_phase,
        "reason": e.reason, "started_unix_ms": e.started_unix_ms, "finished_unix_ms": e.finished_unix_ms,
        "frozen_ms": e.frozen_ms, "total_ms": e.total_ms, "image_bytes": e.image_bytes,
        "image_files": e.image_files, "kill": e.kill, "nodes": e.nodes,
        "storage": e.storage, "flush_detail": e.flush_detail, "flushed_bytes": e.flushed_bytes,
        "flush_ms": e.flush_ms, "local_copy": e.local_copy, "shared_copy": e.shared_copy,
        "partner_copy": e.partner_copy, "encoded": e.encoded, "parity_bytes": e.parity_bytes, "shared_bytes": e.shared_bytes, "durable_ms": e.durable_ms,
        "trigger": trigger_text(e),
        "engine": e.engine,
        "restarts": e.restarts.iter().map(restart_json).collect::<Vec<_>>(),
    })
}

/// Who asked for an epoch, in words: ckptd's, and "user" for a user's request (which ckptd
/// leaves without words).
fn trigger_text(e: &pb::EpochInfo) -> &str {
    match e.trigger_kind() {
        pb::Trigger::User => "user",
        _ => &e.trigger,
    }
}

/// Where an epoch's images are, in the epochs table: ckptd's words, a flush's progress in
/// percent, "-" for an epoch not committed.
fn storage_text(e: &pb::EpochInfo) -> String {
    match e.storage_kind() {
        pb::EpochStorage::Flushing if e.image_bytes > 0 => {
            format!("flushing {}%", e.flushed_bytes * 100 / e.image_bytes)
        }
        pb::EpochStorage::Unspecified => "-".into(),
        _ => e.storage.clone(),
    }
}

/// Prints a list: as one JSON array of `to_json`'s objects under `--json`, else as `table`
/// words it.
pub fn print_list<T>(items: &[T], json: bool, to_json: fn(&T) -> Value, table: fn(&[T])) {
    if json {
        println!("{}", Value::Array(items.iter().map(to_json).collect()));
    } else {
        table(items);
    }
}

/// `ckptctl list` in words: one line per job.
pub fn print_jobs(jobs: &[pb::JobInfo]) {
    say!(
        "{:>6}  {:<16} {:<18} {:>6} {:>6} {:>9}  COMMAND",
        "JOBID",
        "NAME",
        "STATE",
        "OWNER",
        "EPOCHS",
        "COMMITTED"
    );
    for j in jobs {
        say!(
            "{:>6}  {:<16} {:<18} {:>6} {:>6} {:>9}  {}",
            j.id,
            field(&j.name),
            j.state,
            j.owner_uid,
            j.last_epoch,
            j.latest_committed_epoch,
            command(&j.argv)
        );
    }
}

/// `ckptctl epochs` in words: one line per epoch.
pub fn print_epochs(epochs: &[pb::EpochInfo]) {
    say!(
        "{:>5}  {:<28} {:<16} {:<20} {:>9} {:>9} {:>10} {:>6}  {:<6} {:<8}  REASON",
        "EPOCH",
        "STATE",
        "STORAGE",
        "COPIES",
        "FROZEN",
        "TOTAL",
        "SIZE",
        "FILES",
        "ENGINE",
        "BY"
    );
    for e in epochs {
        let reason = if !e.reason.is_empty() {
            format!("[{}] {}", e.failed_phase, e.reason)
        } else if !e.flush_detail.is_empty() {
            format!("[flush] {}", e.flush_detail)
        } else {
            String::new()
        };
        let storage = storage_text(e);
        let copies: Vec<&str> = [
            (e.local_copy, "local"),
            (e.partner_copy, "partner"),
            (!e.encoded.is_empty(), "parity"),
            (e.shared_copy, "shared"),
        ]
        .iter()
        .filter(|c| c.0)
        .map(|c| c.1)
        .collect();
        let copies = if copies.is_empty() {
            "-".to_string()
        } else {
            copies.join(",")
        };
        say!(
            "{:>5}  {:<28} {:<16} {:<20} {:>7}ms {:>7}ms {:>10} {:>6}  {:<6} {:<8}  {}",
            e.epoch,
            e.state,
            storage,
            copies,
            e.frozen_ms,
            e.total_ms,
            size(e.image_bytes),
            e.image_files,
            e.engine,
            trigger_text(e),
            reason
        );
        for r in &e.restarts {
            say!("{:>5}  restored {}", "", restart_text(r));
        }
    }
}

/// A job's policy in words: "checkpoints every 30m (next in 12m 3s)", with how `auto` chose
/// its interval.
pub fn policy_text(p: &pb::JobPolicy) -> String {
    let now = crate::when::now_ms();
    let mut parts = Vec::new();
    if !p.every.is_empty() {
        let mut t = if p.auto {
            format!("checkpoints every {} (auto: {})", secs(p.interval_s), p.why)
        } else {
            format!("checkpoints every {}", p.every)
        };
        if p.next_checkpoint_unix_ms > 0 {
            let left = p.next_checkpoint_unix_ms.saturating_sub(now) / 1000;
            if left == 0 {
                t.push_str(" (next one due now)");
            } else {
                t.push_str(&format!(" (next in {})", secs(left)));
            }
        } else {
            t.push_str(" (while it runs)");
        }
        parts.push(t);
    }
    if p.deadline_unix_ms > 0 {
        parts.push(format!(
            "stops after a final checkpoint before {} (in {}; `ckptctl estimate` says when it starts)",
            crate::when::local(p.deadline_unix_ms),
            secs(p.deadline_unix_ms.saturating_sub(now) / 1000)
        ));
    }
    parts.join("; ")
}

fn timing_json(t: Option<&pb::Timing>) -> Value {
    let t = t.copied().unwrap_or_default();
    json!({"frozen_ms": t.frozen_ms, "commit_ms": t.commit_ms,
           "durable_ms": (t.durable_ms > 0).then_some(t.durable_ms)})
}

/// `ckptctl estimate --json`.
pub fn estimate_json(r: &pb::EstimateReply) -> Value {
    json!({
        "job_id": r.job.as_ref().map(|j| j.id), "known": r.known,
        "resident_per_node_bytes": r.resident_per_node_bytes,
        "predicted": r.known.then(|| timing_json(r.predicted.as_ref())),
        "basis": r.basis,
        "checks": r.checks.iter().map(|c| json!({"epoch": c.epoch,
            "predicted": timing_json(c.predicted.as_ref()), "actual": timing_json(c.actual.as_ref())}))
            .collect::<Vec<_>>(),
        "deadline_lead_ms": r.deadline_lead_ms, "deadline_why": r.deadline_why,
    })
}

/// `ckptctl estimate` in words.
pub fn print_estimate(r: &pb::EstimateReply) {
    let j = r.job.clone().unwrap_or_default();
    if !r.known {
        say!(
            "job {} ({}): nothing to estimate from yet: no checkpoint of any job was measured. Take one (`ckptctl checkpoint {} --wait`) and ask again.",
            j.id, field(&j.name), j.id
        );
        return;
    }
    let p = r.predicted.unwrap_or_default();
    let s = |ms: u64| format!("{:.2} s", ms as f64 / 1000.0);
    say!(
        "job {} ({}): a checkpoint now, with {} resident per node:",
        j.id,
        field(&j.name),
        size(r.resident_per_node_bytes)
    );
    say!("  frozen     ~{}", s(p.frozen_ms));
    say!("  committed  ~{} after it starts", s(p.commit_ms));
    if p.durable_ms > 0 {
        say!("  durable    ~{} after it starts", s(p.durable_ms));
    } else {
        say!("  durable    - (no epoch was copied to shared storage yet)");
    }
    say!("  from {}", r.basis);
    if !r.checks.is_empty() {
        say!("  the same estimate for the last epochs, from the others:");
        say!(
            "  {:>6}  {:>22}  {:>22}  {:>22}",
            "EPOCH",
            "FROZEN",
            "COMMITTED",
            "DURABLE"
        );
        let cell = |pred: u64, act: u64| {
            if act == 0 {
                "-".to_string()
            } else {
                format!(
                    "{} vs {} ({:+.0}%)",
                    s(pred),
                    s(act),
                    (pred as f64 - act as f64) * 100.0 / act as f64
                )
            }
        };
        for c in &r.checks {
            let (pr, ac) = (
                c.predicted.unwrap_or_default(),
                c.actual.unwrap_or_default(),
            );
            say!(
                "  {:>6}  {:>22}  {:>22}  {:>22}",
                c.epoch,
                cell(pr.frozen_ms, ac.frozen_ms),
                cell(pr.commit_ms, ac.commit_ms),
                cell(pr.durable_ms, ac.durable_ms)
            );
        }
    }
    say!(
        "  a deadline's final checkpoint starts {} before it: {}",
        s(r.deadline_lead_ms),
        r.deadline_why
    );
}

/// Seconds as `1h 2m 3s`, without the zero parts (`10m`).
fn secs(s: u64) -> String {
    let parts: Vec<String> = [(s / 3600, "h"), (s / 60 % 60, "m"), (s % 60, "s")]
        .iter()
        .filter(|(v, _)| *v > 0)
        .map(|(v, u)| format!("{v}{u}"))
        .collect();
    if parts.is_empty() {
        "0s".into()
    } else {
        parts.join(" ")
    }
}

pub fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_epochs_trigger_and_storage_read_from_their_kinds() {
        let e = |trigger: pb::Trigger, text: &str, storage: pb::EpochStorage, words: &str| {
            pb::EpochInfo {
                trigger: text.into(),
                trigger_kind: trigger.into(),
                storage: words.into(),
                storage_kind: storage.into(),
                image_bytes: 200,
                flushed_bytes: 50,
                ..Default::default()
            }
        };
        use pb::EpochStorage as S;
        let user = e(pb::Trigger::User, "", S::Unspecified, "");
        assert_eq!(
            (trigger_text(&user), storage_text(&user).as_str()),
            ("user", "-")
        );
        let flushing = e(pb::Trigger::Periodic, "periodic", S::Flushing, "flushing");
        assert_eq!(
            (trigger_text(&flushing), storage_text(&flushing).as_str()),
            ("periodic", "flushing 25%")
        );
        let durable = e(pb::Trigger::Drain, "drain", S::SharedOnly, "shared-only");
        assert_eq!(
            (trigger_text(&durable), storage_text(&durable).as_str()),
            ("drain", "shared-only")
        );
        let empty = pb::EpochInfo {
            image_bytes: 0,
            ..e(pb::Trigger::Deadline, "deadline", S::Flushing, "flushing")
        };
        assert_eq!(storage_text(&empty), "flushing");
    }

    #[test]
    fn an_auto_policy_says_how_it_chose_its_interval() {
        let p = pb::JobPolicy {
            every: "auto".into(),
            auto: true,
            interval_s: 600,
            why: "from the last epochs".into(),
            ..Default::default()
        };
        assert_eq!(
            policy_text(&p),
            "checkpoints every 10m (auto: from the last epochs) (while it runs)"
        );
        let fixed = pb::JobPolicy {
            every: "30m".into(),
            ..Default::default()
        };
        assert_eq!(policy_text(&fixed), "checkpoints every 30m (while it runs)");
    }
}
