"""``deepspeed.utils.zero_to_fp32`` under dslaunch's name.

A script doing ``from deepspeed.utils.zero_to_fp32 import ...`` works with ``dslaunch`` in place
of ``deepspeed``; ``python -m dslaunch.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT`` is the same as
``dslaunch zero-to-fp32``. The code lives in ``dslaunch.runtime.checkpoint.export``.
"""

from dslaunch.runtime.checkpoint.export import (
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
    run_as_script,
)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_state_dict",
           "convert_zero_checkpoint_to_fp32_state_dict", "load_state_dict_from_zero_checkpoint", "main"]

if __name__ == "__main__":
    run_as_script()
