"""DeepSpeed's ``deepspeed.runtime.zero.mics``: MiCS, refused on use.

MiCS shards ZeRO-3 state within groups of ``mics_shard_size`` ranks and replicates it across them;
dslaunch has no MiCS, and DeepSpeed 0.19.8 removed it (its config keys ``zero_optimization.mics_shard_size``
and ``mics_hierarchical_params_gather`` are refused saying so).
"""

from dslaunch.utils.refused import Refusal, refuse

MICS = Refusal("MiCS (ZeRO-3 sharded within groups of mics_shard_size ranks, replicated across them)",
               "use deepspeed.zero.Init with ZeRO stage 3 (zero_hpz_partition_size keeps a node-local "
               "secondary shard for the gathers)")

_REFUSED = ("MiCS_Init", "MiCS_Optimizer", "MiCS_Offload")
globals().update(refuse(__name__, _REFUSED, MICS))

__all__ = ["MICS", *_REFUSED]
