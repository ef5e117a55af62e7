//! The job registry and epoch history, so that a restarted ckptd loses nothing: in an embedded
//! redb database (the default: one head node), or in an etcd cluster ([`etcd`]), where a
//! standby ckptd takes over when the active one is lost. Values are JSON of [`Job`] and
//! [`Epoch`]; every write is one transaction.
//!
//! An epoch is stored in two records: its head (everything but what each node reported at and
//! after the commit), rewritten as the epoch moves through its phases, and its details (each
//! node's manifest digest, partner, parity group: [`EpochDetails`]), written when they change.
//! At a thousand nodes the details are ~90 KB of an epoch's ~100; the phases, retention and the
//! periodic policy read and write heads only ([`Registry::epoch_heads`]). Records written before
//! the split hold everything in the head and read as before.
//!
//! The database holds every job's secret and command line: the redb file is root's alone (0600),
//! also when an older ckptd created it with other modes; an etcd cluster must admit ckptd alone
//! (docs/operations.md).
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::model::{Epoch, Job};

pub mod etcd;

const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("jobs");
/// Key: (job id, epoch number). An epoch's head.
const EPOCHS: TableDefinition<(u64, u32), &[u8]> = TableDefinition::new("epochs");
/// Key: (job id, epoch number). An epoch's [`EpochDetails`], once it has any.
const EPOCH_DETAILS: TableDefinition<(u64, u32), &[u8]> = TableDefinition::new("epoch_details");

/// What an epoch's nodes reported at and after its commit, stored apart from its head.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct EpochDetails {
    #[serde(default)]
    manifests: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    partners: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    encodings: Vec<ckpt_store::erasure::Encoding>,
}

/// An epoch read without its details (`manifests`, `partners` and `encodings` empty): what
/// the phases, retention and the policies need. It cannot be written back: a change is made to
/// the whole epoch ([`Registry::epoch`]).
#[derive(Debug, Clone)]
pub struct EpochHead(Epoch);

impl std::borrow::Borrow<Epoch> for EpochHead {
    fn borrow(&self) -> &Epoch {
        &self.0
    }
}

impl std::ops::Deref for EpochHead {
    type Target = Epoch;
    fn deref(&self) -> &Epoch {
        &self.0
    }
}

/// [`EpochDetails`] of an epoch, borrowed for writing.
#[derive(serde::Serialize)]
struct DetailsOf<'a> {
    manifests: &'a std::collections::BTreeMap<String, String>,
    partners: &'a std::collections::BTreeMap<String, String>,
    encodings: &'a [ckpt_store::erasure::Encoding],
}

/// An epoch's head and details (none while it has none), as stored.
fn split(epoch: &Epoch) -> (Vec<u8>, Option<Vec<u8>>) {
    let details = DetailsOf {
        manifests: &epoch.manifests,
        partners: &epoch.partners,
        encodings: &epoch.encodings,
    };
    let has = !(details.manifests.is_empty()
        && details.partners.is_empty()
        && details.encodings.is_empty());
    let details = has.then(|| serde_json::to_vec(&details).expect("serializable"));
    let head = Epoch {
        manifests: Default::default(),
        partners: Default::default(),
        encodings: Default::default(),
        nodes: epoch.nodes.clone(),
        restarts: epoch.restarts.clone(),
        state: epoch.state.clone(),
        flush: epoch.flush.clone(),
        ..*epoch
    };
    (serde_json::to_vec(&head).expect("serializable"), details)
}

/// Registry failures; each names the database (a file, or an etcd cluster).
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The database cannot be opened or used.
    #[error("job database {path}: {message}")]
    Db {
        /// File, or `etcd:` and the endpoints and prefix.
        path: PathBuf,
        /// The store's message.
        message: String,
    },
    /// A stored record does not decode.
    #[error("job database {path}: corrupt record {key}: {source}")]
    Decode {
        /// File, or `etcd:` and the endpoints and prefix.
        path: PathBuf,
        /// Which record.
        key: String,
        /// Decoder error.
        #[source]
        source: serde_json::Error,
    },
}

/// What a record belongs to. Jobs are keyed `(id, 0)`, epochs `(job, number)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Table {
    Jobs,
    Heads,
    Details,
}

type Key = (u64, u32);

/// One change of a write.
#[derive(Debug)]
enum Op {
    Put(Table, Key, Vec<u8>),
    /// An epoch's details: written only if they differ from those stored; `None` removes them.
    Details(Key, Option<Vec<u8>>),
}

/// Where the records live.
#[derive(Debug)]
enum Backend {
    /// An embedded database file: one head node.
    Redb(Database),
    /// An etcd cluster, written only while this ckptd is the active one.
    Etcd(etcd::Store),
}

/// The persistent registry.
#[derive(Debug)]
pub struct Registry {
    backend: Backend,
    /// Names the database in errors.
    path: PathBuf,
}

impl Registry {
    /// Opens (or creates) the database, 0600.
    pub fn open(path: &Path) -> Result<Self, RegistryError> {
        let db_err = |e: &dyn std::fmt::Display| RegistryError::Db {
            path: path.into(),
            message: e.to_string(),
        };
        if let Some(parent) = path.parent() {
            // Missing parents like /var/lib's: other daemons' directories may live beside it.
            let _ = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent);
        }
        // Created (or narrowed) 0600 before redb opens it: never readable by others, not even
        // for a moment.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| db_err(&e))?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| db_err(&e))?;
        drop(file);
        let db = Database::create(path).map_err(|e| db_err(&e))?;
        let r = Registry {
            backend: Backend::Redb(db),
            path: path.into(),
        };
        // Create the tables so that reads of an empty database succeed.
        let db = r.redb().expect("redb");
        let tx = db.begin_write().map_err(|e| r.err(e))?;
        {
            tx.open_table(JOBS).map_err(|e| r.err(e))?;
            tx.open_table(EPOCHS).map_err(|e| r.err(e))?;
            tx.open_table(EPOCH_DETAILS).map_err(|e| r.err(e))?;
        }
        tx.commit().map_err(|e| r.err(e))?;
        Ok(r)
    }

    /// The registry in an etcd cluster, through `store`, which won the leadership: every write
    /// is made only while it still holds it ([`etcd::Store::campaign`]).
    pub fn on_etcd(store: etcd::Store) -> Self {
        Registry {
            path: store.name().into(),
            backend: Backend::Etcd(store),
        }
    }

    /// The fence this ckptd won the leadership with ([`ckpt_proto::FenceGuard`]): none on the
    /// embedded database, whose ckptd has no rival.
    pub fn fence(&self) -> Option<u64> {
        match &self.backend {
            Backend::Redb(_) => None,
            Backend::Etcd(s) => s.fence(),
        }
    }

    fn redb(&self) -> Option<&Database> {
        match &self.backend {
            Backend::Redb(db) => Some(db),
            Backend::Etcd(_) => None,
        }
    }

    fn err(&self, e: impl std::fmt::Display) -> RegistryError {
        RegistryError::Db {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    fn decode<T: serde::de::DeserializeOwned>(
        &self,
        key: String,
        bytes: &[u8],
    ) -> Result<T, RegistryError> {
        serde_json::from_slice(bytes).map_err(|source| RegistryError::Decode {
            path: self.path.clone(),
            key,
            source,
        })
    }

    /// Next unused job id (one more than the highest stored).
    pub fn next_job_id(&self) -> Result<u64, RegistryError> {
        let last = match &self.backend {
            Backend::Redb(db) => {
                let tx = db.begin_read().map_err(|e| self.err(e))?;
                let t = tx.open_table(JOBS).map_err(|e| self.err(e))?;
                let last = t.last().map_err(|e| self.err(e))?.map(|(k, _)| k.value());
                last
            }
            Backend::Etcd(s) => s.last_job().map_err(|e| self.err(e))?,
        };
        Ok(last.unwrap_or(0) + 1)
    }

    /// Stores a job.
    pub fn put_job(&self, job: &Job) -> Result<(), RegistryError> {
        self.put_job_and_epochs(job, [])
    }

    /// Stores a job and one of its epochs in one transaction.
    pub fn put_job_and_epoch(&self, job: &Job, epoch: &Epoch) -> Result<(), RegistryError> {
        self.put_job_and_epochs(job, [epoch])
    }

    /// Stores a job and some of its epochs in one transaction (one sync).
    pub fn put_job_and_epochs<'e>(
        &self,
        job: &Job,
        epochs: impl IntoIterator<Item = &'e Epoch>,
    ) -> Result<(), RegistryError> {
        let mut ops = vec![Op::Put(
            Table::Jobs,
            (job.id, 0),
            serde_json::to_vec(job).expect("serializable"),
        )];
        for e in epochs {
            epoch_ops(e, &mut ops);
        }
        self.write(ops, true)
    }

    /// Stores an epoch.
    pub fn put_epoch(&self, epoch: &Epoch) -> Result<(), RegistryError> {
        self.put_epochs(std::slice::from_ref(epoch))
    }

    /// Stores epochs in one transaction (none: nothing is written).
    pub fn put_epochs(&self, epochs: &[Epoch]) -> Result<(), RegistryError> {
        let mut ops = Vec::new();
        for e in epochs {
            epoch_ops(e, &mut ops);
        }
        self.write(ops, true)
    }

    /// Records an epoch's progress for readers (`ckptctl status`, `epochs`) without syncing it
    /// to disk: the next durable write (the epoch's commit or abort) makes it durable. A crash
    /// before that finds the epoch as [`Registry::put_job_and_epoch`] began it, which the next
    /// start-up marks failed all the same. An epoch so costs two fsyncs, not one per phase.
    /// (etcd makes every write durable on a quorum: there, this is an ordinary write.)
    pub fn note_epoch(&self, epoch: &Epoch) -> Result<(), RegistryError> {
        let mut ops = Vec::new();
        epoch_ops(epoch, &mut ops);
        self.write(ops, false)
    }

    /// Makes `ops` in one transaction (none: nothing is written); `durable`: synced before it
    /// returns.
    fn write(&self, ops: Vec<Op>, durable: bool) -> Result<(), RegistryError> {
        if ops.is_empty() {
            return Ok(());
        }
        match &self.backend {
            Backend::Redb(db) => {
                let mut tx = db.begin_write().map_err(|e| self.err(e))?;
                if !durable {
                    tx.set_durability(redb::Durability::None)
                        .map_err(|e| self.err(e))?;
                }
                for op in ops {
                    self.redb_op(&tx, op)?;
                }
                tx.commit().map_err(|e| self.err(e))
            }
            Backend::Etcd(s) => s.write(ops).map_err(|e| self.err(e)),
        }
    }

    fn redb_op(&self, tx: &redb::WriteTransaction, op: Op) -> Result<(), RegistryError> {
        match op {
            Op::Put(Table::Jobs, (id, _), v) => {
                let mut t = tx.open_table(JOBS).map_err(|e| self.err(e))?;
                t.insert(id, v.as_slice()).map_err(|e| self.err(e))?;
            }
            Op::Put(table, key, v) => {
                let def = if table == Table::Heads {
                    EPOCHS
                } else {
                    EPOCH_DETAILS
                };
                let mut t = tx.open_table(def).map_err(|e| self.err(e))?;
                t.insert(key, v.as_slice()).map_err(|e| self.err(e))?;
            }
            Op::Details(key, details) => {
                let mut t = tx.open_table(EPOCH_DETAILS).map_err(|e| self.err(e))?;
                let stored = t.get(key).map_err(|e| self.err(e))?;
                let same = stored.as_ref().map(|v| v.value()) == details.as_deref();
                drop(stored);
                if !same {
                    match details {
                        Some(d) => {
                            t.insert(key, d.as_slice()).map_err(|e| self.err(e))?;
                        }
                        None => {
                            t.remove(key).map_err(|e| self.err(e))?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// One record, if stored.
    fn get(&self, table: Table, key: Key) -> Result<Option<Vec<u8>>, RegistryError> {
        match &self.backend {
            Backend::Redb(db) => {
                let tx = db.begin_read().map_err(|e| self.err(e))?;
                let v = if table == Table::Jobs {
                    let t = tx.open_table(JOBS).map_err(|e| self.err(e))?;
                    t.get(key.0)
                        .map_err(|e| self.err(e))?
                        .map(|v| v.value().to_vec())
                } else {
                    let def = if table == Table::Heads {
                        EPOCHS
                    } else {
                        EPOCH_DETAILS
                    };
                    let t = tx.open_table(def).map_err(|e| self.err(e))?;
                    t.get(key)
                        .map_err(|e| self.err(e))?
                        .map(|v| v.value().to_vec())
                };
                Ok(v)
            }
            Backend::Etcd(s) => s.get(table, key).map_err(|e| self.err(e)),
        }
    }

    /// Every record of `job` in an epoch table, or every job (`Table::Jobs`, `job` unused), in
    /// key order.
    fn range(&self, table: Table, job: u64) -> Result<Vec<(Key, Vec<u8>)>, RegistryError> {
        match &self.backend {
            Backend::Redb(db) => {
                let tx = db.begin_read().map_err(|e| self.err(e))?;
                let mut out = Vec::new();
                if table == Table::Jobs {
                    let t = tx.open_table(JOBS).map_err(|e| self.err(e))?;
                    for item in t.iter().map_err(|e| self.err(e))? {
                        let (k, v) = item.map_err(|e| self.err(e))?;
                        out.push(((k.value(), 0), v.value().to_vec()));
                    }
                    return Ok(out);
                }
                let def = if table == Table::Heads {
                    EPOCHS
                } else {
                    EPOCH_DETAILS
                };
                let t = tx.open_table(def).map_err(|e| self.err(e))?;
                for item in t
                    .range((job, 0)..=(job, u32::MAX))
                    .map_err(|e| self.err(e))?
                {
                    let (k, v) = item.map_err(|e| self.err(e))?;
                    out.push((k.value(), v.value().to_vec()));
                }
                Ok(out)
            }
            Backend::Etcd(s) => s.range(table, job).map_err(|e| self.err(e)),
        }
    }

    /// A job, if known.
    pub fn job(&self, id: u64) -> Result<Option<Job>, RegistryError> {
        match self.get(Table::Jobs, (id, 0))? {
            Some(v) => Ok(Some(self.decode(format!("job {id}"), &v)?)),
            None => Ok(None),
        }
    }

    /// Every job, by id.
    pub fn jobs(&self) -> Result<Vec<Job>, RegistryError> {
        self.range(Table::Jobs, 0)?
            .into_iter()
            .map(|((id, _), v)| self.decode(format!("job {id}"), &v))
            .collect()
    }

    /// One epoch, if known.
    pub fn epoch(&self, job: u64, number: u32) -> Result<Option<Epoch>, RegistryError> {
        let Some(mut e) = self.epoch_head(job, number)?.map(|h| h.0) else {
            return Ok(None);
        };
        if let Some(d) = self.get(Table::Details, (job, number))? {
            self.add_details(&mut e, &d)?;
        }
        Ok(Some(e))
    }

    /// Every epoch of a job, oldest first.
    pub fn epochs(&self, job: u64) -> Result<Vec<Epoch>, RegistryError> {
        let mut out = self.heads(job)?;
        let details: std::collections::HashMap<Key, Vec<u8>> =
            self.range(Table::Details, job)?.into_iter().collect();
        for e in &mut out {
            if let Some(d) = details.get(&(e.job_id, e.number)) {
                self.add_details(e, d)?;
            }
        }
        Ok(out)
    }

    /// One epoch without its details, if known.
    pub fn epoch_head(&self, job: u64, number: u32) -> Result<Option<EpochHead>, RegistryError> {
        match self.get(Table::Heads, (job, number))? {
            Some(v) => Ok(Some(EpochHead(
                self.decode(format!("job {job} epoch {number}"), &v)?,
            ))),
            None => Ok(None),
        }
    }

    /// Every epoch of a job without its details, oldest first.
    pub fn epoch_heads(&self, job: u64) -> Result<Vec<EpochHead>, RegistryError> {
        Ok(self.heads(job)?.into_iter().map(EpochHead).collect())
    }

    fn heads(&self, job: u64) -> Result<Vec<Epoch>, RegistryError> {
        self.range(Table::Heads, job)?
            .into_iter()
            .map(|((j, n), v)| self.decode(format!("job {j} epoch {n}"), &v))
            .collect()
    }

    /// Fills in an epoch's details from their record (records from before the split hold them
    /// in the head and have none).
    fn add_details(&self, e: &mut Epoch, stored: &[u8]) -> Result<(), RegistryError> {
        let d: EpochDetails = self.decode(
            format!("job {} epoch {} details", e.job_id, e.number),
            stored,
        )?;
        e.manifests = d.manifests;
        e.partners = d.partners;
        e.encodings = d.encodings;
        Ok(())
    }
}

/// The changes that store `epoch`: its head, and its details where they changed.
fn epoch_ops(epoch: &Epoch, ops: &mut Vec<Op>) {
    let key = (epoch.job_id, epoch.number);
    let (head, details) = split(epoch);
    ops.push(Op::Put(Table::Heads, key, head));
    ops.push(Op::Details(key, details));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{JobState, Phase};

    fn job(id: u64) -> Job {
        crate::model::fixtures::job(id, JobState::Running)
    }

    #[test]
    fn progress_noted_without_a_sync_is_read_back_and_made_durable_by_the_next_write() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ckptd.redb");
        {
            let r = Registry::open(&p).unwrap();
            let mut e = Epoch::begin(1, 1, false, vec!["n1".into()], 0);
            r.put_job_and_epoch(&job(1), &e).unwrap();
            e.enter(Phase::Quiesce).unwrap();
            r.note_epoch(&e).unwrap();
            assert_eq!(
                r.epoch(1, 1).unwrap().unwrap().state,
                crate::model::EpochState::InProgress(Phase::Quiesce)
            );
            e.enter(Phase::LocalCheckpoint).unwrap();
            r.note_epoch(&e).unwrap();
            r.put_job(&job(1)).unwrap();
        }
        let r = Registry::open(&p).unwrap();
        assert_eq!(
            r.epoch(1, 1).unwrap().unwrap().state,
            crate::model::EpochState::InProgress(Phase::LocalCheckpoint)
        );
    }

    #[test]
    fn an_epochs_details_are_stored_apart_read_back_whole_and_left_out_of_heads() {
        let d = tempfile::tempdir().unwrap();
        let r = Registry::open(&d.path().join("ckptd.redb")).unwrap();
        let nodes: Vec<String> = ["n1", "n2"].map(String::from).to_vec();
        let mut e = Epoch::begin(1, 1, false, nodes.clone(), 0);
        r.put_job_and_epoch(&job(1), &e).unwrap();
        crate::model::fixtures::commit(
            &mut e,
            [("n1".into(), "d1".into()), ("n2".into(), "d2".into())].into(),
            5,
        );
        e.partners = [("n1".into(), "n2".into())].into();
        r.put_epoch(&e).unwrap();
        assert_eq!(r.epoch(1, 1).unwrap().unwrap(), e);
        assert_eq!(r.epochs(1).unwrap(), [e.clone()]);
        let head = r.epoch_head(1, 1).unwrap().unwrap();
        assert!(head.manifests.is_empty() && head.partners.is_empty());
        assert_eq!(
            (head.nodes.clone(), head.state.clone()),
            (nodes, e.state.clone())
        );
        assert_eq!(r.epoch_heads(1).unwrap().len(), 1);
        // The head alone holds no manifest: what the phases rewrite stays small.
        let tx = r.redb().unwrap().begin_read().unwrap();
        let t = tx.open_table(EPOCHS).unwrap();
        let stored = t.get((1, 1)).unwrap().unwrap().value().to_vec();
        assert!(!String::from_utf8_lossy(&stored).contains("d1"));
        // Expired, with its details: they stay.
        e.expire("x").unwrap();
        r.put_job_and_epochs(&job(1), [&e]).unwrap();
        assert_eq!(r.epoch(1, 1).unwrap().unwrap(), e);
    }

    #[test]
    fn epochs_recorded_whole_before_the_split_still_read() {
        let d = tempfile::tempdir().unwrap();
        let r = Registry::open(&d.path().join("ckptd.redb")).unwrap();
        let mut e = Epoch::begin(1, 1, false, vec!["n1".into()], 0);
        crate::model::fixtures::commit(&mut e, [("n1".into(), "d1".into())].into(), 5);
        let whole = serde_json::to_vec(&e).unwrap();
        let tx = r.redb().unwrap().begin_write().unwrap();
        tx.open_table(EPOCHS)
            .unwrap()
            .insert((1, 1), whole.as_slice())
            .unwrap();
        tx.commit().unwrap();
        assert_eq!(r.epoch(1, 1).unwrap().unwrap(), e);
        assert_eq!(r.epochs(1).unwrap(), [e.clone()]);
        // Written again, it is split.
        r.put_epoch(&e).unwrap();
        assert_eq!(r.epoch(1, 1).unwrap().unwrap(), e);
        assert!(r.epoch_head(1, 1).unwrap().unwrap().manifests.is_empty());
    }

    #[test]
    fn epochs_written_before_the_phases_were_renamed_still_read() {
        let d = tempfile::tempdir().unwrap();
        let r = Registry::open(&d.path().join("ckptd.redb")).unwrap();
        let mut e = Epoch::begin(1, 1, false, vec!["n1".into()], 0);
        e.fail("x", 1).unwrap();
        let old = serde_json::to_string(&e)
            .unwrap()
            .replace("InitialSync", "Sync");
        assert!(old.contains("\"Sync\""), "{old}");
        let back: Epoch = r.decode("1/1".into(), old.as_bytes()).unwrap();
        assert_eq!(back, e);
    }

    #[test]
    fn survives_reopen() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ckptd.redb");
        {
            let r = Registry::open(&p).unwrap();
            assert_eq!(r.next_job_id().unwrap(), 1);
            let mut j = job(1);
            let e1 = Epoch::begin(1, 1, false, vec!["n1".into()], 0);
            j.last_epoch = 1;
            r.put_job_and_epoch(&j, &e1).unwrap();
            r.put_job(&job(2)).unwrap();
            let mut e2 = Epoch::begin(1, 2, false, vec!["n1".into()], 0);
            e2.fail("x", 1).unwrap();
            r.put_epoch(&e2).unwrap();
            r.put_epoch(&Epoch::begin(2, 1, false, vec![], 0)).unwrap();
        }
        let r = Registry::open(&p).unwrap();
        assert_eq!(r.next_job_id().unwrap(), 3);
        assert_eq!(r.jobs().unwrap().len(), 2);
        assert_eq!(r.job(1).unwrap().unwrap().last_epoch, 1);
        let es = r.epochs(1).unwrap();
        assert_eq!(es.iter().map(|e| e.number).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(es[0].phase(), Some(Phase::InitialSync));
        assert!(r.job(9).unwrap().is_none());
        assert!(r.epoch(1, 9).unwrap().is_none());
    }

    #[test]
    fn database_is_private_also_when_an_older_ckptd_made_it_readable() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/ckptd.redb");
        drop(Registry::open(&p).unwrap());
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let r = Registry::open(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        assert_eq!(r.next_job_id().unwrap(), 1, "the database still opens");
    }
}
