"""The compression scheduler (``deepspeed.compression.scheduler.compression_scheduler``).

The engine builds one from the ds_config and calls ``step()`` after every applied optimizer step
(and ``step(step_zero_check=True)`` before the first forwards): from its ``schedule_offset`` on,
each technique's layers get their ``*_enabled`` flag, so masks and fake-quantization start acting
at the configured step. Sparse pruning also stops being switched on after ``schedule_offset_end``
(layers already on stay on, as in DeepSpeed). ``weight_quantization_enabled`` tells the engine to
start the optimizer-step weight quantizer (``runtime/quantize.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from dslaunch.runtime.compression.compress import compression_config, group_targets, model_get
from dslaunch.runtime.config.compression import TECHNIQUES, CompressionConfig, parse_compression
from dslaunch.utils.logging import logger

__all__ = ["compression_scheduler", "CompressionScheduler"]

_FLAG = {"weight_quantization": "weight_quantization_enabled", "activation_quantization":
         "activation_quantization_enabled", "sparse_pruning": "sparse_pruning_enabled", "row_pruning":
         "row_pruning_enabled", "head_pruning": "head_pruning_enabled", "channel_pruning": "channel_pruning_enabled"}


class CompressionScheduler:
    """Switches the techniques on at their steps.

    Args:
        model: the model ``init_compression`` prepared (the engine's module).
        compression_config: the ``compression_training`` block (parsed, or a ds_config dict/path).
    """

    def __init__(self, model: nn.Module, compression_config_: Any):
        self.model = model
        self.compression_config = _config(compression_config_)
        self.training_steps = 0
        self.weight_quantization_enabled = False
        self.verbose = dict.fromkeys(TECHNIQUES, False)  # DeepSpeed's: whether "enabled at step" was logged
        self._layers = {t.name: [n for g in group_targets(model, t) for names in g.modules for n in names]
                        for t in self.compression_config.techniques if t.enabled}

    def _due(self, technique: str, resumed: bool) -> bool:
        shared = self.compression_config.technique(technique).shared
        if self.training_steps < shared["schedule_offset"]:
            return False
        # past its window sparse pruning is no longer switched on, but what was on stays on
        return technique != "sparse_pruning" or resumed or self.training_steps <= shared["schedule_offset_end"]

    def check_all_modules(self, resumed: bool = False) -> None:
        """Set the flag of every technique that is due on its layers (``resumed``: that has been
        due at some step so far, after a checkpoint load)."""
        for technique, names in self._layers.items():
            if not self._due(technique, resumed):
                continue
            for name in names:
                setattr(model_get(self.model, name), _FLAG[technique], True)
            if not self.verbose[technique]:
                logger.info(f"{technique.replace('_', ' ').capitalize()} is enabled at step {self.training_steps}")
                self.verbose[technique] = True
                if technique == "weight_quantization":
                    self.weight_quantization_enabled = True

    def step(self, step_zero_check: bool = False) -> None:
        """Count an optimizer step (not with ``step_zero_check``) and switch on what is due."""
        if not step_zero_check:
            self.training_steps += 1
        self.check_all_modules()


def _config(given: Any) -> CompressionConfig:
    """A parsed block, a ds_config (dict or path), or the block itself as a dict of techniques."""
    if isinstance(given, CompressionConfig):
        return given
    if isinstance(given, Mapping) and "compression_training" not in given and set(given) <= {*TECHNIQUES,
                                                                                               "layer_reduction"}:
        return parse_compression(given)
    return compression_config(given)


compression_scheduler = CompressionScheduler  # DeepSpeed's (lower-case) class name
