"""Honest ``ft serve`` flags (issue 13): a flag whose feature is not built, that cannot apply, or that contradicts
another is refused before anything loads, in one line naming it and why (exit 2); ``--help`` promises only what
``--model-path`` takes; MoE offload flags that a dense model or ``auto`` leaves unused are said so in the log."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ft(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(_ROOT, "python"), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "freetoken", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize(
    "flags,needle",
    [
        # a feature that is not built
        (["--nvfp4-backend", "marlin"], "--nvfp4-backend marlin is not supported: it needs vLLM's Marlin"),
        (["--nvfp4-backend", "flashinfer"], "--nvfp4-backend flashinfer is not supported: it needs FlashInfer"),
        (["--moe-cpu-layers", "3,7"], "--moe-cpu-layers 3,7 is not supported yet"),
        (["--expert-load", "serial"], "--expert-load serial is not supported yet"),
        (["--tp-size", "2"], "--tensor-parallel-size 2 is not supported yet"),
        # a feature that does not apply (nothing is downloaded)
        (["--model-source", "modelscope"], "--model-source modelscope is not supported"),
        # flags that contradict each other
        (["--moe-backend", "fused", "--moe-cache-size", "64"], "--moe-cache-size applies to expert offload"),
        (["--moe-cpu-threads", "8"], "--moe-cpu-threads applies to --moe-backend hybrid or cpu, not auto"),
        (["--moe-hybrid-max-fetch", "4"], "--moe-hybrid-max-fetch applies to --moe-backend hybrid, not auto"),
    ],
)
def test_refused_flags_exit_2_in_one_line(flags, needle):
    r = _ft("serve", *flags)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: "), r.stderr
    assert needle in r.stderr, r.stderr
    assert "Loading" not in r.stderr and "Free memory" not in r.stderr  # refused before anything loads


def test_help_promises_local_models_only():
    r = _ft("serve", "--help")
    assert r.returncode == 0
    help_text = " ".join(r.stdout.split())
    assert "HF repo id or" not in help_text
    assert "Nothing is downloaded" in help_text and "GGUF file" in help_text
    assert "--metrics-without-api-key" in help_text


def test_unused_offload_flags_are_logged(tiny_llama_dir, caplog):
    """A dense model runs every weight resident: the offload flags a launch line carries are accepted (launch
    lines for MoE models work as written) and the log says they do nothing."""
    from freetoken.worker import Worker

    logging.getLogger("freetoken").addHandler(caplog.handler)
    try:
        Worker(
            {
                "model_path": tiny_llama_dir,
                "device": "cpu",
                "num_tokens": 256,
                "load_progress": False,
                "moe_cache_size": 64,
                "disable_moe_prefill_overlap": True,
            }
        )
    finally:
        logging.getLogger("freetoken").removeHandler(caplog.handler)
    assert any(
        "--moe-cache-size, --disable-moe-prefill-overlap: no effect" in m and "no experts" in m for m in caplog.messages
    ), caplog.messages


def test_offline_llm_refuses_the_same_settings(tiny_llama_dir):
    from freetoken import LLM

    with pytest.raises(ValueError, match="--moe-cpu-threads applies to --moe-backend hybrid or cpu"):
        LLM(tiny_llama_dir, device="cpu", num_tokens=256, load_progress=False, moe_cpu_threads=4)


def test_gdn_prefill_graph_tokens_without_gdn_layers_is_logged(tiny_llama_dir, caplog):
    """``--gdn-prefill-graph-tokens`` set on a model without Gated DeltaNet layers is accepted and said to do nothing;
    left at its default it is not mentioned."""
    from freetoken.worker import Worker

    logging.getLogger("freetoken").addHandler(caplog.handler)
    try:
        for tokens in (2048, None):
            Worker(
                {
                    "model_path": tiny_llama_dir,
                    "device": "cpu",
                    "num_tokens": 256,
                    "load_progress": False,
                    "gdn_prefill_graph_tokens": tokens,
                }
            )
    finally:
        logging.getLogger("freetoken").removeHandler(caplog.handler)
    notes = [m for m in caplog.messages if "--gdn-prefill-graph-tokens" in m]
    assert notes == ["--gdn-prefill-graph-tokens 2048: no effect, the model has no Gated DeltaNet layers"], notes
