//! Deduplicated copies of a node's images in shared storage.
//!
//! One file (tests in `dedup/tests.rs`): the writer and the reader of the pack and
//! recipe format sit side by side so that a change to the format is made to both at once.
//!
//! ```text
//! <shared>/<job>/<epoch>/<node>/MANIFEST          the node manifest, byte for byte (written last)
//! <shared>/<job>/<epoch>/<node>/RECIPE            how every file is rebuilt from chunks
//! <shared>/<job>/packs/<node>/<epoch>-<n>.pack    chunks first stored by that epoch, concatenated
//! ```
//!
//! Files are cut into content-defined chunks (a gear rolling hash; 8 KiB minimum, about
//! 24 KiB on average, 128 KiB maximum), so a region the job did not touch since the last flush
//! yields the same chunks even where it moved within the image. A flush looks every chunk up by
//! its BLAKE3 digest in the newest complete recipe of the same node and writes only chunks not
//! found there (and not written earlier in the same flush) into new pack files; the recipe
//! references chunks in old and new packs alike. Every byte read is also checked against the
//! manifest's file digests, so a damaged local copy fails the flush.
//!
//! A rebuild (restore from shared storage, or `verify`) reads the recipe, checks each chunk's
//! digest, and checks each rebuilt file against the manifest. Deleting an epoch deletes its
//! MANIFEST and RECIPE, then every pack of the node that no remaining recipe references
//! ([`sweep`]); the coordinator never runs a sweep during a flush of the same job.
//!
//! A recipe is read like any file from shared storage: untrusted until checked. Its decoder caps
//! every count before allocating and refuses a pack name or file path that could lead outside
//! its directory; flush, rebuild and sweep refuse a node name that is not one.
use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use crate::copy::{CopyOptions, CopyProgress, Throttle};
use crate::layout::Staging;
use crate::manifest::{self, decode_framed, encode_framed, read_capped, NodeManifest};
use crate::{atomic, error, validate, Result, StoreError};

/// Magic bytes of a recipe.
pub const MAGIC: &[u8; 8] = b"CKPTRCPE";
/// File name of the recipe in a node's shared directory.
pub const RECIPE: &str = "RECIPE";
/// Largest recipe read (about 20 million chunks, over a TiB of images).
pub const MAX_RECIPE_BYTES: u64 = 1 << 30;
/// Most pack names a recipe may list. A recipe lists every pack of the node's earlier copy plus
/// one per file of this epoch, so the list grows with the epochs kept; 16 million names take
/// well over the 1 GiB recipe limit's share anyway.
pub const MAX_PACKS: usize = 1 << 24;
/// Encoded size of one chunk reference: pack index, offset, length, digest.
const CHUNK_REF_BYTES: usize = 4 + 8 + 4 + 32;
/// Set in a chunk reference's encoded length when the chunk is stored zstd-compressed (a
/// reader without compression refuses it as a chunk above 128 KiB instead of misreading it).
const COMPRESSED: u32 = 1 << 31;

const MIN_CHUNK: usize = 8 << 10;
const MAX_CHUNK: usize = 128 << 10;
/// A cut where the low 14 bits of the hash are zero: 16 KiB after the minimum, on average.
const CUT_MASK: u64 = (1 << 14) - 1;

/// A table of 256 pseudo-random words for the gear hash (splitmix64, fixed seed: chunk
/// boundaries must not change between versions, or nothing deduplicates across them).
const GEAR: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut i = 0;
    while i < 256 {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        t[i] = z ^ (z >> 31);
        i += 1;
    }
    t
};

/// Length of the first chunk of `data` (all of it at the end of a file).
fn cut(data: &[u8]) -> usize {
    if data.len() <= MIN_CHUNK {
        return data.len();
    }
    let end = data.len().min(MAX_CHUNK);
    let mut h = 0u64;
    for (i, b) in data.iter().enumerate().take(end).skip(MIN_CHUNK) {
        h = (h << 1).wrapping_add(GEAR[*b as usize]);
        if h & CUT_MASK == 0 {
            return i + 1;
        }
    }
    end
}

/// Where a chunk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRef {
    /// Index into the recipe's pack names.
    pub pack: u32,
    /// Offset in the pack.
    pub offset: u64,
    /// Length in the pack (compressed, if it is).
    pub len: u32,
    /// BLAKE3 of the chunk (as the file holds it, uncompressed).
    pub digest: [u8; 32],
    /// Stored as one zstd frame, smaller than the chunk itself.
    pub compressed: bool,
}

/// How one file is rebuilt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRecipe {
    /// Path relative to the node directory (as in the manifest).
    pub path: String,
    /// Its chunks in order.
    pub chunks: Vec<ChunkRef>,
}

/// How a node's files of one epoch are rebuilt from packs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Recipe {
    /// Pack file names (in `<shared>/<job>/packs/<node>/`).
    pub packs: Vec<String>,
    /// Files, in manifest order.
    pub files: Vec<FileRecipe>,
}

impl Recipe {
    /// Encodes the recipe in its framed binary form (see `docs/formats.md`).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        let put_str = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u32).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        b.extend_from_slice(&(self.packs.len() as u32).to_le_bytes());
        for p in &self.packs {
            put_str(&mut b, p);
        }
        b.extend_from_slice(&(self.files.len() as u32).to_le_bytes());
        for f in &self.files {
            put_str(&mut b, &f.path);
            b.extend_from_slice(&(f.chunks.len() as u32).to_le_bytes());
            for c in &f.chunks {
                b.extend_from_slice(&c.pack.to_le_bytes());
                b.extend_from_slice(&c.offset.to_le_bytes());
                let len = if c.compressed {
                    c.len | COMPRESSED
                } else {
                    c.len
                };
                b.extend_from_slice(&len.to_le_bytes());
                b.extend_from_slice(&c.digest);
            }
        }
        encode_framed(MAGIC, &b)
    }

    /// Decodes a recipe; `path` only names the file in errors. Every count is checked against
    /// its limit ([`MAX_PACKS`], [`manifest::MAX_FILES`]) and against the bytes left before
    /// anything is allocated for it; every pack name must be a plain file name and every file
    /// path a plain relative path ([`crate::validate`]); every chunk must be 1 to 128 KiB long
    /// and in a listed pack.
    pub fn decode(path: &Path, bytes: &[u8]) -> Result<Recipe> {
        let body = decode_framed(path, MAGIC, bytes)?;
        let bad = || StoreError::ChecksumMismatch {
            path: path.to_path_buf(),
        };
        let unsafe_path = |source| StoreError::UnsafePath {
            path: path.to_path_buf(),
            source,
        };
        let over = |what, value: u64, limit: usize| StoreError::LimitExceeded {
            path: path.to_path_buf(),
            what,
            value,
            limit: limit as u64,
        };
        let mut r = Reader { b: body, at: 0 };
        // Each pack name takes at least 5 bytes (length and one byte).
        let packs = r.count(5).ok_or_else(bad)?;
        if packs > MAX_PACKS {
            return Err(over("pack count", packs as u64, MAX_PACKS));
        }
        let mut out = Recipe {
            packs: Vec::with_capacity(packs),
            files: Vec::new(),
        };
        for _ in 0..packs {
            let name = r.string().ok_or_else(bad)?;
            validate::file_name(&name).map_err(unsafe_path)?;
            out.packs.push(name);
        }
        // Each file takes at least 9 bytes (path length, one byte, chunk count).
        let files = r.count(9).ok_or_else(bad)?;
        if files > manifest::MAX_FILES {
            return Err(over("file count", files as u64, manifest::MAX_FILES));
        }
        out.files.reserve_exact(files);
        for _ in 0..files {
            let path_s = r.string().ok_or_else(bad)?;
            validate::relative_path(&path_s).map_err(unsafe_path)?;
            let n = r.count(CHUNK_REF_BYTES).ok_or_else(bad)?;
            let mut chunks = Vec::with_capacity(n);
            for _ in 0..n {
                let pack = r.u32().ok_or_else(bad)?;
                let offset = r.u64().ok_or_else(bad)?;
                let len = r.u32().ok_or_else(bad)?;
                let c = ChunkRef {
                    pack,
                    offset,
                    len: len & !COMPRESSED,
                    digest: r.take(32).ok_or_else(bad)?.try_into().expect("32 bytes"),
                    compressed: len & COMPRESSED != 0,
                };
                if c.pack as usize >= out.packs.len() || c.len == 0 {
                    return Err(bad());
                }
                if c.len as usize > MAX_CHUNK {
                    return Err(over("chunk length", c.len.into(), MAX_CHUNK));
                }
                chunks.push(c);
            }
            out.files.push(FileRecipe {
                path: path_s,
                chunks,
            });
        }
        if r.at != body.len() {
            return Err(bad());
        }
        Ok(out)
    }

    /// Reads `dir/RECIPE`.
    pub fn read(dir: &Path) -> Result<Recipe> {
        let path = dir.join(RECIPE);
        Recipe::decode(&path, &read_capped(&path, MAX_RECIPE_BYTES)?)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    /// A u32 count of items of at least `min_bytes` each; None unless the bytes left can hold
    /// that many, so a forged count never sizes an allocation.
    fn count(&mut self, min_bytes: usize) -> Option<usize> {
        let n = self.u32()? as usize;
        (n <= (self.b.len() - self.at) / min_bytes).then_some(n)
    }
    fn string(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

/// Which copy: a node's images of one epoch of one job.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// Job id.
    pub job: u64,
    /// Epoch.
    pub epoch: u32,
    /// Node.
    pub node: &'a str,
}

/// What a flush wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlushStats {
    /// Image bytes read and checked.
    pub image_bytes: u64,
    /// Bytes of new chunks written to shared storage (compressed, where they are).
    pub written_bytes: u64,
    /// Bytes of those new chunks before compression.
    pub new_bytes: u64,
    /// Chunks in the recipe, and how many of them were new.
    pub chunks: u64,
    /// New chunks.
    pub new_chunks: u64,
}

fn packs_dir(shared: &Staging, job: u64, node: &str) -> PathBuf {
    shared.job_dir(job).join("packs").join(node)
}

/// The newest epoch before `epoch` with a complete copy of `node` (MANIFEST and a readable
/// RECIPE), and its recipe.
fn previous_recipe(shared: &Staging, job: u64, epoch: u32, node: &str) -> Option<Recipe> {
    let mut epochs: Vec<u32> = fs::read_dir(shared.job_dir(job))
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|e| *e < epoch)
        .collect();
    epochs.sort_unstable_by(|a, b| b.cmp(a));
    epochs.into_iter().find_map(|e| {
        let dir = shared.node_dir(job, e, node);
        manifest::read(&dir).ok()?;
        Recipe::read(&dir).ok()
    })
}

/// Copies the sealed node directory `src` into shared storage as epoch `epoch` of `node`,
/// storing only chunks not already there; returns what it wrote. `committed` is the manifest
/// digest the coordinator committed; a source with another manifest is refused.
pub fn flush(
    src: &Path,
    shared: &Staging,
    t: Target<'_>,
    committed: &str,
    opts: &CopyOptions,
    progress: &CopyProgress,
) -> Result<FlushStats> {
    let Target { job, epoch, node } = t;
    error::check_node(shared.root(), node)?;
    let (mbytes, m) = crate::stream::open_source(src, committed)?;
    progress.total.store(m.image_bytes(), Ordering::Relaxed);
    let dest = shared.node_dir(job, epoch, node);
    if dest.exists() {
        fs::remove_dir_all(&dest).map_err(|e| StoreError::io("remove", &dest, e))?;
    }
    fs::create_dir_all(&dest).map_err(|e| StoreError::io("create", &dest, e))?;
    let pdir = packs_dir(shared, job, node);
    fs::create_dir_all(&pdir).map_err(|e| StoreError::io("create", &pdir, e))?;

    // Known chunks: those of the newest complete earlier copy, then those written now.
    let prev = previous_recipe(shared, job, epoch, node).unwrap_or_default();
    let mut names = prev.packs.clone();
    let first_new = names.len() as u32;
    names.extend((0..m.files.len()).map(|i| format!("{epoch}-{i}.pack")));
    let mut known: HashMap<[u8; 32], ChunkRef> = HashMap::new();
    for c in prev.files.iter().flat_map(|f| &f.chunks) {
        known.insert(c.digest, *c);
    }
    let known = Mutex::new(known);
    let throttle = opts.bandwidth.map(Throttle::new);
    let results = for_each_file(m.files.len(), opts.streams, |i| {
        let pack = (
            first_new + i as u32,
            pdir.join(&names[(first_new as usize) + i]),
        );
        flush_file(
            src,
            &m.files[i],
            pack,
            &known,
            (opts, throttle.as_ref()),
            progress,
        )
    })?;
    let mut recipe = Recipe {
        packs: names,
        files: Vec::new(),
    };
    let mut stats = FlushStats::default();
    for (f, st) in results {
        stats.image_bytes += st.image_bytes;
        stats.written_bytes += st.written_bytes;
        stats.new_bytes += st.new_bytes;
        stats.chunks += st.chunks;
        stats.new_chunks += st.new_chunks;
        recipe.files.push(f);
    }
    atomic::sync_dir(&pdir)?;
    atomic::write_file(&dest.join(RECIPE), &recipe.encode())?;
    atomic::write_file(&dest.join(manifest::FILE_NAME), &mbytes)?;
    Ok(stats)
}

fn flush_file(
    src_root: &Path,
    entry: &crate::digest::FileEntry,
    (pack_idx, pack_path): (u32, PathBuf),
    known: &Mutex<HashMap<[u8; 32], ChunkRef>>,
    (opts, throttle): (&CopyOptions, Option<&Throttle>),
    progress: &CopyProgress,
) -> Result<(FileRecipe, FlushStats)> {
    let src = error::join_relative(src_root, &entry.path)?;
    let mut input = File::open(&src).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => StoreError::FileMissing { path: src.clone() },
        _ => StoreError::io("open", &src, e),
    })?;
    let mut pack: Option<File> = None;
    let mut pack_len = 0u64;
    let mut file_hash = blake3::Hasher::new();
    let mut st = FlushStats::default();
    let mut chunks = Vec::new();
    let mut buf: Vec<u8> = Vec::with_capacity(MAX_CHUNK * 2);
    let mut compressor = match opts.compress {
        Some(level) => {
            Some(zstd::bulk::Compressor::new(level).map_err(|e| StoreError::io("zstd", &src, e))?)
        }
        None => None,
    };
    let mut packed: Vec<u8> = Vec::with_capacity(MAX_CHUNK);
    let mut eof = false;
    loop {
        progress.wait_unpaused();
        if progress.cancel.load(Ordering::Relaxed) {
            return Err(StoreError::io(
                "flush",
                &src,
                std::io::Error::new(std::io::ErrorKind::Interrupted, "flush cancelled"),
            ));
        }
        while !eof && buf.len() < MAX_CHUNK {
            let start = buf.len();
            buf.resize(start + MAX_CHUNK, 0);
            let n = input
                .read(&mut buf[start..])
                .map_err(|e| StoreError::io("read", &src, e))?;
            buf.truncate(start + n);
            eof = n == 0;
        }
        if buf.is_empty() {
            break;
        }
        let n = cut(&buf);
        let data = &buf[..n];
        file_hash.update(data);
        st.image_bytes += n as u64;
        if st.image_bytes > entry.size {
            break;
        }
        let digest: [u8; 32] = *blake3::hash(data).as_bytes();
        let found = known.lock().expect("lock").get(&digest).copied();
        let r = match found {
            Some(r) => r,
            None => {
                if pack.is_none() {
                    pack = Some(
                        OpenOptions::new()
                            .write(true)
                            .create(true)
                            .truncate(true)
                            .open(&pack_path)
                            .map_err(|e| StoreError::io("create", &pack_path, e))?,
                    );
                }
                // Stored compressed only where that is smaller.
                let compressed = match compressor.as_mut() {
                    Some(z) => {
                        packed.clear();
                        packed.reserve(zstd::zstd_safe::compress_bound(n));
                        z.compress_to_buffer(data, &mut packed)
                            .map_err(|e| StoreError::io("zstd", &src, e))?;
                        packed.len() < n
                    }
                    None => false,
                };
                let stored = if compressed { &packed[..] } else { data };
                if let Some(t) = throttle {
                    t.take(stored.len() as u64);
                }
                pack.as_mut()
                    .expect("opened")
                    .write_all(stored)
                    .map_err(|e| StoreError::io("write", &pack_path, e))?;
                let r = ChunkRef {
                    pack: pack_idx,
                    offset: pack_len,
                    len: stored.len() as u32,
                    digest,
                    compressed,
                };
                pack_len += stored.len() as u64;
                st.written_bytes += stored.len() as u64;
                st.new_bytes += n as u64;
                st.new_chunks += 1;
                known.lock().expect("lock").insert(digest, r);
                r
            }
        };
        st.chunks += 1;
        chunks.push(r);
        progress.done.fetch_add(n as u64, Ordering::Relaxed);
        buf.drain(..n);
    }
    if st.image_bytes != entry.size {
        return Err(StoreError::FileSize {
            path: src,
            expected: entry.size,
            actual: st
                .image_bytes
                .max(input.metadata().map(|m| m.len()).unwrap_or(0)),
        });
    }
    if file_hash.finalize().to_hex().as_str() != entry.blake3 {
        return Err(StoreError::FileDigest { path: src });
    }
    if let Some(p) = pack {
        p.sync_all()
            .map_err(|e| StoreError::io("fsync", &pack_path, e))?;
    }
    Ok((
        FileRecipe {
            path: entry.path.clone(),
            chunks,
        },
        st,
    ))
}

/// Runs `f` on files 0..n, `streams` of them at once, and returns the results in file order; the
/// first error stops the others from starting new files and is returned.
fn for_each_file<T: Send>(
    n: usize,
    streams: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let queue = Mutex::new((0..n).rev().collect::<Vec<_>>());
    let results: Mutex<Vec<Option<T>>> = Mutex::new((0..n).map(|_| None).collect());
    let failed: Mutex<Option<StoreError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..streams.clamp(1, 64).min(n.max(1)) {
            s.spawn(|| loop {
                if failed.lock().expect("lock").is_some() {
                    return;
                }
                let Some(i) = queue.lock().expect("lock").pop() else {
                    return;
                };
                match f(i) {
                    Ok(r) => results.lock().expect("lock")[i] = Some(r),
                    Err(e) => {
                        failed.lock().expect("lock").get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().expect("lock") {
        return Err(e);
    }
    Ok(results
        .into_inner()
        .expect("lock")
        .into_iter()
        .map(|r| r.expect("every file done"))
        .collect())
}

/// Rebuilds `node`'s files of `epoch` from shared storage into `dest` (replaced; manifest
/// last), or with `dest` = None only checks that they can be rebuilt. Every chunk and every file
/// is checked against its digest. Returns the manifest.
pub fn rebuild(
    shared: &Staging,
    t: Target<'_>,
    committed: &str,
    dest: Option<&Path>,
    opts: &CopyOptions,
) -> Result<NodeManifest> {
    let Target { job, epoch, node } = t;
    error::check_node(shared.root(), node)?;
    let dir = shared.node_dir(job, epoch, node);
    let (mbytes, m) = crate::stream::open_source(&dir, committed)?;
    let recipe = Recipe::read(&dir)?;
    let rpath = dir.join(RECIPE);
    if recipe.files.len() != m.files.len()
        || recipe
            .files
            .iter()
            .zip(&m.files)
            .any(|(r, f)| r.path != f.path)
    {
        return Err(StoreError::ChecksumMismatch { path: rpath });
    }
    if let Some(d) = dest {
        if d.exists() {
            fs::remove_dir_all(d).map_err(|e| StoreError::io("remove", d, e))?;
        }
        fs::create_dir_all(d).map_err(|e| StoreError::io("create", d, e))?;
    }
    let pdir = packs_dir(shared, job, node);
    for_each_file(m.files.len(), opts.streams, |i| {
        rebuild_file(&pdir, &recipe, i, &m.files[i], dest)
    })?;
    if let Some(d) = dest {
        let mut dirs: BTreeSet<PathBuf> = m
            .files
            .iter()
            .filter_map(|f| d.join(&f.path).parent().map(Path::to_path_buf))
            .collect();
        dirs.insert(d.to_path_buf());
        for x in dirs {
            atomic::sync_dir(&x)?;
        }
        atomic::write_file(&d.join(manifest::FILE_NAME), &mbytes)?;
    }
    Ok(m)
}

fn rebuild_file(
    pdir: &Path,
    recipe: &Recipe,
    i: usize,
    entry: &crate::digest::FileEntry,
    dest: Option<&Path>,
) -> Result<()> {
    let mut out = match dest {
        Some(d) => {
            let p = error::join_relative(d, &entry.path)?;
            if let Some(parent) = p.parent() {
                fs::create_dir_all(parent).map_err(|e| StoreError::io("create", parent, e))?;
            }
            Some((
                File::create(&p).map_err(|e| StoreError::io("create", &p, e))?,
                p,
            ))
        }
        None => None,
    };
    let mut packs: HashMap<u32, File> = HashMap::new();
    let mut hash = blake3::Hasher::new();
    let mut size = 0u64;
    let mut buf = Vec::new();
    let mut decompressor = None;
    let mut unpacked: Vec<u8> = Vec::with_capacity(MAX_CHUNK);
    for c in &recipe.files[i].chunks {
        let ppath = error::join_file_name(pdir, &recipe.packs[c.pack as usize])?;
        let pack = match packs.entry(c.pack) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(File::open(&ppath).map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => StoreError::FileMissing {
                        path: ppath.clone(),
                    },
                    _ => StoreError::io("open", &ppath, e),
                })?)
            }
        };
        buf.resize(c.len as usize, 0);
        pack.read_exact_at(&mut buf, c.offset)
            .map_err(|e| StoreError::io("read", &ppath, e))?;
        let data = if c.compressed {
            if decompressor.is_none() {
                decompressor = Some(
                    zstd::bulk::Decompressor::new()
                        .map_err(|e| StoreError::io("zstd", &ppath, e))?,
                );
            }
            // At most a chunk's length comes out of a frame, whatever its header claims; a
            // frame that is not one or says more is a damaged pack.
            unpacked.clear();
            let d = decompressor.as_mut().expect("made");
            if d.decompress_to_buffer(&buf, &mut unpacked).is_err() {
                return Err(StoreError::FileDigest { path: ppath });
            }
            &unpacked[..]
        } else {
            &buf[..]
        };
        if blake3::hash(data).as_bytes() != &c.digest {
            return Err(StoreError::FileDigest { path: ppath });
        }
        hash.update(data);
        size += data.len() as u64;
        if let Some((f, p)) = out.as_mut() {
            f.write_all(data)
                .map_err(|e| StoreError::io("write", p.as_path(), e))?;
        }
    }
    let named = dest
        .map(|d| d.join(&entry.path))
        .unwrap_or_else(|| PathBuf::from(&entry.path));
    entry.check_read(&named, size, &hash)?;
    if let Some((f, p)) = out {
        f.sync_all().map_err(|e| StoreError::io("fsync", &p, e))?;
    }
    Ok(())
}

/// Deletes `node`'s packs of `job` that no remaining recipe of the node references (after its
/// epochs were deleted). Returns the bytes freed. Must not run during a flush of the job.
pub fn sweep(shared: &Staging, job: u64, node: &str) -> Result<u64> {
    error::check_node(shared.root(), node)?;
    let pdir = packs_dir(shared, job, node);
    let Ok(rd) = fs::read_dir(&pdir) else {
        return Ok(0);
    };
    let mut used = BTreeSet::new();
    if let Ok(epochs) = fs::read_dir(shared.job_dir(job)) {
        for e in epochs.flatten() {
            let Some(n) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let dir = shared.node_dir(job, n, node);
            if !dir.exists() {
                continue;
            }
            // A recipe that cannot be read keeps every pack: never delete what might be used.
            let r = Recipe::read(&dir)?;
            used.extend(r.packs);
        }
    }
    let mut freed = 0;
    for ent in rd.flatten() {
        let name = ent.file_name().to_string_lossy().into_owned();
        if !used.contains(&name) {
            freed += ent.metadata().map(|m| m.len()).unwrap_or(0);
            let p = ent.path();
            fs::remove_file(&p).map_err(|e| StoreError::io("remove", &p, e))?;
        }
    }
    Ok(freed)
}

#[cfg(test)]
mod tests;
