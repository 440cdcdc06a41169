"""``deepspeed.sequence``: sequence parallelism (Ulysses ``DistributedAttention`` in ``layer.py``;
the vocabulary- and sequence-split losses in ``cross_entropy.py``; AutoSP for vision and
multimodal models in ``auto_sp.py``, ``autosp_detector.py``, ``autosp_vit.py``, ``autosp_fusion.py``;
FPDT, ``fpdt_layer.py``, refused on use), re-exports of ``dslaunch.runtime.sequence_parallel``.
"""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
