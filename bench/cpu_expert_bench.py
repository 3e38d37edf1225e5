"""Could the host compute missed experts faster than PCIe brings them over? Times one decode token through BF16
experts of Qwen3.6-35B-A3B's shape (gate|up 1024 x 2048, down 2048 x 512, 6 MiB each) on the CPU with torch, for
1-8 experts of a layer, and prints the weight bytes read per second beside the pinned host-to-device copy bandwidth
(what the GPU's expert cache fetches at) and the host's plain read bandwidth (a sum over 1 GiB). A ``hybrid``
expert backend (misses computed where they live) only pays where the first beats the second.

Then the same through FreeToken's CPU expert executor (``freetoken.moe.cpu_experts``, ``crates/ft-cpu-experts``)
on a BF16 and an NVFP4 bank of 64 experts (1.70 MiB an expert in NVFP4), for 1 token and ``--tokens`` tokens routed
to the same experts (each expert read once for all of them): weight GB/s, its share of the host's read bandwidth
(``of read``) and the ratio to pinned H2D. Every call takes the next experts of the bank, so weights come from memory.
Beside each executor row, where its calls' time went (``CpuExpertExecutor.take_call_times``): microseconds a call in
each phase (pairs grouped, x laid out, gate|up, the activations laid out, down) and the pool's hand-off a broadcast
(workers that joined, the share that woke sleeping workers, the caller's wait for those that joined). ``--gap-us``
spins that long between calls, as a decode step's layers space them (~185 us a layer at 1 stream on the H100's
host): the workers spin 200 us before they sleep, so a longer gap measures calls that wake them.

    python3 bench/cpu_expert_bench.py [--threads N] [--tokens 1,4] [--gap-us 0] [--out bench/out/cpu_expert.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hardware_bandwidth import measure_bandwidth  # noqa: E402
from report import write_report  # noqa: E402

from freetoken._core import CPU_EXPERT_PHASES as PHASES  # noqa: E402

H, I, EXPERTS = 2048, 512, 64


def median_s(fn, reps: int = 20, between=None) -> float:
    """The median time of ``fn()``; ``between()``, untimed, before each."""
    fn()
    times = []
    for _ in range(reps):
        if between is not None:
            between()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--experts", default="1,2,4,8")
    ap.add_argument(
        "--tokens", default="1,4", help="tokens a call for the executor's rows (routed to the same experts)"
    )
    ap.add_argument("--gap-us", type=float, default=0.0, help="spin this long between the executor's calls")
    ap.add_argument("--out", default="bench/out/cpu_expert.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hw = measure_bandwidth() if torch.cuda.is_available() else {}
    big = torch.ones(2**30 // 4, dtype=torch.float32)
    read_gbs = big.numel() * 4 / median_s(big.sum, 5) / 1e9
    big = None
    # distinct experts, so that each one is read from memory, not from the caches
    w13 = torch.randn(EXPERTS, 2 * I, H, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, H, I, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, H, dtype=torch.bfloat16)
    per_expert = (w13[0].numel() + w2[0].numel()) * 2
    pcie = hw.get("pcie_h2d_gb_s")
    print(f"{a.threads} threads; host read {read_gbs:.1f} GB/s; pinned H2D {pcie or float('nan'):.1f} GB/s")
    print(f"{'experts':>8}{'ms':>10}{'GB/s':>8}{'vs H2D':>8}")
    rows, turn = [], [0]
    for n in (int(v) for v in a.experts.split(",")):

        def token(n=n):
            base = turn[0] % (EXPERTS // n) * n
            turn[0] += 1
            out = torch.zeros(1, H, dtype=torch.bfloat16)
            for e in range(base, base + n):
                gu = F.linear(x, w13[e])
                out += F.linear(F.silu(gu[:, :I]) * gu[:, I:], w2[e])
            return out

        s = median_s(token)
        gbs = n * per_expert / s / 1e9
        rows.append({"experts": n, "ms": s * 1e3, "gb_s": gbs})
        print(f"{n:>8}{s * 1e3:>10.3f}{gbs:>8.1f}{(gbs / pcie if pcie else float('nan')):>8.2f}")
    kernels, executor_rows = executor_table(a, w13, w2, read_gbs, pcie)
    report = {"threads": a.threads, "host_read_gb_s": read_gbs, "hardware": hw, "rows": rows}
    write_report(a.out, report | {"executor_kernels": kernels, "executor_rows": executor_rows})
    return 0


def nvfp4_bank(experts: int) -> tuple:
    """Random NVFP4 bytes in the bank layout (``layers/nvfp4_experts.py``), block scales in [1, 2)."""
    g = torch.Generator().manual_seed(0)
    codes = lambda rows, k: torch.randint(0, 256, (experts, rows, k // 2), generator=g, dtype=torch.uint8)
    scales = lambda rows, k: (torch.rand(experts, rows, k // 16, generator=g) + 1).to(torch.float8_e4m3fn)
    glob = lambda rows, k: torch.full((experts, rows), 0.3 / k**0.5)
    return tuple(f(*shape) for shape in ((2 * I, H), (H, I)) for f in (codes, scales, glob))


def executor_table(a, w13, w2, read_gbs: float, pcie) -> tuple[str, list]:
    """The CPU expert executor on BF16 (the torch rows' bank) and NVFP4 banks: its kernels and a row per (format,
    tokens, experts)."""
    from freetoken.moe.cpu_experts import CpuExperts

    banks = {"bf16": (w13, w2), "nvfp4": nvfp4_bank(EXPERTS)}
    experts = {name: CpuExperts(bank, threads=a.threads) for name, bank in banks.items()}
    kernels = next(iter(experts.values())).executor.kernels
    print(f"CPU expert executor: {a.threads} threads, {kernels} kernels, {a.gap_us:g} us between calls")
    print(
        f"{'format':>8}{'tokens':>8}{'experts':>8}{'ms':>10}{'GB/s':>8}{'of read':>9}{'vs H2D':>8}"
        f"   us a call: {''.join(f'{p:>{_width(p)}}' for p in PHASES)}"
        f"  a broadcast: {'joined':>7}{'woke':>6}{'wait us':>8}"
    )
    rows, turn = [], [0]
    for name, ex in experts.items():
        per_expert = sum(t[0].numel() * t.element_size() for t in banks[name])
        for tokens in (int(v) for v in a.tokens.split(",")):
            x = torch.randn(tokens, H).bfloat16()
            weights = torch.full((tokens, 1), 1.0)
            out = torch.zeros(tokens, H)
            for n in (int(v) for v in a.experts.split(",")):

                def step(n=n, ex=ex, x=x, weights=weights, out=out):
                    base = turn[0] % (EXPERTS // n) * n
                    turn[0] += 1
                    ids = torch.arange(base, base + n).expand(x.shape[0], n)
                    ex.forward(x, ids, weights.expand(x.shape[0], n), out)

                def gap():
                    t = time.perf_counter() + a.gap_us / 1e6
                    while time.perf_counter() < t:
                        pass

                ex.executor.take_call_times()
                s = median_s(step, between=gap if a.gap_us > 0 else None)
                split = call_split(ex.executor.take_call_times())
                gbs = n * per_expert / s / 1e9
                rows.append(
                    {
                        "format": name,
                        "tokens": tokens,
                        "experts": n,
                        "ms": s * 1e3,
                        "gb_s": gbs,
                        "of_read": gbs / read_gbs,
                        "gap_us": a.gap_us,
                    }
                    | split
                )
                h2d = gbs / pcie if pcie else float("nan")
                phase_us = "".join(f"{split[p + '_us']:>{_width(p)}.1f}" for p in PHASES)
                print(
                    f"{name:>8}{tokens:>8}{n:>8}{s * 1e3:>10.3f}{gbs:>8.1f}{gbs / read_gbs:>9.2f}{h2d:>8.2f}"
                    f"   {'':>10}{phase_us}"
                    f"  {'':>13}{split['joined']:>7.1f}"
                    f"{split['woke']:>6.2f}{split['wait_us']:>8.1f}"
                )
    return kernels, rows


def _width(phase: str) -> int:
    """A phase's column: its name and a margin, at least 6 wide."""
    return max(6, len(phase) + 1)


def call_split(times: dict) -> dict:
    """``take_call_times``'s sums as means: microseconds a call in each phase; workers joined, the share of
    broadcasts that woke sleepers and the caller's wait (us) a broadcast."""
    calls, broadcasts = max(times["calls"], 1), max(times["broadcasts"], 1)
    split = {f"{p}_us": times[f"{p}_ns"] / calls / 1e3 for p in PHASES}
    return split | {
        "broadcasts_a_call": times["broadcasts"] / calls,
        "joined": times["joined"] / broadcasts,
        "woke": times["wakeups"] / broadcasts,
        "wait_us": times["wait_ns"] / broadcasts / 1e3,
    }


if __name__ == "__main__":
    sys.exit(main())
