"""The ``flops_profiler`` block in the engine: an observer on the event seam (``runtime/events.py``).

During the optimizer step that starts with ``profile_step`` steps done, the ``forward`` and
``backward`` phases of every micro step are counted (``counter.FlopCounter``: backward measured,
recomputation included) and every phase is timed; after the step, rank 0 prints the summary (with
achieved FLOP/s and MFU, ``mfu.throughput``) and the module tables. Every rank counts, so with a
model-parallel group (``mpu=``: pipeline stages, tensor slices) the model's params and flops are
summed over it (collective: the engine adds this observer on every rank). Under sequence
parallelism each rank of a sequence group runs ``1/N`` of the sequence's tokens and ``1/N`` of its
attention heads over the whole sequence, so the model's flops are also summed over that group:
attention counts once per sequence (params are replicated there and are not); tokens/s counts the
tokens of every data and sequence rank.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from dslaunch.runtime.config.flops_profiler import FlopsProfilerConfig
from dslaunch.runtime.events import Observer, StepRecord
from dslaunch.runtime.profiling.counter import warm_up
from dslaunch.runtime.profiling.mfu import log, peak_flops, throughput
from dslaunch.runtime.profiling.profiler import FlopsProfiler
from dslaunch.runtime.profiling.report import Profile, StepTiming, number_to_string
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
        self._broken: str | None = None
        """Why profiling the step failed (warned once; training went on)."""
        self._step_flops: int | None = None
        self._sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
        # Paid here, not in the profiled step: the first torch profiler session's set-up (seconds) and
        # the CPU peak's measurement (~0.5 s, once per machine: cached).
        warm_up()
        self._peak = peak_flops(engine.device, engine.precision.model_dtype)

    def _profiling(self) -> bool:
        return not self.done and self._broken is None and self.engine.global_steps == self.cfg.profile_step

    # The step's hooks: whatever goes wrong in the profiling is one warning, never the user's step
    # (``_give_up``); the counting stops, and the step's end still takes part in the sums.
    def phase_begin(self, name: str) -> None:
        if self._profiling():
            self._guarded(self._phase_begin, name)

    def phase_end(self, name: str) -> None:
        if name in self._began:
            self._guarded(self._phase_end, name)

    def _guarded(self, hook: Callable[[str], None], name: str) -> None:
        try:
            hook(name)
        except Exception as err:  # noqa: BLE001 - see above
            self._give_up(err)

    def _phase_begin(self, name: str) -> None:
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

    def _phase_end(self, name: str) -> None:
        if self._sync is not None:
            self._sync()
        self.phase_s[name] += time.perf_counter() - self._began.pop(name)
        if name in _COUNTED:
            assert self.profiler.counter is not None
            self.profiler.counter.pause()

    def _start(self) -> None:
        self._first = time.perf_counter()
        self._input_hook = self.engine.module.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
        self.profiler.start_profile()
        assert self.profiler.counter is not None
        self.profiler.counter.pause()  # counted only inside forward and backward

    def _give_up(self, err: BaseException, keep_counts: bool = False) -> None:
        """One warning; the hooks and torch's profiler session end; training goes on. The counts
        are dropped unless ``keep_counts`` (only the report failed: ``last`` keeps them)."""
        if self._broken is None:
            self._broken = f"{type(err).__name__}: {err}".splitlines()[0]
            log.warning("dslaunch flops profiler: profiling step %d failed (%s); training goes on", self.cfg.profile_step, self._broken)
        self._began.clear()
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None
        if keep_counts:
            self.profiler.end_profile()
        else:
            self.profiler.discard()

    def _skip(self) -> None:
        # The counter records through torch's profiler, one per process: a user's torch.profiler
        # running over this step wins, and the training goes on.
        log.warning("dslaunch flops profiler: torch.profiler is running at step %d; the flops profiler "
                    "records through it, so this step is not profiled (choose another profile_step)",
                    self.engine.global_steps)
        self.done = True
        if self.engine.mp_world_size > 1 or self.engine.sequence_parallel_size > 1:
            self._model_sums(None)  # the ranks that profile sum over the model/sequence group: take part

    def _count_tokens(self, module: Any, args: Any, kwargs: Any) -> None:
        n = tokens_in(args, kwargs)
        if n is not None:
            self._tokens = (self._tokens or 0) + n

    def on_step(self, record: StepRecord) -> None:
        if self._first is None or self.done:
            return
        iter_s = time.perf_counter() - self._first
        self.done = True
        p = None
        if self._broken is None:
            try:
                self.profiler.stop_profile()
                p = self.profiler.profile()
            except Exception as err:  # noqa: BLE001 - see phase_begin
                self._give_up(err)
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None
        sums = self._model_sums(p)  # collective: also when this rank could not count
        if p is None:
            return
        try:
            self._report(record, p, iter_s, sums)
        except Exception as err:  # noqa: BLE001 - see phase_begin
            self._give_up(err, keep_counts=True)

    def _report(self, record: StepRecord, p: Profile, iter_s: float, sums: tuple[int, int, int, bool]) -> None:
        timing = self._timing(record, p, iter_s, sums)
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

    def _timing(self, record: StepRecord, p: Profile, iter_s: float, sums: tuple[int, int, int, bool]) -> StepTiming:
        e = self.engine
        flops = self._step_flops = p.fwd_flops + p.bwd_flops
        model_params, model_fwd, model_flops, complete = sums
        tp = throughput(flops, iter_s, e.device, e.precision.model_dtype, self._peak)
        mfu = (f"{100 * tp.mfu:.2f}% of {number_to_string(tp.peak.flops)}FLOPS ({tp.peak.source})"
               if tp.mfu is not None and tp.peak is not None else "n/a (no peak known for this device)")
        ranks = e.dp_world_size * e.sequence_parallel_size  # a sequence rank's tokens are its own
        tokens_per_s = self._tokens * ranks / iter_s if self._tokens and iter_s > 0 else None
        micro_batch = e.train_micro_batch_size_per_gpu()
        return StepTiming(record.step - 1, e.world_size, e.dp_world_size, e.mp_world_size, micro_batch, self._micro,
                          micro_batch * self._micro, self.phase_s["forward"], self.phase_s["backward"],
                          self.phase_s["allreduce"], self.phase_s["step"], iter_s, model_params, model_fwd,
                          model_flops, mfu, tokens_per_s, complete)

    def _model_sums(self, p: Profile | None) -> tuple[int, int, int, bool]:
        """Params, fwd flops and fwd+bwd flops of the whole model, summed over the model-parallel
        group (the flops also over the sequence group), and whether every rank counted (``p``
        None: this one did not).

        collective: every rank of the model-parallel and sequence groups, profiled or not.
        """
        e = self.engine
        mine = torch.tensor([0, 0, 0, 1] if p is None else [p.params, p.fwd_flops, p.fwd_flops + p.bwd_flops, 0],
                            dtype=torch.float64, device=e.device)
        if e.mp_world_size > 1:
            dist.all_reduce(mine, group=e.grid.get_model_parallel_group())
        if e.sequence_parallel_size > 1:
            flops = mine[1:].clone()
            dist.all_reduce(flops, group=e.seq_parallel_group)
            mine[1:] = flops
        return int(mine[0].item()), int(mine[1].item()), int(mine[2].item()), not mine[3].item()
