//! Property tests of the hybrid radix cache ([`KvCache`] with `CacheType::HybridRadix`: radix tree with
//! recurrent-state snapshots, KV allocator, state slot pool) against the brute-force reference model in
//! `common/hybrid_model.rs`.
//!
//! proptest generates random sequences of match / admit (live slot + snapshot-cut match + lock +
//! allocate, evicting as needed) / restore done / capture at a grid point (snapshot allocation, evicting
//! the LRU snapshot, cached into the tree with the request's lock moving down) / finish (insert + donate,
//! or free) / pin / unpin / evict KV / evict snapshots over a tiny vocabulary and small pools, so both
//! currencies are under pressure all the time. After every operation the harness checks matches, both
//! LRU orders, that KV is never freed under a snapshot, lock and snapshot-lock counts, counters and the
//! conservation of KV pages and state slots. On failure proptest shrinks to a minimal sequence.

mod common;

use common::hybrid_model::{HOp, HybridHarness};
use proptest::prelude::*;

fn tokens(max_len: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..3, 1..max_len)
}

fn op(max_len: usize) -> impl Strategy<Value = HOp> {
    prop_oneof![
        2 => tokens(max_len).prop_map(HOp::Match),
        4 => tokens(max_len).prop_map(HOp::Admit),
        2 => any::<usize>().prop_map(HOp::Restored),
        4 => (any::<usize>(), any::<usize>(), any::<bool>()).prop_map(|(idx, pick, cold)| HOp::Capture { idx, pick, cold }),
        3 => (any::<usize>(), 0usize..32, prop::bool::weighted(0.85), prop::bool::weighted(0.8))
            .prop_map(|(idx, keep, insert, donate)| HOp::Finish { idx, keep, insert, donate }),
        1 => tokens(max_len).prop_map(HOp::Pin),
        1 => any::<usize>().prop_map(HOp::Unpin),
        1 => (0usize..24).prop_map(HOp::EvictKv),
        1 => (0usize..3).prop_map(HOp::EvictSnapshots),
    ]
}

fn run(capacity: usize, page_size: usize, grid: usize, live: usize, snaps: usize, ops: &[HOp]) {
    let mut h = HybridHarness::new(capacity, page_size, grid, live, snaps);
    for o in ops {
        h.apply(o);
    }
    h.drain();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn hybrid_cache_matches_the_model_page_1_grid_2(ops in prop::collection::vec(op(14), 1..150)) {
        run(48, 1, 2, 3, 4, &ops);
    }

    #[test]
    fn hybrid_cache_matches_the_model_page_1_grid_3(ops in prop::collection::vec(op(16), 1..150)) {
        run(48, 1, 3, 4, 2, &ops);
    }

    #[test]
    fn hybrid_cache_matches_the_model_page_2_grid_4(ops in prop::collection::vec(op(24), 1..150)) {
        run(64, 2, 4, 3, 5, &ops);
    }
}

/// A hand-written sequence that walks each path once, so a broken harness shows up even if the random
/// search were to miss: restore, capture over cached KV (duplicates), donation, tombstone, tiered KV eviction.
#[test]
fn scripted_sequence_covers_restore_capture_donation_and_both_evictions() {
    let mut h = HybridHarness::new(16, 1, 2, 2, 2);
    h.apply(&HOp::Admit(vec![1, 2, 3, 4, 5]));
    h.apply(&HOp::Capture { idx: 0, pick: 1, cold: true }); // snapshot at 4: [1 2 3 4] goes into the tree
    assert_eq!(h.kv.tree().num_snapshots(), 1);
    h.apply(&HOp::Finish { idx: 0, keep: 1, insert: true, donate: true }); // donated at 5
    assert_eq!((h.kv.tree().num_snapshots(), h.donations), (2, 1));
    h.apply(&HOp::Admit(vec![1, 2, 3, 4, 5, 6])); // resumes from the state after 5 tokens
    assert_eq!((h.restores, h.restored_tokens), (1, 5));
    h.apply(&HOp::Finish { idx: 0, keep: 0, insert: true, donate: true }); // restore pending: no donation
    assert_eq!(h.donations, 1);
    h.apply(&HOp::Admit(vec![1, 2, 9, 9])); // no snapshot on [1 2]: recomputes, KV [1 2] is a duplicate
    h.apply(&HOp::Capture { idx: 0, pick: 0, cold: false }); // capture at 2: [1 2] was cached, ours is a duplicate
    assert_eq!(h.captures_over_cached_kv, 1);
    h.apply(&HOp::EvictSnapshots(1)); // the oldest unlocked snapshot (at 4) is tombstoned
    h.apply(&HOp::Finish { idx: 0, keep: 2, insert: true, donate: true }); // full: evicts one more to donate
    h.apply(&HOp::Admit(vec![7; 12])); // KV pressure: snapshot-less leaves go first
    assert!(h.evicted_tokens > 0);
    h.drain();
}
