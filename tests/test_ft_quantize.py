"""``ft quantize`` (the Rust CLI running ``freetoken.quant.quantize_checkpoint``): its help, a tiny Qwen3.5-MoE
quantized through it (byte-identical to the Python quantizer's output), then served by ``ft serve`` with the NVFP4
experts offloaded: greedy completions equal ``freetoken.LLM`` on the same checkpoint with resident experts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import hf_reference as R
import pytest
import torch
from server_harness import ServerProcess

pytestmark = pytest.mark.slow
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ft(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.join(_ROOT, "python")}
    return subprocess.run(
        [sys.executable, "-m", "freetoken", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_quantize_help_lists_the_schemes():
    r = _ft("quantize", "--help")
    assert r.returncode == 0, r.stderr
    for needle in ("--model-path", "--output", "--scheme", "w4a16-nvfp4", "nvfp4", "mixed-qwen3.6", "--calib-tokens"):
        assert needle in r.stdout, r.stdout
    r = _ft("--help")
    assert r.returncode == 0 and "quantize" in r.stdout
    r = _ft("quantize", "--model-path", "x", "--output", "y", "--scheme", "int4")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "int4" in r.stderr, r.stderr


def test_quantize_a_missing_checkpoint_is_one_line(tmp_path):
    r = _ft("quantize", "--model-path", str(tmp_path / "nope"), "--output", str(tmp_path / "q"), "--scheme", "nvfp4")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("bf16"), tmp_path_factory.mktemp("q") / "nvfp4"
    R.write_released_qwen3_5_moe(str(src), seed=5)
    r = _ft("quantize", "--model-path", str(src), "--output", str(out), "--scheme", "w4a16-nvfp4", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"Wrote {out}" in r.stdout
    return str(src), str(out)


def test_quantize_writes_what_the_python_quantizer_writes(quantized, tmp_path):
    from safetensors.torch import load_file

    from freetoken.quant.quantize_checkpoint import main

    src, out = quantized
    assert main(["--model-path", src, "--out", str(tmp_path), "--scheme", "w4a16-nvfp4", "--device", "cpu"]) == 0
    with open(os.path.join(out, "hf_quant_config.json")) as f:
        assert json.load(f)["quantization"]["quant_algo"] == "W4A16_NVFP4"
    shard = "model-00001-of-00001.safetensors"
    a, b = load_file(os.path.join(out, shard)), load_file(os.path.join(tmp_path, shard))
    assert a.keys() == b.keys()
    for k in a:  # bytes: the E4M3 scales compare as bytes
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def test_serve_the_quantized_checkpoint_with_offloaded_nvfp4_experts(quantized):
    from freetoken import LLM, SamplingParams

    _, out = quantized
    prompt = [9707, 11, 1879, 0, 3555, 374, 220, 17, 10, 17, 30]
    llm = LLM(out, device="cpu", num_tokens=2048, max_seq_len_override=1024, load_progress=False)
    want = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].text
    del llm
    args = ["--model-path", out, "--served-model-name", "tiny", "--max-running-requests", "1",
            "--max-seq-len-override", "1024", "--num-tokens", "4096", "--device", "cpu",
            "--moe-backend", "offload", "--moe-cache-size", "6"]  # fmt: skip
    srv = ServerProcess(args)
    try:
        log = srv.log()
        assert "nvfp4_backend='torch'" in log and "experts (nvfp4," in log, log[-3000:]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = srv.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        assert srv.get("/v1/stats").json()["expert_misses"] > 0
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
