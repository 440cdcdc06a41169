"""Selective recomputation (``activation_checkpointing.mode: "selective"``): keep the outputs of
matrix multiplications and the dropout masks from the forward, recompute only the rest.

A matmul is most of a transformer block's compute but only a part of its saved activations;
element-wise ops, norms and activations are cheap to redo and hold most of the rest (Megatron's
"selective activation recomputation", torchtitan's op-level selective checkpointing). Dropout is
element-wise but drawing its mask is not cheap on a CPU (a random number per element: measured 15%
of a GPT block's forward + backward here), so its mask (1 byte an element) is kept and the
recompute applies it to the recomputed input (CUDA's fused ``native_dropout``; on a CPU dropout is
``bernoulli_`` into a buffer, then ``div_`` and ``mul``: the 0/1 draw is kept, the rest recomputed). ``MatmulCache`` is a torch dispatch mode: below
autograd, it sees every aten op. While recording (the checkpointed forward) it keeps each such
op's result in call order; while replaying (the recompute in backward) it hands them back instead
of computing again, so autograd builds the same graph over the same values.

Random numbers: a replayed dropout draws nothing, so the generator state the forward had after it
is kept too and set again in the replay: random ops that are recomputed (an attention kernel with
dropout) draw what they drew in the forward. The output a replayed dropout builds
(``input * mask * scale``) is compared with the real one in the forward; where a kernel computes it
otherwise (a bit apart), the whole output is kept instead, so results stay bit for bit.

Limitation: an op that modifies a kept output in place (``relu_`` on a matmul's result) would
make the kept value wrong; the replay checks the tensor's version counter and raises instead.
"""

from __future__ import annotations

from dataclasses import dataclass
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
_EFFICIENT_ATTENTION = _aten._scaled_dot_product_efficient_attention.default  # arg 4: compute_log_sumexp
_DROPOUT = _aten.native_dropout.default  # dropout on CUDA: one kernel, (output, mask)
_BERNOULLI = _aten.bernoulli_.float  # dropout on CPU: a 0/1 mask drawn in place, then div_ and mul


def _keeps(func: Any, args: tuple, kwargs: dict) -> bool:
    if func not in KEPT_OPS:
        return False
    at = KEPT_OPS[func]
    if at is None:
        return True
    p = kwargs.get("dropout_p", args[at] if len(args) > at else 0.0)
    return p == 0.0


def _is_dropout(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is _BERNOULLI:
        return True
    train = kwargs.get("train", args[2] if len(args) > 2 else None)
    return func is _DROPOUT and train is not False and 0.0 < args[1] < 1.0


@dataclass
class _Kept:
    """One kept result: ``out`` (a detached alias) or, for a dropout, ``mask`` and ``scale``."""

    func: Any
    out: Any = None
    originals: tuple[torch.Tensor, ...] = ()
    versions: tuple[int, ...] = ()
    mask: torch.Tensor | None = None
    scale: float = 1.0
    rng_after: torch.Tensor | None = None
    """The generator state after a random op (None: the op draws nothing)."""


class MatmulCache(TorchDispatchMode):
    """Record matmul outputs and dropout masks in call order, then hand them back (``replay``)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[_Kept | None] = []
        self.replaying = False
        self._next = 0

    def replay(self) -> MatmulCache:
        """Switch to replaying from the first kept result; returns self (enter it as a mode)."""
        self.replaying, self._next = True, 0
        return self

    def nbytes(self) -> int:
        held = [t for k in self.kept if k is not None for t in (*_tensors(k.out), k.mask) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        dropout = _is_dropout(func, args, kwargs)
        if not dropout and not _keeps(func, args, kwargs):
            return func(*args, **kwargs)
        if self.replaying:
            return self._replayed(func, args)
        out = func(*_with_log_sumexp(func, args), **kwargs)
        self.kept.append(_dropout_kept(func, args, out) if dropout else _output_kept(func, out))
        return out

    def _replayed(self, func: Any, args: tuple) -> Any:
        k = self.kept[self._next] if self._next < len(self.kept) else None
        if k is None or k.func is not func:
            raise UsageError("selective activation checkpointing: the recompute called another op than "
                             f"the forward ({func}); the checkpointed function must take the same path both "
                             "times, or use activation_checkpointing.mode \"full\"")
        if tuple(t._version for t in k.originals) != k.versions:
            raise UsageError(f"selective activation checkpointing: the output of {func} was modified in "
                             "place after the forward kept it; use activation_checkpointing.mode \"full\" "
                             "or an out-of-place op")
        self.kept[self._next] = None  # handed over: autograd owns it now
        self._next += 1
        if k.rng_after is not None:
            _set_rng(args[0].device, k.rng_after)
        if k.mask is None:
            return k.out
        if func is _BERNOULLI:
            return args[0].copy_(k.mask)
        return args[0].mul(k.mask).mul_(k.scale), k.mask


def _with_log_sumexp(func: Any, args: tuple) -> tuple:
    """The arguments with the memory-efficient attention's ``compute_log_sumexp`` set.

    A reentrant checkpoint's forward runs without grad, so SDPA asks this kernel for no log-sum-exp;
    the replay (with grad) needs it for the backward. Computing it in the forward is what a run
    without checkpointing does, and the output is the same.
    """
    if func is _EFFICIENT_ATTENTION and len(args) > 4 and not args[4]:
        return (*args[:4], True, *args[5:])
    return args


def _output_kept(func: Any, out: Any) -> _Kept:
    # A detached alias: autograd gives ``out`` its forward history, the alias gets the recompute's.
    # Below autograd the alias has its own version counter: ``out`` (the caller's tensor) keeps the
    # count of in-place changes.
    outs = _tensors(out)
    return _Kept(func, _detached(out), outs, tuple(t._version for t in outs))


def _dropout_kept(func: Any, args: tuple, out: Any) -> _Kept:
    rng = _get_rng(args[0].device)
    if func is _BERNOULLI:  # the drawn 0/1 values, exactly, in a byte each
        return _Kept(func, mask=out.to(torch.bool), rng_after=rng)
    output, mask = out
    scale = 1.0 / (1.0 - args[1])
    if torch.equal(args[0].mul(mask).mul_(scale), output):
        return _Kept(func, mask=mask.detach(), scale=scale, rng_after=rng)
    kept = _output_kept(func, out)  # this kernel rounds otherwise: keep the output itself
    kept.rng_after = rng
    return kept


def _get_rng(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _detached(out: Any) -> Any:
    if isinstance(out, (tuple, list)):
        return type(out)(t.detach() if isinstance(t, torch.Tensor) else t for t in out)
    return out.detach()


def _tensors(out: Any) -> tuple[torch.Tensor, ...]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(t for t in items if isinstance(t, torch.Tensor))
