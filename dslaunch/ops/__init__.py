"""DeepSpeed's ``deepspeed.ops`` import paths, for scripts written against DeepSpeed.

Thin facades only: ``adam`` (``DeepSpeedCPUAdam``, ``FusedAdam``), ``adagrad``
(``DeepSpeedCPUAdagrad``) and ``lion`` (``DeepSpeedCPULion``) re-export the classes of
``dslaunch.kernels.cpu.optimizers`` and ``dslaunch.kernels.fused_adam``, which own them;
``normalization`` (``layer_norm``, ``rms_norm``, ``FusedLayerNorm``, ``FusedRMSNorm``) and
``bias_gelu`` (``bias_gelu``, ``BiasGeLU``) call the ops of ``dslaunch.kernels`` (Triton on CUDA).
"""
