//! ckptd's config file (`/etc/ckpt/ckptd.toml`): the coordinator's keys, and the `[agent]`
//! table of the agent `--standalone` embeds (the keys of `agent.toml`). Both are documented in
//! `packaging/config/ckptd.toml`.
use std::path::Path;

use ckpt_daemon::config::{ConfigError, TomlConfig};
use coordinator::config::CoordinatorConfig;
use node_agent::AgentConfig;

/// The whole file.
#[derive(Debug, Clone)]
pub struct CkptdConfig {
    /// The coordinator's keys.
    pub coordinator: CoordinatorConfig,
    /// The embedded agent's, from `[agent]`.
    pub agent: AgentConfig,
}

impl CkptdConfig {
    /// Reads `path`; the built-in defaults when `path` is the default location and absent.
    /// Not validated yet: command-line overrides come first.
    pub fn load_or_default(path: &Path, default_path: &Path) -> Result<Self, ConfigError> {
        let coordinator: CoordinatorConfig =
            ckpt_daemon::config::load_or_default(path, default_path)?;
        let agent = embedded_agent(path, &coordinator.agent)?;
        Ok(CkptdConfig { coordinator, agent })
    }

    /// Checks both parts; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.coordinator.validate()?;
        self.agent.validate()
    }
}

/// The embedded agent's config from the `[agent]` table. It serves this machine on local
/// sockets only, so its default `listen` is loopback.
fn embedded_agent(path: &Path, table: &toml::Table) -> Result<AgentConfig, ConfigError> {
    let mut agent: AgentConfig =
        table
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                path: path.into(),
                message: format!("in [agent]: {}", e.message().trim()),
            })?;
    if !table.contains_key("listen") {
        agent.listen = "127.0.0.1:0".parse().expect("valid address");
    }
    if table.contains_key("metrics") {
        return Err(ConfigError::Invalid {
            key: "agent.metrics",
            problem: "is not used: ckptd's own [metrics] endpoint covers its embedded agent".into(),
        });
    }
    Ok(agent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn parse(text: &str) -> Result<CkptdConfig, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ckptd.toml");
        std::fs::write(&p, text).unwrap();
        let c = CkptdConfig::load_or_default(&p, Path::new("/nonexistent"))?;
        c.validate()?;
        Ok(c)
    }

    #[test]
    fn the_agent_table_is_the_embedded_agents_config() {
        let c = parse("[deadlines]\ndump = \"2m\"\n[agent]\nnode_name = \"head\"\n").unwrap();
        assert_eq!(c.coordinator.deadlines.dump, Duration::from_secs(120));
        assert_eq!(c.agent.node_name, "head");
        assert!(c.agent.listen.ip().is_loopback(), "{}", c.agent.listen);
    }

    #[test]
    fn errors_in_the_agent_table_name_the_table_and_the_key() {
        let e = parse("[agent]\nnode_nmae = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("[agent]") && e.contains("node_nmae"), "{e}");
        let e = parse("[agent]\nstate_dir = \"relative\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("state_dir"), "{e}");
    }

    #[test]
    fn metrics_go_in_ckptds_table_not_the_embedded_agents() {
        let e = parse("[agent.metrics]\nlisten = \"127.0.0.1:9464\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("agent.metrics") && e.contains("ckptd's own"),
            "{e}"
        );
        let e = parse("[metrics]\nlisten = \"127.0.0.1:9464\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("metrics.token_file"), "{e}");
        let c = parse(
            "[metrics]\nlisten = \"127.0.0.1:9464\"\ntoken_file = \"/etc/ckpt/metrics.token\"\n",
        )
        .unwrap();
        assert_eq!(
            c.coordinator.metrics.listen,
            Some("127.0.0.1:9464".parse().unwrap())
        );
    }

    #[test]
    fn packaged_examples_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/config");
        let c = CkptdConfig::load_or_default(&dir.join("ckptd.toml"), Path::new("")).unwrap();
        c.validate().unwrap();
        AgentConfig::load(&dir.join("agent.toml")).unwrap();
    }
}
