"""``deepspeed.sequence.fpdt_layer``: FPDT (fully pipelined distributed transformer for long
sequences), refused on use like the rest of sequence parallelism (``layer.SEQUENCE_PARALLEL``)."""

from dslaunch.sequence.layer import SEQUENCE_PARALLEL
from dslaunch.utils.refused import refuse

_REFUSED = ("FPDT_Attention", "FPDT_FFN", "FPDT_InputConstruct", "FPDT_LogitsLoss")
globals().update(refuse(__name__, _REFUSED, SEQUENCE_PARALLEL))

__all__ = [*_REFUSED]
