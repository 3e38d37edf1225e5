//! The long randomized run: 100,000 operations on the radix cache + allocator per page size, every
//! invariant of the reference harness checked after each one (TGI's `radix.rs` does the same with
//! 100,000 allocate/free rounds). A plain seeded loop rather than proptest: no shrinking, just volume, so
//! rare interleavings (evicting a parent right after its last child, splitting a locked node, inserting
//! over a concurrently cached duplicate) get hit many times.

mod common;

use common::kv_model::{Harness, Op};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random_tokens(rng: &mut StdRng, max_len: usize) -> Vec<u32> {
    let len = rng.gen_range(1..=max_len);
    // A binary vocabulary shares long prefixes; a sprinkle of a third token makes branches.
    (0..len).map(|_| if rng.gen_bool(0.1) { 2 } else { rng.gen_range(0..2) }).collect()
}

fn fuzz(seed: u64, ops: usize, capacity: usize, page_size: usize, max_len: usize) -> Harness {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut h = Harness::new(capacity, page_size);
    for _ in 0..ops {
        let op = match rng.gen_range(0..100) {
            0..=19 => Op::Match(random_tokens(&mut rng, max_len)),
            20..=54 => Op::Admit(random_tokens(&mut rng, max_len)),
            55..=84 => Op::Finish { idx: rng.gen(), keep: rng.gen_range(0..=max_len), insert: rng.gen_bool(0.9) },
            85..=90 => Op::Pin(random_tokens(&mut rng, max_len)),
            91..=96 => Op::Unpin(rng.gen()),
            _ => Op::Evict(rng.gen_range(0..capacity / 2)),
        };
        h.apply(&op);
    }
    h.drain();
    h
}

#[test]
fn hundred_thousand_operations_page_1() {
    let h = fuzz(0xF7EE_7043, 100_000, 64, 1, 16);
    // The run must actually exercise the interesting paths, or it proves nothing.
    assert!(h.admitted > 20_000 && h.refused > 100, "admitted {} refused {}", h.admitted, h.refused);
    assert!(h.cache_hits > 10_000 && h.evicted_tokens > 10_000, "hits {} evicted {}", h.cache_hits, h.evicted_tokens);
}

#[test]
fn hundred_thousand_operations_page_4() {
    let h = fuzz(0x5EED_0004, 100_000, 128, 4, 32);
    assert!(h.admitted > 20_000 && h.refused > 100, "admitted {} refused {}", h.admitted, h.refused);
    assert!(h.cache_hits > 5_000 && h.evicted_tokens > 10_000, "hits {} evicted {}", h.cache_hits, h.evicted_tokens);
}
