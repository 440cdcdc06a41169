"""DeepSpeed's ``deepspeed.ops`` import paths, for scripts written against DeepSpeed.

Thin facades only: ``adam`` (``DeepSpeedCPUAdam``, ``FusedAdam``), ``adagrad``
(``DeepSpeedCPUAdagrad``) and ``lion`` (``DeepSpeedCPULion``) re-export the classes of
``dslaunch.kernels.cpu.optimizers``, which own them.
"""
