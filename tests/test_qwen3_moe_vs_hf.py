"""Qwen3 dense and Qwen3-MoE vs transformers (fp32, CPU, tiny random configs): full prefill, chunked prefill over
a cached prefix (StepPlan.build + ForwardBatch.from_plan with prefix_len > 0), a batch of different lengths, and
64-step greedy decode agreement."""

import pytest
import torch

from freetoken.cache.kv_pool import KVCachePool
from freetoken.engine.forward_batch import ForwardBatch
from freetoken.engine.step_plan import StepPlan
from freetoken.layers.attention import TorchAttention
from freetoken.models.base import ModelConfig
from freetoken.models.registry import model_class

VOCAB = 160

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=96,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    rope_theta=10000.0,
    attention_bias=False,
    tie_word_embeddings=False,
)
MOE = dict(
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=40,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)

CONFIGS = {
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], **MOE),
    "qwen3_moe_mixed": dict(
        BASE,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        **dict(MOE, mlp_only_layers=[0], norm_topk_prob=False, decoder_sparse_step=1),
    ),
    "qwen3_moe_step2": dict(
        BASE,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=4,
        **dict(MOE, decoder_sparse_step=2),
    ),
    "qwen3": dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"]),
    "qwen3_tied_bias": dict(
        BASE,
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        tie_word_embeddings=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
}


def _hf_model(d):
    if d["model_type"] == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers import Qwen3MoeForCausalLM as C

        cfg = Qwen3MoeConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    else:
        from transformers import Qwen3Config
        from transformers import Qwen3ForCausalLM as C

        cfg = Qwen3Config(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = C(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.12 * torch.randn(p.shape, generator=g))
    return m


_CACHE = {}


def _pair(name):
    if name not in _CACHE:
        d = CONFIGS[name]
        hf = _hf_model(d)
        cfg = ModelConfig.from_dict(d)
        ours = model_class(cfg)(cfg).float().eval()
        ours.load_weights(hf.state_dict().items())
        _CACHE[name] = (hf, ours)
    return _CACHE[name]


class Runner:
    """Drives our model through step plans over a paged pool with scattered slots."""

    def __init__(self, model, max_rows=4, max_context=160):
        lay = model.kv_layout
        self.model = model
        self.kv = KVCachePool(
            lay.num_layers,
            max_rows * max_context + 7,
            lay.num_kv_heads,
            lay.head_dim,
            torch.float32,
            torch.device("cpu"),
            max_rows,
            max_context,
        )
        perm = torch.randperm(max_rows * max_context + 7, generator=torch.Generator().manual_seed(7)).tolist()
        self.slots = [perm[r * max_context : (r + 1) * max_context] for r in range(max_rows)]
        self.attn = TorchAttention()

    def step(self, seqs, all_logits=False):
        """seqs: list of (row, prefix_len, new_tokens)."""
        plan = StepPlan.build(
            [
                dict(
                    tokens=toks,
                    prefix_len=pre,
                    row=row,
                    table_from=pre,
                    table_slots=self.slots[row][pre : pre + len(toks)],
                    sample={"temperature": 0.0},
                )
                for row, pre, toks in seqs
            ]
        )
        batch = ForwardBatch.from_plan(plan, self.kv, self.attn, all_logits=all_logits)
        with torch.no_grad():
            return self.model(batch)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_hf(name):
    hf, ours = _pair(name)
    ids = _tokens(21, 0)
    out = Runner(ours).step([(0, 0, ids)], all_logits=True)
    torch.testing.assert_close(out, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_step2", "qwen3"])
@pytest.mark.parametrize("chunks", [(5, 9), (1, 16, 3), (13, 1, 1, 1)])
def test_chunked_prefill_matches_hf(name, chunks):
    hf, ours = _pair(name)
    ids = _tokens(sum(chunks), len(chunks))
    ref = _hf_logits(hf, ids)
    r = Runner(ours)
    pre = 0
    for c in chunks:
        out = r.step([(1, pre, ids[pre : pre + c])], all_logits=True)
        torch.testing.assert_close(out, ref[pre : pre + c], atol=1e-4, rtol=1e-4)
        pre += c


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_mixed", "qwen3"])
def test_batch_of_different_lengths(name):
    hf, ours = _pair(name)
    seqs = [_tokens(n, 10 + n) for n in (1, 7, 30)]
    r = Runner(ours)
    # first chunk of each, all in one batch (seq 2 gets a cached prefix in the second step)
    out = r.step([(0, 0, seqs[0]), (1, 0, seqs[1]), (2, 0, seqs[2][:12])], all_logits=True)
    refs = [_hf_logits(hf, s) for s in seqs]
    torch.testing.assert_close(out, torch.cat([refs[0], refs[1], refs[2][:12]]), atol=1e-4, rtol=1e-4)
    # mixed step: a decode token for seqs 0 and 1, the rest of seq 2 as an extend over its cached prefix
    nxt = [int(refs[0][-1].argmax()), int(refs[1][-1].argmax())]
    out = r.step([(0, 1, [nxt[0]]), (1, 7, [nxt[1]]), (2, 12, seqs[2][12:])])  # last-token logits only
    exp = torch.stack(
        [
            _hf_logits(hf, seqs[0] + [nxt[0]])[-1],
            _hf_logits(hf, seqs[1] + [nxt[1]])[-1],
            refs[2][-1],
        ]
    )
    torch.testing.assert_close(out, exp, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3"])
def test_greedy_64_steps_batched(name):
    hf, ours = _pair(name)
    prompts = [_tokens(5, 40), _tokens(11, 41)]
    # HF greedy, one sequence at a time, full recompute (no cache subtleties)
    want = []
    for p in prompts:
        ids = list(p)
        for _ in range(64):
            ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
        want.append(ids[len(p) :])
    r = Runner(ours)
    logits = r.step([(0, 0, prompts[0]), (1, 0, prompts[1])])
    got = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(63):
        seqs = [(b, len(prompts[b]) + len(got[b]) - 1, [got[b][-1]]) for b in range(2)]
        logits = r.step(seqs)
        for b in range(2):
            got[b].append(int(logits[b].argmax()))
    assert got == want


def test_load_rejects_missing_and_unknown():
    d = CONFIGS["qwen3_moe"]
    hf, _ = _pair("qwen3_moe")
    cfg = ModelConfig.from_dict(d)
    sd = dict(hf.state_dict())
    m = model_class(cfg)(cfg)
    with pytest.raises(KeyError):
        m.load_weights([(k, v) for k, v in sd.items() if k != "model.layers.1.mlp.experts.down_proj"])
    m = model_class(cfg)(cfg)
    with pytest.raises(KeyError):
        m.load_weights(list(sd.items()) + [("model.layers.0.mlp.bogus.weight", torch.zeros(1))])
    # per-expert checkpoint names (real Qwen3-MoE checkpoints) load and match
    per = {}
    I = d["moe_intermediate_size"]
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                per[f"{base}{e}.gate_proj.weight"] = v[e, :I]
                per[f"{base}{e}.up_proj.weight"] = v[e, I:]
        elif k.endswith("experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                per[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            per[k] = v
    m = model_class(cfg)(cfg).eval()
    m.load_weights(per.items())
    ids = _tokens(9, 3)
    torch.testing.assert_close(
        Runner(m).step([(0, 0, ids)], all_logits=True), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4
    )
