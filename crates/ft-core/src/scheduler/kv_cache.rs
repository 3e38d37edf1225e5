//! The KV pool's bookkeeping: free pages plus the prefix cache, behind the four moves a request makes.
//!
//! Every KV slot is in exactly one of three places: the free list ([`KvSlotAllocator`]), the radix tree
//! ([`RadixTree`], cached sequences) or a running request (the pages it computed itself). A request's
//! life through this type:
//!
//! ```text
//!   admit:   match_prefix(prompt[..len-1]) ─► lock(node)      cached prefix stays in the tree, locked
//!   steps:   allocate(pages)                                  evicts LRU tree leaves if the free list is short
//!   finish:  release(tokens with KV, slots, prefix, insert)   radix: insert the computed tokens, free the
//!                                                             duplicates and the unaligned tail, unlock;
//!                                                             naive (or failed): free own pages, unlock
//! ```
//!
//! Free + evictable is the currency of admission: an unlocked cached page can be turned into a free page
//! at any time, so the scheduler admits a request only when free + evictable covers everything it may
//! still allocate (its own and every running request's reserved budget).

use crate::allocator::KvSlotAllocator;
use crate::config::CacheType;
use crate::radix::{NodeId, RadixTree};

/// A request's cached prefix: where its match ends in the tree and how long it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedPrefix {
    /// Node the match ends at (`NodeId::ROOT` when nothing matched); locked while the request runs.
    pub node: NodeId,
    /// Cached tokens (a multiple of the page size). The request's first `len` slots belong to the tree.
    pub len: usize,
}

/// KV slot allocator plus radix prefix cache.
#[derive(Clone, Debug)]
pub struct KvCache {
    /// Free pages of the pool.
    allocator: KvSlotAllocator,
    /// Cached sequences (never consulted with [`CacheType::Naive`]).
    tree: RadixTree,
    /// Whether finished sequences are cached and matched.
    cache_type: CacheType,
}

impl KvCache {
    /// A pool of `capacity_tokens` slots (whole pages of `page_size`), all free, with an empty cache.
    pub fn new(capacity_tokens: usize, page_size: usize, cache_type: CacheType) -> Self {
        KvCache {
            allocator: KvSlotAllocator::new(capacity_tokens, page_size),
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

    /// The prefix tree (read-only).
    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        self.allocator.pages_for(tokens)
    }

    /// Pages that could be handed out right now: free ones plus unlocked cached ones.
    pub fn available_pages(&self) -> usize {
        self.allocator.free_pages() + self.tree.evictable_tokens() / self.page_size()
    }

    /// Longest cached page-aligned prefix of `tokens` and its slots. Takes no lock: call
    /// [`KvCache::lock`] before anything can evict. Always empty with [`CacheType::Naive`].
    pub fn match_prefix(&mut self, tokens: &[u32]) -> (CachedPrefix, Vec<u32>) {
        if self.cache_type == CacheType::Naive {
            return (CachedPrefix { node: NodeId::ROOT, len: 0 }, Vec::new());
        }
        let m = self.tree.match_prefix(tokens);
        (CachedPrefix { node: m.node, len: m.slots.len() }, m.slots)
    }

    /// Pins a matched prefix so eviction cannot take it.
    pub fn lock(&mut self, prefix: CachedPrefix) {
        self.tree.lock(prefix.node);
    }

    /// Releases a pin taken by [`KvCache::lock`].
    pub fn unlock(&mut self, prefix: CachedPrefix) {
        self.tree.unlock(prefix.node);
    }

    /// Takes `pages` pages (their slots, page by page), evicting least-recently-used cached sequences if
    /// the free list is short. `None` (taking nothing) when even eviction cannot make room.
    pub fn allocate(&mut self, pages: usize) -> Option<Vec<u32>> {
        let free = self.allocator.free_pages();
        if pages > free {
            if pages > self.available_pages() {
                return None;
            }
            let freed = self.tree.evict((pages - free) * self.page_size());
            self.allocator.free(&freed);
        }
        self.allocator.alloc(pages)
    }

    /// Evicts unlocked cached sequences (LRU) until `tokens` tokens are freed or nothing is left to evict;
    /// returns the tokens freed.
    pub fn evict(&mut self, tokens: usize) -> usize {
        let freed = self.tree.evict(tokens);
        self.allocator.free(&freed);
        freed.len()
    }

    /// Ends a request's use of the pool. `slots` are all the slots it holds by position (the first
    /// `prefix.len` are the tree's); `computed` are the tokens whose KV is actually written (a prefix of
    /// the request's tokens, at most `slots.len()` long).
    ///
    /// With `insert` and a radix cache, the page-aligned part of `computed` goes into the tree: slots the
    /// tree already had for those positions (cached concurrently by another request) are freed as
    /// duplicates, the rest become the tree's. Everything past the aligned end is freed. Without `insert`
    /// (naive cache, a failed step) all the request's own pages are freed. The prefix lock is released
    /// either way. Returns how many tokens the tree newly took over.
    pub fn release(&mut self, computed: &[u32], slots: &[u32], prefix: CachedPrefix, insert: bool) -> usize {
        let ps = self.page_size();
        assert!(computed.len() <= slots.len(), "more computed tokens than KV slots");
        assert!(prefix.len <= computed.len() || !insert, "cached prefix longer than the computed tokens");
        assert!(slots.len().is_multiple_of(ps) && prefix.len.is_multiple_of(ps), "request slots are not whole pages");
        let mut taken = 0;
        let mut own_from = prefix.len;
        if insert && self.cache_type == CacheType::Radix {
            let aligned = computed.len() - computed.len() % ps;
            let already = self.tree.insert(&computed[..aligned], &slots[..aligned]);
            debug_assert!(already >= prefix.len, "a locked prefix went missing from the tree");
            // Positions prefix.len..already were cached by someone else meanwhile: ours are duplicates.
            self.allocator.free(&slots[prefix.len..already]);
            taken = aligned - already;
            own_from = aligned;
        }
        self.allocator.free(&slots[own_from..]);
        self.tree.unlock(prefix.node);
        taken
    }

    /// Checks the free list and the tree, and that free pages, tree pages and the given request-owned
    /// slots partition the pool exactly (no page lost, none owned twice). `request_slots` are the slots
    /// each request owns itself (past its cached prefix); `live_locks` the node each request locked.
    pub fn check_integrity<'a>(
        &self,
        request_slots: impl IntoIterator<Item = &'a [u32]>,
        live_locks: &[NodeId],
    ) -> Result<(), String> {
        self.allocator.check_integrity()?;
        self.tree.check_integrity(live_locks)?;
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
        for s in request_slots {
            claim(s, "a request")?;
        }
        if let Some(p) = owner.iter().position(|&o| o == 0) {
            return Err(format!("KV page {p} is neither free, cached nor owned by a request (leaked)"));
        }
        Ok(())
    }
}
