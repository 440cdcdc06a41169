"""``deepspeed.zero`` under dslaunch's name: ``import dslaunch.zero`` / ``dslaunch.zero.Init(...)``.

``Init``, ``GatheredParameters``, ``ZeroParamStatus``, ``register_external_parameter`` and
``unregister_external_parameter``, defined in ``dslaunch.runtime.zero.partition_parameters``
(DeepSpeed's path for them too), and ``MiCS_Init`` (refused on use: ``dslaunch.runtime.zero.mics``).
Importing this module imports torch.
"""

from dslaunch.runtime.zero.mics import MiCS_Init
from dslaunch.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "MiCS_Init"]
