//! The long randomized run of the hybrid radix cache: 100,000 operations per configuration on the tree with
//! snapshots, the KV allocator and the state slot pool, every invariant of the reference harness
//! (`common/hybrid_model.rs`) checked after each one. A plain seeded loop rather than proptest: volume,
//! so rare interleavings (a capture whose snapshot slot comes from evicting the snapshot the request
//! restored from, a donation that must tombstone another snapshot, KV eviction freeing a snapshot leaf
//! while a pin holds a snapshot lock further up) get hit many times.

mod common;

use common::hybrid_model::{HOp, HybridHarness};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random_tokens(rng: &mut StdRng, max_len: usize) -> Vec<u32> {
    let len = rng.gen_range(1..=max_len);
    // A binary vocabulary shares long prefixes; a sprinkle of a third token makes branches.
    (0..len).map(|_| if rng.gen_bool(0.1) { 2 } else { rng.gen_range(0..2) }).collect()
}

fn fuzz(seed: u64, ops: usize, capacity: usize, page: usize, grid: usize, live: usize, snaps: usize) -> HybridHarness {
    let max_len = 4 * grid + 3;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut h = HybridHarness::new(capacity, page, grid, live, snaps);
    for _ in 0..ops {
        let op = match rng.gen_range(0..100) {
            0..=11 => HOp::Match(random_tokens(&mut rng, max_len)),
            12..=36 => HOp::Admit(random_tokens(&mut rng, max_len)),
            37..=44 => HOp::Restored(rng.gen()),
            45..=64 => HOp::Capture { idx: rng.gen(), pick: rng.gen(), cold: rng.gen_bool(0.4) },
            65..=84 => HOp::Finish {
                idx: rng.gen(),
                keep: rng.gen_range(0..=max_len),
                insert: rng.gen_bool(0.9),
                donate: rng.gen_bool(0.85),
            },
            85..=89 => HOp::Pin(random_tokens(&mut rng, max_len)),
            90..=94 => HOp::Unpin(rng.gen()),
            95..=97 => HOp::EvictKv(rng.gen_range(0..capacity / 2)),
            _ => HOp::EvictSnapshots(rng.gen_range(0..3)),
        };
        h.apply(&op);
    }
    h.drain();
    h
}

fn assert_exercised(h: &HybridHarness) {
    // The run must actually exercise the interesting paths, or it proves nothing.
    let report = format!(
        "admitted {} refused {} restores {} captures {} (cold {}) over cached KV {} donations {} snapshot evictions {} \
         snapshots lost with KV {} evicted tokens {} tiered evictions {}",
        h.admitted,
        h.refused,
        h.restores,
        h.captures,
        h.cold_captures,
        h.captures_over_cached_kv,
        h.donations,
        h.snapshot_evictions,
        h.snapshots_lost_with_kv,
        h.evicted_tokens,
        h.tiered_evictions
    );
    eprintln!("{report}");
    assert!(h.admitted > 10_000 && h.refused > 100, "{report}");
    assert!(h.restores > 2_000 && h.captures > 1_000 && h.cold_captures > 300 && h.donations > 500, "{report}");
    assert!(
        h.captures_over_cached_kv > 100 && h.snapshot_evictions > 1_000 && h.snapshots_lost_with_kv > 50,
        "{report}"
    );
    assert!(h.evicted_tokens > 10_000 && h.tiered_evictions > 20, "{report}");
}

#[test]
fn hundred_thousand_operations_page_1() {
    let h = fuzz(0x4EB2_1D00, 100_000, 64, 1, 4, 4, 6);
    assert_exercised(&h);
}

#[test]
fn hundred_thousand_operations_page_2() {
    let h = fuzz(0x4EB2_1D02, 100_000, 96, 2, 4, 3, 4);
    assert_exercised(&h);
}
