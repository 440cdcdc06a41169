"""``deepspeed.checkpoint.autoep_universal``: DeepSpeed's AutoEP universal-checkpoint helpers
(``dslaunch.runtime.moe.autoep_universal``: joining ZeRO-1/2 expert fragments into whole weights)."""

from dslaunch.runtime.moe.autoep_universal import consolidate_autoep_zero12_expert_states
from dslaunch.runtime.moe.autoep_universal import zero12_fragment_path as _zero12_fragment_path

__all__ = ["consolidate_autoep_zero12_expert_states", "_zero12_fragment_path"]
