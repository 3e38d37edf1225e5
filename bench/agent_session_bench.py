"""Agent-session TTFT benchmark for the hybrid radix cache (issue 12): one agent-like conversation of ``--turns``
turns replayed through the HTTP API (streamed ``/v1/completions`` over token ids, greedy, ``ignore_eos``), first
against ``ft serve`` with the cache on (``--cache-type radix``, which a Gated DeltaNet hybrid model resolves to
``hybrid_radix``), then against a second server with it off (``--cache-type naive``), one server after the other.

The session: turn 1 is a system prompt with tool definitions and a task (``--system-tokens``, default half of
``--final-context``: 15k tokens, a coding agent's system prompt and tools); every later turn appends the answer
the server returned (``--max-tokens`` tokens) and a new tool result or user message, growing linearly from 1x to
2x in size, so that the prompt of the last turn is exactly ``--final-context`` tokens. Prompts are token ids built
with the model's tokenizer (ChatML framing, the real special tokens), so every count is exact; the answer goes back
into the history as the ids it decodes from (each streamed piece re-encoded; ``ids exact`` says whether that gave
``completion_tokens`` ids, i.e. the history is prompt + generated ids + new ids, and the next turn can resume from
the snapshot taken at the end of the answer; ``no`` where the answer held ids that decode to nothing, e.g. ids
past the tokenizer's vocabulary, which dummy weights can pick: the next turn then resumes from an earlier
snapshot, on the 64-token grid).

Per turn it reports: prompt tokens, new tokens, cached tokens (``usage.prompt_tokens_details.cached_tokens``; both
servers run with ``--enable-cache-report``; the ``/v1/stats`` ``snapshot_hit_tokens`` delta beside it), TTFT with
the cache and without (from the request's send to the first streamed token; the client encodes the JSON body before
the clock starts, since 30k ids are ~4 ms of Python JSON; until 2026-12-03 afternoon that was inside), their ratio,
the cached turn's prefill step (from ``/v1/stats`` ``last_prefill_*``: the engine's time for it, the worker's, its
span on the device's timeline and the host's time to enqueue its forward, ``launch``: near ``device``, the host's
launches set the pace), whether both servers gave the same greedy answer, and the lowest SM clock ``nvidia-smi``
sampled during each server's TTFT (``bench/gpu_clocks.py``; the JSON has mean clocks, power, temperature and
throttle reasons). The last turn's ratio is checked against the issue's target (TTFT cached / uncached <= 10 %),
beside the fraction of its prompt the cached server computed (the floor of that ratio if prefill cost were linear in
the tokens computed; at the defaults the last message is 2,183 new tokens, 7.3 % of 30,000). Prints a table and
writes JSON (command line, date, GPU name, server args, per-turn rows, the resolved config lines) to ``--out``
(``bench/out/``).

On the H200 (Qwen3.6-35B-A3B shape, dummy BF16 weights; the model path defaults to ``configs/qwen3.6-35b-a3b``,
which has no weights, so ``--dummy-weight`` is added; the built-in Qwen3.5/3.6 tokenizer is used, from
``FREETOKEN_CACHE_DIR``: run it in ``scripts/gpu_session.sh``'s environment, ``PYTHONPATH`` and
``FREETOKEN_CACHE_DIR=$PWD/.gpucache``; two start-ups of about a minute each plus two sessions):

    python3 bench/agent_session_bench.py --out bench/out/agent_session_qwen36_dummy.json \\
        --server-args "--max-running-requests 4 --moe-backend fused --max-prefill-length 8192"

A real checkpoint: ``--model-path /path/to/Qwen3.6-35B-A3B``. CPU smoke check on a tiny random Qwen3.5-MoE
(written to a temporary directory by ``tests/hf_reference.write_released_qwen3_5_moe``, real tokenizer):

    python bench/agent_session_bench.py --tiny --final-context 2000 --turns 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import requests

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path.insert(0, os.path.join(_ROOT, "tests"))
sys.path.insert(0, os.path.join(_ROOT, "python"))
from gpu_clocks import ClockSampler  # noqa: E402  (bench/, this script's directory)
from report import write_report  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

TARGET_RATIO = 0.10  # issue 12: TTFT of the 10th turn with the cache <= 10 % of it without

# ------------------------------------------------------------------ the session's text

TOOLS = [
    (
        "read_file",
        "Read a file from the repository and return its contents with line numbers.",
        {"path": "string", "start_line": "integer", "end_line": "integer"},
    ),
    ("write_file", "Create or overwrite a file with the given contents.", {"path": "string", "contents": "string"}),
    (
        "edit_file",
        "Replace an exact string in a file with another string; fails if the old string is not unique.",
        {"path": "string", "old_string": "string", "new_string": "string"},
    ),
    (
        "run_shell",
        "Run a shell command in the repository root and return stdout, stderr and the exit status.",
        {"command": "string", "timeout_s": "integer"},
    ),
    (
        "search",
        "Search the repository for a regular expression; returns matching lines with file and line.",
        {"pattern": "string", "path": "string", "max_results": "integer"},
    ),
    ("list_dir", "List a directory, recursively up to a depth.", {"path": "string", "depth": "integer"}),
    ("git_diff", "Show the working tree's diff against HEAD, optionally for one path.", {"path": "string"}),
    (
        "run_tests",
        "Run the test suite or one test file and return the summary and failures.",
        {"target": "string", "markers": "string"},
    ),
]

WORDS = (
    "request scheduler engine worker tensor cache prefix snapshot state slot page token batch prefill decode "
    "stream client server config model layer expert router kernel buffer queue budget limit admission "
    "eviction radix tree node branch grid chunk capture restore commit plan step output input"
).split()


def tools_block() -> str:
    defs = []
    for name, desc, params in TOOLS:
        props = {p: {"type": t, "description": f"The {p.replace('_', ' ')}."} for p, t in params.items()}
        defs.append(
            json.dumps(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": desc,
                        "parameters": {"type": "object", "properties": props, "required": list(params)[:1]},
                    },
                }
            )
        )
    return (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(defs)
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags."
    )


def filler(rng: random.Random, kind: str, chars: int) -> str:
    """Deterministic text of about ``chars`` characters: source code (tool results), log lines, or prose."""
    out, n = [], 0
    i = 0
    while n < chars:
        w = [rng.choice(WORDS) for _ in range(6)]
        if kind == "code":
            line = (
                f"    def {w[0]}_{w[1]}_{i}(self, {w[2]}: int, {w[3]}=None):\n"
                f"        return self.{w[4]}[{w[2]} % {rng.randint(2, 997)}] + len({w[5]}s)  # {w[1]} {w[3]}\n"
            )
        elif kind == "log":
            line = (
                f"[{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}] {w[0].upper()} "
                f"{w[1]}={rng.randint(0, 99999)} {w[2]} {w[3]} took {rng.random() * 100:.2f} ms ({w[4]}/{w[5]})\n"
            )
        else:
            line = f"The {w[0]} must keep its {w[1]} when the {w[2]} {w[3]}s; check the {w[4]} before each {w[5]}. "
        out.append(line)
        n += len(line)
        i += 1
    return "".join(out)


class Session:
    """The conversation's new messages as token ids, sized to a plan of exact prompt lengths per turn."""

    def __init__(self, tok, final_context: int, turns: int, max_tokens: int, system_tokens: int, seed: int = 0):
        self.tok, self.turns, self.max_tokens, self.seed = tok, turns, max_tokens, seed
        s = system_tokens or (final_context if turns == 1 else round(0.5 * final_context))
        rest = final_context - s - (turns - 1) * max_tokens
        if turns > 1 and rest < (turns - 1) * 64:
            raise SystemExit(
                f"--final-context {final_context} leaves {rest} tokens for {turns - 1} new messages "
                f"after a {s}-token system prompt and {turns - 1} answers of {max_tokens}"
            )
        weights = [1 + k / max(turns - 2, 1) for k in range(turns - 1)]  # 1x .. 2x
        incs = [int(rest * w / sum(weights)) for w in weights]
        if incs:
            incs[-1] += rest - sum(incs)
        self.contexts = [s]  # prompt length of each turn
        for inc in incs:
            self.contexts.append(self.contexts[-1] + max_tokens + inc)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _sized(self, head: str, kind: str, tail: str, n: int, seed: int) -> list[int]:
        """``head`` + filler + ``tail`` as exactly ``n`` ids (the filler cut at a token)."""
        h, t = self.ids(head), self.ids(tail)
        need = n - len(h) - len(t)
        if need < 0:
            h = h[: max(n - len(t), 0)]
            need = n - len(h) - len(t)
        body, chars = [], max(need * 4, 64)
        while len(body) < need:
            body = self.ids(filler(random.Random(seed), kind, chars))
            chars *= 2
        return h + body[:need] + t

    def message(self, turn: int, history_len: int) -> list[int]:
        """The ids turn ``turn`` (0-based) appends to a history of ``history_len`` ids."""
        n = self.contexts[turn] - history_len
        if turn == 0:
            head = (
                f"<|im_start|>system\nYou are a coding agent working in a large repository (session {self.seed}). "
                "Follow the guidelines below.\n\n"
            )
            tail = (
                tools_block() + "<|im_end|>\n<|im_start|>user\nThe scheduler drops a request when a client "
                "hangs up during prefill. Find out why and fix it.<|im_end|>\n<|im_start|>assistant\n"
            )
            h, t = self.ids(head), self.ids(tail)
            if len(h) + len(t) > n:  # a small system prompt: the tool block is cut short
                end = self.ids("<|im_end|>\n<|im_start|>assistant\n")
                return (h + t)[: n - len(end)] + end
            return self._sized(head, "prose", tail, n, seed=self.seed * 1000)
        kind = ("code", "log", "prose")[turn % 3]
        if kind == "prose":
            head = "<|im_end|>\n<|im_start|>user\nThat is not it yet. Here is more context:\n"
            tail = "<|im_end|>\n<|im_start|>assistant\n"
        else:
            head = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
            tail = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        min_len = len(self.ids(head)) + len(self.ids(tail)) + 1
        if n < min_len:
            raise SystemExit(f"turn {turn + 1}: only {n} tokens left for its message (answers longer than planned?)")
        return self._sized(head, kind, tail, n, seed=self.seed * 1000 + turn)


# ------------------------------------------------------------------ the client


def stream_ids(url: str, prompt: list[int], max_tokens: int, tok, timeout: float = 1800) -> dict:
    """One streamed greedy completion over token ids: TTFT, the answer's text and ids, usage."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces, usage, error, first, finish = [], None, None, None, None
    # the body is encoded before the clock starts: a 30k-id prompt takes this client ~4 ms of JSON, not the server's
    data, headers = json.dumps(body).encode(), {"Content-Type": "application/json"}
    wall0 = time.time()  # host wall clock, for the GPU clock samples (bench/gpu_clocks.py)
    t0 = time.perf_counter()
    with requests.post(url + "/v1/completions", data=data, headers=headers, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                error = ev["error"]
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices") or []:
                if c.get("text"):
                    if first is None:
                        first = time.perf_counter()
                    pieces.append(c["text"])
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
    end = time.perf_counter()
    if error or usage is None:
        return {"error": error or "no usage chunk"}
    text = "".join(pieces)
    # Each streamed piece is one token's text (or a few, where a character spans tokens): re-encoding piece by
    # piece gives the generated ids without merges across pieces. Ids that decode to nothing (special tokens, or
    # ids past the tokenizer's vocabulary, which random weights can pick) are lost: then len(ids) falls short.
    ids = [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids]
    return {
        "ttft_s": (first or end) - t0,
        "ttft_wall": (wall0, wall0 + (first or end) - t0),
        "e2e_s": end - t0,
        "text": text,
        "ids": ids,
        "usage": usage,
        "finish_reason": finish,
        "ids_exact": len(ids) == usage["completion_tokens"],
    }


def end_stats(srv: ServerProcess) -> dict:
    """The cache's counters from /v1/stats after the session."""
    stats = srv.get("/v1/stats").json()
    keys = (
        "snapshot_slots_used",
        "snapshot_slots_total",
        "evictable_snapshots",
        "snapshot_hits",
        "snapshot_hit_tokens",
        "cached_tokens_in_tree",
        "kv_capacity_tokens",
        "state_slots_total",
    )
    return {k: stats.get(k) for k in keys}


def run_server(
    label: str, serve_args: list[str], session: Session, tok, warmup_tokens: int, clocks: ClockSampler
) -> dict:
    t0 = time.perf_counter()
    srv = ServerProcess(serve_args, ready_timeout=1200)
    startup_s = time.perf_counter() - t0
    out = {"cache": label, "serve_args": serve_args, "startup_s": startup_s, "turns": []}
    try:
        log = srv.log()
        out["resolved_config"] = next(
            (l[l.find("Resolved config") :] for l in log.splitlines() if "Resolved config" in l), None
        )
        # the start-up warm-ups' own lines (prefill chunks, GEMM shapes): what ran before the first request
        out["warmup_log"] = [l.strip() for l in log.splitlines() if "warm-up" in l]
        for line in out["warmup_log"]:
            print(f"[{label}] {line}", flush=True)
        # Warm-up on ids that share no prefix with the session (JIT, allocator): not measured.
        warm = random.Random(12345)
        w = stream_ids(srv.url, [warm.randrange(1000, 100000) for _ in range(warmup_tokens)], 2, tok)
        if "error" in w:
            raise RuntimeError(f"{label}: warm-up failed: {w['error']}\n{srv.log()[-3000:]}")
        history: list[int] = []
        for k in range(session.turns):
            new = session.message(k, len(history))
            prompt = history + new
            before = srv.get("/v1/stats").json()
            r = stream_ids(srv.url, prompt, session.max_tokens, tok)
            if "error" in r:
                raise RuntimeError(f"{label}: turn {k + 1} failed: {r['error']}\n{srv.log()[-3000:]}")
            after = srv.get("/v1/stats").json()
            details = r["usage"].get("prompt_tokens_details")
            hit_tokens = after["snapshot_hit_tokens"] - before["snapshot_hit_tokens"]
            out["turns"].append(
                {
                    "turn": k + 1,
                    "prompt_tokens": r["usage"]["prompt_tokens"],
                    "new_tokens": len(new),
                    "cached_tokens": details["cached_tokens"] if details else hit_tokens,
                    "cached_from": "usage" if details else "stats",
                    "snapshot_hit_tokens": hit_tokens,
                    "snapshot_hits": after["snapshot_hits"] - before["snapshot_hits"],
                    "ttft_s": r["ttft_s"],
                    "e2e_s": r["e2e_s"],
                    "completion_tokens": r["usage"]["completion_tokens"],
                    "ids_exact": r["ids_exact"],
                    # the last prefill step's own throughput (tokens / its forward): the whole turn's prefill when
                    # the computed tokens fit one chunk, so TTFT minus (computed / this) is the time outside it
                    "prefill_step_tok_s": after.get("prefill_throughput"),
                    # that step's engine time (planning to commit), the worker's and the span on the device's
                    # timeline (CUDA events), from /v1/stats: where a TTFT goes
                    "last_prefill": {
                        k: after.get(f"last_prefill_{k}")
                        for k in ("tokens", "engine_ms", "forward_ms", "device_ms", "launch_ms")
                    },
                    # the GPU's clocks and power while this turn's TTFT ran (nvidia-smi samples)
                    "clocks": clocks.window(*r["ttft_wall"]),
                    "answer": r["text"],
                }
            )
            history = prompt + r["ids"]
        out["stats_end"] = end_stats(srv)
        out["log_tail"] = srv.log()[-3000:]
        out["request_path_events"] = srv.request_path_events()
    finally:
        out["exit_code"] = srv.stop()
    return out


# ------------------------------------------------------------------ set-up


def write_tiny(d: str, max_position: int) -> str:
    import hf_reference as R  # tests/hf_reference.py

    R.write_released_qwen3_5_moe(d, seed=5)
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["text_config"]["max_position_embeddings"] = max_position  # random weights: any length is as good
    with open(path, "w") as f:
        json.dump(cfg, f)
    return d


def load_tokenizer(model_path: str):
    from tokenizers import Tokenizer

    p = os.path.join(model_path, "tokenizer.json")
    if os.path.isfile(p):
        return Tokenizer.from_file(p), p
    # A Qwen3.5/3.6 config without tokenizer files (--dummy-weight): the server uses the built-in vocabulary.
    from freetoken.loading.qwen_tokenizer import qwen_tokenizer_json_path

    p = qwen_tokenizer_json_path()
    return Tokenizer.from_file(p), p


def has_weights(model_path: str) -> bool:
    if os.path.isfile(model_path):
        return True
    return any(f.endswith((".safetensors", ".gguf", ".bin")) for f in os.listdir(model_path))


def gpu_name() -> str:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "none (CPU)"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path",
        default=os.path.join(_ROOT, "configs", "qwen3.6-35b-a3b"),
        help="HF-layout directory; without weight files --dummy-weight is added",
    )
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny random Qwen3.5-MoE in a temporary directory (CPU smoke)"
    )
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--final-context", type=int, default=30000, help="prompt tokens of the last turn")
    ap.add_argument("--system-tokens", type=int, default=0, help="turn 1's prompt (default half of --final-context)")
    ap.add_argument("--max-tokens", type=int, default=32, help="answer tokens per turn")
    ap.add_argument("--warmup-tokens", type=int, default=0, help="warm-up prompt (default min(2048, final/4))")
    ap.add_argument("--server-args", default="", help="more ft serve args, one string (not --cache-type)")
    ap.add_argument("--caches", default="radix,naive", help="servers to run, in order")
    ap.add_argument(
        "--clock-interval-ms", type=int, default=20, help="nvidia-smi sampling interval during the session; 0: off"
    )
    ap.add_argument("--out", default=os.path.join(_ROOT, "bench", "out", "agent_session.json"))
    a = ap.parse_args()
    if a.turns < 1:
        ap.error("--turns must be >= 1")
    return a


def main() -> int:
    a = parse_args()
    extra = shlex.split(a.server_args)
    max_seq = math.ceil((a.final_context + a.max_tokens + 64) / 1024) * 1024
    tmp = None
    model_path = a.model_path
    base = []
    if a.tiny:
        tmp = tempfile.mkdtemp(prefix="ft-agent-bench-")
        model_path = write_tiny(tmp, max_seq)
        if "--num-tokens" not in extra and "--num-pages" not in extra:
            base += ["--num-tokens", str(max(8192, math.ceil(3 * max_seq / 1024) * 1024))]
    dummy = not has_weights(model_path)
    base = ["--model-path", model_path] + (["--dummy-weight"] if dummy else []) + base
    if "--max-seq-len-override" not in extra:
        base += ["--max-seq-len-override", str(max_seq)]
    base += ["--enable-cache-report"] + extra
    tok, tok_path = load_tokenizer(model_path)
    session = Session(tok, a.final_context, a.turns, a.max_tokens, a.system_tokens)
    warmup = a.warmup_tokens or min(2048, max(a.final_context // 4, 16))
    report = {
        "gpu": gpu_name(),
        "model_path": "tiny (tests/hf_reference.write_released_qwen3_5_moe)" if a.tiny else model_path,
        "dummy_weight": dummy,
        "tokenizer": tok_path,
        "turns": a.turns,
        "final_context": a.final_context,
        "max_tokens": a.max_tokens,
        # one prefill step's tokens (ft serve's default 8192): a turn that computes no more is one step
        "chunk": int(extra[extra.index("--max-prefill-length") + 1]) if "--max-prefill-length" in extra else 8192,
        "planned_prompt_tokens": session.contexts,
        "target_ratio": TARGET_RATIO,
        "runs": {},
    }
    try:
        for cache in [c.strip() for c in a.caches.split(",") if c.strip()]:
            print(f"--- {cache}: ft serve {' '.join(base)} --cache-type {cache}", flush=True)
            with ClockSampler(a.clock_interval_ms) as clocks:
                run = run_server(cache, base + ["--cache-type", cache], session, tok, warmup, clocks)
            report["runs"][cache] = run
            print(
                f"    start-up {run['startup_s']:.1f} s, {run['resolved_config']}, exit {run['exit_code']}", flush=True
            )
            for line in run.get("request_path_events", []):
                print(f"    {line}", flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = summarize(report)
    write_report(a.out, report)
    print_table(report, rows)
    return 0


def summarize(report: dict) -> list[dict]:
    runs = report["runs"]
    on, off = runs.get("radix"), runs.get("naive")
    rows = []
    for k in range(report["turns"]):
        t_on = on["turns"][k] if on else None
        t_off = off["turns"][k] if off else None
        ref = t_on or t_off
        row = {
            "turn": k + 1,
            "prompt_tokens": ref["prompt_tokens"],
            "new_tokens": ref["new_tokens"],
            "cached_tokens": t_on["cached_tokens"] if t_on else None,
            "snapshot_hit_tokens": t_on["snapshot_hit_tokens"] if t_on else None,
            "ttft_cached_s": t_on["ttft_s"] if t_on else None,
            "ttft_uncached_s": t_off["ttft_s"] if t_off else None,
            "ids_exact": all(t["ids_exact"] for t in (t_on, t_off) if t),
        }
        tps = t_on and t_on.get("prefill_step_tok_s")
        computed = t_on and t_on["prompt_tokens"] - t_on["cached_tokens"]
        row["prefill_step_cached_s"] = computed / tps if tps and computed and computed <= report["chunk"] else None
        step = (t_on or {}).get("last_prefill") or {}
        one_step = computed and step.get("tokens") == computed  # the turn's prefill was that one step
        for k in ("engine_ms", "forward_ms", "device_ms", "launch_ms"):
            row[f"step_{k}"] = step.get(k) if one_step else None
        row["ratio"] = row["ttft_cached_s"] / row["ttft_uncached_s"] if t_on and t_off else None
        row["same_answer"] = t_on["answer"] == t_off["answer"] if t_on and t_off else None
        # the lowest SM clock sampled during each server's TTFT (bench/gpu_clocks.py): a slow turn at low clocks
        # is the card, not the code
        row["sm_mhz_min"] = [(t or {}).get("clocks", {}).get("sm_mhz_min") for t in (t_on, t_off)]
        rows.append(row)
    report["summary"] = rows
    last = rows[-1]
    report["last_turn"] = {
        "turn": last["turn"],
        "ratio": last["ratio"],
        "target": TARGET_RATIO,
        "met": None if last["ratio"] is None else last["ratio"] <= TARGET_RATIO,
        "new_fraction": last["new_tokens"] / last["prompt_tokens"],
        "computed_fraction": None
        if last["cached_tokens"] is None
        else 1 - last["cached_tokens"] / last["prompt_tokens"],
    }
    return rows


def print_table(report: dict, rows: list[dict]) -> None:
    ms = lambda s: "-" if s is None else f"{s * 1e3:.1f}"  # noqa: E731
    print(
        f"\nagent session: {report['turns']} turns to {report['final_context']} tokens, {report['max_tokens']} "
        f"answer tokens per turn; GPU: {report['gpu']}; {report['date']}"
    )
    print(
        f"{'turn':>4}{'prompt':>8}{'new':>7}{'cached':>8}{'snap hit':>9}{'TTFT on ms':>12}{'TTFT off ms':>13}"
        f"{'on/off':>8}{'step on ms':>11}{'worker':>8}{'device':>8}{'launch':>8}{'same ans':>9}{'ids exact':>10}"
        f"{'SM MHz on/off':>15}"
    )
    f1 = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1%}"
        same = "-" if r["same_answer"] is None else ("yes" if r["same_answer"] else "NO")
        print(
            f"{r['turn']:>4}{r['prompt_tokens']:>8}{r['new_tokens']:>7}{str(r['cached_tokens']):>8}"
            f"{str(r['snapshot_hit_tokens']):>9}{ms(r['ttft_cached_s']):>12}{ms(r['ttft_uncached_s']):>13}"
            f"{ratio:>8}{f1(r.get('step_engine_ms')):>11}{f1(r.get('step_forward_ms')):>8}"
            f"{f1(r.get('step_device_ms')):>8}{f1(r.get('step_launch_ms')):>8}{same:>9}"
            f"{'yes' if r['ids_exact'] else 'no':>10}"
            f"{'/'.join('-' if v is None else f'{v:.0f}' for v in r['sm_mhz_min']):>15}"
        )
    last = report["last_turn"]
    if last["ratio"] is not None:
        print(
            f"turn {last['turn']}: TTFT cached / uncached = {last['ratio']:.1%} (target <= {TARGET_RATIO:.0%}: "
            f"{'met' if last['met'] else 'NOT met'}); the cached server computed {last['computed_fraction']:.1%} "
            f"of its prompt (new tokens {last['new_fraction']:.1%})"
        )


if __name__ == "__main__":
    sys.exit(main())
