//! Scheduler tests over simulated steps: the fake worker in `common/sim.rs` checks the step contract on
//! every plan (rows, page-table deltas, prefix lengths, KV contents by prefix hash, sample placement) and
//! the driver checks the step budget, capacity and `check_integrity()` after every step.

mod common;

use std::collections::HashSet;

use common::sim::{request, Sim};
use ft_core::config::{CacheType, SchedulerConfig};
use ft_core::request::{AdmissionError, FinishReason, RequestEvent, SamplingParams};
use ft_core::scheduler::{sample_seed, Scheduler, PROMPT_LOGPROBS_CHUNK};
use ft_core::step::{StepKind, StepOutput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn small_cfg() -> SchedulerConfig {
    SchedulerConfig {
        max_running_requests: 4,
        max_prefill_tokens: 64,
        kv_capacity_tokens: 512,
        page_size: 1,
        max_context: 256,
        cache_type: CacheType::Radix,
        mixed_decode: true,
        decode_interleave_every: 0,
        num_state_slots: 0,
        num_snapshot_slots: 0,
        snapshot_interval: 64,
        snapshot_token_id: None,
        seed: 7,
    }
}

/// Random arrivals (sharing system prompts so the cache hits), random aborts of queued and running
/// requests, random step failures. Every request must end, admission must be strictly FCFS, and after
/// the last request the pool holds nothing but evictable cache.
fn random_run(cfg: SchedulerConfig, seed: u64, total: u64) -> Sim {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut sim = Sim::new(cfg.clone());
    let system_prompts: Vec<Vec<u32>> =
        (0..3).map(|k| (0..rng.gen_range(10..60)).map(|i| (k * 1000 + i) as u32).collect()).collect();
    let mut next_id = 0u64;
    let mut aborted_queued = HashSet::new();
    let mut idle_polls = 0;
    while next_id < total || !sim.sched.is_idle() {
        // Arrivals.
        if next_id < total && rng.gen_bool(0.3) {
            for _ in 0..rng.gen_range(1..=3) {
                let mut prompt =
                    if rng.gen_bool(0.7) { system_prompts[rng.gen_range(0..3)].clone() } else { Vec::new() };
                let extra = rng.gen_range(if prompt.is_empty() { 1 } else { 0 }..150);
                prompt.extend((0..extra).map(|_| rng.gen_range(0..50)));
                let mut req = request(next_id, prompt, rng.gen_range(1..40));
                if rng.gen_bool(0.5) {
                    req.stop_token_ids = (100..140).collect(); // ~4% per token
                    req.ignore_eos = rng.gen_bool(0.2);
                }
                if rng.gen_bool(0.5) {
                    req.sampling.seed = Some(rng.gen());
                }
                if rng.gen_bool(0.2) {
                    req.sampling.prompt_logprobs = rng.gen_bool(0.5);
                    req.sampling.top_logprobs = rng.gen_range(0..=3);
                }
                sim.add(req).expect("random requests are valid");
                next_id += 1;
            }
        }
        // Aborts (client gone) and stop-string finishes of queued or running requests.
        if rng.gen_bool(0.05) && next_id > 0 {
            let id = rng.gen_range(0..next_id);
            if !sim.outcome(id).ended() {
                if sim.outcome(id).started_step.is_none() {
                    aborted_queued.insert(id);
                }
                let reason = if rng.gen_bool(0.5) { FinishReason::Abort } else { FinishReason::Stop };
                sim.finish(id, reason);
            }
        }
        match sim.plan() {
            Some(plan) if rng.gen_bool(0.02) => sim.fail(&plan, "injected out of memory"),
            Some(plan) => sim.execute(&plan),
            None => {
                assert!(sim.sched.is_idle(), "nothing to run while requests wait");
                idle_polls += 1;
            }
        }
        assert!(sim.steps + idle_polls < 50_000, "run does not terminate");
    }
    // Strict FCFS: requests start in arrival order; only those aborted while queued never start.
    let pos: Vec<usize> =
        sim.start_order.iter().map(|id| sim.add_order.iter().position(|a| a == id).unwrap()).collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "admission was not first come, first served");
    for id in 0..total {
        let o = sim.outcome(id);
        assert!(o.ended(), "request {id} never ended");
        assert!(o.started_step.is_some() || aborted_queued.contains(&id), "request {id} never started");
    }
    sim.assert_clean();
    sim
}

#[test]
fn random_arrivals_aborts_and_failures_all_end_cleanly() {
    let hybrid = SchedulerConfig { num_state_slots: 2, page_size: 4, ..small_cfg() };
    let configs = [
        ("radix page 1 mixed", small_cfg()),
        ("radix page 4 mixed", SchedulerConfig { page_size: 4, ..small_cfg() }),
        ("naive page 1 mixed", SchedulerConfig { cache_type: CacheType::Naive, ..small_cfg() }),
        (
            "radix page 2 interleave 2",
            SchedulerConfig { mixed_decode: false, decode_interleave_every: 2, page_size: 2, ..small_cfg() },
        ),
        ("radix page 1 prefill-first", SchedulerConfig { mixed_decode: false, ..small_cfg() }),
        ("hybrid 2 state slots page 4", hybrid),
        ("big pages tight pool", SchedulerConfig { page_size: 16, kv_capacity_tokens: 320, ..small_cfg() }),
    ];
    for (name, cfg) in configs {
        for seed in 0..4 {
            let sim = random_run(cfg.clone(), seed, 150);
            let hits = sim.outcomes.values().filter(|o| o.cached_tokens.unwrap_or(0) > 0).count();
            let failed = sim.outcomes.values().filter(|o| o.failed.is_some()).count();
            // The run must exercise what it claims to (cache hits, failures), or it proves nothing.
            assert!(failed > 0, "{name} seed {seed}: no failures injected");
            if cfg.cache_type == CacheType::Radix && cfg.num_state_slots == 0 {
                assert!(hits > 10, "{name} seed {seed}: only {hits} cache hits");
            } else {
                assert_eq!(hits, 0, "{name}: naive cache or hybrid model (no state snapshots yet) reported a hit");
            }
        }
    }
}

/// Three decoders are running when a 100k-token prompt arrives; returns, per decoder, the longest gap in
/// steps between two of its tokens, and the number of steps the long prompt took to prefill.
fn decode_gaps_during_long_prefill(mixed: bool, every: usize) -> (Vec<u64>, u64) {
    let cfg = SchedulerConfig {
        max_running_requests: 4,
        max_prefill_tokens: 8192,
        kv_capacity_tokens: 110_000,
        max_context: 120_000,
        mixed_decode: mixed,
        decode_interleave_every: every,
        ..SchedulerConfig::default()
    };
    let mut sim = Sim::new(cfg);
    for id in 0..3 {
        sim.add(request(id, vec![1, 2, 3, id as u32 + 10], 120)).unwrap();
    }
    while sim.outcome(0).tokens.len() < 2 {
        assert!(sim.step());
    }
    let long: Vec<u32> = (0..100_000u32).map(|i| i % 30_000).collect();
    sim.add(request(99, long, 4)).unwrap();
    let mut prefill_steps = 0;
    while sim.outcome(99).tokens.is_empty() {
        let plan = sim.plan().unwrap();
        if plan.seqs.iter().any(|s| s.request_id == 99) {
            prefill_steps += 1;
        }
        sim.execute(&plan);
    }
    sim.run_until_idle(1000);
    sim.assert_clean();
    ((0..3).map(|id| sim.outcome(id).max_token_gap()).collect(), prefill_steps)
}

#[test]
fn mixed_decode_carries_decoders_through_a_100k_prefill() {
    let (gaps, prefill_steps) = decode_gaps_during_long_prefill(true, 0);
    assert_eq!(prefill_steps, 13, "100k tokens in chunks of 8192 minus 3 decode tokens");
    assert_eq!(gaps, vec![1, 1, 1], "every step carries a token for every decoder");
}

#[test]
fn interleaved_decode_waits_at_most_n_prefill_steps() {
    for n in [1, 3] {
        let (gaps, prefill_steps) = decode_gaps_during_long_prefill(false, n);
        assert_eq!(prefill_steps, 13);
        for g in gaps {
            assert_eq!(g, n as u64 + 1, "decode every {n} prefill steps: gap of n prefill steps + the decode step");
        }
    }
}

#[test]
fn prefill_first_starves_decoders_for_the_whole_prefill() {
    let (gaps, prefill_steps) = decode_gaps_during_long_prefill(false, 0);
    assert_eq!(prefill_steps, 13);
    for g in gaps {
        assert!(g > 13, "prefill-first: no decode until the 100k prompt is done (gap {g})");
    }
}

/// A request wanting prompt logprobs computes its whole prompt although the cache holds it, in chunks of at
/// most `PROMPT_LOGPROBS_CHUNK` (and the step budget), and gets every position after the first, in order, then
/// its tokens with their top alternatives (the sim checks positions, order and `next_token`).
#[test]
fn prompt_logprobs_cover_every_position_and_bypass_the_cache() {
    let cfg = SchedulerConfig { max_prefill_tokens: 2048, kv_capacity_tokens: 4096, max_context: 2048, ..small_cfg() };
    let mut sim = Sim::new(cfg);
    sim.keep_plans = true;
    let prompt: Vec<u32> = (0..1100).map(|i| i % 97).collect();
    sim.add(request(1, prompt.clone(), 2)).unwrap();
    sim.run_until_idle(100);
    let mut req = request(2, prompt.clone(), 3);
    req.sampling.prompt_logprobs = true;
    req.sampling.top_logprobs = 2;
    sim.add(req).unwrap();
    sim.add(request(3, prompt.clone(), 2)).unwrap(); // the same prompt beside it still hits the cache
    sim.run_until_idle(100);
    let chunks: Vec<usize> = sim
        .plans
        .iter()
        .flat_map(|p| p.seqs.iter())
        .filter(|s| s.request_id == 2 && s.prompt_logprobs.is_some())
        .map(|s| s.new_tokens.len())
        .collect();
    assert_eq!(chunks, vec![PROMPT_LOGPROBS_CHUNK, PROMPT_LOGPROBS_CHUNK, 1100 - 2 * PROMPT_LOGPROBS_CHUNK]);
    let o = sim.outcome(2);
    assert_eq!((o.cached_tokens, o.prompt_logprobs_upto, o.tokens.len()), (Some(0), 1100, 3));
    assert_eq!(sim.outcome(3).cached_tokens, Some(1099));
    for e in &o.events {
        if let RequestEvent::Token { top_logprobs, .. } = e {
            assert_eq!(top_logprobs.len(), 2);
        }
    }
    sim.assert_clean();
}

fn repeated_prompt(page_size: usize, cache_type: CacheType) {
    let cfg = SchedulerConfig { page_size, cache_type, ..small_cfg() };
    let mut sim = Sim::new(cfg);
    sim.keep_plans = true;
    let prompt: Vec<u32> = (0..37).collect();
    sim.add(request(1, prompt.clone(), 5)).unwrap();
    sim.run_until_idle(100);
    let first_slots: Vec<u32> = sim
        .plans
        .iter()
        .flat_map(|p| p.seqs.iter())
        .filter(|s| s.request_id == 1)
        .flat_map(|s| s.table_slots.iter().copied())
        .collect();
    let out1 = sim.outcome(1).tokens.clone();
    assert_eq!(out1.len(), 5);
    assert_eq!(sim.outcome(1).cached_tokens, Some(0));

    // The same prompt again: everything but the last prompt token comes from the cache.
    sim.plans.clear();
    sim.add(request(2, prompt.clone(), 5)).unwrap();
    let plan = sim.plan().unwrap();
    let seq = &plan.seqs[0];
    let summary = sim.sched.plan_summary(&plan);
    let expect_cached = if cache_type == CacheType::Radix { 36 / page_size * page_size } else { 0 };
    assert_eq!(seq.prefix_len as usize, expect_cached);
    assert_eq!(seq.table_from, 0, "the first chunk after a hit sends the cached slots too");
    assert_eq!(seq.table_slots.len(), 37);
    assert_eq!(&seq.table_slots[..expect_cached], &first_slots[..expect_cached], "cached slots are the first run's");
    assert_eq!(summary.new_seqs, 1);
    assert_eq!(summary.cached_tokens, expect_cached);
    assert_eq!(summary.new_tokens, 37 - expect_cached);
    sim.execute(&plan);
    sim.run_until_idle(100);
    assert_eq!(sim.outcome(2).cached_tokens, Some(expect_cached as u32));

    // A follow-up turn: prompt + the first answer + more. The answer's KV (all but the last sampled
    // token's) was cached too; the fake worker verifies by prefix hash that the slots hold it.
    let mut turn2 = prompt.clone();
    turn2.extend(&out1);
    turn2.extend([7, 7, 7]);
    sim.add(request(3, turn2, 3)).unwrap();
    sim.run_until_idle(100);
    let computed_first_run = 37 + 4;
    let expect = if cache_type == CacheType::Radix { computed_first_run / page_size * page_size } else { 0 };
    assert_eq!(sim.outcome(3).cached_tokens, Some(expect as u32));
    sim.assert_clean();
}

#[test]
fn repeated_prompt_hits_the_cache_page_1() {
    repeated_prompt(1, CacheType::Radix);
}

#[test]
fn repeated_prompt_hits_the_cache_page_4() {
    repeated_prompt(4, CacheType::Radix);
}

/// `n > 1` choices: the HTTP layer submits the other choices once the first has sampled a token; by then the
/// radix cache holds its prompt (whole pages), though the first still runs.
#[test]
fn prompt_is_cached_once_computed_while_the_request_runs() {
    for page_size in [1, 4] {
        let mut sim = Sim::new(SchedulerConfig { page_size, ..small_cfg() });
        let prompt: Vec<u32> = (0..37).map(|i| 100 + i).collect();
        sim.add(request(1, prompt.clone(), 20)).unwrap();
        let plan = sim.plan().unwrap();
        sim.execute(&plan);
        assert_eq!(sim.outcome(1).tokens.len(), 1, "the prompt's step sampled its first token");
        assert!(!sim.outcome(1).ended());
        assert_eq!(sim.sched.stats().cached_tokens_in_tree, 37 / page_size * page_size);
        sim.add(request(2, prompt.clone(), 3)).unwrap();
        sim.run_until_idle(100);
        assert_eq!(sim.outcome(2).cached_tokens, Some((36 / page_size * page_size) as u32));
        assert!(sim.outcome(1).ended());
        sim.assert_clean();
    }
}

#[test]
fn naive_cache_never_reports_cached_tokens() {
    repeated_prompt(1, CacheType::Naive);
    let mut sim = Sim::new(SchedulerConfig { cache_type: CacheType::Naive, ..small_cfg() });
    sim.add(request(1, vec![5; 20], 2)).unwrap();
    sim.run_until_idle(50);
    assert_eq!(sim.sched.stats().cached_tokens_in_tree, 0, "naive frees everything at finish");
}

#[test]
fn admission_validates_and_clamps() {
    let mut s = Scheduler::new(SchedulerConfig {
        max_context: 100,
        kv_capacity_tokens: 1000,
        max_prefill_tokens: 1000,
        ..small_cfg()
    });
    assert_eq!(s.add_request(request(1, vec![], 5)), Err(AdmissionError::EmptyPrompt));
    assert_eq!(
        s.add_request(request(1, vec![0; 100], 5)),
        Err(AdmissionError::ContextLengthExceeded { prompt_tokens: 100, max_context: 100 })
    );
    s.add_request(request(1, vec![0; 90], 50)).unwrap();
    assert_eq!(s.add_request(request(1, vec![0; 3], 5)), Err(AdmissionError::DuplicateId(1)));
    s.add_request(request(2, vec![0; 99], 50)).unwrap();
    s.add_request(request(3, vec![0; 5], 0)).unwrap();
    s.next_step().unwrap();
    let budgets: Vec<(u64, u32)> = s
        .drain_events()
        .into_iter()
        .filter_map(|e| match e {
            RequestEvent::Started { id, max_new_tokens, .. } => Some((id, max_new_tokens)),
            _ => None,
        })
        .collect();
    assert_eq!(budgets, vec![(1, 10), (2, 1), (3, 1)], "clamped to max_context - prompt, at least 1");
    assert_eq!(s.add_request(request(2, vec![1; 3], 5)), Err(AdmissionError::DuplicateId(2)), "running ids too");

    // The pool caps the budget as well (as SGLang caps requests at the pool size).
    let mut s = Scheduler::new(SchedulerConfig { kv_capacity_tokens: 64, max_context: 1000, ..small_cfg() });
    assert_eq!(
        s.add_request(request(1, vec![0; 65], 5)),
        Err(AdmissionError::TooLargeForCache { needed_tokens: 65, capacity_tokens: 64 })
    );
    s.add_request(request(1, vec![0; 60], 100)).unwrap();
    s.next_step().unwrap();
    assert!(matches!(s.drain_events()[0], RequestEvent::Started { max_new_tokens: 5, .. }));
}

#[test]
fn length_finish_at_budget_and_context() {
    let mut sim = Sim::new(SchedulerConfig { max_context: 40, ..small_cfg() });
    sim.add(request(1, vec![3; 30], 1000)).unwrap();
    sim.add(request(2, vec![3; 10], 4)).unwrap();
    sim.run_until_idle(100);
    assert_eq!(sim.outcome(1).tokens.len(), 10, "prompt 30 + 10 = max_context 40");
    assert_eq!(sim.outcome(1).finished, Some(FinishReason::Length));
    assert_eq!(sim.outcome(2).tokens.len(), 4);
    assert_eq!(sim.outcome(2).finished, Some(FinishReason::Length));
    sim.assert_clean();
}

#[test]
fn stop_tokens_end_requests_unless_ignore_eos() {
    let mut sim = Sim::new(small_cfg());
    for (id, ignore_eos) in [(1, false), (2, true), (3, false)] {
        let mut r = request(id, vec![1, 2, 3], 6);
        r.stop_token_ids = vec![7, 8];
        r.ignore_eos = ignore_eos;
        sim.add(r).unwrap();
    }
    sim.worker.script.insert((1, 2), 7);
    sim.worker.script.insert((2, 2), 7);
    sim.worker.script.insert((3, 0), 8); // the very first token
    sim.run_until_idle(100);
    let o1 = sim.outcome(1);
    assert_eq!(o1.tokens.len(), 3);
    assert_eq!(o1.tokens[2], 7, "the stop token is reported as a token");
    assert_eq!(o1.finished, Some(FinishReason::Stop));
    let o2 = sim.outcome(2);
    assert_eq!(o2.tokens.len(), 6);
    assert_eq!(o2.tokens[2], 7);
    assert_eq!(o2.finished, Some(FinishReason::Length), "ignore_eos runs to the budget");
    let o3 = sim.outcome(3);
    assert_eq!((o3.tokens.clone(), o3.finished), (vec![8], Some(FinishReason::Stop)));
    sim.assert_clean();
}

#[test]
fn fail_step_frees_only_the_steps_requests() {
    // Prefill-first without mixing: a prefill step holds only the new prompt, not the decoder.
    let mut sim = Sim::new(SchedulerConfig { mixed_decode: false, ..small_cfg() });
    sim.add(request(1, vec![1; 8], 10)).unwrap();
    sim.step();
    sim.add(request(2, vec![2; 8], 10)).unwrap();
    let plan = sim.plan().unwrap();
    assert_eq!(plan.kind, StepKind::Prefill);
    assert_eq!(plan.seqs.len(), 1);
    sim.fail(&plan, "CUDA out of memory");
    assert_eq!(sim.outcome(2).failed.as_deref(), Some("CUDA out of memory"));
    assert!(!sim.outcome(1).ended());
    assert_eq!(sim.sched.stats().running, 1);
    sim.run_until_idle(100);
    assert_eq!(sim.outcome(1).tokens.len(), 10);
    assert_eq!(sim.outcome(1).finished, Some(FinishReason::Length));
    sim.assert_clean();

    // A mixed step fails everyone in it; a worker answer with the wrong token count fails the step too.
    let mut sim = Sim::new(small_cfg());
    sim.add(request(1, vec![1; 8], 10)).unwrap();
    sim.step();
    sim.add(request(2, vec![2; 8], 10)).unwrap();
    sim.add(request(3, vec![3; 8], 10)).unwrap();
    let plan = sim.plan().unwrap();
    assert_eq!(plan.kind, StepKind::Mixed);
    sim.sched.commit(&plan, &StepOutput { tokens: vec![1], ..Default::default() });
    sim.finish(999, FinishReason::Abort); // unknown id: no-op (and flushes events into the sim)
    for id in 1..=3 {
        assert!(sim.outcome(id).failed.as_deref().unwrap().contains("worker returned 1 tokens"));
    }
    sim.assert_clean();
}

#[test]
fn fail_all_ends_queued_and_running() {
    let mut sim = Sim::new(SchedulerConfig { max_running_requests: 2, ..small_cfg() });
    for id in 0..5 {
        sim.add(request(id, vec![id as u32; 30], 10)).unwrap();
    }
    sim.step();
    sim.step();
    assert_eq!(sim.sched.stats().running, 2);
    sim.sched.fail_all("engine stopped");
    sim.finish(999, FinishReason::Abort);
    for id in 0..5 {
        assert_eq!(sim.outcome(id).failed.as_deref(), Some("engine stopped"));
    }
    sim.assert_clean();
}

#[test]
fn abort_of_queued_and_running_requests() {
    let mut sim = Sim::new(SchedulerConfig { max_running_requests: 1, ..small_cfg() });
    sim.add(request(1, vec![1; 20], 50)).unwrap();
    sim.add(request(2, vec![2; 20], 50)).unwrap();
    sim.step();
    sim.step();
    sim.finish(2, FinishReason::Abort); // queued
    sim.finish(1, FinishReason::Abort); // running, 2 tokens in
    assert_eq!(sim.outcome(2).finished, Some(FinishReason::Abort));
    assert_eq!(sim.outcome(1).finished, Some(FinishReason::Abort));
    assert_eq!(sim.outcome(1).tokens.len(), 2);
    assert!(sim.outcome(2).started_step.is_none());
    // The aborted request's computed KV (prompt + first token) is cached.
    assert_eq!(sim.sched.stats().cached_tokens_in_tree, 21);
    assert!(!sim.step());
    sim.assert_clean();
}

#[test]
fn finish_while_the_step_is_in_flight_skips_it_at_commit() {
    let mut s = Scheduler::new(small_cfg());
    s.add_request(request(1, vec![1; 10], 5)).unwrap();
    s.add_request(request(2, vec![2; 10], 5)).unwrap();
    let plan = s.next_step().unwrap();
    assert_eq!(plan.seqs.len(), 2);
    s.finish(1, FinishReason::Abort);
    s.check_integrity().unwrap();
    // Its KV is not computed yet: nothing may be cached for it.
    assert_eq!(s.stats().cached_tokens_in_tree, 0);
    s.commit(&plan, &StepOutput { tokens: vec![500, 501], logprobs: vec![], ..Default::default() });
    let ev = s.drain_events();
    assert!(ev.iter().all(|e| !matches!(e, RequestEvent::Token { id: 1, .. })), "no token after Finished: {ev:?}");
    assert!(ev.contains(&RequestEvent::Token { id: 2, token: 501, logprob: 0.0, top_logprobs: vec![] }));
    s.check_integrity().unwrap();
    // A second plan while the first is in flight holds only what is not in flight.
    let p2 = s.next_step().unwrap();
    assert!(s.next_step().is_none(), "request 2 is in flight: nothing else to run");
    s.commit(&p2, &StepOutput { tokens: vec![502], logprobs: vec![-1.0], ..Default::default() });
    s.check_integrity().unwrap();
}

#[test]
fn seeded_sampling_is_independent_of_the_batch() {
    let mut seeded = request(42, (0..50).collect(), 12);
    seeded.sampling = SamplingParams { temperature: 0.8, seed: Some(1234), ..SamplingParams::default() };

    let mut alone = Sim::new(small_cfg());
    alone.add(seeded.clone()).unwrap();
    alone.run_until_idle(100);

    // The same request in a crowd: different budget (so different chunking), other requests mixed in,
    // arriving third.
    let mut crowd = Sim::new(SchedulerConfig { max_prefill_tokens: 17, seed: 99, ..small_cfg() });
    crowd.add(request(1, vec![9; 40], 20)).unwrap();
    crowd.step();
    crowd.add(request(2, vec![8; 30], 20)).unwrap();
    crowd.add(seeded).unwrap();
    crowd.add(request(3, vec![7; 5], 20)).unwrap();
    crowd.run_until_idle(300);

    let expected: Vec<u64> = (0..12).map(|n| sample_seed(1234, n)).collect();
    assert_eq!(alone.worker.seeds(42), &expected[..]);
    assert_eq!(crowd.worker.seeds(42), &expected[..]);
    assert_eq!(alone.outcome(42).tokens, crowd.outcome(42).tokens);

    // Unseeded requests draw distinct seeds from the scheduler's stream, reproducibly.
    let first_seeds = |cfg_seed: u64| {
        let mut sim = Sim::new(SchedulerConfig { seed: cfg_seed, ..small_cfg() });
        sim.add(request(1, vec![1; 5], 3)).unwrap();
        sim.add(request(2, vec![1; 5], 3)).unwrap();
        sim.run_until_idle(50);
        (sim.worker.seeds(1)[0], sim.worker.seeds(2)[0])
    };
    let (a, b) = first_seeds(5);
    assert_ne!(a, b);
    assert_eq!(first_seeds(5), (a, b));
    assert_ne!(first_seeds(6), (a, b));
}

#[test]
fn chunked_prompt_continues_before_new_prompts_start() {
    let mut sim = Sim::new(SchedulerConfig { max_prefill_tokens: 32, ..small_cfg() });
    sim.keep_plans = true;
    sim.add(request(1, vec![1; 100], 2)).unwrap();
    sim.add(request(2, vec![2; 10], 2)).unwrap();
    sim.run_until_idle(100);
    let chunks: Vec<Vec<(u64, usize)>> = sim
        .plans
        .iter()
        .map(|p| p.seqs.iter().filter(|s| s.prefix_len < 100).map(|s| (s.request_id, s.new_tokens.len())).collect())
        .collect();
    assert_eq!(chunks[0], vec![(1, 32)]);
    assert_eq!(chunks[1], vec![(1, 32)]);
    assert_eq!(chunks[2], vec![(1, 32)]);
    // The last 4 tokens of 1 go first; 2 fills the rest of the budget in the same step.
    assert_eq!(chunks[3], vec![(1, 4), (2, 10)]);
    assert!(sim.plans[..3].iter().all(|p| p.num_sampled() == 0), "non-final chunks never sample");
    sim.assert_clean();
}

#[test]
fn big_request_at_the_head_blocks_later_ones_until_it_fits() {
    let mut sim = Sim::new(SchedulerConfig { kv_capacity_tokens: 100, max_context: 100, ..small_cfg() });
    sim.add(request(1, vec![1; 50], 30)).unwrap(); // reserves 79
    sim.step();
    sim.add(request(2, vec![2; 60], 30)).unwrap(); // needs 89: waits for 1
    sim.add(request(3, vec![3; 5], 2)).unwrap(); // would fit now, but must not overtake 2
    sim.run_until_idle(200);
    assert_eq!(sim.start_order, vec![1, 2, 3]);
    assert!(
        sim.outcome(2).started_step.unwrap() >= *sim.outcome(1).token_steps.last().unwrap(),
        "2 starts after 1 ends"
    );
    sim.assert_clean();
}

#[test]
fn reservation_counts_output_budget_and_cached_prefix_is_evictable() {
    let mut sim = Sim::new(SchedulerConfig { kv_capacity_tokens: 100, max_context: 100, ..small_cfg() });
    sim.add(request(1, vec![1; 40], 20)).unwrap();
    sim.step();
    let st = sim.sched.stats();
    // 40 prompt slots allocated; used counts allocated slots, not the reservation.
    assert_eq!(st.kv_used_tokens, 40);
    assert!((st.token_usage - 0.40).abs() < 1e-9);
    sim.add(request(2, vec![2; 42], 20)).unwrap(); // 61 > 100 - 59 reserved by 1: waits
    sim.step();
    assert_eq!(sim.sched.stats().running, 1);
    sim.run_until_idle(200);
    // 2's first chunk needed more than the free pages: 1's cached sequence (one 59-token node) was
    // evicted whole. Now 2's 61 computed tokens are cached (evictable) and a big new prompt evicts them.
    let st = sim.sched.stats();
    assert_eq!(st.cached_tokens_in_tree, 61);
    assert_eq!(st.kv_used_tokens, 0);
    sim.add(request(3, vec![3; 90], 5)).unwrap();
    sim.run_until_idle(50);
    assert_eq!(sim.outcome(3).tokens.len(), 5);
    sim.assert_clean();
}

#[test]
fn hybrid_requests_own_a_state_slot_and_wait_for_one() {
    let mut sim = Sim::new(SchedulerConfig { num_state_slots: 2, ..small_cfg() });
    for id in 0..4 {
        sim.add(request(id, vec![id as u32; 10], 5)).unwrap();
    }
    let plan = sim.plan().unwrap();
    assert_eq!(plan.seqs.len(), 2, "two state slots: two requests at a time despite four rows");
    let slots: HashSet<i32> = plan.seqs.iter().map(|s| s.state_slot).collect();
    assert_eq!(slots, HashSet::from([0, 1]));
    assert_eq!(sim.sched.stats().free_state_slots, 0);
    sim.execute(&plan);
    while sim.step() {
        assert!(sim.sched.stats().running <= 2);
    }
    sim.assert_clean();
}

#[test]
fn hybrid_models_get_no_prefix_hits_without_state_snapshots() {
    let mut sim = Sim::new(SchedulerConfig { num_state_slots: 2, ..small_cfg() });
    sim.add(request(1, vec![4; 30], 3)).unwrap();
    sim.run_until_idle(20);
    assert!(sim.sched.stats().cached_tokens_in_tree > 0, "the KV is still cached for the hybrid cache to come");
    sim.add(request(2, vec![4; 30], 3)).unwrap();
    sim.run_until_idle(20);
    assert_eq!(sim.outcome(2).cached_tokens, Some(0));
    sim.assert_clean();
}

#[test]
fn decode_steps_send_one_slot_per_sequence_and_summaries_count_them() {
    let mut sim = Sim::new(small_cfg());
    sim.add(request(1, vec![1; 10], 4)).unwrap();
    sim.add(request(2, vec![2; 10], 4)).unwrap();
    sim.step();
    let plan = sim.plan().unwrap();
    assert_eq!(plan.kind, StepKind::Decode);
    for s in &plan.seqs {
        assert_eq!((s.new_tokens.len(), s.table_slots.len(), s.table_from), (1, 1, s.prefix_len));
        assert!(s.sample.is_some());
    }
    let summary = sim.sched.plan_summary(&plan);
    assert_eq!((summary.decode_tokens, summary.new_seqs, summary.new_tokens), (2, 0, 0));
    sim.execute(&plan);
    sim.run_until_idle(20);
    sim.assert_clean();
}
