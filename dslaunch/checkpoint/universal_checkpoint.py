"""``deepspeed.checkpoint.universal_checkpoint``: ``SubparamShape`` and loading single parameters
from a universal tag (``dslaunch.runtime.checkpoint.universal_restore``), with DeepSpeed's helpers
for AutoTP parameters (``_get_param_uc_restore_meta``, ``_resolve_autotp_partition``,
``_narrow_sub_params``: ``dslaunch.runtime.checkpoint.autotp_universal``)."""

from dslaunch.runtime.checkpoint.autotp_universal import SubparamShape
from dslaunch.runtime.checkpoint.autotp_universal import narrow_sub_params as _narrow_sub_params  # noqa: F401
from dslaunch.runtime.checkpoint.universal_restore import (
    enable_universal_checkpoint,
    load_hp_checkpoint_state,
)
from dslaunch.runtime.checkpoint.universal_restore import (  # noqa: F401
    get_param_uc_restore_meta as _get_param_uc_restore_meta,
)
from dslaunch.runtime.checkpoint.universal_restore import (  # noqa: F401
    resolve_autotp_partition as _resolve_autotp_partition,
)

__all__ = ["SubparamShape", "enable_universal_checkpoint", "load_hp_checkpoint_state"]
