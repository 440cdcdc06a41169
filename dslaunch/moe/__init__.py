"""DeepSpeed's ``deepspeed.moe`` import paths: ``layer`` (``MoE``, refused on use: dslaunch has no
expert parallelism) and ``utils`` (the parameter helpers, with their dense-model answers). Both are
re-exports of ``dslaunch.runtime.moe``; submodules are attributes after ``import deepspeed``."""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
