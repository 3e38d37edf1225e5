"""Quantized weight formats: NVFP4 and FP8 math (``nvfp4.py``, ``fp8.py``), the checkpoint quantization configs
(``config.py``) and our quantizer (``quantize_checkpoint.py``)."""
