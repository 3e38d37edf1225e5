"""Triton kernels, each beside the plain-torch reference it is tested against.

Importable as ``freetoken.kernels`` (``python/freetoken/kernels`` is a symlink to this directory).

- ``fused_moe``: grouped MoE over all-resident fused experts (``fused_moe_torch`` reference, ``fused_moe_triton``).
- ``attention``: paged attention over the KV pool (``extend_attention_*``, ``decode_attention_*``) and the
  ``TritonAttention`` backend, registered as ``"triton"`` in ``freetoken.layers.attention`` on import.

Importing this package never requires CUDA; the Triton paths are chosen only on CUDA tensors (or under
``TRITON_INTERPRET=1`` in tests).
"""
