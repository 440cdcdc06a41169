"""``deepspeed.runtime.bf16_optimizer``: ``BF16_Optimizer``, ``engine.optimizer`` for bf16 with fp32
gradient sums at ZeRO stage 1 (and bf16 pipelines at stage 0), as DeepSpeed's
(``runtime/zero/optimizer_view.py``); making one by hand is refused."""

from dslaunch.runtime.zero.optimizer_view import BF16_Optimizer

__all__ = ["BF16_Optimizer"]
