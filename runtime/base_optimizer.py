"""``deepspeed.runtime.base_optimizer``: DeepSpeed's base classes of its optimizer wrappers.

``DeepSpeedOptimizer`` is the base of every wrapper the engine puts around the torch optimizer;
``ZeROOptimizer`` that of the ZeRO ones (stages 1-3 and ``BF16_Optimizer``). Scripts and
DeepSpeed's tests ask ``isinstance(engine.optimizer, ZeROOptimizer)``; dslaunch's wrappers
(``runtime/zero/optimizer_view.py``) derive from these, so the answer is DeepSpeed's. The classes
carry no behaviour of their own.
"""

from __future__ import annotations

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]


class DeepSpeedOptimizer:
    """The base of the optimizer wrappers ``engine.optimizer`` can be (DeepSpeed's name)."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """The base of the ZeRO optimizer wrappers (stages 1-3, ``BF16_Optimizer``; DeepSpeed's name)."""
