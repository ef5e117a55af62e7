//! What the agent reads back from CRIU's images after a dump: the files CRIU restores through
//! a *link remap*. A file deleted while open but still linked elsewhere (another hard link of
//! it remains) cannot be copied into the images as a "ghost" (CRIU copies only files no name
//! reaches); CRIU links it back into its directory as `link_remap.N` for the restore to open.
//! After a dump that lets the job run on (`--leave-running`, every dump of ckpt's), CRIU
//! removes those links again: the epoch then names a file that is gone, and its restore fails
//! ("Can't link …/link_remap.N"). The agent copies such files while the job is still frozen
//! and puts them back at the link's path before a restore ([`linked_remaps`], used by the
//! dump).
//!
//! An image file is a 4-byte common magic, a 4-byte image magic, then entries, each a 4-byte
//! little-endian length and a protocol buffer. Only the fields read are declared below
//! (CRIU's `images/regfile.proto`, `fdinfo.proto`, `remap-file-path.proto`); the others are
//! skipped as unknown fields.

use std::io;
use std::path::Path;

use prost::Message;

/// `files.img`: every file the tree had open.
const FILES: &str = "files.img";
/// `remap-fpath.img`: which files are opened through another (a ghost or a link remap).
const REMAPS: &str = "remap-fpath.img";
/// The first word of every CRIU image.
const COMMON_MAGIC: u32 = 0x5456_4319;
/// Largest entry read: a file entry holds a path and a few numbers.
const MAX_ENTRY: usize = 1 << 20;
/// `remap_type` LINKED (the default of the field).
const LINKED: i32 = 0;
/// `fd_types` REG.
const REG: i32 = 1;

/// A regular file's entry (the fields read).
#[derive(Clone, PartialEq, Message)]
struct RegFileEntry {
    #[prost(uint32, optional, tag = "1")]
    id: Option<u32>,
    #[prost(string, optional, tag = "6")]
    name: Option<String>,
    #[prost(uint64, optional, tag = "8")]
    size: Option<u64>,
}

/// One file of `files.img` (the fields read).
#[derive(Clone, PartialEq, Message)]
struct FileEntry {
    #[prost(int32, optional, tag = "1")]
    kind: Option<i32>,
    #[prost(uint32, optional, tag = "2")]
    id: Option<u32>,
    #[prost(message, optional, tag = "3")]
    reg: Option<RegFileEntry>,
}

/// One entry of `remap-fpath.img`.
#[derive(Clone, PartialEq, Message)]
struct RemapFilePathEntry {
    #[prost(uint32, optional, tag = "1")]
    orig_id: Option<u32>,
    #[prost(uint32, optional, tag = "2")]
    remap_id: Option<u32>,
    #[prost(int32, optional, tag = "3")]
    remap_type: Option<i32>,
}

/// A file the restore opens through a link CRIU made and removed again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkedRemap {
    /// The file's path when it was dumped (absolute), as its processes had it open (the
    /// kernel shows it with " (deleted)" after it).
    pub path: String,
    /// The link the restore opens it through (absolute), in the same directory.
    pub link: String,
    /// The file's size when it was dumped.
    pub size: u64,
}

/// Reads the entries of the image `file` in `dir`: none where the image is missing.
fn entries<M: Message + Default>(dir: &Path, file: &str) -> io::Result<Vec<M>> {
    let path = dir.join(file);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let bad = |what: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {what}", path.display()),
        )
    };
    let word = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
    };
    if word(0) != Some(COMMON_MAGIC) || word(4).is_none() {
        return Err(bad("not a CRIU image (no magic)"));
    }
    let mut out = Vec::new();
    let mut at = 8;
    while at < bytes.len() {
        let len = word(at).ok_or_else(|| bad("cut inside an entry's length"))? as usize;
        if len > MAX_ENTRY {
            return Err(bad("an entry longer than 1 MiB"));
        }
        let body = bytes
            .get(at + 4..at + 4 + len)
            .ok_or_else(|| bad("cut inside an entry"))?;
        out.push(M::decode(body).map_err(|e| bad(&format!("an entry does not decode: {e}")))?);
        at += 4 + len;
    }
    Ok(out)
}

/// The files the images in `dir` restore through link remaps, with where each link was.
pub fn linked_remaps(dir: &Path) -> io::Result<Vec<LinkedRemap>> {
    let remaps: Vec<RemapFilePathEntry> = entries(dir, REMAPS)?;
    let linked: Vec<(u32, u32)> = remaps
        .iter()
        .filter(|r| r.remap_type.unwrap_or(LINKED) == LINKED)
        .filter_map(|r| Some((r.orig_id?, r.remap_id?)))
        .collect();
    if linked.is_empty() {
        return Ok(Vec::new());
    }
    let files: Vec<FileEntry> = entries(dir, FILES)?;
    let reg = |id: u32| {
        files
            .iter()
            .filter(|f| f.kind == Some(REG))
            .filter_map(|f| f.reg.as_ref().filter(|_| f.id == Some(id)))
            .find(|r| r.id.is_none_or(|own| own == id))
    };
    // CRIU names files relative to their mount's root, with or without a leading slash.
    let absolute =
        |name: &str| format!("/{}", name.trim_start_matches("./").trim_start_matches('/'));
    linked
        .into_iter()
        .map(|(orig, remap)| {
            let missing = |what: &str, id: u32| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{}: a link remap names {what} file {id}, which {} does not hold",
                        dir.join(REMAPS).display(),
                        FILES
                    ),
                )
            };
            let o = reg(orig).ok_or_else(|| missing("the original", orig))?;
            let r = reg(remap).ok_or_else(|| missing("the link", remap))?;
            Ok(LinkedRemap {
                path: absolute(o.name.as_deref().unwrap_or_default()),
                link: absolute(r.name.as_deref().unwrap_or_default()),
                size: o.size.or(r.size).unwrap_or(0),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes an image: the magics, then each entry with its length.
    fn image(dir: &Path, file: &str, magic: u32, entries: &[Vec<u8>]) {
        let mut bytes = COMMON_MAGIC.to_le_bytes().to_vec();
        bytes.extend(magic.to_le_bytes());
        for e in entries {
            bytes.extend((e.len() as u32).to_le_bytes());
            bytes.extend(e);
        }
        std::fs::write(dir.join(file), bytes).unwrap();
    }

    fn reg(id: u32, name: &str, size: u64) -> Vec<u8> {
        FileEntry {
            kind: Some(REG),
            id: Some(id),
            reg: Some(RegFileEntry {
                id: Some(id),
                name: Some(name.into()),
                size: Some(size),
            }),
        }
        .encode_to_vec()
    }

    fn remap(orig: u32, remap: u32, kind: Option<i32>) -> Vec<u8> {
        RemapFilePathEntry {
            orig_id: Some(orig),
            remap_id: Some(remap),
            remap_type: kind,
        }
        .encode_to_vec()
    }

    #[test]
    fn only_linked_remaps_are_listed_with_their_links() {
        let dir = tempfile::tempdir().unwrap();
        assert!(linked_remaps(dir.path()).unwrap().is_empty(), "no images");
        image(
            dir.path(),
            FILES,
            0x5630_3138,
            &[
                reg(0x17, "/tmp/d/gone", 10),
                reg(0x18, "/tmp/d/linked", 11),
                reg(0x19, "tmp/d/link_remap.25", 11),
            ],
        );
        // A ghost (type 1), and a link remap written with its type and without (the default).
        image(
            dir.path(),
            REMAPS,
            0x5913_3954,
            &[remap(0x17, 1, Some(1)), remap(0x18, 0x19, Some(0))],
        );
        assert_eq!(
            linked_remaps(dir.path()).unwrap(),
            [LinkedRemap {
                path: "/tmp/d/linked".into(),
                link: "/tmp/d/link_remap.25".into(),
                size: 11,
            }]
        );
        image(dir.path(), REMAPS, 0x5913_3954, &[remap(0x18, 0x19, None)]);
        assert_eq!(linked_remaps(dir.path()).unwrap().len(), 1);
    }

    #[test]
    fn a_damaged_image_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        image(dir.path(), REMAPS, 1, &[remap(1, 2, None)]);
        let e = linked_remaps(dir.path()).unwrap_err();
        assert!(e.to_string().contains("does not hold"), "{e}");
        std::fs::write(dir.path().join(REMAPS), b"junk").unwrap();
        let e = linked_remaps(dir.path()).unwrap_err();
        assert!(
            e.to_string().contains("remap-fpath.img: not a CRIU image"),
            "{e}"
        );
        let mut cut = COMMON_MAGIC.to_le_bytes().to_vec();
        cut.extend([0, 0, 0, 0, 9, 0, 0, 0, 1]);
        std::fs::write(dir.path().join(REMAPS), cut).unwrap();
        let e = linked_remaps(dir.path()).unwrap_err();
        assert!(e.to_string().contains("cut inside an entry"), "{e}");
    }
}
