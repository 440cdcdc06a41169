"""Mixture of experts with expert parallelism (DeepSpeed's ``deepspeed.moe``).

``gate.py`` routes tokens (``TopKGate``, top-1/top-2/top-k gating), ``experts.py`` holds a rank's
expert copies, ``layer.py`` has ``MoE`` and the all-to-all ``MOELayer``, ``utils.py`` the
expert-parameter helpers (``expert_group_name``: the expert group ZeRO reduces a parameter over),
``layout_invariant.py`` the experts' per-source-block calls under ``layout_invariant``,
``tensor_slices.py`` the split of the slots over tensor slices beside the layer (an mpu with
tensor parallelism).
AutoEP (the ds_config ``expert_parallel`` block): ``autoep.py`` converts a Hugging Face MoE model's
blocks into ``MOELayer``s at ``initialize``, ``autoep_presets.py`` finds the blocks (``autoep_spec.py``:
DeepSpeed's record of one, accepted too),
``grouped_experts.py`` holds a rank's slice of the fused expert weights (``fused_layout.py`` tells
their layout from the shapes), ``autoep_dispatch.py``
sends tokens to them in exact counts, and ``autoep_state.py`` saves and loads them in the Hugging
Face model's layout; ``autoep_universal.py`` has DeepSpeed's universal-checkpoint helpers for
AutoEP (joining ZeRO-1/2 expert fragments). AutoEP folded with AutoTP: ``folding.py`` has the rank
tables and config rules (DeepSpeed's ``auto_ep_folding``), ``autoep_folded.py`` splits a converted
block's routes over the tensor slices, ``folding_metadata.py`` is the folding record of its checkpoints.
``dslaunch/moe/`` re-exports them at DeepSpeed's import paths.
"""

from dslaunch.runtime.moe.experts import Experts
from dslaunch.runtime.moe.gate import TopKGate
from dslaunch.runtime.moe.layer import MoE, MOELayer
from dslaunch.runtime.moe.utils import expert_group_name

__all__ = ["MoE", "MOELayer", "TopKGate", "Experts", "expert_group_name"]
