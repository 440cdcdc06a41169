"""DeepSpeed's engine getters of its settings (``engine.fp16_enabled()``, ``engine.train_batch_size()``,
...): what the config and the engine's parts answer, under DeepSpeed's names."""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.runtime.torch_autocast import get_default_autocast_lower_precision_modules

__all__ = ["EngineSettings"]


class EngineSettings:
    """Mixed into ``DeepSpeedEngine``: reads its ``_config``, ``zero`` and ``loss_scaler``."""

    _config: Any
    zero: Any
    loss_scaler: Any

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.zero.stage

    def autotp_size(self) -> int:
        """``tensor_parallel.autotp_size`` (after ``tp_model_init``'s, 0 without AutoTP), as DeepSpeed's."""
        return self._config.tensor_parallel.autotp_size

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def fp16_auto_cast(self) -> bool:
        return self._config.fp16.auto_cast

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def curriculum_enabled_legacy(self) -> bool:
        return self._config.curriculum_learning.enabled

    def curriculum_params_legacy(self) -> dict | bool:
        """The ``curriculum_learning`` block as given, less ``enabled`` (False without one), as DeepSpeed's."""
        return _block_params(self._config.raw, "curriculum_learning")

    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """The forwards' autocast dtype (None when ``torch_autocast`` is off, as DeepSpeed's)."""
        autocast = self._config.torch_autocast
        return getattr(torch, autocast.dtype) if autocast.enabled else None

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        names = self._config.torch_autocast.lower_precision_safe_modules
        return get_default_autocast_lower_precision_modules() if names is None else list(names)

    def pld_enabled(self) -> bool:
        return self._config.progressive_layer_drop.enabled

    def pld_params(self) -> dict | bool:
        """The ``progressive_layer_drop`` block as given, less ``enabled`` (False without one), as DeepSpeed's."""
        return _block_params(self._config.raw, "progressive_layer_drop")

    def pld_theta(self) -> float:
        return self._config.progressive_layer_drop.theta

    def pld_gamma(self) -> float:
        return self._config.progressive_layer_drop.gamma

    def get_pld_theta(self) -> float | None:
        """The keep probability now (None without progressive layer drop)."""
        pld = getattr(self, "progressive_layer_drop", None)
        return pld.get_theta() if pld is not None else None


def _block_params(raw: Any, key: str) -> dict | bool:
    block = raw.get(key)
    return {k: v for k, v in block.items() if k != "enabled"} if block is not None else False
