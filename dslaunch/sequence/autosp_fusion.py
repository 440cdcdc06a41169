"""``deepspeed.sequence.autosp_fusion``: AutoSP's fusion adapters at the vision-language boundary
(``runtime/sequence_parallel/fusion.py``)."""

from dslaunch.runtime.sequence_parallel.fusion import (
    _DEFAULT_IMAGE_TOKEN_ID,
    InternVLFusionAdapter,
    LlavaFusionAdapter,
    ModalityFusionSPAdapter,
    Qwen2VLFusionAdapter,
)

__all__ = ["ModalityFusionSPAdapter", "LlavaFusionAdapter", "InternVLFusionAdapter", "Qwen2VLFusionAdapter",
           "_DEFAULT_IMAGE_TOKEN_ID"]
