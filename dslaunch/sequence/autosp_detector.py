"""``deepspeed.sequence.autosp_detector``: AutoSP's detector and its class-name registries
(``runtime/sequence_parallel/detector.py``; the sets are the same objects, so adding to them here
registers a model)."""

from dslaunch.runtime.sequence_parallel.detector import (
    _LLM_ATTN_CLASSNAMES,
    _VISION_PROJ_KEYWORDS,
    _VIT_ATTN_CLASSNAMES,
    _VIT_HAS_CLS_TOKEN,
    SPModelInfo,
    detect_model_sp_info,
)

__all__ = ["SPModelInfo", "detect_model_sp_info", "_VIT_ATTN_CLASSNAMES", "_VIT_HAS_CLS_TOKEN",
           "_LLM_ATTN_CLASSNAMES", "_VISION_PROJ_KEYWORDS"]
