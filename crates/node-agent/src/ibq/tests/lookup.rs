//! A verbs layer that names addresses is sent only their endpoints; its node keeps the job's,
//! and answers its lookups from them, to the job's processes only.
use super::*;
use ib_quiesce::control::address_id;

/// An endpoint of QP `qpn` at the address whose GID is all `a`, now at the GID all `now`.
fn at(a: u8, qpn: u32, now: u8) -> Endpoint {
    let mut e = Endpoint {
        id: (address_id(&[a; 16]), qpn),
        qpn: qpn + 0x100,
        ..Endpoint::default()
    };
    e.port.gid = [now; 16];
    e
}

/// Takes this process's layer through a drained quiesce and a release, then has it rebuilt,
/// answering `rebuilt` with `addresses`; returns the node's rebuild result and the layer,
/// connected again (down) for the reconnect.
async fn rebuilt_naming(ch: &Arc<Channels>, addresses: Vec<u64>) -> (Rebuilt, FakeLayer) {
    let mut layer = FakeLayer::connect(ch, false).await;
    assert!(comes_up(ch).await);
    drained(ch, &mut layer).await;
    assert!(released(ch, layer).await.1.is_empty());
    let (rebuild, mut layer) = rebuilding(ch).await;
    layer
        .say(&ToAgent::Rebuilt {
            endpoints: vec![at(1, 0x11, 1)],
            peers: None,
            addresses: Some(addresses),
            micros: 10,
        })
        .await;
    (rebuild.await.unwrap().unwrap(), layer)
}

/// What a lookup of `addresses` by this process gets (the layer's own client, blocking).
async fn look_up(ch: &Channels, addresses: Vec<u64>) -> std::io::Result<Vec<Endpoint>> {
    let socket = ch.socket().to_path_buf();
    tokio::task::spawn_blocking(move || {
        ib_quiesce::control::lookup(&socket, &addresses, Duration::from_secs(5))
    })
    .await
    .unwrap()
}

#[test]
fn a_layer_naming_addresses_gets_theirs_and_looks_up_the_rest_within_its_job() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        // Job 7 in JOB_CGROUP, job 8 in another; this process is in job 7 until moved.
        let cgroup = Arc::new(std::sync::Mutex::new(PathBuf::from(JOB_CGROUP)));
        let uid = my_uid();
        let ch = Channels::with_parts(
            dir.path().join("ibq").join("control.sock"),
            move |c: &Path| {
                if c == Path::new(JOB_CGROUP) {
                    Some(JobOwner { job: 7, uid })
                } else if c == Path::new("/sys/fs/cgroup/ckpt-test-8") {
                    Some(JobOwner { job: 8, uid })
                } else {
                    None
                }
            },
            {
                let cgroup = cgroup.clone();
                move |_pid: i32| Ok(vec![cgroup.lock().unwrap().clone()])
            },
            Limits::default(),
        );
        let listener = ch.bind().unwrap();
        tokio::spawn(ch.clone().serve(listener));
        let pid = me().pid;

        // Before any reconnect the node knows nothing of the job: an empty answer.
        assert_eq!(
            look_up(&ch, vec![address_id(&[2; 16])]).await.unwrap(),
            vec![]
        );

        // It names its own address and peer 2's; the node asks for every endpoint of the job.
        let named = vec![address_id(&[1; 16]), address_id(&[2; 16])];
        let ((eps, node_needs), mut layer) = rebuilt_naming(&ch, named).await;
        assert_eq!(eps, vec![at(1, 0x11, 1)]);
        assert_eq!(
            node_needs, None,
            "a layer that looks up makes its node keep all"
        );

        // The job's endpoints: its own, a node-mate's (same address), peers 2 and 3 (3 moved
        // to the GID all 9). It is sent those at the addresses it named.
        let job = [
            at(1, 0x11, 1),
            at(1, 0x12, 1),
            at(2, 0x21, 2),
            at(3, 0x31, 9),
        ];
        let reconnect = tokio::spawn({
            let (ch, job) = (ch.clone(), job.clone());
            async move { ch.reconnect(&[pid], &job, Duration::from_secs(5)).await }
        });
        let ToChannel::Reconnect { endpoints } = layer.command().await else {
            panic!("a reconnect");
        };
        assert_eq!(endpoints, job[..3].to_vec());
        layer.say(&ToAgent::Reconnected { micros: 1 }).await;
        reconnect.await.unwrap().unwrap();
        assert_eq!(ch.table(7).map(|t| t.len()), Some(4));

        // Peer 3, met later, is looked up by the address the program knows it by, or by where
        // its port is now (a datagram's source); an address of no QP finds nothing.
        assert_eq!(
            look_up(&ch, vec![address_id(&[3; 16])]).await.unwrap(),
            vec![job[3].clone()]
        );
        assert_eq!(
            look_up(&ch, vec![address_id(&[9; 16])]).await.unwrap(),
            vec![job[3].clone()]
        );
        assert_eq!(
            look_up(&ch, vec![address_id(&[4; 16])]).await.unwrap(),
            vec![]
        );

        // Too many addresses at once: refused, the connection closed without an answer.
        let mut s = UnixStream::connect(ch.socket()).await.unwrap();
        let ask = ToAgent::Lookup {
            version: PROTOCOL_VERSION,
            pid,
            addresses: (u64::MAX - MAX_LOOKUP as u64..=u64::MAX).collect(),
        };
        let mut line = serde_json::to_vec(&ask).unwrap();
        assert!(
            line.len() < MAX_LINE,
            "under the line cap: the count is what refuses it"
        );
        line.push(b'\n');
        s.write_all(&line).await.unwrap();
        assert!(closed_by_agent(&mut s, Duration::from_secs(5)).await);

        // A process of another job gets nothing of job 7's; one of no job is refused.
        *cgroup.lock().unwrap() = PathBuf::from("/sys/fs/cgroup/ckpt-test-8");
        assert_eq!(
            look_up(&ch, vec![address_id(&[3; 16])]).await.unwrap(),
            vec![]
        );
        *cgroup.lock().unwrap() = PathBuf::from("/sys/fs/cgroup/user.slice");
        assert!(look_up(&ch, vec![address_id(&[3; 16])]).await.is_err());
    });
}

const MAX_LOOKUP: usize = ib_quiesce::control::MAX_LOOKUP_ADDRESSES;

/// A process in the job's cgroup but not of its owner is refused before its lookup is read,
/// as its hello would be.
#[test]
fn a_lookup_from_a_process_not_of_the_jobs_owner_is_refused() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let ch = serving(dir.path(), my_uid() + 1, JOB_CGROUP, Limits::default());
        assert!(look_up(&ch, vec![address_id(&[3; 16])]).await.is_err());
    });
}
