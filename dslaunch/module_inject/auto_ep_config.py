"""``deepspeed.module_inject.auto_ep_config``: the ``expert_parallel`` block's config class
(``AutoEPConfig``, dslaunch's frozen ``ExpertParallelConfig``), its parser, the presets, DeepSpeed's
record of a detected block (``MoELayerSpec``: ``dslaunch.runtime.moe.autoep_spec``) and
``validate_autoep_config`` (the block against the job's sizes, ``dslaunch.runtime.moe.folding``)."""

from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig as AutoEPConfig
from dslaunch.runtime.config.expert_parallel import parse_autoep_config
from dslaunch.runtime.moe.autoep_presets import PRESETS as PRESET_MODELS
from dslaunch.runtime.moe.autoep_spec import MoELayerSpec
from dslaunch.runtime.moe.folding import validate_autoep_config

__all__ = ["AutoEPConfig", "MoELayerSpec", "parse_autoep_config", "PRESET_MODELS", "validate_autoep_config"]
