"""``deepspeed.sequence.linear_cross_entropy``: a vocabulary-parallel LM head fused into its
cross-entropy (``runtime/sequence_parallel/linear_cross_entropy.py``)."""

from dslaunch.runtime.sequence_parallel.linear_cross_entropy import vocab_parallel_linear_cross_entropy

__all__ = ["vocab_parallel_linear_cross_entropy"]
