"""Decode benchmark (issue 9): our server with decode CUDA graphs against the same server run eagerly
(``--disable-cuda-graph``, the baseline beside it on the same card), all through the HTTP API, with the hardware
limits measured first. Prints a table and writes JSON.

    python bench/decode_bench.py --model-path configs/qwen3.6-35b-a3b --out bench/out/decode.json

Runs, one server at a time:
- ``graphs``: all experts resident. Prefill of one long prompt with the dummy router and with uniform routing;
  decode of 1 stream and of ``--streams`` concurrent streams (aggregate tok/s, p50/p99 inter-token gap); the
  engine's own per-step times from ``/v1/stats`` (worker step, whole engine iteration) beside the gap seen over
  HTTP, which together say what each layer of the stack costs per token.
- ``eager``: the same decode runs with ``--disable-cuda-graph``.
- ``no_overlap`` (unless ``--skip-no-overlap``): the graphs server with overlap scheduling off
  (``DISABLE_OVERLAP_SCHEDULING=1``: each step committed before the next is planned), to show what planning step
  N+1 while step N runs on the GPU gains (``overlapped_steps`` from ``/v1/stats`` says it happened).
- ``offload`` (unless ``--skip-offload``): ``--moe-backend offload --moe-cache-size N``, 1 stream under Zipf,
  uniform and hot (all-hit) routing, switched while the server runs (``FREETOKEN_BENCH_ROUTING_FILE``), with the
  measured hit rate and the PCIe floor (misses per token x expert bytes / measured PCIe bandwidth); once per
  expert cache policy of ``--offload-policies`` (``lfu,lru``: the eviction A/B on the same card, one server each);
  ``--offload-streams N`` adds N concurrent streams under Zipf and uniform routing, with their hit rate.
- ``hybrid`` runs (``--hybrid 1,2,cpu``): the same as ``offload`` with ``--moe-backend hybrid
  --moe-hybrid-max-fetch N`` (``cpu``: ``--moe-backend cpu``): at most N misses a layer per step fetched, the host CPU
  computing the rest (``--moe-cpu-threads`` from the server args), beside the offload run on the same card; ``host
  ms/tok``: the host's time on its experts a token (``/v1/stats`` ``expert_host_busy_ms``), beside the ITL.

Against the hardware: the HBM roofline of a batch-1 step is the bytes a decode token must read (every dense
weight, lm_head, top-k experts per MoE layer, the recurrent state read and written) over the measured
device-to-device copy bandwidth. Reference figures of FreeToken 0.1.2 on the same H200 (REFERENCES §5.4) are
printed beside ours: 262.7 tok/s all resident, 174.6 tok/s offload (an all-hit figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from hardware_bandwidth import measure_bandwidth  # noqa: E402
from report import write_report  # noqa: E402
from serve_bench import long_prompt, stream_completion, stream_together  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

FREETOKEN_012 = {"resident_bs1": 262.7, "offload_all_hit_bs1": 174.6}  # tok/s, REFERENCES §5.4


# ------------------------------------------------------------------ the hardware


def _meta_model(model_path: str):
    """The model built on the meta device in BF16, in its checkpoint's quantized layout when config.json has a
    quantization block (NVFP4 experts and Linears at their real size)."""
    import torch

    from freetoken.loading.model_loader import skip_init
    from freetoken.loading.quantized_model import build_quantized_model
    from freetoken.models.base import ModelConfig
    from freetoken.models.registry import model_class
    from freetoken.quant.config import find_quant_config

    with open(os.path.join(model_path, "config.json")) as f:
        raw = json.load(f)
    cfg, quant = ModelConfig.from_dict(raw), find_quant_config(None, raw)
    meta = torch.device("meta")
    with skip_init(torch.bfloat16, meta):
        if quant is not None:
            return cfg, build_quantized_model(model_class(cfg), cfg, quant, torch.bfloat16, meta)
        return cfg, model_class(cfg)(cfg)


def decode_bytes_per_token(model_path: str) -> dict:
    """Bytes one batch-1 decode token must read, from the model's shapes (built on the meta device, quantized
    layers at their quantized size): every parameter but the embedding table (one row) and the routed experts
    (top-k per MoE layer), plus the recurrent state read and written. Also the bytes of one routed expert."""
    import torch

    cfg, model = _meta_model(model_path)
    elt = 2  # bf16 activations and state

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    total = nbytes(model.parameters())
    embed = model.embed_tokens.weight if hasattr(model, "embed_tokens") else model.model.embed_tokens.weight
    experts = [m for m in model.modules() if type(m).__name__ in ("FusedExperts", "Nvfp4Experts")]
    expert_bytes = nbytes(p[0] for p in experts[0].parameters()) if experts else 0
    routed = sum(nbytes(e.parameters()) for e in experts)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    active = total - nbytes([embed]) - routed + len(experts) * top_k * expert_bytes
    state = 0
    if model.state_layout is not None:
        s = model.state_layout
        state = 2 * s.num_layers * (torch.Size(s.ssm_shape).numel() * 4 + torch.Size(s.conv_shape).numel() * elt)
    return {
        "weight_bytes": active,
        "state_bytes": state,
        "bytes": active + state,
        "expert_bytes": expert_bytes,
        "moe_layers": len(experts),
        "num_experts": int(cfg.get("num_experts") or 0),
        "top_k": top_k,
    }


def uniform_step_bytes(need: dict, streams: int) -> float:
    """Bytes a decode step of ``streams`` sequences must read under uniform routing: the batch-1 weights with
    the top-k experts replaced by the expected number of distinct experts ``E (1 - (1 - k/E)^B)`` per MoE layer,
    plus every sequence's recurrent state."""
    E, k, L = need.get("num_experts", 0), need.get("top_k", 0), need.get("moe_layers", 0)
    distinct = E * (1 - (1 - k / E) ** streams) if E else 0.0
    dense = need["weight_bytes"] - L * k * need["expert_bytes"]
    return dense + L * distinct * need["expert_bytes"] + streams * need["state_bytes"]


def zipf_best_hit_rate(need: dict, cache_size: int, draws: int = 20000) -> float:
    """The hit rate of the best fixed expert cache under ``FREETOKEN_BENCH_ROUTING=zipf`` (the same Gumbel top-k
    draws over Zipf(1) popularity): each MoE layer holds its ``cache_size / layers`` most popular experts (a
    fractional share interpolated), simulated over ``draws`` tokens. No eviction policy can beat it on average,
    so its PCIe floor bounds the Zipf decode rate whatever the cache does."""
    import torch

    E, k, L = need["num_experts"], need["top_k"], need["moe_layers"]
    g = torch.Generator().manual_seed(0)
    u = torch.rand(draws, E, generator=g).clamp_(min=1e-20)
    ids = (-torch.log(-torch.log(u)) + torch.log(1.0 / torch.arange(1, E + 1, dtype=torch.float32))).topk(k).indices
    per_layer = min(E, cache_size / L)
    lo = int(per_layer)
    frac = per_layer - lo
    return float((ids < lo).float().mean() * (1 - frac) + (ids < min(E, lo + 1)).float().mean() * frac)


# ------------------------------------------------------------------ measurements through HTTP


def set_routing(path: str, mode: str) -> None:
    with open(path, "w") as f:
        f.write(mode)


def decode_stats(srv) -> dict:
    s = srv.get("/v1/stats").json()
    return {
        k: s.get(k, 0)
        for k in (
            "decode_steps",
            "decode_forward_ms_total",
            "decode_engine_ms_total",
            "expert_hits",
            "expert_misses",
            "expert_host_misses",
            "expert_host_busy_ms",
            "overlapped_steps",
        )
    }


def stats_since(srv, before: dict) -> dict:
    """``decode_stats`` counted since ``before``, with the expert cache's hit rate over them (None: no lookup)."""
    d = {k: v - before[k] for k, v in decode_stats(srv).items()}
    looked = d["expert_hits"] + d["expert_misses"]
    d["hit_rate"] = d["expert_hits"] / looked if looked else None
    return d


def one_stream(srv, tokens: int) -> dict:
    before = decode_stats(srv)
    r = stream_completion(srv.url, "Count slowly:", tokens)
    d = stats_since(srv, before)
    if "error" in r:
        raise RuntimeError(f"decode failed: {r}")
    n = r["usage"]["completion_tokens"]
    span = sum(r["gaps"])
    steps = max(1, d["decode_steps"])
    return {
        "tokens": n,
        "tok_s": (n - 1) / span,
        "itl_ms_p50": statistics.median(r["gaps"]) * 1e3,
        "http_ms_per_token": span / (n - 1) * 1e3,
        "engine_ms_per_step": d["decode_engine_ms_total"] / steps,
        "worker_ms_per_step": d["decode_forward_ms_total"] / steps,
        "hit_rate": d["hit_rate"],
        "misses_per_token": d["expert_misses"] / steps,
        "host_misses_per_token": d["expert_host_misses"] / steps,  # computed on the CPU (hybrid / cpu)
        "host_ms_per_token": d["expert_host_busy_ms"] / steps,  # the host's time on them
        "overlapped_steps": d["overlapped_steps"],
    }


def many_streams(srv, streams: int, tokens: int) -> dict:
    results = stream_together(srv.url, [f"Count slowly, stream {i}:" for i in range(streams)], tokens)
    gaps = sorted(g for r in results for g in r["gaps"])
    decoded = sum(r["usage"]["completion_tokens"] - 1 for r in results)
    span = statistics.mean(sum(r["gaps"]) for r in results)
    return {
        "streams": streams,
        "tok_s": decoded / span,
        "itl_ms_p50": gaps[len(gaps) // 2] * 1e3,
        "itl_ms_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3,
    }


def prefill(srv, words: int, lead: str = "") -> dict:
    """TTFT of a ~``words``-word prompt; ``lead`` starts it with other tokens (no prefix shared with an earlier one:
    the radix cache cannot shorten it)."""
    r = stream_completion(srv.url, lead + long_prompt(words) + " end", 2)
    if "error" in r:
        raise RuntimeError(f"prefill failed: {r}")
    return {"prompt_tokens": r["usage"]["prompt_tokens"], "tok_s": r["usage"]["prompt_tokens"] / r["ttft_s"]}


def start(label: str, args: list[str], env: dict, timeout: float = 900) -> tuple:
    t0 = time.perf_counter()
    srv = ServerProcess(args, env=env, ready_timeout=timeout)
    startup = time.perf_counter() - t0
    log = srv.log()
    lines = [
        ln
        for ln in log.splitlines()
        if any(
            k in ln
            for k in (
                "Captured CUDA graphs",
                "Start capturing",
                "Resolved config",
                "Expert cache",
                "Prefill warm-up",
                "WARNING",
            )
        )
    ]
    print(f"[{label}] ready in {startup:.0f} s", *lines, sep="\n  ", flush=True)
    return srv, {"label": label, "serve_args": args, "startup_s": startup, "log_excerpt": lines}


# ------------------------------------------------------------------ the runs


def resident_run(label: str, args: list[str], env: dict, a, routing_file: str, with_prefill: bool) -> dict:
    srv, row = start(label, args, env)
    try:
        stream_completion(srv.url, "warm up", 8)
        if with_prefill:
            set_routing(routing_file, "off")
            row["prefill_dummy_router"] = prefill(srv, a.prefill_words)
            set_routing(routing_file, "uniform")
            stream_completion(srv.url, "warm up", 4)  # the switch drops the graphs: not inside the timed prefill
            # a prompt of its own: the dummy-router one is in the radix cache now (a hit would time the cache)
            row["prefill_uniform"] = prefill(srv, a.prefill_words, lead="Uniform: ")
            set_routing(routing_file, "off")
            stream_completion(srv.url, "warm up", 4)  # the routing change recaptures the graphs
        one_stream(srv, 16)
        row["bs1"] = one_stream(srv, a.decode_tokens)
        row["many"] = many_streams(srv, a.streams, a.decode_tokens)
        if with_prefill:  # the same streams with uniform routing: a known number of distinct experts per step
            set_routing(routing_file, "uniform")
            stream_completion(srv.url, "warm up", 4)
            row["many_uniform"] = many_streams(srv, a.streams, a.decode_tokens)
            set_routing(routing_file, "off")
    finally:
        row["request_path_events"] = srv.request_path_events()
        row["exit_code"] = srv.stop()
    return row


def offload_run(
    args: list[str], env: dict, a, routing_file: str, policy: str, with_prefill: bool, backend: str = "offload"
) -> dict:
    srv, row = start(f"{backend} {policy}", args, {**env, "FREETOKEN_MOE_CACHE_POLICY": policy})
    row["cache_size"], row["policy"], row["backend"] = a.cache_size, policy, backend
    try:
        for mode in ("zipf", "uniform", "hot"):
            set_routing(routing_file, mode)
            stream_completion(srv.url, "warm up", 48)  # recapture, and fill the cache under this routing
            row[mode] = one_stream(srv, a.decode_tokens)
        if a.offload_streams:  # many streams over the cache (decode graphs up to ExpertOffload.max_cached_batch)
            for mode in ("zipf", "uniform"):
                set_routing(routing_file, mode)
                stream_completion(srv.url, "warm up", 48)
                before = decode_stats(srv)
                row[f"many_{mode}"] = many_streams(srv, a.offload_streams, a.decode_tokens)
                row[f"many_{mode}"]["hit_rate"] = stats_since(srv, before)["hit_rate"]
        if not with_prefill:
            return row
        set_routing(routing_file, "uniform")  # prefill streams every layer's experts whatever the routing
        stream_completion(srv.url, "warm up", 4)
        # twice, two prompts: the first pays any one-off cost of a chunk this long (a kernel configuration the
        # start-up warm-up did not run), the second is the steady state
        row["prefill_uniform_first"] = prefill(srv, a.prefill_words)
        row["prefill_uniform"] = prefill(srv, a.prefill_words, lead="Second: ")
    finally:
        row["request_path_events"] = srv.request_path_events()
        row["exit_code"] = srv.stop()
    return row


def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-words", type=int, default=7000, help="~8k tokens with the Qwen tokenizer")
    ap.add_argument("--cache-size", type=int, default=1024)
    ap.add_argument("--max-seq-len", type=int, default=16384, help="--max-seq-len-override of every server")
    ap.add_argument("--max-prefill-length", type=int, default=8192)
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument("--skip-no-overlap", action="store_true", help="no run with DISABLE_OVERLAP_SCHEDULING=1")
    ap.add_argument("--skip-offload", action="store_true")
    ap.add_argument("--skip-resident", action="store_true", help="only the offload run")
    ap.add_argument(
        "--offload-streams",
        type=int,
        default=0,
        help="also decode this many concurrent streams on each offload server (Zipf and uniform routing)",
    )
    ap.add_argument(
        "--offload-policies",
        default="lfu",
        help="expert cache policies to run offload decode with, one server each (e.g. lfu,lru: the A/B)",
    )
    ap.add_argument(
        "--hybrid",
        default="",
        help="also decode with --moe-backend hybrid at these --moe-hybrid-max-fetch values, one server each "
        "(comma list; 'cpu' for --moe-backend cpu)",
    )
    ap.add_argument("--out", default="bench/out/decode.json")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    extra = [x for x in a.serve_args if x != "--"]
    hw = measure_bandwidth()
    need = decode_bytes_per_token(a.model_path)
    print(f"hardware: {hw}; decode bytes/token: {need['bytes'] / 1e9:.2f} GB", flush=True)
    routing_file = os.path.join(tempfile.mkdtemp(prefix="ft-bench-"), "routing")
    set_routing(routing_file, "off")
    env = {"FREETOKEN_BENCH_ROUTING_FILE": routing_file}
    common = [
        "--model-path",
        a.model_path,
        "--dummy-weight",
        "--max-seq-len-override",
        str(a.max_seq_len),
        "--max-prefill-length",
        str(a.max_prefill_length),
        *extra,
    ]
    resident = ["--moe-backend", "fused", "--max-running-requests", str(a.streams)]
    report = {"hardware": hw, "decode_bytes": need, "freetoken_0_1_2": FREETOKEN_012, "runs": {}}

    def save():
        write_report(a.out, report)

    def attempt(name, fn, *args, **kw):
        """A run that fails is recorded with its error; the others still run and print."""
        try:
            report["runs"][name] = fn(*args, **kw)
        except Exception as e:  # noqa: BLE001
            print(f"[{name}] failed: {e}", flush=True)
            report["errors"] = {**report.get("errors", {}), name: str(e)[-3000:]}
        save()

    if not a.skip_resident:
        attempt("graphs", resident_run, "graphs", common + resident, env, a, routing_file, with_prefill=True)
    if not a.skip_eager and not a.skip_resident:
        attempt(
            "eager",
            resident_run,
            "eager",
            common + resident + ["--disable-cuda-graph"],
            env,
            a,
            routing_file,
            with_prefill=False,
        )
    if not a.skip_no_overlap and not a.skip_resident:
        no_overlap_env = {**env, "DISABLE_OVERLAP_SCHEDULING": "1"}
        attempt("no_overlap", resident_run, "no_overlap", common + resident, no_overlap_env, a, routing_file, False)
    if not a.skip_offload:
        running = str(max(4, a.offload_streams))
        off = ["--moe-backend", "offload", "--moe-cache-size", str(a.cache_size), "--max-running-requests", running]
        for i, policy in enumerate(a.offload_policies.split(",")):
            name = "offload" if i == 0 else f"offload_{policy}"
            attempt(name, offload_run, common + off, env, a, routing_file, policy, with_prefill=i == 0)
    for fetch in filter(None, a.hybrid.split(",")):
        backend = (
            ["--moe-backend", "cpu"] if fetch == "cpu" else ["--moe-backend", "hybrid", "--moe-hybrid-max-fetch", fetch]
        )
        label = "cpu" if fetch == "cpu" else f"hybrid fetch {fetch}"
        hybrid = backend + [
            "--moe-cache-size",
            str(a.cache_size),
            "--max-running-requests",
            str(max(4, a.offload_streams)),
        ]
        policy = a.offload_policies.split(",")[0]
        attempt(label, offload_run, common + hybrid, env, a, routing_file, policy, False, label)
    print_table(report)
    return 1 if report.get("errors") else 0


def print_table(report: dict) -> None:
    hw, need, runs = report["hardware"], report["decode_bytes"], report["runs"]
    roof_ms = need["bytes"] / (hw["hbm_copy_gb_s"] * 1e9) * 1e3 if hw else None
    if "graphs" in runs:
        print_resident(runs, hw, need, roof_ms)
    for name in runs:
        if name.startswith(("offload", "hybrid", "cpu")):
            print_offload(runs[name], hw, need)
    for name, run in runs.items():  # one-off stalls inside the timed runs (a compile, an allocator growth)
        for line in run.get("request_path_events", []):
            print(f"[{name}] {line}")


def print_resident(runs: dict, hw: dict, need: dict, roof_ms) -> None:
    g = runs["graphs"]
    print(
        f"\nHBM copy {hw.get('hbm_copy_gb_s', 0):.0f} GB/s, PCIe H2D {hw.get('pcie_h2d_gb_s', 0):.1f} GB/s; a decode "
        f"token reads {need['bytes'] / 1e9:.2f} GB -> HBM roofline {roof_ms or 0:.2f} ms/token"
    )
    print(
        f"{'run':<34}{'tok/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'worker ms':>11}{'engine ms':>11}{'vs eager':>10}"
        f"{'vs FT 0.1.2':>13}{'roofline':>10}"
    )
    e = runs.get("eager")

    def line(name, r, base=None, ft=None, roof=True):
        cells = [
            f"{r['tok_s']:.1f}",
            f"{r['itl_ms_p50']:.2f}",
            f"{r['itl_ms_p99']:.2f}" if "itl_ms_p99" in r else "-",
            f"{r['worker_ms_per_step']:.2f}" if "worker_ms_per_step" in r else "-",
            f"{r['engine_ms_per_step']:.2f}" if "engine_ms_per_step" in r else "-",
            f"{r['tok_s'] / base:.2f}x" if base else "-",
            f"{r['tok_s'] / ft:.2f}x" if ft else "-",
            f"{roof_ms * r['tok_s'] / 1e3:.2f}" if roof and roof_ms else "-",
        ]
        print(f"{name:<34}" + "".join(f"{c:>{w}}" for c, w in zip(cells, (10, 9, 9, 11, 11, 10, 13, 10))))

    line("resident, 1 stream, graphs", g["bs1"], e and e["bs1"]["tok_s"], FREETOKEN_012["resident_bs1"])
    if e:
        line("resident, 1 stream, eager", e["bs1"], None, FREETOKEN_012["resident_bs1"])
    line(f"resident, {g['many']['streams']} streams, graphs", g["many"], e and e["many"]["tok_s"], roof=False)
    if e:
        line(f"resident, {e['many']['streams']} streams, eager", e["many"], roof=False)
    u = g.get("many_uniform")
    if u and hw:
        roof_tok_s = u["streams"] / (uniform_step_bytes(need, u["streams"]) / (hw["hbm_copy_gb_s"] * 1e9))
        line(f"resident, {u['streams']} streams, uniform routing", u, roof=False)
        print(
            f"  {u['streams']} streams under uniform routing read "
            f"{uniform_step_bytes(need, u['streams']) / 1e9:.1f} GB "
            f"a step (distinct experts, every state): HBM roofline {roof_tok_s:.0f} tok/s, measured "
            f"{u['tok_s'] / roof_tok_s:.2f} of it"
        )
    n = runs.get("no_overlap")
    if n:
        line("resident, 1 stream, overlap off", n["bs1"], None, FREETOKEN_012["resident_bs1"])
        line(f"resident, {n['many']['streams']} streams, overlap off", n["many"], roof=False)
        print(
            f"overlap on / off: 1 stream {g['bs1']['tok_s'] / n['bs1']['tok_s']:.2f}x, {g['many']['streams']} streams "
            f"{g['many']['tok_s'] / n['many']['tok_s']:.2f}x (overlapped steps at 1 stream: "
            f"{g['bs1'].get('overlapped_steps', 0)} on, {n['bs1'].get('overlapped_steps', 0)} off)"
        )
    b = g["bs1"]
    print(
        f"per token at 1 stream: HTTP gap {b['http_ms_per_token']:.2f} ms, engine iteration "
        f"{b['engine_ms_per_step']:.2f} ms, worker step {b['worker_ms_per_step']:.2f} ms -> HTTP path "
        f"{b['http_ms_per_token'] - b['engine_ms_per_step']:.2f} ms, engine outside the worker "
        f"{b['engine_ms_per_step'] - b['worker_ms_per_step']:.2f} ms"
    )
    for k, name in (("prefill_dummy_router", "dummy router"), ("prefill_uniform", "uniform routing")):
        if k in g:
            print(f"prefill {g[k]['prompt_tokens']} tokens, {name}: {g[k]['tok_s']:.0f} tok/s")


def print_offload(off: dict, hw: dict, need: dict) -> None:
    if True:
        pcie = hw.get("pcie_h2d_gb_s", 55.0) * 1e9
        title = f"{off.get('backend', 'offload')}, cache {off['cache_size']}, {off.get('policy', 'lru')}"
        print(
            f"\n{title:<34}{'tok/s':>10}{'hit rate':>10}{'miss/tok':>10}{'host/tok':>10}{'host ms/tok':>13}"
            f"{'PCIe floor ms':>15}{'floor/ITL':>11}{'vs FT all-hit':>15}"
        )
        for mode in ("zipf", "uniform", "hot"):
            r = off[mode]
            host = r.get("host_misses_per_token", 0.0)
            floor = (r["misses_per_token"] - host) * need["expert_bytes"] / pcie * 1e3  # the fetched misses
            hr = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
            cells = [
                f"{r['tok_s']:.1f}",
                hr,
                f"{r['misses_per_token']:.1f}",
                f"{host:.1f}",
                f"{r.get('host_ms_per_token', 0.0):.2f}",  # the host's time on its experts (hybrid / cpu)
                f"{floor:.2f}",
                f"{floor / r['http_ms_per_token']:.2f}",
                f"{r['tok_s'] / FREETOKEN_012['offload_all_hit_bs1']:.2f}x",
            ]
            widths = (10, 10, 10, 10, 13, 15, 11, 15)
            print(f"{mode + ' routing':<34}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
        for mode in ("zipf", "uniform"):
            m = off.get(f"many_{mode}")
            if m:
                hr = "-" if m["hit_rate"] is None else f"{m['hit_rate']:.3f}"
                print(
                    f"{mode + ', ' + str(m['streams']) + ' streams':<34}{m['tok_s']:>10.1f}{hr:>10}"
                    f"   (gap p50 {m['itl_ms_p50']:.1f} ms, p99 {m['itl_ms_p99']:.1f} ms)"
                )
        best = zipf_best_hit_rate(need, off["cache_size"])
        floor = (1 - best) * need["top_k"] * need["moe_layers"] * need["expert_bytes"] / pcie * 1e3
        print(
            f"  zipf, the best fixed cache of {off['cache_size']} experts (each layer its most popular): hit rate "
            f"{best:.3f}, PCIe floor {floor:.2f} ms -> at most {1e3 / floor:.0f} tok/s at 1 stream"
        )
        if "prefill_uniform" in off:
            p, first = off["prefill_uniform"], off.get("prefill_uniform_first")
            before = f" (the first such prompt: {first['tok_s']:.0f} tok/s)" if first else ""
            print(f"offload prefill {p['prompt_tokens']} tokens, uniform routing: {p['tok_s']:.0f} tok/s{before}")


if __name__ == "__main__":
    sys.exit(main())
