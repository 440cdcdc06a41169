"""DeepSpeed's flops profiler API (``deepspeed.profiling.flops_profiler.profiler``).

``FlopsProfiler(model)``: ``start_profile()``, run the model (forward, and backward too: it is
counted, not assumed), ``stop_profile()``, read ``get_total_flops/macs/params/duration()`` or
``print_model_profile()``, ``end_profile()``. ``get_model_profile(model, input_shape=...)`` does
that around one forward. Counting is ``counter.FlopCounter``'s (aten operators recorded by
torch's profiler, module hooks; counted at ``stop_profile``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.profiling.counter import FlopCounter
from dslaunch.runtime.profiling.report import (
    ModuleRow,
    Profile,
    StepTiming,
    aggregated_lines,
    detailed_lines,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    params_to_string,
    summary_lines,
)
from dslaunch.safe_write import append_file, open_dir, split_path

__all__ = ["FlopsProfiler", "get_model_profile", "model_params"]


def model_params(module: torch.nn.Module) -> int:
    """Trainable parameters of ``module`` (children's included), whole even when ZeRO-3 holds
    only a shard (``ds_numel``); a tied parameter counts once."""
    return sum(_numel(p) for p in module.parameters() if p.requires_grad)


def _numel(p: torch.nn.Parameter) -> int:
    return getattr(p, "ds_numel", p.numel())


def _params_by_module(model: torch.nn.Module) -> dict[str, int]:
    """``model_params`` of every submodule by its name, in one pass over the parameters (a tied
    parameter counts in each module that holds it, once in a common parent)."""
    counts = {name: 0 for name, _ in model.named_modules()}
    seen: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        path = name.split(".")[:-1]
        owners = seen.setdefault(id(p), set())
        for i in range(len(path) + 1):
            prefix = ".".join(path[:i])
            if prefix not in owners:
                owners.add(prefix)
                counts[prefix] = counts.get(prefix, 0) + _numel(p)
    return counts


def _sync_for(model: torch.nn.Module) -> Any:
    on_cuda = any(p.is_cuda for p in model.parameters()) and torch.cuda.is_available()
    return torch.cuda.synchronize if on_cuda else None


class FlopsProfiler:
    """Counts a model's flops per module while started (DeepSpeed's class and methods).

    Args:
        model: the module to profile.
        ds_engine: accepted for DeepSpeed's signature; the engine's profiling is an observer
            (``observer.FlopsProfilerObserver``), not this object.
        recompute_fwd_factor: used only when no backward ran while profiling: the backward is then
            estimated as ``(2 + factor) x`` forward, as DeepSpeed does (a measured backward,
            recomputation included, needs no factor).

    Limitations: counts only what runs on the calling thread between ``start_profile`` and
    ``stop_profile``; not thread-safe.
    """

    def __init__(self, model: torch.nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0):
        self.model, self.ds_engine, self.recompute_fwd_factor = model, ds_engine, recompute_fwd_factor
        self.counter: FlopCounter | None = None
        self.started = False
        self.timing: StepTiming | None = None
        """Set by the engine's observer before printing: the step's latencies and sizes."""
        self.last: Profile | None = None
        """The counts as they were at ``end_profile``."""
        self._stopped: Profile | None = None  # profile() since the last stop: the counts cannot change
        self._ready: FlopCounter | None = None

    def prepare(self) -> None:
        """Build the counter now, for the next ``start_profile`` (the engine's observer does, so that
        its profiled step only registers the hooks). Only once the model's modules and device are
        final: the counter knows the modules it was built with."""
        self._ready = self._new_counter()

    def _new_counter(self) -> FlopCounter:
        return FlopCounter(self.model, (), _sync_for(self.model))

    # ----- DeepSpeed's lifecycle ------------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start counting (a second start while started is ignored, as DeepSpeed's re-entry)."""
        if self.started:
            return
        if self.counter is None:
            self.counter, self._ready = self._ready or self._new_counter(), None
            self.counter.ignore = tuple(ignore_list or ())
        self._stopped = None
        self.counter.start()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the counts stay readable."""
        if self.started and self.counter is not None:
            self.counter.stop()
        self.started = False

    def reset_profile(self) -> None:
        self._stopped = None
        if self.counter is not None:
            self.counter.reset()

    def end_profile(self) -> None:
        """Stop counting and release the hooks; the final counts stay in ``last``."""
        self.stop_profile()
        if self.counter is not None:
            self.last = self.profile()
        self.counter, self._stopped = None, None

    def discard(self) -> None:
        """Stop counting and drop the counts (``last`` keeps an earlier profile)."""
        if self.counter is not None:
            self.counter.discard()
        self.counter, self._stopped, self.started = None, None, False

    # ----- results ---------------------------------------------------------------------------
    def profile(self) -> Profile:
        """The counts as a ``Profile`` (the tables' input): what was counted up to the last
        ``stop_profile`` (the counting happens there); built once after a stop (the engine's
        profiled step reads it for the timing, the tables and ``last``)."""
        if self._stopped is not None and not self.started:
            return self._stopped
        c = self._counted()
        names = {m: name for name, m in self.model.named_modules()}
        params = _params_by_module(self.model)
        rows = []
        for m, s in c.stats.items():
            name = names.get(m, "")
            rows.append(ModuleRow(name or type(m).__name__, type(m).__name__, name.count(".") + (name != ""),
                                  params.get(name, 0), s.fwd_flops, s.bwd_flops, s.own_fwd_flops,
                                  s.own_bwd_flops, s.fwd_duration, s.calls))
        bwd_measured = bool(c.bwd_flops)
        p = Profile(tuple(rows), c.outside[0], c.outside[1], tuple(c.ops.most_common()), bwd_measured,
                    self.recompute_fwd_factor)
        if not self.started:
            self._stopped = p
        return p

    def _counted(self) -> FlopCounter:
        if self.counter is None:
            raise UsageError("FlopsProfiler: nothing counted yet; call start_profile(), run the model, then "
                             "stop_profile() before reading the counts")
        if self.started:
            self.counter.flush()  # read while started (DeepSpeed's example): what ran so far
        return self.counter

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Flops counted: the forward's, plus the backward's where one ran while profiling."""
        c = self._counted()
        total = c.fwd_flops + c.bwd_flops
        return flops_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulates counted (half the flops: only matmul-like operators count)."""
        c = self._counted()
        total = (c.fwd_flops + c.bwd_flops) // 2
        return macs_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        total = model_params(self.model)
        return params_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds spent in the model's forward calls while profiling."""
        total = self._counted().stats[self.model].fwd_duration
        return duration_to_string(total) if as_string else total

    # ----- tables ----------------------------------------------------------------------------
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        """Print the summary, the top modules per depth and (``detailed``) the module tree.

        Args:
            profile_step: the step named in the summary when no engine timing is set.
            module_depth: deepest module level shown (-1: all).
            top_modules: module types listed per depth in the aggregated table.
            detailed: also print the module tree.
            output_file: write there (appending) instead of stdout.
        """
        p = self.profile()
        fwd_s = p.rows[0].fwd_duration if p.rows else 0.0
        lines = summary_lines(p, self.timing, profile_step, fwd_s)
        lines += aggregated_lines(p, module_depth, top_modules) + (detailed_lines(p, module_depth) if detailed else [])
        text = "\n".join(lines) + "\n"
        with _append(output_file) if output_file else nullcontext(sys.stdout) as out:
            out.write(text)
            out.flush()

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        print("\n".join(aggregated_lines(self.profile(), module_depth, top_modules)), flush=True)


def _append(output_file: str) -> Any:
    """``output_file`` opened for appending by ``safe_write``'s rule; its directory must exist.

    Raises:
        OSError: the directory is missing or refused (``UnsafePath``), the file is a link, a
            directory or not this user's; each names the path.
    """
    head, name = split_path(output_file)
    try:
        dir_fd = open_dir(head, create=False)
        try:
            return append_file(dir_fd, name)
        finally:
            os.close(dir_fd)
    except OSError as err:
        if err.filename in (None, name):  # the directory's own refusal names the directory
            err.filename = output_file
        raise


def get_model_profile(model: torch.nn.Module, input_shape: tuple[int, ...] | None = None, args: Sequence = (),
                      kwargs: dict | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one forward (or ``generate``) of ``model`` after ``warm_up`` unprofiled ones.

    Args:
        input_shape: builds the one positional input, an empty tensor of that shape in the model's
            dtype and device (DeepSpeed's way); else ``args`` / ``kwargs`` are the inputs.
        mode: ``"forward"`` calls ``model(...)``, ``"generate"`` calls ``model.generate(...)``.
        The others as ``FlopsProfiler.print_model_profile``; ``as_string`` formats the results.

    Returns:
        ``(flops, macs, params)`` of the profiled call.

    Raises:
        UsageError: a bad ``mode`` or ``input_shape``, or neither inputs nor a shape.
    """
    call = _model_call(model, mode)
    inputs = list(args)
    if input_shape is not None:
        inputs = [_empty_input(model, input_shape), *inputs]
    if not inputs and not kwargs:
        raise UsageError("get_model_profile: give input_shape=(batch, ...) or the inputs as args=[...] / kwargs={...}")
    for _ in range(warm_up):
        call(*inputs, **(kwargs or {}))
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        call(*inputs, **(kwargs or {}))
    finally:
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return flops_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params


def _model_call(model: torch.nn.Module, mode: str) -> Any:
    if mode == "forward":
        return model
    if mode == "generate":
        if not callable(getattr(model, "generate", None)):
            raise UsageError(f"get_model_profile(mode='generate'): {type(model).__name__} has no generate() method")
        return model.generate
    raise UsageError(f"get_model_profile(mode={mode!r}): use 'forward' or 'generate'")


def _empty_input(model: torch.nn.Module, shape: Any) -> torch.Tensor:
    if not isinstance(shape, (tuple, list)) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise UsageError(f"get_model_profile(input_shape={shape!r}): must be a tuple of positive ints, "
                         "e.g. (batch, features)")
    p = next(model.parameters(), None)
    dtype, device = (p.dtype, p.device) if p is not None else (torch.get_default_dtype(), "cpu")
    return torch.ones(()).new_empty(tuple(shape), dtype=dtype, device=device)
