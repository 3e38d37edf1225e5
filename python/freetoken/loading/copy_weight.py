"""The one way a checkpoint tensor lands in a parameter: shapes must agree exactly (a silent broadcast or a
transposed tensor would load and produce garbage), then an in-place copy (dtype and device follow ``dst``)."""

from __future__ import annotations

import torch


@torch.no_grad()
def copy_weight(dst: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(tensor)
