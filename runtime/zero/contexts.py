"""DeepSpeed's ZeRO-3 context managers, ``zero.Init`` and ``zero.GatheredParameters``, below stage 3.

Libraries reach for them by name (transformers builds models under ``zero.Init`` when its config
says stage 3; TRL and accelerate gather parameters around generation). Until stage 3 exists:

- ``GatheredParameters`` is a no-op, as DeepSpeed's is for parameters ZeRO-3 does not partition:
  at stages 0-2 every rank holds every parameter whole.
- ``Init`` with ``enabled=False`` (what callers pass below stage 3) is a no-op; enabled, it is a
  ``UsageError`` naming what is missing, instead of building a model no engine here can train.

Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
from typing import Any

from dslaunch.errors import UsageError

__all__ = ["GatheredParameters", "Init"]


class GatheredParameters(contextlib.nullcontext):
    """No-op below stage 3: the parameters are already whole on every rank."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True):
        super().__init__()


class Init(contextlib.nullcontext):
    """``deepspeed.zero.Init``: partition parameters as modules are built (ZeRO-3).

    Raises:
        UsageError: when enabled: ZeRO-3 is not implemented by dslaunch yet.
    """

    def __init__(self, module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None,
                 **kwargs: Any):
        if enabled:
            raise UsageError("deepspeed.zero.Init(): ZeRO stage 3 is not implemented by dslaunch yet; use "
                             "zero_optimization.stage 0, 1 or 2")
        super().__init__()
