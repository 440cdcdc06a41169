"""``deepspeed.sequence``: sequence parallelism (Ulysses), refused on use (``layer``)."""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
