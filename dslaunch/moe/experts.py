"""``deepspeed.moe.experts``: ``Experts``, a rank's expert copies (``dslaunch.runtime.moe.experts``)."""

from dslaunch.runtime.moe.experts import Experts

__all__ = ["Experts"]
