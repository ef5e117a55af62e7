//! When ckptd checkpoints a job by itself: every so often (a fixed interval, or one derived
//! from the job's checkpoint cost and the nodes' failure rate), kept in the job's record so that
//! it survives a ckptd restart.
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Epoch;

/// Shortest interval a user may ask for: below it, checkpoints would follow each other with the
/// job barely running between them.
pub const MIN_EVERY: Duration = Duration::from_secs(1);

/// How often to checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Every {
    /// A fixed interval, in seconds.
    Seconds(u64),
    /// Derived from the cost of the job's recent checkpoints and the nodes' MTBF.
    Auto,
}

impl Every {
    /// Parses what a user writes after `--every`: a duration (`30m`, `2s`, `1h30m`), `auto`,
    /// or `off` (None).
    pub fn parse(text: &str) -> Result<Option<Every>, String> {
        let t = text.trim();
        match t {
            "off" | "none" => return Ok(None),
            "auto" => return Ok(Some(Every::Auto)),
            _ => {}
        }
        // A bare number is seconds, as in `sleep`.
        let d = match t.parse::<u64>() {
            Ok(s) => Duration::from_secs(s),
            Err(_) => humantime::parse_duration(t).map_err(|e| {
                format!(
                    "--every {t:?}: {e}; give an interval such as 30m, 2h or 90s, or auto, or off"
                )
            })?,
        };
        if d < MIN_EVERY {
            return Err(format!(
                "--every {t:?}: the interval must be at least {}s (or off to stop periodic checkpoints)",
                MIN_EVERY.as_secs()
            ));
        }
        Ok(Some(Every::Seconds(d.as_secs())))
    }

    /// As a user writes it: `30m`, `auto`.
    pub fn text(&self) -> String {
        match self {
            Every::Seconds(s) => humantime::format_duration(Duration::from_secs(*s)).to_string(),
            Every::Auto => "auto".into(),
        }
    }
}

/// A job's checkpoint policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Periodic checkpoints; None: only on request.
    #[serde(default)]
    pub every: Option<Every>,
    /// A final checkpoint (with `--kill`) durable before this time (ms since the Unix epoch);
    /// cleared once taken.
    #[serde(default)]
    pub deadline_unix_ms: Option<u64>,
}

/// A change of a job's policy; what is None stays as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyChange {
    /// New periodic interval (`Some(None)`: off).
    pub every: Option<Option<Every>>,
    /// New deadline (`Some(None)`: none).
    pub deadline_unix_ms: Option<Option<u64>>,
}

impl PolicyChange {
    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        self.every.is_none() && self.deadline_unix_ms.is_none()
    }

    /// Applies it.
    pub fn apply(&self, p: &mut Policy) {
        if let Some(e) = self.every {
            p.every = e;
        }
        if let Some(d) = self.deadline_unix_ms {
            p.deadline_unix_ms = d;
        }
    }
}

/// What `--every auto` needs from the site's configuration.
#[derive(Debug, Clone, Copy)]
pub struct AutoParams {
    /// Mean time between failures of one node.
    pub node_mtbf: Duration,
    /// The interval before any checkpoint of the job was measured.
    pub first: Duration,
    /// Bounds of the derived interval.
    pub min: Duration,
    /// Bounds of the derived interval.
    pub max: Duration,
}

/// An interval and why it was chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct Interval {
    /// The interval.
    pub every: Duration,
    /// Why, in words, for `status`.
    pub why: String,
}

/// How many of the job's latest committed epochs the cost of a checkpoint is averaged over.
const COST_EPOCHS: usize = 3;

/// Daly's interval ("A higher order estimate of the optimum checkpoint interval for restart
/// dumps", 2006) for a checkpoint costing `cost` on a system whose MTBF is `mtbf`; Young's
/// first-order `sqrt(2 C M)` with correction terms, and `M` itself once `C >= 2M`.
pub fn daly(cost: f64, mtbf: f64) -> f64 {
    if cost <= 0.0 {
        return 0.0;
    }
    if cost >= 2.0 * mtbf {
        return mtbf;
    }
    let r = cost / (2.0 * mtbf);
    (2.0 * cost * mtbf).sqrt() * (1.0 + r.sqrt() / 3.0 + r / 9.0) - cost
}

/// A duration as people say it: "608 days", "5.5 h", "10 min", "40 s".
pub fn rough(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 2.0 * 86_400.0 {
        format!("{:.0} days", s / 86_400.0)
    } else if s >= 2.0 * 3600.0 {
        format!("{:.1} h", s / 3600.0)
    } else if s >= 120.0 {
        format!("{:.0} min", s / 60.0)
    } else {
        format!("{s:.0} s")
    }
}

/// The interval of a policy for a job on `nodes` nodes whose epochs are `epochs` (any order).
pub fn interval<E: std::borrow::Borrow<Epoch>>(
    every: Every,
    nodes: usize,
    epochs: &[E],
    p: &AutoParams,
) -> Interval {
    if let Every::Seconds(s) = every {
        return Interval {
            every: Duration::from_secs(s),
            why: String::new(),
        };
    }
    let mut committed: Vec<&Epoch> = epochs
        .iter()
        .map(|e| e.borrow())
        .filter(|e| e.is_restorable())
        .collect();
    committed.sort_by_key(|e| e.number);
    let recent: Vec<&Epoch> = committed
        .iter()
        .rev()
        .take(COST_EPOCHS)
        .rev()
        .copied()
        .collect();
    let fmt = rough;
    if recent.is_empty() {
        return Interval {
            every: p.first,
            why: format!(
                "no checkpoint of this job measured yet: the first after {} measures its cost",
                fmt(p.first)
            ),
        };
    }
    let cost_s =
        recent.iter().map(|e| e.frozen_ms as f64).sum::<f64>() / recent.len() as f64 / 1000.0;
    let mtbf_s = p.node_mtbf.as_secs_f64() / nodes.max(1) as f64;
    let raw = daly(cost_s, mtbf_s);
    let every = Duration::from_secs_f64(raw.max(0.0)).max(p.min).min(p.max);
    let span = match (recent.first(), recent.last()) {
        (Some(a), Some(b)) if a.number != b.number => format!("epochs {}-{}", a.number, b.number),
        (Some(a), _) => format!("epoch {}", a.number),
        _ => String::new(),
    };
    let bound = if every > Duration::from_secs_f64(raw) {
        format!(", raised to the minimum {}", fmt(p.min))
    } else if every < Duration::from_secs_f64(raw) {
        format!(", lowered to the maximum {}", fmt(p.max))
    } else {
        String::new()
    };
    Interval {
        every,
        why: format!(
            "Young/Daly: checkpoint cost {cost_s:.2} s frozen ({span}), job MTBF {} (node MTBF {} over {} node{}){bound}",
            fmt(Duration::from_secs_f64(mtbf_s)),
            fmt(p.node_mtbf),
            nodes.max(1),
            if nodes > 1 { "s" } else { "" },
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;

    #[test]
    fn every_parses_intervals_auto_and_off_and_refuses_zero() {
        assert_eq!(Every::parse("30m"), Ok(Some(Every::Seconds(1800))));
        assert_eq!(Every::parse("1h30m"), Ok(Some(Every::Seconds(5400))));
        assert_eq!(Every::parse("2s"), Ok(Some(Every::Seconds(2))));
        assert_eq!(Every::parse("90"), Ok(Some(Every::Seconds(90))));
        assert_eq!(Every::parse("auto"), Ok(Some(Every::Auto)));
        assert_eq!(Every::parse("off"), Ok(None));
        for bad in ["0", "0s", "500ms", "soon", "-5m", ""] {
            let e = Every::parse(bad).unwrap_err();
            assert!(e.contains("--every"), "{bad}: {e}");
        }
        assert!(Every::parse("0").unwrap_err().contains("at least 1s"));
        assert_eq!(Every::Seconds(1800).text(), "30m");
    }

    #[test]
    fn daly_is_near_young_for_cheap_checkpoints_and_the_mtbf_for_dear_ones() {
        // C = 10 s, M = 1 day: Young gives sqrt(2 C M) = 1314.5 s; Daly a little less.
        let young = (2.0f64 * 10.0 * 86_400.0).sqrt();
        let d = daly(10.0, 86_400.0);
        assert!(d < young && d > young * 0.98, "{d} vs {young}");
        assert_eq!(daly(3.0 * 86_400.0, 86_400.0), 86_400.0);
        assert_eq!(daly(0.0, 86_400.0), 0.0);
    }

    fn params() -> AutoParams {
        AutoParams {
            node_mtbf: Duration::from_secs(100 * 86_400),
            first: Duration::from_secs(600),
            min: Duration::from_secs(60),
            max: Duration::from_secs(86_400),
        }
    }

    fn committed(number: u32, frozen_ms: u64) -> Epoch {
        let mut e = Epoch::begin(1, number, false, vec!["n1".into()], 0);
        fixtures::commit(&mut e, [("n1".to_string(), "d".to_string())].into(), 1);
        e.frozen_ms = frozen_ms;
        e
    }

    #[test]
    fn auto_takes_the_cost_of_the_last_three_commits_and_the_job_mtbf() {
        let p = params();
        let first = interval::<Epoch>(Every::Auto, 4, &[], &p);
        assert_eq!(first.every, Duration::from_secs(600));
        assert!(first.why.contains("first after 10 min"), "{}", first.why);
        // Epoch 1 is dear and old, epoch 5 failed: neither counts.
        let mut failed = Epoch::begin(1, 5, false, vec!["n1".into()], 0);
        failed.fail("x", 1).unwrap();
        failed.frozen_ms = 900_000;
        let epochs = [
            committed(1, 600_000),
            committed(2, 1_000),
            committed(3, 2_000),
            committed(4, 3_000),
            failed,
        ];
        let iv = interval(Every::Auto, 4, &epochs, &p);
        // C = 2 s, M = 100 d / 4 nodes = 25 d.
        let want = daly(2.0, 25.0 * 86_400.0);
        assert!(
            (iv.every.as_secs_f64() - want).abs() < 1.0,
            "{iv:?} vs {want}"
        );
        assert!(iv.why.contains("2.00 s frozen (epochs 2-4)"), "{}", iv.why);
        assert!(iv.why.contains("over 4 nodes"), "{}", iv.why);
        // Bounds apply and say so.
        let tight = AutoParams {
            max: Duration::from_secs(120),
            ..p
        };
        let iv = interval(Every::Auto, 4, &epochs, &tight);
        assert_eq!(iv.every, Duration::from_secs(120));
        assert!(
            iv.why.contains("lowered to the maximum 2 min"),
            "{}",
            iv.why
        );
        // A fixed interval is just that.
        assert_eq!(
            interval(Every::Seconds(7), 4, &epochs, &p).every,
            Duration::from_secs(7)
        );
    }
}
