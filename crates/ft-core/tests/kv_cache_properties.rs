//! Property tests of the radix prefix cache and the KV slot allocator together ([`KvCache`]), against the
//! brute-force reference model in `common/kv_model.rs`.
//!
//! proptest generates random sequences of match / admit (match + lock + allocate, evicting as needed) /
//! finish (insert or free) / pin / unpin / evict operations over a tiny vocabulary (so prompts share
//! prefixes and branch a lot) and a small pool (so allocation keeps evicting). After every operation the
//! harness checks: matches equal the model's longest cached prefix and slots; slot conservation (free +
//! cached + request-owned == capacity, no slot owned twice); prefix closure; lock counts equal the live
//! locks; total and evictable counts; evictions take only unlocked entries, least recently used first.
//! On failure proptest shrinks to a minimal operation sequence.

mod common;

use common::kv_model::{Harness, Op};
use proptest::prelude::*;

fn tokens(max_len: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..3, 1..max_len)
}

fn op(max_len: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => tokens(max_len).prop_map(Op::Match),
        4 => tokens(max_len).prop_map(Op::Admit),
        3 => (any::<usize>(), 0usize..32, prop::bool::weighted(0.85))
            .prop_map(|(idx, keep, insert)| Op::Finish { idx, keep, insert }),
        1 => tokens(max_len).prop_map(Op::Pin),
        1 => any::<usize>().prop_map(Op::Unpin),
        1 => (0usize..24).prop_map(Op::Evict),
    ]
}

fn run(capacity: usize, page_size: usize, ops: &[Op]) {
    let mut h = Harness::new(capacity, page_size);
    for o in ops {
        h.apply(o);
    }
    h.drain();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn radix_and_allocator_match_the_model_page_1(ops in prop::collection::vec(op(14), 1..120)) {
        run(48, 1, &ops);
    }

    #[test]
    fn radix_and_allocator_match_the_model_page_2(ops in prop::collection::vec(op(20), 1..120)) {
        run(64, 2, &ops);
    }

    #[test]
    fn radix_and_allocator_match_the_model_page_4(ops in prop::collection::vec(op(28), 1..120)) {
        run(96, 4, &ops);
    }
}

/// A hand-written sequence that exercises each path once, so a broken harness shows up even if the
/// random search were to miss (e.g. the split on match, duplicates freed on insert, LRU eviction).
#[test]
fn scripted_sequence_covers_split_duplicate_and_eviction() {
    let mut h = Harness::new(8, 1);
    h.apply(&Op::Admit(vec![1, 2, 3, 4]));
    h.apply(&Op::Admit(vec![1, 2, 3, 4])); // no hit yet: a concurrent duplicate
    h.apply(&Op::Finish { idx: 0, keep: usize::MAX, insert: true });
    h.apply(&Op::Finish { idx: 0, keep: usize::MAX, insert: true }); // duplicate slots freed
    assert_eq!(h.kv.tree().total_tokens(), 4);
    assert_eq!(h.kv.allocator().free_pages(), 4);
    h.apply(&Op::Match(vec![1, 2, 9])); // splits [1 2 3 4]
    assert_eq!(h.kv.tree().num_nodes(), 2);
    h.apply(&Op::Admit(vec![5, 6, 7, 8, 9, 1])); // needs 6 of 4 free: evicts [3 4]
    assert_eq!(h.kv.tree().total_tokens(), 2);
    assert_eq!(h.evicted_tokens, 2);
    h.drain();
}
