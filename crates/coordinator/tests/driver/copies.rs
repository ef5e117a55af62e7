//! Partner copies, against the in-process fake agents of the phase tests: when an epoch's
//! copies are made (not behind the previous epoch's flush) and how a part that moved fetches
//! its copy from a third node.
use std::time::Duration;

use crate::cluster::*;
use crate::placement::placed;

/// An epoch's partner copies do not wait for the previous epoch's flush to shared storage:
/// with epoch 1's flush stuck on n1, epoch 2 is still copied to partners; its own flush waits
/// for epoch 1's (they stay in epoch order).
#[tokio::test]
async fn partner_copies_of_the_newest_epoch_pass_a_slow_flush_of_the_one_before() {
    let c = Cluster::start_sharing(|cfg| cfg.redundancy.partner = true, "/shared").await;
    let job = c.job().await;
    c.script("n1", "flush", Act::Hang);
    assert_eq!(c.checkpoint(job, false).await.unwrap(), 1);
    c.wait_call("n1", "flush").await;
    assert_eq!(c.checkpoint(job, false).await.unwrap(), 2);
    let partners = |epoch| {
        c.coord
            .registry
            .epoch(job, epoch)
            .unwrap()
            .unwrap()
            .partners
    };
    let begin = std::time::Instant::now();
    while partners(2).len() < 3 {
        assert!(
            begin.elapsed() < Duration::from_secs(10),
            "epoch 2 waits for epoch 1's flush: {:?}",
            partners(2)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(partners(1).len(), 3, "epoch 1 was copied first");
    // Epoch 2's flush has not started: the only flush calls are epoch 1's, one per node.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(c.nodes_called("flush"), ["n1", "n2", "n3"]);
}

/// n3's partner copy is kept by n1 (the ring n1 -> n2 -> n3 -> n1). When n3's part moves to
/// n4, ckptd grants n4 the fetch of that copy on n1 and names n1 as the partner in n4's
/// restore.
#[tokio::test]
async fn a_moved_part_may_fetch_its_partner_copy_from_a_third_node() {
    let c = Cluster::start_with(|cfg| {
        cfg.job_network.addresses = "10.9.0.10-10.9.0.20".into();
        cfg.job_network.prefix = 24;
        cfg.redundancy.partner = true;
    })
    .await;
    c.add_node("n4").await;
    let job = c.stopped_job().await;
    let begin = std::time::Instant::now();
    while c
        .coord
        .registry
        .epoch(job, 2)
        .unwrap()
        .unwrap()
        .partners
        .is_empty()
    {
        assert!(
            begin.elapsed() < Duration::from_secs(10),
            "no partner copies"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let partners = c.coord.registry.epoch(job, 2).unwrap().unwrap().partners;
    assert_eq!(
        partners.get("n3").map(String::as_str),
        Some("n1"),
        "{partners:?}"
    );
    let (grants, n4) = restart_n3_on_n4(&c, job).await;
    assert_eq!(grants, [("n1".to_string(), format!("{job} 2 n3->n4"))]);
    assert!(n4.ends_with(" partner=n1 from=n3"), "{n4}");
}

/// Restarts epoch 2 with n3's part on n4: the grants ckptd gave for it (sorted) and what n4
/// was asked to restore.
async fn restart_n3_on_n4(c: &Cluster, job: u64) -> (Vec<(String, String)>, String) {
    c.world.lock().unwrap().log.clear();
    assert_eq!(
        c.restart_on(job, 2, &placed(&[], &["n3=n4"]))
            .await
            .unwrap(),
        2
    );
    let mut grants = c.calls("allow-fetch");
    grants.sort();
    let n4 = c
        .calls("restore")
        .into_iter()
        .find(|(n, _)| n == "n4")
        .unwrap()
        .1;
    (grants, n4)
}

/// Under `[redundancy] scheme = "xor:3"`, a committed epoch of a job on n1..n3 is encoded: every
/// member lets the two others read its images, each encodes the rows it holds, and the epoch
/// records the group's parity (no partner copies). A part moved to n4 then restores with the
/// group named and the grants to read the two members left and their parity.
#[tokio::test]
async fn an_encoded_epoch_records_its_groups_parity_and_a_moved_part_gets_the_group() {
    let c = Cluster::start_with(|cfg| {
        cfg.job_network.addresses = "10.9.0.10-10.9.0.20".into();
        cfg.job_network.prefix = 24;
        cfg.redundancy.scheme = "xor:3".into();
    })
    .await;
    c.add_node("n4").await;
    let job = c.stopped_job().await;
    let encodings = |epoch| {
        c.coord
            .registry
            .epoch(job, epoch)
            .unwrap()
            .unwrap()
            .encodings
    };
    let begin = std::time::Instant::now();
    while encodings(2).is_empty() {
        assert!(begin.elapsed() < Duration::from_secs(10), "not encoded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e = c.coord.registry.epoch(job, 2).unwrap().unwrap();
    assert!(e.partners.is_empty(), "parity instead of partner copies");
    assert_eq!(e.encoded_scheme(), Some("xor:3"));
    let g = &e.encodings[0];
    assert_eq!(
        g.members
            .iter()
            .map(|m| m.node.as_str())
            .collect::<Vec<_>>(),
        ["n1", "n2", "n3"]
    );
    assert_eq!(g.parity.len(), 3, "one shard a row");
    for n in ["n1", "n2", "n3"] {
        assert!(c
            .calls("encode")
            .iter()
            .any(|(m, d)| m == n && d == "2 xor:3 n1,n2,n3"));
    }
    let (grants, n4) = restart_n3_on_n4(&c, job).await;
    assert_eq!(
        grants,
        [
            ("n1".to_string(), format!("{job} 2 n1->n4")),
            ("n1".to_string(), format!("{job} 2 n1->n4 parity")),
            ("n2".to_string(), format!("{job} 2 n2->n4")),
            ("n2".to_string(), format!("{job} 2 n2->n4 parity")),
        ]
    );
    assert!(n4.ends_with(" group=n1,n2,n3 from=n3"), "{n4}");
}

/// A job with no more nodes than its scheme's parity shards per row gets no parity: the commit
/// says so in its progress (as ckptctl shows it), and no node is asked to encode.
#[tokio::test]
async fn a_job_too_small_for_its_parity_is_told_it_has_none() {
    let c = Cluster::start_with(|cfg| cfg.redundancy.scheme = "rs:2+2".into()).await;
    let job = c.job_on("n1").await;
    let (j, epoch) = c
        .coord
        .begin_checkpoint(&OWNER, job, false, coordinator::model::Trigger::User)
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    c.coord.drive_checkpoint(j, epoch, tx).await.unwrap();
    let mut said = Vec::new();
    while let Ok(step) = rx.try_recv() {
        said.push(step.message);
    }
    assert!(
        said.iter()
            .any(|m| m.starts_with("no parity: rs:2+2") && m.contains("this job has 1")),
        "{said:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(c.calls("encode").is_empty(), "nothing encoded");
}

/// A member whose encode fails leaves its group without a record: the epoch is not shown as
/// protected by parity, and stays restorable.
#[tokio::test]
async fn a_failed_encode_records_no_parity_for_its_group() {
    let c = Cluster::start_with(|cfg| cfg.redundancy.scheme = "xor:3".into()).await;
    let job = c.job().await;
    c.script("n2", "encode", Act::Fail(tonic::Code::Unavailable));
    assert_eq!(c.checkpoint(job, false).await.unwrap(), 1);
    c.wait_call("n2", "encode").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let e = c.coord.registry.epoch(job, 1).unwrap().unwrap();
    assert!(e.encodings.is_empty() && e.encoded_scheme().is_none());
    assert!(e.is_restorable());
}

/// `ckptctl run --redundancy` overrides ckptd.toml's scheme for one job: under partner copies,
/// a job that asked for `xor:3` gets parity and no partner copies, one that asked for `none`
/// gets neither, and a scheme that does not parse is refused when the job is run.
#[tokio::test]
async fn a_job_may_choose_its_own_redundancy_scheme() {
    let c = Cluster::start_with(|cfg| cfg.redundancy.partner = true).await;
    let parity = c.job_with_redundancy("xor:3").await;
    assert_eq!(c.checkpoint(parity, false).await.unwrap(), 1);
    c.wait_call("n3", "encode").await;
    let begin = std::time::Instant::now();
    loop {
        let e = c.coord.registry.epoch(parity, 1).unwrap().unwrap();
        if e.encoded_scheme() == Some("xor:3") {
            assert!(e.partners.is_empty(), "no partner copies for it");
            break;
        }
        assert!(begin.elapsed() < Duration::from_secs(10), "not encoded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.coord.cancel(&OWNER, parity).await.unwrap();

    let none = c.job_with_redundancy("none").await;
    assert_eq!(c.checkpoint(none, false).await.unwrap(), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(c.calls("replicate").is_empty() && c.calls("encode").is_empty());
    let e = c.coord.registry.epoch(none, 1).unwrap().unwrap();
    assert!(e.partners.is_empty() && e.encodings.is_empty());

    let bad = coordinator::driver::RunSpec {
        redundancy: "raid5".into(),
        ..sleep_on("n1")
    };
    let err = c.coord.run(OWNER, bad).await.unwrap_err();
    assert!(
        matches!(&err, coordinator::driver::DriveError::Invalid(m) if m.contains("--redundancy \"raid5\": unknown")),
        "{err}"
    );
}
