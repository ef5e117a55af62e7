//! The registry in an etcd cluster, and the election of the one ckptd that writes it.
//!
//! Every ckptd of a site points at the same cluster. Each campaigns for one key
//! (`PREFIX/leader`), created under a lease it keeps alive: the one that creates it is the
//! active ckptd, the others stand by and try again when the key goes (the active one stopped,
//! or died and its lease ran out). Every write of the active ckptd is a transaction that first
//! compares the key's creation revision with the one it won: a ckptd that lost the key, even
//! one that does not know it yet (stopped by a debugger, cut off), writes nothing more. When its
//! lease cannot be renewed, [`Leader::lost`] says so and ckptd stops.
//!
//! The registry's calls are synchronous (the embedded database's are); this store runs the
//! etcd client on a runtime of its own and waits for each answer, bounded.
//!
//! It holds one connection per member and sends each call to the member that last answered,
//! going on to the next when one is unreachable or has no leader: a client balancing over all
//! members would keep sending a share of the calls to a member that is down.
use std::future::Future;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity, PutOptions,
    SortOrder, SortTarget, TlsOptions, Txn, TxnOp,
};

use super::{Key, Op, Table};
use crate::config::RegistryConfig;

/// How long one call to one member may take before the next member is tried.
const CALL: Duration = Duration::from_secs(5);
/// How often a standby looks whether the active ckptd's key is gone.
const POLL: Duration = Duration::from_millis(250);
/// The most changes one transaction carries (etcd's default limit is 128).
const MAX_OPS: usize = 120;
/// The most bytes of keys and values one transaction carries (etcd's default limit on a
/// request is 1.5 MiB).
const MAX_BYTES: usize = 1024 * 1024;
/// The largest answer read (a job's whole history at a thousand nodes is megabytes).
const MAX_ANSWER: usize = 256 * 1024 * 1024;

/// The key-value calls of `c`, taking answers up to [`MAX_ANSWER`].
fn kv(c: &Client) -> etcd_client::KvClient {
    c.kv_client().max_decoding_message_size(MAX_ANSWER)
}

/// A connection to each member, and which answered last.
struct Members {
    each: Vec<(String, Client)>,
    answered: std::sync::atomic::AtomicUsize,
}

impl Members {
    /// Runs `call` on the member that answered last, or on the next ones while a member is
    /// unreachable (or cut off from the others: it has no leader).
    async fn call<T, F, Fut>(&self, call: F) -> Result<T, String>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.call_within(CALL, call).await
    }

    /// [`Members::call`], giving each member `each` to answer.
    async fn call_within<T, F, Fut>(&self, each: Duration, call: F) -> Result<T, String>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        use std::sync::atomic::Ordering::Relaxed;
        let first = self.answered.load(Relaxed);
        let mut errors = Vec::new();
        for i in 0..self.each.len() {
            let at = (first + i) % self.each.len();
            let (endpoint, client) = &self.each[at];
            match tokio::time::timeout(each, call(client.clone())).await {
                Ok(Ok(v)) => {
                    self.answered.store(at, Relaxed);
                    return Ok(v);
                }
                Ok(Err(e)) if !unreachable(&e) => return Err(format!("{endpoint}: {e}")),
                Ok(Err(e)) => errors.push(format!("{endpoint}: {e}")),
                Err(_) => errors.push(format!(
                    "{endpoint}: no answer within {}",
                    humantime::format_duration(each)
                )),
            }
        }
        Err(format!("no etcd member answered: {}", errors.join("; ")))
    }
}

/// Whether `e` says the member could not serve the call (down, unreachable, without a
/// leader), so that another may.
fn unreachable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => matches!(
            s.code(),
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
        ),
        _ => false,
    }
}

/// Revokes lease `id` (best effort: unrevoked, it runs out by itself).
async fn revoke(members: std::sync::Arc<Members>, id: i64) {
    let _ = members
        .call(|mut c| async move { c.lease_revoke(id).await })
        .await;
}

/// ckpt's keys in one etcd cluster.
pub struct Store {
    members: std::sync::Arc<Members>,
    prefix: String,
    /// `etcd:ENDPOINTS PREFIX`, naming the store in errors.
    name: String,
    /// The leadership key's creation revision this ckptd won; none before it has.
    fence: Option<i64>,
    /// Tells the [`Leader`] it was deposed (a write refused: the key is not ours any more).
    deposed: Option<tokio::sync::watch::Sender<Option<String>>>,
    runtime: Runtime,
}

/// The store's own runtime, shut down without waiting when the store goes (it may go inside
/// ckptd's runtime, where waiting is not allowed).
#[derive(Debug)]
struct Runtime(Option<tokio::runtime::Runtime>);

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// This ckptd's leadership, won by [`Store::campaign`].
pub struct Leader {
    lost: tokio::sync::watch::Receiver<Option<String>>,
    lease: i64,
    members: std::sync::Arc<Members>,
    handle: tokio::runtime::Handle,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("name", &self.name)
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Leader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leader")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl Leader {
    /// Resolves when the leadership is lost, with why: the lease could not be renewed in time,
    /// so another ckptd may be active now.
    pub async fn lost(&self) -> String {
        let mut rx = self.lost.clone();
        let why = match rx.wait_for(|v| v.is_some()).await {
            Ok(v) => v.clone().unwrap_or_default(),
            Err(_) => "the lease keeper stopped".into(),
        };
        why
    }

    /// Gives the leadership up now (a clean stop): a standby takes over at once instead of
    /// after the lease.
    pub async fn resign(&self) {
        let revoke = self.handle.spawn(revoke(self.members.clone(), self.lease));
        let _ = revoke.await;
    }
}

impl Store {
    /// Connects to the cluster `cfg` names (lazily: a cluster not up yet is waited for by the
    /// first call).
    pub fn connect(cfg: &RegistryConfig) -> Result<Store, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ckptd-etcd")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the etcd client's runtime: {e}"))?;
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(CALL)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_require_leader(true);
        // TLS with ckptd's client certificate, always (the config requires all three).
        let read = |p: &Option<std::path::PathBuf>, what: &str| match p {
            Some(p) => std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display())),
            None => Err(format!("[registry] {what} is not set")),
        };
        let tls = TlsOptions::new()
            .ca_certificate(Certificate::from_pem(read(&cfg.ca, "ca")?))
            .identity(Identity::from_pem(
                read(&cfg.cert, "cert")?,
                read(&cfg.key, "key")?,
            ));
        let opts = opts.with_tls(tls);
        let mut each = Vec::new();
        for endpoint in &cfg.endpoints {
            let (e, o) = (endpoint.clone(), opts.clone());
            // One endpoint: connected when first used, so a member down now is no error.
            let client = runtime
                .block_on(async move { Client::connect([e], Some(o)).await })
                .map_err(|e| format!("etcd at {endpoint}: {e}"))?;
            each.push((endpoint.clone(), client));
        }
        Ok(Store {
            members: std::sync::Arc::new(Members {
                each,
                answered: Default::default(),
            }),
            prefix: cfg.prefix.clone(),
            name: format!("etcd:{}{}", cfg.endpoints.join(","), cfg.prefix),
            fence: None,
            deposed: None,
            runtime: Runtime(Some(runtime)),
        })
    }

    /// Names the store in errors: `etcd:ENDPOINTS PREFIX`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The leadership key's creation revision this ckptd won (none before it has).
    pub fn fence(&self) -> Option<u64> {
        self.fence.and_then(|f| u64::try_from(f).ok())
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime.0.as_ref().expect("running").handle()
    }

    /// The key of the leadership.
    fn leader_key(&self) -> String {
        format!("{}leader", self.prefix)
    }

    /// Waits until this ckptd is the active one, then returns its leadership; meanwhile
    /// `standby` is told who is active (once per change). `me` names this ckptd to the others.
    /// Cancel-safe: a campaign dropped while waiting holds nothing.
    pub async fn campaign(
        &mut self,
        me: &str,
        lease: Duration,
        mut standby: impl FnMut(&str),
    ) -> Result<Leader, String> {
        let key = self.leader_key();
        let ttl = lease.as_secs() as i64;
        let mut active = String::new();
        loop {
            let k = key.clone();
            let holder = self
                .spawn(move |mut c| {
                    let k = k.clone();
                    async move { c.get(k, None).await }
                })
                .await?
                .kvs()
                .first()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned());
            if let Some(h) = holder {
                if h != active {
                    standby(&h);
                    active = h;
                }
                tokio::time::sleep(POLL).await;
                continue;
            }
            // The lease runs from before it was asked for, at the latest.
            let asked = tokio::time::Instant::now();
            let granted = self
                .spawn(move |mut c| async move { c.lease_grant(ttl, None).await })
                .await?;
            let id = granted.id();
            let (k, v) = (key.clone(), me.to_string());
            let won = self
                .spawn(move |mut c| {
                    let txn = Txn::new()
                        .when([Compare::create_revision(k.clone(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(
                            k.clone(),
                            v.clone(),
                            Some(PutOptions::new().with_lease(id)),
                        )]);
                    async move { c.txn(txn).await }
                })
                .await?;
            let revision = won.header().map(|h| h.revision()).filter(|r| *r > 0);
            let Some(revision) = revision.filter(|_| won.succeeded()) else {
                let _ = self.handle().spawn(revoke(self.members.clone(), id)).await;
                if won.succeeded() {
                    return Err("etcd's answer carried no revision".into());
                }
                continue;
            };
            self.fence = Some(revision);
            return Ok(self.keep(id, lease, asked));
        }
    }

    /// Keeps lease `id`, granted after `asked`, alive: three renewals a lease, each member
    /// given a third of it. The leadership is declared lost a tenth of a lease (half a second
    /// at least) before etcd could let it expire, counted from before each renewal was sent,
    /// so that this ckptd has stopped before a standby can win; or at once when etcd says the
    /// lease is gone, or a write was refused ([`Store::write`]).
    fn keep(&mut self, id: i64, lease: Duration, asked: tokio::time::Instant) -> Leader {
        let (tx, rx) = tokio::sync::watch::channel(None);
        self.deposed = Some(tx.clone());
        let members = self.members.clone();
        self.handle().spawn(async move {
            let mut renewed = asked;
            let deadline = lease.saturating_sub((lease / 10).max(Duration::from_millis(500)));
            // After a failed renewal (etcd electing a new leader, a member down), sooner.
            let mut pause = lease / 3;
            let why = loop {
                tokio::time::sleep(pause).await;
                pause = Duration::from_millis(100);
                let sent = tokio::time::Instant::now();
                let left = deadline.saturating_sub(renewed.elapsed());
                if left.is_zero() {
                    break format!(
                        "the lease was not renewed within {}",
                        humantime::format_duration(deadline)
                    );
                }
                let renew = members.call_within(lease / 3, |mut c| async move {
                    let (mut keeper, mut answers) = c.lease_keep_alive(id).await?;
                    keeper.keep_alive().await?;
                    answers.message().await
                });
                match tokio::time::timeout(left, renew).await {
                    Ok(Ok(Some(a))) if a.ttl() > 0 => {
                        renewed = sent;
                        pause = lease / 3;
                    }
                    Ok(Ok(Some(_))) => break "etcd says the lease expired".to_string(),
                    Ok(Ok(None)) | Ok(Err(_)) | Err(_) => continue,
                }
            };
            let _ = tx.send(Some(why));
        });
        Leader {
            lost: rx,
            lease: id,
            members: self.members.clone(),
            handle: self.handle().clone(),
        }
    }

    /// Runs `call` (on the members in turn, [`Members::call`]) on the store's runtime; the
    /// caller may be on any runtime.
    fn spawn<T, F, Fut>(&self, call: F) -> impl Future<Output = Result<T, String>>
    where
        T: Send + 'static,
        F: Fn(Client) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    {
        let (name, members) = (self.name.clone(), self.members.clone());
        let task = self.handle().spawn(async move { members.call(call).await });
        async move {
            task.await
                .unwrap_or_else(|e| Err(format!("{name}: the call failed: {e}")))
        }
    }

    /// [`Store::spawn`], waited for here (a synchronous caller).
    fn wait<T, F, Fut>(&self, call: F) -> Result<T, String>
    where
        T: Send + 'static,
        F: Fn(Client) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let call = self.spawn(call);
        self.handle().spawn(async move {
            let _ = tx.send(call.await);
        });
        let recv = || {
            rx.recv()
                .unwrap_or_else(|_| Err("the etcd client stopped".into()))
        };
        // On one of ckptd's workers, the others go on with its other tasks meanwhile.
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(recv),
            _ => recv(),
        }
    }

    fn key(&self, table: Table, (job, n): Key) -> String {
        match table {
            Table::Jobs => format!("{}jobs/{job:020}", self.prefix),
            Table::Heads => format!("{}epochs/{job:020}/{n:010}", self.prefix),
            Table::Details => format!("{}details/{job:020}/{n:010}", self.prefix),
        }
    }

    /// The key a stored name stands for (`None`: not one of ours).
    fn parse(&self, table: Table, name: &[u8]) -> Option<Key> {
        let name = std::str::from_utf8(name).ok()?.strip_prefix(&self.prefix)?;
        match table {
            Table::Jobs => Some((name.strip_prefix("jobs/")?.parse().ok()?, 0)),
            Table::Heads | Table::Details => {
                let rest = name
                    .strip_prefix("epochs/")
                    .or_else(|| name.strip_prefix("details/"))?;
                let (j, n) = rest.split_once('/')?;
                Some((j.parse().ok()?, n.parse().ok()?))
            }
        }
    }

    /// One record, if stored.
    pub(super) fn get(&self, table: Table, key: Key) -> Result<Option<Vec<u8>>, String> {
        let k = self.key(table, key);
        let r = self.wait(move |c| {
            let k = k.clone();
            async move { kv(&c).get(k, None).await }
        })?;
        Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Every job (`Table::Jobs`), or every record of `job` in an epoch table, in key order.
    pub(super) fn range(&self, table: Table, job: u64) -> Result<Vec<(Key, Vec<u8>)>, String> {
        let prefix = match table {
            Table::Jobs => format!("{}jobs/", self.prefix),
            Table::Heads => format!("{}epochs/{job:020}/", self.prefix),
            Table::Details => format!("{}details/{job:020}/", self.prefix),
        };
        let r = self.wait(move |c| {
            let (prefix, opts) = (
                prefix.clone(),
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Key, SortOrder::Ascend),
            );
            async move { kv(&c).get(prefix, Some(opts)).await }
        })?;
        Ok(r.kvs()
            .iter()
            .filter_map(|kv| Some((self.parse(table, kv.key())?, kv.value().to_vec())))
            .collect())
    }

    /// The highest job id stored.
    pub(super) fn last_job(&self) -> Result<Option<u64>, String> {
        let prefix = format!("{}jobs/", self.prefix);
        let r = self.wait(move |mut c| {
            let (prefix, opts) = (
                prefix.clone(),
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Key, SortOrder::Descend)
                    .with_limit(1),
            );
            async move { c.get(prefix, Some(opts)).await }
        })?;
        Ok(r.kvs()
            .first()
            .and_then(|kv| self.parse(Table::Jobs, kv.key()))
            .map(|k| k.0))
    }

    /// Makes `ops` while this ckptd holds the leadership; more than a transaction holds go in
    /// several, in order (a job's record first). A transaction whose answer was lost with its
    /// member is sent again to the next: it writes the same values.
    pub(super) fn write(&self, ops: Vec<Op>) -> Result<(), String> {
        let Some(fence) = self.fence else {
            return Err("this ckptd is not the active one: it writes nothing".into());
        };
        let mut txn_ops: Vec<(TxnOp, usize)> = Vec::new();
        for op in ops {
            let (key, value) = match op {
                Op::Put(t, k, v) => (self.key(t, k), Some(v)),
                Op::Details(k, v) => {
                    // Written only when changed: ~90 KB at a thousand nodes, and etcd keeps
                    // every version until compacted.
                    if self.get(Table::Details, k)? == v {
                        continue;
                    }
                    (self.key(Table::Details, k), v)
                }
            };
            let size = key.len() + value.as_ref().map_or(0, Vec::len);
            txn_ops.push(match value {
                Some(v) => (TxnOp::put(key, v, None), size),
                None => (TxnOp::delete(key, None), size),
            });
        }
        // etcd takes at most 128 operations and 1.5 MiB a request.
        let mut chunks: Vec<Vec<TxnOp>> = vec![Vec::new()];
        let mut bytes = 0;
        for (op, size) in txn_ops {
            let last = chunks.last_mut().expect("one");
            if !last.is_empty() && (last.len() >= MAX_OPS || bytes + size > MAX_BYTES) {
                chunks.push(Vec::new());
                bytes = 0;
            }
            bytes += size;
            chunks.last_mut().expect("one").push(op);
        }
        for chunk in chunks.into_iter().filter(|c| !c.is_empty()) {
            let leader = self.leader_key();
            let r = self.wait(move |c| {
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        leader.clone(),
                        CompareOp::Equal,
                        fence,
                    )])
                    .and_then(chunk.clone());
                async move { kv(&c).txn(txn).await }
            })?;
            if !r.succeeded() {
                let why = "a write was refused: the leadership key is not this ckptd's any more (another ckptd is active)";
                if let Some(tx) = &self.deposed {
                    let _ = tx.send(Some(why.into()));
                }
                return Err(why.into());
            }
        }
        Ok(())
    }
}
