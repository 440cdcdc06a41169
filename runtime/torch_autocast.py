"""``deepspeed.runtime.torch_autocast``: the ds_config's ``torch_autocast`` block at run time.

With it enabled the engine runs every forward (the pipeline engine each stage's) under
``torch.autocast(device, dtype)``, whatever autocast the caller opened around it, as DeepSpeed's:
the weights keep their dtype (fp32 master and model weights, unless ``bf16``/``fp16`` is on too, as
in DeepSpeed's fp32-adapter-on-bf16-base case), the operations torch deems safe run in ``dtype``.
With ``"float16"`` the loss is scaled dynamically (the ``fp16`` block's defaults; DeepSpeed uses
torch's ``GradScaler``): fp16 activation gradients would underflow.

Differences from DeepSpeed: ``lower_precision_safe_modules`` only names which parameters DeepSpeed
would communicate in ``dtype``. dslaunch checks the names (each must import) and reduces every
gradient in the parameters' own dtype: exact, twice DeepSpeed's bytes for those parameters; so
``get_comm_dtype(p)`` answers ``p.dtype`` (no ``comm_dtype`` attribute is set).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.torch_autocast import TorchAutocastConfig

__all__ = ["LOWER_PRECISION_SAFE_MODULES", "PARAM_COMM_DTYPE_ATTR_NAME", "Autocast", "get_comm_dtype",
           "has_comm_dtype", "get_all_comm_dtypes", "sort_dtypes", "get_default_autocast_lower_precision_modules",
           "safe_module_classes", "scales_loss"]

LOWER_PRECISION_SAFE_MODULES = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"
_KEY = "torch_autocast.lower_precision_safe_modules"


def get_default_autocast_lower_precision_modules() -> list[str]:
    return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def has_comm_dtype(param: torch.nn.Parameter) -> bool:
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.nn.Parameter) -> torch.dtype:
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable[torch.nn.Parameter]) -> set[torch.dtype]:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable[torch.dtype]) -> list[torch.dtype]:
    return sorted(dtypes, key=str)


def safe_module_classes(names: Iterable[str] | None) -> tuple[type, ...]:
    """The classes ``lower_precision_safe_modules`` names (None: DeepSpeed's default list).

    Raises:
        ConfigError: a name that does not import as a class, naming the key and the name.
    """
    if names is None:
        return tuple(LOWER_PRECISION_SAFE_MODULES)
    found = []
    for name in names:
        package, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), attr)
        except (ImportError, AttributeError, ValueError) as err:
            raise ConfigError(f"{name[:200]} does not import ({type(err).__name__}); name a module class by its "
                              "full name, e.g. torch.nn.Linear", key=_KEY) from None
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise ConfigError(f"{name[:200]} is not a torch.nn.Module class", key=_KEY)
        found.append(cls)
    return tuple(found)


@dataclass(frozen=True)
class Autocast:
    """The forwards' autocast of one engine: ``with engine_autocast(): ...``; a no-op when off."""

    device_type: str
    dtype: torch.dtype | None  # None: off

    @classmethod
    def from_config(cls, config: TorchAutocastConfig, device: torch.device) -> Autocast:
        if not config.enabled:
            return cls(device.type, None)
        safe_module_classes(config.lower_precision_safe_modules)  # a bad name fails at initialize
        return cls(device.type, getattr(torch, config.dtype))

    def __call__(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


def scales_loss(config: TorchAutocastConfig) -> bool:
    """float16 autocast needs a loss scale (activation gradients underflow in fp16)."""
    return config.enabled and config.dtype == "float16"
