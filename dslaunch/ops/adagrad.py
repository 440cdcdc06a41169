"""``deepspeed.ops.adagrad``: DeepSpeedCPUAdagrad (owned by ``dslaunch.kernels.cpu.optimizers``)."""

from dslaunch.kernels.cpu.optimizers import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
