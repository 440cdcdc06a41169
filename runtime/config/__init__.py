"""``dslaunch.runtime.config``: the ds_config, parsed once at the edge into frozen dataclasses.

Owns reading the document (``file.py``: JSON/YAML, size and depth bounds), the sections as
typed frozen dataclasses and the one way a section is parsed (``sections.py``), the checkers of
every value and of free-form ``params`` dicts (``param_schema.py``), DeepSpeed's elastic batch
for a world size (``elasticity.py``), the launcher's ``monitor`` block (``monitor.py``), and the
whole config with its batch triad and cross-checks (``ds_config.py``: ``load_config`` -> ``DeepSpeedConfig``).
Each component is handed its parsed section; nothing after ``load_config`` reads a raw dict.
Torch-free.
"""

from dslaunch.runtime.config.ds_config import MAX_TIMEOUT_S, DeepSpeedConfig, load_config, with_batch
from dslaunch.runtime.config.sections import (
    Bf16Config,
    CheckpointConfig,
    Fp16Config,
    OptimizerSection,
    TypedSection,
    ZeroConfig,
)

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

__all__ = ["DeepSpeedConfig", "load_config", "with_batch", "MAX_TIMEOUT_S", "ZeroConfig", "Fp16Config", "Bf16Config",
           "CheckpointConfig", "TypedSection", "OptimizerSection", "ADAGRAD_OPTIMIZER", "ADAM_OPTIMIZER",
           "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER", "ZERO_ONE_ADAM_OPTIMIZER",
           "ONEBIT_LAMB_OPTIMIZER", "LION_OPTIMIZER", "MUON_OPTIMIZER"]
