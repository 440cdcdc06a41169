"""The precision policy: model dtype, communication dtype, and the loss scaler to use.

fp32: model and master in fp32 (the master shard aliases the model weights), no scaling.
fp16: fp16 model, fp32 master weights, dynamic loss scaling (static when ``loss_scale > 0``).
bf16: bf16 model, fp32 master weights, no scaling.
The loss scaler itself is a strategy (``loss_scaler.py``), built from the parsed ``fp16`` section.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.config.sections import DataTypesConfig, Fp16Config
from dslaunch.runtime.precision.keep_in_fp32 import buffers_to_keep_in_fp32, keep_in_fp32_pattern
from dslaunch.runtime.precision.loss_scaler import LossScaler, build_loss_scaler
from dslaunch.runtime.torch_autocast import scales_loss

__all__ = ["PrecisionPolicy"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtypes the model and the gradient communication use."""

    model_dtype: torch.dtype
    comm_dtype: torch.dtype | None  # None: communicate in the gradient (model) dtype
    accum_dtype: torch.dtype | None = None
    """fp32 where ``data_types.grad_accum_dtype`` asks a 16-bit model's gradients to be summed in
    fp32 over the accumulation window; None: in the model dtype (ZeRO 2/3 sum their reduced shards
    in fp32 either way)."""

    @classmethod
    def from_config(cls, cfg: DeepSpeedConfig) -> PrecisionPolicy:
        model = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else torch.float32
        comm = _DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
        accum = _DTYPES[cfg.data_types.grad_accum_dtype] if cfg.data_types.grad_accum_dtype else model
        return cls(model, comm, accum if accum != model else None)

    def data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """DeepSpeed's ``engine.get_data_types()``: (model dtype, gradient accumulation dtype)."""
        return self.model_dtype, self.accum_dtype or self.model_dtype

    def cast_model(self, module: torch.nn.Module, data_types: DataTypesConfig) -> torch.nn.Module:
        """``cast_module`` as the config's ``data_types`` asks (``buffer_dtype``, ``keep_in_fp32_modules``)."""
        buffers = _DTYPES[data_types.buffer_dtype] if data_types.buffer_dtype else None
        return self.cast_module(module, buffers, data_types.keep_in_fp32_modules)

    def cast_module(self, module: torch.nn.Module, buffer_dtype: torch.dtype | None = None,
                    keep_in_fp32: Sequence[str] | str | None = None) -> torch.nn.Module:
        """Cast floating-point parameters to the model dtype (none in fp32); buffers keep the dtype they
        were loaded in (an fp32 rotary ``inv_freq`` stays fp32) unless ``buffer_dtype`` is given, as
        DeepSpeed 0.19.8 casts (before it, DeepSpeed cast the whole module). The buffers
        ``keep_in_fp32`` names (``data_types.keep_in_fp32_modules``) are fp32 either way."""
        if self.model_dtype != torch.float32:
            _cast_floating(module.parameters(), self.model_dtype)
        pattern = keep_in_fp32_pattern(module, keep_in_fp32, self.model_dtype)
        kept = buffers_to_keep_in_fp32(module, pattern) if pattern is not None else []
        _cast_floating(kept, torch.float32)
        if buffer_dtype is not None:
            kept_ids = {id(b) for b in kept}
            _cast_floating((b for b in module.buffers() if id(b) not in kept_ids), buffer_dtype)
        return module

    @staticmethod
    def loss_scaler(cfg: DeepSpeedConfig) -> LossScaler:
        """The loss scaler strategy: dynamic/static for fp16 (at ZeRO stage 0 on the rules of
        DeepSpeed's stage-0 fp16 wrappers), dynamic (the fp16 block's defaults) for float16
        ``torch_autocast``, a no-op scaler otherwise."""
        if not cfg.fp16.enabled and scales_loss(cfg.torch_autocast):
            return build_loss_scaler(Fp16Config(enabled=True))
        return build_loss_scaler(cfg.fp16, stage0=cfg.zero_optimization.stage == 0)

    @staticmethod
    def half_inputs(inputs: Any) -> Any:
        """``fp16.auto_cast``: every floating-point tensor in ``inputs`` (through lists, tuples and
        dicts) as fp16, the rest as it is, as DeepSpeed's engine casts a forward's positional inputs."""
        if isinstance(inputs, list | tuple):
            return type(inputs)(PrecisionPolicy.half_inputs(v) for v in inputs)
        if isinstance(inputs, dict):
            return {k: PrecisionPolicy.half_inputs(v) for k, v in inputs.items()}
        if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
            return inputs.half()
        return inputs

    @staticmethod
    def scales_loss(cfg: DeepSpeedConfig) -> bool:
        """The loss is scaled: ``engine.backward`` must see it (a plain ``loss.backward()`` cannot)."""
        return cfg.fp16.enabled or scales_loss(cfg.torch_autocast)


def _cast_floating(tensors: Any, dtype: torch.dtype) -> None:
    # in place (``.data``), so the module's parameter objects stay the ones the caller holds
    for t in tensors:
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)
