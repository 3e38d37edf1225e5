"""Programmatic dependent launch's rule, read from the source of every kernel module (``kernels/pdl.py``): a kernel
launched with ``**pdl_launch(...)`` may start while the kernel before it still runs, so it must take the ``PDL``
constexpr and call ``pdl_wait_then_release(PDL)`` before it touches memory. A kernel that loaded or stored first
would race its predecessor only on the GPU, only sometimes, and only with ``FREETOKEN_PDL`` on; the interpreter
ignores PDL, so this static check is what the CPU can say about it."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels")
# calls that may come before the wait: they only prefetch weights (which no kernel of a step writes) into L2
BEFORE_WAIT_OK = {"pdl_prefetch_rows"}
MEMORY_OPS = ("load", "store", "atomic_", "inline_asm_elementwise", "make_tensor_descriptor", "make_block_ptr")


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _sources() -> dict[str, ast.Module]:
    out = {}
    for name in sorted(os.listdir(KERNELS)):
        if name.endswith(".py"):
            with open(os.path.join(KERNELS, name)) as f:
                out[name] = ast.parse(f.read())
    return out


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)}


def _pdl_launches(trees) -> list[tuple[str, str, int]]:
    """``(module, kernel, line)`` of every ``kernel[grid](..., **pdl_launch(t))``."""
    out = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            spread = [k.value for k in node.keywords if k.arg is None and isinstance(k.value, ast.Call)]
            if not any(isinstance(c.func, ast.Name) and c.func.id == "pdl_launch" for c in spread):
                continue
            callee = node.func.value
            name = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", None)
            out.append((module, name, node.lineno))
    return out


def _touches_memory(node: ast.AST, jitted: dict, seen: frozenset = frozenset()) -> str | None:
    """What in ``node`` may read or write global memory: a ``tl`` memory op, or a call to one of our jit helpers
    that has one (followed down; the prefetch is allowed)."""
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Call):
            continue
        f = sub.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl":
            if f.attr.startswith(MEMORY_OPS):
                return f"tl.{f.attr}"
        elif isinstance(f, ast.Name) and f.id in jitted and f.id not in BEFORE_WAIT_OK and f.id not in seen:
            inner = _touches_memory(jitted[f.id], jitted, seen | {f.id})
            if inner:
                return f"{f.id} ({inner})"
    return None


def _waits_first(fn: ast.FunctionDef, jitted: dict) -> str | None:
    """None when ``fn`` calls ``pdl_wait_then_release(PDL)`` as one of its own statements before anything that
    touches memory; else what is wrong."""
    for stmt in fn.body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "pdl_wait_then_release":
            args = [a.id for a in call.args if isinstance(a, ast.Name)]
            return None if args == ["PDL"] else f"waits on {ast.unparse(call)}, not on its PDL constexpr"
        touched = _touches_memory(stmt, jitted)
        if touched:
            return f"{touched} at line {stmt.lineno} comes before pdl_wait_then_release(PDL)"
    return "never calls pdl_wait_then_release(PDL) in its own body"


def test_every_pdl_launched_kernel_waits_before_it_touches_memory():
    trees = _sources()
    # a name means the launching module's own function first (two modules have a ``_down_k_step``), else an
    # imported one
    everywhere = {name: fn for tree in trees.values() for name, fn in _jit_functions(tree).items()}
    launches = _pdl_launches(trees)
    assert len(launches) >= 30, "the scan found too few PDL launches: has the launch idiom changed?"
    wrong = []
    for module, kernel, line in launches:
        jitted = {**everywhere, **_jit_functions(trees[module])}
        fn = jitted.get(kernel)
        if fn is None:
            wrong.append(f"{module}:{line}: {kernel} is not a @triton.jit function of kernels/")
            continue
        if "PDL" not in [a.arg for a in fn.args.args]:
            wrong.append(f"{module}:{line}: {kernel} has no PDL constexpr")
            continue
        problem = _waits_first(fn, jitted)
        if problem:
            wrong.append(f"{module}:{line}: {kernel} {problem}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "body, verdict",
    [
        ("pdl_wait_then_release(PDL)\nx = tl.load(p)", None),
        ("i = tl.program_id(0)\npdl_prefetch_rows(w, i, 1, 1, 0, 8, 4, PDL)\npdl_wait_then_release(PDL)", None),
        ("x = tl.load(p)\npdl_wait_then_release(PDL)", "tl.load at line"),
        ("_loads(p)\npdl_wait_then_release(PDL)", "_loads (tl.load) at line"),
        ("_offsets(p)\npdl_wait_then_release(PDL)", None),  # a helper that only computes
        ("pdl_wait_then_release(True)", "not on its PDL constexpr"),
        ("if PDL:\n    pdl_wait_then_release(PDL)\ntl.store(p, 1)", "tl.store at line"),
        ("x = 1", "never calls"),
    ],
)
def test_the_check_tells_a_late_wait(body, verdict):
    """The rule's own test: a load, a store or a helper before the wait, a wait not on ``PDL``, no wait."""
    src = "@triton.jit\ndef k(p, w, PDL: tl.constexpr):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    fn = ast.parse(src).body[0]
    helpers = ast.parse(
        "@triton.jit\ndef _loads(p):\n    return tl.load(p)\n@triton.jit\ndef _offsets(p):\n    return p + 1\n"
    )
    jitted = {"k": fn, "_loads": helpers.body[0], "_offsets": helpers.body[1], "pdl_prefetch_rows": fn}
    got = _waits_first(fn, jitted)
    assert (got is None) if verdict is None else (got is not None and verdict in got), got
