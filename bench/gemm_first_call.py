"""The host cost of cuBLAS's first call at a new GEMM shape, and whether the start-up GEMM warm-up removes it.

A served cached turn brings a token count the process has not seen; profiled inside the server, its step stopped
the device for 3.3-4.8 ms before the first GEMM of each new shape (``bench/results/2026-12-05-h100-qwen3.6-35b-a3b-
served-steps-profile-20k.txt``). ``engine/gemm_warmup.py`` calls each GEMM at every multiple of 64 rows at start-up,
on the reasoning that the cost is a kernel module loaded on first use (cuBLAS sizes its kernels to M in 64-row
steps). This tells. For each mode, in a fresh process each (module loads do not carry over):

- ``cold``: nothing warmed;
- ``warm64``: every multiple of 64 rows from 64 to 8,192 called first (what start-up does now);
- ``pad64``: the same warm-up, then each call on its rows padded to a multiple of 64 (``FREETOKEN_GEMM_PAD_ROWS=64``,
  ``layers/gemm_rows.padded_rows_linear``, its activation copy included): a warmed shape at every call;
- ``eager``: ``CUDA_MODULE_LOADING=EAGER`` (every module of every library loaded at start: its start-up cost is
  printed as the process's CUDA init time);

it times the first and the second call at token counts an agent session brings (none a multiple of 64), per
projection shape of Qwen3.6-35B-A3B's prefill, with the device held busy by a sleep kernel queued first, so that the
host time is the call's own. If ``warm64``'s first calls cost what its second ones do, the warm-up works; if they
cost what ``cold``'s do, the cost is per shape and the GEMMs' rows must be padded to warmed counts as well
(``pad64``'s first calls should then cost its second ones; ``FREETOKEN_GEMM_PAD_ROWS=64``, ``layers/gemm_rows.py``:
then A/B the agent session with it).

    python3 bench/gemm_first_call.py --out bench/out/gemm_first_call.json      # CUDA; ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

from linear_host_cost import SHAPES  # noqa: E402  (the prefill step's cuBLAS linears)
from report import write_report  # noqa: E402

MODES = ("cold", "warm64", "pad64", "eager")
# new tokens of the agent session's cached turns (bench/agent_session_bench.py, 30k) and an uncached last chunk
NEW_ROWS = (1089, 1226, 1362, 1498, 1634, 1770, 1907, 2043, 2183, 5424)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=os.path.join("bench", "out", "gemm_first_call.json"))
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # one mode, in this process
    return ap.parse_args()


def child(mode: str) -> dict:
    """One mode's timings (this process: fresh CUDA context)."""
    import torch

    t0 = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    init_s = time.perf_counter() - t0
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for name, k, n in SHAPES}
    warm_s = 0.0
    if mode in ("warm64", "pad64"):
        from freetoken.engine.gemm_warmup import warmup_rows  # the row counts start-up warms

        t0 = time.perf_counter()
        for m in warmup_rows(8192, 64):
            for name, k, _ in SHAPES:
                torch.nn.functional.linear(torch.empty(m, k, device="cuda", dtype=torch.bfloat16), weights[name])
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
    from freetoken.layers.gemm_rows import padded_rows_linear  # what FREETOKEN_GEMM_PAD_ROWS=64 runs

    pad = 64 if mode == "pad64" else 0
    rows = []
    for m in NEW_ROWS:
        for name, k, _ in SHAPES:
            x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            linear = lambda a, w=weights[name]: torch.nn.functional.linear(a, w)  # noqa: E731
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e8))  # device work queued ahead: neither call below waits for the device
            times = []
            for _ in range(2):
                t = time.perf_counter()
                padded_rows_linear(x, linear, pad)
                times.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
            rows.append({"rows": m, "shape": name, "first_ms": times[0], "second_ms": times[1]})
    return {"mode": mode, "cuda_init_s": init_s, "warmup_s": warm_s, "calls": rows}


def main() -> int:
    a = parse_args()
    if a.child:
        print(json.dumps(child(a.child)))
        return 0
    results = []
    for mode in a.modes.split(","):
        env = dict(os.environ)
        if mode == "eager":
            env["CUDA_MODULE_LOADING"] = "EAGER"
        r = subprocess.run([sys.executable, __file__, "--child", mode], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{mode}: failed\n{r.stderr[-2000:]}")
            continue
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"cuBLAS first call at a new GEMM shape, host ms (device kept busy); GPU: {gpu}, torch {torch.__version__}")
    print(f"{'mode':<8}{'shape':<26}{'first med':>10}{'first max':>10}{'second med':>11}  (init s / warm-up s)")
    for r in results:
        for name, _, _ in SHAPES:
            calls = [c for c in r["calls"] if c["shape"] == name]
            first = [c["first_ms"] for c in calls]
            second = [c["second_ms"] for c in calls]
            print(
                f"{r['mode']:<8}{name[:25]:<26}{statistics.median(first):>10.3f}{max(first):>10.3f}"
                f"{statistics.median(second):>11.3f}  ({r['cuda_init_s']:.1f} / {r['warmup_s']:.1f})"
            )
    write_report(a.out, {"gpu": gpu, "torch": torch.__version__, "new_rows": NEW_ROWS, "modes": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
