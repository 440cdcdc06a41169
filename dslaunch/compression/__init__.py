"""``deepspeed.compression``: DeepSpeed Compression (``compress``: refused on use) and its small
module-path helpers (``helper``). Submodules are attributes after ``import deepspeed``."""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
