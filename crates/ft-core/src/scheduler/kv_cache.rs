//! The cache's bookkeeping: free KV pages, recurrent-state slots and the prefix tree, behind the moves a
//! request makes.
//!
//! Every KV slot is in exactly one of three places: the free list ([`KvSlotAllocator`]), the radix tree
//! ([`RadixTree`], cached sequences) or a running request (the pages it computed itself). With a hybrid
//! model every recurrent-state slot ([`StateSlotPool`]) is likewise free, the live state of one running
//! request, a snapshot owned by one tree node, or a snapshot a step in flight is capturing for a request.
//! A request's life through this type:
//!
//! ```text
//!   admit:    match_prefix(prompt[..len-1]) ─► lock(prefix)   radix: longest cached prefix; hybrid_radix: cut
//!             alloc_live()                                    back to the deepest snapshot, which is locked too
//!                                                             (and how far the KV alone reaches: a branch point)
//!   steps:    allocate(pages)                                 evicts LRU tree leaves if the free list is short
//!             cache_prefix(..)                                radix: the prompt goes into the tree once its KV
//!                                                             is computed (n choices share it), lock moves down
//!             restored(prefix)                                hybrid: its first step copied the snapshot
//!             alloc_snapshot() ... cache_snapshot(..)         hybrid: a capture taken at a grid point goes into
//!                                                             the tree, the request's lock moves down to it
//!                                                             (KV the tree had already stays the request's
//!                                                             duplicate until free_slots at its end)
//!   finish:   release(tokens with KV, slots, prefix,          radix: insert the computed tokens, free the
//!                     insert, live state)                     duplicates and the unaligned tail, unlock;
//!                                                             hybrid_radix: donate the live state to the node
//!                                                             ending at the computed length (see below);
//!                                                             naive (or failed): free own pages, unlock
//! ```
//!
//! Free + evictable is the currency of admission: an unlocked cached page can be turned into a free page
//! at any time, so the scheduler admits a request only when free + evictable covers everything it may
//! still allocate (its own and every running request's reserved budget). Snapshots are a second currency
//! with their own cap and LRU: taking one when the cap is reached evicts the least recently used unlocked
//! snapshot (tombstoning its node), and a snapshot that cannot get room is simply not taken.
//!
//! **Finish donation rule.** A request's live slot holds the state after exactly the tokens whose KV the
//! worker wrote (`computed`: prompt plus all but the last sampled token) once at least one of its steps has
//! been committed and none is in flight (an in-flight step would still advance it). That state becomes the
//! snapshot of the node ending at `computed.len()`, which exists after the insert only when
//! `computed.len()` is a whole number of pages (always with page size 1); otherwise, or when that node
//! already owns a snapshot, or no snapshot room can be made, the live slot is freed. Donated states are
//! *not* on the 64-token grid: the grid exists only so a chunked GDN kernel can emit states inside a chunk,
//! while a donated state is a sequence's final state, exact at any length. The next turn of a chat
//! (`prompt + answer + new message`) then resumes from the end of the answer's KV.

use crate::allocator::{KvSlotAllocator, StateSlotPool, StateSlotUse};
use crate::config::CacheType;
use crate::radix::{NodeId, RadixTree};

/// A request's cached prefix: where its match ends in the tree and how long it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedPrefix {
    /// Node the match ends at (`NodeId::ROOT` when nothing matched); locked while the request runs.
    pub node: NodeId,
    /// Cached tokens (a multiple of the page size). The request's first `len` slots belong to the tree.
    pub len: usize,
    /// Hybrid radix: the snapshot slot at `node` the request restores from, while the restore is pending
    /// (snapshot-locked until [`KvCache::restored`]). `None` once restored, or when nothing is restored.
    pub restore: Option<u32>,
}

impl CachedPrefix {
    /// Nothing cached.
    pub const NONE: CachedPrefix = CachedPrefix { node: NodeId::ROOT, len: 0, restore: None };
}

/// What [`KvCache::match_prefix`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// The usable cached prefix (lock it with [`KvCache::lock`]).
    pub prefix: CachedPrefix,
    /// Its KV slots (`prefix.len` of them).
    pub slots: Vec<u32>,
    /// Longest cached KV prefix of the query (`>= prefix.len`). Past `prefix.len` (hybrid radix only) the
    /// tree has the KV but no state to resume from, and where this ends another cached sequence branched
    /// off: the scheduler snapshots that branch point so the next request sharing it resumes there.
    pub kv_len: usize,
}

/// A running request's live recurrent-state slot, handed back as it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveState {
    /// The live slot.
    pub slot: u32,
    /// Whether the slot holds the state after exactly the request's computed tokens (a step has been
    /// committed and none is in flight). Only then may it be donated.
    pub valid: bool,
}

/// What [`KvCache::release`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Tokens the tree newly took over.
    pub taken: usize,
    /// Whether the live state became the snapshot of the node ending at the computed length.
    pub donated: bool,
}

/// Who holds what outside the tree and the free lists, for [`KvCache::check_integrity`].
#[derive(Clone, Debug, Default)]
pub struct Holders<'a> {
    /// The KV slots each request owns itself (past its cached prefix, and duplicates below it).
    pub kv_slots: Vec<&'a [u32]>,
    /// The node each request (or other user) locked.
    pub locks: Vec<NodeId>,
    /// The node of each pending restore (its snapshot is locked).
    pub snapshot_locks: Vec<NodeId>,
    /// Each running request's live state slot.
    pub live_states: Vec<u32>,
    /// Snapshot slots being captured by steps in flight.
    pub pending_snapshots: Vec<u32>,
}

/// KV slot allocator, recurrent-state slots and the radix prefix cache.
#[derive(Clone, Debug)]
pub struct KvCache {
    /// Free pages of the pool.
    allocator: KvSlotAllocator,
    /// Live and snapshot recurrent-state slots (empty for models without recurrent state).
    states: StateSlotPool,
    /// Cached sequences (never consulted with [`CacheType::Naive`]) and, with
    /// [`CacheType::HybridRadix`], their snapshots.
    tree: RadixTree,
    /// Whether finished sequences are cached and matched, and how.
    cache_type: CacheType,
}

impl KvCache {
    /// A pool of `capacity_tokens` slots (whole pages of `page_size`), all free, with an empty cache and
    /// no recurrent-state slots.
    pub fn new(capacity_tokens: usize, page_size: usize, cache_type: CacheType) -> Self {
        Self::with_state_slots(capacity_tokens, page_size, cache_type, 0, 0)
    }

    /// Also `live_slots + snapshot_slots` recurrent-state slots (a hybrid model). Snapshots are only ever
    /// taken with [`CacheType::HybridRadix`].
    pub fn with_state_slots(
        capacity_tokens: usize,
        page_size: usize,
        cache_type: CacheType,
        live_slots: usize,
        snapshot_slots: usize,
    ) -> Self {
        KvCache {
            allocator: KvSlotAllocator::new(capacity_tokens, page_size),
            states: StateSlotPool::new(live_slots, snapshot_slots),
            tree: RadixTree::new(page_size),
            cache_type,
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.allocator.page_size()
    }

    /// The free list (read-only).
    pub fn allocator(&self) -> &KvSlotAllocator {
        &self.allocator
    }

    /// The recurrent-state slots (read-only).
    pub fn states(&self) -> &StateSlotPool {
        &self.states
    }

    /// The prefix tree (read-only).
    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    /// The cache flavour.
    pub fn cache_type(&self) -> CacheType {
        self.cache_type
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        self.allocator.pages_for(tokens)
    }

    /// Pages that could be handed out right now: free ones plus unlocked cached ones.
    pub fn available_pages(&self) -> usize {
        self.allocator.free_pages() + self.tree.evictable_tokens() / self.page_size()
    }

    /// Longest cached page-aligned prefix of `tokens` and its slots; with [`CacheType::HybridRadix`] cut
    /// back to the deepest node owning a snapshot (`restore` names it). Takes no lock: call
    /// [`KvCache::lock`] before anything can evict. Always empty with [`CacheType::Naive`].
    pub fn match_prefix(&mut self, tokens: &[u32]) -> PrefixMatch {
        let m = match self.cache_type {
            CacheType::Naive => return PrefixMatch { prefix: CachedPrefix::NONE, slots: Vec::new(), kv_len: 0 },
            CacheType::Radix => self.tree.match_prefix(tokens),
            CacheType::HybridRadix => self.tree.match_snapshot(tokens),
        };
        let restore = if self.cache_type == CacheType::HybridRadix { m.state_slot } else { None };
        PrefixMatch {
            prefix: CachedPrefix { node: m.node, len: m.slots.len(), restore },
            slots: m.slots,
            kv_len: m.kv_len,
        }
    }

    /// Pins a matched prefix so eviction cannot take it (and its snapshot, while a restore is pending).
    pub fn lock(&mut self, prefix: CachedPrefix) {
        self.tree.lock(prefix.node);
        if prefix.restore.is_some() {
            self.tree.lock_snapshot(prefix.node);
        }
    }

    /// Releases a pin taken by [`KvCache::lock`].
    pub fn unlock(&mut self, prefix: CachedPrefix) {
        if prefix.restore.is_some() {
            self.tree.unlock_snapshot(prefix.node);
        }
        self.tree.unlock(prefix.node);
    }

    /// The restore of `prefix` has run (the step that copied the snapshot into the live slot is
    /// committed): the snapshot may be evicted again. The prefix's KV stays locked.
    pub fn restored(&mut self, prefix: &mut CachedPrefix) {
        if prefix.restore.take().is_some() {
            self.tree.unlock_snapshot(prefix.node);
        }
    }

    /// Takes `pages` pages (their slots, page by page), evicting least-recently-used cached sequences if
    /// the free list is short. `None` (taking nothing) when even eviction cannot make room.
    pub fn allocate(&mut self, pages: usize) -> Option<Vec<u32>> {
        let free = self.allocator.free_pages();
        if pages > free {
            if pages > self.available_pages() {
                return None;
            }
            self.evict((pages - free) * self.page_size());
        }
        self.allocator.alloc(pages)
    }

    /// Evicts unlocked cached sequences (snapshot-less leaves first, LRU) until `tokens` tokens are freed
    /// or nothing is left to evict; their snapshots go with them. Returns the tokens freed.
    pub fn evict(&mut self, tokens: usize) -> usize {
        let freed = self.tree.evict(tokens);
        self.allocator.free(&freed.kv);
        for s in freed.snapshots {
            self.states.free(s);
        }
        freed.kv.len()
    }

    /// Evicts up to `n` unlocked snapshots (LRU), leaving their nodes as KV-only tombstones. Returns how
    /// many were freed.
    pub fn evict_snapshots(&mut self, n: usize) -> usize {
        let freed = self.tree.evict_snapshots(n);
        for &s in &freed {
            self.states.free(s);
        }
        freed.len()
    }

    /// A live state slot for a request being admitted, `None` when every live slot is taken.
    pub fn alloc_live(&mut self) -> Option<u32> {
        self.states.alloc_live()
    }

    /// A slot to capture a snapshot into, evicting the least recently used unlocked snapshot when the
    /// snapshot cap is reached; `None` when there is no room (every snapshot locked or being captured).
    /// Always `None` unless the cache is [`CacheType::HybridRadix`].
    pub fn alloc_snapshot(&mut self) -> Option<u32> {
        if self.cache_type != CacheType::HybridRadix {
            return None;
        }
        if self.states.snapshot_room() == 0 {
            self.evict_snapshots(1);
        }
        self.states.alloc_snapshot()
    }

    /// Gives back a snapshot slot that was never attached (the capturing step failed or its request ended
    /// while the step was in flight).
    pub fn free_snapshot(&mut self, slot: u32) {
        assert_eq!(self.states.use_of(slot), StateSlotUse::Snapshot, "freeing state slot {slot} as a snapshot");
        self.states.free(slot);
    }

    /// A running request's computed prefix `tokens` (KV written in `slots[..tokens.len()]`) goes into the tree
    /// now, so other requests can resume from it while this one still runs, and the request's lock moves
    /// down to the node ending there: `prefix` becomes it.
    ///
    /// Where the tree already held KV for some of those positions (KV-only nodes past the snapshot the
    /// request resumed from, or cached meanwhile by another request), the tree keeps its own slots and the
    /// request keeps its duplicates for the rest of its life: its page table already points at them, so
    /// nothing is resent (a plan sends `table_from == 0` only in a request's first step). Returns those
    /// duplicate slots; the caller owns them from now on, beside its slots past `prefix.len`, and gives
    /// them back with [`KvCache::free_slots`] when the request ends.
    pub fn cache_prefix(&mut self, tokens: &[u32], slots: &[u32], prefix: &mut CachedPrefix) -> Vec<u32> {
        let g = tokens.len();
        assert!(g > prefix.len && g <= slots.len(), "caching {g} tokens outside the request's computed tokens");
        assert!(prefix.restore.is_none(), "a prefix cached before the restore it continues from has run");
        let (already, node) = self.tree.insert_at(tokens, &slots[..g]);
        debug_assert!(already >= prefix.len, "a locked prefix went missing from the tree");
        // Positions prefix.len..already were in the tree already: ours are duplicates the request keeps.
        let duplicates = slots[prefix.len..already.max(prefix.len)].to_vec();
        self.tree.lock(node);
        self.tree.unlock(prefix.node);
        *prefix = CachedPrefix { node, len: g, restore: None };
        duplicates
    }

    /// A running request's step captured, into `slot`, the state after its first `tokens.len()` tokens
    /// (a whole number of pages, all with KV written: `slots[..tokens.len()]`): the prefix is cached as
    /// [`KvCache::cache_prefix`] does and the snapshot is attached to the node ending there (or freed, if
    /// that node already owns one). Returns the duplicates as `cache_prefix` does. `cold`: an intermediate
    /// chunk end (see [`RadixTree::set_snapshot`]).
    pub fn cache_snapshot(
        &mut self,
        tokens: &[u32],
        slots: &[u32],
        prefix: &mut CachedPrefix,
        slot: u32,
        cold: bool,
    ) -> Vec<u32> {
        assert_eq!(self.cache_type, CacheType::HybridRadix, "snapshots need the hybrid radix cache");
        let duplicates = self.cache_prefix(tokens, slots, prefix);
        if !self.tree.set_snapshot(prefix.node, slot, cold) {
            self.states.free(slot);
        }
        duplicates
    }

    /// Frees KV pages a request owns outside its slots past the prefix (the duplicates
    /// [`KvCache::cache_snapshot`] left it), as it ends.
    pub fn free_slots(&mut self, slots: &[u32]) {
        self.allocator.free(slots);
    }

    /// Ends a request's use of the pool. `slots` are all the slots it holds by position (the first
    /// `prefix.len` are the tree's); `computed` are the tokens whose KV is actually written (a prefix of
    /// the request's tokens, at most `slots.len()` long); `live` its live state slot, if the model has
    /// recurrent state.
    ///
    /// With `insert` and a radix cache, the page-aligned part of `computed` goes into the tree: slots the
    /// tree already had for those positions (cached concurrently by another request) are freed as
    /// duplicates, the rest become the tree's. Everything past the aligned end is freed. Without `insert`
    /// (naive cache, a failed step) all the request's own pages are freed. The prefix lock (and a pending
    /// restore's snapshot lock) is released either way. With [`CacheType::HybridRadix`] and `insert`, a
    /// valid live state is donated as the module docs describe; otherwise the live slot is freed.
    pub fn release(
        &mut self,
        computed: &[u32],
        slots: &[u32],
        prefix: CachedPrefix,
        insert: bool,
        live: Option<LiveState>,
    ) -> Released {
        let ps = self.page_size();
        assert!(computed.len() <= slots.len(), "more computed tokens than KV slots");
        assert!(prefix.len <= computed.len() || !insert, "cached prefix longer than the computed tokens");
        assert!(slots.len().is_multiple_of(ps) && prefix.len.is_multiple_of(ps), "request slots are not whole pages");
        let mut out = Released::default();
        let mut own_from = prefix.len;
        let mut end_node = None;
        if insert && self.cache_type != CacheType::Naive {
            let aligned = computed.len() - computed.len() % ps;
            let (already, node) = self.tree.insert_at(&computed[..aligned], &slots[..aligned]);
            debug_assert!(already >= prefix.len, "a locked prefix went missing from the tree");
            // Positions prefix.len..already were cached by someone else meanwhile: ours are duplicates.
            self.allocator.free(&slots[prefix.len..already]);
            out.taken = aligned - already;
            own_from = aligned;
            if aligned == computed.len() && aligned > 0 {
                end_node = Some(node);
            }
        }
        self.allocator.free(&slots[own_from..]);
        self.unlock(prefix);
        if let Some(LiveState { slot, valid }) = live {
            let donate_to = end_node
                .filter(|&n| valid && self.cache_type == CacheType::HybridRadix && self.tree.state_slot(n).is_none());
            if let Some(node) = donate_to {
                if self.states.snapshot_room() == 0 {
                    self.evict_snapshots(1);
                }
                if self.states.snapshot_room() > 0 {
                    self.states.donate(slot);
                    let attached = self.tree.set_snapshot(node, slot, false);
                    debug_assert!(attached);
                    out.donated = true;
                }
            }
            if !out.donated {
                self.states.free(slot);
            }
        }
        out
    }

    /// Checks the free lists and the tree, and that free pages, tree pages and the request-owned slots
    /// partition the KV pool exactly (no page lost, none owned twice); likewise that free state slots, tree
    /// snapshots, live states and pending captures partition the state slots, each of the right kind.
    pub fn check_integrity(&self, holders: &Holders<'_>) -> Result<(), String> {
        self.allocator.check_integrity()?;
        self.states.check_integrity()?;
        self.tree.check_integrity_with(&holders.locks, &holders.snapshot_locks)?;
        let ps = self.page_size();
        let pages = self.allocator.total_pages();
        let mut owner: Vec<u8> = (0..pages as u32).map(|p| u8::from(self.allocator.is_page_free(p))).collect();
        let mut claim = |slots: &[u32], who: &str| -> Result<(), String> {
            if !slots.len().is_multiple_of(ps) {
                return Err(format!("{who} holds a partial page"));
            }
            for page_slots in slots.chunks(ps) {
                let first = page_slots[0];
                if !(first as usize).is_multiple_of(ps)
                    || page_slots.iter().enumerate().any(|(k, &s)| s != first + k as u32)
                    || first as usize / ps >= pages
                {
                    return Err(format!("{who} holds slots that are not a whole page of the pool at {first}"));
                }
                let page = first as usize / ps;
                if owner[page] != 0 {
                    return Err(format!("KV page {page} is owned twice (second owner: {who})"));
                }
                owner[page] = 1;
            }
            Ok(())
        };
        claim(&self.tree.owned_slots(), "the radix tree")?;
        for s in &holders.kv_slots {
            claim(s, "a request")?;
        }
        if let Some(p) = owner.iter().position(|&o| o == 0) {
            return Err(format!("KV page {p} is neither free, cached nor owned by a request (leaked)"));
        }
        // State slots: each non-free id has exactly one holder of its kind.
        let n = self.states.capacity();
        let mut held = vec![false; n];
        let tree_snaps = self.tree.owned_snapshots();
        let groups: [(&[u32], StateSlotUse, &str); 3] = [
            (&tree_snaps, StateSlotUse::Snapshot, "a tree snapshot"),
            (&holders.pending_snapshots, StateSlotUse::Snapshot, "a pending capture"),
            (&holders.live_states, StateSlotUse::Live, "a live state"),
        ];
        for (ids, kind, who) in groups {
            for &id in ids {
                if id as usize >= n || self.states.use_of(id) != kind {
                    return Err(format!("{who} holds state slot {id}, which the pool does not list as {kind:?}"));
                }
                if std::mem::replace(&mut held[id as usize], true) {
                    return Err(format!("state slot {id} is held twice (second holder: {who})"));
                }
            }
        }
        if let Some(id) = (0..n).find(|&i| !held[i] && self.states.use_of(i as u32) != StateSlotUse::Free) {
            return Err(format!("state slot {id} is in use but nobody holds it (leaked)"));
        }
        Ok(())
    }
}
