"""``kernels/nvfp4_tiles.e2m1_pairs`` (the decode every NVFP4 kernel starts from) against the E2M1 table, under
TRITON_INTERPRET=1: every code at every position of a word, every single set bit, and random words. A pair is two
fp16 bit patterns, weight p low and weight p + 4 high, each ``e2m1(code) * 2^-14``; the bits a pair leaves clear
must be clear (the kernels multiply the register as it is)."""

from triton_interpreter import run_under_interpreter

_SCRIPT = r"""
import torch
import triton
import triton.language as tl

from freetoken.kernels.nvfp4_tiles import e2m1_pairs
from freetoken.quant.nvfp4 import e2m1_values


@triton.jit
def pairs_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p0, p1, p2, p3 = e2m1_pairs(tl.load(w_ptr + offs, mask=mask, other=0))
    tl.store(out_ptr + 4 * offs, p0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + 4 * offs + 1, p1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + 4 * offs + 2, p2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + 4 * offs + 3, p3.to(tl.int32, bitcast=True), mask=mask)


VALUES = e2m1_values()  # the code -> value table the references dequantize with (code 8 is -0)


def placed(code: int) -> int:
    # e2m1(code) * 2^-14 as fp16 bits (exact: at most 2 significant bits, subnormals included)
    return int((VALUES[code] * 2.0**-14).to(torch.float16).view(torch.int16)) & 0xFFFF


words = [c << (4 * p) for p in range(8) for c in range(16)]  # every code at every position, the rest zero
words += [1 << b for b in range(32)] + [0xFFFFFFFF, 0x88888888, 0x77777777]
g = torch.Generator().manual_seed(0)
words += torch.randint(0, 1 << 32, (4096,), generator=g, dtype=torch.int64).tolist()
w = torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in words], dtype=torch.int32)
out = torch.zeros(4 * len(words), dtype=torch.int32)
pairs_kernel[(triton.cdiv(len(words), 256),)](w, out, len(words), BLOCK=256)
got = [x & 0xFFFFFFFF for x in out.tolist()]
for i, word in enumerate(words):
    for p in range(4):
        low, high = placed((word >> (4 * p)) & 15), placed((word >> (4 * p + 16)) & 15)
        assert got[4 * i + p] == low | high << 16, (hex(word), p, hex(got[4 * i + p]), hex(low | high << 16))
print("OK", len(words), "words")
"""


def test_e2m1_pairs_place_every_code_interpreter_cpu():
    run_under_interpreter(_SCRIPT, timeout=300)
