//! Node-local staging under pressure: a staging file system that is too full, or that fills up
//! while the job is being dumped, aborts the epoch cleanly. The job keeps running and earlier
//! epochs stay restorable. Retention then expires old epochs and deletes their images. Skips
//! with a printed reason where CRIU or MPICH is missing.
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use ckpt_tests::{skip_unless_ready, Ckptd, Mpi, Options};

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

    // Retention (keep_local = 1): the next commit expires epoch 1 and deletes its images.
    d.ctl(&["checkpoint", &id, "--wait"]).ok();
    let e = &d.epochs(job)[0];
    assert_eq!(e["state"], "expired", "{e}");
    assert!(
        e["reason"].as_str().unwrap().contains("keep_local = 1"),
        "{e}"
    );
    let begin = Instant::now();
    while d.images(job, 1).exists() {
        assert!(
            begin.elapsed() < LIMIT,
            "images of expired epoch 1 were not deleted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(d.images(job, 4).exists(), "the kept epoch's images stay");
    let v = d.ctl(&["verify", &id, "--epoch", "1"]);
    assert_eq!(v.code, 4, "an expired epoch is not offered: {v:?}");
    assert!(v.stderr.contains("expired"), "{v:?}");
    d.ctl(&["verify", &id]).ok();
    assert_eq!(d.wait_checksum(job, LIMIT), want, "restarted from epoch 1");
}
