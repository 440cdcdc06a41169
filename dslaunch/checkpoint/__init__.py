"""``dslaunch.checkpoint`` (DeepSpeed's ``deepspeed.checkpoint``): reading DeepSpeed's checkpoint
layout file by file as Megatron-DeepSpeed's conversion tools do (``DeepSpeedCheckpoint``,
``ZeROCheckpoint``, the reshape helpers and descriptors, ``merge_state``, the file-name helpers),
the layout's key strings (``constants``, all of them here too as in DeepSpeed), loading single
parameters from a universal tag (``enable_universal_checkpoint``), ``clone_tensors_for_torch_save``
(``utils.py``) and the universal-checkpoint converter (``ds_to_universal.py``). DeepSpeed's module
paths, thin re-exports: ``constants.py``, ``deepspeed_checkpoint.py``, ``zero_checkpoint.py``,
``reshape_meg_2d.py``, ``reshape_3d_utils.py``, ``reshape_utils.py``, ``universal_checkpoint.py``,
and ``autoep_universal.py`` (DeepSpeed's AutoEP universal-checkpoint helpers:
``dslaunch.runtime.moe.autoep_universal``). Implementation in
``dslaunch.runtime.checkpoint``; the engine's own checkpoints are there too.
"""

from dslaunch.runtime.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from dslaunch.runtime.checkpoint.deepspeed_constants import *  # noqa: F403
from dslaunch.runtime.checkpoint.deepspeed_constants import __all__ as _CONSTANTS
from dslaunch.runtime.checkpoint.deepspeed_layout import (
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)
from dslaunch.runtime.checkpoint.deepspeed_reshape import (
    get_model_3d_descriptor,
    merge_state,
    model_3d_desc,
    reshape_meg_2d_parallel,
)
from dslaunch.runtime.checkpoint.deepspeed_zero_files import ZeROCheckpoint
from dslaunch.runtime.checkpoint.universal import SubparamShape, enable_universal_checkpoint

__all__ = ["DeepSpeedCheckpoint", "ZeROCheckpoint", "SubparamShape", "enable_universal_checkpoint",
           "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank",
           "get_model_3d_descriptor", "merge_state", "model_3d_desc", "reshape_meg_2d_parallel", *_CONSTANTS]
