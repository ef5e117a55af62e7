//! The snapshot engines a job may run under, by the names every side uses for them: requests
//! (`RunRequest.engine`, `LaunchRequest.engine`), ckptd's job records, agents' registrations and
//! the command line.
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A snapshot engine. Its name is its lowercase word, in text and in serde alike.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// CRIU: dumps any process tree the agent froze; the default.
    #[default]
    Criu,
    /// DMTCP: the job runs under DMTCP's launcher and coordinator, which suspend it themselves.
    Dmtcp,
}

impl Engine {
    /// Every engine, the default first.
    pub const ALL: [Engine; 2] = [Engine::Criu, Engine::Dmtcp];

    /// Its name: "criu" or "dmtcp".
    pub const fn as_str(self) -> &'static str {
        match self {
            Engine::Criu => "criu",
            Engine::Dmtcp => "dmtcp",
        }
    }

    /// The engine a request names, where "" means the default (as in `RunRequest.engine` and
    /// `LaunchRequest.engine`).
    pub fn named(name: &str) -> Result<Engine, UnknownEngine> {
        if name.is_empty() {
            Ok(Engine::default())
        } else {
            name.parse()
        }
    }

    /// Whether the engine virtualizes PIDs and reconnects sockets itself (DMTCP): its jobs run
    /// in the node's namespaces, without a job network address, and move to other nodes
    /// without one.
    pub fn virtualizes(self) -> bool {
        match self {
            Engine::Criu => false,
            Engine::Dmtcp => true,
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is no engine's; says which names are.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown snapshot engine {name:?}: use {}", Engine::ALL.map(Engine::as_str).join(" or "))]
pub struct UnknownEngine {
    /// The name given.
    pub name: String,
}

impl FromStr for Engine {
    type Err = UnknownEngine;

    /// Reads "criu" or "dmtcp", exactly (no other spelling, no "").
    fn from_str(name: &str) -> Result<Engine, UnknownEngine> {
        Engine::ALL
            .into_iter()
            .find(|e| e.as_str() == name)
            .ok_or_else(|| UnknownEngine { name: name.into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_reads_back_from_its_name_in_text_and_in_serde() {
        for e in Engine::ALL {
            assert_eq!(e.as_str().parse::<Engine>(), Ok(e));
            assert_eq!(e.to_string(), e.as_str());
            let json = serde_json::to_string(&e).unwrap();
            assert_eq!(json, format!("\"{}\"", e.as_str()));
            assert_eq!(serde_json::from_str::<Engine>(&json).unwrap(), e);
        }
        assert_eq!(Engine::named(""), Ok(Engine::Criu));
        assert_eq!(Engine::named("dmtcp"), Ok(Engine::Dmtcp));
        assert!(Engine::Dmtcp.virtualizes() && !Engine::Criu.virtualizes());
    }

    #[test]
    fn another_name_is_refused_with_the_names_allowed() {
        for bad in ["CRIU", "podman", " criu", ""] {
            let e = bad.parse::<Engine>().unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("unknown snapshot engine {bad:?}: use criu or dmtcp")
            );
        }
        let e = serde_json::from_str::<Engine>("\"podman\"").unwrap_err();
        assert!(
            e.to_string().contains("criu") && e.to_string().contains("dmtcp"),
            "{e}"
        );
    }
}
