"""Flops counted at the aten operator level and attributed to the modules that ran them.

``FlopCounter(model)`` is a ``TorchDispatchMode``: while it is active every aten operator the
process runs on this thread passes through it, so it sees the matmuls inside ``F.linear``, ``@``,
``einsum`` and ``bmm``, convolutions, ``scaled_dot_product_attention`` (each backend's forward and
backward operator) and whatever autograd runs in backward, recomputation under activation
checkpointing included. An operator counts as backward while autograd's engine runs a graph task.

Which modules an operator belongs to: forward pre/post hooks on every submodule of ``model``
keep the modules whose forward is running; for backward, hooks on the gradients of a module's
outputs (its backward begins) and of its inputs (its backward ends) keep those whose backward is
running, cleared when the graph task ends (a module whose inputs need no gradient never sees its
end otherwise). A module's count includes its children's (as DeepSpeed's tables); ``own`` counts
are what ran in the module itself, so the ``own`` counts plus ``outside`` sum to the total.

The formulas: matmuls (mm, addmm, bmm, baddbmm) and the SDPA kernels' forward and backward (CPU
flash, CUDA flash/efficient/cudnn) computed here from the shapes; the rest from torch's registry
(``torch.utils.flop_counter.flop_registry``: _scaled_mm, convolutions and their backward, the
varlen and nested attention kernels). Only these count: element-wise operators (activations, norms, softmax, adds)
are not flops here, which is the convention MFU is defined on (PaLM, appendix B). Attention is
counted as full ``T x T`` even when causal (torch's and the 12·L·H·Q·T convention). One MAC is two
flops. Collectives and other operators pass through untouched.

Limitations: operators run by other threads (a DataLoader worker, gloo's) are not seen; a
custom CUDA/Triton kernel that is not an aten operator counts nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["FlopCounter", "ModuleStats", "FORMULAS", "warm_up"]

aten = torch.ops.aten


# The hot operators, from the tensors' shapes directly: torch's registered formulas walk every
# argument with pytree first, which cost more than the operator itself on a small model.
def _mm(a: Any, b: Any, *_: Any, **__: Any) -> int:
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _addmm(bias: Any, a: Any, b: Any, *_: Any, **__: Any) -> int:
    return _mm(a, b)


def _bmm(a: Any, b: Any, *_: Any, **__: Any) -> int:
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _baddbmm(bias: Any, a: Any, b: Any, *_: Any, **__: Any) -> int:
    return _bmm(a, b)


def _attention_sizes(q: Any, k: Any, v: Any) -> tuple[int, int, int]:
    """(batch x query heads x query length x key length, q/k head dim, v head dim); grouped
    key/value heads are broadcast to the query's, as the kernels do."""
    b, h, sq, dq = q.shape
    return b * h * sq * k.shape[-2], dq, v.shape[-1]


def _attention(q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
    n, dq, dv = _attention_sizes(q, k, v)
    return 2 * n * (dq + dv)  # Q·K^T, then P·V


def _attention_backward(grad_out: Any, q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
    n, dq, dv = _attention_sizes(q, k, v)
    # the kernel recomputes Q·K^T; dP = dO·V^T, dV = P^T·dO, dQ = dS·K, dK = dS^T·Q
    return 2 * n * (3 * dq + 2 * dv)


def _fast() -> dict[Any, Callable[..., int]]:
    fast: dict[Any, Callable[..., int]] = {aten.mm: _mm, aten.addmm: _addmm, aten.bmm: _bmm,
                                           aten.baddbmm: _baddbmm}
    for kernel in ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention"):
        for op, formula in ((f"_scaled_dot_product_{kernel}", _attention),
                            (f"_scaled_dot_product_{kernel}_backward", _attention_backward)):
            if hasattr(aten, op):  # the CPU flash kernels came with torch 2.2
                fast[getattr(aten, op)] = formula
    return fast


FORMULAS: dict[Any, Callable[..., int]] = {**flop_registry, **_fast()}
"""aten operator (overload packet) -> flops, called as ``f(*args, **kwargs, out_val=out)``."""


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


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # the common case, without pytree's walk
        return [value] if value.requires_grad else []
    flat, _ = tree_flatten(value)
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]


def _in_backward() -> bool:
    # What torch's ModuleTracker.is_bw reads: -1 unless autograd's engine runs a graph task here.
    return torch._C._current_graph_task_id() != -1


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def warm_up() -> None:
    """Pay once, outside any timed step, what a process pays the first time operators meet a
    Python dispatch mode: torch imports its decomposition machinery then (sympy, dynamo; ~5 s on a
    busy 2-core machine). Afterwards this costs microseconds."""
    with _PassThrough():
        torch.embedding(torch.zeros(2, 2), torch.zeros(1, dtype=torch.long))


class FlopCounter(TorchDispatchMode):
    """Counts the flops of every operator run while active and gives them to ``model``'s modules.

    Args:
        model: the modules to attribute to (all of ``model.modules()``).
        ignore: module types whose operators (children's included) are not counted at all.
        sync: called around each module's forward for its time (``torch.cuda.synchronize`` on a
            GPU; None on a CPU).

    Use ``start()`` / ``stop()`` (``pause()`` / ``resume()`` between: the hooks stay, operators are
    not seen); ``stats``, ``outside`` and ``ops`` hold the counts.
    """

    def __init__(self, model: torch.nn.Module, ignore: Iterable[type] = (),
                 sync: Callable[[], None] | None = None):
        super().__init__()
        self.model, self.ignore, self.sync = model, tuple(ignore), sync
        self.stats: dict[torch.nn.Module, ModuleStats] = {m: ModuleStats() for m in model.modules()}
        self.outside = [0, 0]
        """Flops (forward, backward) of operators run outside every module of ``model``."""
        self.ops: Counter = Counter()
        self._fwd: Counter = Counter()  # module -> forward calls running (a module may re-enter)
        self._bwd: Counter = Counter()  # module -> backward running
        self._starts: dict[torch.nn.Module, list[float]] = {}
        self._ignoring = 0
        self._innermost: list[torch.nn.Module] = []  # modules in forward, innermost last
        self._depth = {m: name.count(".") + (name != "") for name, m in model.named_modules()}
        self._bwd_by_task: dict[int, list[torch.nn.Module]] = {}
        self._hooks: list[Any] = []
        self._grad_hooks: list[Any] = []
        self._counting = False
        # id(operator overload) -> (formula, name) or None, looked up once per distinct operator:
        # an overload's hash, ``overloadpacket`` and ``str`` are Python-level, too dear per call.
        # (torch keeps every overload alive in its op namespaces, so an id is never reused.)
        self._formula_of: dict[int, tuple[Callable[..., int], str] | None] = {}

    # ----- lifecycle -----------------------------------------------------------------------
    def start(self) -> FlopCounter:
        warm_up()
        for m in self.stats:
            self._hooks.append(m.register_forward_pre_hook(self._pre))
            self._hooks.append(m.register_forward_hook(self._post, always_call=True))
        self.resume()
        return self

    def pause(self) -> None:
        """Stop seeing operators; the module hooks stay (a backward still finds its modules)."""
        if self._counting:
            self.__exit__(None, None, None)
            self._counting = False

    def resume(self) -> None:
        if not self._counting:
            self.__enter__()
            self._counting = True

    def stop(self) -> None:
        self.pause()
        for h in (*self._hooks, *self._grad_hooks):
            h.remove()
        self._hooks.clear()
        self._grad_hooks.clear()
        self._fwd.clear()
        self._bwd.clear()

    def reset(self) -> None:
        """Zero every count (the hooks stay)."""
        for m in self.stats:
            self.stats[m] = ModuleStats()
        self.outside = [0, 0]
        self.ops.clear()

    # ----- totals --------------------------------------------------------------------------
    @property
    def fwd_flops(self) -> int:
        return self.outside[0] + sum(s.own_fwd_flops for s in self.stats.values())

    @property
    def bwd_flops(self) -> int:
        return self.outside[1] + sum(s.own_bwd_flops for s in self.stats.values())

    # ----- operators -----------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            entry = self._formula_of[id(func)]
        except KeyError:
            entry = self._formula_of[id(func)] = _formula_entry(func)
        if entry is not None and not self._ignoring:
            self._add(entry[1], entry[0](*args, **kwargs, out_val=out))
        return out

    def _add(self, op: str, flops: int) -> None:
        backward = _in_backward()
        self.ops[op] += flops
        running = set(self._fwd) | set(self._bwd)
        if not running:
            self.outside[backward] += flops
            return
        for m in running:
            s = self.stats[m]
            if backward:
                s.bwd_flops += flops
            else:
                s.fwd_flops += flops
        own = self._own(running)
        st = self.stats[own]
        st.ops[op] += flops
        if backward:
            st.own_bwd_flops += flops
        else:
            st.own_fwd_flops += flops

    def _own(self, running: set[torch.nn.Module]) -> torch.nn.Module:
        # The innermost running module: the forward entered last, else (backward) the deepest.
        for m in reversed(self._innermost):
            if m in running:
                return m
        return max(running, key=lambda m: self._depth.get(m, 0))

    # ----- module hooks --------------------------------------------------------------------
    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self._fwd[module] += 1
        self._innermost.append(module)
        if isinstance(module, self.ignore):
            self._ignoring += 1
        if self.sync is not None:
            self.sync()
        self._starts.setdefault(module, []).append(time.perf_counter())
        inputs = _grad_tensors(args)
        if inputs and torch.is_grad_enabled():
            self._grad_hooks.append(register_multi_grad_hook(inputs, lambda _g, m=module: self._bwd_end(m)))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.sync is not None:
            self.sync()
        s = self.stats[module]
        s.fwd_duration += time.perf_counter() - self._starts[module].pop()
        s.calls += 1
        if isinstance(module, self.ignore):
            self._ignoring -= 1
        _remove_last(self._innermost, module)
        self._fwd[module] -= 1
        if not self._fwd[module]:
            del self._fwd[module]
        if torch.is_grad_enabled():
            # On the outputs' nodes, not the tensors: a tensor hook on the tensor backward starts
            # from (the loss the model returns) never fires.
            nodes = {t.grad_fn for t in _grad_tensors(output) if t.grad_fn is not None}
            for node in nodes:
                self._grad_hooks.append(node.register_prehook(lambda _g, m=module: self._bwd_begin(m)))

    def _bwd_begin(self, module: torch.nn.Module) -> None:
        self._bwd[module] += 1
        task = torch._C._current_graph_task_id()
        if task not in self._bwd_by_task:
            # At the graph task's end: modules whose inputs need no gradient never end otherwise.
            # Per task: reentrant checkpointing runs a nested backward inside the outer one.
            self._bwd_by_task[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._bwd_done(task))
        self._bwd_by_task[task].append(module)

    def _bwd_end(self, module: torch.nn.Module) -> None:
        if self._bwd[module] > 0:
            self._bwd[module] -= 1
        if not self._bwd[module]:
            del self._bwd[module]

    def _bwd_done(self, task: int) -> None:
        for module in self._bwd_by_task.pop(task, ()):
            self._bwd_end(module)


def _formula_entry(func: Any) -> tuple[Callable[..., int], str] | None:
    packet = func.overloadpacket
    formula = FORMULAS.get(packet)
    return None if formula is None else (formula, str(packet))


def _remove_last(stack: list, item: Any) -> None:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is item:
            del stack[i]
            return
