"""``deepspeed.sequence.vocab_parallel_ops``: log-probabilities, entropy and KL divergence of
vocabulary-split logits (``runtime/sequence_parallel/vocab_parallel_ops.py``)."""

from dslaunch.runtime.sequence_parallel.vocab_parallel_ops import (
    vocab_parallel_entropy,
    vocab_parallel_kl_div,
    vocab_parallel_logprobs,
)

__all__ = ["vocab_parallel_logprobs", "vocab_parallel_entropy", "vocab_parallel_kl_div"]
