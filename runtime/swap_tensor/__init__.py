"""DeepSpeed's ``deepspeed.runtime.swap_tensor`` path: ``MIN_SWAPPABLE_BYTES``.

DeepSpeed swaps no tensor smaller than this to NVMe; its tests size models with it. dslaunch's
swap file (``runtime/zero/offload/swap.py``) takes tensors of any size; the constant keeps
DeepSpeed's value so that code sizing tensors with it gets the same sizes.
"""

__all__ = ["MIN_SWAPPABLE_BYTES"]

MIN_SWAPPABLE_BYTES = 1 << 20
