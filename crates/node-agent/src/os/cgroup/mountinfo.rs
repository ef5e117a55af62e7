//! Where cgroup hierarchies are mounted, from a `/proc/self/mountinfo` text: a directory's
//! path within its hierarchy, as the engine names it, and a v1 hierarchy's mount point.
use std::path::{Path, PathBuf};

use super::Flavor;

/// Of the mounts in a mountinfo text that `fits` (file system type, super options), the
/// deepest over `dir` (of two at one point, the later, visible one): `dir`'s path within that
/// mount's hierarchy (the mount's own root joined with the rest), and the mount's super options.
fn deepest_mount<'a>(
    mountinfo: &'a str,
    dir: &Path,
    fits: impl Fn(&str, &str) -> bool,
) -> Option<(String, &'a str)> {
    let mut best: Option<(usize, String, &str)> = None;
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let f: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(point), Some(fstype)) = (f.get(3), f.get(4), r.first()) else {
            continue;
        };
        let options = r.get(2).copied().unwrap_or_default();
        if !fits(fstype, options) || best.as_ref().is_some_and(|(len, ..)| *len > point.len()) {
            continue;
        }
        let Ok(rest) = dir.strip_prefix(point) else {
            continue;
        };
        let path = Path::new(root).join(rest).display().to_string();
        best = Some((point.len(), path, options));
    }
    best.map(|(_, path, options)| (path, options))
}

/// The path of `dir` within the cgroup hierarchy mounted over it (of the freezer controller for
/// v1, the unified one for v2), from a mountinfo text.
pub(super) fn hierarchy_path(mountinfo: &str, dir: &Path, flavor: Flavor) -> Option<String> {
    let fits = |fstype: &str, options: &str| match flavor {
        Flavor::V1 => fstype == "cgroup" && options.split(',').any(|o| o == "freezer"),
        Flavor::V2 => fstype == "cgroup2",
    };
    deepest_mount(mountinfo, dir, fits).map(|(path, _)| path)
}

/// The engine's name for cgroup v1 directory `dir`, `CONTROLLERS:/PATH` (as CRIU's
/// `--cgroup-root` takes it), from a mountinfo text.
pub(super) fn v1_root(mountinfo: &str, dir: &Path) -> Option<String> {
    let (path, options) = deepest_mount(mountinfo, dir, |fstype, _| fstype == "cgroup")?;
    let controllers: Vec<&str> = options
        .split(',')
        .filter(|o| {
            !matches!(*o, "rw" | "ro" | "xattr" | "noprefix" | "clone_children")
                && !o.starts_with("release_agent=")
        })
        .collect();
    Some(format!("{}:{path}", controllers.join(",")))
}

/// The mount point of the cgroup v1 hierarchy whose controllers are `controllers` (as
/// `/proc/PID/cgroup` names them), mounted at its root.
pub(crate) fn v1_mount(mountinfo: &str, controllers: &str) -> Option<PathBuf> {
    let want: Vec<&str> = controllers.split(',').collect();
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut r = right.split_whitespace();
        if r.next()? != "cgroup" {
            return None;
        }
        let options = r.nth(1)?;
        let l: Vec<&str> = left.split_whitespace().collect();
        let (root, point) = (l.get(3)?, l.get(4)?);
        let has = |c: &&str| options.split(',').any(|o| o == *c);
        (*root == "/" && want.iter().all(has)).then(|| PathBuf::from(point))
    })
}

/// Whether a cgroup v1 freezer hierarchy is mounted here (what Slurm's proctrack/cgroup uses
/// on v1).
pub(crate) fn v1_freezer_mounted() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| v1_mount(&m, "freezer").is_some())
}
