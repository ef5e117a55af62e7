//! Fault injection for tests and fire drills, off unless asked for.
//!
//! When the agent starts with `CKPT_FAILPOINTS=/path/to/file`, every checkpoint phase, restore,
//! release and encode reads that file as it begins. A line `PHASE=error` makes the phase fail;
//! `PHASE=delay:DURATION` (e.g. `local-checkpoint=delay:5s`) makes it wait first;
//! `PHASE@NODE=...` applies on that node only. Phases, by their protocol names:
//! `initial-sync`, `quiesce`, `local-checkpoint`, `resume`, `finalize`, and `restore`,
//! `release`, `encode` (an erasure-coded group's parity), `flush` (a copy to shared storage).
//! Without the variable (production), nothing is read.
use std::path::PathBuf;
use std::time::Duration;

/// Environment variable naming the failpoint file.
pub const ENV: &str = "CKPT_FAILPOINTS";

/// The failpoint file, if enabled.
#[derive(Debug, Clone, Default)]
pub struct Failpoints {
    file: Option<PathBuf>,
}

/// What a failpoint asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Fail the phase.
    Error,
    /// Wait this long, then go on.
    Delay(Duration),
}

impl Failpoints {
    /// Failpoints from the environment.
    pub fn from_env() -> Self {
        Failpoints {
            file: std::env::var_os(ENV).map(PathBuf::from),
        }
    }

    /// Failpoints read from `file` (what [`ENV`] names).
    pub fn at(file: PathBuf) -> Self {
        Failpoints { file: Some(file) }
    }

    /// The action set for `phase` on `node`, if any.
    pub fn action(&self, phase: &str, node: &str) -> Option<Action> {
        let text = std::fs::read_to_string(self.file.as_ref()?).ok()?;
        parse(&text, phase, node)
    }
}

fn parse(text: &str, phase: &str, node: &str) -> Option<Action> {
    text.lines().find_map(|l| {
        let (p, a) = l.trim().split_once('=')?;
        let (p, on) = p.trim().split_once('@').unwrap_or((p.trim(), node));
        if p != phase || on != node {
            return None;
        }
        match a.trim() {
            "error" => Some(Action::Error),
            other => other
                .strip_prefix("delay:")
                .and_then(|d| humantime::parse_duration(d).ok())
                .map(Action::Delay),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_errors_and_delays_per_phase() {
        let t = "sync=error\n dump = delay:250ms\nbogus\nrestore@n2=error\n";
        assert_eq!(parse(t, "sync", "n1"), Some(Action::Error));
        assert_eq!(
            parse(t, "dump", "n1"),
            Some(Action::Delay(Duration::from_millis(250)))
        );
        assert_eq!(parse(t, "resume", "n1"), None);
        assert_eq!(parse(t, "restore", "n2"), Some(Action::Error), "on n2");
        assert_eq!(parse(t, "restore", "n1"), None, "on n2 only");
        assert_eq!(
            Failpoints::default().action("sync", "n1"),
            None,
            "disabled without the variable"
        );
    }
}
