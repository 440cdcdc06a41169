"""``deepspeed.moe.mappings``: ``drop_tokens`` / ``gather_tokens`` over the tensor group of
``deepspeed.utils.groups.mpu`` (``dslaunch.runtime.moe.tensor_slices``)."""

from dslaunch.runtime.moe.tensor_slices import drop_tokens, gather_tokens

__all__ = ["drop_tokens", "gather_tokens"]
