//! Free lists for the indices Rust hands out and Python backs with memory.
//!
//! Rust owns every index the worker uses: which KV slots a request writes, which page-table row it lives
//! in, which recurrent-state slot it owns or a snapshot sits in. Python owns the tensors behind them and
//! never decides which index to use. Three allocators cover all of it:
//!
//! * [`KvSlotAllocator`]: the KV pool, handed out a page at a time. Page `p` is the slot ids
//!   `p * page_size .. (p + 1) * page_size`, so a token's slot is `page * page_size + position % page_size`
//!   and the worker's page table stays token-granular (`req_to_token[row, position] -> slot`) whatever the
//!   page size.
//! * [`IdPool`]: a plain free list of small integer ids (page-table rows).
//! * [`StateSlotPool`]: the recurrent-state slots of a hybrid model, each free, the *live* state of a
//!   running request, or a *snapshot* kept by the hybrid radix cache; two capped accounts over one id space.
//!
//! ```text
//!   page_size = 4, capacity = 16 slots = 4 pages
//!   slot:  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
//!   page:     0    |    1    |     2     |      3
//!   a request holding pages [2, 0] for positions 0..6 uses slots [8 9 10 11 0 1]
//! ```
//!
//! All of them detect double frees and foreign ids (a bookkeeping bug) by panicking: silently accepting
//! one would hand the same KV memory or recurrent state to two owners, which corrupts outputs without any
//! error.

/// The KV pool's free pages.
#[derive(Clone, Debug)]
pub struct KvSlotAllocator {
    /// Tokens per page (>= 1).
    page_size: usize,
    /// Free pages, used as a stack (recently freed pages are reused first).
    free_pages: Vec<u32>,
    /// `is_free[page]`: whether the page is in `free_pages` (catches double frees in O(1)).
    is_free: Vec<bool>,
}

impl KvSlotAllocator {
    /// A pool of `capacity_tokens / page_size` whole pages, all free.
    pub fn new(capacity_tokens: usize, page_size: usize) -> Self {
        assert!(page_size >= 1, "page_size must be at least 1");
        let pages = capacity_tokens / page_size;
        assert!(pages * page_size <= u32::MAX as usize + 1, "slot ids must fit u32");
        // Reversed so the first allocations get the lowest page ids (easier to read in logs and tests).
        KvSlotAllocator { page_size, free_pages: (0..pages as u32).rev().collect(), is_free: vec![true; pages] }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.is_free.len()
    }

    /// Slots in the pool (`total_pages * page_size`).
    pub fn capacity_tokens(&self) -> usize {
        self.total_pages() * self.page_size
    }

    /// Pages free right now.
    pub fn free_pages(&self) -> usize {
        self.free_pages.len()
    }

    /// Whether `page` is free.
    pub fn is_page_free(&self, page: u32) -> bool {
        self.is_free[page as usize]
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    /// Takes `n` pages and returns their slots (`n * page_size` slot ids, page by page), or `None` (taking
    /// nothing) when fewer than `n` pages are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free_pages.len() {
            return None;
        }
        let ps = self.page_size as u32;
        let mut slots = Vec::with_capacity(n * self.page_size);
        for _ in 0..n {
            let page = self.free_pages.pop().expect("checked above");
            self.is_free[page as usize] = false;
            slots.extend(page * ps..(page + 1) * ps);
        }
        Some(slots)
    }

    /// Returns whole pages given as their slots (`slots.len()` a multiple of the page size, each page's
    /// slots in order, as [`KvSlotAllocator::alloc`] hands them out).
    ///
    /// Panics on a partial page, a double free or a slot outside the pool: each is a bookkeeping bug.
    pub fn free(&mut self, slots: &[u32]) {
        assert!(
            slots.len().is_multiple_of(self.page_size),
            "freeing {} slots, not a whole number of {}-token pages",
            slots.len(),
            self.page_size
        );
        for page_slots in slots.chunks(self.page_size) {
            let page = self.page_of(page_slots);
            assert!((page as usize) < self.is_free.len(), "slot {} is outside the KV pool", page_slots[0]);
            assert!(!self.is_free[page as usize], "double free of KV page {page} (slot {})", page_slots[0]);
            self.is_free[page as usize] = true;
            self.free_pages.push(page);
        }
    }

    /// The page a run of one page's slots belongs to; panics if the run is not exactly one page.
    pub fn page_of(&self, page_slots: &[u32]) -> u32 {
        let ps = self.page_size as u32;
        let first = page_slots[0];
        assert!(first.is_multiple_of(ps), "slot run starting at {first} is not page-aligned");
        for (k, &s) in page_slots.iter().enumerate() {
            assert!(s == first + k as u32, "slot run starting at {first} is not one contiguous page");
        }
        first / ps
    }

    /// Checks the free stack and the bitmap agree (no page listed twice, every free page listed).
    pub fn check_integrity(&self) -> Result<(), String> {
        let mut seen = vec![false; self.is_free.len()];
        for &p in &self.free_pages {
            let p = p as usize;
            if p >= seen.len() {
                return Err(format!("free list holds page {p} outside the pool"));
            }
            if seen[p] {
                return Err(format!("free list holds page {p} twice"));
            }
            if !self.is_free[p] {
                return Err(format!("page {p} is on the free list but marked used"));
            }
            seen[p] = true;
        }
        let marked = self.is_free.iter().filter(|&&f| f).count();
        if marked != self.free_pages.len() {
            return Err(format!("{marked} pages marked free but {} on the free list", self.free_pages.len()));
        }
        Ok(())
    }
}

/// A free list of the ids `0..n` (page-table rows; the id space under [`StateSlotPool`]).
#[derive(Clone, Debug)]
pub struct IdPool {
    /// Free ids, used as a stack; the lowest ids are handed out first while the pool is fresh.
    free: Vec<u32>,
    /// `in_use[id]`.
    in_use: Vec<bool>,
}

impl IdPool {
    /// The ids `0..n`, all free.
    pub fn new(n: usize) -> Self {
        IdPool { free: (0..n as u32).rev().collect(), in_use: vec![false; n] }
    }

    /// Ids in the pool.
    pub fn capacity(&self) -> usize {
        self.in_use.len()
    }

    /// Ids free right now.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Takes a free id.
    pub fn alloc(&mut self) -> Option<u32> {
        let id = self.free.pop()?;
        self.in_use[id as usize] = true;
        Some(id)
    }

    /// Returns an id; panics on a double free or an id outside the pool (bookkeeping bugs).
    pub fn free(&mut self, id: u32) {
        assert!((id as usize) < self.in_use.len(), "id {id} is outside the pool");
        assert!(self.in_use[id as usize], "double free of id {id}");
        self.in_use[id as usize] = false;
        self.free.push(id);
    }

    /// Whether `id` is handed out.
    pub fn is_in_use(&self, id: u32) -> bool {
        self.in_use[id as usize]
    }

    /// Checks the free stack and the bitmap agree.
    pub fn check_integrity(&self) -> Result<(), String> {
        let mut seen = vec![false; self.in_use.len()];
        for &id in &self.free {
            let i = id as usize;
            if i >= seen.len() || seen[i] || self.in_use[i] {
                return Err(format!("id pool free list is corrupt at id {id}"));
            }
            seen[i] = true;
        }
        if self.in_use.iter().filter(|&&u| !u).count() != self.free.len() {
            return Err("id pool bitmap and free list disagree".into());
        }
        Ok(())
    }
}

/// What one recurrent-state slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateSlotUse {
    /// Nothing: on the free list.
    Free,
    /// The running state of one request (read and written by every step of that request).
    Live,
    /// A frozen state: owned by a radix tree node, or being captured by a step in flight.
    Snapshot,
}

/// The recurrent-state slots of a hybrid (Gated DeltaNet) model: ids `0..live_cap + snapshot_cap`, which
/// the worker backs with one conv + SSM state each.
///
/// ```text
///   live_cap = 2, snapshot_cap = 4: ids 0..6, at most 2 live and at most 4 snapshots at a time
///   id:    0     1     2     3     4     5
///   use:  live  snap  free  live  snap  free      live 2/2, snapshots 2/4
///   request holding 3 finishes, donating it:     live 1/2, snapshots 3/4 (id 3 now a snapshot)
/// ```
///
/// The two kinds are capped *counts* over one id space, not fixed id ranges: a finished request's live
/// slot becomes a tree snapshot in place ([`StateSlotPool::donate`]: donate, not copy), and a free id
/// serves either kind. Because the caps add up to the number of ids, a free id exists whenever either
/// kind is under its cap, so `alloc_live` and `alloc_snapshot` fail only on their own cap.
#[derive(Clone, Debug)]
pub struct StateSlotPool {
    /// The free ids.
    ids: IdPool,
    /// `kind[id]`: what each id holds (`Free` exactly when `ids` lists it as free).
    kind: Vec<StateSlotUse>,
    /// Most live slots at a time (one per running request).
    live_cap: usize,
    /// Most snapshots at a time (FreeToken's `linear_state_cache_ratio` x max running requests by default).
    snapshot_cap: usize,
    /// Ids holding live state now.
    live: usize,
    /// Ids holding snapshots now.
    snapshots: usize,
}

impl StateSlotPool {
    /// `live_cap + snapshot_cap` ids, all free.
    pub fn new(live_cap: usize, snapshot_cap: usize) -> Self {
        let n = live_cap + snapshot_cap;
        assert!(n <= i32::MAX as usize, "state slot ids must fit i32");
        StateSlotPool {
            ids: IdPool::new(n),
            kind: vec![StateSlotUse::Free; n],
            live_cap,
            snapshot_cap,
            live: 0,
            snapshots: 0,
        }
    }

    /// Ids in the pool (what the worker must back).
    pub fn capacity(&self) -> usize {
        self.kind.len()
    }

    /// Most live slots at a time.
    pub fn live_capacity(&self) -> usize {
        self.live_cap
    }

    /// Most snapshots at a time.
    pub fn snapshot_capacity(&self) -> usize {
        self.snapshot_cap
    }

    /// Live slots handed out.
    pub fn live_in_use(&self) -> usize {
        self.live
    }

    /// Snapshots held (in the tree or being captured).
    pub fn snapshots_in_use(&self) -> usize {
        self.snapshots
    }

    /// Live slots that can still be handed out.
    pub fn live_available(&self) -> usize {
        self.live_cap - self.live
    }

    /// Snapshots that can still be taken without evicting one.
    pub fn snapshot_room(&self) -> usize {
        self.snapshot_cap - self.snapshots
    }

    /// Ids on the free list.
    pub fn free_ids(&self) -> usize {
        self.ids.available()
    }

    /// What `id` holds now.
    pub fn use_of(&self, id: u32) -> StateSlotUse {
        self.kind[id as usize]
    }

    fn take(&mut self, kind: StateSlotUse) -> u32 {
        let id = self.ids.alloc().expect("the caps add up to the ids: a free id exists under either cap");
        self.kind[id as usize] = kind;
        id
    }

    /// A slot for a request's live state, `None` at the live cap.
    pub fn alloc_live(&mut self) -> Option<u32> {
        if self.live == self.live_cap {
            return None;
        }
        self.live += 1;
        Some(self.take(StateSlotUse::Live))
    }

    /// A slot for a new snapshot, `None` at the snapshot cap (evict one first).
    pub fn alloc_snapshot(&mut self) -> Option<u32> {
        if self.snapshots == self.snapshot_cap {
            return None;
        }
        self.snapshots += 1;
        Some(self.take(StateSlotUse::Snapshot))
    }

    /// Returns a live slot or a snapshot to the free list. Panics on a free or foreign id.
    pub fn free(&mut self, id: u32) {
        assert!((id as usize) < self.kind.len(), "state slot {id} is outside the pool");
        match self.kind[id as usize] {
            StateSlotUse::Free => panic!("double free of state slot {id}"),
            StateSlotUse::Live => self.live -= 1,
            StateSlotUse::Snapshot => self.snapshots -= 1,
        }
        self.kind[id as usize] = StateSlotUse::Free;
        self.ids.free(id);
    }

    /// Turns live slot `id` into a snapshot in place (a finished request's final state handed to the tree,
    /// no copy). Panics if `id` is not live or the snapshot account is full (evict one first).
    pub fn donate(&mut self, id: u32) {
        assert_eq!(self.kind[id as usize], StateSlotUse::Live, "donating state slot {id} that is not live");
        assert!(self.snapshots < self.snapshot_cap, "donating state slot {id} with no snapshot room");
        self.kind[id as usize] = StateSlotUse::Snapshot;
        self.live -= 1;
        self.snapshots += 1;
    }

    /// Checks the free list, the kinds and the two counts agree, and the counts respect the caps.
    pub fn check_integrity(&self) -> Result<(), String> {
        self.ids.check_integrity()?;
        let mut counts = [0usize; 3];
        for (id, &k) in self.kind.iter().enumerate() {
            if (k == StateSlotUse::Free) == self.ids.is_in_use(id as u32) {
                return Err(format!("state slot {id} is {k:?} but the free list disagrees"));
            }
            counts[k as usize] += 1;
        }
        if counts[StateSlotUse::Live as usize] != self.live || counts[StateSlotUse::Snapshot as usize] != self.snapshots
        {
            return Err(format!(
                "state slot counts: live {} / snapshots {} recorded, {} / {} held",
                self.live,
                self.snapshots,
                counts[StateSlotUse::Live as usize],
                counts[StateSlotUse::Snapshot as usize]
            ));
        }
        if self.live > self.live_cap || self.snapshots > self.snapshot_cap {
            return Err("state slot pool over a cap".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_map_to_contiguous_aligned_slots() {
        let mut a = KvSlotAllocator::new(10, 4); // 2 whole pages; the 2 leftover slots are unused
        assert_eq!(a.total_pages(), 2);
        assert_eq!(a.capacity_tokens(), 8);
        let s = a.alloc(2).unwrap();
        assert_eq!(s, vec![0, 1, 2, 3, 4, 5, 6, 7]);
        assert!(a.alloc(1).is_none());
        a.free(&s[4..]);
        assert_eq!(a.alloc(1).unwrap(), vec![4, 5, 6, 7]);
        a.check_integrity().unwrap();
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = KvSlotAllocator::new(4, 1);
        let s = a.alloc(1).unwrap();
        a.free(&s);
        a.free(&s);
    }

    #[test]
    #[should_panic(expected = "not page-aligned")]
    fn partial_page_free_panics() {
        let mut a = KvSlotAllocator::new(8, 2);
        let s = a.alloc(2).unwrap();
        a.free(&s[1..3]);
    }

    #[test]
    fn id_pool_round_trip() {
        let mut p = IdPool::new(2);
        let a = p.alloc().unwrap();
        let b = p.alloc().unwrap();
        assert_eq!((a, b), (0, 1));
        assert!(p.alloc().is_none());
        p.free(a);
        assert_eq!(p.alloc(), Some(0));
        p.check_integrity().unwrap();
    }

    #[test]
    fn state_pool_caps_and_donation() {
        let mut p = StateSlotPool::new(2, 3);
        assert_eq!(p.capacity(), 5);
        let a = p.alloc_live().unwrap();
        let b = p.alloc_live().unwrap();
        assert!(p.alloc_live().is_none(), "live cap");
        let s: Vec<u32> = (0..3).map(|_| p.alloc_snapshot().unwrap()).collect();
        assert!(p.alloc_snapshot().is_none(), "snapshot cap");
        p.free(s[0]);
        p.donate(a); // a finished request's state becomes a snapshot in place
        assert_eq!((p.live_in_use(), p.snapshots_in_use()), (1, 3));
        assert_eq!(p.use_of(a), StateSlotUse::Snapshot);
        assert_eq!(p.alloc_live(), Some(s[0]), "the freed snapshot id serves a live slot now");
        p.free(b);
        p.check_integrity().unwrap();
    }

    #[test]
    #[should_panic(expected = "double free of state slot")]
    fn state_pool_double_free_panics() {
        let mut p = StateSlotPool::new(1, 1);
        let a = p.alloc_snapshot().unwrap();
        p.free(a);
        p.free(a);
    }

    #[test]
    #[should_panic(expected = "no snapshot room")]
    fn state_pool_donation_needs_room() {
        let mut p = StateSlotPool::new(1, 1);
        let a = p.alloc_live().unwrap();
        p.alloc_snapshot().unwrap();
        p.donate(a);
    }
}
