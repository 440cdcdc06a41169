"""The ds_config ``progressive_layer_drop`` block (DeepSpeed's keys and defaults).

``{"progressive_layer_drop": {"enabled": true, "theta": 0.5, "gamma": 0.001}}``: the engine passes
``progressive_layer_drop=True, pld_theta=<keep probability>`` to every training forward, the
probability falling from 1 towards ``theta`` as ``(1 - theta) * exp(-gamma * step) + theta``
(``runtime/progressive_layer_drop.py``). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslaunch.runtime.config.param_schema import boolean, number
from dslaunch.runtime.config.sections import _opt

__all__ = ["ProgressiveLayerDropConfig"]


@dataclass(frozen=True)
class ProgressiveLayerDropConfig:
    """``progressive_layer_drop``: the layers' keep probability, handed to the model's forward."""

    enabled: bool = _opt(False, boolean, "true or false")
    theta: float = _opt(1.0, number(0.0, 1.0), "the keep probability it tends to, in [0, 1], e.g. 0.5")
    gamma: float = _opt(0.001, number(0.0), "how fast it falls per optimizer step, e.g. 0.001")

    UNIMPLEMENTED = {}  # noqa: RUF012
