"""Selective recomputation (``activation_checkpointing.mode: "selective"``): keep the outputs of
matrix multiplications from the forward and recompute only the rest.

A matmul is most of a transformer block's compute but only a part of its saved activations;
element-wise ops, norms, activations and dropout are cheap to redo and hold most of the rest
(Megatron's "selective activation recomputation", torchtitan's op-level selective checkpointing).
``MatmulCache`` is a torch dispatch mode: below autograd, it sees every aten op. While recording
(the checkpointed forward) it keeps each matmul's output in call order; while replaying (the
recompute in backward) it hands back the kept output instead of multiplying again, so autograd
builds the same graph over the same values. Random ops are always recomputed (under the replayed
RNG state); an attention kernel is kept only when it draws no random numbers (dropout 0), so the
random stream of the recompute is the forward's.

Limitation: an op that modifies a kept output in place (``relu_`` on a matmul's result) would
make the kept value wrong; the replay checks the tensor's version counter and raises instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dslaunch.errors import UsageError

__all__ = ["MatmulCache", "KEPT_OPS"]

_aten = torch.ops.aten
# op -> position of its dropout probability (None: the op draws no random numbers)
KEPT_OPS: dict[Any, int | None] = {
    _aten.mm.default: None, _aten.addmm.default: None, _aten.bmm.default: None,
    _aten.baddbmm.default: None,
    _aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
    _aten._scaled_dot_product_flash_attention.default: 3,
    _aten._scaled_dot_product_efficient_attention.default: 5,
}


def _keeps(func: Any, args: tuple, kwargs: dict) -> bool:
    if func not in KEPT_OPS:
        return False
    at = KEPT_OPS[func]
    if at is None:
        return True
    p = kwargs.get("dropout_p", args[at] if len(args) > at else 0.0)
    return p == 0.0


class MatmulCache(TorchDispatchMode):
    """Record matmul outputs in call order (``recording``), then hand them back (``replaying``)."""

    def __init__(self) -> None:
        super().__init__()
        # (op, a detached alias of its output, the output itself, the output's versions then)
        self.kept: list[tuple[Any, Any, list[torch.Tensor], list[int]]] = []
        self.replaying = False
        self._next = 0

    def replay(self) -> MatmulCache:
        """Switch to replaying from the first kept output; returns self (enter it as a mode)."""
        self.replaying, self._next = True, 0
        return self

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, out, _, _ in self.kept for t in _tensors(out))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _keeps(func, args, kwargs):
            return func(*args, **kwargs)
        if not self.replaying:
            out = func(*args, **kwargs)
            # a detached alias: autograd gives ``out`` its forward history, the alias gets the
            # recompute's. Below autograd the alias has its own version counter: ``out`` (the
            # caller's tensor) keeps the count of in-place changes.
            outs = _tensors(out)
            self.kept.append((func, _detached(out), outs, [t._version for t in outs]))
            return out
        if self._next >= len(self.kept) or self.kept[self._next][0] is not func:
            raise UsageError("selective activation checkpointing: the recompute called another matmul "
                             f"than the forward ({func}); the checkpointed function must take the same "
                             "path both times, or use activation_checkpointing.mode \"full\"")
        _, out, originals, versions = self.kept[self._next]
        if [t._version for t in originals] != versions:
            raise UsageError(f"selective activation checkpointing: the output of {func} was modified in "
                             "place after the forward kept it; use activation_checkpointing.mode \"full\" "
                             "or an out-of-place op")
        self.kept[self._next] = (func, None, [], [])  # handed over: autograd owns it now
        self._next += 1
        return out


def _detached(out: Any) -> Any:
    if isinstance(out, (tuple, list)):
        return type(out)(t.detach() if isinstance(t, torch.Tensor) else t for t in out)
    return out.detach()


def _tensors(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]
