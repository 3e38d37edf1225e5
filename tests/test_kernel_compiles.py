"""The watch over Triton compiles on the request path (``engine/kernel_compiles.py``): it chains into Triton's
post-compile hook, describes a kernel by its integer specializations, and the worker's report names what a served
step compiled. On the CPU nothing compiles, so the hook is called as Triton 3.6+ calls it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from freetoken.engine.kernel_compiles import KernelCompileWatch, process_compile_watch, report_step_compiles

knobs = pytest.importorskip("triton.knobs")


def _fake_compile(name: str, params: list[str], constants: dict, div16: list[int]):
    fn = SimpleNamespace(name=name, jit_function=SimpleNamespace(params=[SimpleNamespace(name=n) for n in params]))
    compile = {
        "constants": {(i,): v for i, v in constants.items()},
        "configs": [{(i,): [["tt.divisibility", 16]] for i in div16}],
        "num_warps": 4,
        "num_stages": 3,
    }
    knobs.runtime.jit_post_compile_hook(
        key="spec", repr=name, fn=fn, compile=compile, is_manual_warmup=False, already_compiled=False
    )


def test_watch_records_compiles_and_chains_the_previous_hook(monkeypatch):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["fn"].name))
    watch = KernelCompileWatch().install()
    assert watch.installed and knobs.runtime.jit_post_compile_hook == watch._hook
    mark = watch.mark()
    _fake_compile("piece_kernel", ["q_ptr", "T", "scale", "BV"], {3: 16}, [0, 1])
    assert watch.since(mark) == ["piece_kernel(BV=16; D16: q_ptr,T; warps=4, stages=3)"]
    assert seen == ["piece_kernel"], "a hook installed before the watch still runs"
    assert watch.install() is watch and knobs.runtime.jit_post_compile_hook == watch._hook  # idempotent


def test_process_watch_is_one_per_process():
    assert process_compile_watch() is process_compile_watch()


def test_report_names_the_kernels_a_step_compiled(caplog):
    watch = KernelCompileWatch()
    mark = watch.mark()
    assert report_step_compiles(watch, mark, 7, 2184, 12.0) == 0
    watch.compiled += [f"k{i}" for i in range(8)]
    with caplog.at_level(logging.WARNING):
        assert report_step_compiles(watch, mark, 8, 2184, 310.0) == 8
    assert "Step 8 (2184 tokens, 310 ms) compiled 8 Triton kernel(s)" in caplog.text
    assert "k0, k1, k2, k3, k4, k5 and 2 more" in caplog.text


def test_the_benchmarks_find_the_warning_in_a_server_log(caplog, tmp_path):
    """The benches list these warnings from a server's log (``server_harness.ServerProcess.request_path_events``,
    used by bench/agent_session_bench.py and bench/decode_bench.py): what they look for is what is logged."""
    from server_harness import ServerProcess

    watch = KernelCompileWatch()
    mark = watch.mark()
    watch.compiled.append("k0")
    with caplog.at_level(logging.WARNING):
        report_step_compiles(watch, mark, 9, 136, 812.0)
    log = tmp_path / "server.log"
    lines = ["[..] INFO     Step 8 (1 tokens, 3 ms) planned"] + [
        f"[..] WARNING  {r.getMessage()}" for r in caplog.records
    ]
    log.write_text("\n".join(lines) + "\n")
    srv = object.__new__(ServerProcess)  # only its log file: no process
    srv.log_file = SimpleNamespace(name=str(log))
    expected = "Step 9 (136 tokens, 812 ms) compiled 1 Triton kernel(s) on the request path: k0"
    assert srv.request_path_events() == [expected]
