//! What ckptctl says about itself without ckptd: shell completion, and the manual pages the
//! ckpt-client package installs (both made from the same clap definitions as `--help`).
use std::path::Path;

use clap::CommandFactory;

use crate::cli::Cli;
use crate::Failure;

/// `ckptctl completions SHELL`: the script on stdout.
pub fn completions(shell: clap_complete::Shell) -> Result<(), Failure> {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "ckptctl", &mut std::io::stdout());
    Ok(())
}

/// `ckptctl manual DIR`: ckptctl.1 and a page per visible command (ckptctl-run.1, ...).
pub fn pages(dir: &Path) -> Result<(), Failure> {
    let failed = |what: &str, e: std::io::Error| Failure {
        code: 1,
        message: format!("cannot {what} {}: {e}", dir.display()),
    };
    std::fs::create_dir_all(dir).map_err(|e| failed("make", e))?;
    clap_mangen::generate_to(Cli::command(), dir).map_err(|e| failed("write the pages into", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_for_ckptctl_and_each_visible_command_teaching_the_exit_codes() {
        let d = std::env::temp_dir().join(format!("ckptctl-man-{}", std::process::id()));
        pages(&d).map_err(|f| f.message).unwrap();
        let main = std::fs::read_to_string(d.join("ckptctl.1")).unwrap();
        assert!(main.contains("Exit codes"), "{main}");
        for c in Cli::command().get_subcommands() {
            let page = d.join(format!("ckptctl-{}.1", c.get_name()));
            assert_eq!(page.exists(), !c.is_hide_set(), "{}", page.display());
        }
        let run = std::fs::read_to_string(d.join("ckptctl-run.1")).unwrap();
        assert!(run.contains("\\-\\-checkpoint\\-on"), "{run}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
