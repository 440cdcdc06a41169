"""``deepspeed.sequence.fpdt_layer``: FPDT (fully pipelined distributed transformer for long
sequences), refused on use; Ulysses (``deepspeed.sequence.layer.DistributedAttention``) is there."""

from dslaunch.utils.refused import Refusal, refuse

FPDT = Refusal("FPDT (the fully pipelined distributed transformer: chunked, offloaded Ulysses attention)",
               "use deepspeed.sequence.layer.DistributedAttention (Ulysses) with sequence_parallel_size")

_REFUSED = ("FPDT_Attention", "FPDT_FFN", "FPDT_InputConstruct", "FPDT_LogitsLoss")
globals().update(refuse(__name__, _REFUSED, FPDT))

__all__ = [*_REFUSED]
