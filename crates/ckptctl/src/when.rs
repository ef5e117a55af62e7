//! Times users write for `--deadline`: `08:00`, `tomorrow 08:00`, `2026-11-25 08:00`,
//! `+90m` (from now), `@1795600000` (Unix seconds); local time unless they end in `Z`. And
//! times as ckptctl shows them, in local time: [`local`] in full, [`clock`] short for today.
use std::time::Duration;

pub use ckpt_proto::now_ms;

fn tm_now() -> libc::tm {
    let t: libc::time_t = (now_ms() / 1000) as libc::time_t;
    // SAFETY: localtime_r writes into the zeroed tm we own.
    unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&t, &mut tm);
        tm
    }
}

/// Seconds since the Unix epoch of a broken-down time, local or UTC.
fn to_unix(tm: &mut libc::tm, utc: bool) -> Option<i64> {
    tm.tm_isdst = -1;
    // SAFETY: mktime/timegm read and normalize the tm we own.
    let t = unsafe {
        if utc {
            libc::timegm(tm)
        } else {
            libc::mktime(tm)
        }
    };
    (t != -1).then_some(t as i64)
}

fn parse_clock(t: &str) -> Option<(i32, i32, i32)> {
    let parts: Vec<&str> = t.split(':').collect();
    let num = |s: &str| s.parse::<i32>().ok();
    let (h, m, s) = match parts.as_slice() {
        [h, m] => (num(h)?, num(m)?, 0),
        [h, m, s] => (num(h)?, num(m)?, num(s)?),
        _ => return None,
    };
    ((0..24).contains(&h) && (0..60).contains(&m) && (0..61).contains(&s)).then_some((h, m, s))
}

fn parse_date(d: &str) -> Option<(i32, i32, i32)> {
    let parts: Vec<i32> = d
        .split('-')
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    match parts.as_slice() {
        [y, m, d] if (1..=12).contains(m) && (1..=31).contains(d) => Some((*y, *m, *d)),
        _ => None,
    }
}

/// Parses a deadline; milliseconds since the Unix epoch.
pub fn parse_deadline(text: &str) -> Result<u64, String> {
    let bad = || {
        format!(
            "--deadline {text:?}: write a time as 08:00, tomorrow 08:00, 2026-11-25 08:00, +90m (from now) or @UNIXSECONDS"
        )
    };
    let t = text.trim();
    if let Some(rel) = t.strip_prefix('+').or_else(|| t.strip_prefix("in ")) {
        let d = rel
            .trim()
            .parse::<u64>()
            .map(Duration::from_secs)
            .or_else(|_| humantime::parse_duration(rel.trim()))
            .map_err(|_| bad())?;
        return Ok(now_ms() + d.as_millis() as u64);
    }
    if let Some(secs) = t.strip_prefix('@') {
        return secs.parse::<u64>().map(|s| s * 1000).map_err(|_| bad());
    }
    let (t, utc) = match t.strip_suffix('Z') {
        Some(rest) => (rest, true),
        None => (t, false),
    };
    let (day, clock, tomorrow) = if let Some(c) = t.strip_prefix("tomorrow ") {
        (None, c.trim(), true)
    } else if let Some((d, c)) = t.split_once(['T', ' ']) {
        (Some(parse_date(d.trim()).ok_or_else(bad)?), c.trim(), false)
    } else {
        (None, t, false)
    };
    let (h, m, s) = parse_clock(clock).ok_or_else(bad)?;
    let mut tm = tm_now();
    if let Some((y, mo, d)) = day {
        tm.tm_year = y - 1900;
        tm.tm_mon = mo - 1;
        tm.tm_mday = d;
    } else if tomorrow {
        tm.tm_mday += 1;
    }
    tm.tm_hour = h;
    tm.tm_min = m;
    tm.tm_sec = s;
    let secs = to_unix(&mut tm, utc).ok_or_else(bad)?;
    u64::try_from(secs).map(|s| s * 1000).map_err(|_| bad())
}

/// A time in local time, `2026-11-25 08:00:00`.
pub fn local(ms: u64) -> String {
    let t = (ms / 1000) as libc::time_t;
    // SAFETY: localtime_r writes into the zeroed tm we own.
    let tm = unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&t, &mut tm);
        tm
    };
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// A time of today as `12:03:04`, an older one as `2026-11-25 12:03`.
pub(crate) fn clock(ms: u64) -> String {
    let today = local(now_ms());
    let t = local(ms);
    match (t.split_once(' '), today.split_once(' ')) {
        (Some((d, time)), Some((d2, _))) if d == d2 => time.to_string(),
        _ => t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_parse_relative_absolute_and_clock_times() {
        let now = now_ms();
        let in90 = parse_deadline("+90m").unwrap();
        assert!((in90 - now).abs_diff(90 * 60_000) < 2_000);
        assert!((parse_deadline("+15").unwrap() - now).abs_diff(15_000) < 2_000);
        assert_eq!(parse_deadline("@1795600000").unwrap(), 1_795_600_000_000);
        assert_eq!(
            parse_deadline("2026-11-25T08:00:00Z").unwrap(),
            1_795_593_600_000
        );
        let today = parse_deadline("08:00").unwrap();
        let tomorrow = parse_deadline("tomorrow 08:00").unwrap();
        assert!(
            (tomorrow - today).abs_diff(86_400_000) <= 3_600_000,
            "DST at most"
        );
        assert_eq!(local(today).get(11..16), Some("08:00"));
        for bad in ["soon", "25:00", "2026-13-01 08:00", "+", "@x"] {
            let e = parse_deadline(bad).unwrap_err();
            assert!(e.contains("tomorrow 08:00"), "{bad}: {e}");
        }
    }
}
