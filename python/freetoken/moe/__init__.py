"""Expert offload (``--moe-backend offload``): routed experts in pinned host memory, a cache of them on the
GPU for decode, whole layers streamed for prefill. ``offload.py`` is the entry point."""
