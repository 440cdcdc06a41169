"""``deepspeed.sequence.cross_entropy``: cross-entropy over vocabulary-split (and sequence-split)
logits, DeepSpeed's API (``runtime/sequence_parallel/cross_entropy.py``)."""

from dslaunch.runtime.sequence_parallel.cross_entropy import (
    VocabParallelCausalLMLoss,
    VocabParallelCrossEntropyLoss,
    configure_vocab_parallel_loss,
    validate_vocab_parallel_loss,
    vocab_parallel_cross_entropy,
    vocab_sequence_parallel_cross_entropy,
)

__all__ = ["vocab_parallel_cross_entropy", "vocab_sequence_parallel_cross_entropy", "VocabParallelCrossEntropyLoss",
           "VocabParallelCausalLMLoss", "configure_vocab_parallel_loss", "validate_vocab_parallel_loss"]
