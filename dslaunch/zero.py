"""``dslaunch.zero`` (DeepSpeed's ``deepspeed.zero``): the ZeRO context managers libraries use
(``Init``, ``GatheredParameters``); the stages themselves are ``dslaunch.runtime.zero``."""

from __future__ import annotations

from dslaunch.runtime.zero.contexts import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
