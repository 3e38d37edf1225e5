"""Which ``--moe-backend`` a model runs with.

``fused`` keeps every expert on the device; ``offload`` keeps them in pinned host memory behind a GPU cache;
``hybrid`` is ``offload`` with at most ``--moe-hybrid-max-fetch`` misses a layer fetched per decode step and the
others computed on the host CPU; ``cpu`` fetches none (every decode miss on the CPU; the cache stays empty).
``auto`` picks ``fused`` when the whole model fits in ``memory_ratio`` of free device memory with room left for the
KV floor (``--kv-reserve-tokens``, at least one full context), else ``offload`` (the point of this engine: MoE models larger than the GPU).
On CPU there is nothing to offload to, so ``auto`` is ``fused`` there. Dense models are always ``fused``.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModel
from ..log import get_logger

logger = get_logger(__name__)

BUILT_MOE_BACKENDS = ("auto", "fused", "offload", "hybrid", "cpu")
OFFLOADED = ("offload", "hybrid", "cpu")  # the experts' banks live in host memory
# --moe-hybrid-max-fetch -1 (auto): at least 3 misses a layer per step over PCIe, more where the layer misses more
# (on CUDA: q* = pcie / (pcie + cpu) of its misses, the bandwidths measured at start-up; hybrid_fetch_share.py). The
# floor: H100 host, Qwen3.6 NVFP4, top-8, 1 stream (bench/results/2026-12-06-h100-qwen3.6-35b-a3b-nvfp4-decode-
# hybrid.txt): a cap of 3 decoded 80.9 tok/s under Zipf (offload 79.1) and 75.7 under uniform routing (offload
# 46.3); a cap of 1 (FreeToken's no-profile default) 36.0 and 30.8: the host reads NVFP4 experts at 34-58 GB/s,
# below PCIe's 55, so most misses belong on PCIe.
AUTO_MAX_FETCH = 3
# ... and at a one-token step (one decode stream) a flat 2, share or not: with the VNNI host kernels (H100 host, Qwen3.6
# NVFP4, 1 stream, bench/results/2026-12-07-h100-qwen3.6-35b-a3b-nvfp4-decode-hybrid-int16-kernels.txt) a fixed cap
# of 2 decoded 130.9 / 134.6 tok/s under Zipf against 117.7 / 118.0 for the auto cap (93.7 / 96.6 vs 93.5 uniform),
# and the auto cap with a floor of 2 only 123.5-123.8 (it still fetched 3 where a layer missed 7-8). With 4 streams
# the fixed 2 lost (uniform 118.6 vs 141.1), so steps of several tokens keep the floor of 3 and the share.
AUTO_ONE_TOKEN_FETCH = 2


def offloads_experts(moe_backend: str) -> bool:
    return moe_backend in OFFLOADED


def hybrid_max_fetch(moe_backend: str, flag: int) -> int | None:
    """Misses a layer's cache admits per decode step: None (no cap) for ``offload``, 0 for ``cpu``, the flag
    (``--moe-hybrid-max-fetch``; -1: ``AUTO_MAX_FETCH``, the floor of the measured share on CUDA) for ``hybrid``."""
    if moe_backend == "cpu":
        return 0
    if moe_backend == "hybrid":
        return AUTO_MAX_FETCH if flag < 0 else flag
    return None


def device_bytes_needed(model_class, config, dtype: torch.dtype, kv_floor_tokens: int, quant=None) -> int:
    """Parameter bytes of ``model_class(config)`` in ``dtype`` (counted on the meta device; in the checkpoint's
    quantized layout when ``quant``, a ``QuantConfig``) plus the KV floor."""
    from ..cache.kv_pool import KVCachePool

    with torch.device("meta"):
        probe = model_class(config)
    size = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in probe.parameters()) * size
    if quant is not None:
        from ..loading.quantized_model import quantized_model_bytes

        weights = quantized_model_bytes(model_class, config, quant, dtype)
    kv = probe.kv_layout
    bpt = KVCachePool.bytes_per_token(kv.num_layers, kv.num_kv_heads, kv.head_dim, dtype, kv.v_head_dim)
    return weights + kv_floor_tokens * bpt


def resolve_moe_backend(
    requested: str, has_experts: bool, device: torch.device, model_bytes: int = 0, available_bytes: int = 0
) -> str:
    """``requested`` (the flag) -> ``fused`` | ``offload`` | ``hybrid`` | ``cpu``. ``model_bytes``: weights plus
    the KV floor (``device_bytes_needed``); ``available_bytes``: ``memory_ratio`` of free device memory. Both are
    read only for ``auto`` on CUDA."""
    if not has_experts:
        return "fused"
    if requested not in BUILT_MOE_BACKENDS:
        raise UnsupportedModel(f"unknown --moe-backend {requested}: expected one of {', '.join(BUILT_MOE_BACKENDS)}")
    if requested != "auto":
        return requested
    if device.type == "cuda" and model_bytes > available_bytes:
        logger.info(
            f"Auto-selected MoE backend: offload (weights and the KV floor need {model_bytes / 2**30:.1f} GiB, "
            f"{available_bytes / 2**30:.1f} GiB are available)"
        )
        return "offload"
    return "fused"
