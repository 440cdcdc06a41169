"""``deepspeed.ops.adam``: DeepSpeedCPUAdam (owned by ``dslaunch.kernels.cpu.optimizers``) and
FusedAdam (owned by ``dslaunch.kernels.fused_adam``: the Triton kernel on CUDA)."""

from dslaunch.kernels.cpu.optimizers import DeepSpeedCPUAdam
from dslaunch.kernels.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
