"""DeepSpeed 0.19's torch-style backward: ``loss.backward()`` on what ``engine(...)`` returned
trains as ``engine.backward(loss)`` would.

The engine's forward hands back each output tensor that requires grad through an identity
autograd node (same storage, no copy). In a backward the script started itself (not
``engine.backward``, which divides the loss already) that node divides the gradient by the
accumulation steps, as DeepSpeed 0.19.8's output hooks do, and queues the engine's backward
epilogue (stage 3 release, the gradient reductions) to run when autograd finishes; so gradients
read right after ``loss.backward()`` are the reduced ones, and ``step()`` follows. A node, not a
tensor hook: a gradient that reaches an output through another output (a model's ``loss`` computed
from its ``logits``, both returned) is divided once, where DeepSpeed's hooks on both divide twice;
an output returned twice is divided once too. With fp16 the loss must have been scaled first (``engine.scale(loss).backward()``), else
the backward ends with ``LossScalingRequiredError``, DeepSpeed's ``RuntimeError``.

Engines in a chain (``head(encoder(x))``): the head divides the gradient that reaches the
encoder's output, so the encoder's node leaves it (DeepSpeed 0.19.8 divides again there: the
encoder's gradients come out divided by the accumulation steps squared).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dslaunch.errors import LossScalingRequiredError, NotALossError

__all__ = ["PlainBackward"]

_OUTPUT = "_dsl_engine_output"  # on a tensor an engine's forward returned: its node's _Output
_MAX_DEPTH = 8  # nesting of tuples/lists/dicts searched for tensors in outputs and inputs


class _Output:
    """One output tensor's state; its node keeps it, not the tensor (which may be freed before
    backward while its graph lives on)."""

    __slots__ = ("consumed",)

    def __init__(self) -> None:
        self.consumed = False  # another engine's forward took it: that engine's node divides


class PlainBackward:
    """One engine's dividing nodes for a script's own backward.

    ``gas`` gives the accumulation steps now, ``epilogue`` completes a backward (the engine's
    ``_backward_epilogue``), ``needs_scaling`` says the loss must be scaled (fp16).
    """

    def __init__(self, gas: Callable[[], int], epilogue: Callable[[], None], needs_scaling: bool) -> None:
        self._gas, self._epilogue, self._needs_scaling = gas, epilogue, needs_scaling
        self._in_engine_backward = False
        self._queued = False
        self.scaled = False  # engine.scale(loss) since the last backward
        self.completed = False  # the last backward's epilogue ran from autograd's callback

    def begin_forward(self, inputs: Any) -> None:
        """Before a forward: mark the inputs that another engine's forward returned (that engine's
        node then leaves their gradient undivided: this one divides it)."""
        self.completed = False
        for t in _tensors(inputs):
            output = getattr(t, _OUTPUT, None)
            if output is not None:
                output.consumed = True

    def attach(self, outputs: Any) -> Any:
        """``outputs`` with each tensor that requires grad passed through the dividing node (tuples
        and lists rebuilt, dicts such as ``ModelOutput`` updated in place)."""
        return _map_tensors(outputs, self._through, {})

    def _through(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.requires_grad and t.grad_fn is not None):
            return t
        output = _Output()
        out = _DivideGrad.apply(t, self, output)
        setattr(out, _OUTPUT, output)
        return out

    def mark_scaled(self, loss: Any) -> None:
        """``engine.scale(loss)``: the next backward of the script's is loss-scaled.

        Raises:
            NotALossError: ``loss`` is not a one-element tensor with a graph (DeepSpeed asserts).
        """
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is not None):
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise NotALossError(f"engine.scale(loss): loss must be a scalar tensor with grad_fn, got {what}"
                                + (" without one" if isinstance(loss, torch.Tensor) and loss.numel() == 1 else "")
                                + "; for a non-scalar tensor use tensor.backward(grad)")
        self.scaled = True

    @contextlib.contextmanager
    def engine_backward(self) -> Iterator[None]:
        """``engine.backward``'s own pass: the loss is divided already, the engine ends it itself."""
        self._in_engine_backward, self.completed = True, False
        try:
            yield
        finally:
            self._in_engine_backward = False

    def take_completed(self) -> bool:
        """True once after a script's backward completed itself (an explicit ``_backward_epilogue()``
        afterwards, DeepSpeed's several-engines contract, then has nothing left to do)."""
        done, self.completed = self.completed, False
        return done

    def gradient(self, grad: torch.Tensor, output: _Output) -> torch.Tensor:
        """What the dividing node passes back for ``output``'s gradient."""
        if self._in_engine_backward:
            return grad
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        gas = self._gas()
        return grad if gas == 1 or output.consumed else grad / gas

    def finish_unhooked(self) -> None:
        """``step()`` after a backward that reached no hooked output (the script called
        ``engine.module`` itself): completed there, its gradients not divided."""
        self._finish()

    def _finish(self) -> None:
        self._queued = False
        scaled, self.scaled = self.scaled, False
        if self._needs_scaling and not scaled:
            raise LossScalingRequiredError(
                "Loss scaling is required for this configuration (fp16), but backward() was called directly "
                "on an unscaled loss: call engine.backward(loss), or engine.scale(loss).backward()")
        self._epilogue()
        self.completed = True


class _DivideGrad(torch.autograd.Function):
    """Identity forward (the tensor's storage, detached so later in-place use stays allowed);
    backward asks the engine what the gradient becomes."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, plain: PlainBackward, output: _Output) -> torch.Tensor:
        ctx.plain, ctx.output = plain, output
        return t.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.plain.gradient(grad, ctx.output), None, None


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor], seen: dict[int, torch.Tensor],
                 depth: int = 0) -> Any:
    """``value`` with ``fn`` applied to each tensor in it, once per tensor object (``seen``)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in seen:
            seen[id(value)] = fn(value)
        return seen[id(value)]
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, dict):
        for key in list(value):
            value[key] = _map_tensors(value[key], fn, seen, depth + 1)
        return value
    if isinstance(value, tuple | list):
        items = [_map_tensors(v, fn, seen, depth + 1) for v in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` through tuples, lists and dicts (Hugging Face's ``ModelOutput`` is one)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < _MAX_DEPTH and isinstance(value, tuple | list):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < _MAX_DEPTH and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)
