"""The ds_config ``layout_invariant`` block: training whose bits do not depend on the parallel
layout (dslaunch's own, not DeepSpeed's). Torch-free.

``{"layout_invariant": {"enabled": true, "chunks": 4}}``: every reduction whose operands a layout
splits differently (a tensor-parallel matmul's inner dimension, a gradient summed over data or
expert-data ranks and accumulation steps, the global gradient norm) is computed in one fixed order
of ``chunks`` pieces, whatever the tensor, expert or data degree. So a job saved at one layout and
resumed at another continues bit for bit as a job that ran at the new layout from the start
(fp32; the same global batch). Degrees must divide ``chunks``; ``check`` refuses what the mode
cannot keep invariant. It costs speed: the pieces are
separate matmuls and the reductions fixed trees, not the fastest collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, integer
from dslaunch.runtime.config.sections import _opt

__all__ = ["LayoutInvariantConfig"]


@dataclass(frozen=True)
class LayoutInvariantConfig:
    """``layout_invariant``: reductions in a fixed order of ``chunks`` pieces at any layout."""

    enabled: bool = _opt(False, boolean, "true or false")
    chunks: int = _opt(4, integer(1, 1024), "an integer from 1 to 1024: the pieces every split reduction is "
                       "cut into (each tensor, expert and data degree must divide it)")

    UNIMPLEMENTED = {}  # noqa: RUF012

    def check(self, cfg: Any) -> None:
        """What the mode cannot keep invariant, refused from the whole config (a ``DeepSpeedConfig``)
        at load: every rank alike, before any group exists.

        Raises:
            ConfigError: one line naming the conflicting key and what would be valid.
        """
        if not self.enabled:
            return
        _check_reductions(cfg)
        if cfg.tensor_parallel.size > 1:
            _check_tensor_parallel(cfg, self.chunks)
        if cfg.expert_parallel.enabled:
            raise ConfigError("true with expert_parallel (AutoEP's grouped experts have no per-block form yet); "
                              "use deepspeed.moe.layer.MoE or disable one of them", key="layout_invariant.enabled")


def _check_reductions(cfg: Any) -> None:
    """Gradients summed in a layout-dependent order: the stage, accumulation, compression, groups."""
    from dslaunch.runtime.optim.registry import is_compressed

    zero, gas = cfg.zero_optimization, cfg.gradient_accumulation_steps
    why = "layout_invariant sums gradients in one fixed tree"
    if zero.stage not in (1, 2):
        raise ConfigError(f"{zero.stage}: {why}, built on ZeRO stage 2's reduction at every micro step (stage 1 "
                          "reduces so too under it); use stage 1 or 2 or disable layout_invariant",
                          key="zero_optimization.stage")
    if gas & (gas - 1):
        raise ConfigError(f"{gas}: {why} over micro steps too, which needs a power of two (1, 2, 4...)",
                          key="gradient_accumulation_steps")
    if is_compressed(cfg.optimizer) or zero.zero_quantized_gradients:
        raise ConfigError(f"true: {why}; 1-bit optimizers and quantized gradients exchange them otherwise: use "
                          "another optimizer or disable layout_invariant", key="layout_invariant.enabled")
    if cfg.use_data_before_expert_parallelism:
        raise ConfigError(f"true: {why} over neighbouring ranks' expert blocks, which needs the default expert "
                          "groups of neighbouring ranks; set it to false", key="use_data_before_expert_parallelism")


def _check_tensor_parallel(cfg: Any, chunks: int) -> None:
    """AutoTP training's pieces: the degree divides ``chunks``; fp32 only; no vocabulary-split loss."""
    tp = cfg.tensor_parallel.size
    if chunks % tp:
        raise ConfigError(f"{chunks} is not a multiple of tensor_parallel.autotp_size {tp}: every degree the "
                          "job may run at must divide it", key="layout_invariant.chunks")
    for half in ("fp16", "bf16"):
        if getattr(cfg, half).enabled:
            raise ConfigError(f"true with {half}: layout-invariant tensor-parallel training is fp32 only; "
                              f"disable one of layout_invariant.enabled and {half}.enabled",
                              key="layout_invariant.enabled")
    if cfg.tensor_parallel.vocab_parallel:
        raise ConfigError(f"true with {cfg.tensor_parallel.vocab_parallel_key}, whose softmax sums over each rank's vocabulary "
                          "slice; disable one of them", key="layout_invariant.enabled")
