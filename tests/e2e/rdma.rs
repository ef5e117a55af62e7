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
/// The one test across guests that every run takes (the fabric the others need); jobs over it
/// run under `CKPT_FULL=1` (`an_rdma_job_with_shared_memory_moves_to_other_guests`).
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

/// The release build's verbs layer, which the guests' agents preload (it must be built).
fn verbs_layer() -> std::path::PathBuf {
    let lib = ckpt_tests::bin_dir().join("libckpt_verbs.so");
    assert!(lib.exists(), "{} (cargo build --release)", lib.display());
    lib
}

/// What follows `prefix` in the first RESULT line that starts with it (`console` for the panic).
fn value_of(res: &[String], prefix: &str, console: &str) -> String {
    res.iter()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in {console}"))
        .to_string()
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
    rdma_job_in_a_guest("criu");
}

/// The same job under the DMTCP engine: the channels are quiesced before DMTCP's checkpoint and
/// rebuilt after it as with CRIU, and after DMTCP's restart, whose processes have new PIDs (the
/// channels find their rebuild flags by the kernel's PID, not DMTCP's virtual one).
#[test]
fn an_rdma_job_under_dmtcp_is_checkpointed_killed_and_restarted_in_a_guest() {
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let dmtcp = ["/opt/dmtcp/bin", "/usr/local/bin"]
        .iter()
        .any(|d| std::path::Path::new(d).join("dmtcp_launch").is_file());
    if !dmtcp {
        eprintln!("SKIPPED: needs DMTCP in /opt/dmtcp or /usr/local (see docs/dmtcp.md)");
        return;
    }
    rdma_job_in_a_guest("dmtcp");
}

fn rdma_job_in_a_guest(engine: &str) {
    let apps = ckpt_tests::apps();
    let bin = ckpt_tests::bin_dir();
    let env = format!(
        "BIN={} APP={} ITERS=30000 WORDS=512 CHECKPOINTS=2 ABORT=1 ENGINE={engine}",
        bin.display(),
        apps.join("rdma_halo").display(),
    );
    let r = vm::run_script("ibjob", "tests/guest/ib_job.sh", &env, 900);
    let res = results(&r.console);
    eprintln!("{}", res.join("\n"));
    let find = |p: &str| {
        res.iter()
            .filter(|l| l.starts_with(p))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        find("engine "),
        [format!("engine \"engine\":\"{engine}\"")],
        "{}",
        r.console
    );
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
/// every process on both nodes is SIGKILLed, guest b's soft-RoCE device is replaced by another
/// (another name, another GID, as on a node a part moved to), and the restarted job finishes
/// with the checksums of an uninterrupted run, each rank having rebuilt its QPs behind the same
/// virtual numbers (rank 0 with new real ones; rank 1's are the first of a fresh device, which
/// may be the old numbers again). Only with `CKPT_FULL=1`, as
/// `an_rdma_job_with_shared_memory_moves_to_other_guests` (a job across guests on new GIDs) is:
/// every run takes a job linked with ib-quiesce in one guest.
#[test]
fn an_rdma_job_across_two_guests_is_checkpointed_killed_and_restarted() {
    ckpt_tests::slow_variant!("an_rdma_job_is_checkpointed_killed_and_restarted_in_a_guest");
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let env = format!(
        "BIN={} APP={} ITERS=8000 WORDS=512",
        ckpt_tests::bin_dir().display(),
        ckpt_tests::apps().join("rdma_halo").display(),
    );
    let (a, b) = vm::run_two("ib2", "tests/guest/ib_two_nodes.sh", &env, 17991, 900);
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
        assert_eq!(field(&d, "rebuilds"), "1", "{d}");
        if rank == 0 {
            assert_ne!(field(&s, "qpn"), field(&d, "qpn"), "{s} / {d}");
        }
    }
    assert!(
        b.console.contains("channel rebuilt"),
        "guest b's agent rebuilt its channel: {}",
        b.console
    );
    // Rank 1 was restored on a guest whose device is another one: rxe0 gone, rxe_moved with
    // another GID in its place (as on a node a part moved to).
    let moved = results(&b.console)
        .into_iter()
        .find(|l| l.starts_with("device rxe0 gid "))
        .unwrap_or_else(|| panic!("no device change on b: {}", b.console));
    let (old, new) = moved["device rxe0 gid ".len()..]
        .split_once(" -> ")
        .expect("old -> new");
    let new_gid = new.rsplit_once("gid ").map(|(_, g)| g).unwrap_or_default();
    assert!(new.starts_with("rxe_moved gid "), "{moved}");
    assert!(
        !new_gid.is_empty() && old != new_gid,
        "another GID: {moved}"
    );
    eprintln!("guest b: {moved}");
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

/// The layer statuses printed after `prefix` in RESULT lines.
fn statuses(res: &[String], prefix: &str) -> Vec<serde_json::Value> {
    res.iter()
        .filter_map(|l| l.strip_prefix(prefix))
        .map(|s| serde_json::from_str(s).expect("status JSON"))
        .collect()
}

/// Each running rank's layer saw rxe0 and carried traffic, refused nothing, met no key or QPN it
/// did not know, and rebuilt
/// `n` times, each time with new real QPNs and rkeys behind the virtual ones the program has
/// held since it started.
fn assert_rebuilt_behind_the_same_virtual_numbers(running: &[serde_json::Value], n: usize) {
    for s in running {
        assert_eq!(s["devices"], serde_json::json!(["rxe0"]), "{s}");
        for count in ["send_wrs", "recv_wrs", "completions"] {
            assert!(
                s[count].as_u64().unwrap() > 50,
                "the layer carried traffic: {s}"
            );
        }
        assert_eq!(s["refused"], serde_json::json!([]), "{s}");
        assert_eq!(
            (&s["unknown_lkeys"], &s["unknown_qpns"]),
            (&0.into(), &0.into()),
            "every key and QPN posted was the layer's: {s}"
        );
        let rb = rebuilds(s);
        assert_eq!(rb.len(), n, "{s}");
        let virt = |v: &[(u64, u64)]| v.iter().map(|p| p.0).collect::<Vec<_>>();
        for (qps, mrs) in &rb {
            assert!(qps.len() >= 2 && !mrs.is_empty(), "{s}");
            assert_eq!(virt(qps), virt(&rb[0].0), "virtual QPNs unchanged: {s}");
            assert_eq!(virt(mrs), virt(&rb[0].1), "virtual rkeys unchanged: {s}");
            assert!(qps.iter().all(|(v, r)| v != r), "new real QPNs: {s}");
            assert!(mrs.iter().all(|(v, r)| v != r), "new real rkeys: {s}");
        }
        assert_ne!(
            rb[n - 2].0,
            rb[n - 1].0,
            "each rebuild has its own real QPNs"
        );
    }
}

/// Each restored rank reported at its exit: restored from the second checkpoint (one rebuild
/// before it), then rebuilt; nothing refused.
fn assert_restored_from_the_second_checkpoint(last: &[serde_json::Value]) {
    assert_eq!(last.len(), 2, "each restored rank reported at its exit");
    for s in last {
        assert_eq!(rebuilds(s).len(), 2, "{s}");
        assert_eq!(s["refused"], serde_json::json!([]), "{s}");
    }
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
    let lib = verbs_layer();
    let (n, iters) = (128, 6000);
    let reference = ckpt_tests::Mpi::OpenMpi.reference_checksum(2, n, iters);
    let env = format!(
        "BIN={} LIB={} APP={} N={n} ITERS={iters} SLEEP=2000",
        bin.display(),
        lib.display(),
        ckpt_tests::apps().join("heat.openmpi").display(),
    );
    let r = vm::run_script("verbsjob", "tests/guest/verbs_job.sh", &env, 800);
    let res = results(&r.console);
    let value = |p: &str| value_of(&res, p, &r.console);
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
    let running = statuses(&res, "running status ");
    assert_eq!(running.len(), 2, "{}", r.console);
    // Two checkpoints and the abort: three rebuilds.
    assert_rebuilt_behind_the_same_virtual_numbers(&running, 3);
    assert_restored_from_the_second_checkpoint(&statuses(&res, "final status "));
}

/// Two guests, one rank on each: the unmodified `heat` under Open MPI, then under MPICH, both
/// over UCX restricted to its verbs transports, started by `ckptctl run --rdma` (no layer or
/// UCX setting in the command: the agents preload the layer, the settings reach the other node
/// through the job's part_env, mpiexec starts the rank there through ckpt-rsh). Each job is
/// checkpointed twice under traffic, SIGKILLed on both guests and restarted, and ends with the
/// checksum of an uninterrupted run; every rank's layer shows new real QPNs and rkeys behind
/// unchanged virtual ones. Only with `CKPT_FULL=1`, as
/// `an_rdma_job_with_shared_memory_moves_to_other_guests` (MPICH over verbs across two guests,
/// moved) is: every run takes Open MPI over verbs in one guest.
#[test]
fn unmodified_mpi_jobs_over_verbs_across_two_guests_are_checkpointed_killed_and_restarted() {
    ckpt_tests::slow_variant!(
        "an_unmodified_mpi_job_over_verbs_is_checkpointed_aborted_killed_and_restarted (one guest)"
    );
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let bin = ckpt_tests::bin_dir();
    verbs_layer();
    let apps = ckpt_tests::apps();
    let mpis = ["ompi", "mpich"];
    let env = format!(
        "BIN={} OMPI_APP={} MPICH_APP={} N=128 ITERS=4500 SLEEP=3000",
        bin.display(),
        apps.join("heat.openmpi").display(),
        apps.join("heat.mpich").display(),
    );
    let (a, b) = vm::run_two(
        "verbs2",
        "tests/guest/verbs_two_nodes.sh",
        &env,
        17993,
        1500,
    );
    let res = results(&a.console);
    let value = |p: &str| value_of(&res, p, &a.console);
    for mpi in &mpis {
        let reference = value(&format!("{mpi} reference checksum "));
        assert_eq!(reference.len(), 16, "{mpi}: {reference:?}");
        assert_eq!(
            value(&format!("{mpi} restarted checksum ")),
            reference,
            "{mpi}: {}",
            a.console
        );
        assert!(
            value(&format!("{mpi} run ")).contains("UCX_TLS=rc_verbs,ud_verbs,sm,self"),
            "--rdma chose the verbs transports"
        );
        for i in 1..=2 {
            assert_eq!(
                value(&format!("{mpi} checkpoint {i} ok ")),
                "2 verbs layer(s) drained",
                "{mpi}: a layer in each rank, one rank on each guest"
            );
        }
        let sent: u64 = value(&format!("{mpi} a sent_pkts ")).parse().unwrap();
        assert!(sent > 500, "{mpi}: rank 0 sent over rxe: {sent} packets");
        let running = statuses(&res, &format!("{mpi} running status "));
        assert_eq!(running.len(), 2, "{mpi}: both ranks' layers: {}", a.console);
        // One rebuild per checkpoint.
        assert_rebuilt_behind_the_same_virtual_numbers(&running, 2);
        assert_restored_from_the_second_checkpoint(&statuses(
            &res,
            &format!("{mpi} final status "),
        ));
    }
    let b_sent: u64 = results(&b.console)
        .iter()
        .find_map(|l| l.strip_prefix("b sent_pkts "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("guest b's packet count: {}", b.console));
    let least = 500 * mpis.len() as u64;
    assert!(
        b_sent > least,
        "rank 1 sent over rxe from guest b: {b_sent}"
    );
}

/// One guest, plain verbs programs with the verbs layer preloaded, under ckpt
/// (`tests/guest/verbs_plain.sh`). `tests/apps/verbs_refusals.c` (a UD QP in RTS): alone it is
/// checkpointed. When it also holds the device file open itself, or has its QP attached to a
/// multicast group through the layer (passed through to rxe), a checkpoint is refused at
/// initial sync naming the process and the descriptor or the feature. Each time the program
/// keeps running. A program that got an asynchronous event (its SRQ's limit reached) and
/// acknowledges it only after a checkpoint is checkpointed, twice. And `tests/apps/verbs_wr.c`,
/// posting with the newer calls (`ibv_create_qp_ex`, `ibv_wr_*`: RDMA write, read, atomic and
/// send with immediate and inline data in one session a tick), is checkpointed, stopped,
/// restarted and checkpointed again with every tick right.
#[test]
fn plain_verbs_programs_refused_features_unacknowledged_events_and_the_newer_post_calls() {
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let bin = ckpt_tests::bin_dir();
    let lib = verbs_layer();
    let app = ckpt_tests::apps().join("verbs_refusals");
    let wr = ckpt_tests::apps().join("verbs_wr");
    let newqp = ckpt_tests::apps().join("verbs_newqp");
    for a in [&app, &wr, &newqp] {
        assert!(a.exists(), "{} (make -C tests/apps)", a.display());
    }
    let env = format!(
        "BIN={} LIB={} APP={} WR={} NEWQP={}",
        bin.display(),
        lib.display(),
        app.display(),
        wr.display(),
        newqp.display(),
    );
    let r = vm::run_script("plain", "tests/guest/verbs_plain.sh", &env, 900);
    let res = results(&r.console);
    let value = |p: &str| value_of(&res, p, &r.console);
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
    for mode in ["none", "fd", "mcast", "event"] {
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

    // An asynchronous event the program got and had not acknowledged: its SRQ is released
    // all the same (the layer acknowledged the event), the program's own acknowledgement
    // after the rebuild stops at the layer, and the next release works (one acknowledgement
    // too many would make the device's destroy wait for ever); the program ran on (above).
    assert_eq!(value("event ready srq: "), "event srq limit reached");
    value("event checkpoint 1 ok");
    assert_eq!(value("event event "), "acknowledged");
    value("event checkpoint 2 ok");
    let layer = statuses(&res, "event layer ");
    assert_eq!(layer.len(), 1, "{}", r.console);
    assert_eq!(
        layer[0]["async_events_acked_for_program"], 1,
        "the layer acknowledged the event once, at the first release: {}",
        layer[0]
    );

    // The newer post calls: an extended QP through a checkpoint, a stop, a restart (its real
    // QPs, keys and numbers new) and a checkpoint after it; the program checks every tick's
    // read-back, counter (one atomic lost or repeated would show) and message.
    assert_eq!(value("wr "), "ready");
    value("wr checkpoint 1 ok");
    value("wr restarted");
    value("wr checkpoint 3 ok");
    let stopped = ticks_of(&value("wr stopped at "));
    let last = value("wr last ");
    let (t, ok, bad) = ticks_of(&last);
    assert_eq!(bad, 0, "every tick checked out: {last}\n{}", r.console);
    assert_eq!(ok, t, "{last}");
    assert!(
        t >= stopped.0 + 10,
        "it went on after the restart: {last} (stopped at tick {})",
        stopped.0
    );
    let layer = statuses(&res, "wr layer ");
    assert_eq!(layer.len(), 1, "{}", r.console);
    assert_eq!(layer[0]["refused"], serde_json::json!([]), "{}", layer[0]);
    assert!(
        layer[0]["send_wrs"].as_u64().unwrap_or(0) >= 4 * 10,
        "the sessions went through the layer: {}",
        layer[0]
    );
    assert_peers_met_after_a_checkpoint_are_looked_up(&res, &r.console);
}

/// What `verbs_plain.sh` reported of `verbs_newqp` at two addresses, meeting only after a
/// checkpoint: each layer was sent the endpoint at its own address only (the job has two),
/// asked the agent once for the other's when the program met it, and the messages went right;
/// after a kill and a restart each was sent both (its address handle names the peer) and
/// asked nothing more.
fn assert_peers_met_after_a_checkpoint_are_looked_up(res: &[String], console: &str) {
    let ready = value_of(res, "meet ", console);
    assert_eq!(ready.matches("ready qp").count(), 2, "{ready}");
    value_of(res, "meet checkpoint 1 ok", console);
    let rebuilt = |s: &serde_json::Value, i: usize| s["rebuilds"][i]["endpoints_received"].as_u64();
    let before = statuses(res, "meet before restart ");
    assert_eq!(before.len(), 2, "{console}");
    for s in &before {
        assert_eq!(rebuilt(s, 0), Some(1), "its own QP's endpoint only: {s}");
        let lookups = s["lookups"].as_array().expect("lookups");
        assert_eq!(lookups.len(), 1, "one lookup, of the peer met: {s}");
        assert_eq!(lookups[0]["endpoints"], 1, "{s}");
        assert!(lookups[0]["error"].is_null(), "{s}");
    }
    assert_ne!(
        before[0]["lookups"][0]["address"], before[1]["lookups"][0]["address"],
        "each looked up the other"
    );
    for who in ["p", "q"] {
        let line = value_of(res, &format!("meet {who} "), console);
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |k: &str| -> u64 {
            let i = f
                .iter()
                .position(|x| *x == k)
                .unwrap_or_else(|| panic!("{k}: {line}"));
            f[i + 1].parse().unwrap()
        };
        assert_eq!(num("peers"), 1, "{who}: {line}");
        assert_eq!(
            num("bad"),
            0,
            "{who}: a message reached another QP: {console}"
        );
        assert_eq!(
            num("src"),
            0,
            "{who}: a completion named another sender QP: {console}"
        );
        assert!(
            num("ok") >= 30,
            "{who}: messages before and after the restart: {line}"
        );
    }
    let after = statuses(res, "meet after restart ");
    assert_eq!(after.len(), 2, "{console}");
    for s in &after {
        let last = s["rebuilds"].as_array().map_or(0, Vec::len);
        assert!(last >= 2, "{s}");
        assert_eq!(rebuilt(s, last - 1), Some(2), "its own and the peer's: {s}");
        assert_eq!(
            s["lookups"].as_array().map(Vec::len),
            Some(1),
            "none since: {s}"
        );
    }
}

/// `tick T ok O bad B` as (T, O, B).
fn ticks_of(line: &str) -> (u64, u64, u64) {
    let w: Vec<&str> = line.split_whitespace().collect();
    let n = |k: &str| {
        w.iter()
            .position(|x| *x == k)
            .and_then(|i| w.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{k} in {line:?}"))
    };
    (n("tick"), n("ok"), n("bad"))
}

/// Three guests, c a spare. The unmodified `heat` under MPICH with 4 ranks, 2 on each of a and
/// b, started by
/// `ckptctl run --rdma` in sandboxes (a job network): the ranks of a guest talk through UCX's
/// shared memory, the guests over verbs through the layer. Checkpointed under traffic, then
/// once more with `--kill`, then restarted with the parts swapped (`--map ga=gb --map
/// gb=ga`): it ends with the checksum of an uninterrupted run, and every rank's layer shows its
/// port at the other guest's GID now, with new real QPNs and rkeys behind unchanged virtual ones.
/// Pre-copy is on, as by default: both parts are pre-dumped (through the agents' CRIU plugin)
/// before the first checkpoint.
///
/// After it, in the same boots, `tests/apps/verbs_newqp`: two processes of one job over UD QPs
/// through the layer, moved to b (`--map`); then guest b powers off, as a node that fails, and
/// ckptd restarts the job by itself (`--on-failure`) on the spare, guest c. Each process makes 8
/// more QPs after each restart on a device that hands out again, to new QPs, numbers the old
/// ones hold as virtual ones. Every message reaches the QP it was sent to, and the layers set
/// such numbers aside.
///
/// Only with `CKPT_FULL=1`: three guests under emulation on two cores take 8 to 16 minutes.
/// Every run takes an unmodified MPI job over verbs through the layer in one guest, with new
/// real numbers behind the same virtual ones, in
/// `an_unmodified_mpi_job_over_verbs_is_checkpointed_aborted_killed_and_restarted`; what only
/// this test runs is a part moving to another guest's device, and the spare.
#[test]
fn an_rdma_job_with_shared_memory_moves_to_other_guests() {
    ckpt_tests::slow_variant!(
        "an_unmodified_mpi_job_over_verbs_is_checkpointed_aborted_killed_and_restarted (one guest: no move)"
    );
    if let Some(why) = vm::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let bin = ckpt_tests::bin_dir();
    verbs_layer();
    let (n, iters) = (128, 4000);
    let reference = ckpt_tests::Mpi::Mpich.reference_checksum(4, n, iters);
    let app = ckpt_tests::Mpi::Mpich.heat_app();
    let env = format!(
        "BIN={} APP={} NEWQP={} N={n} ITERS={iters} SLEEP=3000 REF={reference}",
        bin.display(),
        app.display(),
        ckpt_tests::apps().join("verbs_newqp").display(),
    );
    let runs = vm::run_guests("verbsmv", "tests/guest/verbs_move.sh", &env, 17995, 1500, 3);
    let (a, b) = (&runs[0], &runs[1]);
    let res = results(&a.console);
    let value = |p: &str| value_of(&res, p, &a.console);
    // Where heat stood when its second checkpoint stopped it (how long its rest runs after the
    // move) and each checkpoint's frozen time and size: in every run's output.
    for l in res
        .iter()
        .filter(|l| l.starts_with("heat stopped at") || l.starts_with("epochs "))
    {
        eprintln!("{l}");
    }
    assert_new_qps_after_restarts_never_collide(&res, &a.console);
    // Another answer than an uninterrupted run's: where heat stood, what each checkpoint and
    // the restart did first (a CI log keeps a panic's first lines), then the guests' reports.
    let steps: Vec<&str> = res
        .iter()
        .map(String::as_str)
        .filter(|l| {
            ["heat stopped", "epochs ", "restart ", "ckpt"]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .collect();
    assert_eq!(
        value("restarted "),
        format!("checksum {reference}"),
        "{}\n--- guest a\n{}\n--- guest b\n{}",
        steps.join("\n"),
        a.console,
        b.console
    );
    assert!(
        value("run ").contains("UCX_TLS=rc_verbs,ud_verbs,sm,self"),
        "--rdma keeps UCX's shared memory"
    );
    assert_eq!(
        value("predumps ready "),
        "2",
        "both parts pre-dumped (the CRIU plugin passes over the device mappings): {}",
        a.console
    );
    for i in 1..=2 {
        assert_eq!(
            value(&format!("checkpoint {i} ok ")),
            "4 verbs layer(s) drained",
            "a layer in each rank"
        );
    }
    let shm: Vec<u64> = res
        .iter()
        .filter_map(|l| l.strip_prefix("a shm maps "))
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(shm.len(), 2, "both ranks on guest a: {}", a.console);
    assert!(
        shm.iter().all(|&m| m > 0),
        "each maps UCX's shared memory: {shm:?}"
    );
    assert!(
        value("restart ").contains("moving"),
        "the restart says which part moves where: {}",
        a.console
    );
    let running = statuses(&res, "running status ");
    let last = statuses(&res, "final status ");
    assert_eq!(running.len(), 4, "every rank's layer: {}", a.console);
    assert_eq!(last.len(), 4, "every restored rank's layer: {}", a.console);
    let key = |s: &serde_json::Value| (s["host"].to_string(), s["pid"].as_u64().unwrap());
    // Where the last rebuild left the rank's port (a final status is written at exit, with
    // everything closed).
    let port = |s: &serde_json::Value, k: &str| {
        let r = s["rebuilds"].as_array().and_then(|r| r.last().cloned());
        r.and_then(|r| r["contexts"][0][k].as_str().map(str::to_string))
            .unwrap_or_default()
    };
    let gid = |s: &serde_json::Value| port(s, "gid_now");
    let ident = |s: &serde_json::Value| port(s, "ident");
    let mut moved = 0;
    for before in &running {
        let after = last
            .iter()
            .find(|s| key(s) == key(before))
            .unwrap_or_else(|| {
                panic!(
                    "{:?} reported after the restart: {}",
                    key(before),
                    a.console
                )
            });
        // The first checkpoint's rebuild (the second stopped the job); restored from the
        // second, whose image holds that rebuild, the rank rebuilt once more.
        assert_eq!(rebuilds(before).len(), 1, "{before}");
        assert_eq!(
            rebuilds(after).len(),
            2,
            "restored from the second checkpoint: {after}"
        );
        assert_eq!(after["refused"], serde_json::json!([]), "{after}");
        assert_eq!(
            ident(after),
            ident(before),
            "peers know it by the same address"
        );
        let virt = |v: &Pairs| v.iter().map(|p| p.0).collect::<Vec<_>>();
        let (rb, ra) = (rebuilds(before), rebuilds(after));
        assert_eq!(
            virt(&ra[1].0),
            virt(&rb[0].0),
            "virtual QPNs unchanged: {after}"
        );
        assert_eq!(
            virt(&ra[1].1),
            virt(&rb[0].1),
            "virtual rkeys unchanged: {after}"
        );
        assert_ne!(
            ra[1].0, rb[0].0,
            "new real QPNs on the other guest: {after}"
        );
        assert_ne!(
            gid(after),
            gid(before),
            "its port is at the other guest's GID now"
        );
        assert_eq!(gid(after).len(), 32, "a GID: {after}");
        moved += 1;
    }
    assert_eq!(moved, 4);
    let total: u64 = running
        .iter()
        .map(|s| s["send_wrs"].as_u64().unwrap())
        .sum();
    assert!(
        total > 200,
        "the layers carried traffic between the guests: {total}"
    );
    let b_sent: u64 = results(&b.console)
        .iter()
        .find_map(|l| l.strip_prefix("b sent_pkts "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("guest b's packet count: {}", b.console));
    assert!(b_sent > 500, "ranks on guest b sent over rxe: {b_sent}");
}

/// What `verbs_newqp` and its layers reported in [`an_rdma_job_with_shared_memory_moves_to_other_guests`]:
/// both processes have 17 QPs (1, then 8 after each restart) and know the other's 17, every
/// message arrived on the QP it named, the restarts moved the job (a to b by hand, b to the
/// spare c by ckptd itself when b was lost), and the
/// layers set aside real numbers that were virtual ones of the job, keeping every virtual
/// number of the job's address unique.
fn assert_new_qps_after_restarts_never_collide(res: &[String], console: &str) {
    let moves: Vec<&String> = res
        .iter()
        .filter(|l| l.starts_with("newqp restart"))
        .collect();
    assert_eq!(moves.len(), 1, "{console}");
    assert!(moves[0].contains("moving"), "{moves:?}");
    // Guest b lost: ckptd restarted the job by itself, its part on the spare.
    let recovery: serde_json::Value =
        serde_json::from_str(&value_of(res, "newqp recovery ", console)).unwrap();
    assert_eq!(recovery["trigger"], "node gb lost", "{recovery}\n{console}");
    assert_eq!(
        recovery["moves"],
        serde_json::json!(["gb=gc"]),
        "{recovery}"
    );
    assert!(
        recovery["outcome"]
            .as_str()
            .unwrap_or_default()
            .starts_with("running again"),
        "{recovery}\n{console}"
    );
    for who in ["p", "q"] {
        let line = value_of(res, &format!("newqp {who} "), console);
        let num = |k: &str| -> u64 {
            let f: Vec<&str> = line.split_whitespace().collect();
            let i = f
                .iter()
                .position(|x| *x == k)
                .unwrap_or_else(|| panic!("{k} in {line}"));
            f[i + 1].parse().unwrap()
        };
        assert_eq!((num("qps"), num("peers")), (17, 17), "{who}: {line}");
        assert_eq!(
            num("bad"),
            0,
            "{who}: a message reached another QP: {console}"
        );
        assert!(num("ok") > 17 * 10, "{who}: traffic on every QP: {line}");
        assert_eq!(
            num("src"),
            0,
            "{who}: a UD completion named the sender by another number than the one it \
             published (wc.src_qp): {console}"
        );
    }
    let layers = statuses(res, "newqp layer ");
    assert_eq!(layers.len(), 2, "{console}");
    let aside: u64 = layers
        .iter()
        .map(|s| s["qpns_set_aside"].as_u64().unwrap())
        .sum();
    assert!(
        aside > 0,
        "the restarts made real numbers that were virtual ones: set aside {aside}: {layers:?}"
    );
    let mut virt: Vec<u64> = layers
        .iter()
        .flat_map(|s| {
            s["qps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|q| q["virtual_qpn"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(virt.len(), 34, "{layers:?}");
    virt.sort_unstable();
    virt.dedup();
    assert_eq!(
        virt.len(),
        34,
        "every virtual QP number of the job's address is unique"
    );
}
