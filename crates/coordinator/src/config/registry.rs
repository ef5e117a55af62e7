//! The `[registry]` table of ckptd.toml: the redb file of one head node, or an etcd cluster
//! shared by an active ckptd and its standbys, with the checks that name the key to set.
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;

/// The `[registry]` table: where the job registry lives.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// `"redb"`: the `database` file of this head node. `"etcd"`: an etcd cluster; several
    /// ckptd may then run (on several head nodes), one active and the others standing by.
    pub backend: String,
    /// The etcd cluster's client URLs (`https://head1:2379`, ...): TLS only.
    pub endpoints: Vec<String>,
    /// Where ckpt's keys live in etcd.
    pub prefix: String,
    /// How long the active ckptd holds its leadership without renewing it: a standby takes
    /// over this long after the active ckptd is lost. Whole seconds, 2 s at least (etcd's least
    /// lease), and longer than etcd takes to elect a new leader when its own is lost (up to
    /// twice its election timeout, 1 s by default), or the active ckptd stops then; and
    /// `fence_lease` at least twice it and 1 s more, so that the agents' leases outlast a
    /// failover (with the default 5 s: `fence_lease = "11s"`, or `node_timeout = "22s"`).
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// The CA that signed the etcd members' certificates (PEM).
    pub ca: Option<PathBuf>,
    /// ckptd's client certificate for etcd (PEM): etcd admits ckptd alone (`--client-cert-auth`).
    pub cert: Option<PathBuf>,
    /// Its private key (PEM).
    pub key: Option<PathBuf>,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        RegistryConfig {
            backend: "redb".into(),
            endpoints: Vec::new(),
            prefix: "/ckpt/".into(),
            lease: Duration::from_secs(5),
            ca: None,
            cert: None,
            key: None,
        }
    }
}

impl RegistryConfig {
    /// Whether the registry lives in etcd.
    pub fn etcd(&self) -> bool {
        self.backend == "etcd"
    }

    pub(super) fn validate(&self, fence_lease: Duration) -> Result<(), ConfigError> {
        let invalid = |key, problem: String| Err(ConfigError::Invalid { key, problem });
        match self.backend.as_str() {
            "redb" => return Ok(()),
            "etcd" => {}
            other => {
                return invalid(
                    "registry.backend",
                    format!("is {other:?}: \"redb\" (a file on this head node) or \"etcd\""),
                )
            }
        }
        if self.endpoints.is_empty() {
            return invalid(
                "registry.endpoints",
                "must list the etcd cluster's client URLs (https://HOST:2379, ...)".into(),
            );
        }
        if let Some(e) = self.endpoints.iter().find(|e| !e.starts_with("https://")) {
            return invalid(
                "registry.endpoints",
                format!("has {e}: the registry holds every job's secret and command line, so ckptd reaches etcd over TLS only (https://HOST:PORT)"),
            );
        }
        if self.ca.is_none() || self.cert.is_none() || self.key.is_none() {
            return invalid(
                "registry.ca",
                "`ca` (the etcd members' CA), `cert` and `key` (ckptd's client certificate) are all needed: etcd must admit ckptd alone (--client-cert-auth)".into(),
            );
        }
        if !self.prefix.starts_with('/') || !self.prefix.ends_with('/') {
            return invalid(
                "registry.prefix",
                format!("is {:?}: it begins and ends with '/'", self.prefix),
            );
        }
        if self.lease < Duration::from_secs(2) || self.lease.subsec_nanos() != 0 {
            return invalid(
                "registry.lease",
                "must be whole seconds, 2 s at least (etcd grants no shorter lease)".into(),
            );
        }
        let least = self.lease * 2 + Duration::from_secs(1);
        if fence_lease < least {
            return invalid(
                "registry.lease",
                format!(
                    "({}) needs fence_lease ({}) of twice it and 1 s more, {} (node_timeout {} or more leaves that by default): a standby takes over up to a lease after the active ckptd was lost, and the agents must reach it before their leases end and their jobs are fenced",
                    humantime::format_duration(self.lease),
                    humantime::format_duration(fence_lease),
                    humantime::format_duration(least),
                    humantime::format_duration(least * 2),
                ),
            );
        }
        Ok(())
    }
}
