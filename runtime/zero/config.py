"""DeepSpeed's ``deepspeed.runtime.zero.config``: the ``zero_optimization`` block as an object.

``DeepSpeedZeroConfig(**section)`` parses a ``zero_optimization`` dict exactly as ``load_config``
does (``runtime/config/zero.py``: DeepSpeed's older ``cpu_offload`` switches and the
``stage3_``-less aliases included) and returns dslaunch's frozen ``ZeroConfig``, which also
answers DeepSpeed's attribute names (``prefetch_bucket_size``, ``gather_16bit_weights_on_model_save``).

Limitation: the offload sections are always objects (``device: "none"`` when off), where
DeepSpeed's are None when the config leaves them out.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from dslaunch.runtime.config.sections import SectionClass, parse_section
from dslaunch.runtime.config.zero import (
    LeafModuleConfig,
    OffloadConfig,
    ZeroConfig,
    legacy_zero_forms,
    offload_optimizer_section,
    offload_param_section,
)

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "OffloadDeviceEnum", "OffloadStateTypeEnum", "ZeroStageEnum", "ZeroConfig", "OffloadConfig",
           "DeepSpeedZeroLeafModuleConfig"]


class ZeroStageEnum(int, Enum):
    """The ZeRO stages by DeepSpeed's names."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


# DeepSpeed's qualified name: DeepSpeed pickles the stage into every ZeRO optimizer file, and
# torch.serialization.add_safe_globals([ZeroStageEnum]) must name that class for weights_only loads.
ZeroStageEnum.__module__ = "deepspeed.runtime.zero.config"


class OffloadDeviceEnum(str, Enum):
    """Where an offload section puts its tensors."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The states ``engine.offload_states(include=...)`` names (DeepSpeed's values; what each holds:
    ``offload_states.py``)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class DeepSpeedZeroConfig(metaclass=SectionClass):
    """``DeepSpeedZeroConfig(stage=3, ...)``: a parsed ``ZeroConfig`` (raises ``ConfigError``)."""

    _parsed = ZeroConfig

    @staticmethod
    def _parse(section: dict[str, Any]) -> ZeroConfig:
        return parse_section(ZeroConfig, legacy_zero_forms(section), "zero_optimization")


class DeepSpeedZeroOffloadOptimizerConfig(metaclass=SectionClass):
    """``DeepSpeedZeroOffloadOptimizerConfig(device="cpu", ...)``: a parsed ``OffloadConfig``."""

    _parsed = OffloadConfig

    @staticmethod
    def _parse(section: dict[str, Any]) -> OffloadConfig:
        return offload_optimizer_section("zero_optimization.offload_optimizer", section)


class DeepSpeedZeroOffloadParamConfig(metaclass=SectionClass):
    """``DeepSpeedZeroOffloadParamConfig(device="cpu", ...)``: a parsed ``OffloadConfig``."""

    _parsed = OffloadConfig

    @staticmethod
    def _parse(section: dict[str, Any]) -> OffloadConfig:
        return offload_param_section("zero_optimization.offload_param", section)


class DeepSpeedZeroLeafModuleConfig(metaclass=SectionClass):
    """``DeepSpeedZeroLeafModuleConfig(classes=[...], ...)``: a parsed ``LeafModuleConfig``."""

    _parsed = LeafModuleConfig

    @staticmethod
    def _parse(section: dict[str, Any]) -> LeafModuleConfig:
        return parse_section(LeafModuleConfig, section, "zero_optimization.leaf_module")
