"""Page-locks the host expert banks in place, and unlocks them when they are freed.

Why in place: registering filled pages is faster than a pinned allocation and exact-size, where torch's pinned
allocator rounds up to a power of two (a 60 GB bank set would take up to twice that).

Why the driver API (``cuMemHostRegister``, through ctypes as ``version_info.py`` reads the driver) and not torch's
``cudaHostRegister``: a failed runtime call stays the runtime's last error, and torch raises it at its next kernel
launch, far from the cause (an H100, 2026-12-07: "part or all of the requested memory range is already mapped" out
of a ``torch.full`` after the warning that pinning had failed). A failed driver call leaves nothing behind: the
server goes on with synchronous copies, as its warning says.

Why the unlock: a bank freed while registered leaves its range registered, and the next allocation at that address
(a second model in the process: tests) cannot be registered again.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

# CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP: every context sees it, and under unified addressing
# the device reads it at the host address (the expert gather kernel does, over PCIe)
_FLAGS = 0x1 | 0x2


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostRegister_v2.restype = ctypes.c_int
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuMemHostUnregister.restype = ctypes.c_int
    return lib


def pin_in_place(t: torch.Tensor, device: torch.device) -> bool:
    """Page-locks ``t``'s bytes for ``device``'s context; they are unlocked when ``t`` (the object) is collected.
    False when that fails (the memory stays pageable; nothing else changes)."""
    if t.is_pinned():
        return True
    torch.cuda.synchronize(device)  # the primary context current on this thread, as the driver call needs
    ptr = t.data_ptr()
    if _driver().cuMemHostRegister_v2(ctypes.c_void_p(ptr), t.numel() * t.element_size(), _FLAGS) != 0:
        return False
    weakref.finalize(t, _unpin, ptr).atexit = False  # at exit the process's mappings go with it
    return True


def _unpin(ptr: int) -> None:
    _driver().cuMemHostUnregister(ctypes.c_void_p(ptr))  # a failure (the context gone at exit) changes nothing
