"""``deepspeed.utils.zero_to_fp32`` under dslaunch's name.

A script doing ``from deepspeed.utils.zero_to_fp32 import ...`` works with ``dslaunch`` in place
of ``deepspeed``; ``python -m dslaunch.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT`` is the same as
``dslaunch zero-to-fp32``. The code lives in ``dslaunch.runtime.checkpoint.export`` (the file
listings ``get_optim_files``/``get_model_state_files`` in
``dslaunch.runtime.checkpoint.deepspeed_layout``), imported on
first use of a name: run as a script, the arguments are checked (``dslaunch.runtime.export_cli``)
before torch is imported, so a mistake is answered at once.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORT = "dslaunch.runtime.checkpoint.export"
_LAYOUT = "dslaunch.runtime.checkpoint.deepspeed_layout"
# DeepSpeed's names and their modules, resolved on first access (``__getattr__``)
_NAMES = {"get_fp32_state_dict_from_zero_checkpoint": _EXPORT, "convert_zero_checkpoint_to_state_dict": _EXPORT,
          "convert_zero_checkpoint_to_fp32_state_dict": _EXPORT, "load_state_dict_from_zero_checkpoint": _EXPORT,
          "main": _EXPORT, "get_optim_files": _LAYOUT, "get_model_state_files": _LAYOUT}

__all__ = [*_NAMES]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))


if __name__ == "__main__":
    from dslaunch.runtime.export_cli import run_as_script

    run_as_script()
