"""``deepspeed.accelerator.cpu_accelerator``: DeepSpeed's ``CPU_Accelerator`` (from
``dslaunch.runtime.accelerator``)."""

from dslaunch.runtime.accelerator import CPU_Accelerator

__all__ = ["CPU_Accelerator"]
