//! Checks on the names and paths this crate reads from files and peers before it uses them.
//!
//! A manifest, a recipe, a commit record or a partner's stream names files that this crate then
//! joins onto a directory and creates, writes or reads, as root. Each such string passes one of
//! these checks first: [`relative_path`] for an image file inside a node directory (and
//! [`file_name`] for a pack inside the packs directory), [`absolute_path`] for a host file a
//! restore puts back, [`node_name`] for a node's directory name.
//!
//! The checks refuse, they never repair: `a/../b` is not turned into `b`, because a decoder that
//! quietly normalised a path would hide a damaged or forged file. They look at the string
//! split at `/`, not at [`Path::components`], which drops interior `.` components and doubled
//! slashes. The errors show the offending string escaped (a NUL or a newline cannot forge a log
//! line) and truncated, and say in words what is wrong with it.
use std::path::Path;

/// Longest path accepted, in bytes (Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest path component accepted, in bytes (Linux's `NAME_MAX`).
pub const MAX_COMPONENT_BYTES: usize = 255;
/// Longest node name accepted, in bytes (Linux's `HOST_NAME_MAX`: a host name always fits).
pub const MAX_NODE_NAME_BYTES: usize = 64;
/// Characters of a refused string shown in an error.
const SHOWN_CHARS: usize = 64;

/// A path from a file or a peer that was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("path {shown} is refused: {problem}")]
pub struct InvalidPath {
    /// The path, escaped and truncated for display.
    pub shown: String,
    /// What is wrong with it.
    pub problem: PathProblem,
}

/// Why a path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathProblem {
    /// The empty string.
    #[error("it is empty")]
    Empty,
    /// Longer than [`MAX_PATH_BYTES`].
    #[error("it is longer than {} bytes", MAX_PATH_BYTES)]
    TooLong,
    /// A component longer than [`MAX_COMPONENT_BYTES`].
    #[error("one of its names is longer than {} bytes", MAX_COMPONENT_BYTES)]
    ComponentTooLong,
    /// Contains a NUL byte.
    #[error("it contains a NUL byte")]
    Nul,
    /// Starts with `/` where a path inside a directory is expected.
    #[error("it is absolute, but must be relative to the directory it belongs to")]
    Absolute,
    /// Does not start with `/` where a host path is expected.
    #[error("it is relative, but must be absolute")]
    Relative,
    /// Has a `..` component.
    #[error("it contains `..`, which could lead outside the directory it belongs to")]
    ParentDir,
    /// Has a `.` component.
    #[error("it contains a `.` component")]
    CurDir,
    /// Has an empty component: a doubled or trailing `/`.
    #[error("it contains an empty name (a doubled or trailing `/`)")]
    EmptyComponent,
    /// More than one component where a single file name is expected.
    #[error("it has more than one component, but must be a single file name")]
    NotAFileName,
}

/// A node name from a file, a peer or a caller that was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("node name {shown} is refused: {problem}")]
pub struct InvalidName {
    /// The name, escaped and truncated for display.
    pub shown: String,
    /// What is wrong with it.
    pub problem: NameProblem,
}

/// Why a node name was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NameProblem {
    /// The empty string.
    #[error("it is empty")]
    Empty,
    /// Longer than [`MAX_NODE_NAME_BYTES`].
    #[error("it is longer than {} bytes", MAX_NODE_NAME_BYTES)]
    TooLong,
    /// `.` or `..`.
    #[error("`.` and `..` are not node names")]
    Dots,
    /// A character other than a letter, a digit, `.`, `_` or `-`.
    #[error("it contains {0:?}; a node name is made of ASCII letters, digits, `.`, `_` and `-`")]
    BadChar(char),
}

/// `s` as a path inside a directory: non-empty, relative, made only of plain names (no `.`,
/// `..` or empty component), no NUL, at most [`MAX_PATH_BYTES`] long with names of at most
/// [`MAX_COMPONENT_BYTES`]. Joined onto a directory, it stays below that directory (as far as
/// the string goes: symbolic links on disk are the directory owner's business).
pub fn relative_path(s: &str) -> Result<&Path, InvalidPath> {
    check_path(s, false)
}

/// `s` as an absolute host path: `/` followed by what [`relative_path`] accepts.
pub fn absolute_path(s: &str) -> Result<&Path, InvalidPath> {
    check_path(s, true)
}

/// `s` as a single file name inside a directory: what [`relative_path`] accepts, in one
/// component.
pub fn file_name(s: &str) -> Result<&str, InvalidPath> {
    relative_path(s)?;
    if s.contains('/') {
        return Err(refused_path(s, PathProblem::NotAFileName));
    }
    Ok(s)
}

/// `s` as a node name, which is also a directory name in every store: ASCII letters, digits,
/// `.`, `_` and `-`, not `.` or `..`, at most [`MAX_NODE_NAME_BYTES`] bytes.
pub fn node_name(s: &str) -> Result<&str, InvalidName> {
    let refuse = |problem| {
        Err(InvalidName {
            shown: shown(s),
            problem,
        })
    };
    if s.is_empty() {
        return refuse(NameProblem::Empty);
    }
    if s.len() > MAX_NODE_NAME_BYTES {
        return refuse(NameProblem::TooLong);
    }
    if s == "." || s == ".." {
        return refuse(NameProblem::Dots);
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return refuse(NameProblem::BadChar(c));
    }
    Ok(s)
}

fn check_path(s: &str, absolute: bool) -> Result<&Path, InvalidPath> {
    if s.is_empty() {
        return Err(refused_path(s, PathProblem::Empty));
    }
    if s.len() > MAX_PATH_BYTES {
        return Err(refused_path(s, PathProblem::TooLong));
    }
    if s.contains('\0') {
        return Err(refused_path(s, PathProblem::Nul));
    }
    let rest = match (s.strip_prefix('/'), absolute) {
        (Some(rest), true) => rest,
        (None, false) => s,
        (Some(_), false) => return Err(refused_path(s, PathProblem::Absolute)),
        (None, true) => return Err(refused_path(s, PathProblem::Relative)),
    };
    for name in rest.split('/') {
        let problem = match name {
            "" => PathProblem::EmptyComponent,
            "." => PathProblem::CurDir,
            ".." => PathProblem::ParentDir,
            n if n.len() > MAX_COMPONENT_BYTES => PathProblem::ComponentTooLong,
            _ => continue,
        };
        return Err(refused_path(s, problem));
    }
    Ok(Path::new(s))
}

fn refused_path(s: &str, problem: PathProblem) -> InvalidPath {
    InvalidPath {
        shown: shown(s),
        problem,
    }
}

/// Whether `s` is a BLAKE3 digest as this crate writes it: 64 lowercase hex digits.
pub(crate) fn is_hex_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `s` quoted with Rust's escapes, cut after [`SHOWN_CHARS`] characters (saying how long it
/// was).
pub(crate) fn shown(s: &str) -> String {
    let head: String = s.chars().take(SHOWN_CHARS).collect();
    if head.len() < s.len() {
        format!("{head:?}... ({} bytes)", s.len())
    } else {
        format!("{s:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::path::Component;

    #[test]
    fn relative_paths() {
        let long_name = "x".repeat(MAX_COMPONENT_BYTES + 1);
        let long_path = "a/".repeat(MAX_PATH_BYTES / 2) + "b";
        let max_path = format!("{}b", "a/".repeat(MAX_PATH_BYTES / 2 - 1)) + "c";
        let max_name = "y".repeat(MAX_COMPONENT_BYTES);
        use PathProblem::*;
        let cases: &[(&str, Option<PathProblem>)] = &[
            ("pages-1.img", None),
            ("extra/3", None),
            ("images/core-100.img", None),
            ("...", None),
            (".hidden/..x", None),
            ("a b/ünïcode", None),
            (&max_name, None),
            (&max_path, None),
            ("", Some(Empty)),
            ("/etc/x", Some(Absolute)),
            ("/", Some(Absolute)),
            ("../../x", Some(ParentDir)),
            ("a/../../x", Some(ParentDir)),
            ("a/..", Some(ParentDir)),
            ("..", Some(ParentDir)),
            ("a/./b", Some(CurDir)),
            ("./a", Some(CurDir)),
            (".", Some(CurDir)),
            ("a//b", Some(EmptyComponent)),
            ("a/", Some(EmptyComponent)),
            ("a\0b", Some(Nul)),
            (&long_name, Some(ComponentTooLong)),
            (&long_path, Some(TooLong)),
        ];
        for (s, want) in cases {
            let got = relative_path(s);
            match want {
                None => assert_eq!(got, Ok(Path::new(s)), "{s:?}"),
                Some(p) => assert_eq!(got.map_err(|e| e.problem), Err(*p), "{s:?}"),
            }
        }
    }

    #[test]
    fn absolute_paths_and_file_names() {
        assert_eq!(absolute_path("/tmp/out"), Ok(Path::new("/tmp/out")));
        assert_eq!(
            absolute_path("/dev/shm/x (deleted)"),
            Ok(Path::new("/dev/shm/x (deleted)"))
        );
        for (s, p) in [
            ("tmp/out", PathProblem::Relative),
            ("/tmp/../etc/shadow", PathProblem::ParentDir),
            ("//tmp", PathProblem::EmptyComponent),
            ("/", PathProblem::EmptyComponent),
            ("", PathProblem::Empty),
        ] {
            assert_eq!(absolute_path(s).map_err(|e| e.problem), Err(p), "{s:?}");
        }
        assert_eq!(file_name("3-1.pack"), Ok("3-1.pack"));
        for (s, p) in [
            ("a/b", PathProblem::NotAFileName),
            ("..", PathProblem::ParentDir),
            ("/x", PathProblem::Absolute),
        ] {
            assert_eq!(file_name(s).map_err(|e| e.problem), Err(p), "{s:?}");
        }
    }

    #[test]
    fn node_names() {
        use NameProblem::*;
        let max = "n".repeat(MAX_NODE_NAME_BYTES);
        let over = "n".repeat(MAX_NODE_NAME_BYTES + 1);
        let cases: &[(&str, Option<NameProblem>)] = &[
            ("n1", None),
            ("node_0.a-b", None),
            ("...", None),
            (&max, None),
            (".", Some(Dots)),
            ("..", Some(Dots)),
            ("a/b", Some(BadChar('/'))),
            ("a b", Some(BadChar(' '))),
            ("nöde", Some(BadChar('ö'))),
            ("a\0", Some(BadChar('\0'))),
            ("", Some(Empty)),
            (&over, Some(TooLong)),
        ];
        for (s, want) in cases {
            let got = node_name(s);
            match want {
                None => assert_eq!(got, Ok(*s), "{s:?}"),
                Some(p) => assert_eq!(got.map_err(|e| e.problem), Err(*p), "{s:?}"),
            }
        }
    }

    #[test]
    fn errors_name_the_path_escaped_and_truncated() {
        let e = relative_path("a/../../x").unwrap_err().to_string();
        assert_eq!(
            e,
            r#"path "a/../../x" is refused: it contains `..`, which could lead outside the directory it belongs to"#
        );
        let e = relative_path("a\0b\n/..").unwrap_err().to_string();
        assert!(e.contains(r#""a\0b\n/..""#), "{e}");
        let long = format!("{}\n", "z".repeat(5000));
        let e = relative_path(&long).unwrap_err().to_string();
        assert!(e.contains("... (5001 bytes)") && e.len() < 200, "{e}");
        let e = node_name("a b").unwrap_err().to_string();
        assert!(e.starts_with(r#"node name "a b" is refused"#), "{e}");
    }

    /// Strings made of the pieces that matter to a path check, plus anything at all.
    fn path_like() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            Just("/".to_string()),
            Just(".".to_string()),
            Just("..".to_string()),
            Just("a".to_string()),
            Just("\0".to_string()),
            "[a-z./]{1,4}",
            any::<String>(),
        ];
        proptest::collection::vec(piece, 0..8).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn an_accepted_relative_path_has_only_normal_components(s in path_like()) {
            if let Ok(p) = relative_path(&s) {
                prop_assert!(!p.as_os_str().is_empty());
                prop_assert!(p.components().all(|c| matches!(c, Component::Normal(_))), "{s:?}");
                prop_assert!(!s.contains('\0'));
                let dir = Path::new("/base");
                prop_assert!(dir.join(p).starts_with(dir));
            }
        }

        #[test]
        fn an_accepted_node_name_is_one_normal_component(s in path_like()) {
            if let Ok(n) = node_name(&s) {
                let mut c = Path::new(n).components();
                prop_assert!(matches!(c.next(), Some(Component::Normal(_))), "{s:?}");
                prop_assert!(c.next().is_none(), "{s:?}");
            }
        }
    }
}
