//! Real InfiniBand verbs on soft-RoCE inside QEMU guests (`scripts/testvm.sh`): the ground the
//! ib-quiesce tests stand on. Skips with a printed reason where the guests are not prepared
//! (`scripts/setup.sh --vm`).
use ckpt_tests::vm;

/// One guest: `rxe0` is an active RoCE port, and CRIU works in the guest's kernel.
#[test]
fn a_guest_has_an_active_soft_roce_port_and_criu_works_there() {
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let criu = ckpt_tests::criu_path().expect("criu (scripts/setup.sh)");
    let r = vm::run(
        &format!(
            "ibv_devinfo -d rxe0 | grep -E 'state|link_layer'\n\
             ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE || exit 3\n\
             {} check || exit 4\n",
            criu.display()
        ),
        &["name=rxe", "timeout=300"],
    );
    assert_eq!(r.status, 0, "guest script failed: {}", r.console);
    assert!(r.console.contains("PORT_ACTIVE"), "{}", r.console);
    assert!(r.console.contains("Ethernet"), "RoCE: {}", r.console);
    assert!(
        r.console.contains("Looks good"),
        "criu check: {}",
        r.console
    );
}

/// Two guests joined by a UDP wire form a two-node RoCE fabric: an RC ping-pong between them.
#[test]
fn two_guests_exchange_rc_messages_over_soft_roce() {
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let server = std::thread::spawn(|| {
        vm::run(
            "timeout 120 ibv_rc_pingpong -d rxe0 -g 0 -n 50\n",
            &[
                "name=a",
                "ip=192.168.98.1/24",
                "mac=52:54:00:00:98:01",
                "wire=17981:17982",
                "timeout=300",
            ],
        )
    });
    let client = vm::run(
        "for i in $(seq 60); do busybox ping -c1 -W1 192.168.98.1 >/dev/null 2>&1 && break; done\n\
         for i in $(seq 60); do timeout 30 ibv_rc_pingpong -d rxe0 -g 0 -n 50 192.168.98.1 && exit 0; sleep 0.5; done\n\
         exit 1\n",
        &[
            "name=b",
            "ip=192.168.98.2/24",
            "mac=52:54:00:00:98:02",
            "wire=17982:17981",
            "timeout=300",
        ],
    );
    let server = server.join().expect("server guest");
    assert_eq!(client.status, 0, "client: {}", client.console);
    assert_eq!(server.status, 0, "server: {}", server.console);
    assert!(client.console.contains("50 iters"), "{}", client.console);
}

/// The `RESULT` lines `tests/guest/ib_job.sh` printed, without the prefix.
fn results(console: &str) -> Vec<String> {
    console
        .lines()
        .filter_map(|l| l.trim().strip_prefix("RESULT "))
        .map(str::to_string)
        .collect()
}

/// The value after `key` in a rank's start/done line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let mut it = line.split_whitespace();
    while let Some(w) = it.next() {
        if w == key {
            return it.next().unwrap_or("");
        }
    }
    panic!("no {key} in {line:?}")
}

/// One guest, two ranks over RC on rxe through ib-quiesce: ckpt checkpoints the job under
/// traffic (quiesce, dump, rebuild, continue); a third checkpoint fails in its dump, after the
/// quiesce, and the job goes on on rebuilt channels; the job is killed, restarted from the
/// last committed image, rebuilt with new QP numbers and keys, and finishes with the checksums
/// of an uninterrupted run. The application's virtual QP number and key never change.
#[test]
fn an_rdma_job_is_checkpointed_killed_and_restarted_in_a_guest() {
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let apps = ckpt_tests::apps();
    let bin = ckpt_tests::bin_dir();
    let body = format!(
        "export BIN={} APP={} ITERS=30000 WORDS=512 CHECKPOINTS=2 ABORT=1\nbash {}\n",
        bin.display(),
        apps.join("rdma_halo").display(),
        ckpt_tests::workspace()
            .join("tests/guest/ib_job.sh")
            .display()
    );
    let r = vm::run(&body, &["name=ibjob", "mem=2048", "timeout=900"]);
    assert_eq!(r.status, 0, "guest script failed: {}", r.console);
    let res = results(&r.console);
    eprintln!("{}", res.join("\n"));
    let find = |p: &str| {
        res.iter()
            .filter(|l| l.starts_with(p))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(find("checkpoint ").len(), 2, "{}", r.console);
    let aborted = find("aborted checkpoint: ");
    assert!(
        aborted.len() == 1 && aborted[0].contains("local-checkpoint"),
        "the injected local-checkpoint failure: {}",
        r.console
    );
    assert_eq!(
        find("after the abort the job goes on").len(),
        1,
        "{}",
        r.console
    );
    assert_eq!(
        find("channels rebuilt after the abort").len(),
        1,
        "{}",
        r.console
    );
    for rank in 0..2 {
        let want = find(&format!("reference rank {rank} "));
        let got = find(&format!("restarted rank {rank} "));
        let (want, got) = (
            field(&want[0], rank.to_string().as_str()),
            field(&got[0], rank.to_string().as_str()),
        );
        assert!(
            want.len() == 16,
            "reference checksum of rank {rank}: {}",
            r.console
        );
        assert_eq!(got, want, "rank {rank} after restart: {}", r.console);
        let start = find(&format!("line rank {rank} start "));
        let done = find(&format!("line rank {rank} done "));
        assert_eq!((start.len(), done.len()), (1, 1), "{}", r.console);
        let (s, d) = (&start[0], &done[0]);
        assert_eq!(field(s, "vqpn"), field(d, "vqpn"), "virtual QPN kept");
        assert_eq!(field(s, "vkey"), field(d, "vkey"), "virtual key kept");
        assert_ne!(
            field(s, "qpn"),
            field(d, "qpn"),
            "real QPN changed: {s} / {d}"
        );
        assert_ne!(
            field(s, "rkey"),
            field(d, "rkey"),
            "real rkey changed: {s} / {d}"
        );
        assert!(field(d, "rebuilds").parse::<u64>().unwrap() >= 1, "{d}");
    }
}

/// Two guests joined by a UDP wire, one rank on each: ckptd and an agent in guest a, an agent
/// in guest b. The job (rank 1 started on b through `ckpt-rsh`) is checkpointed under traffic,
/// every process on both nodes is SIGKILLed, and the restarted job finishes with the checksums
/// of an uninterrupted run, with new real QP numbers behind the same virtual ones.
#[test]
fn an_rdma_job_across_two_guests_is_checkpointed_killed_and_restarted() {
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let apps = ckpt_tests::apps();
    let share = tempfile::tempdir().expect("share dir");
    let body = |role: &str| {
        format!(
            "export ROLE={role} BIN={} APP={} ITERS=8000 WORDS=512\nbash {}\n",
            ckpt_tests::bin_dir().display(),
            apps.join("rdma_halo").display(),
            ckpt_tests::workspace()
                .join("tests/guest/ib_two_nodes.sh")
                .display()
        )
    };
    let share_arg = format!("share={}", share.path().display());
    let b = {
        let (body, share_arg) = (body("b"), share_arg.clone());
        std::thread::spawn(move || {
            vm::run(
                &body,
                &[
                    "name=ib2b",
                    "ip=192.168.98.2/24",
                    "mac=52:54:00:00:98:12",
                    "wire=17992:17991",
                    "mem=1536",
                    "timeout=900",
                    &share_arg,
                ],
            )
        })
    };
    let a = vm::run(
        &body("a"),
        &[
            "name=ib2a",
            "ip=192.168.98.1/24",
            "mac=52:54:00:00:98:11",
            "wire=17991:17992",
            "mem=2048",
            "timeout=900",
            &share_arg,
        ],
    );
    let b = b.join().expect("guest b");
    assert_eq!(
        a.status, 0,
        "guest a: {}\nguest b: {}",
        a.console, b.console
    );
    assert_eq!(b.status, 0, "guest b: {}", b.console);
    let res = results(&a.console);
    let find = |p: &str| res.iter().find(|l| l.starts_with(p)).cloned();
    assert!(find("checkpoint ok").is_some(), "{}", a.console);
    // One QP per node, each connected to the other's: each node is sent its peer's endpoint
    // only (all of the job's to both would be 4).
    let rebuild = find("rebuild ").unwrap_or_default();
    assert!(
        rebuild.contains(": 2 QP(s), 2 endpoint(s) relayed"),
        "{rebuild}: {}",
        a.console
    );
    for rank in 0..2 {
        let r = rank.to_string();
        let want = find(&format!("reference rank {rank} ")).expect("reference");
        let got = find(&format!("restarted rank {rank} ")).expect("restarted");
        assert_eq!(
            field(&got, &r),
            field(&want, &r),
            "rank {rank}: {}",
            a.console
        );
        assert_eq!(field(&want, &r).len(), 16, "{}", a.console);
        let s = find(&format!("line rank {rank} start ")).expect("start line");
        let d = find(&format!("line rank {rank} done ")).expect("done line");
        assert_eq!(field(&s, "vqpn"), field(&d, "vqpn"));
        assert_ne!(field(&s, "qpn"), field(&d, "qpn"), "{s} / {d}");
    }
    assert!(
        b.console.contains("channel rebuilt"),
        "guest b's agent rebuilt its channel: {}",
        b.console
    );
}

/// One guest: the unmodified `heat` (Open MPI, two ranks, not linked with ib-quiesce) over UCX
/// restricted to its verbs transports runs through `libckpt_verbs.so` to the checksum it has
/// without it; the data moved over rxe, and each rank's layer saw the device, translated its
/// posts and completions, and refused nothing.
#[test]
fn an_unmodified_mpi_job_over_verbs_runs_through_the_verbs_layer() {
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let lib = ckpt_tests::bin_dir().join("libckpt_verbs.so");
    assert!(lib.exists(), "{} (cargo build --release)", lib.display());
    let body = format!(
        "export LIB={} APP={} N=64 ITERS=200\nbash {}\n",
        lib.display(),
        ckpt_tests::apps().join("heat.openmpi").display(),
        ckpt_tests::workspace()
            .join("tests/guest/verbs_layer.sh")
            .display()
    );
    let r = vm::run(&body, &["name=verbs", "mem=2048", "timeout=600"]);
    assert_eq!(r.status, 0, "guest script failed: {}", r.console);
    let res = results(&r.console);
    eprintln!("{}", res.join("\n"));
    let value = |p: &str| {
        res.iter()
            .find_map(|l| l.strip_prefix(p))
            .unwrap_or_else(|| panic!("no {p:?} in {}", r.console))
            .to_string()
    };
    let plain = value("plain checksum ");
    assert_eq!(plain.len(), 16, "{plain:?}");
    assert_eq!(
        value("layer checksum "),
        plain,
        "the same result through the layer"
    );
    let sent: u64 = value("sent_pkts ").parse().expect("a count");
    assert!(sent > 100, "the ranks talked over rxe: {sent} packets");
    let statuses: Vec<serde_json::Value> = res
        .iter()
        .filter_map(|l| l.strip_prefix("status "))
        .map(|s| serde_json::from_str(s).expect("status JSON"))
        .collect();
    assert_eq!(statuses.len(), 2, "one report per rank: {}", r.console);
    for s in &statuses {
        assert_eq!(s["devices"], serde_json::json!(["rxe0"]), "{s}");
        assert!(s["send_wrs"].as_u64().unwrap() > 50, "{s}");
        assert!(s["recv_wrs"].as_u64().unwrap() > 0, "{s}");
        assert!(s["completions"].as_u64().unwrap() > 50, "{s}");
        assert_eq!(s["refused"], serde_json::json!([]), "{s}");
        assert_eq!(
            s["unknown_lkeys"], 0,
            "every key posted was the layer's: {s}"
        );
        assert_eq!(s["unknown_qpns"], 0, "{s}");
    }
}

/// (virtual, real) numbers, sorted.
type Pairs = Vec<(u64, u64)>;

/// The rebuilds a layer status reports, each as (virtual, real) QP numbers and rkeys.
fn rebuilds(status: &serde_json::Value) -> Vec<(Pairs, Pairs)> {
    let pairs = |v: &serde_json::Value, virt: &str, real: &str| -> Pairs {
        let mut p: Pairs = v
            .as_array()
            .unwrap_or(&Vec::new())
            .iter()
            .map(|x| (x[virt].as_u64().unwrap(), x[real].as_u64().unwrap()))
            .collect();
        p.sort_unstable();
        p
    };
    status["rebuilds"]
        .as_array()
        .expect("rebuilds")
        .iter()
        .map(|r| {
            (
                pairs(&r["qps"], "virtual_qpn", "real_qpn"),
                pairs(&r["mrs"], "rkey", "real_rkey"),
            )
        })
        .collect()
}

/// One guest, two ranks: the unmodified `heat` (Open MPI, not linked with ib-quiesce) over UCX's
/// verbs transports, with `libckpt_verbs.so` preloaded, under ckpt: checkpointed twice under
/// traffic, a third checkpoint aborted after the quiesce (its dump fails) with the job going on,
/// then every process SIGKILLed and the job restarted from its images: it ends with the checksum
/// of an uninterrupted run without the layer. The data moved over rxe; every rebuild put new real
/// QP numbers and keys behind the same virtual ones. Before it, the same job with UCX's rdmacm
/// module (it holds the RDMA connection manager) is refused at initial sync and runs on.
#[test]
fn an_unmodified_mpi_job_over_verbs_is_checkpointed_aborted_killed_and_restarted() {
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let bin = ckpt_tests::bin_dir();
    let lib = bin.join("libckpt_verbs.so");
    assert!(lib.exists(), "{} (cargo build --release)", lib.display());
    let body = format!(
        "export BIN={} LIB={} APP={} N=128 ITERS=6000 SLEEP=2000\nbash {}\n",
        bin.display(),
        lib.display(),
        ckpt_tests::apps().join("heat.openmpi").display(),
        ckpt_tests::workspace()
            .join("tests/guest/verbs_job.sh")
            .display()
    );
    let r = vm::run(&body, &["name=verbsjob", "mem=2048", "timeout=800"]);
    assert_eq!(r.status, 0, "guest script failed: {}", r.console);
    let res = results(&r.console);
    let value = |p: &str| {
        res.iter()
            .find_map(|l| l.strip_prefix(p))
            .unwrap_or_else(|| panic!("no {p:?} in {}", r.console))
            .to_string()
    };
    let reference = value("reference checksum ");
    assert_eq!(reference.len(), 16, "{reference:?}");
    assert_eq!(value("restarted checksum "), reference, "{}", r.console);
    // UCX with its rdmacm module holds the connection manager: refused at initial sync, naming
    // the descriptor; the job finishes right.
    let refused = value("rdmacm refused: ");
    assert!(
        refused.contains("initial-sync") && refused.contains("/dev/infiniband/rdma_cm as fd "),
        "{refused}"
    );
    assert_eq!(value("rdmacm job checksum "), reference);
    for i in 1..=2 {
        value(&format!("checkpoint {i} ok"));
    }
    assert!(
        value("2 verbs layer(s) drained").contains("releasing and freezing"),
        "a second quiesce round released the drained layers"
    );
    assert!(value("aborted checkpoint: ").contains("local-checkpoint"));
    value("after the abort the job goes on");
    let sent: u64 = value("sent_pkts ").parse().expect("a count");
    assert!(sent > 1000, "the ranks talked over rxe: {sent} packets");
    let statuses = |prefix: &str| -> Vec<serde_json::Value> {
        res.iter()
            .filter_map(|l| l.strip_prefix(prefix))
            .map(|s| serde_json::from_str(s).expect("status JSON"))
            .collect()
    };
    let running = statuses("running status ");
    assert_eq!(running.len(), 2, "{}", r.console);
    for s in &running {
        assert_eq!(s["refused"], serde_json::json!([]), "{s}");
        assert_eq!(
            (&s["unknown_lkeys"], &s["unknown_qpns"]),
            (&0.into(), &0.into())
        );
        // Two checkpoints and the abort: three rebuilds, each with new real numbers behind the
        // virtual ones the program has held since it started.
        let rb = rebuilds(s);
        assert_eq!(rb.len(), 3, "{s}");
        let virt = |v: &[(u64, u64)]| v.iter().map(|p| p.0).collect::<Vec<_>>();
        for (qps, mrs) in &rb {
            assert!(qps.len() >= 2 && !mrs.is_empty(), "{s}");
            assert_eq!(virt(qps), virt(&rb[0].0), "virtual QPNs unchanged: {s}");
            assert_eq!(virt(mrs), virt(&rb[0].1), "virtual rkeys unchanged: {s}");
            assert!(qps.iter().all(|(v, r)| v != r), "new real QPNs: {s}");
            assert!(mrs.iter().all(|(v, r)| v != r), "new real rkeys: {s}");
        }
        assert_ne!(rb[1].0, rb[2].0, "each rebuild has its own real QPNs");
    }
    let last = statuses("final status ");
    assert_eq!(
        last.len(),
        2,
        "each restored rank reported at its exit: {}",
        r.console
    );
    for s in &last {
        // Restored from the second checkpoint (one rebuild before it), then rebuilt.
        assert_eq!(rebuilds(s).len(), 2, "{s}");
        assert_eq!(s["refused"], serde_json::json!([]), "{s}");
    }
}

/// One guest, a plain verbs program (`tests/apps/verbs_refusals.c`: a UD QP in RTS) with the
/// verbs layer preloaded, under ckpt. Alone it is checkpointed. When it also holds the device
/// file open itself, or has its QP attached to a multicast group through the layer (passed
/// through to rxe), a checkpoint is refused at initial sync naming the process and the
/// descriptor or the feature. Each time the program keeps running.
#[test]
fn a_verbs_fd_outside_the_layer_and_multicast_in_use_are_refused_and_the_job_runs_on() {
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let bin = ckpt_tests::bin_dir();
    let lib = bin.join("libckpt_verbs.so");
    assert!(lib.exists(), "{} (cargo build --release)", lib.display());
    let app = ckpt_tests::apps().join("verbs_refusals");
    assert!(app.exists(), "{} (make -C tests/apps)", app.display());
    let body = format!(
        "export BIN={} LIB={} APP={}\nbash {}\n",
        bin.display(),
        lib.display(),
        app.display(),
        ckpt_tests::workspace()
            .join("tests/guest/verbs_refusals.sh")
            .display()
    );
    let r = vm::run(&body, &["name=refusals", "mem=2048", "timeout=600"]);
    assert_eq!(r.status, 0, "guest script failed: {}", r.console);
    let res = results(&r.console);
    let value = |p: &str| {
        res.iter()
            .find_map(|l| l.strip_prefix(p))
            .unwrap_or_else(|| panic!("no {p:?} in {}", r.console))
            .to_string()
    };
    // rxe takes the multicast attach the layer passes through.
    assert_eq!(value("plain "), "ready mcast attached");
    // The control case: the layer's own descriptor is not refused.
    assert_eq!(value("none "), "ready");
    value("none checkpointed");

    // The program's own descriptor on the device file: named with its number.
    let ready = value("fd ready fd ");
    let (fd, device) = ready.split_once(" on ").expect("fd N on PATH");
    let refused = value("fd refused: ");
    assert!(
        refused.contains("initial-sync")
            && refused.contains("(verbs_refusals)")
            && refused.contains(&format!("holds {device} as fd {fd},"))
            && refused.contains("did not open"),
        "{refused}"
    );
    // Multicast through the layer: named as the feature in use.
    assert_eq!(value("mcast "), "ready mcast attached");
    let refused = value("mcast refused: ");
    assert!(
        refused.contains("initial-sync")
            && refused.contains("(verbs_refusals)")
            && refused.contains("uses multicast (ibv_attach_mcast)")
            && refused.contains("ff0e::1"),
        "{refused}"
    );
    for mode in ["none", "fd", "mcast"] {
        let ticks: u32 = value(&format!("{mode} runs on: "))
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .expect("a count");
        // 20 at 100 ms each; a slow guest prints fewer, a stopped program none.
        assert!(
            ticks >= 5,
            "{mode}: the program ran on ({ticks} ticks in 2 s)"
        );
    }
}
