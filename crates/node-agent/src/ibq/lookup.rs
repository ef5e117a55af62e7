//! Lookups: a verbs layer, after its reconnect, asks for the endpoints of a peer it meets
//! ([`ib_quiesce::control::lookup`]). The agent answers from the job's endpoints it kept at
//! the reconnect, once per node, and only to a process of that job: the endpoints carry memory
//! keys, and the connection is identified as a channel's is.
use std::collections::HashSet;

use ib_quiesce::control::{matches_address, MAX_LOOKUP_ADDRESSES};

use super::*;

impl Channels {
    /// Keeps `endpoints` as the table of the job of `pids` (in place of its last one); the
    /// tables of jobs without a registered channel left go.
    pub(super) async fn keep_table(&self, pids: &[i32], endpoints: &[Endpoint]) {
        let map = self.conns.lock().await;
        let Some(job) = pids.iter().find_map(|p| map.get(p).map(|r| r.job)) else {
            return;
        };
        let live: HashSet<u64> = map.values().map(|r| r.job).collect();
        drop(map);
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        t.retain(|j, _| live.contains(j));
        t.insert(job, Arc::new(endpoints.to_vec()));
    }

    /// Answers the lookup of `pid` (of job `job`) for `addresses` on `writer`: the endpoints
    /// of the job's QPs there, none if the job was not reconnected on this node.
    pub(super) async fn answer_lookup(
        &self,
        writer: &mut OwnedWriteHalf,
        pid: i32,
        job: u64,
        addresses: &[u64],
    ) -> Result<(), HelloError> {
        if addresses.len() > MAX_LOOKUP_ADDRESSES {
            return Err(HelloError::LookupTooLarge {
                pid,
                asked: addresses.len(),
                max: MAX_LOOKUP_ADDRESSES,
            });
        }
        let table = self
            .tables
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&job)
            .cloned();
        let endpoints: Vec<Endpoint> = table
            .iter()
            .flat_map(|t| t.iter())
            .filter(|e| addresses.iter().any(|&a| matches_address(e, a)))
            .cloned()
            .collect();
        debug!(
            pid,
            job,
            addresses = addresses.len(),
            endpoints = endpoints.len(),
            "ib-quiesce lookup answered"
        );
        let mut line =
            serde_json::to_vec(&ToChannel::Endpoints { endpoints }).expect("serializable");
        line.push(b'\n');
        writer
            .write_all(&line)
            .await
            .map_err(|source| HelloError::Io { pid, source })
    }

    /// The endpoints kept for `job` (tests).
    #[cfg(test)]
    pub(super) fn table(&self, job: u64) -> Option<Arc<Vec<Endpoint>>> {
        self.tables
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&job)
            .cloned()
    }
}
