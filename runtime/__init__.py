"""The training runtime: config, engine, ZeRO stages, precision, optimizers, checkpoints.

Submodules are attributes after a bare import (``dslaunch.runtime.lr_schedules``), imported on
first access, as DeepSpeed's ``deepspeed.runtime`` offers them.
"""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
