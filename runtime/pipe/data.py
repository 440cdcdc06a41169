"""What the pipeline engine does to the data it moves: micro batches to the stage's device, tuples
of what a stage passes on, outputs handed to the rank's own next chunk as a message would bring
them and the gradients that go back, the last stage's loss checked to be one number, outputs
concatenated."""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.errors import UsageError

__all__ = ["to_device", "as_tuple", "as_received", "input_grads", "scalar_loss", "concat"]


def to_device(data: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    if isinstance(data, torch.Tensor):
        cast = dtype if dtype is not None and data.is_floating_point() else data.dtype
        return data.to(device, cast).detach()
    if isinstance(data, tuple | list):
        return tuple(to_device(x, device, dtype) for x in data)
    return data


def as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def as_received(out: Any) -> Any:
    """``out`` as ``p2p.Receiver.recv`` would give it: detached leaves, those that carried a
    gradient asking for one (floating only), so that their ``.grad`` is what goes back."""
    if isinstance(out, tuple | list):
        return tuple(as_received(t) for t in out)
    return out.detach().requires_grad_(out.requires_grad and out.is_floating_point())


def input_grads(inputs: Any) -> tuple[torch.Tensor, ...]:
    """The gradients of the received inputs that ask for one, in order (zeros where none arrived)."""
    return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in as_tuple(inputs) if t.requires_grad)


def scalar_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UsageError(f"the last stage's loss must be a single-element tensor, got {what}: give the "
                         "PipelineModule a loss_fn that reduces (e.g. a mean)")
    return loss.detach().reshape(())


def concat(outputs: list[Any]) -> Any:
    if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
        return torch.cat(outputs)
    return outputs
