//! Node-local staging under pressure: a staging file system that is too full, or that fills up
//! while the job is being dumped, aborts the epoch cleanly. The job keeps running and earlier
//! epochs stay restorable. Retention then expires old epochs and deletes their images. Skips
//! with a printed reason where CRIU or MPICH is missing.
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use ckpt_tests::{flip_byte_in_largest, skip_unless_ready, Ckptd, Mpi, Options};

const LIMIT: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;

fn free_bytes(dir: &Path) -> u64 {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statvfs fills a zeroed struct for a valid NUL-terminated path.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        assert_eq!(
            libc::statvfs(c.as_ptr(), &mut st),
            0,
            "statvfs {}",
            dir.display()
        );
        st.f_bavail as u64 * st.f_frsize as u64
    }
}

/// Grows `file` until the file system holding it has about `leave` bytes free.
fn fill_leaving(file: &Path, leave: u64) {
    let dir = file.parent().unwrap();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .unwrap();
    let chunk = vec![0xa5u8; MIB as usize];
    // Bounded: the tmpfs is a few hundred MiB.
    for _ in 0..4096 {
        let free = free_bytes(dir);
        if free <= leave + MIB {
            break;
        }
        f.write_all(&chunk[..((free - leave).min(MIB)) as usize])
            .unwrap();
    }
    f.sync_all().unwrap();
}

#[test]
fn a_full_staging_disk_aborts_the_epoch_and_keeps_the_job_and_earlier_epochs() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich");
    let want = Mpi::Mpich.reference_checksum(4, 256, 3000);
    let d = Ckptd::start(Options {
        failpoints: true,
        local_size: Some("256m".into()),
        extra_toml: "[retention]\nkeep_local = 1\n".into(),
        ..Options::default()
    });
    let job = d.run_job("heat", &Mpi::Mpich.heat_argv(4, 256, 3000, 2000));
    let id = job.to_string();
    d.wait_progress(job, 1, LIMIT);
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    let local = d.dir.path().join("local");
    let filler = local.join("filler");

    // Too little room up front: refused in initial synchronization, before anything is frozen.
    fill_leaving(&filler, 8 * MIB);
    let out = d.ctl(&["checkpoint", &id, "--wait"]);
    assert_eq!(out.code, 10, "{out:?}");
    assert!(
        out.stderr.contains("staging") && out.stderr.contains("free"),
        "the error says staging lacks room: {out:?}"
    );
    let e = &d.epochs(job)[1];
    assert_eq!(
        (e["state"].as_str(), e["failed_phase"].as_str()),
        (Some("failed"), Some("initial-sync")),
        "{e}"
    );
    std::fs::remove_file(&filler).unwrap();

    // The disk fills while the job is dumped: the epoch aborts in local checkpointing and its
    // partial images are deleted.
    d.set_failpoints("quiesce=delay:3s\n");
    let ctl = d.ctl_spawn(&["checkpoint", &id, "--wait"]);
    let begin = Instant::now();
    while !d.images(job, 3).exists() {
        assert!(begin.elapsed() < LIMIT, "epoch 3 never passed initial sync");
        std::thread::sleep(Duration::from_millis(10));
    }
    fill_leaving(&filler, MIB / 2);
    let out = ctl.wait_with_output().unwrap();
    d.set_failpoints("");
    std::fs::remove_file(&filler).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    let e = &d.epochs(job)[2];
    assert_eq!(
        (e["state"].as_str(), e["failed_phase"].as_str()),
        (Some("failed"), Some("local-checkpoint")),
        "{e} / {stderr}"
    );
    let begin = Instant::now();
    while d.images(job, 3).exists() {
        assert!(
            begin.elapsed() < LIMIT,
            "partial images of epoch 3 were not deleted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(d.status(job)["state"], "running", "the job kept running");
    let before = d.output(job).matches("iter ").count();
    d.wait_progress(job, before + 1, LIMIT);

    // Epoch 1 is intact: kill the job and restart it from there.
    d.kill_job(job);
    d.wait_state(job, "killed", LIMIT);
    d.ctl(&["restart", &id]).ok();

    // Retention (keep_local = 1): the next commit expires epoch 1; the epoch after it deletes
    // its images first thing, in its initial synchronization.
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    let e = &d.epochs(job)[0];
    assert_eq!(e["state"], "expired", "{e}");
    assert!(
        e["reason"].as_str().unwrap().contains("keep_local = 1"),
        "{e}"
    );
    assert!(d.images(job, 1).exists(), "deleted by the next epoch");
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    assert!(
        !d.images(job, 1).exists(),
        "images of expired epoch 1 were not deleted by epoch 5"
    );
    assert!(d.images(job, 5).exists(), "the kept epoch's images stay");
    let v = d.ctl(&["verify", &id, "--epoch", "1"]);
    assert_eq!(v.code, 4, "an expired epoch is not offered: {v:?}");
    assert!(v.stderr.contains("expired"), "{v:?}");
    d.ctl(&["verify", &id]).ok();
    assert_eq!(d.wait_checksum(job, LIMIT), want, "restarted from epoch 1");
}

/// Waits (bounded) until epoch `n` (1-based) has the given storage state.
#[track_caller]
fn wait_storage(d: &Ckptd, job: u64, n: usize, want: &str) -> serde_json::Value {
    let begin = Instant::now();
    loop {
        let e = d.epochs(job)[n - 1].clone();
        if e["storage"] == want {
            return e;
        }
        assert!(
            e["storage"] != "flush-failed" || want == "flush-failed",
            "flush of epoch {n} failed: {e}"
        );
        assert!(
            begin.elapsed() < LIMIT,
            "epoch {n} never became {want}: {e}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn device_of(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).unwrap().dev()
}

#[test]
fn epochs_flush_to_shared_storage_and_restarts_fall_back_to_it() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "mkfs.ext4");
    let want = Mpi::Mpich.reference_checksum(4, 256, 3000);
    // A slow shared target (5 MB/s) on its own file system, chunks stored zstd-compressed;
    // one local epoch kept. Each flush also waits 4 s before it copies (reporting progress):
    // compressed, the first epoch's chunks take about half a second at 5 MB/s, and the next
    // epoch must commit while it is still being copied (a race the test once lost).
    let d = Ckptd::start(Options {
        failpoints: true,
        shared_size: Some("512M".into()),
        agent_toml: "[agent.flush]\nbandwidth_mb = 5\nstreams = 2\ncompress = \"zstd:3\"\n".into(),
        extra_toml: "[retention]\nkeep_local = 1\n".into(),
        ..Options::default()
    });
    let shared = d.dir.path().join("shared");
    assert_ne!(
        device_of(&shared),
        device_of(&d.dir.path().join("local")),
        "shared_dir is a separate file system"
    );
    d.set_failpoints("flush=delay:4s\n");
    // 6 ms a step, about 18 s: it runs on through both delayed flushes.
    let job = d.run_job("heat", &Mpi::Mpich.heat_argv(4, 256, 3000, 6000));
    let id = job.to_string();
    d.wait_progress(job, 1, LIMIT);

    // The commit does not wait for the flush: epoch 1 is restorable and still being copied,
    // and the next epoch commits while it is.
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    let e1 = d.epochs(job)[0].clone();
    assert_eq!(
        (e1["state"].as_str(), e1["storage"].as_str()),
        (Some("committed"), Some("flushing")),
        "{e1}"
    );
    let begin = Instant::now();
    while d.status(job)["flush"]
        .as_str()
        .unwrap_or_default()
        .is_empty()
    {
        assert!(begin.elapsed() < LIMIT, "status never showed the flush");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        d.status(job)["flush"].as_str().unwrap().contains("epoch 1"),
        "{}",
        d.status(job)
    );
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    let e = d.epochs(job);
    assert_eq!(
        (e[0]["storage"].as_str(), e[1]["storage"].as_str()),
        (Some("flushing"), Some("flushing")),
        "epoch 2 committed while epoch 1 was still flushing: {e:?}"
    );
    d.set_failpoints("");
    eprintln!(
        "image bytes {} / {}; frozen {} / {} ms while flushing at 5 MB/s",
        e[0]["image_bytes"], e[1]["image_bytes"], e[0]["frozen_ms"], e[1]["frozen_ms"]
    );

    // Both become durable: a complete copy and a commit record in shared storage. With
    // keep_local = 1, epoch 1 then keeps only its shared copy and stays restorable.
    wait_storage(&d, job, 2, "durable");
    let e1 = wait_storage(&d, job, 1, "shared-only");
    assert_eq!(e1["state"], "committed", "{e1}");
    for n in ["1", "2"] {
        let dir = shared.join(&id).join(n);
        assert!(dir.join("COMMIT").is_file(), "{} has COMMIT", dir.display());
        assert!(dir.join("node0/MANIFEST").is_file());
    }
    // The job's memory (MPI runtime, grids of doubles) compresses: less was written than read.
    let log = std::fs::read_to_string(d.dir.path().join("ckptd.log")).unwrap();
    let flushed: Vec<(u64, u64)> = log
        .lines()
        .filter(|l| l.contains("flushed to shared storage"))
        .map(|l| (field_u64(l, "new_bytes"), field_u64(l, "written_bytes")))
        .collect();
    assert!(
        flushed.len() >= 2 && flushed.iter().all(|&(new, written)| written < new),
        "every flush stored its new chunks compressed: {flushed:?}"
    );
    eprintln!("flushes (new bytes, written bytes): {flushed:?}");
    let begin = Instant::now();
    while d.images(job, 1).exists() {
        assert!(begin.elapsed() < LIMIT, "local copy of epoch 1 not pruned");
        std::thread::sleep(Duration::from_millis(50));
    }

    // A flipped byte in the local copy of epoch 2: `verify` reports it and the intact shared
    // copy; the restart fetches the shared copy and says why.
    let name = flip_byte_in_largest(&d.images(job, 2).join("images"));
    let v = d.ctl(&["verify", &id]);
    let out = v.ok();
    assert!(
        out.contains("local copy: DAMAGED") && out.contains(&name),
        "{v:?}"
    );
    assert!(out.contains("shared copy: ok"), "{v:?}");
    d.kill_job(job);
    d.wait_state(job, "killed", LIMIT);
    let r = d.ctl(&["restart", &id]);
    let said = r.ok().to_string() + &r.stderr;
    assert!(
        said.contains("from its shared copy") && said.contains(&name),
        "the restart names the damaged file and the copy it used: {r:?}"
    );
    assert!(said.contains("restarted from epoch 2"), "{r:?}");
    d.wait_progress(job, d.output(job).matches("iter ").count() + 1, LIMIT);

    // Epoch 1 has no local copy at all: `verify` checks only its shared copy, and restarting
    // it fetches the shared one, saying why.
    let v = d.ctl(&["verify", &id, "--epoch", "1"]);
    assert!(
        v.ok().contains("shared copy: ok") && !v.stdout.contains("local copy"),
        "{v:?}"
    );
    d.kill_job(job);
    d.wait_state(job, "killed", LIMIT);
    let r = d.ctl(&["restart", &id, "--epoch", "1"]);
    let said = r.ok().to_string() + &r.stderr;
    assert!(
        said.contains("from its shared copy") && said.contains("deleted by retention"),
        "{r:?}"
    );
    assert!(d.images(job, 1).join("MANIFEST").is_file(), "fetched back");
    assert_eq!(
        d.epochs(job)[0]["storage"],
        "durable",
        "its local copy is recorded again"
    );
    assert_eq!(d.wait_checksum(job, LIMIT), want, "restarted from shared");
}

/// Shared storage that fills up during a flush: the epoch stays committed and restorable from
/// its local copy, its storage says `flush-failed` naming the node and the cause, the partial
/// shared copy is removed, and the job is not touched.
#[test]
fn a_full_shared_disk_fails_the_flush_and_keeps_the_local_copy() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "mkfs.ext4");
    // 16 MiB of shared storage for images of about 38 MB.
    let d = Ckptd::start(Options {
        shared_size: Some("16M".into()),
        ..Options::default()
    });
    let job = d.run_job("heat", &Mpi::Mpich.heat_argv(4, 256, 3000, 2000));
    let id = job.to_string();
    d.wait_progress(job, 1, LIMIT);
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    let e = wait_storage(&d, job, 1, "flush-failed");
    assert_eq!(e["state"], "committed", "{e}");
    let why = e["flush_detail"].as_str().unwrap_or_default();
    assert!(
        why.contains("node0") && why.contains("No space left"),
        "names the node and the cause: {e}"
    );
    let shared = d.dir.path().join("shared").join(&id);
    assert!(
        !shared.join("1/node0").exists(),
        "the partial copy is removed"
    );
    let packs = shared.join("packs/node0");
    let left = std::fs::read_dir(&packs).map(|r| r.count()).unwrap_or(0);
    assert_eq!(left, 0, "no pack is left in {}", packs.display());
    let v = d.ctl(&["verify", &id]);
    assert!(v.ok().contains("node node0 local copy: ok"), "{v:?}");
    assert_eq!(d.status(job)["state"], "running", "the job kept running");
    d.ctl(&["cancel", &id]).ok();
}

/// The number after `key=` in a log line (0 if absent).
fn field_u64(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.trim_matches(|c: char| !c.is_ascii_digit()).parse().ok())
        .unwrap_or(0)
}
