//! What reaches a terminal. Job names, commands, working directories and process names are a
//! user's words, and root reads them in `ckptctl list`: a name holding an escape sequence
//! would otherwise drive root's terminal (retitle it, rewrite what is on screen, answer back
//! keystrokes). Every text line ckptctl prints goes through [`clean`], which shows control
//! characters and the Unicode controls that reorder text as escapes (`\e[2J` stays visible as
//! `\x1b[2J`); fields a user chose also lose their line breaks ([`field`]), so that a name
//! cannot fake a line of ckptctl's own. JSON output is already escaped by the encoder.
use std::borrow::Cow;
use std::fmt::Write as _;

/// Unicode controls that change the order in which a terminal shows text (bidirectional
/// embeddings, overrides and isolates): shown as escapes like the C0 and C1 controls.
fn reorders(c: char) -> bool {
    matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn unsafe_char(c: char, keep_newline: bool) -> bool {
    (c.is_control() && !(keep_newline && c == '\n')) || reorders(c)
}

fn escape(s: &str, keep_newline: bool) -> Cow<'_, str> {
    if !s.chars().any(|c| unsafe_char(c, keep_newline)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            c if !unsafe_char(c, keep_newline) => out.push(c),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
        }
    }
    Cow::Owned(out)
}

/// A whole text line (or several): control characters other than line breaks escaped.
pub fn clean(s: &str) -> Cow<'_, str> {
    escape(s, true)
}

/// A field a user chose (a job's name, an argument, a path, a process name): every control
/// character escaped, line breaks included.
pub fn field(s: &str) -> Cow<'_, str> {
    escape(s, false)
}

/// A command line in words: its arguments, each a [`field`], joined by spaces.
pub fn command(argv: &[String]) -> String {
    argv.iter()
        .map(|a| field(a).into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// `println!` through [`clean`].
macro_rules! say {
    ($($t:tt)*) => {
        println!("{}", $crate::term::clean(&format!($($t)*)))
    };
}

/// `eprintln!` through [`clean`].
macro_rules! say_err {
    ($($t:tt)*) => {
        eprintln!("{}", $crate::term::clean(&format!($($t)*)))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_sequences_are_shown_not_sent() {
        assert_eq!(clean("heat\x1b]0;pwned\x07"), "heat\\x1b]0;pwned\\x07");
        assert_eq!(clean("a\x1b[2Jb\u{9b}c\x7f"), "a\\x1b[2Jb\\x9bc\\x7f");
        assert_eq!(clean("evil\u{202e}txt.exe"), "evil\\u{202e}txt.exe");
        assert_eq!(clean("two\nlines\r"), "two\nlines\\r");
    }

    #[test]
    fn fields_cannot_fake_a_line() {
        assert_eq!(field("x\nckptctl: done"), "x\\nckptctl: done");
        assert_eq!(field("tab\there"), "tab\\there");
        assert_eq!(
            command(&["/bin/echo".into(), "a\x1bb".into()]),
            "/bin/echo a\\x1bb"
        );
    }

    #[test]
    fn plain_text_is_borrowed_unchanged() {
        assert!(matches!(clean("job 4 (heat-é): running"), Cow::Borrowed(_)));
        assert!(matches!(field("naïve 名前"), Cow::Borrowed(_)));
    }
}
