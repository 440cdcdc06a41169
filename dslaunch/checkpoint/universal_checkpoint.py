"""``deepspeed.checkpoint.universal_checkpoint``: ``SubparamShape`` and loading single parameters
from a universal tag (``dslaunch.runtime.checkpoint.universal``)."""

from dslaunch.runtime.checkpoint.universal import (
    SubparamShape,
    enable_universal_checkpoint,
    load_hp_checkpoint_state,
)

__all__ = ["SubparamShape", "enable_universal_checkpoint", "load_hp_checkpoint_state"]
