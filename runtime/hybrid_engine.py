"""DeepSpeed's ``DeepSpeedHybridEngine`` (``hybrid_engine.enabled``): the training engine that also
generates (DeepSpeed-Chat's RLHF actor: ``actor.generate(prompts, ...)`` between PPO steps).

``generate`` is the model's own ``generate`` (Hugging Face's), run on the trained weights. At ZeRO-3
with ``pin_parameters`` (the default) every partitioned parameter is gathered once for the whole
call and released after it, instead of module by module at every generated token; elsewhere the
parameters are whole already, or gathered per module as in any forward. Everything else is
``DeepSpeedEngine``'s. See ``runtime/config/hybrid_engine.py`` for the keys and what is refused.
"""

from __future__ import annotations

from typing import Any

from dslaunch.runtime.engine import DeepSpeedEngine

__all__ = ["DeepSpeedHybridEngine"]


class DeepSpeedHybridEngine(DeepSpeedEngine):
    """``DeepSpeedEngine`` whose ``generate`` keeps a ZeRO-3 model whole for the call."""

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """``self.module.generate(*inputs, **kwargs)``.

        collective: at ZeRO-3 with ``pin_parameters``, call on every rank (the gather is), with
        ``synced_gpus=True`` where ranks may stop after different lengths, as Hugging Face asks.
        """
        if self.zero_optimization_stage() == 3 and self._config.hybrid_engine.pin_parameters:
            from dslaunch.runtime.zero.partition_parameters import GatheredParameters

            with GatheredParameters(list(self.module.parameters())):
                return self.module.generate(*inputs, **kwargs)
        return self.module.generate(*inputs, **kwargs)
