//! A reference model of the hybrid radix cache (radix tree + recurrent-state snapshots + the KV and state
//! slot allocators) and a harness that drives the real [`KvCache`] (`CacheType::HybridRadix`) and the
//! model side by side, checking every invariant after every operation.
//!
//! The model is deliberately dumb, like `kv_model.rs`: a map from every cached page-aligned token prefix
//! to the KV slots of its last page and its LRU stamp, plus a map from every prefix that has a snapshot to
//! its state slot and snapshot stamp. Locks are recomputed from the harness's requests and pins each time.
//! What the tree does is re-derived by brute force and compared:
//!
//! * a match is the longest KV-cached chain of the query *cut back to the deepest prefix with a snapshot*
//!   (same slots, same restore slot), and it refreshes only the consumed KV and that one snapshot;
//! * snapshot eviction (explicit, or to make room for a capture or a donation) takes exactly the least
//!   recently used snapshots with no pending restore, cold ones (intermediate chunk ends never restored
//!   from) first in the order they were taken; their KV stays (tombstones);
//! * KV eviction never takes a locked prefix, takes snapshot-less leaves before leaves with a snapshot
//!   and LRU within each group, and frees a node's snapshot with it, so every snapshot's prefix is always
//!   KV-cached (KV is never freed under a snapshot);
//! * inserts report the tokens taken over; captures move the request's lock down and hand back the
//!   request's duplicates of KV the tree already had (it keeps them until it ends); donation follows the
//!   finish rule;
//! * both pools are conserved: every KV page free / cached / request-owned, every state slot free / live /
//!   snapshot, none owned twice; live and snapshot counts within their caps.

use std::collections::{HashMap, HashSet};

use ft_core::config::CacheType;
use ft_core::scheduler::kv_cache::{CachedPrefix, Holders, KvCache, LiveState};

/// One operation on the cache, as the scheduler would issue it.
#[derive(Clone, Debug)]
pub enum HOp {
    /// Look up a prefix without locking it.
    Match(Vec<u32>),
    /// A request arrives: live slot, match + lock (and snapshot lock on a restore), allocate KV.
    Admit(Vec<u32>),
    /// Request `idx % live`'s first step ran: its restore is done.
    Restored(usize),
    /// Request `idx % live` captured the state at one of its grid points (`pick` chooses which) past its
    /// locked prefix; the computed length grows to it. `cold`: an intermediate chunk end.
    Capture { idx: usize, pick: usize, cold: bool },
    /// Request `idx % live` ends with `keep` more tokens computed. `insert`: cache them (a finish) or free
    /// everything (a failure). `donate`: its live state is valid (nothing in flight).
    Finish { idx: usize, keep: usize, insert: bool, donate: bool },
    /// Pin a matched prefix with an extra lock (another reader about to restore).
    Pin(Vec<u32>),
    /// Drop pin `idx % pins`.
    Unpin(usize),
    /// Evict at least this many KV tokens (or everything evictable).
    EvictKv(usize),
    /// Evict up to this many snapshots.
    EvictSnapshots(usize),
}

/// A running request in the harness.
#[derive(Clone, Debug)]
struct Req {
    tokens: Vec<u32>,
    slots: Vec<u32>,
    /// Its own pages below `prefix.len` (duplicates of the tree's), freed when it ends.
    duplicates: Vec<u32>,
    prefix: CachedPrefix,
    live: u32,
    computed: usize,
}

/// An extra lock on a matched prefix.
#[derive(Clone, Debug)]
struct Pin {
    tokens: Vec<u32>,
    prefix: CachedPrefix,
}

/// Reference entry of one cached page-aligned prefix.
#[derive(Clone, Debug)]
struct Entry {
    /// KV slots of the prefix's last page.
    slots: Vec<u32>,
    /// Logical time of the last match or insert that consumed this page.
    stamp: u64,
}

/// Reference entry of one snapshot.
#[derive(Clone, Debug)]
struct Snap {
    slot: u32,
    /// `WARM | logical time` the snapshot was taken or last restored from, or its place among the cold
    /// ones (below every warm stamp).
    stamp: u64,
}

const WARM: u64 = 1 << 63;

/// An unlocked leaf of the model before an evicting operation: `(prefix, has a snapshot, stamp)`.
type LeafInfo = Vec<(Vec<u32>, bool, u64)>;

pub struct HybridHarness {
    pub kv: KvCache,
    ps: usize,
    grid: usize,
    pages: usize,
    live_cap: usize,
    snap_cap: usize,
    model: HashMap<Vec<u32>, Entry>,
    snaps: HashMap<Vec<u32>, Snap>,
    clock: u64,
    cold_clock: u64,
    reqs: Vec<Req>,
    pins: Vec<Pin>,
    /// Counters for the report at the end of a run (a run must exercise what it claims to).
    pub admitted: usize,
    pub refused: usize,
    pub restores: usize,
    pub restored_tokens: usize,
    pub captures: usize,
    pub cold_captures: usize,
    pub captures_over_cached_kv: usize,
    pub donations: usize,
    pub snapshot_evictions: usize,
    pub snapshots_lost_with_kv: usize,
    pub evicted_tokens: usize,
    pub tiered_evictions: usize,
}

impl HybridHarness {
    /// A hybrid cache of `capacity` KV tokens in pages of `page_size`, snapshots on multiples of `grid`
    /// (a multiple of the page size), `live_cap` live and `snap_cap` snapshot state slots.
    pub fn new(capacity: usize, page_size: usize, grid: usize, live_cap: usize, snap_cap: usize) -> Self {
        assert!(grid.is_multiple_of(page_size));
        HybridHarness {
            kv: KvCache::with_state_slots(capacity, page_size, CacheType::HybridRadix, live_cap, snap_cap),
            ps: page_size,
            grid,
            pages: capacity / page_size,
            live_cap,
            snap_cap,
            model: HashMap::new(),
            snaps: HashMap::new(),
            clock: 0,
            cold_clock: 0,
            reqs: Vec::new(),
            pins: Vec::new(),
            admitted: 0,
            refused: 0,
            restores: 0,
            restored_tokens: 0,
            captures: 0,
            cold_captures: 0,
            captures_over_cached_kv: 0,
            donations: 0,
            snapshot_evictions: 0,
            snapshots_lost_with_kv: 0,
            evicted_tokens: 0,
            tiered_evictions: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Length of the longest KV-cached page chain of `q`.
    fn chain(&self, q: &[u32]) -> usize {
        let mut len = 0;
        while len + self.ps <= q.len() && self.model.contains_key(&q[..len + self.ps]) {
            len += self.ps;
        }
        len
    }

    /// KV slots of `q[..len]` (a cached chain).
    fn chain_slots(&self, q: &[u32], len: usize) -> Vec<u32> {
        (self.ps..=len).step_by(self.ps).flat_map(|i| self.model[&q[..i]].slots.iter().copied()).collect()
    }

    /// The model's hybrid match: deepest prefix of the cached chain of `q` that has a snapshot.
    fn model_match(&self, q: &[u32]) -> usize {
        let chain = self.chain(q);
        (self.ps..=chain).step_by(self.ps).filter(|&i| self.snaps.contains_key(&q[..i])).max().unwrap_or(0)
    }

    /// Prefixes locked by requests and pins, with their counts, and the snapshot-locked ones.
    fn locks(&self) -> (HashMap<Vec<u32>, usize>, HashMap<Vec<u32>, u32>) {
        let mut kv = HashMap::new();
        let mut snap = HashMap::new();
        let held = self
            .reqs
            .iter()
            .map(|r| (&r.tokens[..r.prefix.len], r.prefix))
            .chain(self.pins.iter().map(|p| (&p.tokens[..], p.prefix)));
        for (path, prefix) in held {
            for i in (self.ps..=path.len()).step_by(self.ps) {
                *kv.entry(path[..i].to_vec()).or_insert(0) += 1;
            }
            if prefix.restore.is_some() {
                *snap.entry(path.to_vec()).or_insert(0) += 1;
            }
        }
        (kv, snap)
    }

    /// The `n` least recently used snapshots nothing is about to restore from, oldest first.
    fn oldest_unlocked_snaps(&self, n: usize) -> Vec<Vec<u32>> {
        let (_, snap_locked) = self.locks();
        let mut v: Vec<(u64, &Vec<u32>)> =
            self.snaps.iter().filter(|(k, _)| !snap_locked.contains_key(*k)).map(|(k, s)| (s.stamp, k)).collect();
        v.sort();
        v.into_iter().take(n).map(|(_, k)| k.clone()).collect()
    }

    /// Unlocked leaves of the model (no cached extension), with tier and stamp.
    fn leaf_info(&self) -> LeafInfo {
        let (locked, _) = self.locks();
        let inner: HashSet<&[u32]> = self.model.keys().map(|k| &k[..k.len() - self.ps]).collect();
        self.model
            .iter()
            .filter(|(k, _)| !inner.contains(&k[..]) && !locked.contains_key(*k))
            .map(|(k, e)| (k.clone(), self.snaps.contains_key(k), e.stamp))
            .collect()
    }

    /// Match in both and compare; stamps the model as the tree stamps itself.
    fn matched(&mut self, q: &[u32]) -> (CachedPrefix, Vec<u32>) {
        let d = self.model_match(q);
        let expected_slots = self.chain_slots(q, d);
        let expected_restore = (d > 0).then(|| self.snaps[&q[..d]].slot);
        let m = self.kv.match_prefix(q);
        assert_eq!(m.kv_len, self.chain(q), "hybrid match of {q:?}: how far the KV reaches");
        let (prefix, slots) = (m.prefix, m.slots);
        assert_eq!(prefix.len, d, "hybrid match of {q:?}: cut to {} but the model says {d}", prefix.len);
        assert_eq!(slots, expected_slots, "hybrid match of {q:?}: slots differ from the model");
        assert_eq!(prefix.restore, expected_restore, "hybrid match of {q:?}: restore slot");
        let now = self.tick();
        for i in (self.ps..=d).step_by(self.ps) {
            self.model.get_mut(&q[..i]).unwrap().stamp = now;
        }
        if d > 0 {
            self.snaps.get_mut(&q[..d]).unwrap().stamp = WARM | now;
        }
        (prefix, slots)
    }

    /// Inserts `key` (whole pages) with `slots` into the model: returns (already cached, newly taken).
    fn model_insert(&mut self, key: &[u32], slots: &[u32]) -> (usize, usize) {
        let already = self.chain(key);
        for i in (already + self.ps..=key.len()).step_by(self.ps) {
            self.model.insert(key[..i].to_vec(), Entry { slots: slots[i - self.ps..i].to_vec(), stamp: 0 });
        }
        let now = self.tick();
        for i in (self.ps..=key.len()).step_by(self.ps) {
            self.model.get_mut(&key[..i]).unwrap().stamp = now;
        }
        (already, key.len() - already)
    }

    /// Removes the predicted snapshot victims from the model; returns them.
    fn evict_model_snaps(&mut self, n: usize) -> HashSet<Vec<u32>> {
        let victims = self.oldest_unlocked_snaps(n);
        for v in &victims {
            self.snaps.remove(v);
        }
        self.snapshot_evictions += victims.len();
        victims.into_iter().collect()
    }

    /// Applies one operation and checks every invariant.
    pub fn apply(&mut self, op: &HOp) {
        let mut kv_evict: Option<(usize, LeafInfo)> = None; // (minimum tokens the op had to free, leaves)
        let mut snap_victims: HashSet<Vec<u32>> = HashSet::new();
        match op {
            HOp::Match(q) => {
                self.matched(q);
            }
            HOp::Pin(q) => {
                let (prefix, _) = self.matched(q);
                self.kv.lock(prefix);
                self.pins.push(Pin { tokens: q[..prefix.len].to_vec(), prefix });
            }
            HOp::Unpin(i) => {
                if !self.pins.is_empty() {
                    let p = self.pins.swap_remove(i % self.pins.len());
                    self.kv.unlock(p.prefix);
                }
            }
            HOp::Admit(tokens) => {
                if self.kv.states().live_available() == 0 {
                    assert_eq!(self.reqs.len(), self.live_cap, "live slots ran out early");
                    self.refused += 1;
                } else {
                    let (prefix, cached) = self.matched(tokens);
                    self.kv.lock(prefix);
                    let need = self.kv.pages_for(tokens.len()) - prefix.len / self.ps;
                    let free_before = self.kv.allocator().free_pages();
                    let available = self.kv.available_pages();
                    let leaves = self.leaf_info_with(Some(&tokens[..prefix.len]), prefix);
                    match self.kv.allocate(need) {
                        Some(own) => {
                            assert!(need <= available);
                            if need > free_before {
                                kv_evict = Some(((need - free_before) * self.ps, leaves));
                            }
                            let live = self.kv.alloc_live().expect("checked a live slot is free");
                            let mut slots = cached;
                            slots.extend(own);
                            if prefix.restore.is_some() {
                                self.restores += 1;
                                self.restored_tokens += prefix.len;
                            }
                            let duplicates = Vec::new();
                            self.reqs.push(Req {
                                tokens: tokens.clone(),
                                slots,
                                duplicates,
                                prefix,
                                live,
                                computed: prefix.len,
                            });
                            self.admitted += 1;
                        }
                        None => {
                            assert!(need > available, "allocation refused although free + evictable covered it");
                            assert_eq!(self.kv.allocator().free_pages(), free_before, "a refused allocation evicted");
                            self.kv.unlock(prefix);
                            self.refused += 1;
                        }
                    }
                }
            }
            HOp::Restored(i) => {
                if !self.reqs.is_empty() {
                    let n = self.reqs.len();
                    let r = &mut self.reqs[i % n];
                    self.kv.restored(&mut r.prefix);
                    assert!(r.prefix.restore.is_none());
                }
            }
            HOp::Capture { idx, pick, cold } => {
                if !self.reqs.is_empty() {
                    let i = idx % self.reqs.len();
                    // The scheduler commits the restore before the captures of the same step.
                    self.kv.restored(&mut self.reqs[i].prefix);
                    let (start, len) = (self.reqs[i].prefix.len, self.reqs[i].tokens.len());
                    let points: Vec<usize> = (start + 1..=len).filter(|g| g % self.grid == 0).collect();
                    if !points.is_empty() {
                        let g = points[pick % points.len()];
                        if self.snaps.len() == self.snap_cap {
                            snap_victims = self.evict_model_snaps(1);
                        }
                        let room = self.snaps.len() < self.snap_cap;
                        let slot = self.kv.alloc_snapshot();
                        assert_eq!(slot.is_some(), room, "snapshot allocation disagrees with the model's room");
                        self.reqs[i].computed = self.reqs[i].computed.max(g);
                        if let Some(slot) = slot {
                            self.capture(i, g, slot, *cold);
                        }
                    }
                }
            }
            HOp::Finish { idx, keep, insert, donate } => {
                if !self.reqs.is_empty() {
                    let r = self.reqs.swap_remove(idx % self.reqs.len());
                    let computed = r.computed.saturating_add(*keep).min(r.tokens.len());
                    let valid = *donate && r.prefix.restore.is_none();
                    let key = &r.tokens[..computed];
                    let aligned = computed - computed % self.ps;
                    let (mut taken, mut donated) = (0, false);
                    if *insert {
                        taken = self.model_insert(&key[..aligned], &r.slots[..aligned]).1;
                        if valid && aligned == computed && aligned > 0 && !self.snaps.contains_key(key) {
                            if self.snaps.len() == self.snap_cap {
                                snap_victims = self.evict_model_snaps(1);
                            }
                            if self.snaps.len() < self.snap_cap {
                                let stamp = WARM | self.tick();
                                self.snaps.insert(key.to_vec(), Snap { slot: r.live, stamp });
                                donated = true;
                                self.donations += 1;
                            }
                        }
                    }
                    let live = Some(LiveState { slot: r.live, valid });
                    let out = self.kv.release(key, &r.slots, r.prefix, *insert, live);
                    self.kv.free_slots(&r.duplicates);
                    assert_eq!(out.taken, taken, "tree took over a different number of tokens than the model");
                    assert_eq!(out.donated, donated, "donation of {key:?} disagrees with the model");
                }
            }
            HOp::EvictKv(n) => {
                let evictable = self.kv.tree().evictable_tokens();
                let leaves = self.leaf_info();
                let freed = self.kv.evict(*n);
                assert!(freed >= (*n).min(evictable), "evict({n}) freed {freed} of {evictable} evictable");
                kv_evict = Some((*n, leaves));
            }
            HOp::EvictSnapshots(n) => {
                snap_victims = self.evict_model_snaps(*n);
                let freed = self.kv.evict_snapshots(*n);
                assert_eq!(freed, snap_victims.len(), "evict_snapshots({n}) freed a different number");
            }
        }
        self.check(kv_evict, snap_victims);
    }

    /// `leaf_info`, counting `extra` (a prefix locked but not yet recorded as a request) as locked.
    fn leaf_info_with(&self, extra: Option<&[u32]>, prefix: CachedPrefix) -> LeafInfo {
        let mut leaves = self.leaf_info();
        if let Some(path) = extra {
            let locked: HashSet<&[u32]> = (self.ps..=prefix.len).step_by(self.ps).map(|i| &path[..i]).collect();
            leaves.retain(|(k, _, _)| !locked.contains(&k[..]));
        }
        leaves
    }

    /// Request `i` caches a snapshot at `g` into `slot`, in the model and for real.
    fn capture(&mut self, i: usize, g: usize, slot: u32, cold: bool) {
        let r = &self.reqs[i];
        let key = r.tokens[..g].to_vec();
        let p = r.prefix.len;
        let own = r.slots[..g].to_vec();
        let (already, _) = self.model_insert(&key, &own);
        let expected_duplicates = own[p..already.max(p)].to_vec();
        let dup = self.snaps.contains_key(&key);
        if !dup {
            let stamp = if cold {
                self.cold_clock += 1;
                self.cold_clock
            } else {
                WARM | self.tick()
            };
            self.snaps.insert(key.clone(), Snap { slot, stamp });
            if cold {
                self.cold_captures += 1;
            }
        }
        let r = &mut self.reqs[i];
        let duplicates = self.kv.cache_snapshot(&key, &r.slots, &mut r.prefix, slot, cold);
        assert_eq!(duplicates, expected_duplicates, "capture at {g}: the request's duplicates of the tree's KV");
        assert_eq!((r.prefix.len, r.prefix.restore), (g, None), "capture at {g}: lock did not move down");
        self.captures += 1;
        if !duplicates.is_empty() {
            self.captures_over_cached_kv += 1;
        }
        r.duplicates.extend(duplicates);
    }

    fn check(&mut self, kv_evict: Option<(usize, LeafInfo)>, snap_victims: HashSet<Vec<u32>>) {
        let ps = self.ps;
        // 1. KV: the tree holds exactly the model's prefixes, minus what an evicting op removed.
        let tree: HashMap<Vec<u32>, Vec<u32>> = self
            .kv
            .tree()
            .cached_sequences()
            .into_iter()
            .flat_map(|(k, v)| (ps..=k.len()).step_by(ps).map(move |i| (k[..i].to_vec(), v[i - ps..i].to_vec())))
            .collect();
        for (k, slots) in &tree {
            let e = self.model.get(k).unwrap_or_else(|| panic!("tree caches {k:?}, the model does not"));
            assert_eq!(&e.slots, slots, "tree and model disagree on the slots of {k:?}");
        }
        let (locked, snap_locked) = self.locks();
        let removed: Vec<Vec<u32>> = self.model.keys().filter(|k| !tree.contains_key(*k)).cloned().collect();
        if !removed.is_empty() {
            let Some((min_needed, leaves)) = kv_evict else {
                panic!("{} cached pages vanished during an operation that cannot evict KV", removed.len())
            };
            assert!(min_needed > 0, "evicted although the free list was enough");
            let gone: HashSet<&Vec<u32>> = removed.iter().collect();
            for k in &removed {
                assert!(!locked.contains_key(k), "evicted locked prefix {k:?}");
            }
            // Leaves without a snapshot go first, then LRU: every unlocked leaf present before the op that
            // was evicted orders no later than every one that stays.
            let (out, kept): (Vec<_>, Vec<_>) = leaves.iter().partition(|(k, _, _)| gone.contains(k));
            for (ek, et, es) in &out {
                for (kk, kt, ks) in &kept {
                    assert!(
                        (et, es) <= (kt, ks),
                        "KV eviction order violated: evicted {ek:?} (snapshot {et}, stamp {es}) but kept \
                         {kk:?} (snapshot {kt}, stamp {ks})"
                    );
                }
            }
            if out.iter().any(|l| l.1) && out.iter().any(|l| !l.1) {
                self.tiered_evictions += 1;
            }
            self.evicted_tokens += removed.len() * ps;
            for k in &removed {
                self.model.remove(k);
                if self.snaps.remove(k).is_some() {
                    self.snapshots_lost_with_kv += 1;
                }
            }
        }
        // 2. Snapshots: the tree holds exactly the model's, with the model's slots and snapshot locks.
        let tree_snaps: HashMap<Vec<u32>, (u32, u32)> =
            self.kv.tree().cached_snapshots().into_iter().map(|(k, s, l)| (k, (s, l))).collect();
        for v in &snap_victims {
            // (A capture may refill the prefix whose snapshot it evicted, even with the same slot id.)
            assert!(
                !tree_snaps.contains_key(v) || self.snaps.contains_key(v),
                "snapshot {v:?} should have been evicted (least recently used)"
            );
        }
        for (k, (slot, lock)) in &tree_snaps {
            let s = self.snaps.get(k).unwrap_or_else(|| panic!("tree has a snapshot at {k:?}, the model does not"));
            assert_eq!(s.slot, *slot, "snapshot slot at {k:?}");
            assert_eq!(*lock, snap_locked.get(k).copied().unwrap_or(0), "snapshot lock count at {k:?}");
        }
        for k in self.snaps.keys() {
            assert!(tree_snaps.contains_key(k), "snapshot at {k:?} vanished (not an LRU victim, KV still there)");
            // 3. KV is never freed under a snapshot: the whole prefix a snapshot continues is cached.
            assert!(!k.is_empty() && k.len() % ps == 0);
            assert!(self.model.contains_key(k), "snapshot at {k:?} without the KV of its prefix");
        }
        // 4. Prefix closure.
        for k in self.model.keys() {
            assert!(!k.is_empty() && k.len() % ps == 0, "cached prefix {k:?} is not whole pages");
            if k.len() > ps {
                assert!(self.model.contains_key(&k[..k.len() - ps]), "prefix closure broken at {k:?}");
            }
        }
        // 5. Counters.
        let t = self.kv.tree();
        assert_eq!(t.total_tokens(), self.model.len() * ps, "total cached tokens");
        let evictable = self.model.keys().filter(|k| !locked.contains_key(*k)).count() * ps;
        assert_eq!(t.evictable_tokens(), evictable, "evictable tokens");
        assert_eq!(t.num_snapshots(), self.snaps.len(), "snapshot count");
        let unlocked_snaps = self.snaps.keys().filter(|k| !snap_locked.contains_key(*k)).count();
        assert_eq!(t.evictable_snapshots(), unlocked_snaps, "evictable snapshots");
        // 6. The cache's own structural check with the harness's holdings.
        let own: Vec<&[u32]> = self.reqs.iter().flat_map(|r| [&r.slots[r.prefix.len..], &r.duplicates[..]]).collect();
        let holders = Holders {
            kv_slots: own.clone(),
            locks: self.reqs.iter().map(|r| r.prefix.node).chain(self.pins.iter().map(|p| p.prefix.node)).collect(),
            snapshot_locks: self
                .reqs
                .iter()
                .map(|r| r.prefix)
                .chain(self.pins.iter().map(|p| p.prefix))
                .filter(|p| p.restore.is_some())
                .map(|p| p.node)
                .collect(),
            live_states: self.reqs.iter().map(|r| r.live).collect(),
            pending_snapshots: Vec::new(),
        };
        self.kv.check_integrity(&holders).unwrap_or_else(|e| panic!("integrity: {e}"));
        // 7. KV slot conservation.
        let mut seen = HashSet::new();
        let model_slots = self.model.values().flat_map(|e| e.slots.iter().copied());
        for slot in model_slots.chain(own.iter().flat_map(|s| s.iter().copied())) {
            assert!(seen.insert(slot), "KV slot {slot} owned twice");
        }
        assert_eq!(seen.len() / ps + self.kv.allocator().free_pages(), self.pages, "KV slot conservation");
        // 8. State slot conservation: live + snapshots + free == capacity, within the caps, none twice.
        let states = self.kv.states();
        assert_eq!(states.live_in_use(), self.reqs.len(), "live state slots in use");
        assert_eq!(states.snapshots_in_use(), self.snaps.len(), "snapshot slots in use");
        assert!(self.snaps.len() <= self.snap_cap && self.reqs.len() <= self.live_cap);
        assert_eq!(states.free_ids() + self.reqs.len() + self.snaps.len(), self.live_cap + self.snap_cap);
        let mut ids = HashSet::new();
        for id in self.reqs.iter().map(|r| r.live).chain(self.snaps.values().map(|s| s.slot)) {
            assert!(ids.insert(id), "state slot {id} held twice");
        }
        // 9. Every request's locked prefix is still the tree's (where the request does not read its own
        // duplicate), and a pending restore names its snapshot.
        for r in &self.reqs {
            let p = r.prefix.len;
            let tree_slots = self.chain_slots(&r.tokens, p);
            for (i, s) in r.slots[..p].iter().enumerate() {
                assert!(*s == tree_slots[i] || r.duplicates.contains(s), "request lost its locked prefix at {i}");
            }
            assert_eq!(self.kv.tree().depth(r.prefix.node), p);
            if let Some(s) = r.prefix.restore {
                assert_eq!(self.snaps[&r.tokens[..p]].slot, s, "pending restore of a different snapshot");
            }
        }
    }

    /// Ends every request and pin, evicts everything and checks both pools are whole again.
    pub fn drain(&mut self) {
        while !self.reqs.is_empty() {
            self.apply(&HOp::Finish { idx: 0, keep: usize::MAX, insert: true, donate: true });
        }
        while !self.pins.is_empty() {
            self.apply(&HOp::Unpin(0));
        }
        self.apply(&HOp::EvictSnapshots(usize::MAX / 2));
        self.apply(&HOp::EvictKv(usize::MAX));
        assert_eq!(self.kv.tree().total_tokens(), 0, "everything unlocked must be evictable");
        assert_eq!(self.kv.allocator().free_pages(), self.pages, "the KV pool is full again");
        assert_eq!(self.kv.states().free_ids(), self.live_cap + self.snap_cap, "every state slot is free again");
    }
}
