//! The radix prefix cache: a tree over token ids whose edges carry the KV slots of those tokens.
//!
//! Why: chat clients resend the whole conversation every turn, agents resend the same system prompt and
//! tool list on every call. Keeping finished sequences' KV in a tree keyed by token ids lets a new prompt
//! skip every token of its longest cached prefix (SGLang `RadixCache`, TGI `radix.rs`).
//!
//! What it is: a compressed trie. Each node owns an edge (`key`: token ids, `value`: their KV slots, same
//! length); a path from the root spells a cached sequence and the concatenated values are that sequence's
//! KV slots. With `page_size > 1` every key is a whole number of pages and children are told apart by
//! their first page, so a match or an insert never ends inside a page.
//!
//! ```text
//!   cached: "the cat sat" and "the cat ran"          match "the dog" splits the shared edge:
//!
//!        (root)                                           (root)
//!          │ "the cat "                                     │ "the "         <- new parent, same locks
//!        [A]                                              [M]                   and last access as A,
//!        ╱    ╲                                          ╱    ╲                 no state snapshot
//!   "sat"      "ran"                             "cat "[A]     (match ends at M: 4 tokens cached)
//!                                                    ╱   ╲
//!                                               "sat"     "ran"
//! ```
//!
//! The tree owns the slots in its values. A request that reuses a prefix *locks* the node where its
//! match ends: the lock count of that node and every ancestor goes up by one, and only nodes with no
//! locks can be evicted, so a prefix in use is never freed under a running request. Eviction takes
//! unlocked leaves in least-recently-used order (a `BTreeSet` of `(last_access, node)`), which may turn
//! their parents into evictable leaves in turn. Node ids stay valid while a node is locked; an unlocked
//! node may be evicted and its id reused.
//!
//! The tree only moves slots in and out of itself ([`RadixTree::insert`] reports how much of a sequence
//! was already cached, [`RadixTree::evict`] returns the slots it dropped); the caller owns the free lists
//! (see [`crate::scheduler::kv_cache::KvCache`]).
//!
//! **Recurrent-state snapshots (the hybrid radix cache).** A Gated DeltaNet layer's state is a point value
//! after some number of tokens; it cannot be cut back like KV. So for a hybrid model a cached prefix is only
//! usable where the state after exactly that prefix was kept: a node may own a *snapshot* (a recurrent-state
//! slot id holding the state after the node's last token). A node without one is KV-only (a split parent,
//! or a *tombstone* whose snapshot was evicted: its KV stays, its descendants may still need it).
//!
//! ```text
//!   (root)
//!     │ system prompt, 0..960                 match "system + question 2 ..." walks root → A → B? no:
//!    [A] ● snapshot (state after 960 tokens)     B's edge diverges; the deepest node on the walked path
//!     │ turn 1, 960..2011                        that owns a snapshot is A: the match is cut back to A
//!    [B] ● snapshot (donated at finish)          (960 cached tokens, restore A's snapshot), not to the
//!     │ turn 2, 2011..3100                       longest KV match. [C] is a tombstone: KV-only.
//!    [C] ○ tombstone
//! ```
//!
//! Two currencies, two LRUs: KV tokens (unlocked leaves, [`RadixTree::evict`]) and snapshots (unlocked
//! snapshots, [`RadixTree::evict_snapshots`]). Evicting a snapshot only tombstones its node. Evicting a
//! leaf's KV frees its snapshot with it, so the KV a snapshot needs (its node's and every ancestor's
//! edge: positions `< depth`) is never freed under it. KV eviction takes leaves without a snapshot first
//! (their KV can never be resumed from: a hybrid match ends at a snapshot), then leaves with one, each
//! group least recently used first. A request restoring from a snapshot holds a *snapshot lock* on that
//! node (beside its ordinary lock on the same node, so `lock_ref >= snap_lock` everywhere) until the copy
//! into its live slot has run; a snapshot lock only protects the node's own snapshot, not its ancestors'.
//!
//! Only what a match consumes is refreshed: a hybrid match stamps the KV nodes up to the snapshot it cut
//! back to and that one snapshot (not the shallower snapshots on the path: the newest snapshot of a
//! conversation stays, its intermediate ones age out first), and never splits an edge (the cut is always
//! at a node's end, so no state-less split parent is ever created by a lookup). Snapshots taken at the
//! intermediate chunk ends of a long prefill enter the snapshot LRU *cold* (evicted before every warm
//! snapshot) until a match restores from one.

use std::collections::{BTreeSet, HashMap};

mod integrity;

/// A node of the [`RadixTree`] (an index into its arena).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(u32);

impl NodeId {
    /// The root: the empty prefix. Locking or unlocking it does nothing.
    pub const ROOT: NodeId = NodeId(0);

    fn idx(self) -> usize {
        self.0 as usize
    }
}

/// One edge of the tree and the node it leads to.
#[derive(Clone, Debug)]
struct Node {
    /// Token ids of this edge (a whole number of pages; empty only for the root).
    key: Vec<u32>,
    /// KV slots of those tokens, `value[i]` holding the K/V of `key[i]` at its position in the sequence.
    value: Vec<u32>,
    /// `None` only for the root (and for free arena entries).
    parent: Option<NodeId>,
    /// Children by the first page of their key.
    children: HashMap<Box<[u32]>, NodeId>,
    /// Live locks on this node or any descendant (requests reading this prefix). 0 = evictable.
    lock_ref: u32,
    /// Logical clock of the last match or insert that walked through this node (LRU order).
    last_access: u64,
    /// The hybrid radix cache's recurrent-state snapshot: the state slot holding the Gated DeltaNet state
    /// after this node's last token. `None`: KV only (a split parent, a plain radix node, or a tombstone
    /// whose snapshot was evicted). Split parents get `None`, as in SGLang's `MambaRadixCache`.
    state_slot: Option<u32>,
    /// Requests about to restore from this node's snapshot (their copy has not run yet). A locked
    /// snapshot is never evicted. Each such request also holds a lock on this node: `lock_ref >= snap_lock`.
    snap_lock: u32,
    /// The snapshot's place in the snapshot LRU order: `WARM | clock` of when it was taken or last restored
    /// from, or, for a cold snapshot never restored from, a number below every warm stamp (see
    /// [`RadixTree::set_snapshot`]).
    snap_access: u64,
    /// Whether this arena entry is a node of the tree (false: on the free list).
    live: bool,
}

impl Node {
    fn empty() -> Self {
        Node {
            key: Vec::new(),
            value: Vec::new(),
            parent: None,
            children: HashMap::new(),
            lock_ref: 0,
            last_access: 0,
            state_slot: None,
            snap_lock: 0,
            snap_access: 0,
            live: false,
        }
    }
}

/// What [`RadixTree::match_prefix`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeMatch {
    /// The node where the match ends (`NodeId::ROOT` for no match); lock it to keep the prefix.
    pub node: NodeId,
    /// KV slots of the matched prefix; its length is the number of cached tokens (a multiple of the page
    /// size).
    pub slots: Vec<u32>,
    /// The snapshot at `node` ([`RadixTree::match_snapshot`] always ends at one unless nothing matched).
    pub state_slot: Option<u32>,
    /// Longest cached KV prefix of the key (whole pages, `>= slots.len()`). Longer than the match only for
    /// [`RadixTree::match_snapshot`]: the tree holds KV past the last snapshot, and where that KV stops
    /// matching, another cached sequence branched off: a branch point worth a snapshot.
    pub kv_len: usize,
}

/// What [`RadixTree::evict`] dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Evicted {
    /// KV slots of the evicted nodes (whole pages).
    pub kv: Vec<u32>,
    /// Snapshot slots the evicted nodes owned (a snapshot goes with its node's KV).
    pub snapshots: Vec<u32>,
}

/// Order of the KV eviction candidates: leaves without a snapshot first, then least recently used.
type LeafKey = (bool, u64, NodeId);

/// Set on every warm snapshot stamp, so cold snapshots (below it) are evicted before every warm one.
const WARM: u64 = 1 << 63;

/// Radix tree over token ids with KV slot values, locks and LRU eviction.
#[derive(Clone, Debug)]
pub struct RadixTree {
    /// Node arena; index 0 is the root.
    nodes: Vec<Node>,
    /// Free arena indices (evicted nodes), reused by new nodes.
    free_nodes: Vec<u32>,
    /// Tokens per page: keys, matches and splits are whole pages.
    page_size: usize,
    /// Logical clock stamped on nodes a match or insert walks through.
    clock: u64,
    /// Unlocked leaves (not the root) as `(has a snapshot, last access, id)`: the KV eviction order
    /// (snapshot-less leaves first, each group least recently used first).
    evictable_leaves: BTreeSet<LeafKey>,
    /// Snapshots with no snapshot lock as `(snap_access, id)`: the snapshot eviction order.
    evictable_snapshots: BTreeSet<(u64, NodeId)>,
    /// Tokens held by all nodes.
    total_tokens: usize,
    /// Tokens held by nodes with no lock (all of them can be evicted, leaves first).
    evictable_tokens: usize,
    /// Nodes owning a snapshot.
    num_snapshots: usize,
    /// Stamps of cold snapshots, in the order they were taken (all below [`WARM`]).
    cold_clock: u64,
}

impl RadixTree {
    /// An empty tree whose keys are whole pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        assert!(page_size >= 1);
        let mut root = Node::empty();
        root.live = true;
        RadixTree {
            nodes: vec![root],
            free_nodes: Vec::new(),
            page_size,
            clock: 0,
            evictable_leaves: BTreeSet::new(),
            evictable_snapshots: BTreeSet::new(),
            total_tokens: 0,
            evictable_tokens: 0,
            num_snapshots: 0,
            cold_clock: 0,
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Tokens cached in the tree.
    pub fn total_tokens(&self) -> usize {
        self.total_tokens
    }

    /// Cached tokens no request has locked (what eviction can free).
    pub fn evictable_tokens(&self) -> usize {
        self.evictable_tokens
    }

    /// Cached tokens locked by running requests.
    pub fn protected_tokens(&self) -> usize {
        self.total_tokens - self.evictable_tokens
    }

    /// Nodes in the tree, root excluded.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - 1 - self.free_nodes.len()
    }

    /// Live locks on `node` and its descendants (0 for an evicted id).
    pub fn lock_ref(&self, node: NodeId) -> u32 {
        self.nodes.get(node.idx()).filter(|n| n.live).map_or(0, |n| n.lock_ref)
    }

    /// The recurrent-state snapshot slot owned by `node` (`None`: KV only, or an evicted id).
    pub fn state_slot(&self, node: NodeId) -> Option<u32> {
        self.nodes.get(node.idx()).filter(|n| n.live).and_then(|n| n.state_slot)
    }

    /// Snapshot locks on `node` (0 for an evicted id).
    pub fn snap_lock(&self, node: NodeId) -> u32 {
        self.nodes.get(node.idx()).filter(|n| n.live).map_or(0, |n| n.snap_lock)
    }

    /// Nodes owning a snapshot.
    pub fn num_snapshots(&self) -> usize {
        self.num_snapshots
    }

    /// Snapshots no request is about to restore from (what [`RadixTree::evict_snapshots`] can free).
    pub fn evictable_snapshots(&self) -> usize {
        self.evictable_snapshots.len()
    }

    /// Tokens from the root to the end of `node` (0 for the root). O(depth in nodes).
    pub fn depth(&self, node: NodeId) -> usize {
        let mut len = 0;
        let mut cur = node;
        while cur != NodeId::ROOT {
            len += self.nodes[cur.idx()].key.len();
            cur = self.nodes[cur.idx()].parent.expect("non-root node has a parent");
        }
        len
    }

    /// Length of the longest page-aligned prefix of `key`, rounding down.
    fn aligned(&self, len: usize) -> usize {
        len - len % self.page_size
    }

    /// Length of the common prefix of `a` and `b`, in whole pages (as tokens).
    fn common_pages(&self, a: &[u32], b: &[u32]) -> usize {
        let n = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        self.aligned(n)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// `id`'s place in the KV eviction order (meaningful while it is an unlocked leaf).
    fn leaf_key(&self, id: NodeId) -> LeafKey {
        let n = &self.nodes[id.idx()];
        (n.state_slot.is_some(), n.last_access, id)
    }

    /// Stamps `id` with `now`, keeping its place in the eviction order.
    fn touch(&mut self, id: NodeId, now: u64) {
        let listed = self.evictable_leaves.remove(&self.leaf_key(id));
        self.nodes[id.idx()].last_access = now;
        if listed {
            self.evictable_leaves.insert(self.leaf_key(id));
        }
    }

    /// Stamps `id`'s snapshot with `now`, keeping its place in the snapshot eviction order.
    fn touch_snapshot(&mut self, id: NodeId, now: u64) {
        let old = self.nodes[id.idx()].snap_access;
        if self.evictable_snapshots.remove(&(old, id)) {
            self.evictable_snapshots.insert((WARM | now, id));
        }
        self.nodes[id.idx()].snap_access = WARM | now;
    }

    fn is_evictable_leaf(&self, id: NodeId) -> bool {
        let n = &self.nodes[id.idx()];
        id != NodeId::ROOT && n.live && n.lock_ref == 0 && n.children.is_empty()
    }

    fn new_node(&mut self, node: Node) -> NodeId {
        if let Some(i) = self.free_nodes.pop() {
            self.nodes[i as usize] = node;
            NodeId(i)
        } else {
            self.nodes.push(node);
            NodeId(self.nodes.len() as u32 - 1)
        }
    }

    /// Splits `child`'s edge after `at` tokens (a page multiple, `0 < at < key.len()`): a new parent takes
    /// the first `at` tokens, `child` keeps the rest (and its snapshot: the state after its last token).
    /// Returns the new parent, which owns no snapshot. Counts and the eviction orders do not change (the
    /// new node is an inner node with the same locks as `child`).
    fn split(&mut self, child: NodeId, at: usize) -> NodeId {
        let ps = self.page_size;
        let c = &mut self.nodes[child.idx()];
        debug_assert!(at > 0 && at < c.key.len() && at.is_multiple_of(ps));
        let parent = c.parent.expect("the root is never split");
        let tail_key = c.key.split_off(at);
        let tail_value = c.value.split_off(at);
        let head_key = std::mem::replace(&mut c.key, tail_key);
        let head_value = std::mem::replace(&mut c.value, tail_value);
        let (lock_ref, last_access) = (c.lock_ref, c.last_access);
        let child_first: Box<[u32]> = c.key[..ps].into();
        let head_first: Box<[u32]> = head_key[..ps].into();
        let mut children = HashMap::new();
        children.insert(child_first, child);
        let mid = self.new_node(Node {
            key: head_key,
            value: head_value,
            parent: Some(parent),
            children,
            lock_ref,
            last_access,
            state_slot: None,
            snap_lock: 0,
            snap_access: 0,
            live: true,
        });
        self.nodes[child.idx()].parent = Some(mid);
        self.nodes[parent.idx()].children.insert(head_first, mid);
        mid
    }

    /// Longest cached prefix of `key` (rounded down to whole pages). Splits an edge when the match ends
    /// inside it, so the returned node ends exactly at the match, and refreshes the LRU stamp of every
    /// node on the path.
    pub fn match_prefix(&mut self, key: &[u32]) -> TreeMatch {
        let now = self.tick();
        let ps = self.page_size;
        let key = &key[..self.aligned(key.len())];
        let mut node = NodeId::ROOT;
        let mut pos = 0;
        let mut slots = Vec::new();
        while pos < key.len() {
            let Some(&child) = self.nodes[node.idx()].children.get(&key[pos..pos + ps]) else { break };
            let common = self.common_pages(&self.nodes[child.idx()].key, &key[pos..]);
            debug_assert!(common >= ps);
            let child = if common < self.nodes[child.idx()].key.len() { self.split(child, common) } else { child };
            self.touch(child, now);
            slots.extend_from_slice(&self.nodes[child.idx()].value);
            pos += common;
            node = child;
        }
        let state_slot = self.nodes[node.idx()].state_slot;
        TreeMatch { node, kv_len: slots.len(), slots, state_slot }
    }

    /// The hybrid radix cache's match: the longest cached prefix of `key` (whole pages) *cut back to the
    /// deepest node on its path that owns a snapshot*, since a hybrid model can only resume where the
    /// recurrent state after exactly that prefix was kept. Never splits an edge (the cut is at a node's
    /// end); refreshes the KV LRU stamps of the nodes up to the cut and the snapshot LRU stamp of the one
    /// snapshot it returns, nothing past the cut. No snapshot on the path: an empty match at the root.
    pub fn match_snapshot(&mut self, key: &[u32]) -> TreeMatch {
        let ps = self.page_size;
        let key = &key[..self.aligned(key.len())];
        let mut node = NodeId::ROOT;
        let mut pos = 0;
        let mut path = Vec::new();
        let mut best = 0;
        let mut kv_extra = 0;
        while pos < key.len() {
            let Some(&child) = self.nodes[node.idx()].children.get(&key[pos..pos + ps]) else { break };
            let edge = &self.nodes[child.idx()].key;
            if pos + edge.len() > key.len() || key[pos..pos + edge.len()] != edge[..] {
                // The key leaves (or ends inside) this edge: no node ends inside the key here.
                kv_extra = self.common_pages(edge, &key[pos..]);
                break;
            }
            pos += edge.len();
            node = child;
            path.push(child);
            if self.nodes[child.idx()].state_slot.is_some() {
                best = path.len();
            }
        }
        let now = self.tick();
        path.truncate(best);
        let mut slots = Vec::new();
        for &id in &path {
            self.touch(id, now);
            slots.extend_from_slice(&self.nodes[id.idx()].value);
        }
        let node = path.last().copied().unwrap_or(NodeId::ROOT);
        if node != NodeId::ROOT {
            self.touch_snapshot(node, now);
        }
        TreeMatch { node, slots, state_slot: self.nodes[node.idx()].state_slot, kv_len: pos + kv_extra }
    }

    /// Caches `key` with KV slots `value` (same length, a whole number of pages). Returns how many leading
    /// tokens of `key` were already cached: the tree keeps its own slots for those, so the caller still
    /// owns `value[..returned]` (and frees the ones that are not the tree's). The tree takes ownership of
    /// `value[returned..]`.
    pub fn insert(&mut self, key: &[u32], value: &[u32]) -> usize {
        self.insert_at(key, value).0
    }

    /// [`RadixTree::insert`] that also returns the node ending exactly at the end of `key` (splitting an
    /// edge if `key` ends inside it; the root for an empty key), where a snapshot of the state after `key`
    /// can be attached.
    pub fn insert_at(&mut self, key: &[u32], value: &[u32]) -> (usize, NodeId) {
        assert_eq!(key.len(), value.len(), "radix insert: key and value lengths differ");
        assert!(key.len().is_multiple_of(self.page_size), "radix insert: key is not a whole number of pages");
        let now = self.tick();
        let ps = self.page_size;
        let mut node = NodeId::ROOT;
        let mut pos = 0;
        while pos < key.len() {
            let Some(&child) = self.nodes[node.idx()].children.get(&key[pos..pos + ps]) else { break };
            let child_len = self.nodes[child.idx()].key.len();
            let common = self.common_pages(&self.nodes[child.idx()].key, &key[pos..]);
            // Split where the key leaves the edge (or ends inside it, as SGLang does): the nodes this
            // insert walks through are then exactly the ones it refreshes in the LRU order.
            let child = if common < child_len { self.split(child, common) } else { child };
            self.touch(child, now);
            pos += common;
            node = child;
        }
        if pos < key.len() {
            let len = key.len() - pos;
            // The parent stops being a leaf: it leaves the eviction order if it was in it.
            self.evictable_leaves.remove(&self.leaf_key(node));
            let leaf = self.new_node(Node {
                key: key[pos..].to_vec(),
                value: value[pos..].to_vec(),
                parent: Some(node),
                children: HashMap::new(),
                lock_ref: 0,
                last_access: now,
                state_slot: None,
                snap_lock: 0,
                snap_access: 0,
                live: true,
            });
            self.nodes[node.idx()].children.insert(key[pos..pos + ps].into(), leaf);
            self.evictable_leaves.insert(self.leaf_key(leaf));
            self.total_tokens += len;
            self.evictable_tokens += len;
            return (pos, leaf);
        }
        (pos, node)
    }

    /// Gives `node` the snapshot in state slot `slot` (the state after the node's last token; the tree
    /// owns the slot from now on). Returns false, taking nothing, if the node already owns one (the caller
    /// keeps and frees its duplicate). Panics on the root or an evicted node.
    ///
    /// A *warm* snapshot enters the snapshot LRU as the most recently used. A *cold* one (an intermediate
    /// state of a long prefill, superseded by a deeper snapshot of the same sequence) enters below every
    /// warm snapshot, cold ones in the order they were taken, until a match restores from it (which makes
    /// it warm): chunk ends of a long prompt go before the end of another conversation's last answer.
    pub fn set_snapshot(&mut self, node: NodeId, slot: u32, cold: bool) -> bool {
        assert!(node != NodeId::ROOT && self.nodes[node.idx()].live, "snapshot on the root or an evicted node");
        if self.nodes[node.idx()].state_slot.is_some() {
            return false;
        }
        debug_assert_eq!(self.nodes[node.idx()].snap_lock, 0);
        let now = if cold {
            self.cold_clock += 1;
            self.cold_clock
        } else {
            WARM | self.tick()
        };
        let listed = self.evictable_leaves.remove(&self.leaf_key(node));
        let n = &mut self.nodes[node.idx()];
        n.state_slot = Some(slot);
        n.snap_access = now;
        if listed {
            self.evictable_leaves.insert(self.leaf_key(node));
        }
        self.evictable_snapshots.insert((now, node));
        self.num_snapshots += 1;
        true
    }

    /// Adds a snapshot lock on `node` (a request will restore from its snapshot): it cannot be evicted
    /// until [`RadixTree::unlock_snapshot`]. The caller must hold a [`RadixTree::lock`] on the same node
    /// (`lock_ref >= snap_lock`), which also keeps the KV the snapshot needs.
    pub fn lock_snapshot(&mut self, node: NodeId) {
        let n = &mut self.nodes[node.idx()];
        assert!(n.live && n.state_slot.is_some(), "snapshot lock on a node without a snapshot");
        assert!(n.lock_ref > n.snap_lock, "snapshot lock without a lock on the node (full_lock >= snapshot_lock)");
        n.snap_lock += 1;
        if n.snap_lock == 1 {
            let stamp = (n.snap_access, node);
            self.evictable_snapshots.remove(&stamp);
        }
    }

    /// Drops one snapshot lock taken by [`RadixTree::lock_snapshot`].
    pub fn unlock_snapshot(&mut self, node: NodeId) {
        let n = &mut self.nodes[node.idx()];
        assert!(n.live && n.snap_lock > 0, "unlocking a snapshot that holds no snapshot lock");
        n.snap_lock -= 1;
        if n.snap_lock == 0 {
            let stamp = (n.snap_access, node);
            self.evictable_snapshots.insert(stamp);
        }
    }

    /// Evicts least-recently-used unlocked snapshots until `n` are freed or none is left; returns their
    /// slots. Their nodes stay as KV-only tombstones (descendants may still need the KV).
    pub fn evict_snapshots(&mut self, n: usize) -> Vec<u32> {
        let mut freed = Vec::new();
        while freed.len() < n {
            let Some((_, id)) = self.evictable_snapshots.pop_first() else { break };
            let listed = self.evictable_leaves.remove(&self.leaf_key(id));
            let slot = self.nodes[id.idx()].state_slot.take().expect("listed snapshots exist");
            debug_assert_eq!(self.nodes[id.idx()].snap_lock, 0);
            if listed {
                self.evictable_leaves.insert(self.leaf_key(id));
            }
            self.num_snapshots -= 1;
            freed.push(slot);
        }
        freed
    }

    /// Adds one lock on `node` (and so on its whole path): nothing on it can be evicted until
    /// [`RadixTree::unlock`].
    pub fn lock(&mut self, node: NodeId) {
        let mut cur = node;
        while cur != NodeId::ROOT {
            let n = &mut self.nodes[cur.idx()];
            assert!(n.live, "locking an evicted radix node");
            n.lock_ref += 1;
            if n.lock_ref == 1 {
                self.evictable_tokens -= n.key.len();
                let stamp = (n.state_slot.is_some(), n.last_access, cur);
                self.evictable_leaves.remove(&stamp);
            }
            cur = self.nodes[cur.idx()].parent.expect("non-root node has a parent");
        }
    }

    /// Drops one lock taken by [`RadixTree::lock`] on the same node.
    pub fn unlock(&mut self, node: NodeId) {
        let mut cur = node;
        while cur != NodeId::ROOT {
            let n = &mut self.nodes[cur.idx()];
            assert!(n.live && n.lock_ref > 0, "unlocking a radix node that holds no lock");
            n.lock_ref -= 1;
            assert!(
                n.lock_ref >= n.snap_lock,
                "unlocking a node below its snapshot locks (full_lock >= snapshot_lock)"
            );
            if n.lock_ref == 0 {
                self.evictable_tokens += n.key.len();
                if n.children.is_empty() {
                    let stamp = (n.state_slot.is_some(), n.last_access, cur);
                    self.evictable_leaves.insert(stamp);
                }
            }
            cur = self.nodes[cur.idx()].parent.expect("non-root node has a parent");
        }
    }

    /// Evicts unlocked leaves until at least `tokens` tokens are freed or nothing is evictable: leaves
    /// without a snapshot first, then leaves with one, least recently used first within each group. A
    /// leaf's snapshot goes with it. Returns the freed KV slots (whole pages; possibly more than asked, a
    /// node goes whole) and snapshot slots.
    pub fn evict(&mut self, tokens: usize) -> Evicted {
        let mut out = Evicted::default();
        while out.kv.len() < tokens {
            let Some((_, _, id)) = self.evictable_leaves.pop_first() else { break };
            let n = std::mem::replace(&mut self.nodes[id.idx()], Node::empty());
            debug_assert!(n.lock_ref == 0 && n.snap_lock == 0 && n.children.is_empty());
            let parent = n.parent.expect("the root is never evicted");
            self.nodes[parent.idx()].children.remove(&n.key[..self.page_size]);
            self.free_nodes.push(id.0);
            self.total_tokens -= n.key.len();
            self.evictable_tokens -= n.key.len();
            out.kv.extend_from_slice(&n.value);
            if let Some(slot) = n.state_slot {
                self.evictable_snapshots.remove(&(n.snap_access, id));
                self.num_snapshots -= 1;
                out.snapshots.push(slot);
            }
            if self.is_evictable_leaf(parent) {
                self.evictable_leaves.insert(self.leaf_key(parent));
            }
        }
        out
    }

    /// Every slot the tree owns.
    pub fn owned_slots(&self) -> Vec<u32> {
        self.nodes.iter().filter(|n| n.live).flat_map(|n| n.value.iter().copied()).collect()
    }

    /// Every snapshot slot the tree owns.
    pub fn owned_snapshots(&self) -> Vec<u32> {
        self.nodes.iter().filter(|n| n.live).filter_map(|n| n.state_slot).collect()
    }

    /// Every snapshot with the tokens it is the state after: `(tokens from the root, slot, snap_lock)`.
    /// Meant for tests and debugging (it copies whole paths).
    pub fn cached_snapshots(&self) -> Vec<(Vec<u32>, u32, u32)> {
        let mut out = Vec::new();
        let mut stack = vec![(NodeId::ROOT, Vec::new())];
        while let Some((id, key)) = stack.pop() {
            for &c in self.nodes[id.idx()].children.values() {
                let mut k = key.clone();
                k.extend_from_slice(&self.nodes[c.idx()].key);
                if let Some(slot) = self.nodes[c.idx()].state_slot {
                    out.push((k.clone(), slot, self.nodes[c.idx()].snap_lock));
                }
                stack.push((c, k));
            }
        }
        out
    }

    /// Every cached sequence that ends at a node, with its slots: `(tokens from the root, slots)` per
    /// node, root excluded. Meant for tests and debugging (it copies whole paths).
    pub fn cached_sequences(&self) -> Vec<(Vec<u32>, Vec<u32>)> {
        let mut out = Vec::new();
        let mut stack = vec![(NodeId::ROOT, Vec::new(), Vec::new())];
        while let Some((id, key, value)) = stack.pop() {
            for &c in self.nodes[id.idx()].children.values() {
                let mut k = key.clone();
                let mut v = value.clone();
                k.extend_from_slice(&self.nodes[c.idx()].key);
                v.extend_from_slice(&self.nodes[c.idx()].value);
                out.push((k.clone(), v.clone()));
                stack.push((c, k, v));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_on_match_keeps_slots_and_locks() {
        let mut t = RadixTree::new(1);
        assert_eq!(t.insert(&[1, 2, 3, 4], &[10, 11, 12, 13]), 0);
        let m = t.match_prefix(&[1, 2, 9]);
        assert_eq!(m.slots, vec![10, 11]);
        assert_eq!(t.num_nodes(), 2, "the edge [1 2 3 4] was split into [1 2] + [3 4]");
        t.lock(m.node);
        assert_eq!(t.evictable_tokens(), 2);
        assert_eq!(t.evict(100).kv, vec![12, 13], "only the unlocked tail can go");
        t.check_integrity(&[m.node]).unwrap();
        t.unlock(m.node);
        assert_eq!(t.evict(100).kv, vec![10, 11]);
        t.check_integrity(&[]).unwrap();
        assert_eq!(t.total_tokens(), 0);
    }

    #[test]
    fn insert_reports_duplicates_and_branches() {
        let mut t = RadixTree::new(1);
        t.insert(&[1, 2, 3], &[0, 1, 2]);
        assert_eq!(t.insert(&[1, 2], &[7, 8]), 2, "ends inside an edge: all cached (the edge is split)");
        assert_eq!(t.insert(&[1, 2, 5, 6], &[7, 8, 9, 10]), 2);
        let mut seqs = t.cached_sequences();
        seqs.sort();
        assert_eq!(
            seqs,
            vec![(vec![1, 2], vec![0, 1]), (vec![1, 2, 3], vec![0, 1, 2]), (vec![1, 2, 5, 6], vec![0, 1, 9, 10]),]
        );
        t.check_integrity(&[]).unwrap();
    }

    #[test]
    fn pages_never_split_inside() {
        let mut t = RadixTree::new(2);
        t.insert(&[1, 2, 3, 4], &[0, 1, 2, 3]);
        // [1 2 3 9]: the second page differs, so only the first page matches.
        assert_eq!(t.match_prefix(&[1, 2, 3, 9]).slots, vec![0, 1]);
        // [1 9 ..]: the first page differs: no match at all even though token 1 agrees.
        assert!(t.match_prefix(&[1, 9, 3, 4]).slots.is_empty());
        // A 3-token query only looks at its first whole page.
        assert_eq!(t.match_prefix(&[1, 2, 3]).slots, vec![0, 1]);
        t.check_integrity(&[]).unwrap();
    }

    #[test]
    fn lru_evicts_oldest_leaf_first() {
        let mut t = RadixTree::new(1);
        t.insert(&[1], &[0]);
        t.insert(&[2], &[1]);
        t.match_prefix(&[1]); // [1] is now more recent than [2]
        assert_eq!(t.evict(1).kv, vec![1]);
        assert_eq!(t.evict(1).kv, vec![0]);
    }

    #[test]
    fn snapshot_match_cuts_back_to_the_deepest_snapshot_without_splitting() {
        let mut t = RadixTree::new(1);
        let (_, a) = t.insert_at(&[1, 2, 3, 4], &[0, 1, 2, 3]);
        let (_, mid) = t.insert_at(&[1, 2], &[9, 9]); // splits: [1 2] + [3 4]
        assert_eq!(t.num_nodes(), 2);
        assert!(t.set_snapshot(mid, 100, false));
        assert!(!t.set_snapshot(mid, 101, false), "one snapshot per node");
        // The KV match would reach 4 tokens (or 3 inside the edge); the state exists only after [1 2].
        let m = t.match_snapshot(&[1, 2, 3, 7]);
        assert_eq!((m.node, m.slots.clone(), m.state_slot), (mid, vec![0, 1], Some(100)));
        assert_eq!(t.num_nodes(), 2, "a snapshot match never splits");
        assert!(t.set_snapshot(a, 7, false));
        assert_eq!(t.match_snapshot(&[1, 2, 3, 4, 5]).state_slot, Some(7));
        assert_eq!(t.match_snapshot(&[1, 2, 3]).state_slot, Some(100), "[1 2 3] ends inside [3 4]: cut to [1 2]");
        assert_eq!(t.match_snapshot(&[1, 2, 3, 9]).kv_len, 3, "KV reaches 3 tokens, the state only 2");
        assert_eq!(t.match_snapshot(&[2]).node, NodeId::ROOT);
        t.check_integrity(&[]).unwrap();
    }

    #[test]
    fn kv_eviction_takes_snapshot_less_leaves_first_and_frees_snapshots_with_their_node() {
        let mut t = RadixTree::new(1);
        let (_, a) = t.insert_at(&[1, 1], &[0, 1]);
        t.insert_at(&[2, 2], &[2, 3]); // newer, but no snapshot: goes first
        t.set_snapshot(a, 50, false);
        assert_eq!(t.evict(1), Evicted { kv: vec![2, 3], snapshots: vec![] });
        assert_eq!(t.evict(1), Evicted { kv: vec![0, 1], snapshots: vec![50] });
        assert_eq!(t.num_snapshots(), 0);
        t.check_integrity(&[]).unwrap();
    }

    #[test]
    fn snapshot_eviction_tombstones_and_respects_snapshot_locks() {
        let mut t = RadixTree::new(1);
        let (_, a) = t.insert_at(&[1], &[0]);
        let (_, b) = t.insert_at(&[1, 2], &[0, 1]);
        t.set_snapshot(a, 10, false);
        t.set_snapshot(b, 11, false);
        let m = t.match_snapshot(&[1, 2, 3]);
        assert_eq!(m.node, b);
        t.lock(b);
        t.lock_snapshot(b);
        t.check_integrity_with(&[b], &[b]).unwrap();
        assert_eq!(t.evict_snapshots(5), vec![10], "b's snapshot is locked; a's goes, its node stays");
        assert_eq!(t.num_nodes(), 2);
        assert_eq!(t.match_snapshot(&[1, 9]).node, NodeId::ROOT, "a is a tombstone now");
        t.unlock_snapshot(b);
        t.unlock(b);
        assert_eq!(t.evict_snapshots(5), vec![11]);
        t.check_integrity(&[]).unwrap();
    }

    #[test]
    fn cold_snapshots_go_first_until_restored_from() {
        let mut t = RadixTree::new(1);
        let (_, w) = t.insert_at(&[1], &[0]);
        let (_, c1) = t.insert_at(&[2], &[1]);
        let (_, c2) = t.insert_at(&[3], &[2]);
        t.set_snapshot(w, 10, false);
        t.set_snapshot(c1, 11, true);
        t.set_snapshot(c2, 12, true);
        assert_eq!(t.evict_snapshots(1), vec![11], "cold before warm, the older cold first");
        t.match_snapshot(&[3, 9]); // restoring from c2 makes it warm (the most recent)
        assert_eq!(t.evict_snapshots(2), vec![10, 12]);
        t.check_integrity(&[]).unwrap();
    }

    #[test]
    #[should_panic(expected = "full_lock >= snapshot_lock")]
    fn snapshot_lock_needs_a_lock_on_the_node() {
        let mut t = RadixTree::new(1);
        let (_, a) = t.insert_at(&[1], &[0]);
        t.set_snapshot(a, 3, false);
        t.lock_snapshot(a);
    }
}
