"""``deepspeed.ops.adam``: DeepSpeedCPUAdam, FusedAdam (owned by ``dslaunch.kernels.cpu.optimizers``)."""

from dslaunch.kernels.cpu.optimizers import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
