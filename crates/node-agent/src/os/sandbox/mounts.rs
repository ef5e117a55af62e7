//! Which of the node's mounts a sandbox keeps following. A part's mount namespace starts as a
//! copy of the node's; a slave copy would receive every mount the node makes afterwards (an
//! automount, a user's `/run/user/UID`, another tool's namespace file), the engine would dump
//! them with the part, and the part could then restore only where they still are: a spare
//! never has the source node's passing mounts. So every mount of the copy is made private,
//! except those at or below the paths a site names (`[job_network] follow_mounts`: automount
//! roots, network file systems whose submounts come and go), which stay slaves of the node's.

use std::path::{Path, PathBuf};

/// The mount points of `mountinfo` (a `/proc/PID/mountinfo`) that a sandbox makes private:
/// every one not at or below a path of `follow`, in the order listed (parents first).
pub(crate) fn to_make_private(mountinfo: &str, follow: &[PathBuf]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for line in mountinfo.lines() {
        let Some(point) = line.split(' ').nth(4).map(unescape) else {
            continue;
        };
        let point = PathBuf::from(point);
        let followed = follow.iter().any(|f| point.starts_with(f));
        if !followed && point.is_absolute() && !out.contains(&point) {
            out.push(point);
        }
    }
    out
}

/// A mount point as the kernel writes it in mountinfo, its octal escapes undone: space, tab,
/// newline and backslash (`\040`, `\011`, `\012`, `\134`); a backslash not followed by three
/// octal digits is kept. The bytes are the path's, UTF-8 or not.
pub(crate) fn unescape(field: &str) -> std::ffi::OsString {
    use std::os::unix::ffi::OsStringExt;
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    std::ffi::OsString::from_vec(out)
}

/// Whether every path a site names to follow is absolute (they are compared with mount points).
pub(crate) fn check_follow(follow: &[PathBuf]) -> Result<(), String> {
    match follow.iter().find(|p| !p.is_absolute() || p == &Path::new("/")) {
        Some(p) => Err(format!(
            "{} is not an absolute path below / (name the mount points whose later submounts a part must see, such as an automount root)",
            p.display()
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone_and_the_rest_kept() {
        assert_eq!(unescape("/mnt/a\\040b\\134c"), "/mnt/a b\\c");
        assert_eq!(unescape("/plain"), "/plain");
        // Not an escape: kept as it is.
        assert_eq!(unescape("/x\\09y\\"), "/x\\09y\\");
    }

    const INFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
30 22 0:26 / /run rw,nosuid shared:5 - tmpfs tmpfs rw
40 22 0:40 / /home rw shared:9 - autofs systemd-1 rw
41 40 0:41 / /home/alice rw shared:10 - nfs4 srv:/alice rw
50 30 0:4 net:[4026532300] /run/netns/other\\040tool rw shared:20 - nsfs nsfs rw
51 22 0:50 / /homework rw shared:21 - tmpfs tmpfs rw
";

    #[test]
    fn every_mount_but_the_followed_ones_is_made_private() {
        let got = to_make_private(INFO, &[PathBuf::from("/home")]);
        let want: Vec<PathBuf> = ["/", "/dev", "/run", "/run/netns/other tool", "/homework"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(
            got, want,
            "/home and below keep following; /homework is not below it"
        );
        assert_eq!(to_make_private(INFO, &[]).len(), 7, "nothing followed");
    }

    #[test]
    fn follow_paths_must_be_absolute_and_not_the_root() {
        assert!(check_follow(&[PathBuf::from("/home"), PathBuf::from("/net")]).is_ok());
        for bad in ["home", "/"] {
            let e = check_follow(&[PathBuf::from(bad)]).unwrap_err();
            assert!(e.contains("absolute path below /"), "{e}");
        }
    }
}
