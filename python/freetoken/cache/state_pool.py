"""Recurrent-state slots of hybrid models (Gated DeltaNet layers).

Rust hands out slot indices (one live slot per running hybrid request, plus snapshot slots owned by the radix
tree); this pool owns the memory behind them. Per GDN layer ``i``:

    conv[i]  [num_slots, conv_dim, Kc - 1]   the last Kc-1 conv *inputs* (channels-first, like HF's conv state)
    ssm[i]   [num_slots, Hv, dk, dv]         the delta-rule state, HF/fla layout (NOT vLLM/SGLang's [Hv, dv, dk])

The SSM state is fp32 by default (``mamba_ssm_dtype: float32`` in the real configs); ``FREETOKEN_MAMBA_SSM_DTYPE``
(``float32`` / ``bfloat16`` / ``float16``) overrides it. A slot's content is meaningful only after a forward
wrote it: a sequence with ``prefix_len == 0`` never reads its slot, so slots need no zeroing on allocation.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def default_ssm_dtype() -> torch.dtype:
    """fp32 unless ``FREETOKEN_MAMBA_SSM_DTYPE`` says otherwise."""
    name = os.environ.get("FREETOKEN_MAMBA_SSM_DTYPE", "float32").strip().lower()
    if name not in _DTYPES:
        raise ValueError(f"FREETOKEN_MAMBA_SSM_DTYPE={name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class _instance_or_static:
    """``pool.bytes_per_slot()`` on an instance, ``RecurrentStatePool.bytes_per_slot(...)`` with explicit sizes
    on the class (for memory planning before a pool exists)."""

    def __init__(self, inst_fn, static_fn):
        self.inst_fn, self.static_fn = inst_fn, static_fn

    def __get__(self, obj, cls):
        if obj is None:
            return self.static_fn
        return self.inst_fn.__get__(obj, cls)


def _static_bytes_per_slot(
    num_layers: int,
    conv_shape: Sequence[int],
    ssm_shape: Sequence[int],
    conv_dtype: torch.dtype,
    ssm_dtype: Optional[torch.dtype] = None,
) -> int:
    ssm_dtype = ssm_dtype or default_ssm_dtype()
    ce = torch.empty(0, dtype=conv_dtype).element_size()
    se = torch.empty(0, dtype=ssm_dtype).element_size()
    return num_layers * (_numel(conv_shape) * ce + _numel(ssm_shape) * se)


class RecurrentStatePool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        conv_shape: Sequence[int],
        ssm_shape: Sequence[int],
        conv_dtype: torch.dtype = torch.bfloat16,
        ssm_dtype: Optional[torch.dtype] = None,
        device: torch.device | str = "cpu",
    ):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.conv_shape = tuple(int(s) for s in conv_shape)
        self.ssm_shape = tuple(int(s) for s in ssm_shape)
        self.conv_dtype = conv_dtype
        self.ssm_dtype = ssm_dtype or default_ssm_dtype()
        self.device = torch.device(device)
        self.conv = [
            torch.zeros(num_slots, *self.conv_shape, dtype=conv_dtype, device=self.device) for _ in range(num_layers)
        ]
        self.ssm = [
            torch.zeros(num_slots, *self.ssm_shape, dtype=self.ssm_dtype, device=self.device) for _ in range(num_layers)
        ]

    @classmethod
    def from_layout(cls, layout, num_slots: int, conv_dtype: torch.dtype, device) -> "RecurrentStatePool":
        """Build from a model's ``StateLayout``."""
        return cls(
            layout.num_layers, num_slots, layout.conv_shape, layout.ssm_shape, conv_dtype, layout.ssm_dtype, device
        )

    def _index(self, idx, device: bool = True) -> torch.Tensor:
        t = torch.as_tensor(idx, dtype=torch.int64).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_slots):
            from ..errors import InvalidPlan

            raise InvalidPlan(f"state slot out of range 0..{self.num_slots - 1}: {t.tolist()}")
        return t.to(self.device) if device else t

    def copy(self, src, dst) -> None:
        """``slot dst[j] <- slot src[j]`` in every layer (snapshot restore / capture). Sources are read before any
        destination is written, so overlapping lists behave like a simultaneous copy."""
        s, d = self._index(src, device=False).tolist(), self._index(dst, device=False).tolist()
        if len(s) != len(d):
            from ..errors import InvalidPlan

            raise InvalidPlan(f"state copy with {len(s)} sources and {len(d)} destinations")
        if not s:
            return
        if not set(s) & set(d):  # the usual case (a snapshot and a live slot): one multi-tensor copy, where
            pools = self.conv + self.ssm  # per-layer gathers cost ~4 launches a layer (30 GDN layers)
            torch._foreach_copy_([p[j] for p in pools for j in d], [p[i] for p in pools for i in s])
            return
        s, d = torch.tensor(s, device=self.device), torch.tensor(d, device=self.device)
        for layer in range(self.num_layers):
            self.conv[layer][d] = self.conv[layer][s]
            self.ssm[layer][d] = self.ssm[layer][s]

    def zero(self, slots) -> None:
        """Clear slots (not needed for correctness, see the module doc; useful in tests and debugging)."""
        i = self._index(slots)
        for layer in range(self.num_layers):
            self.conv[layer][i] = 0
            self.ssm[layer][i] = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)

    def _inst_bytes_per_slot(self) -> int:
        return _static_bytes_per_slot(self.num_layers, self.conv_shape, self.ssm_shape, self.conv_dtype, self.ssm_dtype)

    bytes_per_slot = _instance_or_static(_inst_bytes_per_slot, _static_bytes_per_slot)
