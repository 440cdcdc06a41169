"""``deepspeed.runtime.progressive_layer_drop``: Progressive Layer Dropping (Zhang and He, 2020).

The keep probability of the model's layers starts at 1 and falls towards ``theta`` as
``(1 - theta) * exp(-gamma * step) + theta``. With the ds_config's ``progressive_layer_drop``
enabled the engine holds one (``engine.progressive_layer_drop``), passes
``progressive_layer_drop=True, pld_theta=<probability>`` to each training forward (the model drops
its layers itself) and moves it on at each optimizer step, before the step is counted, as
DeepSpeed's: after the step that leaves ``global_steps`` at n, the probability is that of step n - 1.
It is not in the checkpoint (as in DeepSpeed): a resumed job's first step uses 1 again.
"""

from __future__ import annotations

import numpy as np

from dslaunch.utils.logging import log_dist

__all__ = ["ProgressiveLayerDrop"]


class ProgressiveLayerDrop:
    """The keep-probability schedule (DeepSpeed's class and defaults)."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        self.theta, self.gamma = theta, gamma
        self.current_theta = 1.0
        log_dist(f"Enabled progressive layer dropping (theta = {self.theta})", ranks=[0])

    def get_state(self) -> dict:
        """The keyword arguments a training forward gets."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        # numpy's exp, as DeepSpeed's: the same bits for scripts comparing them
        self.current_theta = float((1.0 - self.theta) * np.exp(-self.gamma * global_step) + self.theta)
