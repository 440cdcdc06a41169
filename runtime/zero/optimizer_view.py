"""``engine.optimizer`` as DeepSpeed's optimizer wrapper: a view over the strategy, the torch
optimizer and the loss scaler, holding no state of its own.

DeepSpeed's ``engine.optimizer`` is its wrapper wherever ZeRO or 16-bit training is on (its
``_configure_optimizer``), and code reads it: accelerate's ``step_was_skipped`` reads ``overflow``,
Megatron logs ``cur_scale``, scripts unwrap ``.optimizer`` (the torch optimizer; an unwrap loop
``while hasattr(opt, "optimizer")`` ends after one step, as with DeepSpeed's). ``optimizer_for``
picks the class DeepSpeed would build:

- stages 1/2: ``DeepSpeedZeroOptimizer``; ``BF16_Optimizer`` at stage 1 for a bf16 model whose
  gradients are summed in fp32 (``data_types.grad_accum_dtype``), without offload;
- stage 3: ``DeepSpeedZeroOptimizer_Stage3``;
- stage 0, fp16 (or bf16 summed in bf16): ``FP16_Optimizer`` over a fused Adam (the config's
  Adam/AdamW without ``torch_adam``, a client ``FusedAdam``), else ``FP16_UnfusedOptimizer``; ``BF16_Optimizer`` for a bf16
  pipeline, and for bf16 summed in fp32 (which DeepSpeed refuses at stage 0);
- stage 0 in fp32: no wrapper, ``engine.optimizer`` is the torch optimizer itself.

What each class answers is what DeepSpeed's class has and dslaunch has data for: ``optimizer``,
``param_groups``/``state``/``defaults`` (the torch optimizer's), ``state_dict()``/``load_state_dict()``
(the ZeRO state the checkpoint layer saves: ``ZeroStrategy.state_dict``), ``zero_grad``, ``step``,
``backward``, ``overflow``, ``clip_grad``, the loss-scale names (``loss_scaler``, ``loss_scale``,
``cur_scale``, ``dynamic_loss_scale``; stage 0's ``loss_scale_config``; not ``BF16_Optimizer``,
which has no scaler), the partition views its tests read and the gradient data of
``gradient_views.py`` (``averaged_gradients``, stage 3's ``_get_norm_groups()``,
``BF16_Optimizer.fp32_groups_gradients_flat``, stages 1/2's ``parallel_partitioned_bit16_groups``:
copies of the averaged gradients, views of the weights). Any other name raises ``AttributeError``
naming the wrapper. Unlike DeepSpeed's, the wrappers are ``torch.optim.Optimizer`` instances, so
torch's LR schedulers accept ``engine.optimizer``.

Making one by hand is refused in one line: the engine builds them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from dslaunch.errors import NotInDslaunchError
from dslaunch.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
from dslaunch.runtime.fp16 import MIXED_PRECISION_WRAPPER
from dslaunch.runtime.zero import gradient_views
from dslaunch.utils.refused import Refusal

__all__ = ["DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "FP16_Optimizer", "FP16_UnfusedOptimizer",
           "BF16_Optimizer", "optimizer_for", "take_step"]

ZERO_WRAPPER = Refusal("a stand-alone ZeRO optimizer wrapper",
                       "set \"zero_optimization.stage\" in the ds_config; engine.optimizer is the wrapper")


def take_step(zero: Any, loss_scaler: Any, clip: float, check_overflow: bool) -> Any:
    """One optimizer step of ``zero`` at the scaler's scale, the scaler told the outcome; the
    strategy's ``StepResult``. collective: all ranks."""
    result = zero.step(loss_scaler.loss_scale, clip, check_overflow=check_overflow)
    loss_scaler.update(result.overflow)
    return result


def _inner(name: str) -> property:
    """The torch optimizer's ``name``, read and set through (DeepSpeed's wrappers' properties)."""
    return property(lambda self: getattr(self.optimizer, name), lambda self, value: setattr(self.optimizer, name, value),
                    doc=f"The torch optimizer's ``{name}``.")


class _View(torch.optim.Optimizer):
    """What every wrapper answers (see the module docstring). ``torch.optim.Optimizer.__init__``
    is never run: the param groups and state are the torch optimizer's."""

    _refusal: Refusal = ZERO_WRAPPER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise self._refusal.error(f"{type(self).__module__}.{type(self).__name__}")

    @classmethod
    def _over(cls, zero: Any, loss_scaler: Any, clip: float, check_overflow: bool, needs_scaling: bool,
              backward: weakref.WeakMethod) -> _View:
        view = cls.__new__(cls)
        view.__dict__.update(_zero=zero, _loss_scaler=loss_scaler, clip_grad=clip, _check_overflow=check_overflow,
                             _needs_scaling=needs_scaling, _backward=backward, _step_patched=False)
        return view

    # ----- the torch optimizer's, as DeepSpeed's properties -----------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over the fp32 master shards."""
        return self._zero.optimizer

    param_groups = _inner("param_groups")
    state = _inner("state")
    defaults = _inner("defaults")

    @property
    def _global_grad_norm(self) -> float:
        """The last step's unscaled gradient norm (DeepSpeed's attribute)."""
        return self.optimizer._global_grad_norm

    @property
    def overflow(self) -> bool:
        """Whether the last step was skipped for inf/NaN gradients (False before the first)."""
        last = self._zero.last_step
        return bool(last is not None and last.overflow)

    @property
    def _opt_called(self) -> bool:
        # torch's LR schedulers warn unless the optimizer stepped before them: the engine steps
        # the strategy, not this object's (patched) ``step``
        return self._step_patched or self._zero.last_step is not None

    @_opt_called.setter
    def _opt_called(self, value: bool) -> None:
        self.__dict__["_step_patched"] = bool(value)

    # ----- what the engine does with it --------------------------------------------------------
    def state_dict(self) -> dict:  # type: ignore[override]
        """This rank's ZeRO state as dslaunch's checkpoints hold it (``ZeroStrategy.state_dict``)."""
        return self._zero.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """Restore a ``state_dict()`` of this wrapper. collective: all ranks."""
        self._zero.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The torch optimizer's: the gradients being accumulated belong to the strategy, which no
        optimizer call touches (``strategy.py``), so loops calling it anywhere train the same;
        ``engine.zero_grad()`` forgets them."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """The optimizer step alone (unscale, clip, skip on overflow, update), without the
        engine's counters and LR scheduler: ``engine.step()`` calls it at each boundary.

        collective: all ranks.
        """
        if closure is not None:
            raise NotInDslaunchError("engine.optimizer.step(closure): closures are not in dslaunch (nor in "
                                     "DeepSpeed's ZeRO optimizers); call engine.step()")
        take_step(self._zero, self._loss_scaler, self.clip_grad, self._check_overflow)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backpropagate ``loss`` (scaled, not divided by the accumulation steps) and reduce the
        gradients, as ``engine.backward(loss, scale_wrt_gas=False)``. collective: all ranks."""
        self._backward()(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """``engine.offload_states`` (DeepSpeed's ZeRO optimizers have it too: RLHF frameworks call it here)."""
        self._zero.offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """``engine.reload_states``."""
        self._zero.reload_states(non_blocking)

    def needs_scaler(self) -> bool:
        """Whether a script's own ``loss.backward()`` must scale the loss (``engine.scale``): fp16."""
        return self._needs_scaling

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def add_param_group(self, param_group: dict) -> None:
        raise NotInDslaunchError("engine.optimizer.add_param_group: the param groups are fixed once ZeRO has "
                                 "flattened them; pass every group to deepspeed.initialize()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    # ----- the parameters, as DeepSpeed's wrappers list them -------------------------------------
    def _model_groups(self) -> list[list[torch.nn.Parameter]]:
        return [list(g.params) for g in self._zero.groups]

    def _masters(self) -> list[torch.Tensor]:
        return [g.master for g in self._zero.groups]


class _Scaled(_View):
    """The loss-scale names of DeepSpeed's fp16-capable wrappers (``BF16_Optimizer`` has none)."""

    @property
    def loss_scaler(self) -> Any:
        """The engine's loss scaler (``engine.loss_scaler``)."""
        return self._loss_scaler

    @property
    def dynamic_loss_scale(self) -> bool:
        return bool(self._loss_scaler.dynamic)

    @property
    def loss_scale(self) -> float:
        return self._loss_scaler.cur_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._loss_scaler.cur_scale = value

    cur_scale = loss_scale


_PARAMS = "Each param group's model parameters."
_MASTERS = "Each param group's fp32 master (this rank's shard where it is partitioned): what the torch optimizer updates."
# DeepSpeed pads its 16-bit flat buffers so that every rank's partition starts 4-byte aligned (2
# elements); dslaunch pads only to the world size (``partition.py``), so a partition starts on any
# element: the alignment it guarantees is 1
_ALIGNMENT = 1


def _averaged(every_param: bool) -> property:
    return property(lambda self: gradient_views.averaged_gradients(self._zero, every_param),
                    doc="Per param group whose gradients are reduced, this rank's piece of each parameter's "
                        "averaged gradient: copies (``gradient_views.averaged_gradients``).")


class DeepSpeedZeroOptimizer(_Scaled, ZeROOptimizer):
    """DeepSpeed's ZeRO stage 1/2 optimizer: ``engine.optimizer`` at those stages."""

    bit16_groups = property(_View._model_groups, doc=_PARAMS)
    single_partition_of_fp32_groups = property(_View._masters, doc=_MASTERS)
    averaged_gradients = _averaged(every_param=False)
    nccl_start_alignment_factor = _ALIGNMENT

    @property
    def parallel_partitioned_bit16_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, every rank's partition of the model weights (views)."""
        return gradient_views.rank_partitions(self._zero)


class DeepSpeedZeroOptimizer_Stage3(_Scaled, ZeROOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's ZeRO stage 3 optimizer: ``engine.optimizer`` at stage 3."""

    fp16_groups = property(_View._model_groups, doc=_PARAMS)
    fp32_partitioned_groups_flat = property(_View._masters, doc=_MASTERS)
    averaged_gradients = _averaged(every_param=True)

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """Each param group's gradient norm over the ranks (loss scale included; -1 for inf/NaN).
        collective: all ranks."""
        return gradient_views.norm_groups(self._zero)

    def _set_fp32_optimizer_param_groups(self) -> None:
        """DeepSpeed points its torch optimizer's groups at the fp32 shards around a
        ``state_dict()``; dslaunch's always are: nothing to do."""

    def _clear_fp32_optimizer_param_groups(self) -> None:
        """The counterpart of ``_set_fp32_optimizer_param_groups``: the groups stay as they are."""


class _Fp16(_Scaled):
    """DeepSpeed 0.19.8's stage-0 16-bit wrappers keep their scale state in ``loss_scale_config``
    (``cur_scale``, ``cur_iter``, ``scale_window``, ``dynamic_loss_scale``): the engine's scaler."""

    _refusal = MIXED_PRECISION_WRAPPER
    fp16_groups = property(_View._model_groups, doc=_PARAMS)

    @property
    def loss_scale_config(self) -> Any:
        return self._loss_scaler


class FP16_Optimizer(_Fp16, DeepSpeedOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's 16-bit wrapper of a fused Adam at stage 0."""

    fp32_groups_flat = property(_View._masters, doc=_MASTERS)


class FP16_UnfusedOptimizer(_Fp16, DeepSpeedOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's 16-bit wrapper of any other optimizer at stage 0."""

    @property
    def fp32_groups(self) -> list[list[torch.Tensor]]:
        """Each param group's fp32 master, one view per parameter."""
        return [[g.master.data[a - g.layout.start:b - g.layout.start].view(shape)
                 for (a, b), shape in zip(map(g.layout.param_range, range(len(g.params))), g.layout.shapes,
                                          strict=True)]
                for g in self._zero.groups]


class BF16_Optimizer(_View, ZeROOptimizer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's bf16 wrapper with fp32 gradient accumulation (ZeRO stage 1; stage 0 pipelines)."""

    _refusal = MIXED_PRECISION_WRAPPER
    bf16_groups = property(_View._model_groups, doc=_PARAMS)
    fp32_groups_flat_partition = property(_View._masters, doc=_MASTERS)
    nccl_start_alignment_factor = _ALIGNMENT

    @property
    def fp32_groups_gradients_flat(self) -> list[torch.Tensor]:
        """Each param group's whole fp32 gradient, flat: this rank's sum before the boundary, the
        average after (copies)."""
        return gradient_views.flat_gradients(self._zero)


def optimizer_for(zero: Any, optimizer: Any, config: Any, loss_scaler: Any, check_overflow: bool,
                  needs_scaling: bool, backward: weakref.WeakMethod, pipeline: bool, from_config: bool) -> Any:
    """``engine.optimizer``: the wrapper DeepSpeed 0.19.8 builds for this config (module
    docstring) over ``zero`` and its torch ``optimizer`` (``from_config``: built from the config's
    ``optimizer`` section, not given by the script); ``optimizer`` itself at stage 0 in fp32 and
    where there is none (an engine without an optimizer)."""
    cls = None if optimizer is None else _wrapper_class(optimizer, config, pipeline, from_config)
    if cls is None:
        return optimizer
    return cls._over(zero, loss_scaler, config.gradient_clipping, check_overflow, needs_scaling, backward)


def _wrapper_class(optimizer: torch.optim.Optimizer, config: Any, pipeline: bool, from_config: bool) -> type[_View] | None:
    stage, fp16, bf16 = config.zero_optimization.stage, config.fp16.enabled, config.bf16.enabled
    fp32_sums = (fp16 or bf16) and config.data_types.grad_accum_dtype == "fp32"
    if stage >= 1:
        if stage == 1 and bf16 and fp32_sums and not config.zero_optimization.offload_optimizer.enabled:
            return BF16_Optimizer
        return DeepSpeedZeroOptimizer_Stage3 if stage == 3 else DeepSpeedZeroOptimizer
    if not (fp16 or bf16):
        return None
    if bf16 and (pipeline or fp32_sums):
        return BF16_Optimizer
    from dslaunch.kernels.fused_adam import FusedAdam

    # DeepSpeed's config Adam/AdamW is its FusedAdam unless torch_adam asks for torch's
    fused = isinstance(optimizer, FusedAdam) or (from_config and config.optimizer.name in ("Adam", "AdamW")
                                                 and not config.optimizer.params.get("torch_adam", False))
    return FP16_Optimizer if fused else FP16_UnfusedOptimizer
