"""``deepspeed.sequence``: sequence parallelism (Ulysses ``DistributedAttention`` in ``layer.py``;
FPDT, ``fpdt_layer.py``, refused on use), re-exports of ``dslaunch.runtime.sequence_parallel``.
"""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
