//! Erasure-coded redundancy of a group of nodes' sealed images: instead of a full copy of every
//! node's images on a partner (twice the bytes), parity computed over a group, from which the
//! images of any `M` lost members of the group can be rebuilt.
//!
//! **What is protected.** A member's *stream*: its manifest file, then every file the manifest
//! lists, in manifest order ([`files::NodeStream`]), the bytes [`crate::stream`] sends to a
//! partner. A rebuilt stream is unpacked through [`crate::stream::Receiver`] ([`files::unpack`]),
//! so the result is checked against the committed manifest digest and every file digest before
//! anything is restored from it.
//!
//! **Layout** ([`Layout`]), for a group of `n` members and `M` parity shards per row (the
//! rotated parity of RAID 5 and 6): there are `n` rows; row `r`'s parity is held by members
//! `r, r+1, ... r+M-1` (mod `n`), and its data are one segment of each of the other `K = n - M`
//! members. So every member holds parity for `M` rows and gives a segment to `K` rows: its
//! stream is cut into `K` segments of equal size (the last padded with zeros), and it stores
//! `M/K` of its own size in parity, never parity of a row it gives data to: losing a member
//! loses at most one shard of any row, and any `M` members at most `M`. A row's shards are as
//! long as the longest segment in it, so uneven streams cost only padding in parity.
//!
//! **Codes** ([`Code`]): `xor` is the plain sum over GF(2) (`M = 1`); `rs:K+M` is Reed-Solomon
//! from the `reed-solomon-simd` crate. Both code position by position, so a row is coded in
//! stripes of [`STRIPE`] bytes with the same result as in one piece (memory stays bounded).
//!
//! **Integrity.** Every parity shard has a BLAKE3 digest in the [`Encoding`] record (committed
//! with the epoch); a shard that does not match is treated as lost ([`verify_parity`]), and a
//! rebuild that then lacks shards is refused, naming the row and what is missing.
//!
//! One file: a group's parity layout, its encoder and its rebuild share the row arithmetic, which
//! must not differ between them.
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub mod files;
pub use files::{EncodedMember, Encoding, NodeStream};

/// Shards are coded in stripes of this many bytes (a multiple of [`ALIGN`]).
pub const STRIPE: usize = 1 << 20;

/// Segment sizes are rounded up to this (the Reed-Solomon coder takes shards of even length;
/// 64 keeps its SIMD paths whole).
pub const ALIGN: u64 = 64;

/// The largest group a scheme may name.
pub const MAX_GROUP: usize = 64;

/// How an epoch's images survive the loss of nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// A full copy of each node's images on another node.
    Partner,
    /// XOR parity over groups of `group` nodes: survives one lost node per group.
    Xor {
        /// Nodes per group.
        group: usize,
    },
    /// Reed-Solomon: per group of `data + parity` nodes, `parity` shards per row; survives
    /// `parity` lost nodes per group.
    Rs {
        /// Data shards per row.
        data: usize,
        /// Parity shards per row.
        parity: usize,
    },
}

/// The group size `xor` takes when none is given.
pub const DEFAULT_XOR_GROUP: usize = 8;

impl Scheme {
    /// Nodes per group (none for `partner`).
    pub fn group_size(&self) -> Option<usize> {
        match *self {
            Scheme::Partner => None,
            Scheme::Xor { group } => Some(group),
            Scheme::Rs { data, parity } => Some(data + parity),
        }
    }

    /// Parity shards per row: how many lost nodes of a group the scheme survives (partner: 1).
    pub fn parity(&self) -> usize {
        match *self {
            Scheme::Partner | Scheme::Xor { .. } => 1,
            Scheme::Rs { parity, .. } => parity,
        }
    }

    /// The code of its parity (none for `partner`).
    pub fn code(&self) -> Option<Code> {
        match *self {
            Scheme::Partner => None,
            Scheme::Xor { .. } => Some(Code::Xor),
            Scheme::Rs { parity, .. } => Some(Code::Rs { parity }),
        }
    }

    /// Bytes stored per image byte with full groups (each node's images, plus its share of
    /// parity).
    pub fn stored_per_image_byte(&self) -> f64 {
        match *self {
            Scheme::Partner => 2.0,
            Scheme::Xor { group } => 1.0 + 1.0 / (group - 1) as f64,
            Scheme::Rs { data, parity } => 1.0 + parity as f64 / data as f64,
        }
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Scheme::Partner => f.write_str("partner"),
            Scheme::Xor { group } => write!(f, "xor:{group}"),
            Scheme::Rs { data, parity } => write!(f, "rs:{data}+{parity}"),
        }
    }
}

impl FromStr for Scheme {
    type Err = String;

    /// `partner`, `xor` (groups of 8), `xor:G` (2 ≤ G ≤ 64), `rs:K+M` (K, M ≥ 1, K + M ≤ 64).
    fn from_str(s: &str) -> Result<Self, String> {
        let usage =
            "a redundancy scheme is `partner`, `xor`, `xor:G` (G nodes per group, 2 to 64) \
                     or `rs:K+M` (K data and M parity shards per group, K + M at most 64)";
        let number = |v: &str| -> Result<usize, String> {
            v.parse::<usize>()
                .map_err(|_| format!("{s:?}: {v:?} is not a number; {usage}"))
        };
        let scheme = match s.split_once(':') {
            None if s == "partner" => Scheme::Partner,
            None if s == "xor" => Scheme::Xor {
                group: DEFAULT_XOR_GROUP,
            },
            Some(("xor", g)) => Scheme::Xor { group: number(g)? },
            Some(("rs", km)) => {
                let (k, m) = km
                    .split_once('+')
                    .ok_or_else(|| format!("{s:?}: no `+` between K and M; {usage}"))?;
                Scheme::Rs {
                    data: number(k)?,
                    parity: number(m)?,
                }
            }
            _ => return Err(format!("{s:?}: unknown; {usage}")),
        };
        match scheme {
            Scheme::Xor { group } if !(2..=MAX_GROUP).contains(&group) => Err(format!(
                "{s:?}: a group has 2 to {MAX_GROUP} nodes; {usage}"
            )),
            Scheme::Rs { data, parity }
                if data == 0 || parity == 0 || data + parity > MAX_GROUP =>
            {
                Err(format!(
                    "{s:?}: K and M are at least 1 and K + M at most {MAX_GROUP}; {usage}"
                ))
            }
            ok => Ok(ok),
        }
    }
}

/// How a group's parity is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Code {
    /// One parity shard per row, the XOR of the row's data.
    Xor,
    /// Reed-Solomon with `parity` shards per row.
    Rs {
        /// Parity shards per row.
        parity: usize,
    },
}

impl Code {
    /// Parity shards per row.
    pub fn parity(&self) -> usize {
        match *self {
            Code::Xor => 1,
            Code::Rs { parity } => parity,
        }
    }
}

/// A node to place in a group, and its failure domain (rack, switch) if the site named one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The node's name.
    pub node: String,
    /// Its failure domain.
    pub domain: Option<String>,
}

/// Splits a job's nodes into the groups of `scheme`: as many groups of the scheme's size as fit,
/// the nodes left over shared among them (so every group has between G and 2G − 1 nodes, and
/// stores no more parity per image byte than the scheme says), or one group of all the nodes
/// when there are fewer than G (it needs one more node than parity shards a row). Nodes with
/// failure domains are dealt so that consecutive members of a group are in
/// different domains where the domains allow it; without, groups follow the nodes' order.
/// `partner` has no groups (an error), and too few nodes for one group is an error naming the
/// least the scheme needs.
pub fn groups(scheme: Scheme, nodes: &[Candidate]) -> Result<Vec<Vec<String>>, String> {
    let Some(size) = scheme.group_size() else {
        return Err("partner copies form no groups".into());
    };
    let parity = scheme.parity();
    let n = nodes.len();
    if n < parity + 1 {
        return Err(format!(
            "{scheme} needs at least {} nodes to protect a job (its parity and one node's \
             images on different nodes); this job has {n}: use `partner` or shared storage",
            parity + 1
        ));
    }
    // Groups of the scheme's size at least (so a row never has fewer data segments than the
    // scheme's, nor more parity per byte), the nodes left over shared among them.
    let count = (n / size).max(1);
    let order = interleave_domains(nodes);
    let (base, extra) = (n / count, n % count);
    let mut out = Vec::with_capacity(count);
    let mut at = 0;
    for g in 0..count {
        let len = base + usize::from(g < extra);
        out.push(order[at..at + len].to_vec());
        at += len;
    }
    Ok(out)
}

/// The nodes' names, taking one of each failure domain in turn (domains in order of first
/// appearance; nodes without one are a domain of their own each).
fn interleave_domains(nodes: &[Candidate]) -> Vec<String> {
    if nodes.iter().all(|c| c.domain.is_none()) {
        return nodes.iter().map(|c| c.node.clone()).collect();
    }
    let mut domains: Vec<(Option<&str>, std::collections::VecDeque<&str>)> = Vec::new();
    for c in nodes {
        let d = c.domain.as_deref();
        match domains.iter_mut().find(|(k, _)| d.is_some() && *k == d) {
            Some((_, q)) => q.push_back(&c.node),
            None => domains.push((d, [c.node.as_str()].into())),
        }
    }
    let mut out = Vec::with_capacity(nodes.len());
    while out.len() < nodes.len() {
        for (_, q) in domains.iter_mut() {
            if let Some(n) = q.pop_front() {
                out.push(n.to_string());
            }
        }
    }
    out
}

/// Where every byte of a group's streams and parity sits ([module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    parity: usize,
    lens: Vec<u64>,
    segment: Vec<u64>,
}

/// One shard of a row: a member's segment (data) or a parity shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contribution {
    /// The member.
    pub member: usize,
    /// Which of its segments.
    pub segment: usize,
}

impl Layout {
    /// The layout of a group whose members' streams are `lens` bytes long, with `parity`
    /// shards per row. A group needs more members than parity shards.
    pub fn new(parity: usize, lens: &[u64]) -> Result<Layout, String> {
        let n = lens.len();
        if parity == 0 || n < parity + 1 || n > MAX_GROUP {
            return Err(format!(
                "a group of {n} members cannot hold {parity} parity shards a row (it needs more \
                 members than parity shards, and at most {MAX_GROUP})"
            ));
        }
        let k = (n - parity) as u64;
        let segment = lens
            .iter()
            .map(|&l| l.div_ceil(k).div_ceil(ALIGN) * ALIGN)
            .collect();
        Ok(Layout {
            parity,
            lens: lens.to_vec(),
            segment,
        })
    }

    /// Members of the group (and rows).
    pub fn members(&self) -> usize {
        self.lens.len()
    }

    /// Parity shards per row.
    pub fn parity(&self) -> usize {
        self.parity
    }

    /// Data segments per row (and per member).
    pub fn data_per_row(&self) -> usize {
        self.members() - self.parity
    }

    /// Member `m`'s stream length.
    pub fn len(&self, m: usize) -> u64 {
        self.lens[m]
    }

    /// The members that hold row `row`'s parity shards, shard 0 first.
    pub fn holders(&self, row: usize) -> Vec<usize> {
        (0..self.parity)
            .map(|j| (row + j) % self.members())
            .collect()
    }

    /// Whether member `m` holds parity of row `row`.
    fn holds(&self, m: usize, row: usize) -> bool {
        (m + self.members() - row) % self.members() < self.parity
    }

    /// Row `row`'s data: one segment of each member that holds none of its parity, in member
    /// order (the order the code numbers them).
    pub fn contributors(&self, row: usize) -> Vec<Contribution> {
        (0..self.members())
            .filter(|&m| !self.holds(m, row))
            .map(|member| Contribution {
                member,
                segment: (0..row).filter(|&r| !self.holds(member, r)).count(),
            })
            .collect()
    }

    /// The size of each of member `m`'s segments.
    pub fn segment_size(&self, m: usize) -> u64 {
        self.segment[m]
    }

    /// The length of row `row`'s shards: its longest segment (0: nothing to protect).
    pub fn row_size(&self, row: usize) -> u64 {
        self.contributors(row)
            .iter()
            .map(|c| self.segment[c.member])
            .max()
            .unwrap_or(0)
    }

    /// Where segment `c` lies in its member's stream: its start and how many of its bytes are
    /// the stream's (the rest, to the row size, is zeros).
    pub fn segment_in_stream(&self, c: Contribution) -> (u64, u64) {
        let start = c.segment as u64 * self.segment[c.member];
        let real = self.lens[c.member]
            .saturating_sub(start)
            .min(self.segment[c.member]);
        (start, real)
    }

    /// Parity bytes member `m` holds.
    pub fn parity_bytes_of(&self, m: usize) -> u64 {
        (0..self.members())
            .filter(|&r| self.holds(m, r))
            .map(|r| self.row_size(r))
            .sum()
    }
}

/// Codes one stripe at a time: the XOR, or a Reed-Solomon coder reused across stripes.
pub struct Coder {
    code: Code,
    encoder: Option<reed_solomon_simd::ReedSolomonEncoder>,
    decoder: Option<reed_solomon_simd::ReedSolomonDecoder>,
}

impl fmt::Debug for Coder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Coder").field("code", &self.code).finish()
    }
}

/// Why coding failed.
#[derive(Debug, thiserror::Error)]
pub enum CodeError {
    /// Reading or writing a shard failed.
    #[error("{what}: {source}")]
    Io {
        /// Which shard, of which member or row.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A row has fewer shards left than its data needs.
    #[error(
        "row {row} cannot be rebuilt: it needs {need} of its shards and {have} are left \
         (lost: {lost}); more members of the group are lost than the scheme survives"
    )]
    NotEnough {
        /// The row.
        row: usize,
        /// Shards needed (its data segments).
        need: usize,
        /// Shards left.
        have: usize,
        /// What was lost, named.
        lost: String,
    },
    /// The Reed-Solomon coder refused (a bug: the layout gives it valid shapes).
    #[error("reed-solomon: {0}")]
    Rs(String),
}

impl Coder {
    /// A coder of `code`.
    pub fn new(code: Code) -> Self {
        Coder {
            code,
            encoder: None,
            decoder: None,
        }
    }

    /// Parity of one stripe: `data` are the row's data at the same position, each `len` bytes
    /// (already padded); returns the `M` parity stripes.
    pub fn encode(&mut self, data: &[&[u8]], len: usize) -> Result<Vec<Vec<u8>>, CodeError> {
        match self.code {
            Code::Xor => {
                let mut p = vec![0u8; len];
                for d in data {
                    xor_into(&mut p, d);
                }
                Ok(vec![p])
            }
            Code::Rs { parity } => {
                let rs = |e: reed_solomon_simd::Error| CodeError::Rs(e.to_string());
                let enc = match &mut self.encoder {
                    Some(e) => {
                        e.reset(data.len(), parity, len).map_err(rs)?;
                        e
                    }
                    None => self.encoder.insert(
                        reed_solomon_simd::ReedSolomonEncoder::new(data.len(), parity, len)
                            .map_err(rs)?,
                    ),
                };
                for d in data {
                    enc.add_original_shard(d).map_err(rs)?;
                }
                let out = enc.encode().map_err(rs)?;
                Ok(out.recovery_iter().map(<[u8]>::to_vec).collect())
            }
        }
    }

    /// The missing data of one stripe: `data[i]` is data shard `i` if it is left, `parity[j]`
    /// parity shard `j` if left, each `len` bytes; returns the missing data shards by index.
    /// The caller has checked that enough are left.
    pub fn decode(
        &mut self,
        data: &[Option<&[u8]>],
        parity: &[Option<&[u8]>],
        len: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, CodeError> {
        match self.code {
            Code::Xor => {
                let missing: Vec<usize> = (0..data.len()).filter(|&i| data[i].is_none()).collect();
                match (missing.as_slice(), parity.first().copied().flatten()) {
                    ([], _) => Ok(Vec::new()),
                    ([i], Some(p)) => {
                        let mut out = p.to_vec();
                        for d in data.iter().flatten() {
                            xor_into(&mut out, d);
                        }
                        Ok(vec![(*i, out)])
                    }
                    _ => Err(CodeError::Rs("xor: more than one shard missing".into())),
                }
            }
            Code::Rs { parity: m } => {
                let rs = |e: reed_solomon_simd::Error| CodeError::Rs(e.to_string());
                if data.iter().all(Option::is_some) {
                    return Ok(Vec::new());
                }
                let dec = match &mut self.decoder {
                    Some(d) => {
                        d.reset(data.len(), m, len).map_err(rs)?;
                        d
                    }
                    None => self.decoder.insert(
                        reed_solomon_simd::ReedSolomonDecoder::new(data.len(), m, len)
                            .map_err(rs)?,
                    ),
                };
                for (i, d) in data.iter().enumerate() {
                    if let Some(d) = d {
                        dec.add_original_shard(i, d).map_err(rs)?;
                    }
                }
                for (j, p) in parity.iter().enumerate() {
                    if let Some(p) = p {
                        dec.add_recovery_shard(j, p).map_err(rs)?;
                    }
                }
                let out = dec.decode().map_err(rs)?;
                Ok(out
                    .restored_original_iter()
                    .map(|(i, s)| (i, s.to_vec()))
                    .collect())
            }
        }
    }
}

fn xor_into(acc: &mut [u8], d: &[u8]) {
    for (a, b) in acc.iter_mut().zip(d) {
        *a ^= b;
    }
}

/// Reads `buf.len()` bytes of member `member`'s stream at `offset` (never past its end).
pub type ReadData<'a> = dyn FnMut(usize, u64, &mut [u8]) -> std::io::Result<()> + 'a;

/// Reads `buf.len()` bytes of parity shard `index` of row `row` at `offset`.
pub type ReadParity<'a> = dyn FnMut(usize, usize, u64, &mut [u8]) -> std::io::Result<()> + 'a;

/// Takes rebuilt bytes of member `member`'s stream at `offset`.
pub type WriteRebuilt<'a> = dyn FnMut(usize, u64, &[u8]) -> std::io::Result<()> + 'a;

/// One parity shard as committed: which row and index, who holds it, its size and digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParityShard {
    /// The row.
    pub row: usize,
    /// Its index among the row's parity shards.
    pub index: usize,
    /// The member that holds it.
    pub holder: usize,
    /// Bytes.
    pub size: u64,
    /// BLAKE3 of its bytes, hex.
    pub digest: String,
}

/// Encodes the parity of `row`: reads each contributor's segment stripe by stripe through
/// `read` (zeros past its stream's end), hands each parity stripe to `write(index, bytes)`
/// and returns the row's shards with their digests.
pub fn encode_row(
    coder: &mut Coder,
    layout: &Layout,
    row: usize,
    read: &mut ReadData<'_>,
    write: &mut dyn FnMut(usize, &[u8]) -> std::io::Result<()>,
) -> Result<Vec<ParityShard>, CodeError> {
    let size = layout.row_size(row);
    let holders = layout.holders(row);
    let contributors = layout.contributors(row);
    let mut hashers: Vec<blake3::Hasher> = holders.iter().map(|_| blake3::Hasher::new()).collect();
    let mut bufs: Vec<Vec<u8>> = contributors.iter().map(|_| Vec::new()).collect();
    let mut at = 0u64;
    while at < size {
        let len = (size - at).min(STRIPE as u64) as usize;
        for (c, buf) in contributors.iter().zip(bufs.iter_mut()) {
            stripe_of(layout, *c, at, len, read, buf)?;
        }
        let data: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
        let parity = coder.encode(&data, len)?;
        for (j, p) in parity.iter().enumerate() {
            hashers[j].update(p);
            write(j, p).map_err(|source| CodeError::Io {
                what: format!("parity shard {j} of row {row}"),
                source,
            })?;
        }
        at += len as u64;
    }
    Ok(holders
        .iter()
        .enumerate()
        .map(|(index, &holder)| ParityShard {
            row,
            index,
            holder,
            size,
            digest: hashers[index].finalize().to_hex().to_string(),
        })
        .collect())
}

/// Fills `buf` with `len` bytes of segment `c` from `at`: the stream's bytes, then zeros.
fn stripe_of(
    layout: &Layout,
    c: Contribution,
    at: u64,
    len: usize,
    read: &mut ReadData<'_>,
    buf: &mut Vec<u8>,
) -> Result<(), CodeError> {
    buf.clear();
    buf.resize(len, 0);
    let (start, real) = layout.segment_in_stream(c);
    if at < real {
        let n = (real - at).min(len as u64) as usize;
        read(c.member, start + at, &mut buf[..n]).map_err(|source| CodeError::Io {
            what: format!("member {} at byte {}", c.member, start + at),
            source,
        })?;
    }
    Ok(())
}

/// Which of a group's shards are gone: members lost, and parity shards found damaged (by row
/// and index).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Losses {
    /// Members whose streams (and the parity they held) are gone.
    pub members: Vec<usize>,
    /// Parity shards that failed their digest.
    pub damaged: Vec<(usize, usize)>,
}

impl Losses {
    fn member(&self, m: usize) -> bool {
        self.members.contains(&m)
    }

    fn parity_left(&self, layout: &Layout, row: usize, index: usize) -> bool {
        !self.member(layout.holders(row)[index]) && !self.damaged.contains(&(row, index))
    }
}

/// Checks before a rebuild that every row with a lost member's segment keeps enough shards,
/// naming the first that does not.
pub fn check_rebuildable(layout: &Layout, losses: &Losses) -> Result<(), CodeError> {
    for row in 0..layout.members() {
        let contributors = layout.contributors(row);
        if !contributors.iter().any(|c| losses.member(c.member)) || layout.row_size(row) == 0 {
            continue;
        }
        let data_left = contributors
            .iter()
            .filter(|c| !losses.member(c.member))
            .count();
        let parity_left = (0..layout.parity())
            .filter(|&j| losses.parity_left(layout, row, j))
            .count();
        if data_left + parity_left < contributors.len() {
            let mut lost: Vec<String> = contributors
                .iter()
                .filter(|c| losses.member(c.member))
                .map(|c| format!("member {}'s segment", c.member))
                .collect();
            lost.extend(
                (0..layout.parity())
                    .filter(|&j| !losses.parity_left(layout, row, j))
                    .map(|j| {
                        let h = layout.holders(row)[j];
                        if losses.member(h) {
                            format!("parity {j} (held by lost member {h})")
                        } else {
                            format!("parity {j} (damaged, on member {h})")
                        }
                    }),
            );
            return Err(CodeError::NotEnough {
                row,
                need: contributors.len(),
                have: data_left + parity_left,
                lost: lost.join(", "),
            });
        }
    }
    Ok(())
}

/// Rebuilds the streams of the `wanted` lost members (every other lost member's bytes are
/// rebuilt only as far as the code needs them, and not handed out): for every row with a wanted
/// member's segment, the
/// surviving segments (through `read`) and the parity shards left (through
/// `read_parity(row, index, offset, buf)`), stripe by stripe; each rebuilt stretch goes to
/// `write(member, offset, bytes)` (never past the member's stream end). Refused before
/// anything is read when a row lacks shards ([`check_rebuildable`]).
pub fn rebuild(
    coder: &mut Coder,
    layout: &Layout,
    losses: &Losses,
    wanted: &[usize],
    read: &mut ReadData<'_>,
    read_parity: &mut ReadParity<'_>,
    write: &mut WriteRebuilt<'_>,
) -> Result<(), CodeError> {
    check_rebuildable(layout, losses)?;
    for row in 0..layout.members() {
        let contributors = layout.contributors(row);
        if !contributors.iter().any(|c| wanted.contains(&c.member)) {
            continue;
        }
        let size = layout.row_size(row);
        let mut data_bufs: Vec<Option<Vec<u8>>> = vec![None; contributors.len()];
        let mut parity_bufs: Vec<Option<Vec<u8>>> = vec![None; layout.parity()];
        let mut at = 0u64;
        while at < size {
            let len = (size - at).min(STRIPE as u64) as usize;
            for (i, c) in contributors.iter().enumerate() {
                data_bufs[i] = if losses.member(c.member) {
                    None
                } else {
                    let mut b = data_bufs[i].take().unwrap_or_default();
                    stripe_of(layout, *c, at, len, read, &mut b)?;
                    Some(b)
                };
            }
            for (j, slot) in parity_bufs.iter_mut().enumerate() {
                *slot = if losses.parity_left(layout, row, j) {
                    let mut b = slot.take().unwrap_or_default();
                    b.clear();
                    b.resize(len, 0);
                    read_parity(row, j, at, &mut b).map_err(|source| CodeError::Io {
                        what: format!("parity shard {j} of row {row} at byte {at}"),
                        source,
                    })?;
                    Some(b)
                } else {
                    None
                };
            }
            let data: Vec<Option<&[u8]>> = data_bufs.iter().map(|b| b.as_deref()).collect();
            let parity: Vec<Option<&[u8]>> = parity_bufs.iter().map(|b| b.as_deref()).collect();
            for (i, bytes) in coder.decode(&data, &parity, len)? {
                let c = contributors[i];
                if !wanted.contains(&c.member) {
                    continue;
                }
                let (start, real) = layout.segment_in_stream(c);
                if at < real {
                    let n = (real - at).min(len as u64) as usize;
                    write(c.member, start + at, &bytes[..n]).map_err(|source| CodeError::Io {
                        what: format!("rebuilt member {} at byte {}", c.member, start + at),
                        source,
                    })?;
                }
            }
            at += len as u64;
        }
    }
    Ok(())
}

/// Checks each parity shard the rebuild would use against its committed digest (read through
/// `read_parity(row, index, offset, buf)`); returns those that do not match, or cannot be read,
/// as damaged. Shards held by lost members are skipped.
pub fn verify_parity(
    layout: &Layout,
    shards: &[ParityShard],
    lost: &[usize],
    read_parity: &mut ReadParity<'_>,
) -> Vec<(usize, usize)> {
    let mut damaged = Vec::new();
    let mut buf = vec![0u8; STRIPE];
    for s in shards {
        if lost.contains(&s.holder) {
            continue;
        }
        if layout.holders(s.row).get(s.index) != Some(&s.holder) {
            damaged.push((s.row, s.index));
            continue;
        }
        let mut h = blake3::Hasher::new();
        let mut at = 0u64;
        let mut ok = true;
        while at < s.size {
            let len = (s.size - at).min(STRIPE as u64) as usize;
            if read_parity(s.row, s.index, at, &mut buf[..len]).is_err() {
                ok = false;
                break;
            }
            h.update(&buf[..len]);
            at += len as u64;
        }
        if !ok || h.finalize().to_hex().as_str() != s.digest {
            damaged.push((s.row, s.index));
        }
    }
    damaged
}

#[cfg(test)]
mod tests;
