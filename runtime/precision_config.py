"""DeepSpeed's ``deepspeed.runtime.precision_config``: the ``bf16`` and ``fp16`` blocks of a config
dict, parsed as ``load_config`` parses them (``runtime/config/sections.py``).

``DeepSpeedFP16Config(**block)`` / ``DeepSpeedBF16Config(**block)`` are DeepSpeed's class names:
calling one returns dslaunch's frozen ``Fp16Config`` / ``Bf16Config``. A bad value is a ``ConfigError``
(one line naming the key) that is also pydantic's ``ValidationError`` where pydantic is installed, as
DeepSpeed's models raise. Limitation: a number given as a string (``loss_scale: "3"``) is refused,
as everywhere in a dslaunch config; DeepSpeed converts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.sections import Bf16Config, Fp16Config, SectionClass, parse_section

__all__ = ["get_bfloat16_config", "get_float16_config", "DeepSpeedFP16Config", "DeepSpeedBF16Config"]


class DeepSpeedFP16Config(metaclass=SectionClass):
    """``DeepSpeedFP16Config(enabled=True, loss_scale=0, ...)``: a parsed ``Fp16Config``."""

    _parsed = Fp16Config

    @staticmethod
    def _parse(section: dict[str, Any]) -> Fp16Config:
        return parse_section(Fp16Config, section, "fp16")


class DeepSpeedBF16Config(metaclass=SectionClass):
    """``DeepSpeedBF16Config(enabled=True, ...)``: a parsed ``Bf16Config``."""

    _parsed = Bf16Config

    @staticmethod
    def _parse(section: dict[str, Any]) -> Bf16Config:
        return parse_section(Bf16Config, section, "bf16")


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> Bf16Config:
    """The ``bf16`` block (or its alias ``bfloat16``); disabled when absent.

    Raises:
        ConfigError: both spellings given, or a bad value in the block.
    """
    if "bf16" in param_dict and "bfloat16" in param_dict:
        raise ConfigError("give either 'bf16' or its alias 'bfloat16', not both", key="bfloat16")
    key = "bf16" if "bf16" in param_dict else "bfloat16"
    return parse_section(Bf16Config, param_dict.get(key), key)


def get_float16_config(param_dict: Mapping[str, Any]) -> Fp16Config:
    """The ``fp16`` block; disabled when absent."""
    return parse_section(Fp16Config, param_dict.get("fp16"), "fp16")
