//! What the layer holds and has done, for tests and for the agent: with `CKPT_VERBS_STATUS`
//! set to a directory, a process writes `<dir>/ckpt-verbs-<pid>.json` when it exits, and after
//! every rebuild: the devices it opened, each live QP with its virtual and real number, each
//! live memory region with its virtual and real keys, the work counted, the calls refused, the
//! features in use that no rebuild brings back (multicast groups attached), and
//! for each rebuild so far the QPs and regions it brought back (virtual and new real numbers)
//! and what the quiesce before it kept.
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

/// Notes a rebuild done (with what the quiesce before it kept), and writes the report.
pub fn rebuilt(kept: &ib_quiesce::QuiesceReport) {
    let now = report();
    if let Ok(mut r) = REBUILDS.lock() {
        r.push(json!({
            "qps": now["qps"].clone(),
            "mrs": now["mrs"].clone(),
            "kept_receives": kept.kept_receives,
            "held_completions": kept.held_completions,
        }));
    }
    write_now();
}

fn write_to(dir: OsString) -> std::io::Result<()> {
    let path = PathBuf::from(dir).join(format!("ckpt-verbs-{}.json", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.write_all(report().to_string().as_bytes())
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
                "virtual_qpn": s.qp.qp_num,
                "real_qpn": s.real_qpn.load(Acquire),
                "type": match s.qp.qp_type { 2 => "RC", 4 => "UD", _ => "other" },
                "state": s.qp.state,
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
                "length": s.mr.length,
            })
        })
        .collect();
    let c = &l.counters;
    json!({
        "pid": std::process::id(),
        "devices": DEVICES.lock().map(|d| d.clone()).unwrap_or_default(),
        "qps": qps,
        "mrs": mrs,
        "rebuilds": REBUILDS.lock().map(|r| r.clone()).unwrap_or_default(),
        "send_wrs": c.send_wrs.load(Relaxed),
        "recv_wrs": c.recv_wrs.load(Relaxed),
        "completions": c.completions.load(Relaxed),
        "unknown_lkeys": c.unknown_lkeys.load(Relaxed),
        "unknown_qpns": c.unknown_qpns.load(Relaxed),
        "refused": l.refusals.lock().map(|r| r.clone()).unwrap_or_default(),
        "unsupported_in_use": l.unsupported_in_use(),
    })
}
