//! Overlap scheduling over simulated steps: `Sim { overlap: true }` plans step N+1 with
//! `Scheduler::next_step_ahead` and has the fake worker run it (as the device would, right after N, its input
//! token taken from N's sampled row) before N is committed. The fake worker checks every input token, KV slot and
//! recurrent state as in the synchronous tests; these tests check that the requests see exactly what the
//! synchronous loop gives them, and what happens to the token computed past a request's end.

mod common;

use common::sim::{request, Sim};
use ft_core::config::{snapshot_slots_for, CacheType, SchedulerConfig, DEFAULT_LINEAR_STATE_CACHE_RATIO};
use ft_core::request::{FinishReason, NewRequest, RequestEvent};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn small_cfg() -> SchedulerConfig {
    SchedulerConfig {
        max_running_requests: 4,
        max_prefill_tokens: 64,
        kv_capacity_tokens: 1024,
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

fn hybrid_cfg() -> SchedulerConfig {
    let snapshots = snapshot_slots_for(4, DEFAULT_LINEAR_STATE_CACHE_RATIO, None);
    SchedulerConfig {
        max_prefill_tokens: 256,
        kv_capacity_tokens: 8192,
        max_context: 4096,
        cache_type: CacheType::HybridRadix,
        num_state_slots: 4 + snapshots,
        num_snapshot_slots: snapshots,
        seed: 11,
        ..small_cfg()
    }
}

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

/// A seeded workload: `(arrival step, request)`, with stop tokens (~4% a token), seeds, top logprobs.
fn workload(seed: u64, n: u64) -> Vec<(u64, NewRequest)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let shared = toks(7, 40);
    (0..n)
        .map(|id| {
            let mut prompt = if rng.gen_bool(0.5) { shared.clone() } else { Vec::new() };
            prompt.extend((0..rng.gen_range(1..80)).map(|_| rng.gen_range(0..50)));
            let mut req = request(id, prompt, rng.gen_range(1..30));
            if rng.gen_bool(0.7) {
                req.stop_token_ids = (100..140).collect();
            }
            req.sampling.seed = Some(rng.gen());
            req.sampling.top_logprobs = rng.gen_range(0..=2);
            (id * 3 + rng.gen_range(0..3), req)
        })
        .collect()
}

/// Runs `work` to the end, each request added once the sim has taken its arrival step.
fn run(cfg: SchedulerConfig, overlap: bool, work: &[(u64, NewRequest)]) -> Sim {
    let mut sim = Sim::new(cfg);
    sim.overlap = overlap;
    let mut pending: Vec<&(u64, NewRequest)> = work.iter().collect();
    for _ in 0..10_000 {
        let (now, later): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(at, _)| *at <= sim.steps);
        pending = later;
        for (_, req) in now {
            sim.add(req.clone()).unwrap();
        }
        if !sim.step() {
            if pending.is_empty() {
                break;
            }
            sim.steps += 1; // idle until the next arrival
        }
    }
    assert!(pending.is_empty() && sim.sched.is_idle(), "the run did not finish");
    sim
}

/// Decode steps computed past a request's end (a stop token at N, its token at N+1 discarded).
fn extra_draws(sim: &Sim, id: u64) -> usize {
    sim.worker.seeds(id).len() - sim.outcome(id).tokens.len()
}

#[test]
fn overlap_gives_the_tokens_of_the_synchronous_loop() {
    let configs = [
        ("radix page 1", small_cfg()),
        ("radix page 4", SchedulerConfig { page_size: 4, ..small_cfg() }),
        ("naive", SchedulerConfig { cache_type: CacheType::Naive, ..small_cfg() }),
        ("prefill first", SchedulerConfig { mixed_decode: false, ..small_cfg() }),
        ("hybrid radix", hybrid_cfg()),
        ("hybrid radix page 4", SchedulerConfig { page_size: 4, ..hybrid_cfg() }),
        ("hybrid naive", SchedulerConfig { cache_type: CacheType::Naive, ..hybrid_cfg() }),
    ];
    for (name, cfg) in configs {
        for seed in 0..3 {
            let work = workload(seed, 40);
            let sync = run(cfg.clone(), false, &work);
            let over = run(cfg.clone(), true, &work);
            assert!(over.ahead_plans.len() > 20, "{name}: the overlap loop hardly planned ahead");
            let mut extra = 0;
            for (_, req) in &work {
                let (a, b) = (sync.outcome(req.id), over.outcome(req.id));
                assert_eq!(a.tokens, b.tokens, "{name} seed {seed}: request {} tokens", req.id);
                assert_eq!(a.finished, b.finished, "{name} seed {seed}: request {} finish", req.id);
                let seeds = sync.worker.seeds(req.id);
                assert_eq!(&over.worker.seeds(req.id)[..seeds.len()], seeds, "{name}: request {} seeds", req.id);
                assert_eq!(extra_draws(&sync, req.id), 0);
                extra += extra_draws(&over, req.id);
                // Only a stop token ends a request with a draw past its end, never its output budget.
                if b.finished == Some(FinishReason::Length) {
                    assert_eq!(extra_draws(&over, req.id), 0, "{name}: a draw past max_tokens");
                }
            }
            assert!(extra > 0, "{name} seed {seed}: no request ended by a stop token while N+1 ran");
            let mut over = over;
            over.assert_clean();
        }
    }
}

/// Request 1 samples its stop token at step N while N+1 (its next decode) is already planned: the `Finished`
/// event goes out at N's commit, the row and KV stay held until N+1 is committed, N+1's token is dropped.
#[test]
fn a_stop_token_at_n_discards_the_token_of_n_plus_1() {
    let mut sim = Sim::new(small_cfg());
    sim.overlap = true;
    let mut req = request(1, toks(1, 10), 20);
    req.stop_token_ids = vec![7];
    sim.worker.script.insert((1, 3), 7);
    sim.add(req).unwrap();
    while sim.outcome(1).finished.is_none() {
        assert!(sim.step());
    }
    assert_eq!(sim.outcome(1).tokens.len(), 4);
    assert_eq!(sim.outcome(1).tokens[3], 7);
    assert!(sim.in_flight.is_some(), "the decode past the stop token is in flight");
    let st = sim.sched.stats();
    assert_eq!((st.running, st.free_rows), (1, 3), "released before the device is done with it");
    assert!(sim.step());
    assert!(sim.in_flight.is_none());
    assert_eq!(sim.sched.stats().running, 0);
    assert_eq!(sim.outcome(1).tokens.len(), 4, "the discarded token was reported");
    assert_eq!(extra_draws(&sim, 1), 1);
    let finished = sim.outcome(1).events.iter().filter(|e| matches!(e, RequestEvent::Finished { .. })).count();
    assert_eq!(finished, 1);
    // The radix cache now holds the prompt and all four tokens (the fifth position's KV was computed too).
    let next: Vec<u32> = toks(1, 10).into_iter().chain(sim.outcome(1).tokens.clone()).chain(toks(2, 5)).collect();
    sim.add(request(2, next, 3)).unwrap();
    sim.run_until_idle(100);
    assert_eq!(sim.outcome(2).cached_tokens, Some(14));
    sim.assert_clean();
}

/// Hybrid radix: the live state of a request that ended at N was advanced by N+1 (it fed the stop token), so
/// it is donated as the state after prompt + output, which the fake worker checks when the next turn
/// restores it.
#[test]
fn hybrid_donation_after_a_step_past_the_end_matches_its_tokens() {
    let mut sim = Sim::new(hybrid_cfg());
    sim.overlap = true;
    let mut history = toks(1, 150);
    for turn in 0..6u64 {
        let mut req = request(turn, history.clone(), 12);
        req.stop_token_ids = vec![7];
        sim.worker.script.insert((turn, 2 + turn as usize), 7);
        sim.add(req).unwrap();
        sim.run_until_idle(1000);
        let o = sim.outcome(turn);
        assert_eq!(o.finished, Some(FinishReason::Stop));
        if turn > 0 {
            assert_eq!(o.cached_tokens, Some(history.len() as u32 - 20 - 3), "turn {turn} resumes after the answer");
        }
        history.extend(o.tokens.clone());
        history.extend(toks(100 + turn as u32, 20 + 3));
    }
    assert_eq!(sim.sched.stats().snapshot_hits, 5);
    sim.assert_clean();
}

/// `max_tokens` is known in advance: no step is planned past it, and the request gets exactly its budget.
#[test]
fn max_tokens_is_exact_and_never_overrun() {
    for cfg in [small_cfg(), hybrid_cfg()] {
        let mut sim = Sim::new(cfg);
        sim.overlap = true;
        for id in 0..4 {
            sim.add(request(id, toks(id as u32 + 1, 20), 5 + id as u32)).unwrap();
        }
        sim.run_until_idle(200);
        for id in 0..4 {
            assert_eq!(sim.outcome(id).tokens.len(), 5 + id as usize);
            assert_eq!(extra_draws(&sim, id), 0);
        }
        assert!(!sim.ahead_plans.is_empty());
        sim.assert_clean();
    }
}

/// A client gone while N+1 is in flight: released at once (nothing donated), the others go on unchanged.
#[test]
fn abort_while_a_step_is_in_flight() {
    for cfg in [small_cfg(), hybrid_cfg()] {
        let work: Vec<(u64, NewRequest)> = (0..3).map(|id| (0, request(id, toks(id as u32 + 1, 30), 12))).collect();
        let sync = run(cfg.clone(), false, &work);
        let mut sim = Sim::new(cfg);
        sim.overlap = true;
        for (_, req) in &work {
            sim.add(req.clone()).unwrap();
        }
        while sim.outcome(1).tokens.len() < 4 {
            sim.step();
        }
        assert!(sim.in_flight.is_some());
        sim.finish(1, FinishReason::Abort);
        sim.run_until_idle(200);
        assert_eq!(sim.outcome(1).finished, Some(FinishReason::Abort));
        for id in [0, 2] {
            assert_eq!(sim.outcome(id).tokens, sync.outcome(id).tokens);
        }
        sim.assert_clean();
    }
}

/// A request arriving while the loop overlaps: the next plan waits for the step in flight and admits it
/// (ahead plans only ever decode).
#[test]
fn admissions_wait_for_the_step_in_flight() {
    let mut sim = Sim::new(small_cfg());
    sim.overlap = true;
    sim.add(request(0, toks(1, 20), 30)).unwrap();
    for _ in 0..6 {
        sim.step();
    }
    assert!(sim.in_flight.is_some());
    let ahead = sim.ahead_plans.len();
    sim.add(request(1, toks(2, 20), 5)).unwrap();
    sim.step(); // commits the step in flight; nothing planned ahead while the new request could start
    assert_eq!(sim.ahead_plans.len(), ahead);
    assert!(sim.in_flight.is_none());
    sim.step(); // the mixed step admitting request 1
    assert!(sim.outcome(1).started_step.is_some());
    sim.run_until_idle(200);
    assert_eq!(sim.outcome(0).tokens.len(), 30);
    sim.assert_clean();
}

/// Random arrivals, aborts, stop strings and failed steps under the overlap loop: every request ends and
/// the pools come back whole.
#[test]
fn random_overlapped_runs_end_cleanly() {
    let configs = [
        (small_cfg(), 1),
        (SchedulerConfig { page_size: 4, ..small_cfg() }, 2),
        (hybrid_cfg(), 3),
        (SchedulerConfig { page_size: 4, ..hybrid_cfg() }, 4),
    ];
    for (cfg, seed) in configs {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut sim = Sim::new(cfg);
        sim.overlap = true;
        let work = workload(seed, 60);
        let mut next = 0;
        while next < work.len() || !sim.sched.is_idle() || sim.in_flight.is_some() {
            while next < work.len() && work[next].0 <= sim.steps {
                sim.add(work[next].1.clone()).unwrap();
                next += 1;
            }
            if rng.gen_bool(0.05) && next > 0 {
                let id = rng.gen_range(0..next as u64);
                if !sim.outcome(id).ended() {
                    sim.finish(id, if rng.gen_bool(0.5) { FinishReason::Abort } else { FinishReason::Stop });
                }
            }
            if rng.gen_bool(0.02) {
                if let Some((plan, _)) = sim.in_flight.take() {
                    sim.fail(&plan, "injected out of memory");
                }
            }
            if !sim.step() {
                sim.steps += 1; // idle until the next arrival
            }
            assert!(sim.steps < 20_000);
        }
        assert!(sim.outcomes.values().all(|o| o.ended()));
        sim.assert_clean();
    }
}
