"""Triton kernels, each beside the plain-torch reference it is tested against.

Importable as ``freetoken.kernels`` (``python/freetoken/kernels`` is a symlink to this directory).

- ``fused_moe``: grouped MoE over all-resident fused experts (``fused_moe_torch`` reference, ``fused_moe_triton``).
- ``moe_combine``: the grouped MoE's sum over each token's k expert rows plus the gated shared expert, one launch.
- ``moe_decode``: routed experts of decode-sized steps as two GEMVs (gate_up with SiLU-and-mul; down with the k
  pairs weighted and summed, the shared expert optionally added), ``moe_decode_torch`` reference.
- ``attention``: paged attention over the KV pool (``extend_attention_*``, ``decode_attention_*``, the latter with
  gated attention's output gate in its merge kernel) and the ``TritonAttention`` backend, registered as ``"triton"``
  in ``freetoken.layers.attention`` on import.
- ``kv_store``: a step's new K and V written into the pool in one launch (``store_kv_torch`` reference).
- ``gdn_decode``: one Gated DeltaNet decode step in place on the state pool's slots (``gdn_conv_decode``,
  ``gdn_recurrent_decode``: Triton on CUDA, ``*_torch`` references elsewhere; CUDA-graph capturable).
- ``gdn_conv_prefill``: the Gated DeltaNet causal conv + SiLU of a varlen prefill batch in one launch, continuing
  from the state pool's slots (read only; ``gdn_conv_prefill_torch`` reference: the former per-sequence conv1d).
- ``rms_norm``: ``rms_norm``, ``add_rms_norm`` (the residual add fused, optionally in place), ``gated_rms_norm``.
- ``activation``: ``silu_and_mul`` over a fused ``[gate | up]`` projection.
- ``rope``: ``qk_norm_rope``, per-head q/k RMSNorm (optional) and partial or full rotate-half RoPE in one kernel.
- ``moe_routing``: ``topk_softmax``, the router's softmax, top-k and renormalisation in one kernel.
- ``expert_admission``: LFU (or LRU) admission of a layer's routed experts into the device expert cache
  (``admit_experts_triton``, one program; ``admit_experts_torch`` reference; no host sync, CUDA-graph capturable).
- ``expert_gather``: copies missed experts from a (pinned host) bank into the cache's slots
  (``gather_experts_triton`` reads host memory through its device address; ``gather_experts_torch`` reference).

Importing this package never requires CUDA; the Triton paths are chosen only on CUDA tensors (or under
``TRITON_INTERPRET=1`` in tests).
"""
