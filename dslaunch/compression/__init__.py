"""``deepspeed.compression``: DeepSpeed Compression (DeepSpeed 0.19.6's library, which 0.19.8
removed; dslaunch keeps it), from ``dslaunch.runtime.compression``: ``compress.py``
(``init_compression``, ``redundancy_clean``, ``student_initialization``), ``basic_layer.py`` (the
compressing layers), ``utils.py`` (quantizers), ``scheduler.py``, ``helper.py`` (module-path
helpers, ``convert_conv1d_to_linear``).
The package's names and submodules are imported on first access.
"""

import importlib
from typing import Any

from dslaunch.utils.lazy import submodule_getattr

# DeepSpeed 0.19.6's package-level names -> the submodule that has them
_NAMES = {"init_compression": "compress", "redundancy_clean": "compress", "compression_scheduler": "scheduler",
          "convert_conv1d_to_linear": "helper"}
_submodule = submodule_getattr(__name__)

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    return _submodule(name)
