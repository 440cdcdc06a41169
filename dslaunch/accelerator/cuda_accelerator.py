"""``deepspeed.accelerator.cuda_accelerator``: DeepSpeed's ``CUDA_Accelerator`` (from
``dslaunch.runtime.accelerator``)."""

from dslaunch.runtime.accelerator import CUDA_Accelerator

__all__ = ["CUDA_Accelerator"]
