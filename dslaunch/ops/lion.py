"""``deepspeed.ops.lion``: DeepSpeedCPULion (owned by ``dslaunch.kernels.cpu.optimizers``)."""

from dslaunch.kernels.cpu.optimizers import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
