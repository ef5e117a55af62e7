//! Erasure-coded redundancy on test hosts (network namespaces, real agents, CRIU and MPICH, no
//! shared storage): a job's nodes encode their group's parity after every checkpoint, and the
//! parts of nodes lost with their disks are rebuilt from it on spares.
use std::time::{Duration, Instant};

use ckpt_tests::hosts::{destroy_sandbox, heat_on_first, hosts_with, result_on, LIMIT};
use ckpt_tests::{skip_unless_ready, slow_variant, Mpi};

/// heat's size, iterations and sleep per iteration (µs), as in `multi_node.rs`.
const N: u32 = 256;
const ITERS: u32 = 3000;
const SLEEP_US: u32 = 2000;

/// Erasure-coded redundancy, without shared storage: `[redundancy] scheme = "xor:4"`, a job
/// on n1..n4 (one group), n5 the spare. Three checkpoints, each encoded (every node holds one
/// row's parity; epoch 2's encode held while ckptd restarts, and done again by the new one);
/// retention (`keep_local = 2`) deletes epoch 1's images and parity everywhere. n2's images of
/// epoch 3 deleted (its disk replaced), a restart in place rebuilds them from the group.
/// Then n3 is lost with its disks, and one byte of a parity shard of epoch 3 that n3's rebuild
/// needs is flipped on n1: the restart on the spare finds epoch 3's rebuild wrong (the unpack
/// checks every file), the shard failing its digest, falls back to epoch 2, rebuilds n3's
/// images on n5 from n1, n2, n4 and their parity, and the job ends right.
#[test]
fn xor_parity_rebuilds_a_lost_nodes_part_on_the_spare_and_a_flipped_parity_byte_is_caught() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "nft");
    parity_rebuilds_lost_nodes("xor:4", 4, &["n3"], true);
}

/// As above under `rs:4+2`: a job on n1..n6 (one group of 6, two parity shards a row), n7 and
/// n8 the spares; n2 and n5 are lost with their disks, and both parts are rebuilt on the
/// spares from the four members left and their parity.
#[test]
fn rs_parity_rebuilds_two_lost_nodes_parts() {
    skip_unless_ready!("mpiexec.mpich", "mpicc.mpich", "nsenter", "nft");
    slow_variant!(
        "xor_parity_rebuilds_a_lost_nodes_part_on_the_spare_and_a_flipped_parity_byte_is_caught"
    );
    parity_rebuilds_lost_nodes("rs:4+2", 6, &["n2", "n5"], false);
}

/// A job on n1..n`job_nodes` under `scheme`, checkpointed three times (two kept); the nodes in
/// `lose` lost with their disks, their parts restarted on the spares (the nodes after the
/// job's) from parity. With `flip`, a parity byte of epoch 3 that the rebuild needs is flipped
/// first.
fn parity_rebuilds_lost_nodes(scheme: &str, job_nodes: usize, lose: &[&str], flip: bool) {
    let mpi = Mpi::Mpich;
    let ranks = job_nodes as u32;
    let want = mpi.reference_checksum(ranks, N, ITERS);
    let names: Vec<String> = (1..=job_nodes + lose.len())
        .map(|i| format!("n{i}"))
        .collect();
    let all: Vec<&str> = names.iter().map(String::as_str).collect();
    let spares = &all[job_nodes..];
    let spare_list = spares
        .iter()
        .map(|s| format!("\"{s}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let Some((cluster, mut d)) = hosts_with(
        &all,
        flip,
        true,
        None,
        &format!(
            "node_timeout = \"2s\"\n[redundancy]\nscheme = \"{scheme}\"\n[retention]\nkeep_local = 2\n[spares]\nnodes = [{spare_list}]\n"
        ),
    ) else {
        return;
    };
    let job = heat_on_first(&d, &cluster, job_nodes, mpi, (ranks, N, ITERS, SLEEP_US));
    let id = job.to_string();
    let parity = scheme
        .parse::<ckpt_store::erasure::Scheme>()
        .unwrap()
        .parity();
    let root = d.dir.path().to_path_buf();
    let local = |n: &str, epoch: u32| root.join(n).join("local").join(&id).join(epoch.to_string());
    for epoch in [1u32, 2, 3] {
        // With `flip`, epoch 2's encode is held on every node while ckptd restarts: the epoch
        // comes back without parity (an encoding is recorded only once whole) and is encoded
        // again.
        let interrupt = flip && epoch == 2;
        if interrupt {
            d.set_failpoints("encode=delay:3s\n");
        }
        d.ctl(&["checkpoint", &id, "--wait"]).ok();
        if interrupt {
            std::thread::sleep(Duration::from_millis(500));
            assert_eq!(
                d.epochs(job)[1]["encoded"],
                "",
                "held: {}",
                d.epochs(job)[1]
            );
            d.stop_daemon();
            d.set_failpoints("");
            d.start_daemon();
            d.wait_agents(&all);
        }
        let begin = Instant::now();
        while d.epochs(job)[epoch as usize - 1]["encoded"] != scheme {
            assert!(
                begin.elapsed() < LIMIT,
                "not encoded: {}",
                d.epochs(job)[epoch as usize - 1]
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        if interrupt {
            let log = std::fs::read_to_string(d.dir.path().join("ckptd.log")).unwrap_or_default();
            assert!(
                log.lines()
                    .any(|l| l.contains("flushing again after a coordinator restart")
                        && l.contains("epoch=2")),
                "epoch 2 encoded again by the new ckptd"
            );
        }
        let e = &d.epochs(job)[epoch as usize - 1];
        assert_eq!(
            e["partner_copy"], false,
            "parity instead of partner copies: {e}"
        );
        assert_eq!(e["shared_copy"], false, "no shared storage: {e}");
        // Every member holds `parity` rows' shards; what they add up to, per image byte.
        let mut parity_bytes = 0;
        for n in &all[..job_nodes] {
            let files: Vec<_> = std::fs::read_dir(local(n, epoch).join("parity"))
                .unwrap_or_else(|e| panic!("{n}'s parity of epoch {epoch}: {e}"))
                .map(|f| f.unwrap())
                .filter(|f| !f.file_name().to_string_lossy().starts_with('.'))
                .collect();
            assert_eq!(files.len(), parity, "{n} epoch {epoch}");
            parity_bytes += files
                .iter()
                .map(|f| f.metadata().unwrap().len())
                .sum::<u64>();
        }
        assert_eq!(
            e["parity_bytes"], parity_bytes,
            "what `ckptctl epochs` says the parity takes: {e}"
        );
        let images = e["image_bytes"].as_u64().unwrap();
        eprintln!(
            "{scheme} epoch {epoch}: {images} image bytes, {parity_bytes} parity bytes: {:.3} stored per image byte",
            (images + parity_bytes) as f64 / images as f64
        );
    }
    if flip {
        // A disk replaced under a node that stays: n2's images of epoch 3 gone, the job killed
        // everywhere. The restart in place finds nothing usable on n2 and restores its part
        // from the group's parity there.
        d.kill_job_on(&all[..job_nodes], job);
        d.wait_state(job, "killed", LIMIT);
        std::fs::remove_dir_all(local("n2", 3).join("n2")).unwrap();
        let r = d.ctl(&["restart", &id]);
        assert_eq!(r.code, 0, "{r:?}");
        assert!(
            r.stderr
                .contains("node n2 restored (held) from its parity copy"),
            "{r:?}"
        );
        assert!(
            local("n2", 3).join("n2").is_dir(),
            "rebuilt into n2's staging"
        );
    }
    if flip {
        // Row 0's parity (held by n1) covers a segment of every member but n1: n3's rebuild
        // needs it.
        let shard = local("n1", 3).join("parity/0.0");
        let mut bytes = std::fs::read(&shard).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 0x40;
        std::fs::write(&shard, bytes).unwrap();
    }
    // The lost nodes are gone: agents, processes, sandboxes, local images.
    for n in lose {
        d.kill_agent_on(n);
    }
    d.kill_job_on(&all[..job_nodes], job);
    for n in lose {
        destroy_sandbox(n, job);
        std::fs::remove_dir_all(d.dir.path().join(n).join("local")).unwrap();
    }
    d.wait_state(job, "lost", LIMIT);
    // Retention (keep_local = 2) expired epoch 1 with epoch 3; the job's next epoch would have
    // deleted it: a restart or the job's loss has it deleted everywhere, images and parity.
    let begin = Instant::now();
    while let Some(n) = all[..job_nodes].iter().find(|n| local(n, 1).exists()) {
        assert!(
            begin.elapsed() < LIMIT,
            "{n} keeps epoch 1: {}",
            local(n, 1).display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The job is lost with the first of them; the restart places around every node down.
    d.wait_nodes_in(lose, "down", LIMIT);
    // No restart policy: ckptd moves the parts of nodes it cannot reach only when told they
    // are down.
    let down = lose.join(",");
    let r = d.ctl(&["restart", &id, "--on-spares", "--down", &down]);
    assert_eq!(r.code, 0, "{r:?}");
    for n in lose {
        assert!(
            spares
                .iter()
                .any(|to| r.stderr.contains(&format!("{n}'s part to {to}"))
                    && r.stderr.contains(&format!(
                        "node {to} restored (held) {n}'s part from its parity copy"
                    ))),
            "{n}: {r:?}"
        );
    }
    if flip {
        assert!(
            r.stderr.contains("epoch 3 cannot be restored")
                && r.stderr.contains("fail their digests")
                && r.stderr.contains("trying epoch 2"),
            "{r:?}"
        );
    }
    assert_eq!(result_on(&d, "n1", job), want, "restarted from parity");
}
