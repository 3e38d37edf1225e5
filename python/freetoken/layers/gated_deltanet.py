"""Gated DeltaNet (GDN) linear attention of Qwen3-Next and Qwen3.5/3.6 (REFERENCES §1.6, §1.9, §2).

Per token t and value head h (state S ∈ R^{dk×dv}, HF/fla layout):

    S ← exp(g_t)·S;   S ← S + β_t · k_t ⊗ (v_t − k_tᵀS);   o_t = q_tᵀS

with q/k from a causal depthwise conv + SiLU over ``[q | k | v]`` channels, l2-normalised (eps inside the sqrt),
q scaled by dk^-0.5, value head h reading q/k head ``h // r`` (GVA), ``g = −exp(A_log)·softplus(a + dt_bias)`` and
``β = sigmoid(b)`` in fp32. The output goes through a gated RMSNorm (plain w, normalise before the ``silu(z)`` gate)
and ``out_proj``.

Each sequence of a ``ForwardBatch`` owns a state slot in a ``RecurrentStatePool``: the last Kc−1 conv inputs and
the delta-rule state. A sequence with ``prefix_len > 0`` continues from its slot, otherwise from zeros; the final
state is written back into the slot. The math runs behind ``gated_delta_rule`` (one dispatch point): fla's Triton
kernels on CUDA when ``fla`` is importable, else the torch reference (chunked form, chunk 64, for prefill; the
recurrent form for decode).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.gdn_conv_prefill import gdn_conv_prefill
from ..kernels.gdn_decode import gdn_conv_decode, gdn_recurrent_decode
from ..kernels.gdn_gates import gdn_gates
from ..kernels.gdn_recurrent_piece import gdn_recurrent_piece
from ..kernels.rms_norm import gated_rms_norm
from ..tuning_env import switch_from_env
from .fused_linear import FusedLinear, fuse_linears
from .gdn_state_windows import gather_windows
from .gemm_rows import padded_rows_linear

if TYPE_CHECKING:
    from .gdn_prefill_graphs import GdnPrefillGraphs

CHUNK_SIZE = 64


# ----------------------------------------------------------------------------------------------------------------
# math: torch references
# ----------------------------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last dim (eps inside the sqrt, as fla and HF)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def torch_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) form for one sequence. All fp32, heads already expanded to Hv, q already
    normalised and scaled, k normalised: ``q, k [H, T, K]``, ``v [H, T, V]``, ``g, beta [H, T]``,
    ``state [H, K, V]``. Returns ``(o [H, T, V], final state [H, K, V])``."""
    H, T, K = k.shape
    V = v.shape[-1]
    pad = (-T) % chunk_size
    if pad:  # padded steps have g = 0, beta = 0, k = 0: they leave the state alone
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk_size
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(H, n, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    gc = g.reshape(H, n, chunk_size).cumsum(-1)  # in-chunk cumulative log-decay
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, n, C, C]
    # (I + strictly_lower(β_i k_i·k_j decay_ij)) X = [β v | β k exp(gc)]  (diagonal ignored: unitriangular)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * gc.exp()[..., None]
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()  # [H, n]
    out = torch.empty(H, n, chunk_size, V, dtype=q.dtype, device=q.device)
    S = state
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S
        out[:, i] = q_dec[:, i] @ S + intra[:, i] @ v_new
        S = S * chunk_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, n * chunk_size, V)[:, :T], S


def torch_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form, batched over sequences of equal length (decode: T = 1). Same conventions as
    ``torch_chunk_gated_delta_rule`` with a leading batch dim: ``q, k [B, H, T, K]``, ``v [B, H, T, V]``,
    ``g, beta [B, H, T]``, ``state [B, H, K, V]``."""
    T = q.shape[2]
    out = torch.empty(*v.shape, dtype=q.dtype, device=q.device)
    S = state
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        kv_mem = torch.einsum("bhk,bhkv->bhv", kt, S)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        S = S + kt[..., :, None] * delta[..., None, :]
        out[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], S)
    return out, S


def _prepare_torch(q, k, v, g, beta, num_v_heads: int):
    """fp32, l2norm q/k, scale q, GVA expansion (value head h reads q/k head h // r); token-major in, token-major
    out: ``[T, Hv, *]``."""
    dk = q.shape[-1]
    r = num_v_heads // q.shape[1]
    qf = l2norm(q.float()) * dk**-0.5
    kf = l2norm(k.float())
    if r > 1:
        qf = qf.repeat_interleave(r, dim=1)
        kf = kf.repeat_interleave(r, dim=1)
    return qf, kf, v.float(), g.float(), beta.float()


def _torch_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, decode, captures):
    Hv = v.shape[1]
    qf, kf, vf, gf, bf = _prepare_torch(q, k, v, g, beta, Hv)
    if decode and not captures:
        # one token per sequence, row b = sequence b: a single batched recurrence step
        o, final = torch_recurrent_gated_delta_rule(
            qf[:, :, None], kf[:, :, None], vf[:, :, None], gf[:, :, None], bf[:, :, None], initial_state.float()
        )
        return o[:, :, 0], final, {}
    N = len(cu_seqlens) - 1
    o = torch.empty_like(vf)
    finals = []
    captured: dict[tuple[int, int], torch.Tensor] = {}
    for b in range(N):
        s, e = cu_seqlens[b], cu_seqlens[b + 1]
        S = initial_state[b].float()
        cuts = sorted({c for c in (captures or {}).get(b, ()) if 0 < c < e - s})
        bounds = [0, *cuts, e - s]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            a, z = s + lo, s + hi
            tq, tk, tv = (x[a:z].transpose(0, 1) for x in (qf, kf, vf))  # [Hv, n, *]
            tg, tb = gf[a:z].transpose(0, 1), bf[a:z].transpose(0, 1)
            if z - a == 1:
                ob, S = torch_recurrent_gated_delta_rule(tq[None], tk[None], tv[None], tg[None], tb[None], S[None])
                ob, S = ob[0], S[0]
            else:
                ob, S = torch_chunk_gated_delta_rule(tq, tk, tv, tg, tb, S)
            o[a:z] = ob.transpose(0, 1)
            captured[(b, hi)] = S
        finals.append(S)
    return o, torch.stack(finals), captured


# ----------------------------------------------------------------------------------------------------------------
# math: fla kernels (CUDA)
# ----------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _fla_ops():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # not installed, or no usable triton: say why once, since the fallback is slower
        from ..log import get_logger

        get_logger(__name__).warning(
            f"fla is not importable ({type(e).__name__}: {e}); Gated DeltaNet runs the torch reference"
        )
        return None
    takes_cpu_cu = "cu_seqlens_cpu" in inspect.signature(chunk_gated_delta_rule).parameters
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, takes_cpu_cu


def gdn_backend(device: torch.device) -> str:
    """``fla`` on CUDA when importable, else ``torch``; ``FREETOKEN_GDN_BACKEND=torch|fla`` forces one."""
    forced = os.environ.get("FREETOKEN_GDN_BACKEND", "auto").lower()
    if forced == "torch":
        return "torch"
    usable = device.type == "cuda" and _fla_ops() is not None
    if forced == "fla" and not usable:
        raise RuntimeError("FREETOKEN_GDN_BACKEND=fla needs CUDA and an importable fla")
    return "fla" if usable else "torch"


def gdn_conv_impl() -> str:
    """The prefill conv's implementation: ``auto`` (Triton on CUDA), or ``FREETOKEN_GDN_CONV_IMPL=torch|triton``
    (tests, A/B runs); any other value is refused (checked at start-up with the ``Resolved config`` line)."""
    impl = os.environ.get("FREETOKEN_GDN_CONV_IMPL", "auto").lower()
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"FREETOKEN_GDN_CONV_IMPL={impl!r}: expected auto, torch or triton")
    return impl


def stage_inputs() -> bool:
    """Whether the prefill conv writes q | k | v as contiguous blocks, into the GDN prefill graphs' buffers when a
    chunk fits them (the gates too); ``FREETOKEN_GDN_STAGE_INPUTS=0`` keeps the former ``[T, C]`` output and the
    copies into the graphs (A/B runs)."""
    return switch_from_env("FREETOKEN_GDN_STAGE_INPUTS")


_batch_graphs_held_off = False  # ``eager_batch_steps``


def batch_graphs_on() -> bool:
    """Whether steps of several sequences replay the GDN batch graphs (``layers/gdn_batch_graphs.py``) where start-up
    captured them; ``FREETOKEN_GDN_BATCH_GRAPHS=0`` runs them eagerly (in-process A/B, read every step)."""
    return switch_from_env("FREETOKEN_GDN_BATCH_GRAPHS") and not _batch_graphs_held_off


@contextlib.contextmanager
def eager_batch_steps():
    """Steps of several sequences run eagerly inside (the prefill warm-up compiles the kernels of the steps no batch
    graph holds: more sequences or chunks than the largest bucket)."""
    global _batch_graphs_held_off
    held, _batch_graphs_held_off = _batch_graphs_held_off, True
    try:
        yield
    finally:
        _batch_graphs_held_off = held


def _fla_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, decode, graphs=None, borrow=False):
    """``graphs`` (a ``GdnPrefillGraphs``): one sequence replays the graph of its padded length when one holds it,
    several the graph of their bucket (``graphs.batch``); ``borrow``: the outputs may be the graphs' buffers (valid
    until the next replay)."""
    chunk, recurrent, takes_cpu_cu = _fla_ops()
    if not decode and len(cu_seqlens) <= 2 and _fla_direct_ops() is not None:
        # one sequence runs as a batch of one (no varlen index tensors, no host syncs), below fla's entry point
        out = graphs.run(q, k, v, g, beta, initial_state, borrow=borrow) if graphs is not None else None
        return out if out is not None else fla_direct_prefill(q, k, v, g, beta, initial_state)
    if not decode and _fla_direct_varlen():  # several: the same, with the step's varlen index
        batch_graphs = graphs.batch if graphs is not None and batch_graphs_on() else None
        lens = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        out = batch_graphs.run(q, k, v, g, beta, initial_state, lens) if batch_graphs is not None else None
        if out is not None:
            return out if borrow else (out[0].clone(), out[1].clone())
        return fla_direct_prefill(q, k, v, g, beta, initial_state, _fla_varlen_index(tuple(cu_seqlens), q.device))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # split views of the conv output are strided
    initial_state = initial_state.contiguous()
    if decode:
        # [B, 1, H, *]: one sequence per batch row, state rows aligned with batch rows
        o, final = _fla_recurrent(
            recurrent, q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state
        )
        return o[:, 0], final
    return _fla_public_chunk(chunk, takes_cpu_cu, q, k, v, g, beta, initial_state, cu_seqlens)


def _fla_public_chunk(chunk, takes_cpu_cu, q, k, v, g, beta, initial_state, cu_seqlens):
    """fla's public ``chunk_gated_delta_rule`` (several sequences through its varlen path, or any fla whose
    internals ``fla_direct_prefill`` does not know). Inputs contiguous."""
    kw = {}
    if len(cu_seqlens) > 2:
        cu_dev, cu_cpu = _fla_cu_seqlens(tuple(cu_seqlens), q.device)
        kw = {"cu_seqlens": cu_dev, **({"cu_seqlens_cpu": cu_cpu} if takes_cpu_cu else {})}
    o, final = chunk(
        q=q[None],
        k=k[None],
        v=v[None],
        g=g[None].float(),
        beta=beta[None].float(),
        scale=q.shape[-1] ** -0.5,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **kw,
    )
    return o[0], final


@functools.lru_cache(maxsize=None)
def _fla_direct_ops():
    """fla's chunked forward pieces (``l2norm_fwd``, ``chunk_gated_delta_rule_fwd``) when this fla has them with the
    parameters ``fla_direct_prefill`` passes, else None (the public entry point then runs)."""
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    except Exception:
        return None
    wanted = {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state"}
    if not wanted <= set(inspect.signature(chunk_gated_delta_rule_fwd).parameters):
        return None
    return l2norm_fwd, chunk_gated_delta_rule_fwd


def fla_direct_prefill(q, k, v, g, beta, initial_state, varlen=None):
    """One sequence (``[T, H, *]``) through fla's chunked forward, called below its public entry point: the same
    kernels as ``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True)`` without the wrappers around them
    (backend dispatch, ``torch.compiler.disable``, ``input_guard``, the autograd Function), which are host time in
    every GDN layer of a prefill step. On the H200 (bench/fla_host_cost.py, 2,184 tokens at Qwen3.6's shape): 1.04
    ms of host time a call against 1.37, bit-for-bit the same output and state. Needs ``_fla_direct_ops()``.
    ``varlen``: ``(cu_seqlens, chunk_indices)`` on the device (``_fla_varlen_index``) for several sequences, as the
    public entry would pass them on (needs ``_fla_direct_varlen()``)."""
    l2norm_fwd, fwd = _fla_direct_ops()
    kw = {} if varlen is None else {"cu_seqlens": varlen[0], "chunk_indices": varlen[1]}
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    qn, _ = l2norm_fwd(q[None])
    kn, _ = l2norm_fwd(k[None])
    out = fwd(
        q=qn,
        k=kn,
        v=v[None],
        g=g[None].float(),
        beta=beta[None].float(),
        scale=q.shape[-1] ** -0.5,
        initial_state=initial_state.contiguous(),
        output_final_state=True,
        **kw,
    )
    if len(out) != 6:  # the signature matched but the result does not: never read the wrong tensors
        raise RuntimeError(f"fla's chunk_gated_delta_rule_fwd returned {len(out)} values, fla_direct_prefill reads 6")
    o, final = out[1], out[3]  # (g, o, A, final_state, initial_state, g_input) in fla 0.6
    return o[0].to(q.dtype), final


def _fla_recurrent(recurrent, q, k, v, g, beta, initial_state):
    """fla's token-by-token kernel on ``[B, T, H, *]`` inputs (keywords only: its 5th positional parameter is gk)."""
    return recurrent(
        q=q,
        k=k,
        v=v,
        g=g.float(),
        beta=beta.float(),
        scale=q.shape[-1] ** -0.5,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


# a piece shorter than this (fla's chunk length) runs token by token when the caller gives a ``short`` kernel,
# unless it starts on a chunk boundary of the call (``token_by_token``)
SHORT_PIECE = 64


def token_by_token(start: int, end: int) -> bool:
    """Whether the piece ``[start, end)`` of one sequence's snapshot rounds runs on the token-by-token kernel: when
    it is shorter than fla's chunk and starts off the call's chunk boundaries. A tail that starts on one (a chunk
    that begins on the snapshot grid, e.g. a fresh prompt's, cut at its last grid point) runs in fla's chunked form
    instead: then fla's chunks of the two pieces are those of the uncut call, and so is every rounding (the state
    between them passes in fp32, as fla carries it from chunk to chunk), so a fresh prompt's tokens with the radix
    cache are those of ``--cache-type naive``. A tail after an off-grid start (a cached turn resumed at the last
    turn's end) cannot match an uncut call anyway, and token by token it costs less."""
    return end - start < SHORT_PIECE and (start == 0 or start % CHUNK_SIZE != 0)


@functools.lru_cache(maxsize=4)
def _fla_cu_seqlens(cu_seqlens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ``cu_seqlens`` tensors for every GDN layer of a step: fla caches its varlen index tensors on the
    identity of the tensor it is given (``tensor_cache``), and building them reads the device tensor on the host,
    so a fresh tensor per layer cost a host sync per layer (~35 ms of a 2k-token prefill step on the H200). Sent
    from pinned memory without waiting (a pageable copy waits for the device to finish the work queued before it)."""
    cu_cpu = torch.tensor(cu_seqlens, dtype=torch.int64)
    return _to_device_async(cu_cpu, device), cu_cpu


def _to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@functools.lru_cache(maxsize=4)
def _fla_varlen_index(cu_seqlens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, chunk_indices)`` on the device, once per step (every GDN layer of it passes the same tensors,
    so fla's index caches keyed on them hit): the chunk indices built by fla's own ``prepare_chunk_indices`` on the
    host copy, both sent without waiting."""
    from fla.ops.utils.index import prepare_chunk_indices

    cu_cpu = torch.tensor(cu_seqlens, dtype=torch.int64)
    chunk_indices = prepare_chunk_indices(cu_cpu, CHUNK_SIZE, cu_seqlens_cpu=cu_cpu)
    return _to_device_async(cu_cpu, device), _to_device_async(chunk_indices, device)


@functools.lru_cache(maxsize=None)
def _fla_direct_varlen() -> bool:
    """Whether ``fla_direct_prefill`` can pass several sequences: fla's chunked forward takes ``cu_seqlens`` and
    ``chunk_indices`` and this fla has ``prepare_chunk_indices``."""
    if _fla_direct_ops() is None:
        return False
    try:
        from fla.ops.utils.index import prepare_chunk_indices
    except Exception:
        return False
    fwd_params = inspect.signature(_fla_direct_ops()[1]).parameters
    index_params = inspect.signature(prepare_chunk_indices).parameters
    return {"cu_seqlens", "chunk_indices"} <= set(fwd_params) and "cu_seqlens_cpu" in index_params


def gated_delta_rule_in_rounds(varlen, q, k, v, g, beta, initial_state, cu_seqlens, captures, short=None):
    """States at snapshot points from a varlen kernel that only returns final states: each sequence is cut at
    its capture offsets, and round r runs the r-th piece of every sequence that has one in one varlen call,
    starting from the state the previous round ended with. Pieces of one sequence depend on each other, so a
    step with at most two snapshots per sequence costs at most three calls.

    ``varlen(q, k, v, g, beta, init, cu_seqlens, decode) -> (o, final)`` is the capture-free kernel (its outputs
    may be buffers its next call overwrites: the GDN prefill graphs' ``borrow``; every output is copied out or used
    before the next call); ``short(q, k, v, g, beta, init, out) -> (o, final)``, when given, runs a single
    sequence's pieces shorter than ``SHORT_PIECE`` tokens (the tail after a grid-point snapshot) in one cheap
    launch, writing o into ``out`` (its rows of the whole output), where ``token_by_token`` says so.
    Returns ``(o [T, Hv, dv] fp32 (the kernels' dtype when no sequence is cut or there is one sequence),
    final [N, Hv, dk, dv] fp32, {(seq, offset): state})``, the states at every piece end of the sequences
    ``captures`` names."""
    N = len(cu_seqlens) - 1
    pieces = []  # per sequence: [(start, end)] token ranges, relative to the sequence
    for b in range(N):
        n = cu_seqlens[b + 1] - cu_seqlens[b]
        bounds = [0, *sorted({c for c in captures.get(b, ()) if 0 < c < n}), n]
        pieces.append(list(zip(bounds[:-1], bounds[1:])))
    if all(len(p) == 1 for p in pieces):  # snapshots at sequence ends only (chunk ends): one call, no gathers
        o, final = varlen(q, k, v, g, beta, initial_state, cu_seqlens, False)
        final = final.float()
        return o, final, {(b, cu_seqlens[b + 1] - cu_seqlens[b]): final[b] for b in captures}
    captured: dict[tuple[int, int], torch.Tensor] = {}
    if N == 1:  # one sequence (a cached turn's chunk): its pieces are views, no index tensors, gathers or scatters
        o = v.new_empty(v.shape)  # the pieces' dtype: no fp32 round trip of [T, Hv, dv]
        state = initial_state
        for a, z in pieces[0]:
            if short is not None and token_by_token(a, z):  # writes its rows of o itself: no copy
                _, final_r = short(q[a:z], k[a:z], v[a:z], g[a:z], beta[a:z], state, out=o[a:z])
            else:
                o_r, final_r = varlen(q[a:z], k[a:z], v[a:z], g[a:z], beta[a:z], state, [0, z - a], False)
                o[a:z] = o_r
            state = final_r  # the next piece reads it before varlen runs again
            captured[(0, z)] = final_r[0].to(torch.float32, copy=True)
        return o, state.float(), captured
    # several sequences (a prompt cut at its grid point beside decode tokens): a fixed handful of ops a round
    # whatever the sequence count (one gather per input, one index for them built on the host, the states of the
    # round's sequences as one tensor), where per-sequence ops cost the host ~0.1 ms a sequence and layer; a round
    # whose tokens (or state rows) are consecutive takes them as a view instead (the served join: decode tokens,
    # then one prompt cut once, so round 0 is a prefix of the batch and round 1 the rest)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    init, prev_seqs, final = initial_state, list(range(N)), None
    for r in range(max(len(p) for p in pieces)):
        seqs = [b for b in range(N) if r < len(pieces[b])]  # a subset of the previous round's
        ranges = [(cu_seqlens[b] + pieces[b][r][0], cu_seqlens[b] + pieces[b][r][1]) for b in seqs]
        cu = [0]
        for a, z in ranges:
            cu.append(cu[-1] + z - a)
        idx = _rows_of(ranges, q.device)
        if seqs != prev_seqs:
            init = init[_rows_of([(prev_seqs.index(b), prev_seqs.index(b) + 1) for b in seqs], q.device)]
        o_r, final_r = varlen(q[idx], k[idx], v[idx], g[idx], beta[idx], init.to(initial_state.dtype), cu, False)
        _put_rows(o, idx, o_r.float())
        init = final_r.to(torch.float32, copy=True)  # the varlen outputs may be buffers its next call overwrites
        if final is None:  # round 0 holds every sequence; later rounds overwrite the rows of the cut ones
            final = init
        else:  # after this round was enqueued reading its rows of ``final`` (a view when they are consecutive)
            _put_rows(final, _rows_of([(b, b + 1) for b in seqs], q.device), init)
        for i, b in enumerate(seqs):
            if b in captures:  # a cut sequence's round-0 row of ``final`` is overwritten later: its own copy
                captured[(b, pieces[b][r][1])] = init[i].clone() if r == 0 and len(pieces[b]) > 1 else init[i]
        prev_seqs = seqs
    return o, final, captured


def _rows_of(ranges: list[tuple[int, int]], device: torch.device):
    """The rows ``[a, z)`` of ``ranges`` (ascending), as a slice when each range starts where the last ended (a view:
    no index upload, no gather), else as an index tensor sent without waiting."""
    if all(z == a for (_, z), (a, _) in zip(ranges, ranges[1:])):
        return slice(ranges[0][0], ranges[-1][1])
    return _to_device_async(torch.tensor([t for a, z in ranges for t in range(a, z)]), device)


def _put_rows(dst: torch.Tensor, rows, src: torch.Tensor) -> None:
    """``dst[rows] = src`` for ``_rows_of``'s slice or index."""
    if isinstance(rows, slice):
        dst[rows] = src
    else:
        dst.index_copy_(0, rows, src)


# ----------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: Optional[list[int]],
    decode: bool,
    captures: Optional[dict[int, list[int]]] = None,
    backend: Optional[str] = None,
    prefill_graphs=None,
):
    """The delta rule over a varlen batch.

    ``q, k [T, Hk, dk]`` and ``v [T, Hv, dv]`` are the conv outputs (before l2norm/scale: both backends do that);
    ``g, beta [T, Hv]`` fp32 (log-decay, post-sigmoid beta); ``initial_state [N, Hv, dk, dv]`` (zeros for fresh
    sequences); ``cu_seqlens`` host list of N+1 offsets (None when ``decode``); ``decode`` = every sequence has exactly
    one token.
    ``captures`` maps a sequence index to offsets (relative to its first token this step) after which its state is
    wanted (snapshots). ``prefill_graphs`` (``layers/gdn_prefill_graphs.py``, fla only): a single sequence's
    pieces replay CUDA graphs. Returns ``(o [T, Hv, dv] fp32, final [N, Hv, dk, dv] fp32, {(seq, offset): state})``."""
    backend = backend or gdn_backend(q.device)
    if backend == "fla":
        varlen = functools.partial(_fla_gated_delta_rule, graphs=prefill_graphs, borrow=True)
        if captures:
            # a tail shorter than fla's chunk (after a grid-point snapshot) runs token by token in one launch, with
            # or without graphs: both then compute it alike, and it costs the host less than a padded replay; one
            # that starts on a chunk boundary runs chunked, as the uncut call would (``token_by_token``)
            return gated_delta_rule_in_rounds(
                varlen, q, k, v, g, beta, initial_state, cu_seqlens, captures, short=gdn_recurrent_piece
            )
        o, final = varlen(q, k, v, g, beta, initial_state, cu_seqlens, decode)
        return o, final.float(), {}
    return _torch_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, decode, captures)


# ----------------------------------------------------------------------------------------------------------------
# the layer
# ----------------------------------------------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """``w · cast(x · rsqrt(mean(x²) + eps)) · silu(z)`` per head: plain ``w`` (init 1), norm before the gate
    (HF ``Qwen3NextRMSNormGated`` = fla ``FusedRMSNormGated(activation="silu")``)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """One GDN layer. ``state_layer`` indexes this layer in the ``RecurrentStatePool`` (GDN layers are numbered
    0..num_gdn_layers-1, separately from the attention layers' KV indices).

    ``interleaved_proj=False`` (Qwen3.5/3.6): separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
    ``interleaved_proj=True`` (Qwen3-Next): ``in_proj_qkvz``, ``in_proj_ba`` with rows grouped per key head,
    de-interleaved on the activations (§1.9), so the weights stay exactly as in the checkpoint."""

    def __init__(self, config, layer_id: int, state_layer: int, interleaved_proj: bool = False):
        super().__init__()
        self.layer_id = layer_id
        self.state_layer = state_layer
        self.interleaved_proj = interleaved_proj
        H = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"GDN conv activation {act!r} is not supported (silu only)")
        if interleaved_proj:
            self.in_proj_qkvz = nn.Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(H, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(H, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(H, self.num_v_heads, bias=False)
        # nn.Conv1d only for its parameter (``conv1d.weight [C, 1, Kc]``); the conv itself runs below
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.get("rms_norm_eps", 1e-6))
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)
        self._in_proj: Optional[FusedLinear] = None
        # set at start-up on CUDA (``startup.capture_gdn_prefill_graphs``): one sequence's delta rule from graphs
        self.prefill_graphs: Optional["GdnPrefillGraphs"] = None

    # shapes of this layer's state slot, for the pool
    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def fuse_projections(self) -> None:
        """All input projections in one GEMM (``layers/fused_linear.py``)."""
        if self._in_proj is None:
            parts = (
                (self.in_proj_qkvz, self.in_proj_ba)
                if self.interleaved_proj
                else (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
            )
            self._in_proj = fuse_linears(*parts)

    def project(self, x: torch.Tensor):
        """``x [T, H]`` → ``qkv [T, C]`` (channels q | k | v), ``z [T, Hv, dv]``, ``b, a [T, Hv]`` (column views of
        one output when the projections are fused)."""
        T = x.shape[0]
        Hk, Hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if not self.interleaved_proj:
            if self._in_proj is not None:
                qkv, z, b, a = self._in_proj.split(self._in_proj(x))
                return qkv, z.view(T, Hv, dv), b, a
            return self.in_proj_qkv(x), self.in_proj_z(x).view(T, Hv, dv), self.in_proj_b(x), self.in_proj_a(x)
        r = Hv // Hk
        if self._in_proj is not None:
            qkvz, ba = self._in_proj.split(self._in_proj(x))
        else:
            qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        q, k, v, z = torch.split(qkvz.view(T, Hk, 2 * dk + 2 * r * dv), [dk, dk, r * dv, r * dv], dim=-1)
        b, a = torch.split(ba.reshape(T, Hk, 2 * r), [r, r], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, Hv, dv), b.reshape(T, Hv), a.reshape(T, Hv)

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        T = x.shape[0]
        qkv, z, b, a = self.project(x)
        if batch.is_decode and not batch.snapshots:
            o = self._decode(qkv, b, a, batch)
        else:
            o = self._extend(qkv, b, a, batch)
        # [T, Hv, dv] both: z is a column slice of the fused projection, which the Triton norm reads in place
        o = self.norm(o.reshape(T, self.num_v_heads, self.head_v_dim), z)
        return padded_rows_linear(o.reshape(T, self.value_dim), self.out_proj)

    def _gates(self, b: torch.Tensor, a: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, beta)`` fp32 ``[T, Hv]``: log-decay and write strength (one launch on CUDA), into ``out`` if given."""
        return gdn_gates(a, b, self.A_log, self.dt_bias, out=out)

    @staticmethod
    def _initial_states(ssm_pool, batch, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[N, Hv, dk, dv]`` fp32: each sequence's state before this step (its slot, or zeros when fresh). One
        sequence continuing from an fp32 slot reads the slot itself (a view: the kernels only read it, and the slot
        is written after them), saving the copies of a gather; several take one gather, whatever their count.
        ``out`` (the batch graphs' static states, fp32 pools): gathered straight into it, fresh rows zeroed there,
        no state of an all-fresh step read at all."""
        slots = batch.state_slots_cpu
        if len(slots) == 1 and ssm_pool.dtype == torch.float32:
            s = slots[0]
            return ssm_pool[s : s + 1] if batch.prefix_lens_cpu[0] > 0 else torch.zeros_like(ssm_pool[s : s + 1])
        if out is not None and ssm_pool.dtype == torch.float32:
            fresh = [i for i, p in enumerate(batch.prefix_lens_cpu) if p == 0]
            if len(fresh) == len(slots):
                return out.zero_()
            torch.index_select(ssm_pool, 0, batch.state_slots, out=out)
            if len(fresh) > 4:
                out.masked_fill_((batch.prefix_lens == 0)[:, None, None, None], 0.0)
            else:
                for i in fresh:
                    out[i].zero_()
            return out
        fresh = (batch.prefix_lens == 0)[:, None, None, None]
        return torch.where(fresh, 0.0, ssm_pool[batch.state_slots].float())

    def _split_heads(self, y):
        """``[T, H, d]`` q, k, v from the conv output: ``[T, C]`` (views of its columns) or its three parts."""
        q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1) if torch.is_tensor(y) else y
        T = q.shape[0]
        return (
            q.reshape(T, self.num_k_heads, self.head_k_dim),
            k.reshape(T, self.num_k_heads, self.head_k_dim),
            v.reshape(T, self.num_v_heads, self.head_v_dim),
        )

    def _batch_graphs(self, lens: list[int], captures: dict[int, list[int]]):
        """The GDN batch graphs (``gdn_batch_graphs.py``) when this step of several sequences replays them and may
        stage its inputs in their buffers and gather its states into them: cut only at sequence ends (sequences cut
        inside gather their pieces out of the inputs round by round, which a replay's copies would overwrite) and
        held by a bucket; else None."""
        graphs = self.prefill_graphs
        batch = graphs.batch if graphs is not None and len(lens) > 1 else None
        if batch is None or not batch_graphs_on() or not _fla_direct_varlen():
            return None
        if any(rel < lens[seq] for seq, rels in captures.items() for rel in rels):
            return None
        return batch if batch.bucket(lens) is not None else None

    def _decode(self, qkv, b, a, batch) -> torch.Tensor:
        """One token per sequence, every sequence continuing from its slot: two kernels batched over sequences,
        working in place on the state pools (``kernels/gdn_decode.py``), device tensors only (CUDA-graph
        capturable). Returns ``o [B, Hv, dv]`` in the activation dtype."""
        pool = batch.state
        conv_pool, ssm_pool = pool.conv[self.state_layer], pool.ssm[self.state_layer]
        slots = batch.state_slots
        y = gdn_conv_decode(qkv, conv_pool, self.conv1d.weight[:, 0, :], slots)
        q, k, v = self._split_heads(y)
        return gdn_recurrent_decode(q, k, v, a, b, self.A_log, self.dt_bias, ssm_pool, slots)

    def _extend(self, qkv, b, a, batch) -> torch.Tensor:
        """Prompt chunks (and mixed batches): the conv in one launch over the batch (``kernels/gdn_conv_prefill.py``;
        ``FREETOKEN_GDN_CONV_IMPL=torch|triton`` forces an implementation), the state windows per sequence on the
        host lengths; captures snapshots."""
        pool = batch.state
        li = self.state_layer
        conv_pool, ssm_pool = pool.conv[li], pool.ssm[li]
        Kc1 = self.conv_kernel - 1
        w = self.conv1d.weight[:, 0, :]  # [C, Kc]

        snaps = batch.snapshots or []
        captures: dict[int, list[int]] = {}
        for seq, upto, _slot in snaps:
            rel = upto - batch.prefix_lens_cpu[seq]
            if not 0 < rel <= batch.extend_lens_cpu[seq]:
                from ..errors import InvalidPlan

                raise InvalidPlan(f"snapshot at {upto} outside the tokens of sequence {seq} in this step")
            captures.setdefault(seq, []).append(rel)

        slots = batch.state_slots
        has_init = batch.has_initial_state_cpu
        lens = batch.extend_lens_cpu
        cu_list = [0]
        for n in lens:
            cu_list.append(cu_list[-1] + n)
        stage = stage_inputs()
        batch_graphs = self._batch_graphs(lens, captures)
        if not stage:
            staged = None
        elif len(lens) == 1:  # one sequence that fits the prefill graphs: the conv and the gates write in place
            staged = self.prefill_graphs.staging(lens[0]) if self.prefill_graphs is not None else None
        else:
            staged = batch_graphs.staging(lens) if batch_graphs is not None else None
        # device offsets from the ForwardBatch: no copies; prefix_lens > 0 is what has_initial_state means. q | k | v
        # come out as three contiguous blocks (what fla's kernels read without a copy)
        y = gdn_conv_prefill(
            qkv, w, conv_pool, batch.cu_seqlens, slots, batch.prefix_lens, max(lens), impl=gdn_conv_impl(),
            parts=(self.key_dim, self.key_dim, self.value_dim) if stage else None, out=staged[0] if staged else None,
        )  # fmt: skip

        def conv_window(s: int, end: int) -> torch.Tensor:
            """``[C, Kc-1]``: the inputs of sequence s before offset ``end``, in qkv's dtype as the conv read
            them. When end < Kc-1 it reaches into the previous state: a copy (``cat``), so that later slot
            writes cannot change it; otherwise a view of qkv, which nothing writes."""
            at = cu_list[s]
            if end >= Kc1:
                return qkv[at + end - Kc1 : at + end].t()
            if has_init[s]:
                prev = conv_pool[batch.state_slots_cpu[s]].to(qkv.dtype)
            else:
                prev = qkv.new_zeros(self.conv_dim, Kc1)
            return torch.cat([prev[:, end:], qkv[at : at + end].t()], dim=-1)

        # every window is read before any slot is written (a snapshot window can reach into the previous state)
        ix = batch.gdn_windows
        if ix is None:  # one sequence: its window (and snapshots') one by one
            new_conv = [conv_window(s, n) for s, n in enumerate(lens)]
            snap_conv = [conv_window(seq, upto - batch.prefix_lens_cpu[seq]) for seq, upto, _slot in snaps]
            for s, window in enumerate(new_conv):
                conv_pool[batch.state_slots_cpu[s]] = window.to(conv_pool.dtype)
        else:  # several: all windows in a few ops, whatever their count (``gdn_state_windows.py``)
            windows = gather_windows(qkv, conv_pool, ix).to(conv_pool.dtype)
            conv_pool[ix.dst[: ix.num_seqs]] = windows[: ix.num_seqs]
        init = self._initial_states(ssm_pool, batch, batch_graphs.states_for(lens) if batch_graphs else None)

        q, k, v = self._split_heads(y)
        g, beta = self._gates(b, a, out=staged[1:] if staged else None)
        o, final, captured = gated_delta_rule(
            q, k, v, g, beta, init, cu_list, False, captures or None, prefill_graphs=self.prefill_graphs
        )
        ssm_pool[slots] = final.to(ssm_pool.dtype)

        # snapshots: state after `upto` tokens into the snapshot slot (conv window = the Kc-1 inputs before upto)
        if ix is None:
            for (seq, upto, slot), window in zip(snaps, snap_conv):
                rel = upto - batch.prefix_lens_cpu[seq]
                conv_pool[slot] = window.to(conv_pool.dtype)
                ssm_pool[slot] = captured[(seq, rel)].to(ssm_pool.dtype)
        elif snaps:
            dst = ix.dst[ix.num_seqs :]
            conv_pool[dst] = windows[ix.num_seqs :]
            states = [captured[(seq, upto - batch.prefix_lens_cpu[seq])] for seq, upto, _slot in snaps]
            ssm_pool[dst] = torch.stack(states).to(ssm_pool.dtype)
        return o.to(qkv.dtype)
