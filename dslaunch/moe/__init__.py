"""DeepSpeed's ``deepspeed.moe`` import paths: ``layer.py`` (``MoE``), ``sharded_moe.py``
(``TopKGate``, ``MOELayer``, the gating functions), ``experts.py`` (``Experts``), ``utils.py``
(the expert-parameter helpers), ``fused_expert_layout.py`` (fused expert weights' layout) and
``mappings.py`` (``drop_tokens`` / ``gather_tokens`` over the tensor slices), re-exports of
``dslaunch.runtime.moe``; submodules are attributes
after ``import deepspeed``.
"""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
