"""``deepspeed.sequence.fpdt_layer``: FPDT, Ulysses with chunked (and offloaded) attention for very
long sequences: the load-balanced layout (``runtime/sequence_parallel/fpdt_input.py``), the attention
(``fpdt_attention.py``, per-block math in ``fpdt_blocks.py``), the chunked MLP and LM-head loss
(``fpdt_mlp.py``)."""

from dslaunch.runtime.sequence_parallel.fpdt_attention import (
    FPDT_Attention,
    _FPDTGPUAttentionImpl_,
    _FPDTGPUOffloadingAttentionImpl_,
)
from dslaunch.runtime.sequence_parallel.fpdt_blocks import update_out_and_lse
from dslaunch.runtime.sequence_parallel.fpdt_input import FPDT_InputConstruct
from dslaunch.runtime.sequence_parallel.fpdt_mlp import FPDT_FFN, FPDT_LogitsLoss

__all__ = ["FPDT_Attention", "FPDT_FFN", "FPDT_InputConstruct", "FPDT_LogitsLoss", "update_out_and_lse",
           "_FPDTGPUAttentionImpl_", "_FPDTGPUOffloadingAttentionImpl_"]
