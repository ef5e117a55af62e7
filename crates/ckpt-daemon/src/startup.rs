//! A daemon's start-up in `main`: its config read, overridden from the command line and
//! validated, `--check-config`, and the exit on a failure. Every message starts with the
//! daemon's name.
use std::path::Path;
use std::process::ExitCode;

use crate::config::ConfigError;

/// Prints `<daemon>: <error>` on stderr and returns the exit code `code`: how a daemon ends
/// when it cannot start.
pub fn fail(daemon: &str, error: impl std::fmt::Display, code: u8) -> ExitCode {
    eprintln!("{daemon}: {error}");
    ExitCode::from(code)
}

/// The config a daemon starts with: `loaded` (the file as read, not yet validated) with the
/// command-line `overrides` applied, then checked by `validate`. A failure of either step is
/// printed as `<daemon>: <error>` and is exit code 2.
pub fn config<T>(
    daemon: &str,
    loaded: Result<T, ConfigError>,
    overrides: impl FnOnce(&mut T),
    validate: impl FnOnce(&T) -> Result<(), ConfigError>,
) -> Result<T, ExitCode> {
    let mut cfg = loaded.map_err(|e| fail(daemon, e, 2))?;
    overrides(&mut cfg);
    validate(&cfg).map_err(|e| fail(daemon, e, 2))?;
    Ok(cfg)
}

/// A command-line override: `value`, when given, replaces the config's `key`.
pub fn set<T>(key: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *key = v;
    }
}

/// `--check-config` once the config at `path` (and the overrides) passed [`config`]: says so
/// and exits 0.
pub fn config_is_valid(daemon: &str, path: &Path) -> ExitCode {
    println!("{daemon}: config {} is valid", path.display());
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_most_10(v: &u32) -> Result<(), ConfigError> {
        if *v > 10 {
            return Err(ConfigError::Invalid {
                key: "v",
                problem: "is above 10".into(),
            });
        }
        Ok(())
    }

    #[test]
    fn overrides_apply_before_validation_and_errors_end_start_up() {
        let cfg = config("d", Ok(20u32), |v| set(v, Some(5)), at_most_10);
        assert_eq!(cfg.ok(), Some(5));
        assert!(config("d", Ok(5u32), |v| set(v, Some(50)), at_most_10).is_err());
        assert!(config("d", Ok(20u32), |v| set(v, None), at_most_10).is_err());
        let unreadable = Err(ConfigError::Parse {
            path: "x.toml".into(),
            message: "bad".into(),
        });
        assert!(config("d", unreadable, |_: &mut u32| {}, at_most_10).is_err());
    }
}
