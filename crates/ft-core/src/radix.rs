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
//! was already cached, [`RadixTree::evict`] returns the slots it dropped); the caller owns the free list
//! (see [`crate::scheduler::kv_cache::KvCache`]).

use std::collections::{BTreeSet, HashMap};

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
    /// Reserved for the hybrid radix cache (a later issue): the recurrent-state snapshot slot holding the
    /// Gated DeltaNet state after this node's last token, `None` for a tombstone. Unused for now; split
    /// parents get `None`, as in SGLang's `MambaRadixCache`.
    state_slot: Option<i32>,
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
}

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
    /// Unlocked leaves (not the root), ordered least recently used first: the eviction order.
    evictable_leaves: BTreeSet<(u64, NodeId)>,
    /// Tokens held by all nodes.
    total_tokens: usize,
    /// Tokens held by nodes with no lock (all of them can be evicted, leaves first).
    evictable_tokens: usize,
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
            total_tokens: 0,
            evictable_tokens: 0,
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

    /// The recurrent-state snapshot slot stored at `node` (always `None` until the hybrid radix cache
    /// lands; see the field's doc).
    pub fn state_slot(&self, node: NodeId) -> Option<i32> {
        self.nodes.get(node.idx()).filter(|n| n.live).and_then(|n| n.state_slot)
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

    /// Stamps `id` with `now`, keeping its place in the eviction order.
    fn touch(&mut self, id: NodeId, now: u64) {
        let old = self.nodes[id.idx()].last_access;
        if self.evictable_leaves.remove(&(old, id)) {
            self.evictable_leaves.insert((now, id));
        }
        self.nodes[id.idx()].last_access = now;
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
    /// the first `at` tokens, `child` keeps the rest. Returns the new parent. Counts and the eviction order
    /// do not change (the new node is an inner node with the same locks as `child`).
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
        TreeMatch { node, slots }
    }

    /// Caches `key` with KV slots `value` (same length, a whole number of pages). Returns how many leading
    /// tokens of `key` were already cached: the tree keeps its own slots for those, so the caller still
    /// owns `value[..returned]` (and frees the ones that are not the tree's). The tree takes ownership of
    /// `value[returned..]`.
    pub fn insert(&mut self, key: &[u32], value: &[u32]) -> usize {
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
            let p = &self.nodes[node.idx()];
            self.evictable_leaves.remove(&(p.last_access, node));
            let leaf = self.new_node(Node {
                key: key[pos..].to_vec(),
                value: value[pos..].to_vec(),
                parent: Some(node),
                children: HashMap::new(),
                lock_ref: 0,
                last_access: now,
                state_slot: None,
                live: true,
            });
            self.nodes[node.idx()].children.insert(key[pos..pos + ps].into(), leaf);
            self.evictable_leaves.insert((now, leaf));
            self.total_tokens += len;
            self.evictable_tokens += len;
        }
        pos
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
                let stamp = (n.last_access, cur);
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
            if n.lock_ref == 0 {
                self.evictable_tokens += n.key.len();
                if n.children.is_empty() {
                    let stamp = (n.last_access, cur);
                    self.evictable_leaves.insert(stamp);
                }
            }
            cur = self.nodes[cur.idx()].parent.expect("non-root node has a parent");
        }
    }

    /// Evicts least-recently-used unlocked leaves until at least `tokens` tokens are freed or nothing is
    /// evictable. Returns the freed slots (whole pages; possibly more than asked, a node goes whole).
    pub fn evict(&mut self, tokens: usize) -> Vec<u32> {
        let mut freed = Vec::new();
        while freed.len() < tokens {
            let Some((_, id)) = self.evictable_leaves.pop_first() else { break };
            let n = std::mem::replace(&mut self.nodes[id.idx()], Node::empty());
            debug_assert!(n.lock_ref == 0 && n.children.is_empty());
            let parent = n.parent.expect("the root is never evicted");
            self.nodes[parent.idx()].children.remove(&n.key[..self.page_size]);
            self.free_nodes.push(id.0);
            self.total_tokens -= n.key.len();
            self.evictable_tokens -= n.key.len();
            freed.extend_from_slice(&n.value);
            if self.is_evictable_leaf(parent) {
                let stamp = (self.nodes[parent.idx()].last_access, parent);
                self.evictable_leaves.insert(stamp);
            }
        }
        freed
    }

    /// Every slot the tree owns.
    pub fn owned_slots(&self) -> Vec<u32> {
        self.nodes.iter().filter(|n| n.live).flat_map(|n| n.value.iter().copied()).collect()
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

    /// Checks the tree's structure against itself and against the locks its users hold:
    /// parent/child links agree and every node is reachable from the root (prefix closure); keys and
    /// values have equal, page-multiple lengths and values are whole aligned pages; `lock_ref` of each
    /// node equals the number of `live_locks` at or below it; the token counters and the eviction order
    /// match a recount. O(nodes + locks * depth).
    pub fn check_integrity(&self, live_locks: &[NodeId]) -> Result<(), String> {
        let ps = self.page_size;
        let root = &self.nodes[0];
        if !root.live || root.parent.is_some() || !root.key.is_empty() || root.lock_ref != 0 {
            return Err("root node is malformed".into());
        }
        // Expected lock counts from the users' locks.
        let mut expected = vec![0u32; self.nodes.len()];
        for &l in live_locks {
            if l == NodeId::ROOT {
                continue;
            }
            if !self.nodes.get(l.idx()).is_some_and(|n| n.live) {
                return Err(format!("a live lock points at evicted node {l:?}"));
            }
            let mut cur = l;
            while cur != NodeId::ROOT {
                expected[cur.idx()] += 1;
                cur = self.nodes[cur.idx()].parent.ok_or("node without parent")?;
            }
        }
        // Walk from the root.
        let mut reached = 0usize;
        let mut total = 0usize;
        let mut evictable = 0usize;
        let mut leaves = BTreeSet::new();
        let mut stack = vec![NodeId::ROOT];
        while let Some(id) = stack.pop() {
            let n = &self.nodes[id.idx()];
            if !n.live {
                return Err(format!("node {id:?} is reachable but not live"));
            }
            reached += 1;
            let mut child_locks = 0u32;
            for (first, &c) in &n.children {
                let cn = &self.nodes[c.idx()];
                if !cn.live || cn.parent != Some(id) {
                    return Err(format!("child {c:?} of {id:?} does not point back to its parent"));
                }
                if cn.key.len() < ps || cn.key[..ps] != first[..] {
                    return Err(format!("child {c:?} is filed under the wrong first page"));
                }
                child_locks += cn.lock_ref;
                stack.push(c);
            }
            if id == NodeId::ROOT {
                continue;
            }
            if n.key.is_empty() || n.key.len() != n.value.len() || !n.key.len().is_multiple_of(ps) {
                return Err(format!("node {id:?} has key/value lengths {}/{}", n.key.len(), n.value.len()));
            }
            for page in n.value.chunks(ps) {
                if !(page[0] as usize).is_multiple_of(ps)
                    || page.iter().enumerate().any(|(k, &s)| s != page[0] + k as u32)
                {
                    return Err(format!("node {id:?} holds a slot run that is not a whole page"));
                }
            }
            if n.lock_ref != expected[id.idx()] {
                return Err(format!(
                    "node {id:?} has lock_ref {} but {} live locks at or below it",
                    n.lock_ref,
                    expected[id.idx()]
                ));
            }
            if n.lock_ref < child_locks {
                return Err(format!("node {id:?} has fewer locks than its children together"));
            }
            total += n.key.len();
            if n.lock_ref == 0 {
                evictable += n.key.len();
                if n.children.is_empty() {
                    leaves.insert((n.last_access, id));
                }
            }
        }
        let live = self.nodes.iter().filter(|n| n.live).count();
        if live != reached {
            return Err(format!("{live} live nodes but only {reached} reachable from the root"));
        }
        if live + self.free_nodes.len() != self.nodes.len() {
            return Err("node arena free list and live flags disagree".into());
        }
        if total != self.total_tokens {
            return Err(format!("total_tokens is {} but nodes hold {total}", self.total_tokens));
        }
        if evictable != self.evictable_tokens {
            return Err(format!("evictable_tokens is {} but unlocked nodes hold {evictable}", self.evictable_tokens));
        }
        if leaves != self.evictable_leaves {
            return Err("the eviction order does not list exactly the unlocked leaves".into());
        }
        Ok(())
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
        assert_eq!(t.evict(100), vec![12, 13], "only the unlocked tail can go");
        t.check_integrity(&[m.node]).unwrap();
        t.unlock(m.node);
        assert_eq!(t.evict(100), vec![10, 11]);
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
        assert_eq!(t.evict(1), vec![1]);
        assert_eq!(t.evict(1), vec![0]);
    }
}
