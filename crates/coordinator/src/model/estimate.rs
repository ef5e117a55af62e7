//! How long a checkpoint of a job will take, from how long earlier ones took. Checkpoint time
//! grows with the resident memory per node (every node dumps its part in parallel, at the
//! speed of its staging storage) and the copy to shared storage with the bytes it writes: each
//! time is fitted as `a + b x`, x the resident bytes per node at the initial synchronization,
//! over the job's own committed epochs, or over recent epochs of every job while the job has
//! fewer than two (the nodes' storage is what sets b). Recent epochs weigh more than old ones
//! (the weight halves every [`HALF_LIFE`] epochs): a node's page cache, its other jobs and the
//! shared storage's load change over a job's life, and the next checkpoint is most like the
//! last ones.
use serde::Serialize;

use super::{Epoch, FlushState};

/// One committed epoch as the estimate sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    epoch: u32,
    /// Resident bytes per node.
    x: f64,
    frozen_ms: f64,
    commit_ms: f64,
    durable_ms: Option<f64>,
}

fn sample(e: &Epoch) -> Option<Sample> {
    if !e.is_restorable() || e.resident_bytes == 0 || e.nodes.is_empty() {
        return None;
    }
    let commit_ms = e.finished_unix_ms.saturating_sub(e.started_unix_ms) as f64;
    Some(Sample {
        epoch: e.number,
        x: e.resident_bytes as f64 / e.nodes.len() as f64,
        frozen_ms: e.frozen_ms as f64,
        commit_ms,
        // Older records have no time of durability: their flush alone after the commit.
        durable_ms: e.durable_ms().map(|d| d as f64).or(match e.flush {
            FlushState::Durable { flush_ms, .. } => Some(commit_ms + flush_ms as f64),
            _ => None,
        }),
    })
}

/// `y = a + b x`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Line {
    a: f64,
    b: f64,
}

impl Line {
    fn at(&self, x: f64) -> f64 {
        (self.a + self.b * x).max(0.0)
    }
}

/// How many epochs it takes for an epoch's weight in the fit to halve.
const HALF_LIFE: f64 = 2.0;

/// Weighted least squares over `points` (x, y, weight); proportional (`a = 0`) when there are
/// fewer than three or their x hardly differ, or when the fit would give a negative term.
fn fit(points: &[(f64, f64, f64)]) -> Option<Line> {
    let (sw, sx, sy) = points
        .iter()
        .fold((0.0, 0.0, 0.0), |(sw, sx, sy), (x, y, w)| {
            (sw + w, sx + w * x, sy + w * y)
        });
    if points.is_empty() || sx <= 0.0 || sw <= 0.0 {
        return None;
    }
    let proportional = Line { a: 0.0, b: sy / sx };
    let (mx, my) = (sx / sw, sy / sw);
    let sxx: f64 = points.iter().map(|(x, _, w)| w * (x - mx) * (x - mx)).sum();
    let sxy: f64 = points.iter().map(|(x, y, w)| w * (x - mx) * (y - my)).sum();
    // x must spread over at least 10 % of its mean for a slope to mean anything.
    if points.len() < 3 || (sxx / sw).sqrt() < 0.1 * mx {
        return Some(proportional);
    }
    let b = sxy / sxx;
    let a = my - b * mx;
    if a < 0.0 || b < 0.0 {
        return Some(proportional);
    }
    Some(Line { a, b })
}

/// The fitted times.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Model {
    frozen: Line,
    commit: Line,
    durable: Option<Line>,
}

/// The fit over `samples`, oldest first.
fn model(samples: &[Sample]) -> Option<Model> {
    let n = samples.len();
    let pts = |f: fn(&Sample) -> Option<f64>| -> Vec<(f64, f64, f64)> {
        samples
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let age = (n - 1 - i) as f64;
                Some((s.x, f(s)?, 0.5f64.powf(age / HALF_LIFE)))
            })
            .collect()
    };
    Some(Model {
        frozen: fit(&pts(|s| Some(s.frozen_ms)))?,
        commit: fit(&pts(|s| Some(s.commit_ms)))?,
        durable: fit(&pts(|s| s.durable_ms)),
    })
}

/// A predicted checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// How long the job is frozen.
    pub frozen_ms: u64,
    /// From the start of the checkpoint to its commit.
    pub commit_ms: u64,
    /// From the start to durable in shared storage; None when no epoch was ever flushed.
    pub durable_ms: Option<u64>,
}

/// A prediction for an earlier epoch from the others, beside what it took.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    /// The epoch.
    pub epoch: u32,
    /// What the others predict for it.
    pub predicted: Prediction,
    /// What it took.
    pub actual: Prediction,
}

/// An estimate and what it rests on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    /// Resident bytes per node it is for.
    pub resident_per_node: u64,
    /// The prediction.
    pub predicted: Prediction,
    /// What it is fitted on, in words.
    pub basis: String,
    /// Leave-one-out predictions for the job's last epochs.
    pub checks: Vec<Check>,
}

fn predict(m: &Model, x: f64) -> Prediction {
    Prediction {
        frozen_ms: m.frozen.at(x).round() as u64,
        commit_ms: m.commit.at(x).round() as u64,
        durable_ms: m.durable.map(|l| l.at(x).round() as u64),
    }
}

/// How many epochs of every job the estimate uses while the job has too few of its own.
const SITE_EPOCHS: usize = 20;
/// How many of the job's own last epochs the estimate uses.
const OWN_EPOCHS: usize = 20;
/// How many of the job's last epochs it checks itself against.
const CHECKED: usize = 5;

/// The estimate for a job whose processes hold `resident_per_node` bytes per node now, from
/// its own epochs `own` or, while it has fewer than two, recent epochs of any job (`site`).
pub fn estimate(own: &[Epoch], site: &[Epoch], resident_per_node: u64) -> Option<Estimate> {
    let mut mine: Vec<Sample> = own.iter().filter_map(sample).collect();
    mine.sort_by_key(|s| s.epoch);
    // Older ones weigh next to nothing.
    mine.drain(..mine.len().saturating_sub(OWN_EPOCHS));
    let (samples, basis) = if mine.len() >= 2 {
        (
            mine.clone(),
            format!("{} committed epochs of this job", mine.len()),
        )
    } else {
        let mut all: Vec<(u64, Sample)> = site
            .iter()
            .filter_map(|e| Some((e.started_unix_ms, sample(e)?)))
            .collect();
        all.sort_by_key(|(t, _)| std::cmp::Reverse(*t));
        let mut recent: Vec<Sample> = all.into_iter().take(SITE_EPOCHS).map(|(_, s)| s).collect();
        recent.reverse();
        let n = recent.len();
        (
            recent,
            format!("{n} recent epochs of all jobs (this job has fewer than 2 of its own)"),
        )
    };
    let m = model(&samples)?;
    let checks = if mine.len() >= 3 {
        mine.iter()
            .rev()
            .take(CHECKED)
            .rev()
            .filter_map(|s| {
                let others: Vec<Sample> = mine
                    .iter()
                    .filter(|o| o.epoch != s.epoch)
                    .copied()
                    .collect();
                let m = model(&others)?;
                Some(Check {
                    epoch: s.epoch,
                    predicted: predict(&m, s.x),
                    actual: Prediction {
                        frozen_ms: s.frozen_ms as u64,
                        commit_ms: s.commit_ms as u64,
                        durable_ms: s.durable_ms.map(|d| d as u64),
                    },
                })
            })
            .collect()
    } else {
        Vec::new()
    };
    Some(Estimate {
        resident_per_node,
        predicted: predict(&m, resident_per_node as f64),
        basis,
        checks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;

    /// A committed epoch on `nodes` nodes with `mb` MB resident per node that took
    /// 100 ms + 2 ms/MB frozen, twice that to commit and 1 s + 10 ms/MB more to be durable.
    fn epoch(number: u32, nodes: usize, mb: u64) -> Epoch {
        let names: Vec<String> = (0..nodes).map(|i| format!("n{i}")).collect();
        let mut e = Epoch::begin(1, number, false, names.clone(), 1_000);
        e.resident_bytes = mb * nodes as u64 * 1_000_000;
        let frozen = 100 + 2 * mb;
        fixtures::commit(
            &mut e,
            names.iter().map(|n| (n.clone(), "d".to_string())).collect(),
            1_000 + 2 * frozen,
        );
        e.frozen_ms = frozen;
        e.flush = FlushState::Durable {
            flush_ms: 1_000 + 10 * mb,
            written_bytes: 0,
            durable_unix_ms: 0,
        };
        e
    }

    #[test]
    fn times_are_fitted_on_memory_per_node_and_checked_on_the_last_epochs() {
        let own = [
            epoch(1, 2, 100),
            epoch(2, 2, 200),
            epoch(3, 4, 400),
            epoch(4, 4, 800),
        ];
        let e = estimate(&own, &[], 1_000_000_000).unwrap();
        assert_eq!(e.predicted.frozen_ms, 100 + 2 * 1000);
        assert_eq!(e.predicted.commit_ms, 2 * (100 + 2 * 1000));
        assert_eq!(
            e.predicted.durable_ms,
            Some(2 * (100 + 2 * 1000) + 1_000 + 10 * 1000)
        );
        assert!(
            e.basis.contains("4 committed epochs of this job"),
            "{}",
            e.basis
        );
        assert_eq!(e.checks.len(), 4);
        let last = e.checks.last().unwrap();
        assert_eq!(last.epoch, 4);
        assert_eq!(last.predicted, last.actual, "exact on an exact line");
    }

    #[test]
    fn a_new_job_borrows_the_sites_epochs_and_nothing_measured_gives_nothing() {
        let other = [epoch(1, 2, 100), epoch(2, 2, 100)];
        let e = estimate(&[epoch(1, 1, 50)], &other, 200_000_000).unwrap();
        assert!(
            e.basis.contains("2 recent epochs of all jobs"),
            "{}",
            e.basis
        );
        // Proportional through two equal points: 300 ms at 100 MB, so 600 ms at 200 MB.
        assert_eq!(e.predicted.frozen_ms, 600);
        assert!(e.checks.is_empty());
        assert_eq!(estimate(&[], &[], 1), None);
        let mut failed = epoch(1, 1, 50);
        failed.state = crate::model::EpochState::Expired { reason: "x".into() };
        assert_eq!(estimate(&[failed], &[], 1), None);
    }

    #[test]
    fn recent_epochs_weigh_more_and_durable_is_timed_from_the_start() {
        // Same memory; the job's checkpoints got slower (200 ms, then 400 ms frozen).
        let mut own: Vec<Epoch> = (1..=4).map(|n| epoch(n, 2, 50)).collect();
        for e in &mut own[2..] {
            e.frozen_ms = 400;
        }
        for e in &mut own[..2] {
            e.frozen_ms = 200;
        }
        let e = estimate(&own, &[], 50_000_000).unwrap();
        // Weights 1/2, 1/sqrt 2, 1/sqrt 2, 1: closer to the last epochs than the mean of 300.
        assert!(
            e.predicted.frozen_ms > 320 && e.predicted.frozen_ms < 400,
            "{}",
            e.predicted.frozen_ms
        );
        // An epoch that records when it became durable is fitted on that, not on commit +
        // flush (the partner copies came before its flush).
        let mut timed = epoch(5, 2, 50);
        timed.flush = FlushState::Durable {
            flush_ms: 1_000,
            written_bytes: 0,
            durable_unix_ms: timed.started_unix_ms + 9_000,
        };
        let one = sample(&timed).unwrap();
        assert_eq!(one.durable_ms, Some(9_000.0));
        let old = sample(&own[0]).unwrap();
        assert_eq!(old.durable_ms, Some(old.commit_ms + 1_000.0 + 500.0));
    }
}
