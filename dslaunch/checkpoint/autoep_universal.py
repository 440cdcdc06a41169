"""``deepspeed.checkpoint.autoep_universal``: DeepSpeed's AutoEP universal-checkpoint helpers
(``dslaunch.runtime.moe.autoep_universal``: joining ZeRO-1/2 expert fragments into whole weights;
the consolidation of folded expert files is refused in one line) and the folding record of AutoEP
folded with AutoTP (``make_folding_metadata``, ``validate_folding_metadata``:
``dslaunch.runtime.moe.folding_metadata``)."""

from dslaunch.runtime.moe.autoep_universal import (
    consolidate_autoep_expert_files,
    consolidate_autoep_zero12_expert_states,
)
from dslaunch.runtime.moe.autoep_universal import zero12_fragment_path as _zero12_fragment_path
from dslaunch.runtime.moe.folding_metadata import make_folding_metadata, validate_folding_metadata

__all__ = ["consolidate_autoep_expert_files", "consolidate_autoep_zero12_expert_states", "_zero12_fragment_path",
           "make_folding_metadata", "validate_folding_metadata"]
