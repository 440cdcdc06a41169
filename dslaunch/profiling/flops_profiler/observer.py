"""The ``flops_profiler`` block in the engine: an observer on the event seam (``runtime/events.py``).

During the optimizer step that starts with ``profile_step`` steps done, the ``forward`` and
``backward`` phases of every micro step are counted (``counter.FlopCounter``: backward measured,
recomputation included) and every phase is timed; after the step, rank 0 prints the summary (with
achieved FLOP/s and MFU, ``mfu.throughput``) and the module tables. Every rank counts, so with a
model-parallel group (``mpu=``: pipeline stages, tensor slices) the model's params and flops are
summed over it (collective: the engine adds this observer on every rank).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from dslaunch.profiling.flops_profiler.counter import warm_up
from dslaunch.profiling.flops_profiler.mfu import log, peak_flops, throughput
from dslaunch.profiling.flops_profiler.profiler import FlopsProfiler
from dslaunch.profiling.flops_profiler.report import StepTiming, number_to_string
from dslaunch.runtime.config.flops_profiler import FlopsProfilerConfig
from dslaunch.runtime.events import Observer, StepRecord
from dslaunch.safe_write import explain

__all__ = ["FlopsProfilerObserver", "tokens_in"]

_COUNTED = ("forward", "backward")


def tokens_in(args: Any, kwargs: Any) -> int | None:
    """Tokens in a language model's batch: the first 2-D integer tensor given (``input_ids``
    first), batch x sequence; None when there is none."""
    ids = kwargs.get("input_ids") if isinstance(kwargs, dict) else None
    flat, _ = tree_flatten((ids, args, kwargs))
    for t in flat:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() and not t.is_complex():
            return t.numel()
    return None


class FlopsProfilerObserver(Observer):
    """Profiles one optimizer step of ``engine`` as its ``flops_profiler`` block says."""

    def __init__(self, engine: Any, cfg: FlopsProfilerConfig):
        self.engine, self.cfg = engine, cfg
        self.profiler = FlopsProfiler(engine.module, engine, cfg.recompute_fwd_factor)
        self.profiler.prepare()
        self.phase_s: dict[str, float] = defaultdict(float)
        self._began: dict[str, float] = {}
        self._first: float | None = None
        self._micro = 0
        self._tokens: int | None = None
        self._input_hook: Any = None
        self.done = False
        self._step_flops: int | None = None
        self._sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
        # Paid here, not in the profiled step: the first torch profiler session's set-up (seconds) and
        # the CPU peak's measurement (~0.5 s, once per machine: cached).
        warm_up()
        self._peak = peak_flops(engine.device, engine.precision.model_dtype)

    def _profiling(self) -> bool:
        return not self.done and self.engine.global_steps == self.cfg.profile_step

    def phase_begin(self, name: str) -> None:
        if not self._profiling():
            return
        if self._first is None:
            if torch.autograd._profiler_enabled():
                self._skip()
                return
            self._start()
        if name == "forward":
            self._micro += 1
        if name in _COUNTED:
            assert self.profiler.counter is not None
            self.profiler.counter.resume()
        if self._sync is not None:
            self._sync()
        self._began[name] = time.perf_counter()

    def phase_end(self, name: str) -> None:
        if name not in self._began:
            return
        if self._sync is not None:
            self._sync()
        self.phase_s[name] += time.perf_counter() - self._began.pop(name)
        if name in _COUNTED:
            assert self.profiler.counter is not None
            self.profiler.counter.pause()

    def _start(self) -> None:
        self._first = time.perf_counter()
        self.profiler.start_profile()
        assert self.profiler.counter is not None
        self.profiler.counter.pause()  # counted only inside forward and backward
        self._input_hook = self.engine.module.register_forward_pre_hook(self._count_tokens, with_kwargs=True)

    def _skip(self) -> None:
        # The counter records through torch's profiler, one per process: a user's torch.profiler
        # running over this step wins, and the training goes on.
        log.warning("dslaunch flops profiler: torch.profiler is running at step %d; the flops profiler "
                    "records through it, so this step is not profiled (choose another profile_step)",
                    self.engine.global_steps)
        self.done = True
        if self.engine.mp_world_size > 1:
            self._model_sums(0, 0)  # the ranks that profile sum over the model-parallel group: take part

    def _count_tokens(self, module: Any, args: Any, kwargs: Any) -> None:
        n = tokens_in(args, kwargs)
        if n is not None:
            self._tokens = (self._tokens or 0) + n

    def on_step(self, record: StepRecord) -> None:
        if self._first is None or self.done:
            return
        iter_s = time.perf_counter() - self._first
        self.profiler.stop_profile()
        self._input_hook.remove()
        self.done = True
        timing = self._timing(record, iter_s)
        self.profiler.timing = timing
        if self.engine.global_rank == 0:
            self._print(record.step - 1)
        self.profiler.end_profile()

    def _print(self, step: int) -> None:
        """The tables to ``output_file``; one that cannot be written safely (a missing directory, a
        directory, a link, a full disk) is a warning and the tables go to stdout: training goes on."""
        args = (step, self.cfg.module_depth, self.cfg.top_modules, self.cfg.detailed)
        try:
            self.profiler.print_model_profile(*args, self.cfg.output_file)
            return
        except OSError as err:
            why = explain(err, self.cfg.output_file or "")
        log.warning("dslaunch flops profiler: cannot write flops_profiler.output_file %s; the profile "
                    "goes to stdout and training goes on", why)
        self.profiler.print_model_profile(*args, None)

    def step_flops(self) -> int | None:
        """This rank's forward + backward FLOPs of the profiled step, once it is done (else None)."""
        return self._step_flops

    def _timing(self, record: StepRecord, iter_s: float) -> StepTiming:
        e, p = self.engine, self.profiler.profile()
        flops = self._step_flops = p.fwd_flops + p.bwd_flops
        model_params, model_flops = self._model_sums(p.params, flops)
        tp = throughput(flops, iter_s, e.device, e.precision.model_dtype, self._peak)
        mfu = (f"{100 * tp.mfu:.2f}% of {number_to_string(tp.peak.flops)}FLOPS ({tp.peak.source})"
               if tp.mfu is not None and tp.peak is not None else "n/a (no peak known for this device)")
        tokens_per_s = self._tokens * e.dp_world_size / iter_s if self._tokens and iter_s > 0 else None
        return StepTiming(record.step - 1, e.world_size, e.dp_world_size, e.mp_world_size, self._micro,
                          e.train_micro_batch_size_per_gpu() * self._micro, self.phase_s["forward"],
                          self.phase_s["backward"], self.phase_s["allreduce"], self.phase_s["step"], iter_s,
                          model_params, model_flops, mfu, tokens_per_s)

    def _model_sums(self, params: int, flops: int) -> tuple[int, int]:
        """Params and flops of the whole model: summed over the model-parallel group (collective)."""
        if self.engine.mp_world_size <= 1:
            return params, flops
        both = torch.tensor([params, flops], dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(both, group=self.engine.grid.get_model_parallel_group())
        return int(both[0].item()), int(both[1].item())
