//! Lookups: a verbs layer, after its reconnect, asks for the endpoints of a peer it meets
//! ([`ib_quiesce::control::lookup`]). The agent answers from the job's endpoints it kept at
//! the reconnect, once per node, and only to a process of that job: the endpoints carry memory
//! keys, and the connection is identified as a channel's is.
use std::collections::HashSet;

use ib_quiesce::control::{addresses_of, MAX_LOOKUP_ADDRESSES};

use super::*;

/// Every endpoint of a job as of its last reconnect on this node, indexed by the addresses
/// each is at ([`addresses_of`]): a channel's share and a lookup's answer are gathered from the
/// index, not by comparing every endpoint with every address asked for.
#[derive(Debug)]
pub(super) struct Table {
    endpoints: Vec<Endpoint>,
    by_address: HashMap<u64, Vec<usize>>,
}

impl Table {
    fn new(endpoints: &[Endpoint]) -> Self {
        let mut by_address: HashMap<u64, Vec<usize>> = HashMap::new();
        for (i, e) in endpoints.iter().enumerate() {
            for a in addresses_of(e) {
                let at = by_address.entry(a).or_default();
                // An endpoint's port id can equal its channel id (it never moved).
                if at.last() != Some(&i) {
                    at.push(i);
                }
            }
        }
        Table {
            endpoints: endpoints.to_vec(),
            by_address,
        }
    }

    /// The endpoints at any of `addresses`, each once, in the table's order.
    pub(super) fn at(&self, addresses: &[u64]) -> Vec<Endpoint> {
        let mut found: Vec<usize> = addresses
            .iter()
            .filter_map(|a| self.by_address.get(a))
            .flatten()
            .copied()
            .collect();
        found.sort_unstable();
        found.dedup();
        found
            .into_iter()
            .map(|i| self.endpoints[i].clone())
            .collect()
    }
}

impl Channels {
    /// Keeps `endpoints` as the table of the job of `pids` (in place of its last one), and
    /// returns it; the tables of jobs without a registered channel left go.
    pub(super) async fn keep_table(&self, pids: &[i32], endpoints: &[Endpoint]) -> Arc<Table> {
        let table = Arc::new(Table::new(endpoints));
        let map = self.conns.lock().await;
        let Some(job) = pids.iter().find_map(|p| map.get(p).map(|r| r.job)) else {
            return table;
        };
        let live: HashSet<u64> = map.values().map(|r| r.job).collect();
        drop(map);
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        t.retain(|j, _| live.contains(j));
        t.insert(job, table.clone());
        table
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
        let endpoints = table.map(|t| t.at(addresses)).unwrap_or_default();
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
    pub(super) fn table(&self, job: u64) -> Option<Vec<Endpoint>> {
        self.tables
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&job)
            .map(|t| t.endpoints.clone())
    }
}
