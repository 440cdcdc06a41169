"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: accelerate imports these when its
``parallelism_config`` asks for DeepSpeed's sequence parallelism; refused on use
(``dslaunch.sequence.layer.SEQUENCE_PARALLEL``)."""

from dslaunch.sequence.layer import SEQUENCE_PARALLEL
from dslaunch.utils.refused import refuse

_REFUSED = ("UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter")
globals().update(refuse(__name__, _REFUSED, SEQUENCE_PARALLEL))

__all__ = [*_REFUSED]
