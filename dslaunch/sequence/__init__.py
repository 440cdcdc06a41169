"""``deepspeed.sequence``: sequence parallelism (Ulysses ``DistributedAttention`` in ``layer.py``;
the vocabulary- and sequence-split losses in ``cross_entropy.py``; FPDT, ``fpdt_layer.py``, refused
on use), re-exports of ``dslaunch.runtime.sequence_parallel``.
"""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
