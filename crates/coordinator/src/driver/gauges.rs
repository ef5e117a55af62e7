//! The gauges of [`crate::metrics`] that are computed from the coordinator's state at each
//! scrape: agents up and down, jobs by state.
use crate::metrics::metrics;
use crate::model::JobState;

use super::Coordinator;

impl Coordinator {
    /// Sets the gauges computed from the coordinator's state: agents up and down, jobs by
    /// state. Run before each scrape.
    pub fn refresh_metrics(&self) {
        let m = metrics();
        let timeout = self.cfg.node_timeout;
        let (mut up, mut down) = (0, 0);
        for a in self.agents.views() {
            if a.since_seen <= timeout {
                up += 1;
            } else {
                down += 1;
            }
        }
        m.agents.with_label_values(&["up"]).set(up);
        m.agents.with_label_values(&["down"]).set(down);
        if let Ok(jobs) = self.registry.jobs() {
            m.jobs.reset();
            for j in &jobs {
                let state = match &j.state() {
                    JobState::Exited { .. } => "exited".to_string(),
                    s => s.name().replace(' ', "_"),
                };
                m.jobs.with_label_values(&[state.as_str()]).inc();
            }
        }
    }
}
