"""AutoSP (``deepspeed.sequence.auto_sp``): sequence parallelism for a vision or multimodal model
in one call.

``auto_wrap_model_for_sp(model, process_group)`` puts ``UlyssesSPViTAttention`` in place of every
vision attention layer the detector finds (``detector.py``), with the model's ``[CLS]`` rule;
language-model attention layers are reported and left alone (Hugging Face's ``hidden_states``
attention is not ``DistributedAttention``'s query/key/value interface: use
``UlyssesSPAttentionHF.register_with_transformers`` for the language model); a vision-language
projector is reported for a fusion adapter (``fusion.py``), which is not attached for you.

Usage, as DeepSpeed's::

    engine, *_ = deepspeed.initialize(model=model, config={..., "sequence_parallel_size": 2})
    auto_wrap_model_for_sp(engine, groups._get_sequence_parallel_group())

Each rank then feeds its shard of the patch sequence (``[CLS]`` first on every rank, if any).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.detector import _VIT_HAS_CLS_TOKEN, detect_model_sp_info
from dslaunch.runtime.sequence_parallel.vit_attention import UlyssesSPViTAttention
from dslaunch.utils.logging import logger

__all__ = ["auto_wrap_model_for_sp"]


def auto_wrap_model_for_sp(model: torch.nn.Module, process_group: Any) -> torch.nn.Module:
    """Wrap ``model``'s vision attention layers for the sequence group ``process_group``, in place.

    Returns:
        ``model`` itself, its vision attention layers replaced by ``UlyssesSPViTAttention``.

    Raises:
        UsageError (a ValueError, as DeepSpeed's): no attention layer of a known class; the model
            would run each rank's shard with attention over that shard only, so it is refused,
            naming the registries to extend.

    Limitations: language-model attention is not wrapped (a warning names the layers) and the
    projector's fusion adapter is yours to attach (a warning names the projector).
    """
    info = detect_model_sp_info(model)
    if not info.vit_attn_modules and not info.llm_attn_modules:
        raise UsageError("auto_wrap_model_for_sp: no attention layer of a known class in "
                         f"{type(model).__name__}; add its attention class names to _VIT_ATTN_CLASSNAMES (and "
                         "_VIT_HAS_CLS_TOKEN) or _LLM_ATTN_CLASSNAMES of deepspeed.sequence.autosp_detector")
    for name, module in info.vit_attn_modules:
        has_cls = _VIT_HAS_CLS_TOKEN.get(type(module).__name__, True)
        _replace(model, name, UlyssesSPViTAttention(module, process_group, has_cls_token=has_cls))
    if info.vit_attn_modules:
        logger.info(f"AutoSP: wrapped {len(info.vit_attn_modules)} vision attention layer(s) with "
                    "UlyssesSPViTAttention")
    if info.llm_attn_modules:
        names = [name for name, _ in info.llm_attn_modules]
        kinds = sorted({type(m).__name__ for _, m in info.llm_attn_modules})
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        logger.warning(f"AutoSP: {len(names)} language-model attention layer(s) ({', '.join(kinds)}: {shown}) left "
                       "unwrapped: their hidden_states interface is not DistributedAttention's query/key/value; "
                       "use UlyssesSPAttentionHF.register_with_transformers for the language model")
    if info.vision_projection_module is not None:
        logger.warning(f"AutoSP: vision projector '{info.vision_projection_module[0]}' found; wrap it in "
                       "LlavaFusionAdapter, InternVLFusionAdapter or Qwen2VLFusionAdapter "
                       "(deepspeed.sequence.autosp_fusion) to split the fused sequence over the group")
    if not info.vit_attn_modules:
        logger.warning(f"AutoSP: nothing wrapped in {type(model).__name__}; it is returned unchanged")
    return model


def _replace(model: torch.nn.Module, dotted: str, new: torch.nn.Module) -> None:
    if not dotted:
        raise UsageError(f"auto_wrap_model_for_sp: the model is itself a {type(model).__name__}, which cannot be "
                         "replaced in place; wrap it directly: UlyssesSPViTAttention(model, process_group)")
    parent_name, _, child = dotted.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)
