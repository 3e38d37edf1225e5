//! The radix tree's integrity check: a recount of everything the tree keeps incrementally (lock counts,
//! token totals, the two eviction orders), compared with what it holds. Tests and the fuzz runs call it
//! after every operation; it is also what `check_integrity` endpoints run.

use super::{LeafKey, Node, NodeId, RadixTree};
use std::collections::{BTreeSet, HashSet};

/// What the users' locks say each node's counters must be, by node index.
struct ExpectedLocks {
    /// Live locks at or below the node (its `lock_ref`).
    below: Vec<u32>,
    /// Live locks held exactly at the node.
    at: Vec<u32>,
    /// Snapshot locks held at the node (its `snap_lock`).
    snapshot: Vec<u32>,
}

/// What a walk from the root finds, to compare with the tree's running totals.
#[derive(Default)]
struct Recount {
    reached: usize,
    total_tokens: usize,
    evictable_tokens: usize,
    evictable_leaves: BTreeSet<LeafKey>,
    snapshot_slots: HashSet<u32>,
    evictable_snapshots: BTreeSet<(u64, NodeId)>,
}

impl RadixTree {
    /// [`RadixTree::check_integrity_with`] for users that hold no snapshot locks.
    pub fn check_integrity(&self, live_locks: &[NodeId]) -> Result<(), String> {
        self.check_integrity_with(live_locks, &[])
    }

    /// Checks the tree's structure against itself and against the locks its users hold:
    /// parent/child links agree and every node is reachable from the root (prefix closure); keys and
    /// values have equal, page-multiple lengths and values are whole aligned pages; `lock_ref` of each
    /// node equals the number of `live_locks` at or below it; the token counters and the eviction order
    /// match a recount. Snapshots: no slot owned twice, none on the root; `snap_lock` of each node equals
    /// the `snapshot_locks` on it, which never exceed the `live_locks` on that same node (full >= snapshot);
    /// the snapshot count and the snapshot eviction order match a recount. O(nodes + locks * depth).
    pub fn check_integrity_with(&self, live_locks: &[NodeId], snapshot_locks: &[NodeId]) -> Result<(), String> {
        let root = &self.nodes[0];
        if !root.live
            || root.parent.is_some()
            || !root.key.is_empty()
            || root.lock_ref != 0
            || root.state_slot.is_some()
        {
            return Err("root node is malformed".into());
        }
        let expected = self.expected_locks(live_locks, snapshot_locks)?;
        let recount = self.walk(&expected)?;
        self.check_totals(&recount)
    }

    fn expected_locks(&self, live_locks: &[NodeId], snapshot_locks: &[NodeId]) -> Result<ExpectedLocks, String> {
        let n = self.nodes.len();
        let mut e = ExpectedLocks { below: vec![0; n], at: vec![0; n], snapshot: vec![0; n] };
        for &l in live_locks {
            e.at[l.idx()] += 1;
            if l == NodeId::ROOT {
                continue;
            }
            if !self.nodes.get(l.idx()).is_some_and(|n| n.live) {
                return Err(format!("a live lock points at evicted node {l:?}"));
            }
            let mut cur = l;
            while cur != NodeId::ROOT {
                e.below[cur.idx()] += 1;
                cur = self.nodes[cur.idx()].parent.ok_or("node without parent")?;
            }
        }
        for &l in snapshot_locks {
            if l == NodeId::ROOT || !self.nodes.get(l.idx()).is_some_and(|n| n.live && n.state_slot.is_some()) {
                return Err(format!("a snapshot lock points at {l:?}, which owns no snapshot"));
            }
            e.snapshot[l.idx()] += 1;
        }
        Ok(e)
    }

    /// Visits every node reachable from the root, checking each, and recounts the totals.
    fn walk(&self, expected: &ExpectedLocks) -> Result<Recount, String> {
        let mut r = Recount::default();
        let mut stack = vec![NodeId::ROOT];
        while let Some(id) = stack.pop() {
            let n = &self.nodes[id.idx()];
            if !n.live {
                return Err(format!("node {id:?} is reachable but not live"));
            }
            r.reached += 1;
            let child_locks = self.check_children(id, n, &mut stack)?;
            if id == NodeId::ROOT {
                continue;
            }
            self.check_key_and_pages(id, n)?;
            check_locks(id, n, child_locks, expected)?;
            if let Some(slot) = n.state_slot {
                if !r.snapshot_slots.insert(slot) {
                    return Err(format!("snapshot slot {slot} is owned by two nodes"));
                }
                if n.snap_lock == 0 {
                    r.evictable_snapshots.insert((n.snap_access, id));
                }
            }
            r.total_tokens += n.key.len();
            if n.lock_ref == 0 {
                r.evictable_tokens += n.key.len();
                if n.children.is_empty() {
                    r.evictable_leaves.insert((n.state_slot.is_some(), n.last_access, id));
                }
            }
        }
        Ok(r)
    }

    /// Children point back to `id` and are filed under their first page; pushes them for the walk and
    /// returns their lock counts together.
    fn check_children(&self, id: NodeId, n: &Node, stack: &mut Vec<NodeId>) -> Result<u32, String> {
        let mut child_locks = 0u32;
        for (first, &c) in &n.children {
            let cn = &self.nodes[c.idx()];
            if !cn.live || cn.parent != Some(id) {
                return Err(format!("child {c:?} of {id:?} does not point back to its parent"));
            }
            if cn.key.len() < self.page_size || cn.key[..self.page_size] != first[..] {
                return Err(format!("child {c:?} is filed under the wrong first page"));
            }
            child_locks += cn.lock_ref;
            stack.push(c);
        }
        Ok(child_locks)
    }

    fn check_key_and_pages(&self, id: NodeId, n: &Node) -> Result<(), String> {
        let ps = self.page_size;
        if n.key.is_empty() || n.key.len() != n.value.len() || !n.key.len().is_multiple_of(ps) {
            return Err(format!("node {id:?} has key/value lengths {}/{}", n.key.len(), n.value.len()));
        }
        for page in n.value.chunks(ps) {
            if !(page[0] as usize).is_multiple_of(ps) || page.iter().enumerate().any(|(k, &s)| s != page[0] + k as u32)
            {
                return Err(format!("node {id:?} holds a slot run that is not a whole page"));
            }
        }
        Ok(())
    }

    fn check_totals(&self, r: &Recount) -> Result<(), String> {
        let live = self.nodes.iter().filter(|n| n.live).count();
        if live != r.reached {
            return Err(format!("{live} live nodes but only {} reachable from the root", r.reached));
        }
        if live + self.free_nodes.len() != self.nodes.len() {
            return Err("node arena free list and live flags disagree".into());
        }
        if r.total_tokens != self.total_tokens {
            return Err(format!("total_tokens is {} but nodes hold {}", self.total_tokens, r.total_tokens));
        }
        if r.evictable_tokens != self.evictable_tokens {
            return Err(format!(
                "evictable_tokens is {} but unlocked nodes hold {}",
                self.evictable_tokens, r.evictable_tokens
            ));
        }
        if r.evictable_leaves != self.evictable_leaves {
            return Err("the eviction order does not list exactly the unlocked leaves".into());
        }
        if r.snapshot_slots.len() != self.num_snapshots {
            return Err(format!("num_snapshots is {} but nodes own {}", self.num_snapshots, r.snapshot_slots.len()));
        }
        if r.evictable_snapshots != self.evictable_snapshots {
            return Err("the snapshot eviction order does not list exactly the unlocked snapshots".into());
        }
        Ok(())
    }
}

/// A node's lock counters against the users' locks: `lock_ref` counts the live locks at or below it and
/// is at least its children's together; `snap_lock` counts the snapshot locks on it, never more than the
/// live locks held exactly there.
fn check_locks(id: NodeId, n: &Node, child_locks: u32, e: &ExpectedLocks) -> Result<(), String> {
    let i = id.idx();
    if n.lock_ref != e.below[i] {
        return Err(format!("node {id:?} has lock_ref {} but {} live locks at or below it", n.lock_ref, e.below[i]));
    }
    if n.lock_ref < child_locks {
        return Err(format!("node {id:?} has fewer locks than its children together"));
    }
    if n.snap_lock != e.snapshot[i] {
        return Err(format!("node {id:?} has snap_lock {} but {} snapshot locks", n.snap_lock, e.snapshot[i]));
    }
    if n.snap_lock > e.at[i] {
        return Err(format!("node {id:?} has more snapshot locks than locks (full_lock >= snapshot_lock)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree with a branch, a lock and a snapshot: [1 2 3 4] and [1 2 5 6] (page 2), a lock on the
    /// second, a snapshot on the first.
    fn tree() -> (RadixTree, NodeId, NodeId) {
        let mut t = RadixTree::new(2);
        let (_, a) = t.insert_at(&[1, 2, 3, 4], &[10, 11, 12, 13]);
        let (_, b) = t.insert_at(&[1, 2, 5, 6], &[10, 11, 20, 21]);
        assert!(t.set_snapshot(a, 7, false));
        t.lock(b);
        t.check_integrity(&[b]).unwrap();
        (t, a, b)
    }

    /// Corrupts a tree from [`tree`] given its two leaves.
    type Corruption = Box<dyn Fn(&mut RadixTree, NodeId, NodeId)>;

    /// Each corruption of the bookkeeping is caught, with a message naming it.
    #[test]
    fn every_kind_of_corruption_is_reported() {
        let cases: Vec<(&str, Corruption)> = vec![
            ("lock_ref", Box::new(|t, _, b| t.nodes[b.idx()].lock_ref -= 1)),
            ("fewer locks than its children", Box::new(|t, _, b| t.nodes[b.idx()].lock_ref += 1)),
            ("total_tokens", Box::new(|t, _, _| t.total_tokens += 2)),
            ("evictable_tokens", Box::new(|t, _, _| t.evictable_tokens -= 2)),
            ("eviction order", Box::new(|t, _, _| t.evictable_leaves.clear())),
            ("not a whole page", Box::new(|t, a, _| t.nodes[a.idx()].value[1] = 99)),
            ("key/value lengths", Box::new(|t, a, _| t.nodes[a.idx()].value.push(14))),
            ("owned by two nodes", Box::new(|t, a, b| t.nodes[b.idx()].state_slot = t.nodes[a.idx()].state_slot)),
            ("num_snapshots", Box::new(|t, _, _| t.num_snapshots += 1)),
            ("snapshot eviction order", Box::new(|t, _, _| t.evictable_snapshots.clear())),
            ("point back", Box::new(|t, a, b| t.nodes[a.idx()].parent = Some(b))),
            ("root node", Box::new(|t, _, _| t.nodes[0].key.push(1))),
        ];
        for (want, corrupt) in cases {
            let (mut t, a, b) = tree();
            corrupt(&mut t, a, b);
            let err = t.check_integrity(&[b]).expect_err(want);
            assert!(err.contains(want), "{want}: got {err}");
        }
        let (mut t, a, b) = tree();
        assert!(t.check_integrity(&[]).unwrap_err().contains("lock_ref"), "a lock the users no longer hold");
        assert!(t.check_integrity_with(&[b], &[a]).unwrap_err().contains("snap_lock 0 but 1"));
        t.nodes[a.idx()].snap_lock = 1; // a snapshot lock on a node nobody holds a full lock on
        assert!(t.check_integrity_with(&[b], &[a]).unwrap_err().contains("more snapshot locks than locks"));
        assert!(t.check_integrity_with(&[b], &[b]).unwrap_err().contains("owns no snapshot"));
    }
}
