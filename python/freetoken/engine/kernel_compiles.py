"""Which Triton kernels compile while the server serves (a request's step paid for it), reported in the log.

The prefill warm-up (``prefill_warmup.py``) compiles the specializations requests are expected to bring; a step that
still compiles one waits ~0.1-1 s for it (an agent turn's TTFT of ~100 ms read 280-330 ms on the H200 at 3 of 10
turns, 2026-12-03). Triton calls ``knobs.runtime.jit_post_compile_hook`` after each compile (or load from its
disk cache) of a kernel new to this process; the watch records them and the worker logs the ones a served step
caused, with their constexpr values and the arguments specialized as divisible by 16, so that the warm-up (or a
``do_not_specialize``) can cover them.
"""

from __future__ import annotations

from typing import Optional

from ..log import get_logger

try:
    from triton import knobs as _knobs
except ImportError:  # no Triton, or one too old for knobs: nothing to watch
    _knobs = None

logger = get_logger(__name__)


def _describe(fn, compile: dict) -> str:
    """``name(constexpr values; D16: arguments marked divisible by 16; warps, stages)`` from what the hook gets."""
    name = getattr(fn, "name", "?")
    try:
        params = [p.name for p in fn.jit_function.params]
        consts = [f"{params[k[0]]}={v}" for k, v in compile.get("constants", {}).items() if len(k) == 1]
        attrs = (compile.get("configs") or [{}])[0]
        div16 = [params[k[0]] for k, marks in attrs.items() if len(k) == 1 and ["tt.divisibility", 16] in marks]
    except Exception:  # the hook's arguments are Triton's internals: keep the name if their shape changed
        return name
    opts = f"warps={compile.get('num_warps')}, stages={compile.get('num_stages')}"
    return f"{name}({', '.join(consts)}; D16: {','.join(div16)}; {opts})"


class KernelCompileWatch:
    """Counts Triton compiles in this process from ``install()`` on, with a description of each."""

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self._previous = None
        self.installed = False

    def install(self) -> "KernelCompileWatch":
        if self.installed or _knobs is None or not hasattr(_knobs.runtime, "jit_post_compile_hook"):
            return self
        self._previous = _knobs.runtime.jit_post_compile_hook  # (another hook keeps running behind ours)
        _knobs.runtime.jit_post_compile_hook = self._hook
        self.installed = True
        return self

    def _hook(self, **kw) -> Optional[bool]:
        # (Triton passes key, repr, fn, compile, is_manual_warmup, already_compiled by keyword; all go on unchanged)
        self.compiled.append(_describe(kw["fn"], kw["compile"]))
        return self._previous(**kw) if self._previous is not None else None

    def mark(self) -> int:
        """A position to ask ``since`` about later."""
        return len(self.compiled)

    def since(self, mark: int) -> list[str]:
        """The kernels compiled after ``mark``."""
        return self.compiled[mark:]


_PROCESS_WATCH = KernelCompileWatch()


def process_compile_watch() -> KernelCompileWatch:
    """The process's one watch (every worker in it shares Triton's hook), installed on first use."""
    return _PROCESS_WATCH.install()


def report_step_compiles(watch: KernelCompileWatch, mark: int, step_id: int, num_tokens: int, step_ms: float) -> int:
    """Logs the kernels a served step compiled (a warning: the warm-up missed their shape); returns how many."""
    names = watch.since(mark)
    if names:
        listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        logger.warning(
            f"Step {step_id} ({num_tokens} tokens, {step_ms:.0f} ms) compiled {len(names)} Triton kernel(s) "
            f"on the request path: {listed}"
        )
    return len(names)
