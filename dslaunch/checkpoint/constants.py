"""``deepspeed.checkpoint.constants``: the key and file-name strings of DeepSpeed's checkpoints
(``dslaunch.runtime.checkpoint.deepspeed_constants``) and the ``FOLDING_*`` keys of AutoEP folded
with AutoTP (``dslaunch.runtime.moe.folding_metadata``)."""

from dslaunch.runtime.checkpoint.deepspeed_constants import *  # noqa: F403
from dslaunch.runtime.checkpoint.deepspeed_constants import __all__ as _checkpoint_names
from dslaunch.runtime.moe import folding_metadata as _folding

_folding_names = [name for name in _folding.__all__ if name.startswith("FOLDING_")]
globals().update({name: getattr(_folding, name) for name in _folding_names})
__all__ = [*_checkpoint_names, *_folding_names]
