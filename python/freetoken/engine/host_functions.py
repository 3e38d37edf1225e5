"""Host functions enqueued on a CUDA stream (``cuLaunchHostFunc``), capturable in a CUDA graph as host nodes.

Why: the hybrid MoE backend computes missed experts on the host CPU while the GPU fetches and runs the others, and
that work has to sit inside the decode step's CUDA graph, ordered after the kernels that write its inputs into
pinned host memory and before the kernel that reads its output. A host function is that order: the stream runs
it when the work before it is done and goes on when it returns. It must not call CUDA, and it runs on a driver
thread, so the engine's own functions are native (no GIL); ``PythonHostFunction`` is for tests and probes.

torch has no binding for it, so this calls the driver API through ctypes (``libcuda.so.1`` is present wherever a
CUDA device is). The stream is the current one unless given.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Optional

import torch

# void (*)(void *userData): the driver's CUhostFn
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchHostFunc.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorName.restype = ctypes.c_int
    return lib


def _error_name(lib: ctypes.CDLL, code: int) -> str:
    name = ctypes.c_char_p()
    if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {code}"


def launch_host_function(fn_address: int, user_data: int = 0, stream: Optional[torch.cuda.Stream] = None) -> None:
    """Enqueues ``fn(user_data)`` (a native ``void (*)(void *)`` at ``fn_address``) on ``stream`` (default: the
    current one). Under stream capture it becomes a host node of the graph."""
    if not fn_address:
        raise ValueError("launch_host_function needs a function address")
    stream = stream if stream is not None else torch.cuda.current_stream()
    lib = _driver()
    code = lib.cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(fn_address),
                                ctypes.c_void_p(user_data))  # fmt: skip
    if code != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed: {_error_name(lib, code)}")


@functools.lru_cache(maxsize=1)
def native_no_op_address() -> int:
    """libc's ``free``: with a null ``user_data`` a native host function that does nothing, to time the host
    node's own cost."""
    return ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p).value


class PythonHostFunction:
    """A Python callable as a host function (tests and probes: it takes the GIL on the driver's thread, so the
    thread that waits for the stream must not hold it; torch's synchronize calls release it)."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn
        self.error: Optional[BaseException] = None  # an exception cannot cross the driver: kept for the caller
        self._c_fn = HOST_FN(self._call)  # kept alive as long as the graph or stream may call it

    def _call(self, _user_data) -> None:
        try:
            self._fn()
        except BaseException as e:  # noqa: BLE001 (reported through .error)
            self.error = e

    @property
    def address(self) -> int:
        return ctypes.cast(self._c_fn, ctypes.c_void_p).value

    def launch(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        launch_host_function(self.address, 0, stream)
