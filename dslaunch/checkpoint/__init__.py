"""``dslaunch.checkpoint`` (DeepSpeed's ``deepspeed.checkpoint``): helpers for saving what the
engine holds with ``torch.save`` (``utils.py``: ``clone_tensors_for_torch_save``), and the
universal-checkpoint converter (``ds_to_universal.py``). The engine's own checkpoints are
``dslaunch.runtime.checkpoint``.
"""

from dslaunch.runtime.checkpoint.universal import (
    ORIGINAL_VOCAB_SIZE,
    PADDED_VOCAB_SIZE,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)

__all__ = ["ORIGINAL_VOCAB_SIZE", "PADDED_VOCAB_SIZE", "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0",
           "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS", "PIPELINE_REPLICATED_PARAMETER_PATTERNS",
           "TP_REPLICATED_PARAMETER_PATTERNS", "UNIVERSAL_CHECKPOINT_INFO", "UNIVERSAL_CHECKPOINT_VERSION_KEY",
           "UNIVERSAL_CHECKPOINT_VERSION_VALUE", "VOCABULARY_PARAMETER_PATTERNS"]
