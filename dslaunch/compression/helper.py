"""``deepspeed.compression.helper``: getting and setting a submodule by dotted name
(``dslaunch.utils.module_utils``, where DeepSpeed 0.19.8 moved them), GPT-2's ``Conv1D`` turned into
``nn.Linear`` and the compressible-layer test (``dslaunch.runtime.compression.compress``)."""

from __future__ import annotations

from dslaunch.runtime.compression.compress import convert_conv1d_to_linear, is_module_compressible
from dslaunch.utils.module_utils import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr", "convert_conv1d_to_linear", "is_module_compressible"]
