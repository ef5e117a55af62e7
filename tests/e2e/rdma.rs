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
