"""DeepSpeed's ``deepspeed.moe`` import paths: ``layer`` (``MoE``), ``sharded_moe`` (``TopKGate``,
``MOELayer``, the gating functions), ``experts`` (``Experts``) and ``utils`` (the expert-parameter
helpers), re-exports of ``dslaunch.runtime.moe``; submodules are attributes after ``import deepspeed``."""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
