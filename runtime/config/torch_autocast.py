"""The ds_config ``torch_autocast`` block: the engine runs each forward under ``torch.autocast``
(DeepSpeed's native mixed precision: the weights stay as they are, fp32 usually; the operations
torch deems safe run in ``dtype``).

``{"torch_autocast": {"enabled": true, "dtype": "bfloat16", "lower_precision_safe_modules":
["torch.nn.Linear", "torch.nn.Conv2d"]}}``. Torch-free: the module names are resolved by the engine
(``runtime/torch_autocast.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, describe
from dslaunch.runtime.config.sections import _opt, optional

__all__ = ["TorchAutocastConfig", "AUTOCAST_DTYPES"]

# DeepSpeed's spellings of the two half dtypes (its DtypeEnum), -> torch's name
AUTOCAST_DTYPES = {**dict.fromkeys(("bfloat16", "bf16", "bfloat", "torch.bfloat16"), "bfloat16"),
                   **dict.fromkeys(("float16", "fp16", "half", "torch.float16"), "float16")}


def _dtype(path: str, value: Any) -> str:
    if not isinstance(value, str) or value not in AUTOCAST_DTYPES:
        raise ConfigError(f"must be \"bfloat16\" or \"float16\" (or bf16/fp16), got {describe(value)}", key=path)
    return AUTOCAST_DTYPES[value]


def _class_names(path: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and "." in v for v in value):
        raise ConfigError(f"must be a list of module classes by their full names, e.g. [\"torch.nn.Linear\"], got "
                          f"{describe(value)}", key=path)
    return tuple(value)


@dataclass(frozen=True)
class TorchAutocastConfig:
    """``torch_autocast``: forwards under ``torch.autocast(dtype)``."""

    enabled: bool = _opt(False, boolean, "true or false")
    dtype: str = _opt("bfloat16", _dtype, "\"bfloat16\" or \"float16\"")
    lower_precision_safe_modules: tuple[str, ...] | None = _opt(
        None, optional(_class_names), "a list of module classes, e.g. [\"torch.nn.Linear\"] (null: Linear and Conv1d-3d)")

    UNIMPLEMENTED = {}  # noqa: RUF012
