"""``deepspeed.ops.random_ltd``: random-LTD's token operations (``dropping_utils.py``), re-exported
from ``runtime/data_pipeline/data_routing/tokens.py``, which owns them (plain torch: DeepSpeed's
are its CUDA op ``RandomLTDBuilder``)."""

from dslaunch.runtime.data_pipeline.data_routing.tokens import (
    GatherTokens,
    ScatterTokens,
    bert_sample_tokens,
    gpt_sample_tokens,
)

__all__ = ["gpt_sample_tokens", "bert_sample_tokens", "GatherTokens", "ScatterTokens"]
