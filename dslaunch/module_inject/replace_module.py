"""``deepspeed.module_inject.replace_module``: DeepSpeed's layer surgery for training
(``replace_transformer_layer``, ``revert_transformer_layer``, ``replace_module``), implemented in
``dslaunch.runtime.transformer_inject``."""

from dslaunch.runtime.transformer_inject import (
    replace_module,
    replace_transformer_layer,
    revert_transformer_layer,
)

__all__ = ["replace_transformer_layer", "revert_transformer_layer", "replace_module"]
