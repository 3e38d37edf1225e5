"""Kernels changed for the H200 compiled for sm_90 on a machine without a GPU (``scripts/triton_compile_check.py``:
Triton's real compiler down to a cubin with the ptxas in the triton wheel), where the interpreter tests only run
their Python semantics: a kernel the interpreter accepts but the GPU compiler refuses would otherwise first fail on
the GPU machine, in every prefill. Signatures as the launchers pass them at Qwen3.6's shapes."""

from __future__ import annotations

import importlib.util
import os

import pytest

triton = pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_check(kernel: str, ptr: dict, const: dict, div16: str = "", warps: int = 4, stages: int = 3) -> int:
    """The script's exit status for ``kernel`` with ``ptr`` types (scalars too), ``const`` constexprs and the
    integer arguments ``div16`` marks as multiples of 16 (as the JIT marks them at Qwen3.6's shapes)."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel has no ptxas")
    spec = importlib.util.spec_from_file_location("triton_compile_check", f"{ROOT}/scripts/triton_compile_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    pairs = lambda d: ",".join(f"{k}={v}" for k, v in d.items())  # noqa: E731
    return script.main(
        [
            kernel,
            "--ptr",
            pairs(ptr),
            "--const",
            pairs(const),
            f"--warps={warps}",
            f"--stages={stages}",
            f"--div16={div16}",
        ]
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shared", [True, False])
def test_moe_combine_compiles_for_sm90(dtype, shared):
    ptr = {"partial_ptr": "*fp32", "shared_ptr": f"*{dtype}", "gate_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
    const = {"K": 8, "HAS_SHARED": shared, "BLOCK_H": 1024}
    div16 = "H,stride_p,stride_s,stride_o"
    assert compile_check("freetoken.kernels.moe_combine:_moe_combine_kernel", ptr, const, div16) == 0


@pytest.mark.parametrize("split", [True, False])
def test_extend_attention_compiles_for_sm90(split):
    """The extend kernel with its unmasked and masked key tiles at Qwen3.6's head dim (256) and sm_90's tiles."""
    ptr = {p: "*bf16" for p in ("Q", "K", "V", "O")}
    ptr.update(MidO="*fp32", MidL="*fp32", req_to_token="*i32", rows_ptr="*i32", cu_ptr="*i32", prefix_ptr="*i32")
    ptr.update(sm_scale="fp32")
    const = dict(GROUP=8, BLOCK_M=128, BLOCK_N=64, BLOCK_D=256, BLOCK_DV=256, PREC="'tf32'", SPLIT=split)
    strides = ",".join(f"stride_{s}" for s in ("qt", "qh", "kt", "kh", "vt", "vh", "ot", "oh", "rt", "mot", "moh"))
    div16 = f"{strides},D,DV"
    assert compile_check("freetoken.kernels.attention:_extend_kernel", ptr, const, div16, warps=8, stages=2) == 0
