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


def compile_check(
    kernel: str,
    ptr: dict,
    const: dict,
    div16: str = "",
    warps: int = 4,
    stages: int = 3,
    async_wgmma: bool = False,
    ptx_has: str = "",
    max_registers: int = 0,
    max_shared: int = 0,
    ptx_out: str = "",
) -> int:
    """The script's exit status for ``kernel`` with ``ptr`` types (scalars too), ``const`` constexprs and the
    integer arguments ``div16`` marks as multiples of 16 (as the JIT marks them at Qwen3.6's shapes).
    ``async_wgmma``: 2 when ptxas serializes the kernel's wgmmas; ``ptx_has``: 3 when the PTX lacks one of these
    comma-separated strings; ``max_registers`` / ``max_shared``: 4 above that many registers a thread / bytes of
    shared memory a program; ``ptx_out``: a file the PTX is written to."""
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
            *(["--async-wgmma"] if async_wgmma else []),
            f"--ptx-has={ptx_has}",
            f"--max-registers={max_registers}",
            f"--max-shared={max_shared}",
            f"--ptx-out={ptx_out}",
        ]
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("weighted", [True, False])
def test_moe_combine_compiles_for_sm90(dtype, shared, weighted, rows_at=False):
    """Weighted: the BF16 grouped kernel's rows in the activation dtype, weights applied here; else NVFP4's fp32."""
    ptr = {"partial_ptr": f"*{dtype}" if weighted else "*fp32", "rows_at_ptr": "*i32", "weights_ptr": f"*{dtype}"}
    ptr.update({"shared_ptr": f"*{dtype}", "gate_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"})
    const = {"K": 8, "HAS_WEIGHTS": weighted, "HAS_SHARED": shared, "ROWS_AT": rows_at, "BLOCK_H": 1024}
    div16 = "H,stride_p,stride_s,stride_o"
    assert compile_check("freetoken.kernels.moe_combine:_moe_combine_kernel", ptr, const, div16) == 0


def test_moe_combine_reading_rows_through_positions_compiles_for_sm90():
    """The combine of ``moe_grouped_mm`` (rows left in expert order, read through each pair's position)."""
    test_moe_combine_compiles_for_sm90("bf16", True, True, rows_at=True)


@pytest.mark.parametrize("tail,warps", [(0, 4), (16, 4), (32, 8)])
def test_grouped_bf16_moe_compiles_for_sm90(tail, warps):
    """The grouped BF16 MoE's two kernels with and without a tail row tile, at Qwen3.6's expert shapes, their wgmmas
    asynchronous either way (with the tail's dots as rows·tile, ptxas serialized them all: C7515, triton 3.6)."""
    ptr = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32"}
    const = {"TOPK": 8, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "DOT_PREC": "'tf32'", "TAIL": tail}
    const["TAIL_ROWS"] = max(tail, 16)
    div16 = "H,I,stride_xt,stride_we,stride_wn,stride_ot"
    kernel = "freetoken.kernels.fused_moe:_moe_gate_up_kernel"
    assert compile_check(kernel, ptr, const, div16, warps=warps, async_wgmma=True) == 0
    ptr = {"h_ptr": "*bf16", **{k: v for k, v in ptr.items() if k != "x_ptr"}}
    del const["TOPK"]
    const["BLOCK_N"] = 128
    div16 = "H,I,stride_ht,stride_we,stride_wn,stride_ot"
    kernel = "freetoken.kernels.fused_moe:_moe_down_kernel"
    assert compile_check(kernel, ptr, const, div16, warps=warps, async_wgmma=True) == 0


@pytest.mark.parametrize("walk,warps,stages", [(4, 4, 3), (16, 4, 4), (4, 8, 3)])
def test_grouped_bf16_moe_down_walk_compiles_for_sm90(walk, warps, stages):
    """The down kernel walking N tiles (one flattened loop, each tile stored at its last K step), at Qwen3.6's
    expert shapes: it compiles, and its wgmmas stay asynchronous with the store inside the loop."""
    ptr = {"h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32"}
    const = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "DOT_PREC": "'tf32'", "TAIL": 0, "WALK": walk}
    div16 = "H,I,stride_ht,stride_we,stride_wn,stride_ot"
    kernel = "freetoken.kernels.fused_moe:_moe_down_kernel"
    assert compile_check(kernel, ptr, const, div16, warps=warps, stages=stages, async_wgmma=True) == 0


@pytest.mark.parametrize("counted", [True, False])
def test_moe_align_compiles_for_sm90(counted):
    """The grouped MoE's alignment: the parallel count of a prefill-sized step and the plan that reads it, or counts
    a decode-sized step itself."""
    ids = {"ids_ptr": "*i32", "cursor_ptr": "*i32", "block_expert_ptr": "*i32", "sorted_ids_ptr": "*i32"}
    const = {"BLOCK_M": 64, "E_BINS": 512, "CHUNK": 1024, "BLOCK_B": 1024, "COUNTED": counted}
    assert compile_check("freetoken.kernels.fused_moe:_moe_align_plan_kernel", ids, const) == 0
    if counted:
        ptr = {"ids_ptr": "*i32", "counts_ptr": "*i32"}
        const = {"E_BINS": 512, "CHUNK": 1024}
        assert compile_check("freetoken.kernels.fused_moe:_moe_align_count_kernel", ptr, const) == 0


@pytest.mark.parametrize("split,slot32,lazy", [(True, False, True), (False, True, True), (True, True, False)])
def test_extend_attention_compiles_for_sm90(split, slot32, lazy):
    """The extend kernel (lazily rescaled, as served: per row on split launches, for the block unsplit; or not) at
    Qwen3.6's head dim (256) and sm_90's tiles, key offsets in int32 and int64. Its wgmmas must stay asynchronous (no
    ptxas C7515: the former two-loop form had it, each of a tile's 20 wgmmas waiting for the one before)."""
    ptr = {p: "*bf16" for p in ("Q", "K", "V", "O")}
    ptr.update(MidO="*fp32", MidL="*fp32", req_to_token="*i32", rows_ptr="*i32", cu_ptr="*i32", prefix_ptr="*i32")
    ptr.update(sm_scale="fp32")
    const = dict(GROUP=8, BLOCK_M=128, BLOCK_N=64, BLOCK_D=256, BLOCK_DV=256, PREC="'tf32'", SPLIT=split)
    const.update(LAZY=lazy, ROW_RESCALE=lazy and split, SLOT32=slot32)
    strides = ("qt", "qh", "kt", "kh", "vt", "vh", "ot", "oh", "rt", "mot", "moh", "mos")
    div16 = ",".join(f"stride_{s}" for s in strides) + ",D,DV"
    kernel = "freetoken.kernels.attention:_extend_kernel"
    assert compile_check(kernel, ptr, const, div16, warps=8, stages=2, async_wgmma=True) == 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("warps", [1, 4])
def test_gdn_recurrent_piece_compiles_for_sm90(dtype, warps):
    """The token-by-token tail kernel at Qwen3.6's GDN shape (32 value heads over 16 key heads, 128 x 128 state)."""
    ptr = {p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
    ptr.update(g_ptr="*fp32", beta_ptr="*fp32", s0_ptr="*fp32", s1_ptr="*fp32", scale="fp32")
    const = dict(R=2, DK=128, DV=128, BK=128, BV=16, EPS=1e-6)
    div16 = "stride_qt,stride_qh,stride_kt,stride_kh,stride_vt,stride_vh,stride_gt,stride_bt,stride_ot,stride_oh"
    kernel = "freetoken.kernels.gdn_recurrent_piece:_gdn_recurrent_piece_kernel"
    assert compile_check(kernel, ptr, const, div16, warps=warps) == 0


def test_cudnn_merge_compiles_for_sm90():
    """The merge of the cuDNN route's two attention partials (bf16 outputs, fp32 log-sum-exps) at head dim 256."""
    ptr = {"o1_ptr": "*bf16", "o2_ptr": "*bf16", "out_ptr": "*bf16", "l1_ptr": "*fp32", "l2_ptr": "*fp32"}
    div16 = "stride_o1h,stride_o1t,stride_l1h,stride_o2h,stride_o2t,stride_l2h,stride_ot,stride_oh,DV"
    assert compile_check("freetoken.kernels.attention_cudnn:_merge_two_kernel", ptr, dict(BLOCK_DV=256), div16) == 0


@pytest.mark.parametrize("pool", ["bf16", "fp32"])
def test_gdn_conv_prefill_compiles_for_sm90(pool):
    """The GDN prefill conv writing q | k | v as three blocks (its part picked per tile) at Qwen3.6's 8,192 channels."""
    ptr = {"x_ptr": "*bf16", "w_ptr": "*bf16", "pool_ptr": f"*{pool}", "y_ptr": "*bf16"}
    ptr.update(cu_ptr="*i32", slots_ptr="*i64", init_ptr="*i1")
    const = dict(KC=4, BLOCK_T=32, BLOCK_C=128)
    div16 = "C,split1,split2,base1,base2,stride_y0,stride_y1,stride_y2,stride_xt,stride_ps,stride_pc"
    assert compile_check("freetoken.kernels.gdn_conv_prefill:_gdn_conv_prefill_kernel", ptr, const, div16) == 0


# (rows of x, rows a program, words a step, no masks, packed half): the launch settings nvfp4_linear picks for lm_head
@pytest.mark.parametrize(
    "block_m,block_n,block_w,even,half",
    [(1, 128, 32, True, True), (2, 64, 32, True, True), (4, 64, 32, False, True), (2, 32, 64, True, False)],
)
def test_nvfp4_gemv_compiles_for_sm90(block_m, block_n, block_w, even, half):
    """The NVFP4 GEMV at lm_head's tiling, in packed half precision (its inline PTX ``fma.rn.f16x2`` chain) and in
    fp32, and the half GEMV's x packing."""
    ptr = {"x_ptr": "*bf16", "xp_ptr": "*i32" if half else "*bf16", "xf_ptr": "*fp32" if half else "*bf16"}
    ptr.update(w_ptr="*i32", s_ptr="*u8", g_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
    const = dict(HAS_BIAS=False, EVEN=even, SPLIT_K=1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w, NUM_STAGES=3)
    const.update(HALF=half, ASM=True)
    div16 = "N,K,stride_xm,stride_pm,stride_wn,stride_sn,stride_om,KW_PER_SPLIT"
    assert compile_check("freetoken.kernels.nvfp4_linear:_nvfp4_gemv_kernel", ptr, const, div16) == 0
    ptr = {"x_ptr": "*bf16", "xp_ptr": "*i32", "xf_ptr": "*fp32"}
    const = dict(TOP=12, BLOCK_B=64)
    assert compile_check("freetoken.kernels.nvfp4_half_gemv:_half_pairs_kernel", ptr, const, "K,stride_xm") == 0


@pytest.mark.parametrize("half,tail,fuse", [(True, 0, False), (False, 0, False), (True, 16, False), (False, 16, True)])
def test_nvfp4_grouped_moe_compiles_for_sm90(half, tail, fuse):
    """The grouped NVFP4 MoE kernels at the tiles of a ~2k-token step (64-row blocks, gate and up in separate
    tiles, or in one), on fp16 weight tiles (the default there for 16-bit x) and on the bf16 ones, with and without
    a tail row tile. (ptxas serializes their wgmmas, C7515: the decoded tile is the A operand from registers. The
    x·tileᵀ form that avoids it measured no faster on the H200, 2026-12-05: the decoding binds them.)"""
    x = "*fp16" if half else "*bf16"
    common = dict(w_ptr="*i32", s_ptr="*u8", g_ptr="*fp32", sorted_ids_ptr="*i32", block_expert_ptr="*i32")
    const = dict(BLOCK_M=64, NUM_STAGES=3, DOT_PREC="'tf32'", HALF=half, ASM=True, TAIL=tail, TAIL_ROWS=max(tail, 16))
    ptr = dict(common, x_ptr=x, xf_ptr="*fp32", out_ptr="*bf16")
    gu = dict(const, TOPK=8, BLOCK_N=64, BLOCK_K=64 if fuse else 128, FUSE_GU=fuse)
    div16 = "H,I,stride_xt,stride_we,stride_wn,stride_se,stride_sn,stride_ge,stride_ot"
    assert compile_check("freetoken.kernels.nvfp4_moe:_nvfp4_moe_gate_up_kernel", ptr, gu, div16) == 0
    ptr = dict(common, h_ptr=x, hf_ptr="*fp32", out_ptr="*bf16")
    # K steps as grouped_config picks them: 64 weights beside a tail (at 128 that build spilled: 255 registers)
    down = dict(const, BLOCK_N=128, BLOCK_K=64 if tail else 128, X_DTYPE="tl.bfloat16")
    div16 = div16.replace("stride_xt", "stride_ht")
    kernel = "freetoken.kernels.nvfp4_moe:_nvfp4_moe_down_kernel"
    assert compile_check(kernel, ptr, down, div16, max_registers=254 if tail else 0) == 0


@pytest.mark.parametrize("half,tail,walk", [(True, 16, 4), (False, 0, 4), (True, 0, 16)])
def test_nvfp4_grouped_moe_down_walk_compiles_for_sm90(half, tail, walk):
    """The grouped NVFP4 down kernel walking N tiles (one flattened loop, each tile stored at its last K step), at
    the ~2k-token step's tiles: it compiles without spilling."""
    x = "*fp16" if half else "*bf16"
    ptr = dict(w_ptr="*i32", s_ptr="*u8", g_ptr="*fp32", sorted_ids_ptr="*i32", block_expert_ptr="*i32")
    ptr.update(h_ptr=x, hf_ptr="*fp32", out_ptr="*bf16")
    const = dict(BLOCK_M=64, NUM_STAGES=3, DOT_PREC="'tf32'", HALF=half, ASM=True, TAIL=tail, TAIL_ROWS=max(tail, 16))
    const.update(BLOCK_N=128, BLOCK_K=64, X_DTYPE="tl.bfloat16", WALK=walk)
    div16 = "H,I,stride_ht,stride_we,stride_wn,stride_se,stride_sn,stride_ge,stride_ot"
    kernel = "freetoken.kernels.nvfp4_moe:_nvfp4_moe_down_kernel"
    assert compile_check(kernel, ptr, const, div16, max_registers=254) == 0


# (rows of x, rows a program, K step, warps, fp16 tiles, no masks): nvfp4_linear's tensor-core tiles at small M
@pytest.mark.parametrize(
    "block_m,block_n,block_k,warps,half,even",
    # the fp16 tiles' default at M <= 16 (K steps of 256: 142 registers on sm_90, 128 on sm_80/89, no spills), their
    # K step before it, the wide-M tiles, the bf16 tiles
    [
        (16, 64, 256, 2, True, True),
        (16, 64, 128, 2, True, True),
        (32, 64, 128, 4, True, False),
        (16, 32, 128, 2, False, False),
    ],
)
def test_nvfp4_dot_compiles_for_sm90(block_m, block_n, block_k, warps, half, even):
    """The tensor-core NVFP4 kernel with its fp16 tiles (inline ``mul.rn.f16x2``; mma.sync at 2 warps, wgmma at 4)
    and its bf16 tiles, and ``half_rows``' x."""
    ptr = {"x_ptr": "*fp16" if half else "*bf16", "xf_ptr": "*fp32" if half else "*bf16", "w_ptr": "*i32"}
    ptr.update(s_ptr="*u8", g_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
    const = dict(HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=3, DOT_PREC="'tf32'")
    const.update(HALF=half, EVEN=even, ASM=True)
    div16 = "N,K,stride_xm,stride_wn,stride_sn,stride_om"
    assert compile_check("freetoken.kernels.nvfp4_linear:_nvfp4_dot_kernel", ptr, const, div16, warps=warps) == 0
    ptr = {"x_ptr": "*bf16", "xh_ptr": "*fp16", "xf_ptr": "*fp32"}
    const = dict(TOP=12, BLOCK=2048)
    assert compile_check("freetoken.kernels.nvfp4_half_gemv:_half_rows_kernel", ptr, const, "K,stride_xm") == 0


@pytest.mark.parametrize("half", [True, False])
def test_nvfp4_decode_gate_up_compiles_for_sm90(half):
    """The MoE decode gate|up GEMV at Qwen3.6's expert shapes, in packed half precision (its PTX) and in fp32."""
    ptr = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32", "ids_ptr": "*i32"}
    ptr.update(inter_ptr="*fp32", xp_ptr="*i32" if half else "*fp32", xf_ptr="*fp32")
    const = dict(H=2048, I=512, TOPK=8, EVEN=True, BLOCK_N=32, BLOCK_W=64, NUM_STAGES=3, HALF=half, ASM=True)
    div16 = "stride_xt,stride_pt,stride_we,stride_wn,stride_se,stride_sn,stride_ge"
    assert compile_check("freetoken.kernels.nvfp4_moe:_nvfp4_decode_gate_up_kernel", ptr, const, div16) == 0


@pytest.mark.parametrize("half", [True, False])
def test_nvfp4_decode_down_compiles_for_sm90(half):
    """The MoE decode down GEMV at Qwen3.6's expert shapes (top-8 pairs as a tile axis, the shared expert's NVFP4
    down in the epilogue), in packed half precision (its PTX) and in fp32."""
    ptr = {"inter_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32", "ids_ptr": "*i32"}
    ptr.update(wts_ptr="*bf16", out_ptr="*bf16", shared_ptr="*bf16", sd_w_ptr="*i32", sd_s_ptr="*u8")
    ptr.update(sd_g_ptr="*fp32", shared_gate_ptr="*bf16", xp_ptr="*i32", xf_ptr="*fp32")
    const = dict(H=2048, I=512, IS=512, TOPK=8, KP=8, TILE_PAIRS=True, SHARED=2, EVEN=True, EVEN_S=True)
    const.update(BLOCK_N=8, BLOCK_W=64, BLOCK_WS=64, NUM_STAGES=3, HALF=half, ASM=True)
    div16 = "stride_we,stride_wn,stride_se,stride_sn,stride_ge,stride_ot,stride_st,stride_sdw,stride_sds,stride_pt"
    assert compile_check("freetoken.kernels.nvfp4_moe:_nvfp4_decode_down_kernel", ptr, const, div16) == 0


@pytest.mark.parametrize("block_m", [1, 2])
def test_mixed_gemv_compiles_for_sm90(block_m):
    """The mixed BF16 / FP8 / NVFP4 GEMV at GDN in_proj's tiling (its FP8 rows decoded to fp32)."""
    ptr = {"x_ptr": "*bf16", "out_ptr": "*bf16", "d_ptr": "*bf16", "f_ptr": "*i32", "fs_ptr": "*fp32"}
    ptr.update(n_ptr="*i32", ns_ptr="*u8", ng_ptr="*fp32")
    const = dict(K=2048, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=256, NUM_STAGES=3)
    div16 = "stride_xm,stride_om,stride_d,stride_f,stride_n,stride_ns"
    assert compile_check("freetoken.kernels.mixed_gemv:_mixed_gemv_kernel", ptr, const, div16) == 0


@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 16, 512), (16, 64, 128), (32, 16, 256), (32, 64, 128)])
def test_mixed_dot_compiles_for_sm90(block_m, block_n, block_k):
    """The mixed projection on tensor cores (3..16 rows of x) at GDN in_proj's shapes: FP8 bytes converted to bf16
    tiles, NVFP4 words to bf16 tiles, dense rows as they are."""
    ptr = {"x_ptr": "*bf16", "out_ptr": "*bf16", "d_ptr": "*bf16", "f_ptr": "*u8", "fs_ptr": "*fp32"}
    ptr.update(n_ptr="*i32", ns_ptr="*u8", ng_ptr="*fp32")
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=3, DOT_DTYPE="tl.bfloat16")
    const.update(DOT_PREC="'ieee'")
    div16 = "stride_xm,stride_om,stride_d,stride_f,stride_n,stride_ns,K"
    assert compile_check("freetoken.kernels.mixed_dot:_mixed_dot_kernel", ptr, const, div16, warps=2) == 0


@pytest.mark.parametrize("formats", ["dense+fp8", "fp8"])
def test_mixed_dot_compiles_only_its_formats_for_sm90(formats):
    """A projection's mixed kernel compiles only the branches of the formats it has (``mixed_gemv.format_flags``),
    and a dense row's K step holds an FP8 row's bytes: GDN in_proj (BF16 + FP8 rows; 32-row programs, 256-weight
    steps at 8 rows of x) and the FP8-only attention projections then leave room for 7 programs an SM (<= 160
    registers on 2 warps, <= 32 KB of shared memory; 228 KB an SM), which smaller programs than in_proj's ~3 an SM
    can use. With every branch compiled the kernel took 238 registers and 49 KB: room for 4 (2026-12-05)."""
    ptr = {"x_ptr": "*bf16", "out_ptr": "*bf16", "d_ptr": "*bf16", "f_ptr": "*u8", "fs_ptr": "*fp32", "n_ptr": "*i32"}
    ptr.update({"ns_ptr": "*u8", "ng_ptr": "*fp32"})
    const = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "NUM_STAGES": 3, "DOT_DTYPE": "tl.bfloat16"}
    const.update({"DOT_PREC": "'ieee'", "HAS_DENSE": formats == "dense+fp8", "HAS_FP8": True, "HAS_NVFP4": False})
    div16 = "K,stride_xm,stride_om,stride_d,stride_f,stride_n,stride_ns"
    kernel = "freetoken.kernels.mixed_dot:_mixed_dot_kernel"
    assert compile_check(kernel, ptr, const, div16, warps=2, max_registers=160, max_shared=32768) == 0


@pytest.mark.parametrize("pdl", [0, 1, 2])
def test_pdl_kernels_compile_for_sm90(pdl):
    """Programmatic dependent launch (``kernels/pdl.py``): under ``PDL`` a kernel waits for the kernel before it and
    then releases the next (``griddepcontrol.wait`` and ``.launch_dependents`` in its PTX); without it, neither. At
    ``PDL=2`` (``FREETOKEN_PDL=prefetch``) the decode GEMVs also prefetch their first weight lines into L2. An
    RMSNorm, the fp16 tensor-core NVFP4 linear and the mixed projection on tensor cores stand for the rest (every
    kernel calls the same helpers first)."""
    both = "griddepcontrol.wait,griddepcontrol.launch_dependents"
    ptr = {k: "*bf16" for k in ("x_ptr", "res_ptr", "z_ptr", "w_ptr", "out_ptr", "sum_ptr")}
    ptr["eps"] = "fp32"
    const = {"ONE_PLUS": True, "HAS_RESIDUAL": True, "HAS_GATE": False, "BLOCK_R": 1, "BLOCK_N": 2048, "PDL": pdl}
    status = compile_check("freetoken.kernels.rms_norm:_rms_norm_kernel", ptr, const, "N", ptx_has=both)
    assert status == (0 if pdl else 3)
    ptr = {"x_ptr": "*fp16", "xf_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32"}
    ptr.update({"bias_ptr": "*bf16", "out_ptr": "*bf16"})
    const = {"HAS_BIAS": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "NUM_STAGES": 3, "DOT_PREC": "'tf32'"}
    const.update({"HALF": True, "EVEN": True, "ASM": True, "PDL": pdl})
    div16 = "N,K,stride_xm,stride_wn,stride_sn,stride_om"
    kernel = "freetoken.kernels.nvfp4_linear:_nvfp4_dot_kernel"
    assert compile_check(kernel, ptr, const, div16, warps=2, ptx_has=both) == (0 if pdl else 3)
    assert compile_check(kernel, ptr, const, div16, warps=2, ptx_has="prefetch.global.L2") == (0 if pdl == 2 else 3)
    ptr = {"x_ptr": "*bf16", "out_ptr": "*bf16", "d_ptr": "*bf16", "f_ptr": "*u8", "fs_ptr": "*fp32", "n_ptr": "*i32"}
    ptr.update({"ns_ptr": "*u8", "ng_ptr": "*fp32"})
    const = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "NUM_STAGES": 3, "DOT_DTYPE": "tl.bfloat16"}
    const.update({"DOT_PREC": "'ieee'", "PDL": pdl})
    div16 = "K,stride_xm,stride_om,stride_d,stride_f,stride_n,stride_ns"
    kernel = "freetoken.kernels.mixed_dot:_mixed_dot_kernel"
    assert compile_check(kernel, ptr, const, div16, warps=2, ptx_has="prefetch.global.L2") == (0 if pdl == 2 else 3)


def test_host_expert_mailbox_kernels_compile_with_their_system_scope_instructions(tmp_path):
    """The mailbox's pack and wait kernels (``kernels/host_expert_mailbox.py``): the fence before the request, the
    write-through stores to host memory, the acquire polls and the re-fetched host sums are in the PTX (the
    interpreter runs plain loads and stores in their place). In the pack kernel every warp has read the request
    counter before one thread writes it back: a barrier between the counter's load and the stores before the
    request (without it a late warp counts twice and rings a request no wait kernel expects; the interpreter has
    no warps to show it)."""
    mailbox = "freetoken.kernels.host_expert_mailbox"
    pack_ptrs = dict(x_ptr="*bf16", topk_ptr="*i64", slot_ptr="*i32", weight_ptr="*fp32", host_x_ptr="*bf16",
                     host_ids_ptr="*i64", host_weight_ptr="*fp32", control_ptr="*i64", state_ptr="*i64")  # fmt: skip
    pack = dict(PAIRS=8, BLOCK_P=16, BLOCK_H=1024, SYSTEM=True)
    has = "fence.acq_rel.sys,st.relaxed.sys.global.b64,st.global.wt,bar.sync"
    ptx = tmp_path / "pack.ptx"
    assert compile_check(f"{mailbox}:_pack_kernel", pack_ptrs, pack, div16="H,stride_x", ptx_has=has,
                         ptx_out=str(ptx)) == 0  # fmt: skip
    ops = [op for line in ptx.read_text().splitlines() for op in ("ld.global.b64", "st.global.b64", "bar.sync",
           "fence.acq_rel.sys") if op in line]  # fmt: skip
    before_request = ops[: ops.index("fence.acq_rel.sys")]
    last_load = len(before_request) - 1 - before_request[::-1].index("ld.global.b64")
    after_load = before_request[last_load + 1 :]
    assert "st.global.b64" in after_load and after_load.index("bar.sync") < after_load.index("st.global.b64"), ops
    wait_ptrs = dict(y_ptr="*bf16", host_out_ptr="*fp32", control_ptr="*i64", state_ptr="*i64")
    has = "ld.acquire.sys.global.b64,ld.global.cv"
    assert compile_check(f"{mailbox}:_wait_add_kernel", wait_ptrs, dict(BLOCK_H=1024, SYSTEM=True),
                         div16="H,stride_y", ptx_has=has) == 0  # fmt: skip
