"""DeepSpeed's older ds_config spellings, still in its docs, rewritten into today's form before
the config is parsed (``legacy_forms``). Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.zero import legacy_zero_forms

__all__ = ["legacy_forms"]


def legacy_forms(given: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's older spellings, still in its docs, in today's form (a copy; ``given`` is kept).

    ``bfloat16`` is ``bf16``; ``"zero_optimization": true`` is stage 1 (false: stage 0), with the
    top-level ``allgather_size`` as its ``allgather_bucket_size``; ``zero_optimization.cpu_offload``
    and ``cpu_offload_param`` are the offload sections (``legacy_zero_forms``).
    """
    raw = dict(given)
    if "bfloat16" in raw:
        if "bf16" in raw:
            raise ConfigError("give either 'bf16' or its alias 'bfloat16', not both", key="bfloat16")
        raw["bf16"] = raw.pop("bfloat16")
    if isinstance(raw.get("zero_optimization"), bool):
        zero: dict[str, Any] = {"stage": int(raw["zero_optimization"])}
        if "allgather_size" in raw:
            zero["allgather_bucket_size"] = raw.pop("allgather_size")
        raw["zero_optimization"] = zero
    if isinstance(raw.get("zero_optimization"), Mapping):
        raw["zero_optimization"] = legacy_zero_forms(raw["zero_optimization"])
    return raw
