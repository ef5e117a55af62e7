//! Inside a Slurm job: the allocation a resumed job restarts on (`run --resume`), read from
//! the environment Slurm gives every batch script and step (`SLURM_JOB_ID`,
//! `SLURM_JOB_NODELIST`).
use ckpt_proto::v1 as pb;

/// More node names than a host list of a real allocation expands to: a guard against a list
/// like `n[0-999999999]`.
const MOST_NODES: usize = 1 << 20;

/// The allocation of the Slurm job this ckptctl runs in, or `None` outside one.
pub fn allocation() -> Result<Option<pb::Allocation>, String> {
    let (Ok(id), Ok(list)) = (
        std::env::var("SLURM_JOB_ID"),
        std::env::var("SLURM_JOB_NODELIST"),
    ) else {
        return Ok(None);
    };
    let nodes =
        expand(&list).map_err(|e| format!("SLURM_JOB_NODELIST={list:?} of Slurm job {id}: {e}"))?;
    Ok(Some(pb::Allocation {
        name: format!("Slurm job {id}"),
        nodes,
    }))
}

/// Slurm's compressed host list (`n[1-3,07],login1`, as in `SLURM_JOB_NODELIST`) as names,
/// in its order, as `scontrol show hostnames` gives them: a range keeps the width of its first
/// bound (`n[08-10,3]`: n08, n09, n10, n3); a name may have several bracketed parts
/// (`r[1-2]n[1-2]`).
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for term in split_top(list, ',')? {
        let term = term.trim();
        if term.is_empty() {
            continue;
        }
        expand_term(term, &mut out)?;
    }
    if out.is_empty() {
        return Err("names no node".into());
    }
    Ok(out)
}

/// Splits `s` at `sep` outside brackets.
fn split_top(s: &str, sep: char) -> Result<Vec<&str>, String> {
    let (mut depth, mut start, mut parts) = (0usize, 0usize, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested '[' at byte {i}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("']' without '[' at byte {i}")),
            c if c == sep && depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '[' is not closed".into());
    }
    parts.push(&s[start..]);
    Ok(parts)
}

/// Appends the names of one host term (`n[1-3]x`, `login1`) to `out`.
fn expand_term(term: &str, out: &mut Vec<String>) -> Result<(), String> {
    let Some(open) = term.find('[') else {
        if out.len() >= MOST_NODES {
            return Err(format!("expands to more than {MOST_NODES} names"));
        }
        out.push(term.to_string());
        return Ok(());
    };
    let close = open + term[open..].find(']').ok_or("a '[' is not closed")?;
    let (prefix, ranges, rest) = (&term[..open], &term[open + 1..close], &term[close + 1..]);
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let (lo, hi) = (lo.trim(), hi.trim());
        let number = |s: &str| {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!(
                    "{range:?} in {term:?} is not a number or a range N-M"
                ));
            }
            s.parse::<u64>()
                .map_err(|e| format!("{s:?} in {term:?}: {e}"))
        };
        let (a, b) = (number(lo)?, number(hi)?);
        if a > b {
            return Err(format!("the range {range:?} in {term:?} runs backwards"));
        }
        if b - a >= MOST_NODES as u64 {
            return Err(format!("expands to more than {MOST_NODES} names"));
        }
        for i in a..=b {
            let name = format!("{prefix}{i:0width$}{rest}", width = lo.len());
            expand_term(&name, out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::expand;

    fn names(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    #[test]
    fn a_host_list_expands_as_scontrol_show_hostnames_does() {
        assert_eq!(names("n1"), ["n1"]);
        assert_eq!(names("n[1-3]"), ["n1", "n2", "n3"]);
        assert_eq!(names("n[2-3],n7,login1"), ["n2", "n3", "n7", "login1"]);
        // Each range keeps the width of its own first bound.
        assert_eq!(names("n[08-10,3]"), ["n08", "n09", "n10", "n3"]);
        assert_eq!(names("n[001-003]"), ["n001", "n002", "n003"]);
        assert_eq!(names("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(names("a[1],b[5-5]"), ["a1", "b5"]);
    }

    #[test]
    fn a_host_list_that_is_not_one_is_refused_with_why() {
        for (list, why) in [
            ("", "names no node"),
            ("n[1-3", "not closed"),
            ("n1-3]", "without '['"),
            ("n[3-1]", "backwards"),
            ("n[a-c]", "not a number"),
            ("n[1-]", "not a number"),
            ("n[[1-2]]", "nested"),
            ("n[0-999999999]", "more than"),
        ] {
            let e = expand(list).expect_err(list);
            assert!(e.contains(why), "{list}: {e}");
        }
    }
}
