"""Shared fixtures. Keep small: paths, the demo model, a tiny random HF Llama checkpoint, and ``blocked_fla``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helper modules next to the tests

torch.set_num_threads(min(2, torch.get_num_threads()))
# workers built by the tests (and the servers they start) leave the collector alone: a test process builds many, and
# frozen objects in reference cycles would never be freed. tests/test_gc_control.py covers the freeze itself.
os.environ.setdefault("FREETOKEN_GC_FREEZE", "0")
# ... and skip the start-up prefill warm-up on CUDA (each small worker would compile its own warm-up shapes);
# tests/test_prefill_warmup.py runs it directly, on the CPU and under the gpu marker.
os.environ.setdefault("FREETOKEN_PREFILL_WARMUP", "0")


def blocked_fla() -> None:
    """Make ``fla`` / ``causal_conv1d`` unimportable so transformers' hybrid models run their torch reference code
    (REFERENCES 2.3). Call before transformers is imported; harmless afterwards."""
    for name in ("fla", "causal_conv1d"):
        if name not in sys.modules:
            sys.modules[name] = None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: loads a real model (tens of seconds on 2 CPU cores)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _freetoken_cache(tmp_path_factory):
    """Generated tokenizers go to a per-session directory, not ~/.cache."""
    old = os.environ.get("FREETOKEN_CACHE_DIR")
    os.environ["FREETOKEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("freetoken-cache"))
    yield
    if old is None:
        os.environ.pop("FREETOKEN_CACHE_DIR", None)
    else:
        os.environ["FREETOKEN_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def demo_gguf_path() -> str:
    from freetoken.demo_model import DemoModelMissing, demo_model_path

    try:
        return demo_model_path()
    except DemoModelMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def demo_worker(demo_gguf_path):
    """The demo model (SmolLM2-135M Q4_1, fp32 on CPU) with a small KV pool; shared by the test modules."""
    from freetoken.worker import Worker

    return Worker(
        {
            "model_path": demo_gguf_path,
            "device": "cpu",
            "num_tokens": 4096,
            "max_running_requests": 4,
            "max_seq_len_override": 2048,
            "load_progress": False,
        }
    )


def make_tiny_llama_dir(path, seed: int = 0, **over) -> str:
    """A random 2-layer HF Llama (hidden 64, GQA 4/2) saved with ``save_pretrained`` (safetensors, fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(over)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).float().eval()
    with torch.no_grad():  # norms away from 1 so a norm-weight bug shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


def assert_start_up_refuses(monkeypatch, tmp_path, variable: str, value: str) -> None:
    """A hybrid model's worker (a tiny ``qwen3_5_moe``) refuses to start with ``variable=value`` in its environment,
    in one line naming the variable and the value: a bad kernel choice stops start-up, not the first prefill."""
    import re

    import hf_reference as R

    from freetoken.worker import Worker

    R.write_released_qwen3_5_moe(str(tmp_path), seed=3)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=re.escape(f"{variable}={value!r}")):
        Worker({"model_path": str(tmp_path), "device": "cpu", "num_tokens": 1024, "load_progress": False})


@pytest.fixture
def freetoken_caplog(caplog):
    """``caplog`` that sees the ``freetoken`` loggers' records: their root logger does not propagate once the server's
    logging is set up (``log.py``), so whether plain ``caplog`` saw them depended on which test ran first."""
    import logging

    logger = logging.getLogger("freetoken")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
