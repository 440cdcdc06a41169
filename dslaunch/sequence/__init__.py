"""``deepspeed.sequence``: sequence parallelism (Ulysses ``layer.DistributedAttention``; FPDT refused)."""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
