"""``dslaunch.accelerator`` (DeepSpeed's ``deepspeed.accelerator``): ``get_accelerator()``.

The device a rank trains on, behind DeepSpeed's accelerator interface, for the scripts and
libraries that ask it (DeepSpeed's tutorials, accelerate, transformers): CUDA when torch sees a
GPU, else CPU, the same choice ``dslaunch.runtime.dist`` makes for the process group. Also
``DS_ACCELERATOR=cpu|cuda`` as DeepSpeed reads it. Implemented in ``dslaunch.runtime.accelerator``;
``real_accelerator.py`` is DeepSpeed's module path of ``get_accelerator`` and ``set_accelerator``,
``cpu_accelerator.py`` and ``cuda_accelerator.py`` of its two accelerator classes.
"""

from __future__ import annotations

from dslaunch.runtime.accelerator import (
    Accelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = ["Accelerator", "get_accelerator", "set_accelerator", "is_current_accelerator_supported"]
