"""``CpuExperts``: one MoE layer's routed experts computed on the host CPU for a few tokens, reading the bank where it
lives in (pinned) host memory: the first piece of ``--moe-backend hybrid|cpu`` (an expert the GPU's cache misses is
computed here instead of fetched over PCIe).

The work is native (``crates/ft-cpu-experts`` through ``freetoken._core``): the gate|up rows of each routed expert,
then its down rows, split over a thread pool, with AVX-512 kernels where the CPU has them (BF16 rows, and NVFP4 rows
decoded 16 codes at a time; with VNNI, NVFP4 rows as exact int16 times x in int16 blocks; with AVX512-BF16, BF16 rows
times the BF16 x through its dot products) and portable ones elsewhere; sums in fp32, the GIL released::

    experts = CpuExperts((gate_up, down))                                       # BF16: [E, 2I, H], [E, H, I]
    experts = CpuExperts((w13, w13_scale, w13_global, w2, w2_scale, w2_global))  # NVFP4 (layers/nvfp4_experts.py)
    out = experts.forward(x, topk_ids, topk_weights, out)  # out[t] += sum_j w[t, j] * expert_{ids[t, j]}(x[t])

The bank's tensors are read in place, never copied: plain ``[E, ...]`` tensors or views whose experts sit at a
stride (``Nvfp4Rows.views``, the offload host bank of NVFP4 experts); inside an expert they must be row-major. The
object keeps them alive (the native side holds only their addresses). One executor (thread pool) per thread count
serves every layer (``executor``). NVFP4 banks need H and I divisible by 16.
"""

from __future__ import annotations

import functools
import os

import torch

_BF16 = ("gate_up", "down")
_NVFP4 = ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")
_SCALE_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # E4M3 block scales, or their bits


def physical_cores() -> int:
    """Cores (not hardware threads) this process may run on: the experts are bound by memory reads, which a
    second thread of a core does not add to."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as f, open(base + "core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            return os.cpu_count() or 1
    return len(cores) or os.cpu_count() or 1


@functools.cache
def executor(threads: int = 0, portable: bool = False):
    """The shared ``_core.CpuExpertExecutor`` of ``threads`` threads (0: ``physical_cores()``); ``portable``: the
    portable kernels even where AVX-512 runs (tests)."""
    from .. import _core

    return _core.CpuExpertExecutor(threads or physical_cores(), portable)


def _check(name: str, t: torch.Tensor, dtypes, shape: tuple) -> tuple[int, int, int]:
    """``(address, elements from it to the end of the last expert, stride(0))`` of a bank tensor, after checking
    it is on the CPU with this dtype and shape, row-major inside each expert."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    inner = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size > 1 and stride != inner:
            raise ValueError(f"{name} must be row-major inside each expert (strides {t.stride()})")
        inner *= size
    return t.data_ptr(), (shape[0] - 1) * t.stride(0) + inner, t.stride(0)


class CpuExperts:
    def __init__(self, bank, threads: int = 0, portable: bool = False):
        """``bank``: ``(gate_up, down)`` BF16 or the six NVFP4 tensors, CPU, in ``Nvfp4Experts.bank()`` order."""
        from .. import _core

        bank = tuple(bank)
        if len(bank) == 2:
            gate_up, down = bank
            if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3 or gate_up.shape[1] % 2:
                raise ValueError("gate_up must be a [E, 2I, H] tensor")
            E, I2, H = gate_up.shape
            I = I2 // 2
            bf16 = (torch.bfloat16,)
            self.native = _core.CpuExpertBank.bf16(
                E, H, I, _check("gate_up", gate_up, bf16, (E, 2 * I, H)), _check("down", down, bf16, (E, H, I))
            )
            self.format = "bf16"
        elif len(bank) == 6:
            w13, w2 = bank[0], bank[3]
            if not isinstance(w13, torch.Tensor) or w13.dim() != 3 or w13.shape[1] % 2:
                raise ValueError("w13 must be a [E, 2I, H/2] tensor")
            if not isinstance(w2, torch.Tensor) or w2.dim() != 3:
                raise ValueError("w2 must be a [E, H, I/2] tensor")
            E, I = w13.shape[0], w13.shape[1] // 2
            H = 2 * w13.shape[2]
            if H % 16 or I % 16:
                raise ValueError(f"NVFP4 experts need hidden ({H}) and intermediate ({I}) sizes divisible by 16")
            shapes = ((E, 2 * I, H // 2), (E, 2 * I, H // 16), (E, 2 * I), (E, H, I // 2), (E, H, I // 16), (E, H))
            dtypes = ((torch.uint8,), _SCALE_DTYPES, (torch.float32,)) * 2
            raw = [_check(n, t, d, s) for n, t, d, s in zip(_NVFP4, bank, dtypes, shapes)]
            self.native = _core.CpuExpertBank.nvfp4(E, H, I, *raw)
            self.format = "nvfp4"
        else:
            raise ValueError(f"a bank is {_BF16} (BF16) or {_NVFP4} (NVFP4), got {len(bank)} tensors")
        self.bank = bank  # the native bank reads these tensors' memory: keep them alive
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.executor = executor(threads, portable)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``out[t] += sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` (``out`` zeros when not given);
        returns ``out`` [T, H] fp32. ``x`` bf16 [T, H] contiguous; ``topk_ids`` int32/int64 [T, k], an id < 0 is
        no pair; ``topk_weights`` fp32/bf16 [T, k]; ``out`` fp32 [T, H] contiguous. All on the CPU."""
        H = self.hidden_size
        for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("out", out)):
            if (t is not None or name != "out") and (not isinstance(t, torch.Tensor) or t.device.type != "cpu"):
                raise ValueError(f"{name} must be a CPU tensor")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != H or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous bfloat16 [T, {H}] tensor, got {x.dtype} {list(x.shape)}")
        T = x.shape[0]
        if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
            raise ValueError(f"topk_ids must be int32 or int64 [{T}, k], got {topk_ids.dtype} {list(topk_ids.shape)}")
        if topk_weights.dtype not in (torch.float32, torch.bfloat16) or topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_weights must be float32 or bfloat16 {list(topk_ids.shape)}, "
                f"got {topk_weights.dtype} {list(topk_weights.shape)}"
            )
        if out is None:
            out = torch.zeros(T, H, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (T, H) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 [{T}, {H}] tensor, got {out.dtype} {list(out.shape)}")
        k = topk_ids.shape[1]
        if T == 0 or k == 0:
            return out
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        self.executor.forward(self.native, x.data_ptr(), T, ids.data_ptr(), weights.data_ptr(), k, out.data_ptr())
        return out

    def mailbox_call(self, mailbox, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor):
        """These experts over fixed buffers, registered with ``mailbox`` (``_core.CpuExpertMailbox``: its thread
        runs the call when the GPU asks, ``mailbox.run(index)`` here); returns its index. The call computes
        ``out = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``, zeroed first (zero and an error for the mailbox's
        ``take_errors()`` on failure). ``x`` bf16 [T, H], ``ids`` int64 [T, k], ``weights`` fp32 [T, k], ``out``
        fp32 [T, H]: contiguous CPU tensors (pinned, for a device's kernels) that the caller keeps alive as long as
        the mailbox."""
        return mailbox.add_call(self.executor, self.native, *self._fixed_buffers(x, ids, weights, out))

    def _fixed_buffers(self, x, ids, weights, out) -> tuple:
        """The native call's buffer arguments, checked: ``(x, T, ids, weights, k, out)``."""
        H = self.hidden_size
        T, k = ids.shape if ids.dim() == 2 else (-1, -1)
        for name, t, dtype, shape in (
            ("x", x, torch.bfloat16, (T, H)),
            ("ids", ids, torch.int64, (T, k)),
            ("weights", weights, torch.float32, (T, k)),
            ("out", out, torch.float32, (T, H)),
        ):
            ok = isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
            if not ok or t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor of shape {list(shape)}")
        return x.data_ptr(), T, ids.data_ptr(), weights.data_ptr(), k, out.data_ptr()
