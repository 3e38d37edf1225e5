"""Steps of several sequences, served: what a client sees when prompts arrive together and when a prompt joins running
decode streams, with the Gated DeltaNet batch graphs (``layers/gdn_batch_graphs.py``) and without
(``FREETOKEN_GDN_BATCH_GRAPHS=0``: fla's varlen forward called eagerly), one server each, through the HTTP API.

    FREETOKEN_BENCH_ROUTING=uniform python bench/concurrent_prompts_bench.py --out bench/out/concurrent.json -- \\
        --dummy-weight --model-path configs/qwen3.6-35b-a3b-nvfp4 --max-running-requests 32 --moe-backend fused

Two scenarios a server, each ``--rounds`` times with prompts no earlier request shares (random words: the radix cache
cannot shorten them):
- burst: ``--burst`` prompts of ``--burst-words`` words sent at once (a few tokens each): the time to every first token
  (the last TTFT) and the median TTFT;
- join: ``--burst - 1`` streams decoding (``ignore_eos``), then ``--joins`` prompts of ``--join-words`` words, one at a
  time: the joiner's TTFT, and the longest gap each running stream saw while the joiner prefilled, beside the
  streams' median gap before the first join; and the joiner's step from ``/v1/stats`` (engine, worker, device and
  host-launch ms: is it host-bound).
The servers differ only in the switch, so the ratio is the batch graphs' (the routing, driven by
``FREETOKEN_BENCH_ROUTING``, is the same in both). With ``--moe-backend fused`` every expert is resident: there is no
expert cache and no hit rate (the table says so).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time

import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_report  # noqa: E402
from serve_bench import WORDS, stream_completion, stream_together  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

MODES = {"batch graphs": {}, "eager varlen": {"FREETOKEN_GDN_BATCH_GRAPHS": "0"}}


def fresh_prompt(rng: random.Random, words: int) -> str:
    """``words`` random words behind a random number: no prefix shared with any other prompt of the run."""
    return f"{rng.randrange(10**9)}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def burst(url: str, rng: random.Random, n: int, words: int) -> dict:
    """``n`` prompts sent together, 2 tokens each: their TTFTs."""
    results = stream_together(url, [fresh_prompt(rng, words) for _ in range(n)], 2)
    ttfts = sorted(r["ttft_s"] * 1e3 for r in results)
    return {
        "prompts": n,
        "prompt_tokens_mean": statistics.mean(r["usage"]["prompt_tokens"] for r in results),
        "ttft_ms_p50": statistics.median(ttfts),
        "ttft_ms_last": ttfts[-1],
    }


def last_prefill_step(url: str) -> dict:
    """The last step that computed prompt tokens, from ``/v1/stats``: its prompt tokens (the decode tokens beside
    them not counted), the engine's, the worker's, the device's time and the host's time to enqueue it (ms)."""
    stats = requests.get(url + "/v1/stats", timeout=30).json()
    keys = ("tokens", "engine_ms", "forward_ms", "device_ms", "launch_ms")
    return {k: float(stats.get(f"last_prefill_{k}") or 0.0) for k in keys}


def gaps_around_joins(running: list[dict], joined: list[dict]) -> tuple[list[float], list[float]]:
    """From the decode streams' token times and the joiners' send and first-token times: the streams' gaps before the
    first join (steady decode), and per joiner the longest gap of any stream that overlaps its wait (from its send to
    its first token: the step that held its prompt delayed that stream's next token); 0 when none overlaps."""
    first_join = joined[0]["sent"]
    pairs = [(a, b) for s in running for a, b in zip(s["stamps"], s["stamps"][1:])]
    steady = [b - a for a, b in pairs if b < first_join]
    stalls = []
    for r in joined:
        lo, hi = r["sent"], r["stamps"][0]
        stalls.append(max((b - a for a, b in pairs if b > lo and a < hi), default=0.0))
    return steady, stalls


def join(url: str, rng: random.Random, streams: int, joins: int, words: int) -> dict:
    """``streams`` decode streams, then ``joins`` prompts one after another while they run: each joiner's TTFT and
    the longest gap any stream saw between the joiner's send and its first token (the step that prefilled it)."""
    running: list = []
    tokens = 64 + joins * 48  # the streams outlive the joins (a joiner's round takes a few dozen decode steps)
    prompts = [fresh_prompt(rng, 8) for _ in range(streams)]
    holder = threading.Thread(target=lambda: running.extend(stream_together(url, prompts, tokens)))
    holder.start()
    time.sleep(1.5)  # every stream past its prefill, decoding
    joined, steps = [], []
    for _ in range(joins):
        r = stream_completion(url, fresh_prompt(rng, words), 2)
        if "error" in r:
            raise RuntimeError(f"joining prompt failed: {r}")
        joined.append(r)
        steps.append(last_prefill_step(url))  # the joiner's step (no other prompt came since)
        time.sleep(0.25)
    holder.join()
    steady, stalls = gaps_around_joins(running, joined)
    return {
        "streams": streams,
        "joins": joins,
        "join_prompt_tokens": statistics.mean(r["usage"]["prompt_tokens"] for r in joined),
        "join_ttft_ms_p50": statistics.median(r["ttft_s"] * 1e3 for r in joined),
        "stream_gap_ms_p50_before": statistics.median(steady) * 1e3 if steady else None,
        "stream_gap_ms_at_join_p50": statistics.median(stalls) * 1e3,
        "stream_gap_ms_at_join_max": max(stalls) * 1e3,
        "join_step": {key: statistics.median(st[key] for st in steps) for key in steps[0]},
        "joins_after_the_streams": sum(1 for r in joined if r["stamps"][0] > max(x["stamps"][-1] for x in running)),
    }


def bench_server(serve_args: list[str], env: dict, a: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    srv = ServerProcess(serve_args, env=env, ready_timeout=900)
    out: dict = {"env": env, "startup_s": time.perf_counter() - t0, "rounds": []}
    try:
        line = next((ln for ln in srv.log().splitlines() if "Gated DeltaNet prefill CUDA graphs" in ln), "")
        out["graphs_line"] = line[line.find("Captured") :] if "Captured" in line else line
        rng = random.Random(a.seed)
        stream_together(
            srv.url, [fresh_prompt(rng, a.burst_words) for _ in range(a.burst)], 2
        )  # what JIT start-up left
        for _ in range(a.rounds):
            out["rounds"].append(
                {
                    "burst": burst(srv.url, rng, a.burst, a.burst_words),
                    "join": join(srv.url, rng, a.burst - 1, a.joins, a.join_words),
                }
            )
        out["request_path_events"] = srv.request_path_events()
    finally:
        out["exit_code"] = srv.stop()
    return out


def best(rounds: list[dict], scenario: str, key: str) -> float:
    if scenario == "join_step":
        return min(r["join"]["join_step"][key] for r in rounds)
    return min(r[scenario][key] for r in rounds)


def print_table(report: dict) -> None:
    modes = report["servers"]
    print(
        f"\nsteps of several sequences, served ({report['routing']} routing, experts resident: no expert cache, no hit "
        f"rate); best of {report['rounds']} rounds"
    )
    rows = [
        ("burst: TTFT p50 ms", "burst", "ttft_ms_p50"),
        ("burst: last TTFT ms", "burst", "ttft_ms_last"),
        ("join: joiner TTFT p50 ms", "join", "join_ttft_ms_p50"),
        ("join: stream gap before ms", "join", "stream_gap_ms_p50_before"),
        ("join: stream gap at join p50 ms", "join", "stream_gap_ms_at_join_p50"),
        ("join: stream gap at join max ms", "join", "stream_gap_ms_at_join_max"),
        ("join step: engine ms", "join_step", "engine_ms"),
        ("join step: worker ms", "join_step", "forward_ms"),
        ("join step: device ms", "join_step", "device_ms"),
        ("join step: host launch ms", "join_step", "launch_ms"),
    ]
    names = list(modes)
    print(f"{'':34}" + "".join(f"{n:>16}" for n in names) + f"{'ratio':>10}")
    for label, scenario, key in rows:
        vals = [best(modes[n]["rounds"], scenario, key) for n in names]
        ratio = vals[1] / vals[0] if len(vals) == 2 and vals[0] else float("nan")
        print(f"{label:34}" + "".join(f"{v:16.1f}" for v in vals) + f"{ratio:10.2f}")
    r0 = modes[names[0]]["rounds"][0]
    print(
        f"burst: {r0['burst']['prompts']} prompts of ~{r0['burst']['prompt_tokens_mean']:.0f} tokens; join: "
        f"{r0['join']['streams']} streams, {r0['join']['joins']} prompts of ~{r0['join']['join_prompt_tokens']:.0f} "
        "tokens (ratio: eager varlen / batch graphs)"
    )
    for n in names:
        events = modes[n]["request_path_events"]
        print(f"{n}: start-up {modes[n]['startup_s']:.0f} s; {modes[n]['graphs_line']}; request-path events: "
              f"{len(events)}{' (' + events[0] + ')' if events else ''}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/out/concurrent_prompts.json")
    ap.add_argument("--burst", type=int, default=32, help="prompts sent together (the join scenario runs one fewer)")
    ap.add_argument("--burst-words", type=int, default=40)
    ap.add_argument("--joins", type=int, default=6)
    ap.add_argument("--join-words", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES), help="servers to run, of: " + ", ".join(MODES))
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    serve_args = [x for x in a.serve_args if x != "--"]
    report = {
        "serve_args": serve_args,
        "routing": os.environ.get("FREETOKEN_BENCH_ROUTING", "the router's own"),
        "rounds": a.rounds,
        "servers": {},
    }
    for name in a.modes.split(","):
        report["servers"][name] = bench_server(serve_args, MODES[name], a)
        write_report(a.out, report)
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
