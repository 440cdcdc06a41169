"""``deepspeed.sequence``: sequence parallelism (Ulysses ``DistributedAttention`` in ``layer.py``;
the vocabulary- and sequence-split losses in ``cross_entropy.py``, the LM head fused into its loss
in ``linear_cross_entropy.py``, log-probabilities, entropy and KL of vocabulary-split logits in
``vocab_parallel_ops.py``; AutoSP for vision and
multimodal models in ``auto_sp.py``, ``autosp_detector.py``, ``autosp_vit.py``, ``autosp_fusion.py``;
FPDT, ``fpdt_layer.py``, refused on use), re-exports of ``dslaunch.runtime.sequence_parallel``.
"""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
