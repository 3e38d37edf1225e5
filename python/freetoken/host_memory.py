"""Host memory checked before loading: what the load will hold in host RAM, against what the machine has available,
so too little memory is one line (``StartupRefused``, exit 1 from ``ft serve``) instead of an allocator traceback or
the OOM killer minutes into the load.

What the load holds in host memory (counted on the meta device, nothing allocated):

- on the CPU, every weight, in the dtype it runs in (a GGUF model dequantized);
- with ``--moe-backend offload``, the routed experts' banks in pinned host memory;
- fused on CUDA, nothing lasting (the weights stream from the checkpoint to the device).

Quantized checkpoints are counted in their quantized layout: on the CPU every weight, offloaded NVFP4 experts at
their NVFP4 size (``moe/nvfp4_rows.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .errors import StartupRefused
from .moe.backend_choice import offloads_experts

GiB = 1 << 30


def check_host_memory(cls, config, dtype: torch.dtype, device: torch.device, moe_backend: str, quant=None) -> None:
    """Raises ``StartupRefused`` naming what the load needs when it needs more host memory than is available."""
    needed, what = host_bytes_needed(cls, config, dtype, device, moe_backend, quant)
    if needed == 0:
        return
    available = available_host_bytes()
    if needed > available:
        raise StartupRefused(
            f"not enough host memory to load the model: {what} need {needed / GiB:.1f} GiB, "
            f"{available / GiB:.1f} GiB are available (free memory, or use a machine with more RAM)"
        )


def host_bytes_needed(cls, config, dtype, device, moe_backend: str, quant=None) -> tuple[int, str]:
    """``(bytes, what they are)`` the load keeps in host memory; ``(0, "")`` when nothing large."""
    name = str(dtype).removeprefix("torch.")
    if device.type == "cpu":
        from .moe.backend_choice import device_bytes_needed

        return device_bytes_needed(cls, config, dtype, 0, quant), f"the weights ({name}, on the CPU)"
    if offloads_experts(moe_backend):
        needed = routed_expert_bytes(cls, config, dtype, quant)
        return needed, "the routed experts (pinned host memory, offload)"
    return 0, ""


def routed_expert_bytes(cls, config, dtype: torch.dtype, quant=None) -> int:
    """Bytes of every routed expert (gate_up + down, as ``ExpertOffload`` banks them: NVFP4 rows where ``quant``
    quantizes the experts, else ``dtype``), from the model's MoE blocks as they are built on the meta device."""
    from .loading.quantized_model import experts_scheme
    from .moe.nvfp4_rows import Nvfp4Rows
    from .quant.config import NVFP4_SCHEMES

    elt = torch.empty((), dtype=dtype).element_size()
    sizes: list[int] = []

    def record(layer_id: int, num_experts: int, hidden: int, intermediate: int) -> Optional[torch.nn.Module]:
        if quant is not None and experts_scheme(quant, layer_id) in NVFP4_SCHEMES:
            sizes.append(num_experts * Nvfp4Rows(hidden, intermediate).expert_bytes)
        else:
            sizes.append(num_experts * 3 * hidden * intermediate * elt)
        return None  # the block builds its own (meta) experts

    with torch.device("meta"):
        cls(config, experts_factory=record)
    return sum(sizes)


def available_host_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
