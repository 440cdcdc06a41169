"""DeepSpeed's ``deepspeed.ops`` import paths, for scripts written against DeepSpeed.

Thin facades only: ``adam.py`` (``DeepSpeedCPUAdam``, ``FusedAdam``), ``adagrad.py``
(``DeepSpeedCPUAdagrad``) and ``lion.py`` (``DeepSpeedCPULion``) re-export the classes of
``dslaunch.kernels.cpu.optimizers`` and ``dslaunch.kernels.fused_adam``, which own them;
``normalization.py`` (``layer_norm``, ``rms_norm``, ``FusedLayerNorm``, ``FusedRMSNorm``) and
``bias_gelu.py`` (``bias_gelu``, ``BiasGeLU``) re-export ``dslaunch.kernels.normalization`` and
``dslaunch.kernels.bias_gelu`` (Triton on CUDA); ``op_builder/`` answers DeepSpeed's op builders with what dslaunch has (``aio.py`` is its
``AsyncIOBuilder`` path); ``random_ltd/`` re-exports random-LTD's token operations
(``dslaunch.runtime.data_pipeline.data_routing.tokens``); ``transformer.py`` (``DeepSpeedTransformerLayer``,
``DeepSpeedTransformerConfig``, also attributes of this package as in DeepSpeed) re-exports
``dslaunch.kernels.transformer``; ``sparse_attention/`` re-exports ``dslaunch.runtime.sparse_attention``
and ``dslaunch.kernels.block_sparse``.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # DeepSpeed's op table (``deepspeed.ops.__compatible_ops__``), built on first use
    if name in ("__compatible_ops__", "__installed_ops__"):
        from dslaunch.ops.op_builder import compatible_ops

        return compatible_ops()
    if name in ("DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig"):  # imported on use: torch
        from dslaunch.ops import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'deepspeed.ops' has no attribute {name!r}")
