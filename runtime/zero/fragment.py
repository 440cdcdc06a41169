"""One trained parameter's piece of the ZeRO state on this rank, read and written where the next
step reads it: the fp32 master, the gradient and the optimizer state (``full_state.py`` and
``local_state.py``, DeepSpeed's ``safe_get/set_*``, are built on it).

A parameter the engine trains knows its slot (``_dsl_slot``: strategy, group, index). Its elements
are the range [a, b) of its group's flat vector; this rank holds [start, end) of that vector (all of
it at stage 0), so its fragment is [lo, hi), their intersection (empty on some ranks at stages 1-3;
at stage 3 it is ``param.ds_tensor``'s range).

``what`` names the state: ``PARAM`` the fp32 master, ``GRAD`` the averaged gradient (after backward,
before the step; still multiplied by the fp16 loss scale, as DeepSpeed's), any other string an
optimizer state key (``exp_avg``). The gradient is kept as the reduced sum: a value written is
divided by the averaging factor (exact for a power-of-two world), so the step sees it as DeepSpeed's.
All functions here are local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PARAM", "GRAD", "Fragment", "fragment_address", "locate", "rank_tensor", "read", "write"]

PARAM, GRAD = "param", "grad"


@dataclass(frozen=True)
class Fragment:
    """Where a parameter's elements are: ``[a, b)`` of group ``gi``'s vector, ``[lo, hi)`` here."""

    strategy: Any
    gi: int
    index: int
    a: int
    b: int
    lo: int
    hi: int

    @property
    def group(self) -> Any:
        return self.strategy.groups[self.gi]

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class fragment_address:  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's record of one parameter's piece of a rank's ZeRO-1/2 partition: ``numel``
    elements from ``start`` (its files pickle one per parameter in ``param_slice_mappings``)."""

    numel: int
    start: int


# DeepSpeed's qualified name: torch.serialization.add_safe_globals([fragment_address]) then allows
# DeepSpeed's files in torch.load(weights_only=True) (torch matches a class by module and name).
fragment_address.__module__ = "deepspeed.utils.tensor_fragment"


def locate(param: torch.nn.Parameter) -> Fragment | None:
    """The fragment of ``param`` (None: not trained by an engine, e.g. frozen)."""
    slot = getattr(param, "_dsl_slot", None)
    strategy = slot[0]() if slot is not None else None
    if strategy is None:
        return None
    lay = strategy.groups[slot[1]].layout
    a, b = lay.param_range(slot[2])
    lo = max(a, lay.start)
    return Fragment(strategy, slot[1], slot[2], a, b, lo, max(lo, min(b, lay.end)))


def rank_tensor(frag: Fragment, what: str) -> torch.Tensor | None:
    """This rank's [start, end) of group ``frag.gi``'s ``what`` (None: no such optimizer state).
    The live tensor, except an NVMe-swapped state (a copy read from the swap file)."""
    s, g = frag.strategy, frag.group
    if what == PARAM:
        return g.master.data
    if what == GRAD:
        return s.grad_shard(frag.gi)
    state = s.optimizer.state.get(g.master, {}).get(what)
    if state is None and s.offload is not None:  # NVMe: in the swap file
        state = s.offload.state_tensor(frag.gi, what)
    return state if torch.is_tensor(state) and state.numel() == g.master.numel() else None


def read(frag: Fragment, what: str) -> torch.Tensor | None:
    """This rank's fragment of ``what``: a new 1-D fp32 tensor of ``frag.numel`` elements."""
    t = rank_tensor(frag, what)
    if t is None:
        return None
    start = frag.group.layout.start
    out = t[frag.lo - start:frag.hi - start].to(torch.float32, copy=True)
    return out.mul_(frag.strategy.average_factor) if what == GRAD else out


def write(frag: Fragment, what: str, values: torch.Tensor) -> None:
    """Store ``values`` (``frag.numel`` elements) as this rank's fragment of ``what``.

    Raises:
        ValueError: the optimizer has no state ``what`` (yet: before the first step), or it lives
            split between device and host (``offload_optimizer.ratio`` < 1).
    """
    t = rank_tensor(frag, what)
    if t is None:
        raise ValueError(f"the optimizer has no state {what!r} for this parameter (keys exist after the "
                         f"first step; Adam's are 'exp_avg' and 'exp_avg_sq')")
    start = frag.group.layout.start
    src = values.detach().reshape(-1).float()
    t[frag.lo - start:frag.hi - start].copy_(src / frag.strategy.average_factor if what == GRAD else src)
    if what not in (PARAM, GRAD) and frag.strategy.optimizer.state.get(frag.group.master, {}).get(what) is not t:
        frag.strategy.offload.store_state(frag.gi, what, t)  # NVMe: write the copy back
