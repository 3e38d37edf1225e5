"""Sparse MoE block (Qwen3-MoE, Qwen3-Next, Qwen3.5/3.6) with an optional sigmoid-gated shared expert.

Parameter names follow transformers 5.x exactly, relative to the block (``model.layers.{i}.mlp.``)::

    gate.weight                      [E, H]       router, no bias
    experts.gate_up_proj             [E, 2I, H]   rows [gate(I) | up(I)]   (fused, no ``.weight`` suffix)
    experts.down_proj                [E, H, I]
    shared_expert.{gate,up}_proj.weight [Is, H],  shared_expert.down_proj.weight [H, Is]    (when Is > 0)
    shared_expert_gate.weight        [1, H]

Router (REFERENCES §1.8): ``softmax(x·gateᵀ)`` in fp32 over all experts → top-k → renormalise (always for
Qwen3.5/3.6; if ``norm_topk_prob`` for Qwen3-Next / Qwen3-MoE) → weights cast to x's dtype. The cast happens where
the weights are applied (``run_experts``, or inside the decode kernel), not as a kernel of its own per layer.

Checkpoints ship experts either fused (BF16 Qwen3.5/3.6) or per expert (``experts.{e}.{gate,up,down}_proj.weight``:
Qwen3-MoE, Qwen3-Next, quantized checkpoints); ``SparseMoeBlock.load_weights`` accepts both and merges per-expert
tensors into the fused parameters at load.

The seam for expert placement
-----------------------------
``SparseMoeBlock.experts`` is an ``ExpertsBackend``: a module with ``forward(x [T, H], topk_ids [T, k],
topk_weights [T, k], shared=None) -> [T, H]`` (the weighted sum over the k routed experts, plus the block's shared
expert when it hands one over as a ``SharedExpertTerm``; an NVFP4 shared down projection only for a step that
``takes_nvfp4_shared_down``) and ``load_expert_weight(name, tensor)``. ``FusedExperts``
keeps every expert resident on the device and runs either the torch reference (loop over experts hit) or, picked
automatically on CUDA, Triton: the decode GEMVs (``freetoken.kernels.moe_decode``, which also add the shared expert
in their epilogue) for decode-sized steps, the grouped kernel (``freetoken.kernels.fused_moe``) above them.
Expert offload (``freetoken.moe``) builds its own ``ExpertsBackend`` in every block: the model's
constructor takes an ``experts_factory`` and hands it to each block, so resident expert tensors are never allocated
on the device; routing, the shared expert and weight-name mapping stay here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.activation import silu_and_mul
from ..kernels.fused_moe import fused_moe_torch
from ..kernels.moe_combine import add_gated_shared
from ..kernels.moe_decode import MAX_PAIRS as DECODE_MAX_PAIRS
from ..kernels.moe_routing import topk_softmax
from ..loading.copy_weight import copy_weight
from ..moe import bench_routing
from ..quant import nvfp4
from ..tuning_env import choice_from_env
from .fused_linear import FusedLinear, fuse_linears
from .gemm_rows import padded_rows_linear
from .moe_prefill_graphs import MoePrefillGraphs, drop_padding_rows
from .quantized_linear import Nvfp4Linear

# "auto" = triton on CUDA, torch elsewhere; tests and benchmarks can pin one.
_DEFAULT_IMPL = "auto"


def resolve_moe_impl(impl: str, x: torch.Tensor) -> str:
    """``auto`` is triton on CUDA tensors, torch elsewhere."""
    if impl != "auto":
        return impl
    return "triton" if x.is_cuda else "torch"


@dataclass
class SharedExpertTerm:
    """A block's shared expert, handed to its experts backend so that the decode kernel can add it in its epilogue:
    ``sigmoid(gate_logit) * s``, ``s`` the shared expert's output, either given (``output [T, H]``) or still to be
    computed from its gate|up projection (``gate_up [T, 2Is]`` and its down weight: ``s = down(silu_and_mul(
    gate_up))``, which the kernel then does too). The down weight is ``down_weight [H, Is]`` in x's dtype, or
    ``down_nvfp4`` (packed codes, block scales and global scale of an ``Nvfp4Linear``), which only NVFP4 experts
    backends take (``takes_nvfp4_shared_down``). Tensors may be column views of the block's fused projection."""

    gate_logit: torch.Tensor  # [T, 1]
    output: Optional[torch.Tensor] = None
    gate_up: Optional[torch.Tensor] = None
    down_weight: Optional[torch.Tensor] = None
    down_nvfp4: Optional[nvfp4.Nvfp4Tensor] = None

    def add_to(self, routed: torch.Tensor) -> torch.Tensor:
        """``routed + sigmoid(gate_logit) * s`` in torch ops (the block's own formula)."""
        return add_gated_shared(routed, self.gate_logit, self.shared_output())

    def shared_output(self) -> torch.Tensor:
        """``s``: given, or computed in torch ops (an NVFP4 down weight as ``Nvfp4Linear``'s reference: dequantized
        to x's dtype, then one matmul)."""
        if self.output is not None:
            return self.output
        down = self.down_weight
        if self.down_nvfp4 is not None:
            d = self.down_nvfp4
            down = nvfp4.dequantize(d.packed, d.scale, d.scale_2, self.gate_up.dtype)
        return padded_rows_linear(silu_and_mul(self.gate_up), lambda h: F.linear(h, down))

    def kernel_args(self) -> dict:
        """The shared-expert arguments of ``moe_decode`` (and of ``nvfp4_moe_decode_triton``, which alone takes
        ``shared_down_nvfp4``)."""
        if self.output is not None:
            return dict(shared=self.output, shared_gate=self.gate_logit)
        if self.down_nvfp4 is not None:
            return dict(shared_gate=self.gate_logit, shared_gate_up=self.gate_up, shared_down_nvfp4=self.down_nvfp4)
        return dict(shared_gate=self.gate_logit, shared_gate_up=self.gate_up, shared_down=self.down_weight)


def grouped_shared_args(shared: Optional[SharedExpertTerm]) -> dict:
    """The grouped kernels' shared-expert arguments: its output (computed here) and gate logit, which they add
    while summing each token's expert rows (``kernels/moe_combine.py``)."""
    return {} if shared is None else dict(shared=shared.shared_output(), shared_gate=shared.gate_logit)


def write_into(out: Optional[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """``y`` copied into ``out`` when given (the paths that do not write ``out`` themselves), else ``y``."""
    return y if out is None else out.copy_(y)


def grouped_gemm_choice() -> str:
    """Which grouped GEMMs run a BF16 step above the decode sizes: ``triton`` (``kernels/fused_moe.py``, the
    default) or ``grouped_mm`` (torch's grouped GEMM, CUTLASS on sm_90: ``kernels/moe_grouped_mm.py``), from
    ``FREETOKEN_BF16_MOE_GROUPED`` (an A/B: slower at the agent turn on the H200, 2026-12-06; read at each call, a
    graph keeps its capture's)."""
    return choice_from_env("FREETOKEN_BF16_MOE_GROUPED", "triton", ("triton", "grouped_mm"))


def run_experts(impl: str, x, w13, w2, topk_ids, topk_weights, shared: Optional[SharedExpertTerm] = None, out=None):
    """The weighted sum over the routed experts, ``topk_ids`` indexing the first dimension of ``w13``/``w2``
    (expert ids for resident weights, slot ids for an expert cache), plus ``shared`` when given. ``topk_weights``
    fp32 or x's dtype: every path applies them rounded to x's dtype. ``impl``: auto | torch | triton; triton runs
    steps of at most ``DECODE_MAX_PAIRS`` (token, expert) pairs through the decode GEMVs (shared term fused), larger
    ones through the grouped kernel. ``out [T, H]``: where the result goes (the grouped kernel writes it there)."""
    T, k = topk_ids.shape
    if resolve_moe_impl(impl, x) == "triton":
        if T * k <= DECODE_MAX_PAIRS:
            from ..kernels.moe_decode import moe_decode_triton

            args = shared.kernel_args() if shared else {}
            return write_into(out, moe_decode_triton(x, w13, w2, topk_ids, topk_weights, **args))
        from ..kernels.fused_moe import fused_moe_triton
        from ..kernels.moe_grouped_mm import fused_moe_grouped_mm, grouped_mm_supported

        # fp32 weights as they are: the combine rounds each to x's dtype where it reads it (one launch fewer)
        grouped = fused_moe_triton
        if grouped_gemm_choice() == "grouped_mm" and grouped_mm_supported(x, w13, w2):
            grouped = fused_moe_grouped_mm
        return grouped(x, w13, w2, topk_ids, topk_weights, **grouped_shared_args(shared), out=out)
    y = fused_moe_torch(x, w13, w2, topk_ids, topk_weights.to(x.dtype))
    return write_into(out, y if shared is None else shared.add_to(y))


def moe_input_rows(mlp: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """Where a decoder layer's norm should write the MLP's input ``[T, H]`` (shaped like ``x``): the rows of the
    block's MoE prefill graph input when a graph will run the step, else None (a new tensor)."""
    graphs = getattr(mlp, "prefill_graphs", None)
    if graphs is None or x.dim() != 2 or x.dtype != graphs.x.dtype:
        return None
    return graphs.input_rows(mlp, x.shape[0])


def set_default_moe_impl(name: str) -> None:
    """``auto`` | ``torch`` | ``triton``: the implementation new ``FusedExperts`` use (existing ones keep theirs
    unless their ``impl`` is changed)."""
    global _DEFAULT_IMPL
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown MoE implementation {name!r}")
    _DEFAULT_IMPL = name


class GatedMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate x) * up x)`` with HF names ``gate_proj``, ``up_proj``, ``down_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

        self._gate_up: Optional[FusedLinear] = None

    def fuse_projections(self) -> None:
        if self._gate_up is None and not getattr(self, "fused_by_parent", False):
            self._gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is not None:
            return self.activate(self._gate_up(x))
        return padded_rows_linear(F.silu(self.gate_proj(x)) * self.up_proj(x), self.down_proj)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate) * up)`` from the fused ``[gate | up]`` projection."""
        return padded_rows_linear(silu_and_mul(gate_up), self.down_proj)


class ExpertsBackend(nn.Module):
    """Where routed experts live and how they run. See the module docstring."""

    num_experts: int

    def takes_nvfp4_shared_down(self, pairs: int) -> bool:
        """Whether ``forward`` takes a ``SharedExpertTerm`` with ``down_nvfp4`` for a step of ``pairs`` (token,
        expert) pairs (the NVFP4 experts' decode kernel runs that down projection in its epilogue)."""
        return False

    def prefill_capturable(self, device: torch.device) -> bool:
        """Whether a prefill-sized ``forward`` on ``device`` is fixed-shape device work with no host sync, ids
        ``num_experts`` dropped (what a MoE prefill graph holds, ``layers/moe_prefill_graphs.py``). Offload
        backends plan their transfers on the host: no."""
        return False

    def decode_max_pairs(self) -> int:
        """The largest step, in (token, expert) pairs, that ``forward`` gives its decode kernels."""
        return DECODE_MAX_PAIRS

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: Optional[SharedExpertTerm] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``out [T, H]``: where the result is written, and returned (a MoE prefill graph's output rows)."""
        raise NotImplementedError

    def load_expert_weight(self, name: str, tensor: torch.Tensor) -> None:
        """``name`` is relative to ``experts.``: ``gate_up_proj``, ``down_proj`` or ``{e}.{gate,up,down}_proj.weight``."""
        raise NotImplementedError

    def missing_weights(self) -> list[str]:
        return []


_PER_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class FusedExperts(ExpertsBackend):
    """All experts resident: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        impl: Optional[str] = None,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ):
        """``device`` / ``dtype``: where the expert tensors live (default: the ambient default device and dtype)."""
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        kw = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        self.impl = impl or _DEFAULT_IMPL
        # which parts were loaded: fused tensors, or per-expert pieces (e, 0=gate,1=up,2=down)
        self._loaded: set = set()

    def forward(self, x, topk_ids, topk_weights, shared=None, out=None):
        return run_experts(self.impl, x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, shared, out)

    def prefill_capturable(self, device: torch.device) -> bool:
        """The Triton path (its alignment drops ids ``num_experts``); the torch reference syncs the host."""
        return self.impl == "triton" or (self.impl == "auto" and device.type == "cuda")

    @torch.no_grad()
    def load_expert_weight(self, name: str, tensor: torch.Tensor) -> None:
        E, I = self.num_experts, self.intermediate_size
        if name in ("gate_up_proj", "down_proj"):
            copy_weight(getattr(self, name), tensor, f"experts.{name}")
            self._loaded.add(name)
            return
        m = _PER_EXPERT.match(name)
        if not m:
            raise KeyError(f"unexpected expert tensor experts.{name}")
        e, kind = int(m.group(1)), m.group(2)
        if e >= E:
            raise ValueError(f"expert index {e} >= num_experts {E}")
        if kind == "down_proj":
            dst = self.down_proj[e]
        elif kind == "gate_proj":
            dst = self.gate_up_proj[e, :I]
        else:
            dst = self.gate_up_proj[e, I:]
        copy_weight(dst, tensor, f"experts.{name}")
        self._loaded.add((e, kind))

    def missing_weights(self) -> list[str]:
        missing = []
        for fused, kinds in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            if fused in self._loaded:
                continue
            for e in range(self.num_experts):
                for k in kinds:
                    if (e, k) not in self._loaded:
                        missing.append(f"experts.{e}.{k}.weight")
        return missing


def merge_expert_weights(items: Iterable[tuple[str, torch.Tensor]], num_experts: int) -> list[tuple[str, torch.Tensor]]:
    """Turn per-expert ``experts.{e}.{gate,up,down}_proj.weight`` tensors into fused ``experts.gate_up_proj
    [E, 2I, H]`` / ``experts.down_proj [E, H, I]``; other names pass through unchanged. Names are relative to the
    MoE block. Used by tools that need fused tensors outside a module (e.g. writing a BF16 checkpoint)."""
    gate, up, down, rest = {}, {}, {}, []
    for name, t in items:
        m = re.match(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if not m:
            rest.append((name, t))
            continue
        {"gate_proj": gate, "up_proj": up, "down_proj": down}[m.group(2)][int(m.group(1))] = t
    if gate or up:
        if not (len(gate) == len(up) == num_experts):
            raise ValueError(f"per-expert gate/up tensors incomplete: {len(gate)}/{len(up)} of {num_experts}")
        rest.append(("experts.gate_up_proj", torch.stack([torch.cat([gate[e], up[e]], 0) for e in range(num_experts)])))
    if down:
        if len(down) != num_experts:
            raise ValueError(f"per-expert down tensors incomplete: {len(down)} of {num_experts}")
        rest.append(("experts.down_proj", torch.stack([down[e] for e in range(num_experts)])))
    return rest


def _always_renormalise(config) -> bool:
    mt = {config.get("model_type"), config.get("outer_model_type")}
    if mt & {"qwen3_5_moe", "qwen3_5_moe_text"}:
        return True  # Qwen3.5/3.6 deleted norm_topk_prob: always renormalise
    default = "qwen3_moe" not in mt  # Qwen3MoeConfig defaults to False, Qwen3NextConfig to True
    return bool(config.get("norm_topk_prob", default))


# Builds a block's experts instead of ``FusedExperts``: (layer_id, num_experts, hidden_size, intermediate_size) ->
# ExpertsBackend. Expert offload passes one through the model's constructor (``ExpertOffload.make_experts``).
ExpertsFactory = Callable[[int, int, int, int], "ExpertsBackend"]


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int = 0,
        experts: Optional[ExpertsBackend] = None,
        experts_factory: Optional[ExpertsFactory] = None,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.hidden_size = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.intermediate_size = config.moe_intermediate_size
        self.norm_topk_prob = _always_renormalise(config)
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"MoE activation {act!r} is not supported (silu only)")
        self.gate = nn.Linear(self.hidden_size, self.num_experts, bias=False)
        if experts is None and experts_factory is not None:
            experts = experts_factory(layer_id, self.num_experts, self.hidden_size, self.intermediate_size)
        self.experts = experts or FusedExperts(self.num_experts, self.hidden_size, self.intermediate_size)
        shared = int(config.get("shared_expert_intermediate_size", 0) or 0)
        self.shared_expert_intermediate_size = shared
        if shared > 0:
            self.shared_expert = GatedMLP(self.hidden_size, shared)
            self.shared_expert_gate = nn.Linear(self.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self._fused: Optional[FusedLinear] = None  # [router | shared gate | shared gate_up], see fuse_projections
        # set at start-up on CUDA (``startup.capture_moe_prefill_graphs``): prefill-sized steps replay a graph
        self.prefill_graphs: Optional["MoePrefillGraphs"] = None

    def fuse_projections(self) -> None:
        """One GEMM for everything that reads the block's input: router logits, the shared expert's gate logit and
        its gate|up projection."""
        if self._fused is not None:
            return
        if self.shared_expert is None:
            self._fused = fuse_linears(self.gate)
            return
        self.shared_expert.fused_by_parent = True
        se = self.shared_expert
        self._fused = fuse_linears(self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj)

    def route(
        self, x: torch.Tensor, logits: Optional[torch.Tensor] = None, valid_rows: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``topk_ids [T, k]`` int64, ``topk_weights [T, k]`` fp32 (HF ``Qwen3_5MoeTopKRouter``, whose cast to x's
        dtype the experts backend applies). ``logits``: the router logits when the caller already has them (fused
        projection). ``valid_rows`` (a device scalar): rows at or past it are a graph's padding, routed to no
        expert (id ``num_experts``)."""
        if logits is None:
            logits = F.linear(x, self.gate.weight)
        ids, w = topk_softmax(logits, self.top_k, self.norm_topk_prob)
        ids = bench_routing.override(ids, self.layer_id, self.num_experts)  # benchmarks only; ids when off
        if valid_rows is not None:
            ids = drop_padding_rows(ids, valid_rows, self.num_experts)
        return ids, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prefill_graphs is not None:
            out = self.prefill_graphs.run(self, x)
            if out is not None:
                return out
        return self.compute(x)

    def compute(
        self, x: torch.Tensor, valid_rows: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The block's output, eagerly (or being captured). ``valid_rows``: see ``route``; ``out``: where the output
        is written (the experts backend writes it there)."""
        if self._fused is not None:
            return self._forward_fused(x, valid_rows, out)
        ids, w = self.route(x, valid_rows=valid_rows)
        shared = None
        if self.shared_expert is not None:
            shared = SharedExpertTerm(self.shared_expert_gate(x), output=self.shared_expert(x))
        return self.experts(x, ids, w, shared, out=out)

    def _forward_fused(
        self, x: torch.Tensor, valid_rows: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        y = self._fused(x)
        E = self.num_experts
        ids, w = self.route(x, logits=y[:, :E], valid_rows=valid_rows)
        shared = None
        if self.shared_expert is not None:  # columns [E] the shared gate logit, [E+1:] its gate | up
            # the whole shared expert goes to the experts backend: the decode kernel runs its down projection too
            gate, gate_up, down = y[:, E : E + 1], y[:, E + 1 :], self.shared_expert.down_proj
            if isinstance(down, nn.Linear):
                shared = SharedExpertTerm(gate, gate_up=gate_up, down_weight=down.weight)
            elif self._folds_nvfp4_shared_down(down, ids):
                pieces = nvfp4.Nvfp4Tensor(down.weight, down.weight_scale, down.weight_scale_2)
                shared = SharedExpertTerm(gate, gate_up=gate_up, down_nvfp4=pieces)
            else:  # another quantized down projection, or a larger step: it runs as its own layer
                shared = SharedExpertTerm(gate, output=self.shared_expert.activate(gate_up))
        return self.experts(x, ids, w, shared, out=out)

    def _folds_nvfp4_shared_down(self, down: nn.Module, ids: torch.Tensor) -> bool:
        """Whether the experts backend runs the shared expert's NVFP4 down projection (and its SiLU-and-mul): NVFP4
        experts on a decode-sized step (their decode kernel's epilogue; 2 launches fewer per layer). Shapes only:
        the same choice on every replay of a CUDA graph."""
        return (
            isinstance(down, Nvfp4Linear)
            and down.bias is None
            and self.experts.takes_nvfp4_shared_down(ids.shape[0] * ids.shape[1])
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors named relative to the block (``gate.weight``, ``experts.gate_up_proj``,
        ``experts.{e}.gate_proj.weight``, ``shared_expert.*``, ``shared_expert_gate.weight``). Returns the names
        taken; raises on unknown names or wrong shapes. Call ``check_loaded()`` afterwards."""
        taken = set()
        params = dict(self.named_parameters())
        for name, t in weights:
            if name.startswith("experts."):
                self.experts.load_expert_weight(name[len("experts.") :], t)
            elif name in params and not name.startswith("experts."):
                copy_weight(params[name], t, name)
            else:
                raise KeyError(f"unexpected MoE tensor {name!r}")
            taken.add(name)
        self._taken = getattr(self, "_taken", set()) | taken
        return taken

    def missing_weights(self) -> list[str]:
        taken = getattr(self, "_taken", set())
        missing = [n for n, _ in self.named_parameters() if not n.startswith("experts.") and n not in taken]
        return missing + self.experts.missing_weights()
