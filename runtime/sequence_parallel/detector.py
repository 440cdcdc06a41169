"""AutoSP's detector (``deepspeed.sequence.autosp_detector``): which modules of a multimodal model
are vision attention, language-model attention and the vision-language projector.

Attention is recognised by class name, from Hugging Face transformers' names (the registries
below: DeepSpeed 0.19.8's, and transformers' own InternVL vision attention): add a model's class names to ``_VIT_ATTN_CLASSNAMES`` (with its
``_VIT_HAS_CLS_TOKEN`` entry) or ``_LLM_ATTN_CLASSNAMES`` to have it found, as DeepSpeed's docs
say. The projector is the first module (in ``named_modules`` order) whose dotted name contains
one of ``_VISION_PROJ_KEYWORDS``.

Modules already inside an AutoSP wrapper are skipped, so wrapping a model twice wraps each
attention once (DeepSpeed's detector would find the inner module again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dslaunch.runtime.sequence_parallel.vit_attention import UlyssesSPViTAttention

__all__ = ["SPModelInfo", "detect_model_sp_info"]

# Vision encoder attention classes (transformers' names), and whether each model puts a [CLS]
# token first (an unknown class counts as having one when wrapped).
_VIT_HAS_CLS_TOKEN = {
    "ViTAttention": True,
    "CLIPAttention": True,
    "SiglipAttention": False,
    "InternVisionAttention": False,
    "Qwen2VLVisionAttention": False,
    "Idefics2VisionAttention": False,
    "PaliGemmaVisionAttention": False,
    # transformers' own InternVL (DeepSpeed's "InternVisionAttention" is OpenGVLab's remote code);
    # its embeddings put a [CLS] token first, as ViT's
    "InternVLVisionAttention": True,
}
# A set users extend (DeepSpeed's documented registration point), not a view of the dict above.
_VIT_ATTN_CLASSNAMES = set(_VIT_HAS_CLS_TOKEN)

# Language-model decoder attention classes: found and reported, not wrapped.
_LLM_ATTN_CLASSNAMES = {
    "LlamaAttention",
    "MistralAttention",
    "Qwen2Attention",
    "InternLM2Attention",
    "GemmaAttention",
    "Phi3Attention",
    "GPTNeoXAttention",
    "FalconAttention",
    "MptAttention",
}

# Parts of the dotted names under which multimodal models keep their vision-language projector.
_VISION_PROJ_KEYWORDS = ("visual_projection", "mm_projector", "vision_proj", "multi_modal_projector",
                         "img_projection")


@dataclass
class SPModelInfo:
    """What ``detect_model_sp_info`` found: ``(dotted name, module)`` pairs of the vision and
    language-model attention layers, and of the outermost projector (or None)."""

    vit_attn_modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    llm_attn_modules: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    vision_projection_module: tuple[str, torch.nn.Module] | None = None


def detect_model_sp_info(model: torch.nn.Module) -> SPModelInfo:
    """The vision attention, language-model attention and projector modules of ``model``, by the
    registries' class names and keywords, in ``named_modules`` order."""
    info = SPModelInfo()
    wrapped: list[str] = []  # prefixes of AutoSP wrappers' insides
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in wrapped):
            continue
        if isinstance(module, UlyssesSPViTAttention):
            wrapped.append(f"{name}." if name else "")
            continue
        kind = type(module).__name__
        if kind in _VIT_ATTN_CLASSNAMES:
            info.vit_attn_modules.append((name, module))
        elif kind in _LLM_ATTN_CLASSNAMES:
            info.llm_attn_modules.append((name, module))
        if info.vision_projection_module is None and any(word in name for word in _VISION_PROJ_KEYWORDS):
            info.vision_projection_module = (name, module)
    return info
