"""``no_host_sync()``: fail loudly when tensor code does something a CUDA graph cannot capture.

A decode step replayed from a CUDA graph must not read device values on the host (``.item()``, ``bool(t)``,
``.tolist()``), produce shapes that depend on data (``nonzero``, ``unique``, boolean indexing), or turn Python data
into tensors (``torch.tensor(list)``: a pageable host-to-device copy). On CUDA, capture itself fails on most of
these; this audit finds them on the CPU too, where the tests run: every aten operator passes through a dispatch
mode that raises on the offenders. (A CPU tensor's ``.tolist()`` reads memory without an operator; code meant
for capture gets no host lists to call it on, see ``ForwardBatch``.)
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    pass


def _name(func) -> str:
    return str(func.overloadpacket.__name__)


# operators that read a device value on the host, or whose output shape depends on tensor data
_FORBIDDEN = {
    "_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "is_nonzero",
    "equal",
    "allclose",
    "nonzero",
    "argwhere",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
    "bincount",
    "histc",
    "lift_fresh",  # torch.tensor(python data)
}


class _Audit(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in _FORBIDDEN:
            raise HostSyncError(f"aten.{name} cannot run inside a CUDA graph (host sync or data-dependent shape)")
        if (
            name == "repeat_interleave"
            and func._overloadname in ("Tensor", "self_Tensor")
            and kwargs.get("output_size") is None
        ):
            raise HostSyncError("repeat_interleave with tensor repeats needs output_size inside a CUDA graph")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or []):
                raise HostSyncError(f"aten.{name} with a boolean mask has a data-dependent shape")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync():
    """Raise ``HostSyncError`` on any operator a CUDA graph could not capture, within the block."""
    with _Audit():
        yield
