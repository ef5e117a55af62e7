//! TOML configuration files: parsed with defaults for missing keys, then validated; every
//! error names the file, or the key and the line.
use std::path::{Path, PathBuf};

/// Errors reading or validating the configuration. Each names the file or the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// Config file.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema (unknown key, wrong type, ...).
    #[error("invalid config {path}: {message}")]
    Parse {
        /// Config file.
        path: PathBuf,
        /// Parser message, naming the key and line.
        message: String,
    },
    /// A value is out of range.
    #[error("invalid config: `{key}` {problem}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// What is wrong with it.
        problem: String,
    },
}

/// Parses TOML text into a config; `path` only names the source in errors, which name the key
/// and line.
pub fn parse_toml<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.into(),
        message: e.to_string().trim().to_string(),
    })
}

/// Reads a TOML config file. When `path` is the daemon's default location and does not exist,
/// the built-in defaults are used, so a daemon runs without a config file; any other missing
/// file is an error.
pub fn load_or_default<T: serde::de::DeserializeOwned + Default>(
    path: &Path,
    default_path: &Path,
) -> Result<T, ConfigError> {
    if path == default_path && !path.exists() {
        return Ok(T::default());
    }
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.into(),
        source,
    })?;
    parse_toml(path, &text)
}

/// A daemon config read from TOML: parsed with defaults for missing keys, then validated.
pub trait TomlConfig: serde::de::DeserializeOwned + Default {
    /// Checks values that the schema alone cannot; the error names the key.
    fn validate(&self) -> Result<(), ConfigError>;

    /// Reads and validates a TOML file.
    fn load(path: &Path) -> Result<Self, ConfigError> {
        let cfg: Self = load_or_default(path, Path::new(""))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses and validates TOML text; `path` only names the source in errors.
    fn from_toml(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let cfg: Self = parse_toml(path, text)?;
        cfg.validate()?;
        Ok(cfg)
    }
}
