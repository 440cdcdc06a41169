"""DeepSpeed's ``deepspeed.checkpointing`` (``deepspeed.runtime.activation_checkpointing.checkpointing``):
activation checkpointing with RNG replay, host-memory and model-parallel-split inputs, and a
selective mode.

``checkpoint(function, *args)`` runs ``function`` without keeping what autograd would save for its
backward; backward runs it again (the recompute) under the RNG states of the forward, so dropout
draws the same masks and the gradients are bit for bit those of the function run plainly.
``checkpoint`` is reentrant (an autograd Function whose backward calls ``torch.autograd.backward``
on the recompute), ``non_reentrant_checkpoint`` keeps the forward's graph and drops only its saved
tensors (saved-tensor hooks; the first one backward needs triggers the recompute). Arguments may be
tensors, ``None`` or any other value; outputs a tensor or a tuple (non-tensors pass through).

How the inputs wait for the recompute (``storage.py``): as they are, in host memory
(``cpu_checkpointing``), or split over the model-parallel group (``partition_activations``, with an
mpu). ``mode: "selective"`` (dslaunch) keeps matmul outputs and recomputes the rest (``selective.py``).

``configure(mpu_, deepspeed_config, ...)`` sets all of it; keyword arguments win over the config's
``activation_checkpointing`` block; ``initialize()`` calls it when its config has the block.

Global state: DeepSpeed's API is module functions (``checkpointing.configure(...)`` then
``checkpointing.checkpoint(...)`` anywhere in a model), so the settings, the RNG tracker and the
profile totals live in this module, one per process, as in DeepSpeed; ``configure`` replaces the
settings with a new frozen ``CheckpointSettings``.

Limitations: ``contiguous_memory_optimization`` is validated as DeepSpeed does and changes nothing
(each kept input is already one contiguous tensor; DeepSpeed's buffers fight CUDA allocator
fragmentation). ``partition_activations`` needs every rank of the group to checkpoint the same
inputs in the same order (collective in backward).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import ConfigError, UsageError
from dslaunch.runtime.accelerator import get_accelerator
from dslaunch.runtime.activation_checkpointing.rng import (
    MODEL_PARALLEL_RNG,
    CudaRNGStatesTracker,
    RngSnapshot,
    model_parallel_seeds,
)
from dslaunch.runtime.activation_checkpointing.selective import MatmulCache
from dslaunch.runtime.activation_checkpointing.storage import KeepPolicy, Kept, keep
from dslaunch.runtime.config.activation import (
    MODES,
    ActivationCheckpointingConfig,
    check_contiguous,
    parse_activation_checkpointing,
)
from dslaunch.runtime.config.param_schema import boolean, choice, integer
from dslaunch.runtime.parallel.mpu import tensor_axis

__all__ = ["configure", "is_configured", "checkpoint", "non_reentrant_checkpoint", "reset", "set_num_layers",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "CudaRNGStatesTracker",
           "CheckpointSettings", "settings", "profile_totals", "ProfileTotals"]


@dataclass(frozen=True)
class CheckpointSettings:
    """What ``configure`` set (DeepSpeed's module globals, as one frozen value)."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_layers: int | None = None
    cpu_checkpointing: bool = False
    synchronize: bool = False
    profile: bool = False
    mode: str = "full"
    mpu: Any = None

    @classmethod
    def from_config(cls, cfg: ActivationCheckpointingConfig, mpu: Any = None) -> CheckpointSettings:
        return cls(cfg.partition_activations, cfg.contiguous_memory_optimization, cfg.number_checkpoints,
                   cfg.cpu_checkpointing, cfg.synchronize_checkpoint_boundary, cfg.profile, cfg.mode, mpu)


@dataclass
class ProfileTotals:
    """Seconds spent in checkpointed forwards and in recomputes since the last ``reset``."""

    forwards: int = 0
    forward_s: float = 0.0
    recomputes: int = 0
    recompute_s: float = 0.0


@dataclass
class _State:
    settings: CheckpointSettings = field(default_factory=CheckpointSettings)
    configured: bool = False
    tracker: CudaRNGStatesTracker = field(default_factory=CudaRNGStatesTracker)
    profile: ProfileTotals = field(default_factory=ProfileTotals)


_STATE = _State()  # the module's state: see "Global state" above


# ----- configuration ----------------------------------------------------------------------------
def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None, mode: str | None = None) -> None:
    """Configure activation checkpointing (DeepSpeed's signature; ``mode`` is dslaunch's).

    Args:
        mpu_: a Megatron-style mpu (or ``PipelineParallelGrid``) whose tensor/model-parallel group
            ``partition_activations`` splits over and whose tensor rank seeds the tracker; None
            keeps the one configured before.
        deepspeed_config: a ds_config path or dict; its ``activation_checkpointing`` block is read.
        partition_activations, contiguous_checkpointing, num_checkpoints, checkpoint_in_cpu,
        synchronize, profile, mode: override the block's ``partition_activations``,
            ``contiguous_memory_optimization``, ``number_checkpoints``, ``cpu_checkpointing``,
            ``synchronize_checkpoint_boundary``, ``profile``, ``mode``.

    Raises:
        ConfigError: a bad config block or argument (one line naming it), or contiguous
            checkpointing without partitioned activations or a number of checkpoints.
    """
    base = _block(deepspeed_config) if deepspeed_config is not None else ActivationCheckpointingConfig()
    s = CheckpointSettings.from_config(base, mpu_ if mpu_ is not None else _STATE.settings.mpu)
    given = {"partition_activations": (partition_activations, boolean),
             "contiguous_checkpointing": (contiguous_checkpointing, boolean),
             "num_layers": (num_checkpoints, integer(1)), "cpu_checkpointing": (checkpoint_in_cpu, boolean),
             "synchronize": (synchronize, boolean), "profile": (profile, boolean), "mode": (mode, choice(*MODES))}
    args = {"num_layers": "num_checkpoints", "cpu_checkpointing": "checkpoint_in_cpu"}
    s = replace(s, **{k: check(f"configure({args.get(k, k)}=)", v) for k, (v, check) in given.items()
                      if v is not None})
    check_contiguous(s.contiguous_checkpointing, s.partition_activations, s.num_layers,
                     "configure(contiguous_checkpointing=)")
    _STATE.settings, _STATE.configured = s, True


def _block(source: Any) -> ActivationCheckpointingConfig:
    from dslaunch.runtime.config.file import read_config_file

    if isinstance(source, (str, Path)):
        raw, where = read_config_file(Path(source)), str(source)
    elif isinstance(source, dict):
        raw, where = source, None
    else:
        raise ConfigError("configure(deepspeed_config=...) takes a ds_config path or dict, got "
                          f"{type(source).__name__}")
    block = raw.get("activation_checkpointing") if isinstance(raw, dict) else None
    try:
        return parse_activation_checkpointing(block)
    except ConfigError as err:
        raise ConfigError(str(err), source=where) from None


def configure_from(cfg: ActivationCheckpointingConfig, mpu: Any) -> None:
    """``configure`` from an already validated block (what ``initialize`` does with its config)."""
    _STATE.settings, _STATE.configured = CheckpointSettings.from_config(cfg, mpu), True


def is_configured() -> bool:
    """True once ``configure`` ran (DeepSpeed's check before using its checkpoint)."""
    return _STATE.configured


def settings() -> CheckpointSettings:
    """The settings in force."""
    return _STATE.settings


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's number of checkpoints (``number_checkpoints``)."""
    _STATE.settings = replace(_STATE.settings, num_layers=integer(1)("set_num_layers(nlayers=)", nlayers))


def reset() -> None:
    """DeepSpeed calls this between evaluation forwards to free its contiguous buffers; dslaunch
    keeps none, so it only zeroes the profile totals."""
    _STATE.profile = ProfileTotals()


def profile_totals() -> ProfileTotals:
    """Time spent checkpointing (counted while ``profile`` is on); dslaunch's addition."""
    return _STATE.profile


# ----- RNG ----------------------------------------------------------------------------------------
def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's named RNG states (on a machine without CUDA: CPU generator states)."""
    return _STATE.tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` (the same on every tensor-parallel rank) and add the
    tracker state ``model-parallel-rng`` with ``seed + 2718 + tensor-parallel rank`` (DeepSpeed's rule).

    Raises:
        Exception: the tracker already holds those seeds (as DeepSpeed).
    """
    seed = integer(0, 2**63 - 1)("model_parallel_cuda_manual_seed(seed=)", seed)
    data_seed, tp_seed = model_parallel_seeds(seed, _mp_rank(_STATE.settings.mpu))
    _STATE.tracker.reset()
    get_accelerator().manual_seed(data_seed)
    _STATE.tracker.add(MODEL_PARALLEL_RNG, tp_seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed the tracker's ``model-parallel-rng`` state with ``seed + 2718 + tensor-parallel rank``
    (DeepSpeed's rule; Megatron-DeepSpeed calls it after changing the tensor-parallel layout); the
    default generator is left as it was."""
    seed = integer(0, 2**63 - 1)("model_parallel_reconfigure_tp_seed(seed=)", seed)
    _, tp_seed = model_parallel_seeds(seed, _mp_rank(_STATE.settings.mpu))
    with _STATE.tracker.fork():
        get_accelerator().manual_seed(tp_seed)


def _mp_ask(mpu: Any, what: Any) -> Any:
    try:
        return tensor_axis(mpu, what)
    except AttributeError as err:
        raise UsageError(f"deepspeed.checkpointing: {err}") from None


def _mp_rank(mpu: Any) -> int:
    return 0 if mpu is None else _mp_ask(mpu, "rank")


def _policy(s: CheckpointSettings) -> KeepPolicy:
    if not s.partition_activations or s.mpu is None or not dist.is_initialized():
        return KeepPolicy(cpu=s.cpu_checkpointing)
    return KeepPolicy(s.cpu_checkpointing, _mp_ask(s.mpu, "group"), _mp_ask(s.mpu, "rank"),
                      _mp_ask(s.mpu, "world_size"))


# ----- one checkpointed call ----------------------------------------------------------------------
@dataclass
class _Call:
    """What one checkpointed call keeps between its forward and its recompute."""

    function: Callable[..., Any]
    kept: list[Kept]
    needs_grad: list[bool]
    rng: RngSnapshot
    cache: MatmulCache | None
    settings: CheckpointSettings

    @classmethod
    def begin(cls, function: Callable[..., Any], args: tuple) -> _Call:
        s = _STATE.settings
        policy = _policy(s)
        return cls(function, [keep(a, policy) for a in args],
                   [torch.is_tensor(a) and a.requires_grad for a in args], RngSnapshot.capture(_STATE.tracker),
                   MatmulCache() if s.mode == "selective" else None, s)

    def run_forward(self, args: tuple) -> Any:
        with self._timed(recompute=False), self.cache if self.cache is not None else contextlib.nullcontext():
            return self.function(*args)

    def recompute(self, hooks: contextlib.AbstractContextManager | None = None) -> tuple[Any, list[Any]]:
        """Run the function again on the kept inputs under the forward's RNG states.

        Returns:
            (its outputs, its inputs: detached, requiring grad where the originals did).
        """
        inputs = [_detached(k.restore(), g) for k, g in zip(self.kept, self.needs_grad, strict=True)]
        replay = self.cache.replay() if self.cache is not None else contextlib.nullcontext()
        with self._timed(recompute=True), self.rng.replayed(_STATE.tracker), torch.enable_grad(), \
                hooks if hooks is not None else contextlib.nullcontext(), replay:
            out = self.function(*inputs)
        self.kept = []  # the recompute is the last use (a second backward raises, as torch's)
        return out, inputs

    @contextlib.contextmanager
    def _timed(self, recompute: bool) -> Iterator[None]:
        s = self.settings
        if s.synchronize:
            get_accelerator().synchronize()
        start = time.perf_counter() if s.profile else 0.0
        try:
            yield
        finally:
            if s.synchronize:
                get_accelerator().synchronize()
            if s.profile:
                p, took = _STATE.profile, time.perf_counter() - start
                if recompute:
                    p.recomputes, p.recompute_s = p.recomputes + 1, p.recompute_s + took
                else:
                    p.forwards, p.forward_s = p.forwards + 1, p.forward_s + took


def _detached(x: Any, needs_grad: bool) -> Any:
    return x.detach().requires_grad_(needs_grad) if torch.is_tensor(x) else x


def _tensors(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


class CheckpointFunction(torch.autograd.Function):
    """The reentrant checkpoint: forward without grad, backward = recompute + its backward."""

    @staticmethod
    def forward(ctx: Any, call: _Call, anchor: torch.Tensor, *args: Any) -> Any:
        ctx.call = call
        with torch.no_grad():
            out = call.run_forward(args)
        ctx.mark_non_differentiable(*[t for t in _tensors(out) if torch.is_tensor(t) and not
                                      (t.is_floating_point() or t.is_complex())])
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise UsageError("deepspeed.checkpointing.checkpoint is reentrant and cannot run under "
                             "torch.autograd.grad(); use .backward(), or non_reentrant_checkpoint")
        call: _Call = ctx.call
        out, inputs = call.recompute()
        pairs = [(o, g) for o, g in zip(_tensors(out), grads, strict=False)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.call = None
        return (None, None, *(x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs))


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` and recompute it in backward instead of keeping its activations.

    Parameters used inside get their gradients even when no argument requires grad (DeepSpeed's
    and torch's reentrant checkpoints drop them then). Under ``torch.no_grad()`` it is a plain call.

    Returns:
        What ``function`` returns (a tensor or a tuple).
    """
    if not torch.is_grad_enabled():
        return function(*args)
    # An anchor that requires grad: the outputs always join the graph, so backward reaches the
    # recompute and the parameters inside get gradients.
    anchor = torch.empty(0, requires_grad=True)
    return CheckpointFunction.apply(_Call.begin(function, args), anchor, *args)


# ----- the non-reentrant checkpoint -----------------------------------------------------------------
class _Frame:
    """Saved-tensor hooks of one non-reentrant call: the forward saves nothing but a count; the
    first unpack recomputes every saved tensor, each later unpack takes its own."""

    def __init__(self, call: _Call):
        self.call = call
        self.meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.saved: dict[int, torch.Tensor] | None = None

    def pack(self, t: torch.Tensor) -> int:
        self.meta.append((t.shape, t.dtype, t.device))
        return len(self.meta) - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.saved is None:
            self.saved = self._recompute()
        if index not in self.saved:
            raise UsageError("deepspeed.checkpointing.non_reentrant_checkpoint: a saved activation was "
                             "used twice (backward through the graph a second time); recompute it with a "
                             "new forward")
        return self.saved.pop(index)

    def _recompute(self) -> dict[int, torch.Tensor]:
        got: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> int:
            got.append(t.detach())  # not the recompute's graph: it would live until backward ends
            return len(got) - 1

        self.call.recompute(torch.autograd.graph.saved_tensors_hooks(collect, _never))
        if len(got) != len(self.meta):
            raise UsageError(f"deepspeed.checkpointing: the recompute saved {len(got)} tensors for backward, "
                             f"the forward {len(self.meta)}: the checkpointed function must take the same "
                             "path both times")
        for i, (t, (shape, dtype, device)) in enumerate(zip(got, self.meta, strict=True)):
            if (t.shape, t.dtype, t.device) != (shape, dtype, device):
                raise UsageError(f"deepspeed.checkpointing: saved tensor {i} was {tuple(shape)} {dtype} on "
                                 f"{device} in the forward and {tuple(t.shape)} {t.dtype} on {t.device} in "
                                 "the recompute")
        return dict(enumerate(got))


def _never(index: int) -> torch.Tensor:
    raise UsageError("deepspeed.checkpointing: backward through a recompute's own graph")


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """As ``checkpoint``, keeping the forward's autograd graph and dropping only its saved tensors:
    works with ``torch.autograd.grad``, inputs that need no grad and outputs used several times."""
    if not torch.is_grad_enabled():
        return function(*args)
    frame = _Frame(_Call.begin(function, args))
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return frame.call.run_forward(args)
