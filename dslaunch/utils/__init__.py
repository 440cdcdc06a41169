"""``dslaunch.utils``: the ``deepspeed.utils`` import paths scripts and libraries use, and the small
utilities both the launcher and the runtime need (so the runtime never imports the launcher).

- DeepSpeed's paths: ``zero_to_fp32.py`` and ``zero_to_torch.py``, ``logging.py`` (``logger``,
  ``log_dist``), ``groups.py`` (this rank's data/model/expert groups), ``z3_leaf_module.py`` (the ZeRO-3 leaf flags),
  ``comms_logging.py`` (the comms logger's records and table), ``timer.py``, ``numa.py``
  (``--bind_core_list`` syntax), ``torch.py`` (``required_torch_version``), ``module_utils.py``
  (``recursive_getattr/setattr``), ``nvtx.py`` (``instrument_w_nvtx``), ``tensor_fragment.py``,
  ``bwc.py`` (an mpu's axes under any of its names), ``init_on_device.py`` (``OnDevice``); the
  ZeRO ``safe_get/set_full_*`` and ``safe_get/set_local_*`` names resolve to ``dslaunch.runtime.zero``.
- shared by launcher and runtime: ``ports.py`` (``free_port``), ``beat.py`` (the heartbeat wire
  format), ``restart.py`` (the restart variables), ``hostlist.py`` (host names, SLURM hostlists),
  ``private_cache.py`` (owner-only caches), ``refused.py`` (DeepSpeed names dslaunch refuses on
  use), ``lazy.py`` (submodules imported on first access).

Submodules and names are imported on first access, so ``import dslaunch.utils`` never imports torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# ``z3_leaf_module`` is not among them: as in DeepSpeed, that name is the function of the same name.
_SHADOWED = frozenset({"z3_leaf_module"})
_SUBMODULES = ("beat", "bwc", "groups", "hostlist", "init_on_device", "logging", "module_utils", "numa", "nvtx", "ports",
               "refused", "restart",
               "tensor_fragment", "timer", "torch", "zero_to_fp32", "zero_to_torch")

# name -> module that defines it (DeepSpeed's ``from deepspeed.utils import logger``)
_NAMES = {
    **dict.fromkeys(("logger", "log_dist", "log_dist_once", "print_dist"), f"{__name__}.logging"),
    **dict.fromkeys(("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
                     "z3_leaf_module", "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name",
                     "set_z3_leaf_modules_by_suffix"), "dslaunch.runtime.zero.leaf_modules"),
    # the ZeRO state of one parameter, at any stage (import torch on first access)
    **dict.fromkeys(("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                     "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
                     "safe_update_full_grad_vectorized"), "dslaunch.runtime.zero.full_state"),
    **dict.fromkeys(("safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
                     "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"),
                    "dslaunch.runtime.zero.local_state"),
    "RepeatingLoader": "dslaunch.runtime.dataloader",  # deepspeed.utils.RepeatingLoader
    **dict.fromkeys(("SynchronizedWallClockTimer", "NoopTimer"), "dslaunch.runtime.timers"),
    "OnDevice": "dslaunch.runtime.zero.partition_parameters",  # deepspeed.utils.OnDevice
    "instrument_w_nvtx": f"{__name__}.nvtx",
    "fragment_address": "dslaunch.runtime.zero.fragment",
}

__all__ = [*_SUBMODULES, *_NAMES]


class _Package(types.ModuleType):
    """Keeps ``_SHADOWED`` names for their functions: importing the submodule of the same name
    (``import dslaunch.utils.z3_leaf_module``) would otherwise bind the module there, and
    ``from deepspeed.utils import z3_leaf_module`` must give the function, as DeepSpeed's does."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'dslaunch.utils' has no attribute {name!r}")
