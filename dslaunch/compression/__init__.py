"""``deepspeed.compression``: DeepSpeed Compression (``compress.py``: refused on use) and its small
module-path helpers (``helper.py``). Submodules are attributes after ``import deepspeed``.
"""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
