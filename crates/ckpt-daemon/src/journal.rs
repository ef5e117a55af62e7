//! Logging straight to the systemd journal, with structured fields: when a daemon's stderr is
//! the journal (`$JOURNAL_STREAM` names it), every event goes to journald's native socket with
//! `MESSAGE` (the text stderr would show), `PRIORITY`, `SYSLOG_IDENTIFIER`, and the job, epoch,
//! phase and node of the spans it happened in as `CKPT_JOB`, `CKPT_EPOCH`, `CKPT_PHASE` and
//! `CKPT_NODE`: `journalctl -u ckptd CKPT_JOB=12` shows one job's story across its epochs.
use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::Path;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// journald's socket for the native protocol.
pub const SOCKET: &str = "/run/systemd/journal/socket";

/// Span and event fields that become journal fields, and their journal names.
const KEYS: [(&str, &str); 4] = [
    ("job", "CKPT_JOB"),
    ("epoch", "CKPT_EPOCH"),
    ("phase", "CKPT_PHASE"),
    ("node", "CKPT_NODE"),
];

/// A message longer than this is cut: one datagram carries one entry.
const MAX_MESSAGE: usize = 48 * 1024;

/// Whether stderr is the journal: `$JOURNAL_STREAM` (`DEV:INODE`, set by systemd for a
/// service whose output goes to the journal) names the file stderr is.
pub fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let Ok(m) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    dev.parse() == Ok(m.dev()) && ino.parse() == Ok(m.ino())
}

/// A `tracing` layer that sends each event to journald as one entry.
#[derive(Debug)]
pub struct JournalLayer {
    socket: UnixDatagram,
    identifier: String,
}

impl JournalLayer {
    /// Connects to journald's socket at `path` ([`SOCKET`]); `identifier` is the
    /// `SYSLOG_IDENTIFIER` (the daemon's name).
    pub fn connect(path: &Path, identifier: &str) -> io::Result<JournalLayer> {
        let socket = UnixDatagram::unbound()?;
        socket.connect(path)?;
        Ok(JournalLayer {
            socket,
            identifier: identifier.to_string(),
        })
    }
}

/// The fields recorded on a span.
struct SpanFields(Vec<(String, String)>);

/// Collects an event's or a span's fields: the message apart, the others in order.
#[derive(Default)]
struct Collect {
    message: String,
    fields: Vec<(String, String)>,
}

impl Visit for Collect {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_string();
        } else {
            self.fields
                .push((field.name().to_string(), value.to_string()));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.fields
                .push((field.name().to_string(), format!("{value:?}")));
        }
    }
}

/// Appends `KEY=value` in the native protocol: a value with a newline goes as KEY, newline,
/// its length (64-bit little-endian), the bytes, newline.
fn put(out: &mut Vec<u8>, key: &str, value: &str) {
    out.extend_from_slice(key.as_bytes());
    if value.contains('\n') {
        out.push(b'\n');
        out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    } else {
        out.push(b'=');
    }
    out.extend_from_slice(value.as_bytes());
    out.push(b'\n');
}

fn priority(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "3",
        Level::WARN => "4",
        Level::INFO => "6",
        _ => "7",
    }
}

impl<S> tracing_subscriber::Layer<S> for JournalLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut c = Collect::default();
        attrs.record(&mut c);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(c.fields));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let mut c = Collect::default();
        values.record(&mut c);
        if let Some(span) = ctx.span(id) {
            let mut ext = span.extensions_mut();
            match ext.get_mut::<SpanFields>() {
                Some(f) => f.0.extend(c.fields),
                None => ext.insert(SpanFields(c.fields)),
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        // Outermost span first, the event last: the innermost value of a key wins.
        let mut context: Vec<(String, String)> = Vec::new();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(f) = span.extensions().get::<SpanFields>() {
                    context.extend(f.0.iter().cloned());
                }
            }
        }
        let mut c = Collect::default();
        event.record(&mut c);
        let mut text = c.message;
        for (k, v) in &c.fields {
            text.push_str(&format!(" {k}={v}"));
        }
        if text.len() > MAX_MESSAGE {
            let mut cut = MAX_MESSAGE;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            text.push_str(" [cut]");
        }
        context.extend(c.fields);
        let mut out = Vec::with_capacity(text.len() + 256);
        put(&mut out, "MESSAGE", &text);
        put(&mut out, "PRIORITY", priority(event.metadata().level()));
        put(&mut out, "SYSLOG_IDENTIFIER", &self.identifier);
        put(&mut out, "CKPT_TARGET", event.metadata().target());
        for (key, journal_key) in KEYS {
            if let Some((_, v)) = context.iter().rev().find(|(k, _)| k == key) {
                put(&mut out, journal_key, v);
            }
        }
        // A lost log line must not stop the daemon.
        let _ = self.socket.send(&out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    /// The entries a stand-in journald received, as (key, value) lists.
    fn entries(sock: &UnixDatagram) -> Vec<Vec<(String, String)>> {
        sock.set_nonblocking(true).unwrap();
        let mut out = Vec::new();
        let mut buf = vec![0u8; 128 * 1024];
        while let Ok(n) = sock.recv(&mut buf) {
            let mut fields = Vec::new();
            let mut rest = &buf[..n];
            while !rest.is_empty() {
                let nl = rest.iter().position(|&b| b == b'\n').unwrap();
                let line = std::str::from_utf8(&rest[..nl]).unwrap();
                if let Some((k, v)) = line.split_once('=') {
                    fields.push((k.to_string(), v.to_string()));
                    rest = &rest[nl + 1..];
                } else {
                    let len = u64::from_le_bytes(rest[nl + 1..nl + 9].try_into().unwrap()) as usize;
                    let v = std::str::from_utf8(&rest[nl + 9..nl + 9 + len]).unwrap();
                    fields.push((line.to_string(), v.to_string()));
                    rest = &rest[nl + 10 + len..];
                }
            }
            out.push(fields);
        }
        out
    }

    fn get<'a>(e: &'a [(String, String)], k: &str) -> Option<&'a str> {
        e.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str())
    }

    #[test]
    fn events_carry_the_job_epoch_phase_and_node_of_their_spans() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.sock");
        let journald = UnixDatagram::bind(&path).unwrap();
        let layer = JournalLayer::connect(&path, "ckptd").unwrap();
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let epoch = tracing::info_span!("epoch", job = 12u64, epoch = 3u32);
            let _e = epoch.enter();
            let phase = tracing::info_span!("phase", phase = "quiesce", node = "n2");
            let _p = phase.enter();
            tracing::warn!(frozen_ms = 41u64, "node slow");
            tracing::error!(phase = "abort", "two\nlines");
        });
        drop(tracing::info_span!("outside"));
        let got = entries(&journald);
        assert_eq!(got.len(), 2, "{got:?}");
        let w = &got[0];
        assert_eq!(get(w, "MESSAGE"), Some("node slow frozen_ms=41"));
        assert_eq!(get(w, "PRIORITY"), Some("4"));
        assert_eq!(get(w, "SYSLOG_IDENTIFIER"), Some("ckptd"));
        assert_eq!(get(w, "CKPT_JOB"), Some("12"));
        assert_eq!(get(w, "CKPT_EPOCH"), Some("3"));
        assert_eq!(get(w, "CKPT_PHASE"), Some("quiesce"));
        assert_eq!(get(w, "CKPT_NODE"), Some("n2"));
        let e = &got[1];
        assert_eq!(
            get(e, "MESSAGE"),
            Some("two\nlines phase=abort"),
            "binary form"
        );
        assert_eq!(get(e, "PRIORITY"), Some("3"));
        assert_eq!(
            get(e, "CKPT_PHASE"),
            Some("abort"),
            "the event's own value wins"
        );
    }

    #[test]
    fn stderr_is_the_journal_only_when_journal_stream_names_it() {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata("/proc/self/fd/2").unwrap();
        std::env::set_var("JOURNAL_STREAM", format!("{}:{}", m.dev(), m.ino()));
        assert!(stderr_is_journal());
        std::env::set_var("JOURNAL_STREAM", format!("{}:{}", m.dev(), m.ino() + 1));
        assert!(!stderr_is_journal());
        std::env::remove_var("JOURNAL_STREAM");
        assert!(!stderr_is_journal());
    }
}
