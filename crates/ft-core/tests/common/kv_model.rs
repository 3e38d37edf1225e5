//! A reference model of the KV cache (radix tree + slot allocator) and a harness that drives the real
//! [`KvCache`] and the model side by side, checking every invariant after every operation.
//!
//! The model is deliberately dumb: a map from every cached page-aligned token prefix to the KV slots of
//! its last page and the logical time it was last used (with one-token pages: every prefix and the slot
//! of its last token). Everything the tree does (longest-prefix match, page
//! alignment, duplicate detection on insert, lock counting, LRU eviction of unlocked leaves) is
//! re-derived from that map by brute force and compared.

use std::collections::{HashMap, HashSet};

use ft_core::config::CacheType;
use ft_core::scheduler::kv_cache::{CachedPrefix, Holders, KvCache};

/// One operation on the cache, as a scheduler would issue it.
#[derive(Clone, Debug)]
pub enum Op {
    /// Look up a prefix without locking it.
    Match(Vec<u32>),
    /// A request arrives: match + lock its prefix, allocate slots for the rest (evicting if needed).
    Admit(Vec<u32>),
    /// Request `idx % live` ends; its cached prefix and `keep` more tokens (at most all of them) have KV.
    /// `insert`: cache them (radix finish) or just free everything (failure).
    Finish { idx: usize, keep: usize, insert: bool },
    /// Pin a matched prefix with an extra lock (another reader).
    Pin(Vec<u32>),
    /// Drop pin `idx % pins`.
    Unpin(usize),
    /// Evict at least this many tokens (or everything evictable).
    Evict(usize),
}

/// A request holding slots in the harness.
#[derive(Clone, Debug)]
struct LiveSeq {
    tokens: Vec<u32>,
    slots: Vec<u32>,
    prefix: CachedPrefix,
}

/// An extra lock on a matched prefix.
#[derive(Clone, Debug)]
struct Pin {
    tokens: Vec<u32>,
    prefix: CachedPrefix,
}

/// Reference entry for one cached prefix (a whole number of pages).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    /// KV slots of the prefix's last page.
    slots: Vec<u32>,
    /// Logical time of the last match or insert that walked through this token.
    stamp: u64,
}

pub struct Harness {
    pub kv: KvCache,
    ps: usize,
    pages: usize,
    /// Every cached page-aligned prefix -> its last page's slots and LRU stamp.
    model: HashMap<Vec<u32>, Entry>,
    clock: u64,
    live: Vec<LiveSeq>,
    pins: Vec<Pin>,
    /// Counters for the report at the end of a run.
    pub admitted: usize,
    pub refused: usize,
    pub evicted_tokens: usize,
    pub cache_hits: usize,
}

impl Harness {
    pub fn new(capacity_tokens: usize, page_size: usize) -> Self {
        Harness {
            kv: KvCache::new(capacity_tokens, page_size, CacheType::Radix),
            ps: page_size,
            pages: capacity_tokens / page_size,
            model: HashMap::new(),
            clock: 0,
            live: Vec::new(),
            pins: Vec::new(),
            admitted: 0,
            refused: 0,
            evicted_tokens: 0,
            cache_hits: 0,
        }
    }

    /// The model's longest cached page-aligned prefix of `q`, and its slots.
    fn model_match(&self, q: &[u32]) -> Vec<u32> {
        let mut slots = Vec::new();
        let mut len = 0;
        while len + self.ps <= q.len() {
            let Some(e) = self.model.get(&q[..len + self.ps]) else { break };
            slots.extend_from_slice(&e.slots);
            len += self.ps;
        }
        slots
    }

    fn stamp_prefixes(&mut self, q: &[u32], len: usize) {
        for i in (self.ps..=len).step_by(self.ps) {
            self.model.get_mut(&q[..i]).expect("stamped prefix is cached").stamp = self.clock;
        }
    }

    /// Match in both and compare; stamps the model like the tree's LRU.
    fn matched(&mut self, q: &[u32]) -> (CachedPrefix, Vec<u32>) {
        let expected = self.model_match(q);
        let m = self.kv.match_prefix(q);
        assert_eq!(m.kv_len, m.slots.len(), "a radix match uses all the KV it finds");
        let (prefix, slots) = (m.prefix, m.slots);
        self.clock += 1;
        assert_eq!(slots, expected, "match of {q:?} disagrees with the reference");
        assert_eq!(prefix.len, slots.len());
        self.stamp_prefixes(q, expected.len());
        if !slots.is_empty() {
            self.cache_hits += 1;
        }
        (prefix, slots)
    }

    /// Applies one operation and checks every invariant.
    pub fn apply(&mut self, op: &Op) {
        let free_before = self.kv.allocator().free_pages();
        let mut may_evict = None; // Some(minimum tokens the op had to free)
        match op {
            Op::Match(q) => {
                self.matched(q);
            }
            Op::Pin(q) => {
                let (prefix, _) = self.matched(q);
                self.kv.lock(prefix);
                self.pins.push(Pin { tokens: q[..prefix.len].to_vec(), prefix });
            }
            Op::Unpin(i) => {
                if !self.pins.is_empty() {
                    let p = self.pins.swap_remove(i % self.pins.len());
                    self.kv.unlock(p.prefix);
                }
            }
            Op::Admit(tokens) => {
                let (prefix, cached) = self.matched(tokens);
                self.kv.lock(prefix);
                let need = self.kv.pages_for(tokens.len()) - prefix.len / self.ps;
                let available = self.kv.available_pages();
                match self.kv.allocate(need) {
                    Some(own) => {
                        assert!(need <= available);
                        assert_eq!(own.len(), need * self.ps);
                        if need > free_before {
                            may_evict = Some((need - free_before) * self.ps);
                        }
                        let mut slots = cached;
                        slots.extend(own);
                        self.live.push(LiveSeq { tokens: tokens.clone(), slots, prefix });
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
            Op::Finish { idx, keep, insert } => {
                if !self.live.is_empty() {
                    let s = self.live.swap_remove(idx % self.live.len());
                    let computed = s.prefix.len + (*keep).min(s.tokens.len() - s.prefix.len);
                    let key = &s.tokens[..computed];
                    let taken = self.kv.release(key, &s.slots, s.prefix, *insert, None).taken;
                    if *insert {
                        self.clock += 1;
                        let aligned = computed - computed % self.ps;
                        let mut new = 0;
                        for i in (self.ps..=aligned).step_by(self.ps) {
                            self.model.entry(s.tokens[..i].to_vec()).or_insert_with(|| {
                                new += self.ps;
                                Entry { slots: s.slots[i - self.ps..i].to_vec(), stamp: 0 }
                            });
                        }
                        assert_eq!(taken, new, "tree took over a different number of tokens than the model");
                        self.stamp_prefixes(&s.tokens, aligned);
                    } else {
                        assert_eq!(taken, 0);
                    }
                }
            }
            Op::Evict(n) => {
                let evictable = self.kv.tree().evictable_tokens();
                let freed = self.kv.evict(*n);
                assert!(freed >= (*n).min(evictable), "evict({n}) freed {freed} of {evictable} evictable");
                may_evict = Some(*n);
            }
        }
        self.check_against_model(may_evict);
    }

    /// Lock count of every cached prefix, from the harness's own locks.
    fn locked_prefixes(&self) -> HashMap<Vec<u32>, usize> {
        let mut locked = HashMap::new();
        let paths = self.live.iter().map(|s| &s.tokens[..s.prefix.len]).chain(self.pins.iter().map(|p| &p.tokens[..]));
        for path in paths {
            for i in (self.ps..=path.len()).step_by(self.ps) {
                *locked.entry(path[..i].to_vec()).or_insert(0) += 1;
            }
        }
        locked
    }

    fn check_against_model(&mut self, may_evict: Option<usize>) {
        // 1. The tree holds exactly the model's prefixes (minus what an evicting op removed).
        let ps = self.ps;
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
        let locked = self.locked_prefixes();
        let removed: Vec<(Vec<u32>, Entry)> =
            self.model.iter().filter(|(k, _)| !tree.contains_key(*k)).map(|(k, e)| (k.clone(), e.clone())).collect();
        if !removed.is_empty() {
            let Some(min_needed) = may_evict else {
                panic!("{} cached tokens vanished during an operation that cannot evict", removed.len())
            };
            assert!(min_needed > 0, "evicted although the free list was enough");
            for (k, _) in &removed {
                assert!(!locked.contains_key(k), "evicted locked prefix {k:?}");
            }
            // LRU: everything evicted was used no later than every unlocked leaf that stays.
            let newest_evicted = removed.iter().map(|(_, e)| e.stamp).max().unwrap();
            let inner: HashSet<&[u32]> = tree.keys().map(|k| &k[..k.len() - ps]).collect();
            for (k, e) in &self.model {
                if tree.contains_key(k) && !locked.contains_key(k) && !inner.contains(&k[..]) {
                    assert!(
                        e.stamp >= newest_evicted,
                        "LRU violated: kept leaf {k:?} (stamp {}) is older than an evicted one ({newest_evicted})",
                        e.stamp
                    );
                }
            }
            self.evicted_tokens += removed.len() * ps;
            for (k, _) in &removed {
                self.model.remove(k);
            }
        }
        // 2. Prefix closure: every cached prefix's parent is cached.
        for k in self.model.keys() {
            assert!(!k.is_empty() && k.len() % ps == 0, "cached prefix {k:?} is not whole pages");
            if k.len() > ps {
                assert!(self.model.contains_key(&k[..k.len() - ps]), "prefix closure broken at {k:?}");
            }
        }
        // 3. Counters: total and evictable tokens equal the model's count.
        assert_eq!(self.kv.tree().total_tokens(), self.model.len() * ps, "total cached tokens");
        let evictable = self.model.keys().filter(|k| !locked.contains_key(*k)).count() * ps;
        assert_eq!(self.kv.tree().evictable_tokens(), evictable, "evictable tokens");
        // 4. The tree's own structural check with the harness's locks (lock_ref == live locks below).
        let locks: Vec<_> =
            self.live.iter().map(|s| s.prefix.node).chain(self.pins.iter().map(|p| p.prefix.node)).collect();
        let own: Vec<&[u32]> = self.live.iter().map(|s| &s.slots[s.prefix.len..]).collect();
        // 5. Slot conservation and exclusive ownership: free + tree + requests == capacity, no page twice.
        let holders = Holders { kv_slots: own.clone(), locks, ..Holders::default() };
        self.kv.check_integrity(&holders).unwrap_or_else(|e| panic!("integrity: {e}"));
        let mut seen = HashSet::new();
        let model_slots = self.model.values().flat_map(|e| e.slots.iter().copied());
        let own_slots = own.iter().flat_map(|s| s.iter().copied());
        for slot in model_slots.chain(own_slots) {
            assert!(seen.insert(slot), "slot {slot} owned twice");
            assert!(!self.kv.allocator().is_page_free(slot / self.ps as u32), "slot {slot} owned but its page is free");
        }
        let owned_pages = seen.len() / self.ps;
        assert_eq!(owned_pages + self.kv.allocator().free_pages(), self.pages, "slot conservation");
        // 6. Every live request's slots still hold its locked prefix.
        for s in &self.live {
            assert_eq!(&s.slots[..s.prefix.len], &self.model_match(&s.tokens[..s.prefix.len])[..]);
        }
    }

    /// Ends every live request and pin, evicts everything and checks the pool is whole again.
    pub fn drain(&mut self) {
        while !self.live.is_empty() {
            self.apply(&Op::Finish { idx: 0, keep: usize::MAX, insert: true });
        }
        while !self.pins.is_empty() {
            self.apply(&Op::Unpin(0));
        }
        self.apply(&Op::Evict(usize::MAX));
        assert_eq!(self.kv.tree().total_tokens(), 0, "everything unlocked must be evictable");
        assert_eq!(self.kv.allocator().free_pages(), self.pages, "the pool is full again");
    }
}
