"""DeepSpeed's ``deepspeed.runtime.zero.linear``: a linear layer written as one autograd Function.

DeepSpeed's ZeRO-3 swaps ``F.linear`` for ``zero3_linear_wrap`` (``zero.Init(mem_efficient_linear=
True)``) so that a released weight can be gathered again in backward. dslaunch's stage 3 needs no
swap: it gathers every partitioned Parameter a Function saved before that Function's backward runs
(``fetcher.py``), so ``nn.Linear`` and this layer train alike. The names are here for the scripts
and layers built on them (Megatron-style code calls ``LinearFunctionForZeroStage3.apply``); the
backward still gathers a weight that arrives released (a call outside an engine's hooks).

Autocast: the forward runs under whatever autocast is active (``torch.amp.custom_fwd`` semantics
without a cast), the backward under the forward's autocast state, as DeepSpeed's does.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from dslaunch.runtime.accelerator import get_accelerator
from dslaunch.runtime.utils import noop_decorator
from dslaunch.runtime.zero import params as zp

__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "zero3_linear_wrap",
           "autocast_custom_fwd", "autocast_custom_bwd", "noop_decorator"]


def _device_type() -> str:
    return get_accelerator().device_name()


# DeepSpeed's decorators for Functions of its own (torch >= 2.4: torch.amp's, bound to the device)
autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=_device_type())
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=_device_type())


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """``input @ weight.T + bias`` with its own backward (DeepSpeed's signature: ``apply(input,
    weight, bias=None)``); any number of leading dimensions, or a 1-D input."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        out = input.matmul(weight.t())
        if bias is not None:
            out += bias  # in place: under autocast the output keeps matmul's dtype, as DeepSpeed's
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        device = _device_type()
        # DeepSpeed's attribute names (its tests read them on the grad_fn)
        ctx._fwd_used_autocast, ctx._dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        input, weight = inputs[0], inputs[1]  # noqa: A001
        ctx.save_for_backward(input, weight, inputs[2] if len(inputs) > 2 else None)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors  # noqa: A001
        released = zp.is_partitioned(weight) and weight.ds_status is zp.ZeroParamStatus.NOT_AVAILABLE
        if released:
            zp.fetch([weight])
        try:
            with torch.autocast(device_type=_device_type(), enabled=ctx._fwd_used_autocast, dtype=ctx._dtype):
                return _linear_grads(ctx.needs_input_grad, grad_output, input, weight, bias)
        finally:
            if released:
                zp.release([weight])


def _linear_grads(needs: tuple[bool, ...], grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,  # noqa: A002
                  bias: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``input @ weight.T + bias`` for the inputs that need one (the rest None)."""
    grad_input = grad.matmul(weight) if needs[0] else None
    grad_weight = grad_bias = None
    if needs[1]:
        grad_weight = (torch.outer(grad, input) if grad.dim() == 1
                       else grad.reshape(-1, grad.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1])))
    if bias is not None and needs[2]:
        grad_bias = grad if grad.dim() == 1 else grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
    """``F.linear`` through ``LinearFunctionForZeroStage3`` (DeepSpeed's name)."""
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(nn.Module):
    """``nn.Linear`` (same parameters, initialisation and ``extra_repr``) whose forward is
    ``LinearFunctionForZeroStage3``."""

    __constants__ = ["in_features", "out_features"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return LinearFunctionForZeroStage3.apply(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
