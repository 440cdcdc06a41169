"""``deepspeed.sequence.autosp_fusion``: AutoSP's fusion adapters at the vision-language boundary
(``runtime/sequence_parallel/fusion.py``)."""

from dslaunch.runtime.sequence_parallel.fusion import (
    InternVLFusionAdapter,
    LlavaFusionAdapter,
    ModalityFusionSPAdapter,
    Qwen2VLFusionAdapter,
)

__all__ = ["ModalityFusionSPAdapter", "LlavaFusionAdapter", "InternVLFusionAdapter", "Qwen2VLFusionAdapter"]
