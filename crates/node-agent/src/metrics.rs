//! The agent's Prometheus metrics, in the process's default registry: served by ckpt-agent's
//! own endpoint, or by a standalone ckptd's with its own. Times of this node's dumps, restores
//! and verifications; its staging space, set at each scrape by [`refresh`].
use std::sync::OnceLock;

use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts};

use crate::jobs::Jobs;

/// Buckets (seconds): 10 ms to 10 min.
const LATENCY: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Every metric of the agent.
#[derive(Debug)]
pub struct Metrics {
    /// `ckpt_agent_dump_duration_seconds{engine}`: the snapshot engine's dump of a job's part.
    pub dump_seconds: HistogramVec,
    /// `ckpt_agent_restores_total{outcome}`.
    pub restores: IntCounterVec,
    /// `ckpt_agent_restore_duration_seconds`: successful restores of a part, images verified.
    pub restore_seconds: Histogram,
    /// `ckpt_agent_verify_duration_seconds`: `ckptctl verify` of an epoch's copies here.
    pub verify_seconds: Histogram,
    /// `ckpt_agent_staging_free_bytes`.
    pub staging_free: IntGauge,
    /// `ckpt_agent_staging_size_bytes`.
    pub staging_size: IntGauge,
    /// `ckpt_agent_jobs`: jobs this agent keeps a record of.
    pub jobs: IntGauge,
}

impl Metrics {
    fn new() -> Metrics {
        let h = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY.to_vec()))
                .expect("valid")
        };
        let g = |name: &str, help: &str| IntGauge::new(name, help).expect("valid");
        Metrics {
            dump_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "ckpt_agent_dump_duration_seconds",
                    "Duration of the snapshot engine's dump of a job's part on this node, by engine.",
                )
                .buckets(LATENCY.to_vec()),
                &["engine"],
            )
            .expect("valid"),
            restores: IntCounterVec::new(
                Opts::new(
                    "ckpt_agent_restores_total",
                    "Restores of a job's part on this node, by outcome (done, failed).",
                ),
                &["outcome"],
            )
            .expect("valid"),
            restore_seconds: h(
                "ckpt_agent_restore_duration_seconds",
                "Duration of successful restores of a job's part on this node, images verified.",
            ),
            verify_seconds: h(
                "ckpt_agent_verify_duration_seconds",
                "Duration of verifications of an epoch's copies on this node.",
            ),
            staging_free: g(
                "ckpt_agent_staging_free_bytes",
                "Bytes available in this node's staging file system.",
            ),
            staging_size: g(
                "ckpt_agent_staging_size_bytes",
                "Size of this node's staging file system.",
            ),
            jobs: g(
                "ckpt_agent_jobs",
                "Jobs this node's agent keeps a record of.",
            ),
        }
    }

    fn register(&self) {
        ckpt_daemon::metrics::register(vec![
            Box::new(self.dump_seconds.clone()),
            Box::new(self.restores.clone()),
            Box::new(self.restore_seconds.clone()),
            Box::new(self.verify_seconds.clone()),
            Box::new(self.staging_free.clone()),
            Box::new(self.staging_size.clone()),
            Box::new(self.jobs.clone()),
        ]);
        for o in ["done", "failed"] {
            self.restores.with_label_values(&[o]);
        }
    }
}

/// The agent's metrics, registered in the default registry on first use.
pub fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = Metrics::new();
        m.register();
        m
    })
}

/// Sets the gauges of this node: staging space, jobs. Run before each scrape.
pub fn refresh(jobs: &Jobs) {
    let m = metrics();
    if let Ok((free, size)) = jobs.node.staging.space() {
        m.staging_free.set(i64::try_from(free).unwrap_or(i64::MAX));
        m.staging_size.set(i64::try_from(size).unwrap_or(i64::MAX));
    }
    m.jobs
        .set(i64::try_from(jobs.snapshot().len()).unwrap_or(i64::MAX));
}
