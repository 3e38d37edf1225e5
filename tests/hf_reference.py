"""Tiny random HF transformers models (Qwen3.5-MoE, Qwen3-Next) as references for our hybrid models, and a tiny
engine driver that runs our model through real step plans with its own slot bookkeeping.

Pitfall (REFERENCES §2.3): transformers 5.x wraps its torch GDN references with
``use_kernel_func_from_hub_with_fallback(..., "fla")``; with ``fla`` importable they silently run fla's Triton
kernels. We block ``fla`` / ``causal_conv1d`` before transformers is imported and, should transformers already be
imported by someone else, point the modules' globals back at the unwrapped torch functions. On a GPU machine
that tests our fla path, ``FREETOKEN_TEST_ALLOW_FLA=1`` keeps fla importable; the unwrapping alone then keeps HF on
its torch references.
"""

from __future__ import annotations

import inspect
import os
import sys

if os.environ.get("FREETOKEN_TEST_ALLOW_FLA") != "1":
    for _blocked in ("fla", "causal_conv1d"):
        if _blocked not in sys.modules:
            sys.modules[_blocked] = None  # import fails -> transformers falls back to its torch code

import torch  # noqa: E402

from freetoken.cache.kv_pool import KVCachePool  # noqa: E402
from freetoken.cache.state_pool import RecurrentStatePool  # noqa: E402
from freetoken.engine.forward_batch import ForwardBatch  # noqa: E402
from freetoken.engine.step_plan import StepPlan  # noqa: E402
from freetoken.layers.attention import TorchAttention  # noqa: E402
from freetoken.models.base import ModelConfig  # noqa: E402

_GDN_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def _hf_modules():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m35
    from transformers.models.qwen3_next import modeling_qwen3_next as mnext

    for mod in (m35, mnext):
        for name in _GDN_FUNCS:
            fn = getattr(mod, name, None)
            if fn is not None:
                setattr(mod, name, inspect.unwrap(fn))
    return m35, mnext


# ------------------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------------------


def tiny_text_config(**over) -> dict:
    """Fields shared by both families. Defaults: GVA r=2, dk != dv, 4 layers with attention at 1 and 3."""
    rotary = 0.25
    head_dim = over.get("head_dim", 32)
    half = int(head_dim * rotary) // 2
    c = dict(
        vocab_size=160,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        rms_norm_eps=1e-6,
        full_attention_interval=2,
        max_position_embeddings=1024,
        hidden_act="silu",
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": rotary,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
            "mrope_interleaved": True,
        },
    )
    c.update(over)
    return c


def qwen3_5_moe_config(**over) -> dict:
    """Outer ``qwen3_5_moe`` config with the language model under ``text_config`` (as the released ones)."""
    text = tiny_text_config(**over)
    text["model_type"] = "qwen3_5_moe_text"
    return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text}


def qwen3_next_config(**over) -> dict:
    c = tiny_text_config(**over)
    c.update(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        norm_topk_prob=True,
        intermediate_size=80,
        decoder_sparse_step=1,
        mlp_only_layers=over.get("mlp_only_layers", []),
    )
    c["rope_parameters"] = {k: v for k, v in c["rope_parameters"].items() if not k.startswith("mrope")}
    return c


# ------------------------------------------------------------------------------------------------------------
# HF models
# ------------------------------------------------------------------------------------------------------------


def _hf_kwargs(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("model_type", "architectures")}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial weights so a wrong norm, gate or head mapping shows: (1+w) norms with random w, plain GDN norm
    weight around 1, A_log / dt_bias spread out, and 1/sqrt(fan_in) linear weights (HF's 0.02 init makes every
    block nearly the identity). The lm_head is scaled up so greedy choices are well separated."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + 0.3 * rnd(p.shape))
        elif name.endswith("norm.weight"):
            p.copy_(0.3 * rnd(p.shape))
        elif name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=g) * 3.5 - 3.0)  # A in [0.05, 1.65]
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * rnd(p.shape))
        elif name.endswith("conv1d.weight"):
            p.copy_(0.5 * rnd(p.shape))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(rnd(p.shape))
        elif name.endswith("lm_head.weight"):
            p.copy_(3.0 * rnd(p.shape) / p.shape[-1] ** 0.5)
        elif p.dim() >= 2:
            p.copy_(rnd(p.shape) / p.shape[-1] ** 0.5)
        else:
            p.copy_(0.1 * rnd(p.shape))


def build_hf_model(config: dict, seed: int = 0):
    """A tiny HF ``Qwen3_5MoeForCausalLM`` (from ``text_config``) or ``Qwen3NextForCausalLM`` in fp32, eval."""
    m35, mnext = _hf_modules()
    torch.manual_seed(seed)
    if config["model_type"] == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        model = m35.Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**_hf_kwargs(config["text_config"])))
    elif config["model_type"] == "qwen3_next":
        from transformers import Qwen3NextConfig

        model = mnext.Qwen3NextForCausalLM(Qwen3NextConfig(**_hf_kwargs(config)))
    else:
        raise ValueError(config["model_type"])
    model = model.float().eval()
    model.config._attn_implementation = "eager"
    randomize_(model, seed)
    return model


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused ``experts.gate_up_proj`` / ``experts.down_proj`` → per-expert ``experts.{e}.{gate,up,down}_proj.weight``
    (how Qwen3-Next and quantized checkpoints ship them)."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            base, I = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :I].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, I:].clone()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def build_ours(config: dict, hf_model, weights: dict[str, torch.Tensor] | None = None):
    """Our model for ``config`` (through the registry), loaded from ``weights`` (default: the HF state dict), its
    projections fused as the worker fuses them."""
    from freetoken.layers.fused_linear import fuse_projections
    from freetoken.models.registry import model_class

    cfg = ModelConfig.from_dict(config)
    model = model_class(cfg)(cfg).float().eval()
    model.load_weights(list((weights if weights is not None else hf_model.state_dict()).items()))
    fuse_projections(model)  # as the worker does: every check below runs the fused projections
    return model


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position of ``ids`` (one sequence, no cache)."""
    out = hf_model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation by full recompute (the plainest reference). Returns (new tokens, logits of every
    position of prompt + new tokens[:-1]), so logits[len(prompt) - 1 + i] chose new token i."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(hf_model, ids)[-1].argmax()))
    return ids[len(prompt) :], hf_logits(hf_model, ids[:-1])


def top2_margin(logits: torch.Tensor) -> float:
    v = logits.topk(2).values
    return float(v[0] - v[1])


# ------------------------------------------------------------------------------------------------------------
# our side: a tiny engine with its own slot bookkeeping
# ------------------------------------------------------------------------------------------------------------


class TinyEngine:
    """Runs our model through ``StepPlan.build`` + ``ForwardBatch.from_plan``. Sequence ``s`` uses page-table row
    ``s``, KV slots laid out backwards per sequence (so a page-table bug cannot hide behind identity indexing) and
    state slot ``2s + 1`` (slot 0 and the even slots stay unused)."""

    def __init__(self, model, max_seqs: int = 4, max_ctx: int = 320, dtype=torch.float32, device="cpu"):
        self.model = model
        self.max_ctx = max_ctx
        kvl, stl = model.kv_layout, model.state_layout
        self.kv = KVCachePool(
            kvl.num_layers,
            1 + max_seqs * max_ctx,
            kvl.num_kv_heads,
            kvl.head_dim,
            dtype,
            torch.device(device),
            max_rows=max_seqs,
            max_context=max_ctx,
        )
        self.state = RecurrentStatePool.from_layout(stl, 2 * max_seqs + 2, dtype, device)
        self.lens: dict[int, int] = {}
        self.attn = TorchAttention()

    def kv_slot(self, seq: int, pos: int) -> int:
        return 1 + seq * self.max_ctx + (self.max_ctx - 1 - pos)

    @staticmethod
    def state_slot(seq: int) -> int:
        return 2 * seq + 1

    @torch.no_grad()
    def step(self, items, all_logits: bool = False, snapshots=()) -> list:
        """One forward over items ``(seq, new tokens)`` or ``(seq, new tokens, sample: bool)`` (default: sample).
        Returns per item the logits of every new token ``[n, V]`` (``all_logits``), else the logits of its last
        token ``[V]`` when it samples and None when it does not (a non-final prefill chunk).
        ``snapshots``: ``(item index, upto, slot)``."""
        seqs = []
        for it in items:
            seq, toks = it[0], list(it[1])
            sample = it[2] if len(it) > 2 else True
            p = self.lens.get(seq, 0)
            seqs.append(
                dict(
                    tokens=toks,
                    prefix_len=p,
                    row=seq,
                    table_from=p,
                    table_slots=[self.kv_slot(seq, q) for q in range(p, p + len(toks))],
                    state_slot=self.state_slot(seq),
                    sample={} if sample else None,
                )
            )
        plan = StepPlan.build(seqs)
        if snapshots:
            t = lambda i: torch.tensor([s[i] for s in snapshots], dtype=torch.int64)  # noqa: E731
            plan.snap_seq, plan.snap_upto, plan.snap_slot = t(0), t(1), t(2)
        batch = ForwardBatch.from_plan(plan, self.kv, self.attn, state=self.state, all_logits=all_logits)
        logits = self.model(batch)
        for it in items:
            self.lens[it[0]] = self.lens.get(it[0], 0) + len(it[1])
        out, at = [], 0
        if all_logits:
            for it in items:
                out.append(logits[at : at + len(it[1])])
                at += len(it[1])
            return out
        for s in seqs:
            if s["sample"] is None:
                out.append(None)
            else:
                out.append(logits[at])
                at += 1
        return out


# ------------------------------------------------------------------------------------------------------------
# scenarios shared by the two model test files
# ------------------------------------------------------------------------------------------------------------

LOGIT_TOL = 1.5e-4  # fp32 CPU, at logit scale <= 10 (measured <= 1.2e-4); scaled for larger logits, see logit_tol
TIE_TOL = 1e-3  # a greedy choice whose HF top-2 margin is below this is a tie either implementation may break


def logit_tol(ref: torch.Tensor) -> float:
    """1.5e-4 for logits up to magnitude 10, relative 1.5e-5 beyond (tied embeddings give logits ~60)."""
    return LOGIT_TOL * max(1.0, float(ref.abs().max()) / 10.0)


def write_released_qwen3_5_moe(d: str, seed: int = 5, **over):
    """A tiny random Qwen3.5-MoE checkpoint in the released layout (outer ``qwen3_5_moe`` config,
    ``model.language_model.*`` tensors, MTP and vision tensors to skip, fp32) with the real Qwen3.5/3.6 tokenizer
    files, written to ``d`` (``over``: text-config fields). Returns the HF model holding the same weights."""
    import json
    import os

    from safetensors.torch import save_file

    from freetoken.loading.qwen_tokenizer import write_qwen_tokenizer_files

    cfg = qwen3_5_moe_config(
        vocab_size=248320, hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16, **over
    )
    cfg["text_config"].update(eos_token_id=248044, bos_token_id=248044)
    hf = build_hf_model(cfg, seed=seed)
    sd = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v.contiguous()
        for k, v in hf.state_dict().items()
    }
    sd["mtp.fc.weight"] = torch.zeros(2, 2)
    sd["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(2, 2)
    save_file(sd, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "torch_dtype": "float32"}, f)
    write_qwen_tokenizer_files(str(d))
    return hf


def prompt(n: int, seed: int, vocab: int = 160) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_chunked_prefill(hf, ours, pieces_per_seq: dict[int, list[int]], seed: int = 0) -> float:
    """Every sequence's prompt goes through the engine in the given pieces (several sequences share a step while
    they all have pieces left; a piece continues from the state slot and KV of the previous ones). Logits at every
    position must match HF's one-shot forward. Returns the max abs error."""
    prompts = {s: prompt(sum(p), seed + s) for s, p in pieces_per_seq.items()}
    refs = {s: hf_logits(hf, ids) for s, ids in prompts.items()}
    eng = TinyEngine(ours)
    got = {s: [] for s in prompts}
    at = {s: 0 for s in prompts}
    queues = {s: list(p) for s, p in pieces_per_seq.items()}
    while any(queues.values()):
        items = []
        for s, q in queues.items():
            if q:
                n = q.pop(0)
                items.append((s, prompts[s][at[s] : at[s] + n]))
                at[s] += n
        for (s, _), lg in zip(items, eng.step(items, all_logits=True)):
            got[s].append(lg)
    err = 0.0
    for s in prompts:
        e = float((torch.cat(got[s]) - refs[s]).abs().max())
        assert e < logit_tol(refs[s]), (s, e)
        err = max(err, e)
    return err


def check_greedy(hf, ours, plans: dict[int, tuple[int, list[int]]], steps: int = 64, seed: int = 0):
    """Greedy generation through the engine vs HF's greedy continuation, ``steps`` tokens per sequence.
    ``plans[seq] = (first step, prompt pieces)``: a sequence joins at its first step, prefills its prompt in the
    given pieces (only the last piece samples), then decodes one token per step, in the same steps as the other
    sequences' prefill pieces (mixed steps). Each sampled logit row must match HF's logits at that position
    (LOGIT_TOL) and its argmax must equal HF's greedy token; a mismatch is allowed only where HF's top-2 margin is
    below TIE_TOL (then HF's token is fed on, so the comparison continues on the reference path).
    Returns (max abs logit error, ties, min margin seen)."""
    prompts = {s: prompt(sum(p), seed + 7 * s) for s, (_, p) in plans.items()}
    refs = {s: hf_greedy(hf, prompts[s], steps) for s in prompts}  # (tokens, logits per position)
    eng = TinyEngine(ours)
    queues = {s: list(p) for s, (_, p) in plans.items()}
    at = {s: 0 for s in prompts}
    gen: dict[int, list[int]] = {s: [] for s in prompts}
    err, ties, min_margin, step_no = 0.0, 0, float("inf"), 0
    while any(len(g) < steps for g in gen.values()):
        items = []
        for s, (first, _) in plans.items():
            if step_no < first or len(gen[s]) >= steps:
                continue
            if queues[s]:
                n = queues[s].pop(0)
                items.append((s, prompts[s][at[s] : at[s] + n], not queues[s]))
                at[s] += n
            else:
                items.append((s, [gen[s][-1]], True))
        step_no += 1
        if not items:
            continue
        for (s, _toks, sample), lg in zip(items, eng.step(items)):
            if not sample:
                assert lg is None
                continue
            i = len(gen[s])
            ref_tokens, ref_logits = refs[s]
            ref = ref_logits[len(prompts[s]) - 1 + i]
            e = float((lg - ref).abs().max())
            assert e < logit_tol(ref_logits), (s, i, e)
            err = max(err, e)
            margin = top2_margin(ref)
            min_margin = min(min_margin, margin)
            if int(lg.argmax()) != ref_tokens[i]:
                assert margin < TIE_TOL, f"seq {s} token {i}: ours {int(lg.argmax())} vs HF {ref_tokens[i]}"
                ties += 1
            gen[s].append(ref_tokens[i])
    return err, ties, min_margin
