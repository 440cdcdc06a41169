"""The ds_config's rules between sections: each section validates itself when parsed
(``parse_section``); what one section's value forbids in another's (fp16 with bf16, a 1-bit
optimizer with ZeRO stage 3, ZeRO++ below stage 3, ...) is checked here, once, on the whole
parsed config, before anything is built: every rank refuses alike, in one line naming the key.
"""

from __future__ import annotations

from typing import Any

from dslaunch.errors import AccumulationModeError, ConfigError
from dslaunch.runtime.config.activation import check_contiguous
from dslaunch.runtime.config.monitors import check_packages
from dslaunch.runtime.zero.registry import STAGES, stage_choices

__all__ = ["cross_check"]


def _check_compressed(cfg: Any) -> None:
    """What the 1-bit optimizers (optim/onebit.py) cannot run with: one line naming the key."""
    from dslaunch.runtime.optim.registry import is_compressed

    if not is_compressed(cfg.optimizer):
        return
    name, zero = cfg.optimizer.name, cfg.zero_optimization
    if cfg.fp16.enabled:
        raise ConfigError(f"{name} does not run with fp16 loss scaling here (a rank skipping an overflowed "
                          "step would leave the others in the compressed exchange); use bf16 or fp32",
                          key="fp16.enabled")
    if zero.stage not in (0, 1, 2) or (name == "ZeroOneAdam" and zero.stage != 0):
        stages = "stage 0 (its ranks step apart between synchronisations)" if name == "ZeroOneAdam" else "stages 0, 1 and 2"
        raise ConfigError(f"{name} runs with ZeRO {stages}, not {zero.stage}", key="zero_optimization.stage")
    if zero.offload_optimizer.enabled:
        raise ConfigError(f"{name} does not run with an offloaded optimizer", key="zero_optimization.offload_optimizer")


def _check_muon(cfg: Any) -> None:
    """Muon (optim/muon.py) needs whole param groups at its step; the offloaded step has buckets."""
    if cfg.optimizer is not None and cfg.optimizer.name == "Muon" and cfg.zero_optimization.offload_optimizer.enabled:
        raise ConfigError("Muon does not run with an offloaded optimizer here (its step needs whole "
                          "matrices; the offloaded step updates buckets): remove offload_optimizer",
                          key="zero_optimization.offload_optimizer")


def _check_unmanaged(cfg: Any) -> None:
    """What ``managed_gradient_accumulation: false`` (every ``step()`` a boundary) cannot run with."""
    zero = cfg.zero_optimization
    if not cfg.managed_gradient_accumulation and zero.overlap_comm and zero.stage < 2:
        raise AccumulationModeError(
            "true with managed_gradient_accumulation false: as DeepSpeed, dslaunch supports overlap_comm only with "
            "ZeRO stage 2 or 3 there (at stages 0 and 1 the gradients are reduced in step(), after the backward: "
            "there is nothing to overlap); set it to false", key="zero_optimization.overlap_comm")


def cross_check(cfg: Any) -> None:
    """The rules between the sections of ``cfg`` (a parsed ``DeepSpeedConfig``).

    Raises:
        ConfigError: one line naming the key whose value the others forbid, and what would be valid.
    """
    act = cfg.activation_checkpointing
    check_contiguous(act.contiguous_memory_optimization, act.partition_activations, act.number_checkpoints,
                     "activation_checkpointing.contiguous_memory_optimization")
    check_packages(cfg.monitor_config)
    cfg.autotuning.check()
    cfg.curriculum_learning.check()
    cfg.data_efficiency.check()
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16 and bf16 cannot both be enabled; choose one", key="bf16.enabled")
    zero = cfg.zero_optimization
    if cfg.gradient_allreduce_op == "sum" and zero.stage == 3:
        raise ConfigError("'sum' is not supported with ZeRO stage 3 (as in DeepSpeed: its partitioned "
                          "reduction averages); use \"mean\" or stage 0-2", key="gradient_allreduce_op")
    cfg.data_types.check(cfg.fp16.enabled, cfg.bf16.enabled)
    _check_compressed(cfg)
    _check_muon(cfg)
    _check_unmanaged(cfg)
    cfg.tensor_parallel.check(zero.stage)
    cfg.expert_parallel.check(cfg)
    cfg.layout_invariant.check(cfg)
    if zero.offload_optimizer.enabled and zero.stage == 0:
        raise ConfigError("needs ZeRO stage 1, 2 or 3 (stage 0 keeps the optimizer state on every rank's "
                          "device)", key="zero_optimization.offload_optimizer.device")
    for key in ("offload_optimizer", "offload_param"):
        off = getattr(zero, key)
        if off.device == "nvme" and off.nvme_path is None:
            raise ConfigError("is required with \"device\": \"nvme\" (a directory for the swap files)",
                              key=f"zero_optimization.{key}.nvme_path")
    ratio = zero.offload_optimizer.ratio
    if ratio != 1.0 and zero.offload_optimizer.enabled and (zero.stage != 3 or zero.offload_optimizer.device == "nvme"):
        why = "partial offload needs ZeRO stage 3" if zero.stage != 3 else "partial offload needs \"device\": \"cpu\""
        raise ConfigError(f"{ratio} is refused: {why}; set it to 1.0 or remove it",
                          key="zero_optimization.offload_optimizer.ratio")
    zeropp = {"zero_quantized_weights": zero.zero_quantized_weights, "zero_hpz_partition_size":
              zero.zero_hpz_partition_size > 1, "zero_quantized_gradients": zero.zero_quantized_gradients}
    for key, on in zeropp.items():
        if on and zero.stage != 3:
            raise ConfigError(f"ZeRO++ needs ZeRO stage 3, this config has stage {zero.stage}; set the stage "
                              "to 3 or remove it", key=f"zero_optimization.{key}")
    if cfg.zero_optimization.stage not in STAGES:
        raise ConfigError(f"ZeRO stage {cfg.zero_optimization.stage} is accepted by DeepSpeed but not "
                          f"implemented by dslaunch yet; use {stage_choices()}", key="zero_optimization.stage")
