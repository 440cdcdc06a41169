"""DeepSpeed Compression (XTC / ZeroQuant-style compression-aware training): ``compress.py`` (the
model surgery: ``init_compression``, ``redundancy_clean``, ``student_initialization``),
``layers.py`` (the compressing layers), ``quantizers.py`` (fake-quantizers and top-k masks),
``scheduler.py`` (the techniques switched on at their steps). The ``compression_training`` block is
parsed by ``runtime/config/compression.py``; the optimizer-step weight quantizer (MoQ) is
``runtime/quantize.py``; ``training.py`` is what the engine drives each step.
"""
