"""``deepspeed.checkpoint.autoep_universal``: the folding record of AutoEP folded with AutoTP
(``make_folding_metadata``, ``validate_folding_metadata``: ``dslaunch.runtime.moe.folding_metadata``)
and DeepSpeed's AutoEP universal-checkpoint helpers, refused in one line
(``dslaunch.runtime.moe.autoep_universal``: dslaunch loads an AutoEP tag at another ``autoep_size``
without conversion)."""

from dslaunch.runtime.moe.autoep_universal import (
           consolidate_autoep_expert_files,
           consolidate_autoep_zero12_expert_states,
)
from dslaunch.runtime.moe.autoep_universal import zero12_fragment_path as _zero12_fragment_path
from dslaunch.runtime.moe.folding_metadata import make_folding_metadata, validate_folding_metadata

__all__ = ["consolidate_autoep_expert_files", "consolidate_autoep_zero12_expert_states", "_zero12_fragment_path",
           "make_folding_metadata", "validate_folding_metadata"]
