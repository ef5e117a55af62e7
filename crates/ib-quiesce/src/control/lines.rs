//! Reading the control protocol's lines under a cap (both ends).
use std::io::BufRead;

/// A line longer than the reader's cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a line longer than the {cap}-byte cap")]
pub struct LineTooLong {
    /// The cap.
    pub cap: usize,
}

/// The part of a line read so far. It never holds more than the cap it is fed with: a line
/// that would grow past it is an error, and the part is dropped.
#[derive(Debug, Default)]
pub struct LineBuf {
    part: Vec<u8>,
}

impl LineBuf {
    /// Takes bytes from `avail` up to and including the next newline. Returns how many it took
    /// and, if the newline was among them, the whole line without it.
    pub fn feed(
        &mut self,
        avail: &[u8],
        cap: usize,
    ) -> std::result::Result<(usize, Option<Vec<u8>>), LineTooLong> {
        let (take, end) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (avail.len(), false),
        };
        if self.part.len() + take > cap {
            self.part = Vec::new();
            return Err(LineTooLong { cap });
        }
        self.part.extend_from_slice(&avail[..take]);
        if end {
            Ok((take + 1, Some(std::mem::take(&mut self.part))))
        } else {
            Ok((take, None))
        }
    }
}

/// What a line reader with cap `cap` returns for `input`, read to its end: the lines (without
/// their newlines) before the first one longer than the cap, and whether it stopped at such a
/// line. An unterminated last part is never returned, but is too long once it passes the cap.
/// The model the readers' property tests (here and in the node agent) check against.
#[doc(hidden)]
pub fn lines_within_cap(input: &[u8], cap: usize) -> (Vec<Vec<u8>>, bool) {
    let mut lines = Vec::new();
    let mut segments: Vec<&[u8]> = input.split(|&b| b == b'\n').collect();
    let last = segments.pop().unwrap_or_default();
    for seg in segments {
        if seg.len() > cap {
            return (lines, true);
        }
        lines.push(seg.to_vec());
    }
    (lines, last.len() > cap)
}

/// Reads the next line of at most `cap` bytes, without its newline; `None` at the end of the
/// stream (an unterminated last line is dropped: its writer died mid-message). A longer line
/// is an `InvalidData` error carrying [`LineTooLong`].
pub fn read_line(
    r: &mut impl BufRead,
    part: &mut LineBuf,
    cap: usize,
) -> std::io::Result<Option<Vec<u8>>> {
    loop {
        let avail = match r.fill_buf() {
            Ok(a) => a,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(None);
        }
        let (used, line) = part
            .feed(avail, cap)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        r.consume(used);
        if line.is_some() {
            return Ok(line);
        }
    }
}
