"""Compiles a Triton kernel for a GPU this machine does not have (default sm_90, the H200), to PTX and cubin with
Triton's bundled ptxas: a type error between branches, a bad cast or a register-allocation failure shows here, before
a GPU session spends minutes starting a machine to find it. The interpreter (TRITON_INTERPRET=1) checks what a
kernel computes; this checks that the GPU compiler takes it.

    python scripts/triton_compile_check.py freetoken.kernels.mixed_gemv:_mixed_gemv_kernel \\
        --ptr x_ptr=*bf16,out_ptr=*bf16,d_ptr=*bf16,f_ptr=*u8,fs_ptr=*fp32,n_ptr=*i32,ns_ptr=*u8,ng_ptr=*fp32 \\
        --const K=2048,BLOCK_M=1,BLOCK_N=16,BLOCK_K=256,NUM_STAGES=3

Arguments not named in ``--ptr`` or ``--const`` are 32-bit integers, except constexprs with a default (as at
launch). ``--const`` values are Python literals (``True``, ``64``) or Triton dtypes (``tl.bfloat16``). Prints the
PTX size, the registers per thread and the shared memory a program; exits 1 if compiling fails.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _constexpr(text: str):
    """A Python literal (``True``, ``64``, ``'tf32'``) or a Triton dtype (``tl.bfloat16``)."""
    if text.startswith("tl."):
        import triton.language as tl

        return getattr(tl, text[3:])
    return ast.literal_eval(text)


def _pairs(text: str) -> dict:
    return dict(item.split("=", 1) for item in text.split(",") if item) if text else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernel", help="module:function, e.g. freetoken.kernels.mixed_gemv:_mixed_gemv_kernel")
    p.add_argument("--ptr", default="", help="name=type pairs for pointer arguments (*bf16, *fp32, *i32, *u8, ...)")
    p.add_argument("--const", default="", help="name=value pairs for constexpr arguments")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 89, 90")
    p.add_argument(
        "--div16",
        default="",
        help="integer arguments that are multiples of 16 at launch (comma-separated, or 'all'): Triton's JIT marks "
        "them, and pointers (torch allocations are 16-byte aligned), as divisible by 16, which vectorized loads and "
        "the loop pipeliner need; without the marks the kernel compiles unpipelined",
    )
    p.add_argument("--warps", type=int, default=4, help="num_warps, as the launcher passes it")
    p.add_argument("--stages", type=int, default=3, help="num_stages, as the launcher passes it")
    p.add_argument(
        "--async-wgmma",
        action="store_true",
        help="exit 2 when ptxas serializes the kernel's wgmmas (its C7515 advisory: each wgmma then waits for the "
        "one before it, so the tensor cores overlap nothing; what that costs depends on the kernel: time it)",
    )
    p.add_argument(
        "--ptx-has",
        default="",
        help="comma-separated strings the PTX must contain (e.g. griddepcontrol.wait): exit 3 naming the first absent",
    )
    p.add_argument(
        "--max-registers",
        type=int,
        default=0,
        help="exit 4 when ptxas gives a thread more registers than this (0: no bound); with --max-shared, the "
        "occupancy a launcher's tiles were chosen for",
    )
    p.add_argument("--max-shared", type=int, default=0, help="exit 4 above this many bytes of shared memory a program")
    p.add_argument("--ptx-out", default="", help="write the PTX to this file (tests read its instruction order)")
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = a.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    params = inspect.signature(fn.fn).parameters
    names = list(params)
    consts = {k: _constexpr(v) for k, v in _pairs(a.const).items()}
    for param in params.values():  # constexprs left out take their defaults, as at launch
        if param.name not in consts and "constexpr" in str(param.annotation) and param.default is not param.empty:
            consts[param.name] = param.default
    ptrs = _pairs(a.ptr)
    unknown = (set(consts) | set(ptrs)) - set(names)
    if unknown:
        p.error(f"{name} has no argument(s) {sorted(unknown)}")
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    div16 = set(names) if a.div16 == "all" else set(filter(None, a.div16.split(",")))
    aligned = [i for i, n in enumerate(names) if sig[n].startswith("*") or (n in div16 and sig[n] == "i32")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    try:
        options = {"num_warps": a.warps, "num_stages": a.stages}
        compiled = triton.compile(src, target=GPUTarget("cuda", a.arch, 32), options=options)
    except Exception as e:  # the compiler's message is the point of the tool
        causes, inner = [], e.__cause__
        while inner is not None:  # a nested @jit call's error names only its caller: print down to the root
            causes.append(f"\ncaused by: {inner!r}")
            inner = inner.__cause__
        print(f"{name} does not compile for sm_{a.arch}: {e}" + "".join(causes))
        return 1
    if a.ptx_out:
        with open(a.ptx_out, "w") as f:
            f.write(compiled.asm["ptx"])
    usage, advisories, registers = _ptxas_usage(compiled.asm["ptx"], a.arch)
    shared = getattr(compiled.metadata, "shared", None)  # bytes a program: with registers, what sets occupancy
    usage += f", {shared} bytes of shared memory" if shared is not None else ""
    print(f"{name}: sm_{a.arch} PTX {len(compiled.asm['ptx'])} bytes" + usage)
    for line in advisories:
        print(f"  ptxas: {line}")
    if a.async_wgmma and any("C7515" in line for line in advisories):
        print(f"{name}: ptxas serializes its wgmmas")
        return 2
    for text in filter(None, a.ptx_has.split(",")):
        if text not in compiled.asm["ptx"]:
            print(f"{name}: its PTX has no {text!r}")
            return 3
    if a.max_registers and (registers is None or registers > a.max_registers):
        print(f"{name}: {registers} registers a thread, more than {a.max_registers} (or ptxas did not say)")
        return 4
    if a.max_shared and (shared is None or shared > a.max_shared):
        print(f"{name}: {shared} bytes of shared memory a program, more than {a.max_shared}")
        return 4
    return 0


def _ptxas_usage(ptx: str, arch: int) -> tuple[str, list[str], int | None]:
    """Registers and spill bytes per thread, from the ptxas Triton compiled with (``get_ptxas``) run verbosely on the
    PTX (the driver that would report them is not here), its performance advisories (``(C75xx) Potential
    Performance Loss: ...``, which Triton does not show), and the register count; empty (None) where that fails."""
    import re
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except Exception:
        return "", [], None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch_flag = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        r = subprocess.run([ptxas, "-v", f"--gpu-name={arch_flag}", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)  # fmt: skip
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores", r.stderr)
    advisories = [
        m.group(1) for m in re.finditer(r"ptxas info\s*: (\(C75\d\d\)[^\n]*?)(?: in the function|$)", r.stderr, re.M)
    ]
    usage = (f", {regs.group(1)} registers" if regs else "") + (
        f", {spills.group(1)} bytes of spill stores" if spills else ""
    )
    return usage, advisories, int(regs.group(1)) if regs else None


if __name__ == "__main__":
    sys.exit(main())
