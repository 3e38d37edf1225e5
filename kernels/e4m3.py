"""Rounding fp32 values to the E4M3 grid inside a Triton kernel, so that the cast to ``tl.float8e4nv`` after it is
exact.

Why not let the cast round: on the GPU it rounds to nearest even (``cvt.rn.satfinite``) as torch does, but the Triton
interpreter (the CPU tests) rounds ties away from zero, subnormals toward zero, and a value that rounds up to the
next power of two down into its own binade (-125.5 -> -64). Rounding first, with fp32 arithmetic that both run the
same way, makes the kernels agree with torch's ``.to(torch.float8_e4m3fn)`` bit for bit on both.

    |v| >= 2^-6 (normal):      keep 3 mantissa bits, to nearest even, on the fp32 bits
    |v| <  2^-6 (subnormal):   multiples of 2^-9, through (|v| + C) - C with C = 1.5 * 2^14 (ulp(C) = 2^-9),
                               then v's sign (torch keeps it: -0 and values rounding to zero stay negative)

Inputs must lie within [-448, 448] (E4M3's finite range); callers clamp or scale to it.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def round_to_e4m3(v):
        """fp32 ``v`` (|v| <= 448) -> fp32 on the E4M3 grid, to nearest even."""
        bits = v.to(tl.uint32, bitcast=True)
        lsb = (bits >> 20) & 1
        normal = ((bits + 0x7FFFF + lsb) & 0xFFF00000).to(tl.float32, bitcast=True)
        magic = 24576.0  # 1.5 * 2^14
        tiny = ((tl.abs(v) + magic) - magic).to(tl.uint32, bitcast=True)
        subnormal = (tiny | (bits & 0x80000000)).to(tl.float32, bitcast=True)  # the sign kept: -0 stays -0
        return tl.where(tl.abs(v) >= 0.015625, normal, subnormal)
