"""Flops counted at the aten operator level and attributed to the modules that ran them.

``FlopCounter(model)`` records while started with torch's own profiler (CPU activity, shapes
recorded): a C++ callback notes every aten operator this thread and autograd's threads run, with
its argument shapes, sequence number and nesting, ~1 us each. Forward pre/post hooks on every
submodule of ``model`` add a named marker to the same record. Nothing is counted during the step:
``stop()`` applies the formulas to the recorded shapes and replays the record in order.

- Which operators: the outermost counted operator of a nest (``addmm`` inside ``linear``; the
  backend kernel inside ``aten::convolution`` does not count again). So it sees the matmuls
  inside ``F.linear``, ``@``, ``einsum`` and ``bmm``, convolutions, ``scaled_dot_product_attention``
  (each backend's forward and backward operator), what autograd runs in backward, recomputation
  under activation checkpointing, and the aten operators a compiled graph calls.
- Backward: autograd runs each node inside an ``evaluate_function`` range carrying the node's
  sequence number, the number the forward operator that made the node recorded. A backward
  operator belongs to the modules that were running when its node was made (plus, during a
  recomputation, the modules whose forward runs again); it counts as backward.
- Forward: an operator belongs to the modules whose forward is running (between their markers).
  A module's count includes its children's (as DeepSpeed's tables); ``own`` counts are what ran
  in the module itself, so the ``own`` counts plus ``outside`` sum to the total.

- Routed work: a module with a ``flops_share`` (an MoE layer's ``Experts``: a callable, or None)
  runs more than its real work (every slot of every expert's capacity, empty ones too); each of
  its calls counts that share of its operators, forward and backward (the share is taken when
  the call begins and read after the step: no device sync in it).

Why not a ``TorchDispatchMode`` (the first version): every operator then paid ~13 us of Python
dispatch on this machine, more than a small model's operator itself; the profiler's callback is
C++, and the Python work is paid once, after the step (``count_s``).

The formulas (which operators count, from which shapes) are ``formulas.py``'s. An operator whose
formula fails (or that is known to be uncountable from shapes) counts 0 and is named once in a
warning (``uncounted``): the counting never raises into the step it profiles.

Limitations: operators run by other threads (a DataLoader worker, gloo's) are not seen; a
custom CUDA/Triton kernel that is not an aten operator counts nothing; operators whose flops need
tensor values (variable-length attention's cumulative lengths) count 0 (warned); torch's profiler must
not be running already (one profiler per process). When torch's non-reentrant checkpoint stops a
recomputation early inside a matmul that saves its inputs first, the module hooks see the stop
and that matmul is not counted; where the checkpointed code is a plain function, not a module,
nothing sees it and that one matmul counts.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint

from dslaunch.errors import UsageError
from dslaunch.runtime.profiling.formulas import ATTENTION_KERNELS, FORMULAS, Uncountable

__all__ = ["FlopCounter", "ModuleStats", "warm_up"]

log = logging.getLogger("dslaunch.profiling")

_MARK = "dslaunch.flops."
_BACKWARD_NODE = "autograd::engine::evaluate_function: "
# What torch's non-reentrant checkpoint raises to end a recomputation once the tensors backward
# needs are back: raised while an operator saves a tensor for backward (see ``_replay``).
_STOP = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)

try:  # a record-function range from Python at ~0.5 us (torch >= 2.2); else the public one
    from torch._C._profiler import _RecordFunctionFast as _marker
except ImportError:  # pragma: no cover - older torch
    from torch.autograd.profiler import record_function as _marker


@dataclass
class ModuleStats:
    """What one module did while counted (mutable: the counter adds to it)."""

    fwd_flops: int = 0
    bwd_flops: int = 0
    """Includes recomputation of its forward under activation checkpointing."""
    own_fwd_flops: int = 0
    own_bwd_flops: int = 0
    fwd_duration: float = 0.0
    """Seconds in its forward calls (a CUDA module's synchronised around each call)."""
    calls: int = 0
    ops: Counter = field(default_factory=Counter)
    """Operator name -> flops, its own operators only."""


@dataclass(frozen=True)
class _Context:
    """Where an operator ran: the modules running (each enclosing one too), the innermost, and
    whether an ignored module is among them."""

    modules: frozenset = frozenset()
    own: Any = None
    ignored: bool = False
    share: float = 1.0
    """The part of its operators' flops that counts (``flops_share`` of the modules running)."""

    def joined(self, node: _Context) -> _Context:
        """This forward context inside a backward node's (a recomputation), or the node's alone."""
        if not self.modules:
            return node
        share = self.share if self.share != 1.0 else node.share
        return _Context(self.modules | node.modules, self.own, self.ignored or node.ignored, share)


_NOWHERE = _Context()


@dataclass
class _Followed:
    """What the replay follows from one recorded stretch into the next (a reading while started
    splits the record): the modules in forward, innermost last; whether counting is paused; the
    context each autograd node was made in, by (thread, sequence number)."""

    forward: list = field(default_factory=list)
    counting: bool = True
    made: dict = field(default_factory=dict)
    shares: dict = field(default_factory=dict)
    """Module -> the share of its call now running (modules with a ``flops_share``)."""


def _session() -> Any:
    return torch.autograd.profiler.profile(record_shapes=True, use_device=None)


def warm_up() -> None:
    """Pay once, outside any timed step, what a process pays the first time torch's profiler
    starts (kineto's set-up, ~1.5 s on a busy 2-core machine). Afterwards ~1 ms."""
    if torch.autograd._profiler_enabled():
        return
    with _session():
        with _marker(_MARK + "warm_up"):
            torch.zeros(1).add_(1)


class FlopCounter:
    """Counts the flops of every operator run while started and gives them to ``model``'s modules.

    Args:
        model: the modules to attribute to (all of ``model.modules()``).
        ignore: module types whose operators (children's included, forward and backward) are not
            counted at all.
        sync: called around each module's forward for its time (``torch.cuda.synchronize`` on a
            GPU; None on a CPU).

    Use ``start()`` / ``stop()`` (``pause()`` / ``resume()`` between: operators then run are not
    counted, the modules are still followed); ``stats``, ``outside`` and ``ops`` hold the counts
    once stopped, ``count_s`` the seconds ``stop()`` took to count them.

    Raises:
        UsageError: from ``start()``, when torch's profiler is already running.
    """

    def __init__(self, model: torch.nn.Module, ignore: Iterable[type] = (),
                 sync: Callable[[], None] | None = None):
        self.model, self.ignore, self.sync = model, tuple(ignore), sync
        self.stats: dict[torch.nn.Module, ModuleStats] = {m: ModuleStats() for m in model.modules()}
        self.outside = [0, 0]
        """Flops (forward, backward) of operators run outside every module of ``model``."""
        self.ops: Counter = Counter()
        self.count_s = 0.0
        """Seconds spent in ``stop()`` turning the record into counts (paid after the step)."""
        self.uncounted: dict[str, str] = {}
        """Operators that ran but could not be counted (counted 0, warned once), with the reason."""
        self._starts: dict[torch.nn.Module, list[float]] = {}
        self._shares: dict[torch.nn.Module, deque] = {}  # per call of a module with a flops_share
        self._names: dict[torch.nn.Module, tuple[str, str]] = {}
        self._marks: dict[str, tuple[str, Any]] = {_MARK + k: (k, None) for k in ("pause", "resume", "stop")}
        for i, m in enumerate(self.stats):
            self._names[m] = (f"{_MARK}pre.{i}", f"{_MARK}post.{i}")
            self._marks[self._names[m][0]] = ("pre", m)
            self._marks[self._names[m][1]] = ("post", m)
        self._hooks: list[Any] = []
        self._session: Any = None
        self._counting = False
        self._followed = _Followed()

    # ----- lifecycle -----------------------------------------------------------------------
    def start(self) -> FlopCounter:
        if torch.autograd._profiler_enabled():
            raise UsageError("flops profiler: torch's profiler is already running in this process and "
                             "the flops profiler records through it; stop torch.profiler first, or "
                             "profile a step outside it")
        for m in self.stats:
            self._hooks.append(m.register_forward_pre_hook(self._pre))
            self._hooks.append(m.register_forward_hook(self._post, always_call=True))
        self._session = _session()
        self._session.__enter__()
        self._counting = True
        return self

    def pause(self) -> None:
        """Stop counting operators; the modules are still followed (a backward finds them)."""
        if self._session is not None and self._counting:
            self._mark(_MARK + "pause")
            self._counting = False

    def resume(self) -> None:
        if self._session is not None and not self._counting:
            self._mark(_MARK + "resume")
            self._counting = True

    def stop(self) -> None:
        """Stop recording and count what was recorded (``count_s``)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._count_recorded()

    def discard(self) -> None:
        """Stop recording and count nothing (the hooks go, torch's profiler session ends)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        session, self._session = self._session, None
        if session is not None:
            session.__exit__(None, None, None)

    def flush(self) -> None:
        """Count what was recorded so far and record on (DeepSpeed's readers may be called while
        started: its own example reads the totals between forward and backward)."""
        if self._session is not None:
            self._count_recorded()
            self._session = _session()
            self._session.__enter__()

    def _count_recorded(self) -> None:
        if self._session is None:
            return
        t0 = time.perf_counter()
        session, self._session = self._session, None
        session.__exit__(None, None, None)
        self._replay(session.kineto_results.events())
        self.count_s += time.perf_counter() - t0

    def reset(self) -> None:
        """Zero every count (the hooks stay)."""
        for m in self.stats:
            self.stats[m] = ModuleStats()
        self.outside = [0, 0]
        self.ops.clear()
        self.count_s = 0.0

    # ----- totals --------------------------------------------------------------------------
    @property
    def fwd_flops(self) -> int:
        return self.outside[0] + sum(s.own_fwd_flops for s in self.stats.values())

    @property
    def bwd_flops(self) -> int:
        return self.outside[1] + sum(s.own_bwd_flops for s in self.stats.values())

    # ----- module hooks (in the step: as little as possible) -------------------------------
    @staticmethod
    def _mark(name: str) -> None:
        with _marker(name):
            pass

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if self.sync is not None:
            self.sync()
        self._mark(self._names[module][0])
        self._starts.setdefault(module, []).append(time.perf_counter())
        share = getattr(module, "flops_share", None)
        if share is not None:
            self._shares.setdefault(module, deque()).append(share)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.sync is not None:
            self.sync()
        if output is None and _STOP is not None and isinstance(sys.exc_info()[1], _STOP):
            self._mark(_MARK + "stop")  # an always_call hook runs inside the forward's ``except``
        self._mark(self._names[module][1])
        s = self.stats[module]
        s.fwd_duration += time.perf_counter() - self._starts[module].pop()
        s.calls += 1

    # ----- after the step --------------------------------------------------------------------
    def _replay(self, events: Iterable[Any]) -> None:
        """Walk the record in the order operators began, following the modules' markers, and
        count each outermost counted operator where it ran."""
        f = self._followed
        here = self._context(f.forward)  # the context the modules in forward make
        open_: dict[int, list[tuple[int, _Context | None]]] = {}  # thread -> (end, node context | None: an op)
        latest: dict[int, int] = {}  # thread -> when its latest operator began
        last: dict[int, tuple[str, int, _Context, bool, int]] = {}  # thread -> its latest count (..., end)
        for e in sorted(events, key=lambda e: e.correlation_id()):
            name, thread, begin = e.name(), e.start_thread_id(), e.start_ns()
            mark = self._marks.get(name)
            if mark is not None:
                kind, module = mark
                if kind == "stop":
                    self._undo_unrun(last.pop(thread, None), latest.get(thread, 0))
                elif kind == "pause" or kind == "resume":
                    f.counting = kind == "resume"
                else:
                    if kind == "pre":
                        f.forward.append(module)
                        if self._shares.get(module):
                            f.shares[module] = float(self._shares[module].popleft()())
                    else:
                        _remove_last(f.forward, module)
                    here = self._context(f.forward)
                continue
            latest[thread] = begin
            formula = FORMULAS.get(name)
            node_begins = name.startswith(_BACKWARD_NODE)
            seq = e.sequence_nr()
            if formula is None and not node_begins and seq < 0:
                continue
            stack = open_.setdefault(thread, [])
            while stack and stack[-1][0] <= begin:
                stack.pop()
            node = next((c for _, c in reversed(stack) if c is not None), None)
            where = here if node is None else here.joined(node)
            if node_begins:
                stack.append((e.end_ns(), f.made.get((e.fwd_thread_id(), seq), _NOWHERE)))
                continue
            if seq >= 0:
                f.made[(thread, seq)] = where
            if formula is None or any(c is None for _, c in stack):
                continue  # not counted, or inside a counted operator
            end = e.end_ns()
            stack.append((end, None))
            if f.counting and not where.ignored:
                op, flops, backward = name, round(self._flops(name, formula, e) * where.share), node is not None
                self._add(op, flops, where, backward)
                last[thread] = (op, flops, where, backward, end)

    def _flops(self, name: str, formula: Callable[..., int], e: Any) -> int:
        """``formula`` on ``e``'s recorded arguments; an operator it cannot count counts 0, with one
        warning per operator (a profiled step must never fail on the counting)."""
        try:
            return int(formula(*_arguments(e)))
        except Exception as err:  # noqa: BLE001 - any formula's failure is the same to the step
            if name not in self.uncounted:
                why = str(err) if isinstance(err, Uncountable) else f"{type(err).__name__}: {err}"
                self.uncounted[name] = why
                log.warning("dslaunch flops profiler: %s not counted (%s); its flops are left out of the "
                            "totals", name, why.splitlines()[0] if why else "no reason given")
            return 0

    def _undo_unrun(self, count: tuple[str, int, _Context, bool, int] | None, latest: int) -> None:
        """A checkpoint's recomputation was stopped inside an operator. If it was the last counted
        one (nothing began after it ended) and saves its inputs before it runs (a matmul, a
        convolution: not an attention kernel, which saves its outputs last), it did not run."""
        if count is not None and count[4] >= latest and count[0] not in ATTENTION_KERNELS:
            op, flops, where, backward, _ = count
            self._add(op, -flops, where, backward)

    def _context(self, forward: list[torch.nn.Module]) -> _Context:
        if not forward:
            return _NOWHERE
        ignored = bool(self.ignore) and any(isinstance(m, self.ignore) for m in forward)
        share = math.prod(self._followed.shares.get(m, 1.0) for m in forward)
        return _Context(frozenset(forward), forward[-1], ignored, share)

    def _add(self, name: str, flops: int, where: _Context, backward: bool) -> None:
        op = name.replace("::", ".")
        self.ops[op] += flops
        if not self.ops[op]:
            del self.ops[op]
        if where.own is None:
            self.outside[backward] += flops
            return
        for m in where.modules:
            s = self.stats[m]
            if backward:
                s.bwd_flops += flops
            else:
                s.fwd_flops += flops
        st = self.stats[where.own]
        st.ops[op] += flops
        if not st.ops[op]:
            del st.ops[op]
        if backward:
            st.own_bwd_flops += flops
        else:
            st.own_fwd_flops += flops


def _arguments(e: Any) -> list[Any]:
    """A recorded operator's arguments: a tensor's shape, a scalar's value, None for None."""
    shapes = e.shapes()
    values = e.concrete_inputs() or [None] * len(shapes)  # none when torch records no values
    return [value if value is not None else (None if dtype == "" else shape)
            for shape, dtype, value in zip(shapes, e.dtypes(), values, strict=True)]


def _remove_last(stack: list, item: Any) -> None:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is item:
            del stack[i]
            return
