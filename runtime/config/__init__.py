"""``dslaunch.runtime.config``: the ds_config, parsed once at the edge into frozen dataclasses.

- ``file.py``: reading the document (JSON/YAML, size and depth bounds).
- ``ds_config.py``: the whole config (``load_config`` -> ``DeepSpeedConfig``); ``cross_check.py``:
  the rules between its sections;
  ``batch.py``: the batch triad, completed from the sizes given or the ``elasticity`` block;
  ``client_forms.py``: what libraries write into a ds_config that a user would not (``"auto"``
  left unfilled, dotted keys); ``legacy.py``: DeepSpeed's older spellings in today's form.
- ``sections.py``: the one way a section is parsed, and the small sections (``fp16``, ``bf16``,
  ``checkpoint``, ``optimizer``/``scheduler``); ``param_schema.py``: the checkers of every value
  and of free-form ``params`` dicts.
- one module per bigger section: ``zero.py`` (``zero_optimization``, its offload sections,
  ``aio``), ``activation.py`` (``activation_checkpointing``), ``autotuning.py``,
  ``comms_logger.py``, ``elasticity.py`` (DeepSpeed's elastic batch for a world size),
  ``flops_profiler.py``, ``monitors.py`` (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``),
  ``monitor.py`` (the launcher's ``monitor`` block), ``pipeline.py``, ``tensor_parallel.py``
  (with ``partition_config.py``: its hand-written layer rules),
  ``expert_parallel.py`` (AutoEP),
  ``memory_checkpoint.py`` (dslaunch's ``memory_checkpoint`` block), ``layout_invariant.py``
  (dslaunch's ``layout_invariant`` block), ``curriculum.py`` (``curriculum_learning``),
  ``data_efficiency.py`` (``data_efficiency``: curriculum by data sampling),
  ``torch_autocast.py``, ``progressive_layer_drop.py``, ``hybrid_engine.py`` (DeepSpeed's
  ``hybrid_engine``: one engine that trains and generates), ``compression.py``
  (``compression_training``, DeepSpeed Compression's techniques).
- ``deepspeed_defaults.py``: DeepSpeed 0.19.8's own defaults (data), which the tests and the docs'
  config reference compare dslaunch's with.

Each component is handed its parsed section; nothing after ``load_config`` reads a raw dict.
Torch-free.
"""

from dslaunch.runtime.config.deepspeed_defaults import get_scalar_param
from dslaunch.runtime.config.ds_config import MAX_TIMEOUT_S, DeepSpeedConfig, load_config, with_batch
from dslaunch.runtime.config.sections import (
    Bf16Config,
    CheckpointConfig,
    Fp16Config,
    OptimizerSection,
    TypedSection,
)
from dslaunch.runtime.config.zero import ZeroConfig

# DeepSpeed's names for ds_config's optimizer "type" values (``deepspeed.runtime.config``), lowercase as
# DeepSpeed compares them; Megatron-DeepSpeed reads them. The registry (``runtime/optim``) accepts each.
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"


def get_gradient_clipping(param_dict: dict) -> object:
    """DeepSpeed's reader of a raw config's ``gradient_clipping`` (1.0 when absent)."""
    return get_scalar_param(param_dict, "gradient_clipping")


def get_log_level(param_dict: dict) -> object:
    """DeepSpeed's reader of a raw config's ``log_level`` (None when absent)."""
    return get_scalar_param(param_dict, "log_level")

__all__ = ["DeepSpeedConfig", "load_config", "with_batch", "MAX_TIMEOUT_S", "ZeroConfig", "Fp16Config", "Bf16Config",
           "CheckpointConfig", "TypedSection", "OptimizerSection", "ADAGRAD_OPTIMIZER", "ADAM_OPTIMIZER",
           "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER", "ZERO_ONE_ADAM_OPTIMIZER",
           "ONEBIT_LAMB_OPTIMIZER", "LION_OPTIMIZER", "MUON_OPTIMIZER", "get_gradient_clipping", "get_log_level"]
