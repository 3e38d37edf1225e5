"""Greedy parity of the hybrid radix cache at the real shape (issue 12: outputs token-identical to ``--cache-type
naive``): the same long prompt sent to a naive server twice and to a radix server twice (the second time from its
snapshot), then a second turn (the answer plus new ids) to both, all greedy. Prints, for each pair of answers that
should match, whether they do and where they first part:

  naive 1 vs naive 2    the same computation twice in one server: is the engine deterministic?
  radix 1 vs naive 1    a cold radix request (its chunks end on the snapshot grid) against the naive one
  radix 2 vs radix 1    the same prompt again, resumed from the snapshot at its last grid point
  radix turn 2 vs naive turn 2    a cached second turn against the recomputed one

The agent session bench (``agent_session_bench.py``) found the two servers' answers different from turn 1 on, on the
dummy Qwen3.6 weights; this tells nondeterminism apart from a path that computes differently. ``--layers N`` keeps
the first N decoder layers of the config (a copy in a temporary directory; dummy weights only) so a run fits a short
GPU session. Writes JSON to ``--out``.

    python3 bench/greedy_parity.py --layers 8 --server-args "--moe-backend fused --max-prefill-length 8192"
    python3 bench/greedy_parity.py --tiny --prompt-tokens 1500                     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path.insert(0, os.path.join(_ROOT, "tests"))
from agent_session_bench import gpu_name, write_tiny  # noqa: E402  (bench/, this script's directory)
from report import write_report  # noqa: E402
from server_harness import ServerProcess  # noqa: E402


def truncated_config(src: str, layers: int, dst: str) -> str:
    """A copy of the config directory ``src`` with its first ``layers`` decoder layers (dummy weights only)."""
    for name in os.listdir(src):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] = layers
    if text.get("layer_types"):
        text["layer_types"] = text["layer_types"][:layers]
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return dst


TOP = 5  # logprobs of each answer token's top candidates


def complete(srv: ServerProcess, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion over token ids: its text, usage, tokens and each token's top-5 logprobs."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": TOP}
    r = srv.post("/v1/completions", json=body, timeout=1800)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    j = r.json()
    lp = j["choices"][0].get("logprobs") or {}
    return {"text": j["choices"][0]["text"], "usage": j["usage"], "tokens": lp.get("tokens", []),
            "top": lp.get("top_logprobs", [])}  # fmt: skip


def at_parting(x: dict, y: dict) -> dict | None:
    """Where two answers first choose different tokens ``a`` (x's) and ``b`` (y's): both tokens' logprobs in each
    run (None: outside its top 5). A near tie in both (``a`` and ``b`` within a few hundredths) is a rounding flip
    between two paths that compute alike; ``b`` far below ``a`` in x means the paths computed different things."""
    i = next((i for i, (p, q) in enumerate(zip(x["tokens"], y["tokens"])) if p != q), None)
    if i is None or i >= min(len(x["top"]), len(y["top"])):
        return None
    a, b = x["tokens"][i], y["tokens"][i]
    return {"token": i, "a": a, "b": b, "x": [x["top"][i].get(a), x["top"][i].get(b)],
            "y": [y["top"][i].get(a), y["top"][i].get(b)]}  # fmt: skip


def margin(chosen: float | None, other: float | None) -> str:
    """How far a run's chosen token led the other run's choice: ``lp(chosen) - lp(other)``; ``top5-`` when the other
    is outside this run's top 5."""
    if chosen is None:
        return "-"
    return "top5-" if other is None else f"{chosen - other:.3f}"


def first_difference(a: str, b: str) -> int | None:
    """The first character where ``a`` and ``b`` differ (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(cache: str, serve_args: list[str], prompt: list[int], second: list[int], max_tokens: int) -> dict:
    """One server's requests: the prompt twice, then a second turn (the prompt plus ``second``, the same ids for
    both servers, so the turns compare whatever the first answers were)."""
    srv = ServerProcess(serve_args + ["--cache-type", cache], ready_timeout=1200)
    try:
        first = complete(srv, prompt, max_tokens)
        again = complete(srv, prompt, max_tokens)
        turn2 = complete(srv, prompt + second, max_tokens)
    finally:
        code = srv.stop()
    # each server's answers as they come, so that a run cut short (a GPU session's time limit) still tells something
    for name, r in (("first", first), ("again", again), ("turn 2", turn2)):
        print(f"[{cache}] {name}: {r['text'][:60]!r}", flush=True)
    return {"first": first, "again": again, "turn2": turn2, "exit_code": code}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=os.path.join(_ROOT, "configs", "qwen3.6-35b-a3b"))
    ap.add_argument("--layers", type=int, default=0, help="keep the first N decoder layers (0: all)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen3.5-MoE (CPU smoke)")
    ap.add_argument("--prompt-tokens", type=int, default=10000)
    ap.add_argument("--second-tokens", type=int, default=1500, help="new ids of the second turn")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--out", default=os.path.join(_ROOT, "bench", "out", "greedy_parity.json"))
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="ft-greedy-parity-")
    try:
        max_seq = a.prompt_tokens + a.second_tokens + a.max_tokens + 64
        if a.tiny:
            model, dummy = write_tiny(tmp, max_seq), []
        elif a.layers:
            model, dummy = truncated_config(a.model_path, a.layers, tmp), ["--dummy-weight"]
        else:
            model, dummy = a.model_path, ["--dummy-weight"]
        serve = ["--model-path", model, *dummy, "--max-seq-len-override", str(max_seq), "--enable-cache-report"]
        serve += shlex.split(a.server_args)
        rng = random.Random(7)
        prompt = [rng.randrange(1000, 100000) for _ in range(a.prompt_tokens)]
        second = [rng.randrange(1000, 100000) for _ in range(a.second_tokens)]
        naive = run("naive", serve, prompt, second, a.max_tokens)
        radix = run("radix", serve, prompt, second, a.max_tokens)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    pairs = [
        ("naive 1 vs naive 2", naive["first"], naive["again"]),
        ("radix 1 vs naive 1", radix["first"], naive["first"]),
        ("radix 2 vs radix 1", radix["again"], radix["first"]),
        ("radix turn 2 vs naive turn 2", radix["turn2"], naive["turn2"]),
    ]
    rows = []
    print(f"greedy parity: {a.prompt_tokens}-token prompt, {a.second_tokens} more in turn 2, {a.max_tokens} tokens")
    print(f"{'pair':<30}{'same':>6}{'first diff (char)':>19}{'cached tokens':>15}   where they part: token, "
          "each run's lead of its token over the other's")  # fmt: skip
    for label, x, y in pairs:
        diff = first_difference(x["text"], y["text"])
        cached = (x["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        part = at_parting(x, y)
        rows.append({"pair": label, "same": diff is None, "first_difference": diff, "cached_tokens": cached,
                     "parting": part})  # fmt: skip
        where = ""
        if part is not None:  # each run's lead of its own choice over the other's
            where = f"   token {part['token']}: {margin(*part['x'])} / {margin(*part['y'][::-1])}"
        print(
            f"{label:<30}{'yes' if diff is None else 'NO':>6}{'-' if diff is None else diff:>19}{str(cached):>15}{where}"
        )
    report = {
        "gpu": gpu_name(),
        "serve_args": serve,
        "rows": rows,
        "naive": naive,
        "radix": radix,
    }
    write_report(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
