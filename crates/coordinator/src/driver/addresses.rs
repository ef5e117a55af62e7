//! Job addresses: with a `[job_network]`, every part of a job gets an address of its own, which
//! the node's agent gives to the part's sandbox and which stays the part's wherever a restart
//! puts it. A job keeps its addresses while it runs and after it ended in a way a restart
//! follows ([`Job::holds_addresses`]).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use super::{Coordinator, DriveError};
use crate::model::Job;

impl Coordinator {
    /// Gives `job`'s part on `node` a free job address (kept if it has one); nothing without a
    /// job network, nor to a job whose engine virtualizes the network itself
    /// ([`Job::engine_virtualizes`]). Call with the state lock held, and store the job
    /// afterwards.
    pub(super) fn take_address(&self, job: &mut Job, node: &str) -> Result<(), DriveError> {
        let Some((first, last)) = self
            .cfg
            .job_network
            .range()
            .map_err(|e| DriveError::Invalid(format!("[job_network] addresses: {e}")))?
        else {
            return Ok(());
        };
        if job.addresses.contains_key(node) || job.engine_virtualizes() {
            return Ok(());
        }
        self.check_address_quota(job)?;
        let used = self.addresses_in_use(job.id)?;
        let mine: BTreeSet<Ipv4Addr> = job.addresses.values().filter_map(|a| host(a)).collect();
        let free = (u32::from(first)..=u32::from(last))
            .map(Ipv4Addr::from)
            .find(|a| !used.contains(a) && !mine.contains(a))
            .ok_or_else(|| {
                DriveError::Invalid(format!(
                    "no free job address: all of {} are held by running or restartable jobs; widen [job_network] addresses in ckptd.toml or cancel jobs that will not restart",
                    self.cfg.job_network.addresses
                ))
            })?;
        job.addresses.insert(
            node.to_string(),
            format!("{free}/{}", self.cfg.job_network.prefix),
        );
        Ok(())
    }

    /// Checks that `job`'s addresses are not held by another job (a finished job gives them
    /// back; by the time it is restarted another may have them). Call with the state lock held.
    pub(super) fn check_addresses_free(&self, job: &Job) -> Result<(), DriveError> {
        if job.addresses.is_empty() {
            return Ok(());
        }
        let used = self.addresses_in_use(job.id)?;
        for (node, a) in &job.addresses {
            if host(a).is_some_and(|h| used.contains(&h)) {
                return Err(DriveError::Invalid(format!(
                    "job {}'s address {a} (its part on {node}) is now held by another job; cancel that job, or run this one again",
                    job.id
                )));
            }
        }
        Ok(())
    }

    /// The job network's gateway, as agents are sent it.
    pub(super) fn job_gateway(&self) -> String {
        self.cfg.job_network.gateway.clone()
    }

    fn addresses_in_use(&self, except: u64) -> Result<BTreeSet<Ipv4Addr>, DriveError> {
        Ok(self
            .registry
            .jobs()?
            .iter()
            .filter(|j| j.id != except && j.holds_addresses())
            .flat_map(|j| j.addresses.values().filter_map(|a| host(a)))
            .collect())
    }
}

/// The address of `ADDRESS/PREFIX`.
fn host(cidr: &str) -> Option<Ipv4Addr> {
    cidr.split('/').next()?.parse().ok()
}
