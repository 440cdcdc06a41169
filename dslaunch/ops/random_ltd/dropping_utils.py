"""``deepspeed.ops.random_ltd.dropping_utils``: a re-export of
``runtime/data_pipeline/data_routing/tokens.py`` (drawing, gathering and scattering tokens)."""

from dslaunch.runtime.data_pipeline.data_routing.tokens import (
    GatherTokens,
    ScatterTokens,
    bert_sample_tokens,
    gpt_sample_tokens,
)

__all__ = ["gpt_sample_tokens", "bert_sample_tokens", "GatherTokens", "ScatterTokens"]
