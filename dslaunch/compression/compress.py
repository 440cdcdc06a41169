"""``deepspeed.compression.compress``: DeepSpeed Compression's entry points, refused on use."""

from dslaunch.utils.refused import Refusal, refuse

COMPRESSION = Refusal("DeepSpeed Compression (quantization-aware training, pruning, layer reduction)",
                      "use torch.ao.quantization or torch.nn.utils.prune on the model before deepspeed.initialize")

_REFUSED = ("init_compression", "redundancy_clean", "student_initialization")
globals().update(refuse(__name__, _REFUSED, COMPRESSION))

__all__ = ["COMPRESSION", *_REFUSED]
