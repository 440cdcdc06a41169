"""Mixture of experts with expert parallelism (DeepSpeed's ``deepspeed.moe``).

``gate`` routes tokens (``TopKGate``, top-1/top-2/top-k gating), ``experts`` holds a rank's expert
copies, ``layer`` has ``MoE`` and the all-to-all ``MOELayer``, ``utils`` the expert-parameter
helpers. ``dslaunch/moe/`` re-exports them at DeepSpeed's import paths.
"""

from dslaunch.runtime.moe.experts import Experts
from dslaunch.runtime.moe.gate import TopKGate
from dslaunch.runtime.moe.layer import MoE, MOELayer

__all__ = ["MoE", "MOELayer", "TopKGate", "Experts"]
