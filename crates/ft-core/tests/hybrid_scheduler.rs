//! Scheduler tests of the hybrid radix cache over simulated steps. The fake worker (`common/sim.rs`) keeps
//! recurrent-state slots holding `(tokens folded in, hash of them)` next to its KV pool, runs each plan's
//! state copies before the forward and its captures after it, and checks that every sequence continuing
//! from its live slot finds exactly the state after its `prefix_len` tokens there; the driver checks
//! `check_integrity()` after every step and, at the end, that every KV page and every state slot (live
//! and snapshot) is accounted for and comes back when the cache is flushed.

mod common;

use common::sim::{request, Sim};
use ft_core::config::{snapshot_slots_for, CacheType, SchedulerConfig, DEFAULT_LINEAR_STATE_CACHE_RATIO};
use ft_core::request::FinishReason;
use ft_core::step::{StateCopy, StepOutput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A hybrid model with the hybrid radix cache: 4 live slots, FreeToken's default 2.0 x 4 = 8 snapshot
/// slots, the 64-token GDN grid, 256-token prefill steps.
fn hybrid_cfg() -> SchedulerConfig {
    let snapshots = snapshot_slots_for(4, DEFAULT_LINEAR_STATE_CACHE_RATIO, None);
    SchedulerConfig {
        max_running_requests: 4,
        max_prefill_tokens: 256,
        kv_capacity_tokens: 8192,
        page_size: 1,
        max_context: 4096,
        cache_type: CacheType::HybridRadix,
        mixed_decode: true,
        decode_interleave_every: 0,
        num_state_slots: 4 + snapshots,
        num_snapshot_slots: snapshots,
        snapshot_interval: 64,
        snapshot_token_id: None,
        seed: 11,
    }
}

/// `n` tokens no other `seed` produces.
fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

/// The snapshot slot the tree holds for exactly `tokens`, if any.
fn snapshot_at(sim: &Sim, tokens: &[u32]) -> Option<u32> {
    sim.sched.kv_cache().tree().cached_snapshots().into_iter().find(|(k, _, _)| k == tokens).map(|(_, s, _)| s)
}

#[test]
fn config_sizes_and_resolves_the_hybrid_cache() {
    assert_eq!(snapshot_slots_for(4, 2.0, None), 8, "FreeToken: ceil(2.0 x max_running_requests)");
    assert_eq!(snapshot_slots_for(3, 1.5, None), 5);
    assert_eq!(snapshot_slots_for(4, 2.0, Some(3)), 3, "an absolute count overrides the ratio");
    assert_eq!(CacheType::resolve(CacheType::Radix, true), CacheType::HybridRadix);
    assert_eq!(CacheType::resolve(CacheType::Radix, false), CacheType::Radix);
    assert_eq!(CacheType::resolve(CacheType::HybridRadix, false), CacheType::Radix);
    assert_eq!(CacheType::resolve(CacheType::Naive, true), CacheType::Naive);
    assert_eq!(CacheType::HybridRadix.as_str(), "hybrid_radix");
    let cfg = hybrid_cfg();
    cfg.validate().unwrap();
    assert_eq!((cfg.live_state_slots(), cfg.snapshot_grid()), (4, 64));
    assert_eq!(SchedulerConfig { page_size: 48, ..cfg.clone() }.snapshot_grid(), 192, "lcm(64, page size)");
    assert!(SchedulerConfig { num_snapshot_slots: 0, ..cfg.clone() }.validate().is_err());
    assert!(SchedulerConfig { num_state_slots: 0, num_snapshot_slots: 0, ..cfg.clone() }.validate().is_err());
    assert!(SchedulerConfig { num_snapshot_slots: 12, ..cfg.clone() }.validate().is_err(), "no live slot left");
}

/// The same prompt sent again resumes at the last grid point below its length (it matches
/// `prompt[..len - 1]`, and the first run captured exactly that point): SGLang's n-1 miss cannot happen.
#[test]
fn identical_prompts_reuse_the_last_grid_point_below_their_length() {
    for n in [2, 63, 64, 65, 66, 127, 128, 129, 255, 256, 257, 300, 513, 700] {
        let mut sim = Sim::new(hybrid_cfg());
        let prompt = toks(1, n);
        sim.add(request(1, prompt.clone(), 3)).unwrap();
        sim.run_until_idle(100);
        let want = (n - 1) / 64 * 64;
        for id in [2, 3] {
            sim.add(request(id, prompt.clone(), 3)).unwrap();
            let plan = sim.plan().unwrap();
            let seq = &plan.seqs[0];
            assert_eq!(seq.prefix_len as usize, want, "prompt of {n}: resumes at {}", seq.prefix_len);
            if want > 0 {
                let src = snapshot_at(&sim, &prompt[..want]).expect("the snapshot it restores") as i32;
                assert_eq!(plan.state_copies, vec![StateCopy { src, dst: seq.state_slot }]);
            } else {
                assert!(plan.state_copies.is_empty());
            }
            sim.execute(&plan);
            sim.run_until_idle(100);
            assert_eq!(sim.outcome(id).cached_tokens, Some(want as u32));
        }
        let st = sim.sched.stats();
        let hits = if want > 0 { 2 } else { 0 };
        assert_eq!((st.snapshot_hits, st.snapshot_hit_tokens), (hits, hits * want as u64));
        sim.assert_clean();
    }
}

/// Each turn of a chat resends the whole history: it resumes from the state donated when the previous
/// answer finished (page 1: exactly at the end of the answer's KV).
fn multi_turn(page_size: usize) {
    let mut sim = Sim::new(SchedulerConfig { page_size, ..hybrid_cfg() });
    let mut history = toks(1, 150);
    let mut prev: Option<(usize, usize)> = None; // (previous prompt length, tokens with KV at its end)
    let mut resumed = 0;
    for turn in 0..10u64 {
        sim.add(request(turn, history.clone(), 8 + 3 * turn as u32)).unwrap();
        sim.run_until_idle(1000);
        let o = sim.outcome(turn);
        let cached = o.cached_tokens.unwrap() as usize;
        if let Some((prev_prompt, computed)) = prev {
            if computed % page_size == 0 {
                assert_eq!(cached, computed, "turn {turn} resumes at the end of the previous answer");
            } else {
                // The donation needs a node ending there: only on a page boundary. Otherwise the last
                // grid point of the previous prompt (or later) is there.
                assert!(
                    cached >= (prev_prompt - 1) / 64 * 64 && cached.is_multiple_of(page_size),
                    "turn {turn}: {cached}"
                );
            }
            resumed += cached;
        }
        prev = Some((history.len(), history.len() + o.tokens.len() - 1));
        history.extend(o.tokens.clone());
        history.extend(toks(100 + turn as u32, 20 + (37 * turn as usize) % 90));
    }
    let st = sim.sched.stats();
    assert_eq!((st.snapshot_hits, st.snapshot_hit_tokens), (9, resumed as u64));
    assert!(sim.worker.copies == 9 && sim.worker.captures > 0);
    sim.assert_clean();
}

#[test]
fn multi_turn_conversation_resumes_at_the_end_of_each_answer_page_1() {
    multi_turn(1);
}

#[test]
fn multi_turn_conversation_resumes_at_the_end_of_each_answer_page_4() {
    multi_turn(4);
}

/// Conversations sharing a system prompt: the first one's only capture lies past the system prompt (in
/// its own question), so the second cannot resume; but it sees the KV of the system prompt cached and
/// snapshots that branch point, and every later conversation resumes there.
#[test]
fn shared_system_prompt_is_snapshotted_at_the_branch_point() {
    let mut sim = Sim::new(SchedulerConfig { max_prefill_tokens: 1024, ..hybrid_cfg() });
    let system = toks(7, 500);
    let ask = |q: u32, n: usize| -> Vec<u32> { system.iter().copied().chain(toks(q, n)).collect() };
    sim.add(request(1, ask(1, 100), 4)).unwrap();
    sim.run_until_idle(50);
    assert!(snapshot_at(&sim, &ask(1, 100)[..576]).is_some(), "one chunk: its last grid point <= 599");
    sim.add(request(2, ask(2, 80), 4)).unwrap();
    sim.run_until_idle(50);
    assert_eq!(sim.outcome(2).cached_tokens, Some(0), "no state inside the system prompt yet");
    assert!(snapshot_at(&sim, &system[..448]).is_some(), "the branch point (last grid point <= 500) is kept");
    for id in 3..6 {
        sim.add(request(id, ask(id as u32, 30 + 10 * id as usize), 4)).unwrap();
    }
    sim.run_until_idle(100);
    for id in 3..6 {
        assert_eq!(sim.outcome(id).cached_tokens, Some(448), "request {id} resumes at the branch point");
    }
    sim.assert_clean();
}

/// A request arriving while another with the same system prompt is still prefilling resumes from the
/// snapshot the first one's committed chunk put into the tree.
#[test]
fn concurrent_requests_resume_from_a_running_requests_chunk_snapshots() {
    let mut sim = Sim::new(hybrid_cfg());
    let system = toks(7, 500);
    let a: Vec<u32> = system.iter().copied().chain(toks(1, 300)).collect();
    let b: Vec<u32> = system.iter().copied().chain(toks(2, 40)).collect();
    sim.add(request(1, a, 4)).unwrap();
    sim.step(); // chunk 0..256, captures 256
    sim.add(request(2, b, 4)).unwrap();
    let plan = loop {
        let plan = sim.plan().unwrap();
        if plan.seqs.iter().any(|s| s.request_id == 2) {
            break plan;
        }
        sim.execute(&plan); // A's next chunks take the whole budget first
    };
    let seq_b = plan.seqs.iter().find(|s| s.request_id == 2).unwrap();
    assert_eq!(seq_b.prefix_len, 256, "B resumes from A's first chunk snapshot while A still runs");
    assert!(!sim.outcome(1).ended());
    sim.execute(&plan);
    sim.run_until_idle(100);
    assert_eq!(sim.outcome(2).cached_tokens, Some(256));
    sim.assert_clean();
}

/// Chunks cut by the step budget end on the grid (also when decodes take part of the budget), and each
/// captures its end.
#[test]
fn prefill_chunks_end_on_the_grid_and_capture_there() {
    let mut sim = Sim::new(hybrid_cfg());
    sim.keep_plans = true;
    sim.add(request(1, toks(1, 10), 50)).unwrap();
    sim.step();
    sim.add(request(2, toks(2, 700), 2)).unwrap();
    let plan = sim.plan().unwrap();
    let chunk = plan.seqs.iter().find(|s| s.request_id == 2).unwrap();
    assert_eq!(chunk.new_tokens.len(), 192, "budget 256 - 1 decode = 255, cut down to the grid");
    assert_eq!(plan.snapshots.len(), 1);
    assert_eq!(plan.snapshots[0].upto, 192);
    sim.execute(&plan);
    sim.run_until_idle(100);
    let ends: Vec<u32> = sim
        .plans
        .iter()
        .flat_map(|p| p.seqs.iter())
        .filter(|s| s.request_id == 2 && s.sample.is_none())
        .map(|s| s.context_len())
        .collect();
    assert!(ends.iter().all(|e| e % 64 == 0), "non-final chunks end on the grid: {ends:?}");
    let captures: Vec<u32> = sim
        .plans
        .iter()
        .flat_map(|p| p.snapshots.iter().map(move |c| (p, c)))
        .filter(|(p, c)| p.seqs[c.seq_index as usize].request_id == 2)
        .map(|(_, c)| c.upto)
        .collect();
    assert_eq!(captures, vec![192, 384, 576, 640], "each chunk's end, then the last grid point <= 699");
    sim.assert_clean();
}

/// Aborts: mid-prefill (its chunks' snapshots stay usable), while a step is in flight (no donation, the
/// pending capture is given back), and while a restore is pending.
#[test]
fn aborts_mid_prefill_keep_committed_snapshots_and_release_everything_else() {
    let mut sim = Sim::new(SchedulerConfig { max_prefill_tokens: 128, ..hybrid_cfg() });
    let p = toks(1, 600);
    sim.add(request(1, p.clone(), 5)).unwrap();
    sim.step();
    sim.step();
    sim.finish(1, FinishReason::Abort); // 256 computed, snapshots at 128 and 256
    assert!(snapshot_at(&sim, &p[..256]).is_some() && snapshot_at(&sim, &p[..128]).is_some());
    sim.add(request(2, p.clone(), 5)).unwrap();
    sim.run_until_idle(100);
    assert_eq!(sim.outcome(2).cached_tokens, Some(256));

    // Aborted while its first chunk is in flight: the capture slot goes back, nothing is cached.
    let q = toks(2, 300);
    sim.add(request(3, q.clone(), 5)).unwrap();
    let plan = sim.plan().unwrap();
    assert_eq!(plan.snapshots.len(), 1);
    let used = sim.sched.stats().snapshot_slots_used;
    sim.finish(3, FinishReason::Abort);
    assert_eq!(sim.sched.stats().snapshot_slots_used, used - 1, "the pending capture is freed");
    sim.sched.commit(&plan, &StepOutput { tokens: vec![0; plan.num_sampled()], ..Default::default() });
    sim.sched.check_integrity().unwrap();
    assert!(snapshot_at(&sim, &q[..128]).is_none());

    // Aborted with its restore pending (first step in flight): the snapshot lock is released.
    sim.add(request(4, p.clone(), 5)).unwrap();
    let plan = sim.plan().unwrap();
    assert_eq!(plan.state_copies.len(), 1);
    let locked = |sim: &Sim| sim.sched.kv_cache().tree().cached_snapshots().iter().filter(|s| s.2 > 0).count();
    assert_eq!(locked(&sim), 1);
    sim.finish(4, FinishReason::Abort);
    assert_eq!(locked(&sim), 0);
    sim.sched.commit(&plan, &StepOutput { tokens: vec![0; plan.num_sampled()], ..Default::default() });
    sim.sched.check_integrity().unwrap();
    sim.add(request(5, p.clone(), 5)).unwrap();
    sim.run_until_idle(100);
    assert!(sim.outcome(5).cached_tokens.unwrap() >= 256);
    sim.assert_clean();
}

/// A request aborted while a step of it is in flight must not donate its live slot: the device still
/// runs that step and advances the slot past what the scheduler committed. The fake worker runs the plan
/// after the abort, as the device would, so a donated slot would hold the wrong state for the next restore.
#[test]
fn abort_with_a_step_in_flight_donates_nothing() {
    let mut sim = Sim::new(hybrid_cfg());
    let p = toks(1, 300);
    sim.add(request(1, p.clone(), 5)).unwrap();
    sim.step(); // 0..256, snapshot at 256
    sim.step(); // 256..300, samples a token
    let plan = sim.plan().unwrap(); // the decode of position 300 in flight
    sim.finish(1, FinishReason::Abort); // 300 tokens computed: the live slot must not become their state
    let out = sim.worker.execute(&plan); // the device runs it anyway: the slot now holds 301 tokens
    sim.sched.commit(&plan, &out);
    sim.sched.check_integrity().unwrap();
    assert!(snapshot_at(&sim, &p).is_none(), "no donation at 300");
    let q: Vec<u32> = p.iter().copied().chain(toks(9, 10)).collect();
    sim.add(request(2, q, 5)).unwrap();
    sim.run_until_idle(100);
    assert_eq!(sim.outcome(2).cached_tokens, Some(256));
    sim.assert_clean();
}

/// A failed first step of a restoring request releases its snapshot lock and caches nothing.
#[test]
fn a_failed_restore_step_releases_the_snapshot() {
    let mut sim = Sim::new(hybrid_cfg());
    let p = toks(1, 300);
    sim.add(request(1, p.clone(), 3)).unwrap();
    sim.run_until_idle(50);
    sim.add(request(2, p.clone(), 3)).unwrap();
    let plan = sim.plan().unwrap();
    assert_eq!(plan.state_copies.len(), 1);
    sim.fail(&plan, "injected out of memory");
    assert!(sim.outcome(2).failed.is_some());
    sim.add(request(3, p.clone(), 3)).unwrap();
    sim.run_until_idle(50);
    assert_eq!(sim.outcome(3).cached_tokens, Some(256));
    sim.assert_clean();
}

/// `--enable-special-token-ckpt`: the state right after a sampled tool-call opener is kept, so a client
/// that re-renders the call body resumes right after the opener.
#[test]
fn special_token_checkpoint_resumes_right_after_the_opener() {
    for token_ckpt in [Some(777), None] {
        let mut sim = Sim::new(SchedulerConfig { snapshot_token_id: token_ckpt, ..hybrid_cfg() });
        let p = toks(3, 100);
        sim.add(request(1, p.clone(), 10)).unwrap();
        sim.worker.script.insert((1, 4), 777);
        sim.run_until_idle(50);
        let out = sim.outcome(1).tokens.clone();
        assert_eq!(out[4], 777);
        let mut next: Vec<u32> = p.iter().chain(&out[..5]).copied().collect();
        next.extend(toks(4, 30)); // the call body as the client renders it, then the tool result
        sim.add(request(2, next, 3)).unwrap();
        sim.run_until_idle(50);
        let want = if token_ckpt.is_some() { 105 } else { 64 };
        assert_eq!(sim.outcome(2).cached_tokens, Some(want));
        sim.assert_clean();
    }
}

/// With two snapshot slots, snapshots are evicted (tombstoned) to make room; KV-only nodes give no hit,
/// and the next request over them re-snapshots the branch point.
#[test]
fn evicted_snapshots_leave_kv_only_tombstones() {
    let mut sim = Sim::new(SchedulerConfig { num_state_slots: 6, num_snapshot_slots: 2, ..hybrid_cfg() });
    let a = toks(1, 300);
    sim.add(request(1, a.clone(), 3)).unwrap();
    sim.run_until_idle(50); // snapshots at 256 (chunk) and 302 (donated)
    let a_end: Vec<u32> = a.iter().chain(&sim.outcome(1).tokens[..2]).copied().collect();
    assert!(snapshot_at(&sim, &a[..256]).is_some() && snapshot_at(&sim, &a_end).is_some());
    sim.add(request(2, toks(2, 200), 3)).unwrap();
    sim.run_until_idle(50); // its capture at 192 and its donation at 202 evict both of A's, LRU first
    assert!(snapshot_at(&sim, &a[..256]).is_none() && snapshot_at(&sim, &a_end).is_none());
    assert_eq!(sim.sched.kv_cache().tree().num_snapshots(), 2);
    let cached = sim.sched.stats().cached_tokens_in_tree;
    assert!(cached >= 300 + 200, "the KV stays as tombstones: {cached}");
    sim.add(request(3, a.clone(), 3)).unwrap();
    sim.run_until_idle(50);
    assert_eq!(sim.outcome(3).cached_tokens, Some(0), "KV without a state gives no hit");
    assert!(snapshot_at(&sim, &a[..256]).is_some(), "the branch point over the tombstones is re-snapshotted");
    sim.add(request(4, a.clone(), 3)).unwrap();
    sim.run_until_idle(50);
    assert_eq!(sim.outcome(4).cached_tokens, Some(256));
    let st = sim.sched.stats();
    assert!(st.snapshot_slots_used <= 2 && st.snapshot_slots_total == 2);
    sim.assert_clean();
}

/// Stats while requests run: live slots and locked snapshots are used, cached snapshots are evictable.
#[test]
fn stats_count_live_slots_and_snapshots() {
    let mut sim = Sim::new(hybrid_cfg());
    let p = toks(1, 300);
    sim.add(request(1, p.clone(), 3)).unwrap();
    sim.run_until_idle(50);
    let st = sim.sched.stats();
    assert_eq!((st.state_slots_total, st.snapshot_slots_total), (12, 8));
    assert_eq!((st.snapshot_slots_used, st.evictable_snapshots, st.state_slots_used), (2, 2, 0));
    sim.add(request(2, p.clone(), 3)).unwrap();
    let plan = sim.plan().unwrap();
    let st = sim.sched.stats();
    // live slot + the locked snapshot it restores; no capture (no grid point in 256..299)
    assert_eq!((st.state_slots_used, st.free_state_slots, st.evictable_snapshots), (2, 3, 1));
    assert!((st.mamba_usage() - 2.0 / 12.0).abs() < 1e-9);
    sim.execute(&plan);
    sim.run_until_idle(50);
    sim.assert_clean();
}

/// Random multi-turn conversations, shared system prompts, identical resends, aborts and step failures,
/// under pressure on both currencies (few snapshot slots, a small KV pool, a fine grid). Every request
/// ends, every restored state is right (checked by the fake worker), and every KV page and state slot
/// is accounted for at the end.
fn random_hybrid_run(cfg: SchedulerConfig, seed: u64, total: u64, min_hits: usize) -> Sim {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut sim = Sim::new(cfg.clone());
    sim.worker.favourite = cfg.snapshot_token_id;
    let systems: Vec<Vec<u32>> = (0..3).map(|k| toks(50 + k, rng.gen_range(20..90))).collect();
    let mut finished: Vec<Vec<u32>> = Vec::new(); // full histories of finished requests (prompt + output)
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    let mut next_id = 0u64;
    let mut idle = 0;
    let mut snapshot_cap_reached = 0;
    let mut recorded = std::collections::HashSet::new();
    while next_id < total || !sim.sched.is_idle() {
        if next_id < total && rng.gen_bool(0.3) {
            let mut prompt = match rng.gen_range(0..10) {
                // The next turn of a conversation, mostly of one that just finished (users answer soon).
                0..=3 if !finished.is_empty() => {
                    let recent = if rng.gen_bool(0.7) { finished.len().saturating_sub(4) } else { 0 };
                    finished[rng.gen_range(recent..finished.len())].clone()
                }
                4 if !prompts.is_empty() => prompts[rng.gen_range(0..prompts.len())].clone(), // resent as is
                5..=7 => systems[rng.gen_range(0..3)].clone(),
                _ => Vec::new(),
            };
            if prompt.is_empty() || !prompts.contains(&prompt) {
                prompt.extend(toks(1000 + next_id as u32, rng.gen_range(1..60)));
            }
            prompt.truncate(cfg.max_context / 2);
            let mut req = request(next_id, prompt.clone(), rng.gen_range(1..30));
            if rng.gen_bool(0.3) {
                req.stop_token_ids = (100..140).collect();
            }
            sim.add(req).unwrap();
            prompts.push(prompt);
            next_id += 1;
        }
        if rng.gen_bool(0.04) && next_id > 0 {
            let id = rng.gen_range(0..next_id);
            if !sim.outcome(id).ended() {
                sim.finish(id, FinishReason::Abort);
            }
        }
        match sim.plan() {
            Some(plan) if rng.gen_bool(0.02) => sim.fail(&plan, "injected out of memory"),
            Some(plan) => sim.execute(&plan),
            None => idle += 1,
        }
        let st = sim.sched.stats();
        if st.snapshot_slots_used == st.snapshot_slots_total {
            snapshot_cap_reached += 1;
        }
        for id in 0..next_id {
            let o = sim.outcome(id);
            if o.finished.is_some() && !o.tokens.is_empty() && recorded.insert(id) {
                let mut h = prompts[id as usize].clone();
                h.extend(&o.tokens);
                finished.push(h);
            }
        }
        assert!(sim.steps + idle < 100_000, "run does not terminate");
    }
    for id in 0..total {
        assert!(sim.outcome(id).ended(), "request {id} never ended");
    }
    let hits = sim.outcomes.values().filter(|o| o.cached_tokens.unwrap_or(0) > 0).count();
    let st = sim.sched.stats();
    assert!(hits >= min_hits, "only {hits} hits of {total}");
    // Every hit restores once, unless its first step failed or it was aborted before that step ran.
    assert!(st.snapshot_hits as usize == hits && sim.worker.copies <= hits && sim.worker.copies * 4 >= hits * 3);
    assert!(snapshot_cap_reached > 50, "the snapshot pool was never under pressure");
    sim.assert_clean();
    sim
}

#[test]
fn random_conversations_under_pressure_on_both_currencies_end_cleanly() {
    let base = SchedulerConfig {
        max_prefill_tokens: 96,
        kv_capacity_tokens: 1536,
        max_context: 1024,
        num_state_slots: 4 + 3,
        num_snapshot_slots: 3,
        snapshot_interval: 16,
        ..hybrid_cfg()
    };
    // (name, config, least requests that must resume from a snapshot, of 200)
    let configs = [
        ("page 1", base.clone(), 10),
        ("page 4", SchedulerConfig { page_size: 4, ..base.clone() }, 10),
        (
            "page 2 interleaved",
            SchedulerConfig { page_size: 2, mixed_decode: false, decode_interleave_every: 2, ..base.clone() },
            10,
        ),
        ("anchor token", SchedulerConfig { snapshot_token_id: Some(105), ..base.clone() }, 10),
        ("more snapshots", SchedulerConfig { num_state_slots: 4 + 8, num_snapshot_slots: 8, ..base.clone() }, 40),
    ];
    for (name, cfg, min_hits) in configs {
        for seed in 0..3 {
            let sim = random_hybrid_run(cfg.clone(), seed, 200, min_hits);
            eprintln!(
                "{name} seed {seed}: {} steps, {} restores, {} captures, hits {:?}",
                sim.steps,
                sim.worker.copies,
                sim.worker.captures,
                sim.sched.stats().snapshot_hit_tokens
            );
            if cfg.snapshot_token_id.is_some() {
                assert!(sim.worker.anchor_captures > 10, "{name}: {} anchor captures", sim.worker.anchor_captures);
            }
        }
    }
}
