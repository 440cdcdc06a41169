"""``deepspeed.ops.transformer``: DeepSpeed's fused training transformer layer, refused on use."""

from dslaunch.utils.refused import Refusal, refuse

TRANSFORMER_KERNEL = Refusal("DeepSpeed's fused transformer layer kernel (DeepSpeedTransformerLayer)",
                             "use the model's own layers (torch.nn.TransformerEncoderLayer or the Hugging Face model)")

_REFUSED = ("DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig")
globals().update(refuse(__name__, _REFUSED, TRANSFORMER_KERNEL))

__all__ = ["TRANSFORMER_KERNEL", *_REFUSED]
