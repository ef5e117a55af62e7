//! What the layer holds and has done, for tests and for the agent: with `CKPT_VERBS_STATUS`
//! set to a directory, a process writes `<dir>/ckpt-verbs-<host>-<pid>.json` when it exits, and
//! after every rebuild (the host name keeps processes of several nodes apart in a shared
//! directory; a part restored elsewhere keeps the name of the node it first ran on, as its
//! sandbox does): the devices it opened, each context's address (the one its peers know it by
//! and the one it has now), each live QP with its virtual and real number, each
//! live memory region with its virtual and real keys, the work counted, the calls refused, the
//! features in use that no rebuild brings back (multicast groups attached), and
//! for each rebuild so far the QPs and regions it brought back (virtual and new real numbers)
//! and what the quiesce before it kept, and each context's address then. Written to a
//! temporary file and renamed into place.
use std::ffi::OsString;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::{Mutex, Once};

use serde_json::{json, Value};

use crate::shadow::{layer, Layer, ShadowMr, ShadowQp};

/// The environment variable naming the status directory.
pub const STATUS_ENV: &str = "CKPT_VERBS_STATUS";

static DEVICES: Mutex<Vec<String>> = Mutex::new(Vec::new());
static REBUILDS: Mutex<Vec<Value>> = Mutex::new(Vec::new());
static LOOKUPS: Mutex<Vec<Value>> = Mutex::new(Vec::new());
static AT_EXIT: Once = Once::new();

/// Notes a device opened; the first one arranges the report at exit.
pub fn opened(device: String) {
    if let Ok(mut d) = DEVICES.lock() {
        d.push(device);
    }
    AT_EXIT.call_once(|| {
        if std::env::var_os(STATUS_ENV).is_some() {
            // SAFETY: registering a plain function; it runs once at exit.
            unsafe { libc::atexit(write_at_exit) };
        }
    });
}

extern "C" fn write_at_exit() {
    write_now();
}

/// Writes the report now, if asked for. A failure must not change what the program does.
fn write_now() {
    if let Some(dir) = std::env::var_os(STATUS_ENV) {
        let _ = write_to(dir);
    }
}

/// Notes a lookup of address `id` after a reconnect ([`crate::lookup::meet`]): the endpoints
/// found there, or why there was no answer; and writes the report (lookups are rare: one per
/// address met between two checkpoints).
pub fn looked_up(id: u64, endpoints: usize, error: Option<String>) {
    if let Ok(mut l) = LOOKUPS.lock() {
        l.push(json!({
            "address": format!("{id:016x}"),
            "endpoints": endpoints,
            "error": error,
        }));
    }
    write_now();
}

/// Notes a rebuild done (with what the quiesce before it kept, and how many endpoints its
/// reconnect was sent), and writes the report.
pub fn rebuilt(kept: &ib_quiesce::QuiesceReport, endpoints_received: usize) {
    let now = report();
    if let Ok(mut r) = REBUILDS.lock() {
        r.push(json!({
            "qps": now["qps"].clone(),
            "mrs": now["mrs"].clone(),
            "contexts": now["contexts"].clone(),
            "kept_receives": kept.kept_receives,
            "held_completions": kept.held_completions,
            "endpoints_received": endpoints_received,
        }));
    }
    write_now();
}

fn write_to(dir: OsString) -> std::io::Result<()> {
    let name = format!("ckpt-verbs-{}-{}.json", host(), std::process::id());
    let dir = PathBuf::from(dir);
    // Whole or not at all: a reader never sees a report being written.
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(report().to_string().as_bytes())?;
    std::fs::rename(&tmp, dir.join(name))
}

/// This process's host name (`uname`), "-" if it has none.
fn host() -> String {
    // SAFETY: uname fills the struct it is given.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: as above; nodename is NUL-terminated by the kernel.
    if unsafe { libc::uname(&mut u) } != 0 {
        return "-".into();
    }
    // SAFETY: a NUL-terminated array.
    let name = unsafe { std::ffi::CStr::from_ptr(u.nodename.as_ptr()) };
    let name: String = name
        .to_string_lossy()
        .chars()
        .map(|c| if c == '/' { '_' } else { c })
        .collect();
    if name.is_empty() {
        "-".into()
    } else {
        name
    }
}

/// Each context's device and address: the id its peers know it by, and the GID (or LID) it has
/// now (null while released).
fn contexts(l: &Layer) -> Vec<Value> {
    // Held throughout: a context is freed only after it left the set.
    let ctxs = crate::shadow::lock(&l.contexts);
    ctxs.iter()
        .map(|&p| {
            // SAFETY: a listed shadow context is live (see above).
            let c = unsafe { &*(p as *const crate::shadow::ShadowCtx) };
            json!({
                "device": c.device,
                "ident": format!("{:016x}", c.ident.load(Relaxed)),
                "gid_now": c.addr_now().map(|a| hex(&a.0)),
            })
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The report, as JSON.
pub fn report() -> Value {
    let l = layer();
    let qps: Vec<Value> = Layer::live(&l.qps)
        .into_iter()
        .map(|p| {
            // SAFETY: a live shadow QP (untracked before it is freed).
            let s = unsafe { &*(p as *const ShadowQp) };
            let peer = s.peer.lock().ok().and_then(|p| *p).map(|(_, q)| q);
            json!({
                "virtual_qpn": s.ex.qp_base.qp_num,
                "real_qpn": s.real_qpn.load(Acquire),
                "type": match s.ex.qp_base.qp_type { 2 => "RC", 4 => "UD", _ => "other" },
                "state": s.ex.qp_base.state,
                "peer_qpn": peer,
                "transitions": s.transitions.lock().map(|t| t.len()).unwrap_or(0),
            })
        })
        .collect();
    let mrs: Vec<Value> = Layer::live(&l.mrs)
        .into_iter()
        .map(|p| {
            // SAFETY: a live shadow MR.
            let s = unsafe { &*(p as *const ShadowMr) };
            // SAFETY: its real MR is live while the shadow is.
            let (lkey, rkey) = unsafe {
                let r = s.real.load(Acquire);
                if r.is_null() {
                    (0, 0)
                } else {
                    ((*r).lkey, (*r).rkey)
                }
            };
            json!({
                "lkey": s.mr.lkey, "real_lkey": lkey,
                "rkey": s.mr.rkey, "real_rkey": rkey,
                "length": s.mr.length, "access": s.reg.access,
            })
        })
        .collect();
    let c = &l.counters;
    json!({
        "pid": std::process::id(),
        "host": host(),
        "devices": DEVICES.lock().map(|d| d.clone()).unwrap_or_default(),
        "contexts": contexts(l),
        "qps": qps,
        "mrs": mrs,
        "rebuilds": REBUILDS.lock().map(|r| r.clone()).unwrap_or_default(),
        "lookups": LOOKUPS.lock().map(|l| l.clone()).unwrap_or_default(),
        "send_wrs": c.send_wrs.load(Relaxed),
        "recv_wrs": c.recv_wrs.load(Relaxed),
        "completions": c.completions.load(Relaxed),
        "unknown_lkeys": c.unknown_lkeys.load(Relaxed),
        "unknown_qpns": c.unknown_qpns.load(Relaxed),
        "qpns_set_aside": c.qpns_set_aside.load(Relaxed),
        "async_events_acked_for_program": c.async_events_acked_for_program.load(Relaxed),
        "refused": l.refusals.lock().map(|r| r.clone()).unwrap_or_default(),
        "unsupported_in_use": l.unsupported_in_use(),
    })
}
