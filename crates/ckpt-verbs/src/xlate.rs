//! Translation between the identifiers a program holds (virtual) and those the device uses
//! now (real).
//!
//! A program keeps QP numbers and memory keys for its whole life, packs them into its own
//! wire protocol and sends them to its peers (UCX does), so they must not change when the
//! layer releases every verbs object before a snapshot and creates new ones after it. Each
//! object therefore gets a virtual number when it is created: the real one of that first
//! incarnation, which the device guarantees unique among the live objects of the port. Until
//! a rebuild, every translation is the identity; after one, these tables map the virtual
//! numbers, ours and our peers', to the new real ones.
//!
//! Peers are named by the id ([`Addr::id`]) of the port address the program itself uses for
//! them (GID, or LID on InfiniBand without a GRH): a peer's virtual numbers are unique per
//! address, like the real ones they started as. The address is virtual too: after a restart
//! on other nodes the program still addresses a peer by the GID it had, and [`Tables::peer`]
//! gives the one it has now.
use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{
    compiler_fence, AtomicBool, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
    Ordering::SeqCst,
};
use std::sync::RwLock;

/// A peer port's address as the program addresses it: the GID, or (no GRH) the LID in the
/// last two bytes of an otherwise zero value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Addr(pub [u8; 16]);

impl Addr {
    /// The address of an InfiniBand port known by its LID only.
    pub fn lid(lid: u16) -> Self {
        let mut a = [0u8; 16];
        a[14..].copy_from_slice(&lid.to_be_bytes());
        Addr(a)
    }

    /// The address's 64-bit id (FNV-1a of its bytes, never 0): how peers, endpoints and the
    /// translation tables name it.
    pub fn id(&self) -> u64 {
        ib_quiesce::control::address_id(&self.0)
    }
}

/// Where a peer's port is now: what a rebuilt connection or address handle is pointed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerPort {
    /// Its GID now.
    pub gid: [u8; 16],
    /// Its LID now (InfiniBand).
    pub lid: u16,
}

/// A multiply-shift hasher for small integer keys: the tables are read on every post and
/// every completion, and SipHash costs more than the rest of the translation.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type Map<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// What a lookup found: the real value, or nothing known (the identity is used and the miss
/// counted, so that a status report shows identifiers the layer never handed out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Translated.
    Real(u32),
    /// Not in the table.
    Unknown(u32),
}

impl Found {
    /// The value to hand to the device.
    pub fn value(self) -> u32 {
        match self {
            Found::Real(v) | Found::Unknown(v) => v,
        }
    }
}

/// Changes to the tables a post or a poll reads (our lkeys and QPs), in all of the process's
/// [`Tables`]: a thread's [`Recent`] lookups hold while it is unchanged.
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// Entries of a thread's cache of recent lookups, per table (direct-mapped).
const RECENT: usize = 16;

/// A thread's recent lookups of the tables `owner` ([`TablesId`]) made at `generation`: every message
/// posts and polls, and a lock-free hit here spares the hot path the table locks (a program
/// uses a handful of keys and QPs at a time; registrations and QPs change rarely).
struct Recent {
    owner: u64,
    generation: u64,
    lkeys: [Option<(u32, u32)>; RECENT],
    qps: [Option<(u32, (u32, usize))>; RECENT],
}

impl Recent {
    const EMPTY: Recent = Recent {
        owner: 0,
        generation: 0,
        lkeys: [None; RECENT],
        qps: [None; RECENT],
    };

    /// This thread's cache for `owner` at `generation`, emptied first if it was for others.
    fn valid_for(&mut self, owner: u64, generation: u64) -> &mut Self {
        if self.owner != owner || self.generation != generation {
            *self = Recent::EMPTY;
            self.owner = owner;
            self.generation = generation;
        }
        self
    }
}

/// Slot of an lkey: the index bits above the key byte (mlx and rxe keys are index << 8 | key).
fn lkey_slot(k: u32) -> usize {
    (k >> 8) as usize % RECENT
}

/// A thread's cache and whether a lookup of this thread is using it (a signal handler's lookup
/// that interrupts one finds it busy and reads the tables instead).
struct Recents {
    busy: AtomicBool,
    cache: UnsafeCell<Recent>,
}

thread_local! {
    static RECENTS: Recents = const {
        Recents {
            busy: AtomicBool::new(false),
            cache: UnsafeCell::new(Recent::EMPTY),
        }
    };
}

/// `f` on this thread's cache, unless a lookup it interrupted (in a signal handler) has it.
fn with_recent<R>(f: impl FnOnce(&mut Recent) -> Option<R>) -> Option<R> {
    RECENTS.with(|r| {
        if r.busy.load(Relaxed) {
            return None;
        }
        r.busy.store(true, Relaxed);
        compiler_fence(SeqCst);
        // SAFETY: only this thread reaches its cache, and `busy` keeps the lookups of a
        // signal handler that interrupts this one away from it.
        let out = f(unsafe { &mut *r.cache.get() });
        compiler_fence(SeqCst);
        r.busy.store(false, Relaxed);
        out
    })
}

/// A set of [`Tables`], for the thread caches: unique in the process (tests make many).
#[derive(Debug)]
struct TablesId(u64);

impl Default for TablesId {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TablesId(NEXT.fetch_add(1, Relaxed))
    }
}

/// Every translation table of a process.
#[derive(Debug, Default)]
pub struct Tables {
    /// Which tables these are to the thread caches.
    id: TablesId,
    /// Our memory regions: virtual lkey → real lkey.
    lkeys: RwLock<Map<u32, u32>>,
    /// Our memory regions: virtual rkey → real rkey (what peers learn after a rebuild).
    rkeys: RwLock<Map<u32, u32>>,
    /// Our QPs: real QP number → (virtual, the shadow's address); completions carry the real
    /// one.
    local_qpns: RwLock<Map<u32, (u32, usize)>>,
    /// Peers' QPs: (their address id, virtual QP number) → real QP number. Empty until a peer
    /// rebuilt: then the identity is right.
    remote_qpns: RwLock<Map<(u64, u32), u32>>,
    /// The same, backwards: (their address id, real QP number) → virtual QP number, for the
    /// source QP of a UD completion.
    remote_virtual_qpns: RwLock<Map<(u64, u32), u32>>,
    /// Whether `remote_virtual_qpns` has anything: read on every UD receive, without a lock.
    translating_remote_qpns: AtomicBool,
    /// Peers' address ids by where their ports are now (GID, or [`Addr::lid`] of the LID): who
    /// sent a UD message, by its GRH or source LID.
    peers_by_port: RwLock<Map<[u8; 16], u64>>,
    /// Peers' memory: (their address id, virtual rkey) → real rkey.
    remote_rkeys: RwLock<Map<(u64, u32), u32>>,
    /// Peers' ports now, by address id (empty until a rebuild).
    peers: RwLock<Map<u64, PeerPort>>,
    /// Addresses whose endpoints these tables hold as of the last reconnect: those it named
    /// or was sent, and those looked up since.
    known: RwLock<std::collections::HashSet<u64, BuildHasherDefault<IdHasher>>>,
    /// Whether the layer reconnected at least once (before, every translation is the identity
    /// and there is nothing to look up).
    reconnected: AtomicBool,
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

impl Tables {
    /// Records a memory region registered (or re-registered) with these keys.
    pub fn set_mr(&self, vlkey: u32, lkey: u32, vrkey: u32, rkey: u32) {
        write(&self.lkeys).insert(vlkey, lkey);
        write(&self.rkeys).insert(vrkey, rkey);
        GENERATION.fetch_add(1, Release);
    }

    /// Forgets a deregistered memory region.
    pub fn drop_mr(&self, vlkey: u32, vrkey: u32) {
        write(&self.lkeys).remove(&vlkey);
        write(&self.rkeys).remove(&vrkey);
        GENERATION.fetch_add(1, Release);
    }

    /// Whether a virtual lkey or rkey is in use (a new region must not take it).
    pub fn key_in_use(&self, k: u32) -> bool {
        read(&self.lkeys).contains_key(&k) || read(&self.rkeys).contains_key(&k)
    }

    /// The real lkey of one of our virtual lkeys.
    #[inline]
    pub fn lkey(&self, v: u32) -> Found {
        let found = self.through_recent(
            v,
            |r| &mut r.lkeys[lkey_slot(v)],
            || read(&self.lkeys).get(&v).copied(),
        );
        match found {
            Some(real) => Found::Real(real),
            None => Found::Unknown(v),
        }
    }

    /// `key`'s value from this thread's cache entry `entry` when it holds it for these tables
    /// as they are now, else from `table` (and then cached).
    #[inline]
    fn through_recent<V: Copy>(
        &self,
        key: u32,
        entry: impl Fn(&mut Recent) -> &mut Option<(u32, V)>,
        table: impl FnOnce() -> Option<V>,
    ) -> Option<V> {
        let generation = GENERATION.load(Acquire);
        let owner = self.id.0;
        let cached = with_recent(|r| {
            let fresh = r.owner == owner && r.generation == generation;
            let (k, v) = (*entry(r))?;
            (fresh && k == key).then_some(v)
        });
        if cached.is_some() {
            return cached;
        }
        let found = table()?;
        with_recent(|r| {
            *entry(r.valid_for(owner, generation)) = Some((key, found));
            Some(())
        });
        Some(found)
    }

    /// Records one of our QPs and its shadow.
    pub fn set_qp(&self, real: u32, virt: u32, shadow: usize) {
        write(&self.local_qpns).insert(real, (virt, shadow));
        GENERATION.fetch_add(1, Release);
    }

    /// Forgets one of our QPs by its real number.
    pub fn drop_qp(&self, real: u32) {
        write(&self.local_qpns).remove(&real);
        GENERATION.fetch_add(1, Release);
    }

    /// Whether a virtual QP number of ours is taken.
    pub fn qpn_in_use(&self, v: u32) -> bool {
        read(&self.local_qpns).values().any(|&(x, _)| x == v)
    }

    /// Whether a new QP of a process known to its peers by address `me` (0: not known yet)
    /// may take `n` as its virtual number, which is its real one: no QP of this process has
    /// it, and no peer table of the job may hold it as one of `me`'s QPs that a rebuild moved
    /// to another real number. Every layer learns the endpoints at its own address at each
    /// rebuild (its node-mates' too, which share `me`), so a number in `remote_qpns` under
    /// `me` is one the peers translate; with `me` unknown (then the layer was sent every
    /// endpoint of the job), a number under any address is avoided.
    ///
    /// Nor may it be a real number the peers still know as another of `me`'s virtual ones (a QP
    /// destroyed since the rebuild): they would give that one as the source of its UD messages.
    pub fn qpn_free_for_new(&self, me: u64, n: u32) -> bool {
        if self.qpn_in_use(n) {
            return false;
        }
        let t = read(&self.remote_qpns);
        let back = read(&self.remote_virtual_qpns);
        if me == 0 {
            !t.keys().any(|&(_, v)| v == n) && !back.iter().any(|(&(_, r), &v)| r == n && v != n)
        } else {
            !t.contains_key(&(me, n)) && back.get(&(me, n)).is_none_or(|&v| v == n)
        }
    }

    /// The virtual number of one of our QPs, from the real one a completion carries.
    #[inline]
    pub fn local_qpn(&self, real: u32) -> Found {
        match read(&self.local_qpns).get(&real) {
            Some(&(v, _)) => Found::Real(v),
            None => Found::Unknown(real),
        }
    }

    /// The virtual number and shadow of one of our QPs, by its real number.
    #[inline]
    pub fn local_qp(&self, real: u32) -> Option<(u32, usize)> {
        self.through_recent(
            real,
            |r| &mut r.qps[real as usize % RECENT],
            || read(&self.local_qpns).get(&real).copied(),
        )
    }

    /// Learns a peer QP's new real number.
    pub fn set_remote_qpn(&self, peer: u64, virt: u32, real: u32) {
        let old = write(&self.remote_qpns).insert((peer, virt), real);
        let mut back = write(&self.remote_virtual_qpns);
        if let Some(old) = old {
            if back.get(&(peer, old)) == Some(&virt) {
                back.remove(&(peer, old));
            }
        }
        back.insert((peer, real), virt);
        self.translating_remote_qpns.store(true, Relaxed);
    }

    /// The virtual number of the QP that sent a UD message, from the real one its completion
    /// gives (`src_qp`) and where it came from (the sender's port now: the GID of its GRH, or
    /// [`Addr::lid`] of its LID). The identity until a peer rebuilt, and for a QP made since.
    #[inline]
    pub fn remote_source_qpn(&self, from: Addr, real: u32) -> u32 {
        let back = read(&self.remote_virtual_qpns);
        if back.is_empty() {
            return real;
        }
        // A peer that never moved is still at the address the program knows it by.
        let peer = read(&self.peers_by_port)
            .get(&from.0)
            .copied()
            .unwrap_or_else(|| from.id());
        back.get(&(peer, real)).copied().unwrap_or(real)
    }

    /// Whether any peer's QP numbers are translated (a UD completion's source may need it).
    #[inline]
    pub fn translates_remote_qpns(&self) -> bool {
        self.translating_remote_qpns.load(Relaxed)
    }

    /// The real number of a peer's QP (the identity until that peer rebuilt).
    #[inline]
    pub fn remote_qpn(&self, peer: u64, virt: u32) -> u32 {
        let t = read(&self.remote_qpns);
        if t.is_empty() {
            return virt;
        }
        t.get(&(peer, virt)).copied().unwrap_or(virt)
    }

    /// Learns a peer memory region's new real rkey.
    pub fn set_remote_rkey(&self, peer: u64, virt: u32, real: u32) {
        write(&self.remote_rkeys).insert((peer, virt), real);
    }

    /// The real rkey of a peer's memory (the identity until that peer rebuilt).
    #[inline]
    pub fn remote_rkey(&self, peer: u64, virt: u32) -> u32 {
        let t = read(&self.remote_rkeys);
        if t.is_empty() {
            return virt;
        }
        t.get(&(peer, virt)).copied().unwrap_or(virt)
    }

    /// Learns where a peer's port is now.
    pub fn set_peer(&self, peer: u64, port: PeerPort) {
        let old = write(&self.peers).insert(peer, port);
        let mut by_port = write(&self.peers_by_port);
        if let Some(old) = old {
            for k in [old.gid, Addr::lid(old.lid).0] {
                if by_port.get(&k) == Some(&peer) {
                    by_port.remove(&k);
                }
            }
        }
        if port.gid != [0; 16] {
            by_port.insert(port.gid, peer);
        }
        if port.lid != 0 {
            by_port.insert(Addr::lid(port.lid).0, peer);
        }
    }

    /// Where a peer's port is now (None: it never moved, or is unknown).
    pub fn peer(&self, peer: u64) -> Option<PeerPort> {
        read(&self.peers).get(&peer).copied()
    }

    /// A reconnect is in: the endpoints held are those of the addresses `known`, and no others
    /// are current.
    pub fn reconnected(&self, known: impl IntoIterator<Item = u64>) {
        let mut k = write(&self.known);
        k.clear();
        k.extend(known);
        self.reconnected.store(true, Release);
    }

    /// Whether the endpoints of address `id` must be asked for: a reconnect happened and
    /// brought none of them, and none were looked up since.
    #[inline]
    pub fn needs_lookup(&self, id: u64) -> bool {
        self.reconnected.load(Acquire) && !read(&self.known).contains(&id)
    }

    /// Address `id`'s endpoints are held (or were asked for).
    pub fn know(&self, id: u64) {
        write(&self.known).insert(id);
    }

    /// Whether a peer is known to be at `port` now (a UD completion's source).
    #[inline]
    pub fn knows_port(&self, port: Addr) -> bool {
        read(&self.peers_by_port).contains_key(&port.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_keys_and_qpns_translate_and_unknown_ones_are_reported() {
        let t = Tables::default();
        t.set_mr(0x100, 0x100, 0x101, 0x101);
        assert_eq!(t.lkey(0x100), Found::Real(0x100));
        // A rebuild gave the region new keys behind the same virtual ones.
        t.set_mr(0x100, 0x977, 0x101, 0x978);
        assert_eq!(t.lkey(0x100), Found::Real(0x977));
        assert_eq!(t.lkey(0x555), Found::Unknown(0x555));
        assert!(t.key_in_use(0x101));
        t.drop_mr(0x100, 0x101);
        assert_eq!(t.lkey(0x100), Found::Unknown(0x100));
        assert!(!t.key_in_use(0x101));

        t.set_qp(0x11, 0x11, 1);
        t.drop_qp(0x11);
        t.set_qp(0x2a, 0x11, 2);
        assert_eq!(t.local_qpn(0x2a), Found::Real(0x11));
        assert_eq!(t.local_qp(0x2a), Some((0x11, 2)));
        assert!(t.qpn_in_use(0x11));
        assert_eq!(t.local_qpn(0x11), Found::Unknown(0x11));
    }

    #[test]
    fn a_threads_recent_lookups_follow_every_change_and_never_mix_tables() {
        let (t, u) = (Tables::default(), Tables::default());
        // Keys in one cache slot (index bits 0x1 and 0x11), looked up in turn.
        t.set_mr(0x100, 0x200, 0x100, 0x200);
        t.set_mr(0x1100, 0x1200, 0x1100, 0x1200);
        u.set_mr(0x100, 0x300, 0x100, 0x300);
        for _ in 0..3 {
            assert_eq!(t.lkey(0x100), Found::Real(0x200));
            assert_eq!(t.lkey(0x1100), Found::Real(0x1200));
            assert_eq!(u.lkey(0x100), Found::Real(0x300), "another table's key");
        }
        assert_eq!(u.lkey(0x1100), Found::Unknown(0x1100));
        t.drop_mr(0x1100, 0x1100);
        assert_eq!(t.lkey(0x1100), Found::Unknown(0x1100), "deregistered");
        assert_eq!(t.lkey(0x100), Found::Real(0x200));

        t.set_qp(0x2a, 0x11, 2);
        assert_eq!(t.local_qp(0x2a), Some((0x11, 2)));
        assert_eq!(u.local_qp(0x2a), None);
        t.drop_qp(0x2a);
        assert_eq!(t.local_qp(0x2a), None, "destroyed");
        t.set_qp(0x2a, 0x2a, 3);
        assert_eq!(
            t.local_qp(0x2a),
            Some((0x2a, 3)),
            "a new QP with that number"
        );
        // Another thread's change is seen here.
        std::thread::scope(|s| {
            s.spawn(|| t.set_mr(0x100, 0x400, 0x100, 0x400));
        });
        assert_eq!(t.lkey(0x100), Found::Real(0x400));
    }

    #[test]
    fn a_peers_numbers_are_the_identity_until_it_rebuilt_and_are_per_address() {
        let t = Tables::default();
        let a = Addr([1; 16]).id();
        let b = Addr::lid(7).id();
        assert_ne!(a, b);
        assert_eq!(t.remote_qpn(a, 0x12), 0x12);
        assert_eq!(t.remote_rkey(a, 0x300), 0x300);
        t.set_remote_qpn(a, 0x12, 0x40);
        t.set_remote_rkey(a, 0x300, 0x9300);
        assert_eq!(t.remote_qpn(a, 0x12), 0x40);
        assert_eq!(
            t.remote_qpn(b, 0x12),
            0x12,
            "another peer's 0x12 is its own"
        );
        assert_eq!(t.remote_rkey(a, 0x300), 0x9300);
        assert_eq!(t.remote_rkey(b, 0x300), 0x300);
        assert_eq!(Addr::lid(0x1234).0[14..], [0x12, 0x34]);
    }

    #[test]
    fn a_ud_senders_real_qp_number_goes_back_to_its_virtual_one_by_where_it_is_now() {
        let t = Tables::default();
        let (a, b) = (Addr([1; 16]), Addr([2; 16]));
        assert_eq!(t.remote_source_qpn(a, 0x40), 0x40, "nothing rebuilt yet");
        assert!(!t.translates_remote_qpns());
        // a stayed where it was, its QP 0x12 is real 0x40 now; b moved to GID 3 and its QP
        // 0x12 is real 0x41 there.
        t.set_remote_qpn(a.id(), 0x12, 0x40);
        t.set_peer(
            b.id(),
            PeerPort {
                gid: [3; 16],
                lid: 0,
            },
        );
        t.set_remote_qpn(b.id(), 0x12, 0x41);
        assert!(t.translates_remote_qpns());
        assert_eq!(t.remote_source_qpn(a, 0x40), 0x12);
        assert_eq!(
            t.remote_source_qpn(Addr([3; 16]), 0x41),
            0x12,
            "b, from its new GID"
        );
        assert_eq!(t.remote_source_qpn(a, 0x41), 0x41, "0x41 is b's, not a's");
        assert_eq!(t.remote_source_qpn(a, 0x50), 0x50, "a QP a made since");
        // A second rebuild: b's QP is real 0x42 now; 0x41 is nobody's.
        t.set_remote_qpn(b.id(), 0x12, 0x42);
        assert_eq!(t.remote_source_qpn(Addr([3; 16]), 0x42), 0x12);
        assert_eq!(t.remote_source_qpn(Addr([3; 16]), 0x41), 0x41);
        // b moves again, to an InfiniBand port known by its LID.
        t.set_peer(
            b.id(),
            PeerPort {
                gid: [0; 16],
                lid: 9,
            },
        );
        assert_eq!(t.remote_source_qpn(Addr::lid(9), 0x42), 0x12);
        assert_eq!(
            t.remote_source_qpn(Addr([3; 16]), 0x42),
            0x42,
            "b is not at GID 3 any more"
        );
    }

    #[test]
    fn a_new_qp_never_takes_a_number_the_peers_translate_for_its_address() {
        let t = Tables::default();
        let (me, other) = (Addr([1; 16]).id(), Addr([2; 16]).id());
        assert!(t.qpn_free_for_new(me, 0x15), "nothing known yet");
        // The job's last rebuild: a node-mate's QP 0x15 (same address) is real 0x30 now,
        // another node's 0x16 is real 0x31; this process's own QP 0x17 is real 0x15.
        t.set_remote_qpn(me, 0x15, 0x30);
        t.set_remote_qpn(other, 0x16, 0x31);
        t.set_qp(0x15, 0x17, 1);
        assert!(
            !t.qpn_free_for_new(me, 0x15),
            "peers would reach the node-mate's QP"
        );
        assert!(
            !t.qpn_free_for_new(me, 0x17),
            "this process's own virtual number"
        );
        assert!(t.qpn_free_for_new(me, 0x16), "0x16 is another address's");
        assert!(
            !t.qpn_free_for_new(0, 0x16),
            "with its address unknown, any address's"
        );
        assert!(t.qpn_free_for_new(me, 0x18));
        // A QP of this address that was real 0x19 when the peers last learnt it and is gone
        // now: a new QP that gets 0x19 again would be named the old one as a UD source.
        t.set_remote_qpn(me, 0x1a, 0x19);
        assert!(
            !t.qpn_free_for_new(me, 0x19),
            "a real number peers translate back"
        );
        assert!(!t.qpn_free_for_new(0, 0x19));
        assert!(t.qpn_free_for_new(other, 0x19), "another address's");
    }

    #[test]
    fn addresses_are_looked_up_only_after_a_reconnect_and_once_until_the_next() {
        let t = Tables::default();
        let (a, b) = (Addr([1; 16]).id(), Addr([2; 16]).id());
        assert!(
            !t.needs_lookup(a),
            "nothing to look up before any reconnect"
        );
        t.reconnected([a]);
        assert!(!t.needs_lookup(a), "named at the rebuild");
        assert!(t.needs_lookup(b));
        t.know(b);
        assert!(!t.needs_lookup(b), "asked once");
        // The next reconnect brings new numbers: what was looked up before is stale.
        t.reconnected([a]);
        assert!(t.needs_lookup(b));
    }
}
