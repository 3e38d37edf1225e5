"""config.json as the installed transformers writes it (issue 13): key aliases from HF's config classes, and a
missing or unsupported key as one line naming it, through the Worker and through ``ft serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from freetoken.errors import UnsupportedModel
from freetoken.models.base import CONFIG_KEY_ALIASES, MissingConfigKey, ModelConfig

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_config_classes():
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

    return [Qwen3MoeConfig, Qwen3NextConfig, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, LlamaConfig, Qwen3Config]


def test_alias_table_covers_the_installed_transformers():
    """Every alias the installed transformers declares for a model type we serve is in our table."""
    for cls in _hf_config_classes():
        ours = CONFIG_KEY_ALIASES.get(cls.model_type)
        assert ours is not None, f"{cls.model_type} missing from CONFIG_KEY_ALIASES"
        for alias, written in (getattr(cls, "attribute_map", None) or {}).items():
            assert ours.get(alias) == written, f"{cls.__name__}.attribute_map[{alias!r}] = {written!r}; ours: {ours}"


def test_aliases_read_under_both_names():
    new = ModelConfig.from_dict({"model_type": "qwen3_moe", "num_local_experts": 8})
    old = ModelConfig.from_dict({"model_type": "qwen3_moe", "num_experts": 8})
    for c in (new, old):
        assert c.num_experts == 8 and c.num_local_experts == 8 and c.get("num_experts") == 8
    # Only where the model type declares it.
    assert ModelConfig.from_dict({"model_type": "llama", "num_local_experts": 8}).get("num_experts") is None


def test_missing_key_names_it():
    c = ModelConfig.from_dict({"model_type": "qwen3_moe"})
    with pytest.raises(MissingConfigKey, match="config.json has no 'num_experts' \\(nor num_local_experts\\)"):
        _ = c.num_experts
    with pytest.raises(UnsupportedModel, match="'hidden_size'"):
        _ = c.hidden_size
    assert c.get("hidden_size", 7) == 7 and not hasattr(c, "hidden_size")  # optional reads keep their default


def _tiny_qwen3_moe_config(**extra):
    """The 2-layer, 8-expert Qwen3-MoE shape these tests save (``extra``: more config fields)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        **extra,
    )


def _tiny_qwen3_moe(path) -> str:
    """A random 2-layer Qwen3-MoE saved by the installed transformers' save_pretrained, with a word-level tokenizer
    and a chat template so ``ft serve`` can run it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Qwen3MoeForCausalLM

    cfg = _tiny_qwen3_moe_config(norm_topk_prob=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            },
            f,
        )
    return str(path)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return _tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe-hf-saved"))


def test_transformers_saved_qwen3_moe_serves_through_the_worker(qwen3_moe_dir):
    from transformers import Qwen3MoeForCausalLM

    from freetoken.worker import Worker

    with open(os.path.join(qwen3_moe_dir, "config.json")) as f:
        saved = json.load(f)
    assert "num_local_experts" in saved and "num_experts" not in saved  # the spelling this test is about
    w = Worker(
        {
            "model_path": qwen3_moe_dir,
            "device": "cpu",
            "dtype": "float32",
            "num_tokens": 256,
            "max_running_requests": 2,
            "load_progress": False,
        }
    )
    assert w.info()["architecture"] == "Qwen3MoeForCausalLM"
    tokens = [3, 17, 42, 5, 9, 33, 60, 12]
    ours = w.forward_logits(tokens)
    hf = Qwen3MoeForCausalLM.from_pretrained(qwen3_moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)


def _ft_serve(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(_ROOT, "python"), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "freetoken", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _config_dir(tmp_path, drop=(), **set_) -> str:
    d = _tiny_qwen3_moe_config().to_dict()
    for k in drop:
        d.pop(k)
    d.update(set_)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    return str(tmp_path)


@pytest.mark.parametrize(
    "drop,key", [(("hidden_size",), "'hidden_size'"), (("num_local_experts",), "'num_experts' (nor num_local_experts)")]
)
def test_ft_serve_missing_key_is_one_line(tmp_path, drop, key):
    r = _ft_serve("--model-path", _config_dir(tmp_path, drop=drop), "--dummy-weight", "--device", "cpu")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = _error_lines(r.stderr)
    assert len(errors) == 1 and key in errors[0], r.stderr[-3000:]


@pytest.mark.parametrize(
    "set_,needle",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type 'yarn'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config with quant_method 'awq'"),
        ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}}, "quant_algo 'INT4_AWQ'"),
    ],
)
def test_unsupported_config_values_are_one_line(tmp_path, set_, needle):
    from freetoken.worker import Worker

    path = _config_dir(tmp_path, **set_)
    # quantization_config is refused for real weights only (--dummy-weight runs the shapes): write one shard.
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(1)}, os.path.join(path, "model.safetensors"))
    with pytest.raises(UnsupportedModel, match=needle.replace("(", "\\(").replace(")", "\\)")):
        Worker({"model_path": path, "device": "cpu", "num_tokens": 64, "load_progress": False})


def test_transformers_saved_qwen3_moe_serves_through_ft_serve(qwen3_moe_dir):
    from server_harness import ServerProcess

    srv = ServerProcess(
        [
            "--model-path",
            qwen3_moe_dir,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-tokens",
            "512",
            "--max-running-requests",
            "2",
        ]
    )
    try:
        r = srv.post(
            "/v1/completions", json={"prompt": "w3 w17 w42", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
