"""Expert-offload benchmark: the same model served with every expert resident (``--moe-backend fused``, the
baseline) and offloaded with GPU expert caches of several sizes, through the HTTP API. For each: batch-1 decode and
the expert-cache hit rate measured over it (from ``/v1/stats``), then prefill throughput with the cache as decode
left it. ``from cache`` is the share of the prefill's streamed experts copied from the cache's slots instead of over
PCIe (``--moe-prefill-hit-d2d``, the default), ``of floor`` its throughput against the PCIe floor of the experts it
did copy over PCIe (their bytes at ``--pcie-gb-s``); ``--hit-d2d`` adds each size with
``--disable-moe-prefill-hit-d2d`` beside it (every expert over PCIe: the A/B).
Against the hardware: every miss copies one expert over PCIe, so decode cannot beat
``misses/token × expert bytes / PCIe bandwidth``; the table prints that floor and how close decode gets.

Routing must be driven explicitly with dummy weights (REFERENCES §5.4): ``--routing uniform`` (worst case) or
``zipf`` (skewed) sets ``FREETOKEN_BENCH_ROUTING`` for every server, the baseline included.

    python bench/offload_bench.py --model-path configs/qwen3.6-35b-a3b --cache-sizes 1024,4096 --routing zipf \\
        --out bench/out/offload.json -- --dummy-weight --max-seq-len-override 32768
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from report import write_report  # noqa: E402
from serve_bench import long_prompt, stream_completion  # noqa: E402
from server_harness import ServerProcess  # noqa: E402


def expert_bytes(model_path: str, bytes_per_param: int = 2) -> int:
    """Bytes one offloaded expert moves over PCIe: its NVFP4 rows when the config quantizes the experts to NVFP4
    (``moe/nvfp4_rows.py``), else ``bytes_per_param`` per weight."""
    with open(os.path.join(model_path, "config.json")) as f:
        raw = json.load(f)
    cfg = raw.get("text_config", raw)
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    from freetoken.moe.nvfp4_rows import Nvfp4Rows
    from freetoken.quant.config import NVFP4_SCHEMES, find_quant_config

    quant = find_quant_config(None, raw)
    if quant is not None and quant.scheme_for("layers.0.mlp.experts.0.gate_proj") in NVFP4_SCHEMES:
        return Nvfp4Rows(H, I).expert_bytes
    return 3 * H * I * bytes_per_param


def run_one(label: str, serve_args: list[str], env: dict, a) -> dict:
    t0 = time.perf_counter()
    srv = ServerProcess(serve_args, env=env, ready_timeout=900)
    row = {"label": label, "serve_args": serve_args, "startup_s": time.perf_counter() - t0}
    try:
        warm = stream_completion(srv.url, long_prompt(a.prefill_words // 4), 2)
        if "error" in warm:
            raise RuntimeError(f"{label}: warm-up failed: {warm}")
        before = srv.get("/v1/stats").json()
        dec = stream_completion(srv.url, "Count slowly:", a.decode_tokens)
        after = srv.get("/v1/stats").json()
        # the prefill after the decode, so that the cache holds decode's experts (--moe-prefill-hit-d2d reads them)
        pre = stream_completion(srv.url, long_prompt(a.prefill_words) + " end", 2)
        row["prefill_tokens"] = pre["usage"]["prompt_tokens"]
        row["prefill_tok_s"] = pre["usage"]["prompt_tokens"] / pre["ttft_s"]
        streamed = srv.get("/v1/stats").json()
        from_cache = streamed.get("prefill_experts_from_cache", 0) - after.get("prefill_experts_from_cache", 0)
        from_host = streamed.get("prefill_experts_from_host", 0) - after.get("prefill_experts_from_host", 0)
        row["prefill_from_cache"] = from_cache / (from_cache + from_host) if from_cache + from_host else None
        row["prefill_experts_from_host"] = from_host
        itl = statistics.median(dec["gaps"])
        row["decode_tok_s"] = 1 / itl
        row["decode_median_itl_ms"] = itl * 1e3
        hits = after.get("expert_hits", 0) - before.get("expert_hits", 0)
        misses = after.get("expert_misses", 0) - before.get("expert_misses", 0)
        row["hit_rate"] = hits / (hits + misses) if hits + misses else None
        tokens = len(dec["gaps"]) + 1
        row["misses_per_token"] = misses / tokens
        log = srv.log()
        row["log_excerpt"] = [
            ln
            for ln in log.splitlines()
            if any(k in ln for k in ("Resolved config", "Expert offload", "Expert cache", "moe-cache-auto", "WARNING"))
        ]
    finally:
        row["exit_code"] = srv.stop()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--cache-sizes", default="1024", help="comma-separated --moe-cache-size values; 'auto' allowed")
    ap.add_argument("--routing", choices=["uniform", "zipf"], default="uniform")
    ap.add_argument("--prefill-words", type=int, default=7000)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--pcie-gb-s", type=float, default=55.0, help="host-to-device bandwidth for the floor")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument(
        "--hit-d2d",
        action="store_true",
        help="each cache size also with --disable-moe-prefill-hit-d2d (every expert over PCIe: the run beside it)",
    )
    ap.add_argument("--out", default="bench/out/offload.json")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    common = ["--model-path", a.model_path, "--max-running-requests", "1"] + [x for x in a.serve_args if x != "--"]
    env = {"FREETOKEN_BENCH_ROUTING": a.routing}
    eb = expert_bytes(a.model_path)
    configs = [] if a.no_baseline else [("fused (all resident)", ["--moe-backend", "fused"])]
    for size in a.cache_sizes.split(","):
        flag = [] if size == "auto" else ["--moe-cache-size", size]
        if a.hit_d2d:
            no_d2d = ["--moe-backend", "offload", "--disable-moe-prefill-hit-d2d"] + flag
            configs.append((f"offload, cache {size}, no d2d", no_d2d))
        configs.append((f"offload, cache {size}", ["--moe-backend", "offload"] + flag))
    runs, base = [], None
    for label, extra in configs:
        r = run_one(label, common + extra, env, a)
        base = base or (r["decode_tok_s"] if not a.no_baseline else None)
        floor_s = r["misses_per_token"] * eb / (a.pcie_gb_s * 1e9)
        r["pcie_floor_ms_per_token"] = floor_s * 1e3
        r["pcie_share_of_itl"] = floor_s * 1e3 / r["decode_median_itl_ms"]
        r["decode_vs_baseline"] = r["decode_tok_s"] / base if base else None
        # the prefill's PCIe floor: the experts its stream copied over PCIe (/v1/stats), at the link's rate
        pcie_s = r["prefill_experts_from_host"] * eb / (a.pcie_gb_s * 1e9)
        r["prefill_of_pcie_floor"] = r["prefill_tok_s"] * pcie_s / r["prefill_tokens"] if pcie_s else None
        runs.append(r)
        # after every run: a later run that times out keeps the earlier ones
        write_report(a.out, {"routing": a.routing, "expert_bytes": eb, "pcie_gb_s": a.pcie_gb_s, "runs": runs})
    print(f"routing={a.routing}, expert {eb / 2**20:.1f} MiB, PCIe {a.pcie_gb_s:g} GB/s")
    hdr = (
        "run",
        "start s",
        "prefill tok/s",
        "from cache",
        "of floor",
        "decode tok/s",
        "vs fused",
        "hit rate",
        "miss/tok",
        "PCIe floor ms",
        "floor/ITL",
    )
    print("".join(f"{h:>14}" if i else f"{h:<24}" for i, h in enumerate(hdr)))
    for r in runs:
        cells = [
            r["label"],
            f"{r['startup_s']:.1f}",
            f"{r['prefill_tok_s']:.0f}",
            "-" if r["prefill_from_cache"] is None else f"{r['prefill_from_cache']:.3f}",
            "-" if r["prefill_of_pcie_floor"] is None else f"{r['prefill_of_pcie_floor']:.2f}",
            f"{r['decode_tok_s']:.1f}",
            "-" if r["decode_vs_baseline"] is None else f"{r['decode_vs_baseline']:.2f}",
            "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}",
            f"{r['misses_per_token']:.1f}",
            f"{r['pcie_floor_ms_per_token']:.2f}",
            f"{r['pcie_share_of_itl']:.2f}",
        ]
        print("".join(f"{c:>14}" if i else f"{c:<24}" for i, c in enumerate(cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
