"""The ds_config ``flops_profiler`` block (DeepSpeed's keys and defaults).

``{"flops_profiler": {"enabled": true, "profile_step": 1, "module_depth": -1, "top_modules": 1,
"detailed": true, "output_file": null, "recompute_fwd_factor": 0.0}}``

The engine reads it (``dslaunch.runtime.profiling.observer``): when enabled, the optimizer
step that starts with ``profile_step`` steps done is counted and rank 0 prints its tables.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, describe, integer, number
from dslaunch.runtime.config.sections import _opt, optional

__all__ = ["FlopsProfilerConfig"]


def _file(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"must be a file path (a non-empty string) or null for stdout, got {describe(value)}",
                          key=path)
    return value


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """``flops_profiler``: count one optimizer step's flops per module and print the tables."""

    enabled: bool = _opt(False, boolean, "true or false")
    profile_step: int = _opt(1, integer(0), "the step to profile, counted from 0 (1: the second step, "
                             "after warm-up)")
    module_depth: int = _opt(-1, integer(-1), "the deepest module level printed, e.g. 2 (-1: all)")
    top_modules: int = _opt(1, integer(1), "module types listed per depth, e.g. 3")
    detailed: bool = _opt(True, boolean, "true to print the module tree too")
    output_file: str | None = _opt(None, optional(_file), "a file to append the tables to, or null for stdout")
    recompute_fwd_factor: float = _opt(0.0, number(0.0), "how much of the forward is recomputed in "
                                       "backward, e.g. 1.0 (dslaunch measures it: see README)")

    UNIMPLEMENTED = {}  # noqa: RUF012
