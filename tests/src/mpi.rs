//! The MPI test programs and their reference answers.
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};

use crate::{bin_dir, workspace};

/// Builds the MPI test programs once and returns their directory.
pub fn apps() -> PathBuf {
    static APPS: OnceLock<PathBuf> = OnceLock::new();
    APPS.get_or_init(|| {
        let out = workspace().join("target/apps");
        let st = Command::new("make")
            .arg("-s")
            .arg("-C")
            .arg(workspace().join("tests/apps"))
            .arg(format!("OUT={}", out.display()))
            .arg(format!("IBQ_LIB={}", bin_dir().display()))
            .status()
            .expect("run make");
        assert!(st.success(), "building tests/apps failed");
        out
    })
    .clone()
}

/// An MPI implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mpi {
    /// MPICH (Hydra).
    Mpich,
    /// Open MPI (ORTE).
    OpenMpi,
}

impl Mpi {
    /// The launcher binary.
    pub fn launcher(self) -> &'static str {
        match self {
            Mpi::Mpich => "mpiexec.mpich",
            Mpi::OpenMpi => "mpirun.openmpi",
        }
    }

    /// The heat program built for this MPI.
    pub fn heat_app(self) -> PathBuf {
        apps().join(match self {
            Mpi::Mpich => "heat.mpich",
            Mpi::OpenMpi => "heat.openmpi",
        })
    }

    /// `mpiexec ... heat N ITERS SLEEP_US` with `ranks` ranks on this node.
    pub fn heat_argv(self, ranks: u32, n: u32, iters: u32, sleep_us: u32) -> Vec<String> {
        let app = self.heat_app();
        let mut v: Vec<String> = vec![self.launcher().into()];
        if self == Mpi::OpenMpi {
            v.extend(["--allow-run-as-root", "--oversubscribe"].map(String::from));
        }
        v.extend(["-n".into(), ranks.to_string(), app.display().to_string()]);
        v.extend([n, iters, sleep_us].map(|x| x.to_string()));
        v
    }

    /// `mpiexec ... heat N ITERS SLEEP_US` with `ranks` ranks spread over `hosts` (addresses),
    /// the same number on each.
    pub fn heat_argv_on(
        self,
        hosts: &[&str],
        ranks: u32,
        n: u32,
        iters: u32,
        sleep_us: u32,
    ) -> Vec<String> {
        let mut v = self.heat_argv(ranks, n, iters, sleep_us);
        let per = ranks / hosts.len() as u32;
        let list = match self {
            Mpi::Mpich => hosts.join(","),
            Mpi::OpenMpi => hosts
                .iter()
                .map(|h| format!("{h}:{per}"))
                .collect::<Vec<_>>()
                .join(","),
        };
        let flag = match self {
            Mpi::Mpich => "-hosts",
            Mpi::OpenMpi => "-host",
        };
        v.splice(1..1, [flag.to_string(), list]);
        v
    }

    /// Checksum of an uninterrupted run, computed once per argument set (without the sleep).
    pub fn reference_checksum(self, ranks: u32, n: u32, iters: u32) -> String {
        type Key = (Mpi, u32, u32, u32);
        static CACHE: OnceLock<Mutex<std::collections::HashMap<Key, String>>> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        if let Some(c) = cache.lock().unwrap().get(&(self, ranks, n, iters)) {
            return c.clone();
        }
        let argv = self.heat_argv(ranks, n, iters, 0);
        // Kept on disk beside the programs too, so each test binary does not run it again: the
        // name holds the program's build time, so a rebuilt program is run afresh.
        let built = std::fs::metadata(self.heat_app())
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let kept = apps().join(format!("reference-{self:?}-{ranks}-{n}-{iters}-{built}"));
        if let Some(c) = std::fs::read_to_string(&kept)
            .ok()
            .filter(|c| c.len() == 16)
        {
            cache
                .lock()
                .unwrap()
                .insert((self, ranks, n, iters), c.clone());
            return c;
        }
        let out = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .output()
            .expect("run reference job");
        let c = checksum_in(&String::from_utf8_lossy(&out.stdout))
            .expect("reference run printed a checksum");
        let _ = std::fs::write(&kept, &c);
        cache
            .lock()
            .unwrap()
            .insert((self, ranks, n, iters), c.clone());
        c
    }
}

/// The last `checksum XXXX` in a job's output.
pub fn checksum_in(text: &str) -> Option<String> {
    text.lines()
        .rev()
        .find_map(|l| l.strip_prefix("checksum ").map(|c| c.trim().to_string()))
}
