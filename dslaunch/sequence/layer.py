"""``deepspeed.sequence.layer``: Ulysses sequence parallelism's attention, refused on use."""

from dslaunch.utils.refused import Refusal, refused_class

SEQUENCE_PARALLEL = Refusal("sequence parallelism (DeepSpeed-Ulysses DistributedAttention)",
                            "shard the batch (data parallel/ZeRO) or the layers (deepspeed.pipe) instead")

DistributedAttention = refused_class(__name__, "DistributedAttention", SEQUENCE_PARALLEL)

__all__ = ["SEQUENCE_PARALLEL", "DistributedAttention"]
