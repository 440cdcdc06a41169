"""DeepSpeed's ``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module``
section (``runtime/config/zero.py``) and its defaults, by DeepSpeed's names.
"""

from dslaunch.runtime.config.zero import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
    DEFAULT_LEAF_MODULE_NAMES,
)
from dslaunch.runtime.zero.config import DeepSpeedZeroLeafModuleConfig

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
           "DeepSpeedZeroLeafModuleConfig"]
