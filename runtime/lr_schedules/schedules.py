"""The schedule classes DeepSpeed names: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Step semantics: see the package docstring. Formulas (t = last_batch_iteration, W = max(2, warmup_num_steps), T = total_num_steps):

- warmup gamma: log: ln(t + 1) / ln(W); linear: t / W; 1 once t >= W.
- WarmupLR: min + (max - min) * gamma.
- WarmupDecayLR: as WarmupLR, then gamma = max(0, (T - t) / max(1, T - W)).
- WarmupCosineLR: lr = base_lr * ratio; warmup: min_ratio + (1 - min_ratio) * gamma; then with
  p = min(1, (t - W + 1) / max(1, T - W)): ratio = cos_min + (1 - cos_min) * (1 + cos(pi p)) / 2.
- OneCycle: triangle from cycle_min_lr up to cycle_max_lr over cycle_first_step_size steps and back
  over cycle_second_step_size (optionally in stairs); after the cycle lr = cycle_min_lr / (1 +
  decay_lr_rate * k / decay_step_size) with k the steps since the cycle; momentum (beta1) moves
  inversely between cycle_max_mom and cycle_min_mom, then decays by (1 + decay_mom_rate * k /
  decay_step_size).
- LRRangeTest: min_lr * (1 + step_rate * (t + 1) / step_size) (floored interval with staircase).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from dslaunch.errors import ConfigError

# torch is imported where a schedule meets an optimizer (torch is loaded then): checking a
# config's ``scheduler`` section (``--autotuning``, the launcher) must not pay for importing it.

__all__ = ["Schedule", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]

_KEY = "scheduler.params"


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    # The engine may hand over a wrapper (e.g. a ZeRO strategy's optimizer) exposing .optimizer.
    if hasattr(optimizer, "param_groups"):
        return optimizer.param_groups
    return optimizer.optimizer.param_groups


def _per_group(value: Any, n_groups: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ConfigError(f"has {len(value)} values but the optimizer has {n_groups} param groups",
                              key=f"{_KEY}.{name}")
        return list(value)
    return [value] * n_groups


def _validated(init: Callable[..., None]) -> Callable[..., None]:
    """Check a schedule's keyword params as ``scheduler.params`` are checked (the registry's
    schema), so a schedule built in Python refuses what a config would (a zero step size, a
    negative warmup) with the same one-line ``ConfigError``, before any lr is written."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        if type(self).__init__ is checked:  # not when a subclass's __init__ calls it
            from dslaunch.runtime.lr_schedules import validate_lr_scheduler

            bound = signature.bind(self, *args, **kwargs)
            # None where None is the default means "derive it" (warmup_max_lr: the optimizer's lr)
            given = {k: v for k, v in bound.arguments.items() if k not in ("self", "optimizer")
                     and not (v is None and signature.parameters[k].default is None)}
            validate_lr_scheduler(type(self).__name__, given)
        init(self, *args, **kwargs)

    return checked


def _lr_value(lr: Any) -> Any:
    """A group's lr as a number: a tensor lr is written in place later, so a copy taken from it
    as a base must not be the tensor itself."""
    import torch

    return lr.item() if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr


class Schedule:
    """Shared mechanics: the iteration counter, writing lrs into the optimizer, state."""

    def __init__(self, optimizer: Any, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = [_lr_value(group["lr"]) for group in self._groups]

    @property
    def _groups(self) -> list[dict[str, Any]]:
        return _param_groups(self.optimizer)

    def _start(self) -> None:
        """Write the starting values (only for a fresh schedule, as DeepSpeed does)."""
        if self.last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> list[float]:
        """The lr of each param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer."""
        return list(self._last_lr)

    def _apply(self) -> None:
        import torch

        lrs = self.get_lr()
        for group, lr in zip(self._groups, lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):  # a tensor lr (for compiled steps) stays that tensor
                group["lr"].copy_(torch.as_tensor(lr, dtype=group["lr"].dtype))
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or jump to ``last_batch_iteration``) and update the optimizer's lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        if self.last_batch_iteration >= 0:
            self._apply()


def _warmup_gamma(t: int, warmup_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done after step t (only called for 0 <= t < warmup_steps)."""
    if warmup_type == "log":
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps


class WarmupLR(Schedule):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    @_validated
    def __init__(self, optimizer: Any, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        n = len(self._groups)
        if warmup_max_lr is None:  # DeepSpeed (0.19): the optimizer's configured lr
            warmup_max_lr = [_lr_value(group["lr"]) for group in self._groups]
        self.min_lrs = _per_group(warmup_min_lr, n, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, n, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self._start()

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    @_validated
    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(Schedule):
    """Scale the optimizer's own lr: warm up to ratio 1, then cosine-decay to cos_min_ratio."""

    @_validated
    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.base_lrs = [_lr_value(group["lr"]) for group in self._groups]
        self._start()

    def get_lr_ratio(self) -> float:
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            gamma = _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.base_lrs]


class OneCycle(Schedule):
    """1Cycle: lr up then down between cycle_min_lr and cycle_max_lr, then decay; momentum inverse.

    Momentum cycling changes ``betas[0]`` of groups that have ``betas`` (Adam-like); for
    optimizers without betas it is skipped, as in DeepSpeed.
    """

    @_validated
    def __init__(self, optimizer: Any, cycle_min_lr: Any, cycle_max_lr: Any, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: Any = 0.8,
                 cycle_max_mom: Any = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        n = len(self._groups)
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = float(self.first_step_size if cycle_second_step_size is None
                                      else cycle_second_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(cycle_min_lr, n, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, n, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.cycle_momentum = cycle_momentum and all("betas" in g for g in self._groups)
        self.min_moms = _per_group(cycle_min_mom, n, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, n, "cycle_max_mom")
        self.decay_mom_rate = decay_mom_rate
        if self.last_batch_iteration == -1:
            self._apply()
            self._set_momentum(self.min_moms)

    @property
    def step_ratio(self) -> float:
        """The rising part's share of the cycle (DeepSpeed's attribute): 1.0 when
        ``cycle_second_step_size`` is 0, i.e. the lr rises the whole cycle and then drops."""
        return self.first_step_size / self.total_size

    def _scale(self) -> float:
        """Position in the triangle, 0 at cycle_min and 1 at the peak."""
        position = (self.last_batch_iteration + 1) % self.total_size
        rising = position <= self.first_step_size
        if rising:
            fraction, stairs = position / self.first_step_size, self.first_stair_count
        else:
            fraction = (self.total_size - position) / self.second_step_size
            stairs = self.second_stair_count
        if stairs > 0:  # hold each level for a stair; computed on the step count, not the float
            size = self.first_step_size if rising else self.second_step_size
            steps_in = position if rising else self.total_size - position
            fraction = math.floor(steps_in * stairs / size) / stairs
        return fraction

    def _decay_interval(self) -> float | None:
        """Decay intervals since the cycle ended, or None while in the cycle / decay disabled."""
        if self.last_batch_iteration < self.total_size or self.decay_step_size == 0:
            return None
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        interval = self._decay_interval()
        if interval is None:
            return list(self.min_lrs)
        return [lo / (1.0 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's ``betas`` at ``last_batch_iteration``, as DeepSpeed's: (cycled beta1, the
        optimizer's beta2); None without momentum cycling."""
        if not self.cycle_momentum:
            return None
        return [(mom, group["betas"][1]) for mom, group in zip(self._beta1s(), self._groups, strict=True)]

    def _beta1s(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)]
        interval = self._decay_interval()
        if interval is None:
            return list(self.max_moms)
        return [hi * (1.0 + self.decay_mom_rate * interval) for hi in self.max_moms]

    def _set_momentum(self, moms: list[float]) -> None:
        if not self.cycle_momentum:
            return
        for group, mom in zip(self._groups, moms, strict=True):
            group["betas"] = (mom, group["betas"][1])  # keep the optimizer's beta2

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        self._set_momentum(self._beta1s())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if self.last_batch_iteration >= 0:
            self._set_momentum(self._beta1s())


class LRRangeTest(Schedule):
    """Grow the lr from lr_range_test_min_lr linearly (or in stairs) to find a usable maximum."""

    @_validated
    def __init__(self, optimizer: Any, lr_range_test_min_lr: Any = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(lr_range_test_min_lr, len(self._groups), "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lo * (1.0 + self.step_rate * interval) for lo in self.min_lrs]
