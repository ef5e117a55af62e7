//! ckptd's Prometheus metrics, in the process's default registry (served by
//! `ckpt_daemon::metrics`). Counters and histograms are updated where epochs, restarts and
//! flushes end; gauges of the cluster (agents, jobs) are computed at each scrape by
//! [`Coordinator::refresh_metrics`](crate::driver::Coordinator::refresh_metrics).
use std::sync::OnceLock;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

/// Latency buckets (seconds) of phases, epochs and restarts: 10 ms to 10 min.
const LATENCY: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Buckets (seconds) of flushes to shared storage: 100 ms to 1 h.
const FLUSH: &[f64] = &[
    0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// Every metric of the coordinator.
#[derive(Debug)]
pub struct Metrics {
    /// `ckpt_epochs_total{outcome, failed_phase}`.
    pub epochs: IntCounterVec,
    /// `ckpt_phase_duration_seconds{phase}`: each phase of a committed epoch, as the barrier
    /// over every node saw it.
    pub phase_seconds: HistogramVec,
    /// `ckpt_epoch_frozen_seconds`: how long the job was frozen (committed epochs).
    pub frozen_seconds: Histogram,
    /// `ckpt_epoch_duration_seconds`: from the request to the commit.
    pub epoch_seconds: Histogram,
    /// `ckpt_image_bytes_total`: image bytes of committed epochs.
    pub image_bytes: IntCounter,
    /// `ckpt_flushes_total{outcome}`.
    pub flushes: IntCounterVec,
    /// `ckpt_flush_bytes_total`: bytes written to shared storage (new chunks only).
    pub flush_bytes: IntCounter,
    /// `ckpt_flush_duration_seconds`.
    pub flush_seconds: Histogram,
    /// `ckpt_flush_backlog_epochs`: epochs whose partner copies or flush are queued or
    /// running.
    pub flush_backlog: IntGauge,
    /// `ckpt_partner_copies_total{outcome}`: one per node and epoch.
    pub partner_copies: IntCounterVec,
    /// `ckpt_restarts_total{outcome}`.
    pub restarts: IntCounterVec,
    /// `ckpt_restart_duration_seconds`: successful restarts, from the request until the job
    /// runs again.
    pub restart_seconds: Histogram,
    /// `ckpt_recoveries_total{outcome}`: restarts ckptd made by itself (`--on-failure`).
    pub recoveries: IntCounterVec,
    /// `ckpt_recovery_duration_seconds`: from a lost node's last contact until its job runs
    /// again elsewhere.
    pub recovery_seconds: Histogram,
    /// `ckpt_agents{state}`: registered agents up and down.
    pub agents: IntGaugeVec,
    /// `ckpt_jobs{state}`: jobs by state.
    pub jobs: IntGaugeVec,
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec())).expect("valid")
}

fn counters(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid")
}

impl Metrics {
    fn new() -> Metrics {
        Metrics {
            epochs: counters(
                "ckpt_epochs_total",
                "Checkpoint epochs ended, by outcome (committed, failed) and the phase a failed one failed in.",
                &["outcome", "failed_phase"],
            ),
            phase_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "ckpt_phase_duration_seconds",
                    "Duration of each phase of committed epochs, over every node of the job.",
                )
                .buckets(LATENCY.to_vec()),
                &["phase"],
            )
            .expect("valid"),
            frozen_seconds: histogram(
                "ckpt_epoch_frozen_seconds",
                "How long committed epochs kept their job frozen.",
                LATENCY,
            ),
            epoch_seconds: histogram(
                "ckpt_epoch_duration_seconds",
                "Duration of committed epochs, from the request to the commit.",
                LATENCY,
            ),
            image_bytes: IntCounter::new(
                "ckpt_image_bytes_total",
                "Image bytes of committed epochs, over every node.",
            )
            .expect("valid"),
            flushes: counters(
                "ckpt_flushes_total",
                "Flushes of committed epochs to shared storage, by outcome (durable, failed).",
                &["outcome"],
            ),
            flush_bytes: IntCounter::new(
                "ckpt_flush_bytes_total",
                "Bytes written to shared storage by flushes (chunks not already there).",
            )
            .expect("valid"),
            flush_seconds: histogram(
                "ckpt_flush_duration_seconds",
                "Duration of flushes to shared storage that made an epoch durable.",
                FLUSH,
            ),
            flush_backlog: IntGauge::new(
                "ckpt_flush_backlog_epochs",
                "Committed epochs whose partner copies or flush to shared storage are queued or running.",
            )
            .expect("valid"),
            partner_copies: counters(
                "ckpt_partner_copies_total",
                "Copies of a node's images of an epoch to its partner node, by outcome (done, failed).",
                &["outcome"],
            ),
            restarts: counters(
                "ckpt_restarts_total",
                "Restarts of jobs from committed epochs, by outcome (done, failed).",
                &["outcome"],
            ),
            restart_seconds: histogram(
                "ckpt_restart_duration_seconds",
                "Duration of successful restarts, until the job runs again on every node.",
                LATENCY,
            ),
            recoveries: counters(
                "ckpt_recoveries_total",
                "Restarts of failed jobs ckptd made by itself (--on-failure), by outcome (done, failed, gave_up).",
                &["outcome"],
            ),
            recovery_seconds: histogram(
                "ckpt_recovery_duration_seconds",
                "From a lost node's last contact with ckptd until its job runs again by itself.",
                LATENCY,
            ),
            agents: IntGaugeVec::new(
                Opts::new(
                    "ckpt_agents",
                    "Registered node agents, by state (up: a heartbeat within node_timeout; down).",
                ),
                &["state"],
            )
            .expect("valid"),
            jobs: IntGaugeVec::new(Opts::new("ckpt_jobs", "Jobs by state."), &["state"])
                .expect("valid"),
        }
    }

    fn register(&self) {
        ckpt_daemon::metrics::register(vec![
            Box::new(self.epochs.clone()),
            Box::new(self.phase_seconds.clone()),
            Box::new(self.frozen_seconds.clone()),
            Box::new(self.epoch_seconds.clone()),
            Box::new(self.image_bytes.clone()),
            Box::new(self.flushes.clone()),
            Box::new(self.flush_bytes.clone()),
            Box::new(self.flush_seconds.clone()),
            Box::new(self.flush_backlog.clone()),
            Box::new(self.partner_copies.clone()),
            Box::new(self.restarts.clone()),
            Box::new(self.restart_seconds.clone()),
            Box::new(self.recoveries.clone()),
            Box::new(self.recovery_seconds.clone()),
            Box::new(self.agents.clone()),
            Box::new(self.jobs.clone()),
            Box::new(
                prometheus::IntGauge::with_opts(
                    Opts::new(
                        "ckpt_coordinator_info",
                        "ckptd's version, as a label; always 1.",
                    )
                    .const_label("version", env!("CARGO_PKG_VERSION")),
                )
                .inspect(|g| g.set(1))
                .expect("valid"),
            ),
        ]);
        // Outcomes every dashboard expects, present (at 0) before the first one happens.
        self.epochs.with_label_values(&["committed", ""]);
        for o in ["durable", "failed"] {
            self.flushes.with_label_values(&[o]);
        }
        for o in ["done", "failed"] {
            self.partner_copies.with_label_values(&[o]);
            self.restarts.with_label_values(&[o]);
        }
        for o in ["done", "failed", "gave_up"] {
            self.recoveries.with_label_values(&[o]);
        }
    }
}

/// The coordinator's metrics, registered in the default registry on first use.
pub fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = Metrics::new();
        m.register();
        m
    })
}

/// Counts a flush task queued or running while it lives.
#[derive(Debug)]
pub(crate) struct Backlog;

impl Backlog {
    pub(crate) fn enter() -> Backlog {
        metrics().flush_backlog.inc();
        Backlog
    }
}

impl Drop for Backlog {
    fn drop(&mut self) {
        metrics().flush_backlog.dec();
    }
}
